"""The error-code catalog: one TOML data file, loaded and validated here.

>>> cat = load_catalog()
>>> cat["GPU_XID_48"].layer
1
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

from graph.errors import CatalogError

__all__ = [
    "Layer",
    "Stage",
    "Trigger",
    "Recoverability",
    "Severity",
    "FAMILIES",
    "LAYER_NAMES",
    "Edge",
    "Code",
    "Catalog",
    "load_catalog",
    "default_catalog",
    "DEFAULT_CATALOG_PATH",
]

DEFAULT_CATALOG_PATH = Path(__file__).with_name("catalog.toml")


class Stage(StrEnum):
    PRE_LOAD = "pre_load"
    TOKENIZATION = "tokenization"
    PREFILL = "prefill"
    DECODE = "decode"
    KV_CACHE = "kv_cache"
    POST_PROCESS = "post_process"
    TRANSPORT = "transport"


class Trigger(StrEnum):
    USER_INPUT = "user_input"
    SCHEDULER = "scheduler"
    ENGINE = "engine"
    HARDWARE_DRIVER = "hardware_driver"


class Recoverability(StrEnum):
    TRANSIENT = "transient"
    STATE_POLLUTION = "state_pollution"
    IRREVERSIBLE = "irreversible"


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2, Severity.CRITICAL: 3}

LAYER_NAMES = {
    1: "hardware interrupt",
    2: "driver/runtime",
    3: "interconnect/collective",
    4: "memory/resource",
    5: "engine/scheduler",
    6: "model/operator",
    7: "API/semantic",
}
Layer = int

FAMILIES: tuple[str, ...] = (
    "gpu_hardware",
    "interconnect",
    "driver_runtime",
    "illegal_memory_access",
    "gpu_oom",
    "kv_cache_capacity",
    "kv_cache_integrity",
    "numerical",
    "attention_position",
    "tokenizer",
    "model_loading",
    "compile_graph",
    "scheduler",
    "speculative_decoding",
    "lora_adapter",
    "request_validation",
    "overload",
    "timeout",
    "host_resource",
    "network",
    "config",
    "engine_crash",
)

_NAME_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_UNPORTABLE_RE = re.compile(r"\(\?[=!<]|\(\?<[=!]|\\[1-9]|\(\?P=")


@dataclass(frozen=True, slots=True)
class Edge:
    code: str
    strength: float


@dataclass(frozen=True, slots=True)
class Code:
    name: str
    id: int
    layer: int
    stage: Stage
    trigger: Trigger
    recoverability: Recoverability
    family: str
    severity: Severity
    summary: str
    action: str
    grounding: str
    detectors: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    causes: tuple[Edge, ...] = ()
    #: codes this code beats when patterns of both match one line (declared
    #: precedence, before the longest-span rule; ``ingest.classify.pick_match``)
    wins_over: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.name,
            "id": self.id,
            "layer": self.layer,
            "layer_name": LAYER_NAMES[self.layer],
            "stage": str(self.stage),
            "trigger": str(self.trigger),
            "recoverability": str(self.recoverability),
            "family": self.family,
            "severity": str(self.severity),
            "summary": self.summary,
            "action": self.action,
            "grounding": self.grounding,
            "detectors": list(self.detectors),
            "patterns": list(self.patterns),
            "examples": list(self.examples),
            "causes": [{"code": e.code, "strength": e.strength} for e in self.causes],
            "wins_over": list(self.wins_over),
        }


@dataclass(frozen=True)
class Catalog:
    version: int
    path: str
    codes: tuple[Code, ...]
    _by_name: dict[str, Code] = field(repr=False, default_factory=dict)
    _by_id: dict[int, Code] = field(repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._by_name.update({c.name: c for c in self.codes})
        self._by_id.update({c.id: c for c in self.codes})

    def __getitem__(self, name: str) -> Code:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.codes)

    def __len__(self) -> int:
        return len(self.codes)

    def get(self, name: str) -> Code | None:
        return self._by_name.get(name)

    def by_id(self, code_id: int) -> Code | None:
        return self._by_id.get(code_id)

    def select(self, *, layer: int | None = None, family: str | None = None) -> list[Code]:
        return [
            c
            for c in self.codes
            if (layer is None or c.layer == layer) and (family is None or c.family == family)
        ]


_REQUIRED = (
    "name",
    "id",
    "layer",
    "stage",
    "trigger",
    "recoverability",
    "family",
    "severity",
    "summary",
    "action",
    "grounding",
)
_ENUMS: dict[str, type[StrEnum]] = {
    "stage": Stage,
    "trigger": Trigger,
    "recoverability": Recoverability,
    "severity": Severity,
}
_KNOWN = set(_REQUIRED) | {"detectors", "patterns", "examples", "causes", "wins_over"}


def _str_list(entry: dict[str, Any], key: str, where: str, problems: list[str]) -> tuple[str, ...]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"{where}: '{key}' must be a list of strings")
        return ()
    return tuple(value)


def parse_catalog(data: dict[str, Any], path: str, *, check_patterns: bool = True) -> Catalog:
    """Validate a parsed TOML document; raise CatalogError listing every problem."""
    problems: list[str] = []
    entries = data.get("code")
    if not isinstance(entries, list) or not entries:
        raise CatalogError(path, ["no [[code]] entries"])
    codes: list[Code] = []
    names: dict[str, int] = {}
    ids: dict[int, str] = {}
    for i, entry in enumerate(entries):
        where = f"code #{i + 1} ({entry.get('name', '?')})"
        missing = [k for k in _REQUIRED if k not in entry]
        if missing:
            problems.append(f"{where}: missing field(s) {', '.join(missing)}")
            continue
        unknown = sorted(set(entry) - _KNOWN)
        if unknown:
            problems.append(f"{where}: unknown field(s) {', '.join(unknown)}")
        name = entry["name"]
        if not isinstance(name, str) or not _NAME_RE.match(name):
            problems.append(f"{where}: name must be UPPER_SNAKE_CASE")
            continue
        if name in names:
            problems.append(f"{where}: duplicate name {name} (also code #{names[name]})")
        names.setdefault(name, i + 1)
        cid, layer = entry["id"], entry["layer"]
        if not isinstance(layer, int) or layer not in LAYER_NAMES:
            problems.append(f"{where}: layer {layer!r} is not one of 1..7")
            continue
        if not isinstance(cid, int) or cid // 1000 != layer:
            problems.append(f"{where}: id {cid!r} must be an int with id // 1000 == layer {layer}")
        elif cid in ids:
            problems.append(f"{where}: duplicate id {cid} (also {ids[cid]})")
        else:
            ids[cid] = name
        enums: dict[str, Any] = {}
        for key, enum in _ENUMS.items():
            try:
                enums[key] = enum(entry[key])
            except ValueError:
                allowed = ", ".join(e.value for e in enum)
                problems.append(f"{where}: {key} {entry[key]!r} is not one of {allowed}")
        if entry["family"] not in FAMILIES:
            problems.append(f"{where}: unknown family {entry['family']!r}")
        for key in ("summary", "action", "grounding"):
            if not isinstance(entry[key], str) or not entry[key].strip():
                problems.append(f"{where}: '{key}' must be a non-empty string")
        detectors = _str_list(entry, "detectors", where, problems)
        patterns = _str_list(entry, "patterns", where, problems)
        examples = _str_list(entry, "examples", where, problems)
        wins_over = _str_list(entry, "wins_over", where, problems)
        if not detectors and not patterns:
            problems.append(f"{where}: needs at least one pattern or detector")
        if check_patterns:
            for pat in patterns:
                if _UNPORTABLE_RE.search(pat):
                    problems.append(f"{where}: pattern {pat!r} uses look-around or back-references")
                    continue
                try:
                    rx = re.compile(pat)
                except re.error as exc:
                    problems.append(f"{where}: pattern {pat!r} does not compile: {exc}")
                    continue
                if not any(rx.search(ex) for ex in examples):
                    problems.append(f"{where}: pattern {pat!r} matches none of its examples")
        edges: list[Edge] = []
        raw_causes = entry.get("causes", [])
        if not isinstance(raw_causes, list):
            problems.append(f"{where}: 'causes' must be a list of {{code, strength}} tables")
            raw_causes = []
        for edge in raw_causes:
            if not isinstance(edge, dict) or set(edge) != {"code", "strength"}:
                problems.append(f"{where}: each cause needs exactly 'code' and 'strength'")
                continue
            s = edge["strength"]
            if not isinstance(s, int | float) or not 0 < s <= 1:
                problems.append(
                    f"{where}: edge to {edge['code']} has strength {s!r}, not in (0, 1]"
                )
                continue
            if edge["code"] == name:
                problems.append(f"{where}: edge to itself")
                continue
            edges.append(Edge(edge["code"], float(s)))
        if len(enums) == len(_ENUMS):
            codes.append(
                Code(
                    name=name,
                    id=cid,
                    layer=layer,
                    family=entry["family"],
                    summary=entry["summary"],
                    action=entry["action"],
                    grounding=entry["grounding"],
                    detectors=detectors,
                    patterns=patterns,
                    examples=examples,
                    causes=tuple(edges),
                    wins_over=wins_over,
                    **enums,
                )
            )
    known = {c.name for c in codes} | set(names)
    by_name = {c.name: c for c in codes}
    for code in codes:
        seen: set[str] = set()
        for edge in code.causes:
            if edge.code not in known:
                problems.append(f"code {code.name}: edge to unknown code {edge.code}")
            if edge.code in seen:
                problems.append(f"code {code.name}: duplicate edge to {edge.code}")
            seen.add(edge.code)
        for other in code.wins_over:
            if other == code.name or other not in known:
                problems.append(f"code {code.name}: wins_over names {other}, not another code")
            elif other in by_name and code.name in by_name[other].wins_over:
                problems.append(f"code {code.name}: wins_over {other}, which also wins over it")
    if problems:
        raise CatalogError(path, problems)
    return Catalog(version=int(data.get("version", 1)), path=path, codes=tuple(codes))


def load_catalog(path: str | Path | None = None, *, check_patterns: bool = True) -> Catalog:
    """Load and validate the catalog file (default: the one shipped in ``graph/``)."""
    p = Path(path) if path is not None else DEFAULT_CATALOG_PATH
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise CatalogError(str(p), [f"cannot read: {exc}"]) from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CatalogError(str(p), [f"not valid TOML: {exc}"]) from exc
    return parse_catalog(data, str(p), check_patterns=check_patterns)


@cache
def default_catalog() -> Catalog:
    """The shipped catalog (or ``$RCA_CATALOG``), loaded once per process.

    Pattern checks are left to ``rca codes`` and the tests, to keep start-up fast.
    """
    return load_catalog(os.environ.get("RCA_CATALOG") or None, check_patterns=False)
