"""The fault-injection lab: a small LLM serving stack on CPU with the real probes.

See ``docs/lab.md`` for the contract between the engine, the fault injectors and
the benchmark. Everything here imports torch lazily from the submodules; this
package module itself stays light.
"""

from __future__ import annotations

__all__ = ["LabConfig", "LabEngine", "LabRequest", "LabResult"]


def __getattr__(name: str) -> object:
    if name == "LabConfig":
        from rca.lab.model import LabConfig

        return LabConfig
    if name in ("LabEngine", "LabRequest", "LabResult"):
        from rca.lab import engine

        return getattr(engine, name)
    raise AttributeError(name)
