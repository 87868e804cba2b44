"""LoRA adapters: files, hot loading with vLLM's validation wording, and the
per-row deltas of a batched forward.

An adapter file is a torch file holding ``{"rank": r, "alpha": a,
"target_modules": ["q_proj", "v_proj"], "weights": {"layers.0.self_attn.q_proj":
(A [r, in], B [out, r]), ...}}`` (a bare module name such as ``"q_proj"`` applies
to every layer); the delta of a module is ``x @ A.T @ B.T * alpha / r``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "Adapter",
    "LoraManager",
    "LoraLoadError",
    "SUPPORTED_MODULES",
    "save_adapter",
    "random_adapter",
]

SUPPORTED_MODULES = ("q_proj", "v_proj")
_NAME = re.compile(r"^layers\.(\d+)\.self_attn\.(\w+)$")


class LoraLoadError(ValueError):
    """An adapter that cannot be loaded; the message is vLLM's."""


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def save_adapter(
    path: str | Path,
    *,
    rank: int,
    alpha: float,
    target_modules: list[str],
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> Path:
    path = Path(path)
    torch.save(
        {"rank": rank, "alpha": alpha, "target_modules": target_modules, "weights": weights}, path
    )
    return path


def random_adapter(
    model: nn.Module,
    path: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    target_modules: tuple[str, ...] = SUPPORTED_MODULES,
    scale: float = 0.5,
) -> Path:
    """Write a random adapter for ``model`` (tests, demos and faults)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i, layer in enumerate(model.layers):  # type: ignore[attr-defined]
        for mod in target_modules:
            lin = getattr(layer.self_attn, mod)
            a = torch.randn(rank, lin.in_features, generator=g) * scale
            b = torch.randn(lin.out_features, rank, generator=g) * scale / rank
            weights[f"layers.{i}.self_attn.{mod}"] = (a, b)
    return save_adapter(
        path, rank=rank, alpha=alpha, target_modules=list(target_modules), weights=weights
    )


class _Context:
    def __init__(self, rows: dict[str, tuple[Adapter, torch.Tensor]]) -> None:
        self.rows = rows

    def delta(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor | None:
        out: torch.Tensor | None = None
        for adapter, idx in self.rows.values():
            w = adapter.weights.get((layer, module))
            if w is None:
                continue
            a, b = w
            d = (x[idx] @ a.T) @ b.T * adapter.scale
            if out is None:
                out = torch.zeros(*x.shape[:-1], b.shape[0], dtype=x.dtype)
            out[idx] = d.to(x.dtype)
        return out


class LoraManager:
    """Loaded adapters by name; ``load`` validates and hot-swaps them in."""

    def __init__(self, model: nn.Module, *, max_loras: int, max_lora_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, Adapter] = {}
        self.errors = 0

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def names(self) -> list[str]:
        return list(self.adapters)

    def load(self, name: str, path: str | Path) -> Adapter:
        try:
            adapter = self._read(name, str(path))
        except LoraLoadError:
            self.errors += 1
            raise
        if name not in self.adapters and len(self.adapters) >= self.max_loras:
            self.errors += 1
            raise LoraLoadError(
                f"Loading lora {name} failed: max_loras={self.max_loras} adapters are "
                "already loaded"
            )
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None

    def _read(self, name: str, path: str) -> Adapter:
        if self.max_loras <= 0:
            raise LoraLoadError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        try:
            data: Any = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            raise LoraLoadError(
                f"Loading lora {name} failed: No adapter found for {path}"
            ) from None
        if not isinstance(data, dict) or not {"rank", "weights"} <= set(data):
            raise LoraLoadError(f"Loading lora {name} failed: No adapter found for {path}")
        rank = int(data["rank"])
        if rank > self.max_lora_rank:
            raise LoraLoadError(
                f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}."
            )
        if rank < 1:
            raise LoraLoadError(f"Loading lora {name} failed: rank must be >= 1, got {rank}")
        weights_in = dict(data["weights"])
        received = list(
            data.get("target_modules") or sorted({k.rsplit(".", 1)[-1] for k in weights_in})
        )
        extra = sorted({k.rsplit(".", 1)[-1] for k in weights_in} - set(received))
        if any(t not in SUPPORTED_MODULES for t in received) or extra:
            raise LoraLoadError(
                f"While loading {path}, expected target modules in {list(SUPPORTED_MODULES)} "
                f"but received {received + extra}. "
                "Please verify that the loaded LoRA module is correct"
            )
        layers = self.model.layers  # type: ignore[attr-defined]
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for key, pair in weights_in.items():
            if key in SUPPORTED_MODULES:  # a bare module name: every layer
                where = [(i, key) for i in range(len(layers))]
            else:
                m = _NAME.match(key)
                if m is None or int(m[1]) >= len(layers):
                    raise LoraLoadError(
                        f"Loading lora {name} failed: unexpected module {key!r} in {path}"
                    )
                where = [(int(m[1]), m[2])]
            a, b = (torch.as_tensor(t, dtype=torch.float32) for t in pair)
            for i, mod in where:
                lin = getattr(layers[i].self_attn, mod)
                want_a, want_b = (rank, lin.in_features), (lin.out_features, rank)
                if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                    raise LoraLoadError(
                        f"Loading lora {name} failed: size mismatch for {key}: expected "
                        f"lora_A {list(want_a)} and lora_B {list(want_b)}, got "
                        f"{list(a.shape)} and {list(b.shape)}"
                    )
                weights[(i, mod)] = (a, b)
        targets = received
        alpha = float(data.get("alpha", rank))
        return Adapter(name, path, rank, alpha, tuple(targets), weights)

    def context(self, names: list[str | None]) -> _Context | None:
        """Per-row deltas for a batch whose row i uses adapter ``names[i]``."""
        groups: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            if n is not None and n in self.adapters:
                groups.setdefault(n, []).append(i)
        if not groups:
            return None
        return _Context({n: (self.adapters[n], torch.tensor(ix)) for n, ix in groups.items()})
