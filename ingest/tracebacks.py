"""Python tracebacks in logs: whole chains, and the deepest cause.

Handles tracebacks printed bare or behind a log prefix on every line (vLLM's
``ERROR 11-29 10:14:03 async_llm_engine.py:61] ``, ``(EngineCore_DP0
pid=1394) ERROR ... [core.py:1006] ``, ``[rank0]: ``, syslog), and chains
joined by ``The above exception was the direct cause of the following
exception:`` or ``During handling of the above exception, another exception
occurred:``. In a chain the first exception printed is the deepest cause.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ExceptionInfo",
    "Traceback",
    "find_tracebacks",
    "frame_location",
    "raised_at",
    "strip_prefix",
]

_PREFIXES = (
    re.compile(r"^\(\w+ pid=\d+\) "),
    re.compile(
        r"^(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
        r"(?:\[[^\]]+\]|[\w./-]+:\d+\]) ?"
    ),
    re.compile(r"^\[rank\d+\]:\s?"),
    re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+"),
    re.compile(r"^[A-Z][a-z]{2} +\d+ \d\d:\d\d:\d\d(?:\.\d+)? \S+ [\w./-]+(?:\[\d+\])?: ?"),
    re.compile(
        r"^\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)? +"
        r"(?:\w+ +)?(?:[\w.]+: ?)?"
    ),
)
_START = "Traceback (most recent call last):"
_CHAIN = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
_EXC = re.compile(
    r"^(?P<type>(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Warning|"
    r"Dead\w*|Fault|Timeout|Abort\w*|Failure|Failed))(?::\s?(?P<msg>.*))?$"
)


def strip_prefix(line: str) -> str:
    """The line without the log prefixes known above (applied repeatedly)."""
    changed = True
    while changed:
        changed = False
        for rx in _PREFIXES:
            m = rx.match(line)
            if m and m.end() > 0:
                line = line[m.end() :]
                changed = True
    return line


@dataclass(frozen=True, slots=True)
class ExceptionInfo:
    type: str
    message: str
    line: int  # index of the exception line in the input sequence
    raised_at: str | None = None  # innermost frame: "vllm/lora/models.py:123 in f"

    @property
    def text(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


@dataclass
class Traceback:
    start: int  # index of the first "Traceback ..." line
    end: int  # index of the last line that belongs to the chain
    exceptions: list[ExceptionInfo] = field(default_factory=list)
    complete: bool = True  # False if the input ended inside it

    @property
    def deepest(self) -> ExceptionInfo | None:
        return self.exceptions[0] if self.exceptions else None

    @property
    def final(self) -> ExceptionInfo | None:
        return self.exceptions[-1] if self.exceptions else None

    def to_dict(self) -> dict[str, object]:
        return {
            "start": self.start,
            "end": self.end,
            "chain": [
                {"type": e.type, "message": e.message, "line": e.line, "raised_at": e.raised_at}
                for e in self.exceptions
            ],
        }


def find_tracebacks(lines: Sequence[str]) -> list[Traceback]:
    """Every traceback chain in ``lines`` (indices are positions in ``lines``)."""
    out: list[Traceback] = []
    i, n = 0, len(lines)
    while i < n:
        if _START not in lines[i]:
            i += 1
            continue
        tb = Traceback(start=i, end=i)
        i = _parse_chain(lines, i, tb)
        out.append(tb)
    return out


_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>\S+))?')
#: where a package's own path starts: what is before it says where Python is
#: installed (and may name a user), not where the code is
_PKG_ROOT = re.compile(r"^.*?[\\/](?:site|dist)-packages[\\/]")
_HOME = re.compile(r"^.*?[\\/](?:home|Users)[\\/][^\\/]+[\\/]|^.*?[\\/]root[\\/]")


def frame_location(path: str, line: str, func: str | None) -> str:
    """``vllm/lora/models.py:123 in activate_adapter``: the path from the
    package root (site-/dist-packages), else its last three parts."""
    short = _PKG_ROOT.sub("", path)
    if short == path:  # not an installed package: no home folder, the last three parts
        short = "/".join(_HOME.sub("", path).replace("\\", "/").split("/")[-3:])
    return f"{short}:{line}" + (f" in {func}" if func else "")


def raised_at(attrs: str | dict[str, Any] | None) -> str | None:
    """A log record's exception frame (``attrs.traceback.raised_at``) from its
    attrs, a dict or the stored JSON text; None when it has none."""
    if isinstance(attrs, str):
        try:
            attrs = json.loads(attrs)
        except ValueError:
            return None
    tb = attrs.get("traceback") if isinstance(attrs, dict) else None
    where = tb.get("raised_at") if isinstance(tb, dict) else None
    return where if isinstance(where, str) else None


def _parse_chain(lines: Sequence[str], i: int, tb: Traceback) -> int:
    n = len(lines)
    while True:
        # i is at a "Traceback (most recent call last):" line
        i += 1
        exc: ExceptionInfo | None = None
        frame: str | None = None
        while i < n:
            body = strip_prefix(lines[i].rstrip("\r\n"))
            if exc is None and (f := _FRAME.match(body)):
                frame = frame_location(f["path"], f["line"], f["func"])
            if body.startswith((" ", "\t")) or not body.strip():
                if exc is not None and not body.strip():
                    break  # a blank line ends the exception message
                i += 1
                continue
            if body.startswith(_START) or body in _CHAIN:
                break
            m = _EXC.match(body)
            if m and exc is None:
                exc = ExceptionInfo(m["type"], (m["msg"] or "").strip(), i, frame)
                tb.exceptions.append(exc)
                tb.end = i
                i += 1
                continue
            if exc is not None:
                # message continuation (CUDA's "CUDA kernel errors might be ...")
                if _looks_like_new_log_line(lines[i]):
                    break
                tb.end = i
                i += 1
                continue
            i += 1  # a frame detail we do not model (e.g. "^^^^" markers)
        if i >= n:
            tb.complete = exc is not None
            return i
        # look ahead for a chain separator followed by another traceback
        j = i
        while j < n and not strip_prefix(lines[j]).strip():
            j += 1
        if j < n and strip_prefix(lines[j]).strip() in _CHAIN:
            k = j + 1
            while k < n and _START not in lines[k]:
                if strip_prefix(lines[k]).strip():
                    break
                k += 1
            if k < n and _START in lines[k]:
                i = k
                continue
        return i


def _looks_like_new_log_line(line: str) -> bool:
    return strip_prefix(line) != line and not line.startswith("[rank")
