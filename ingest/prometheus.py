"""Prometheus / OpenMetrics exposition text -> METRICS rows, and threshold events.

:func:`parse_exposition` turns one scrape (dcgm-exporter, vLLM, TGI, Triton...)
into rows of :data:`ingest.schema.METRICS`. Every input line ends up as exactly
one of: a sample, metadata (``# HELP``/``# TYPE``/``# UNIT``/``# EOF``, other
comments, blank lines) or a quarantine row with the reason. Bad input never
raises. DCGM "blank" sentinels (values near 2**63, e.g. 9223372036854775794)
are not readings: they are quarantined, not stored as samples.

:class:`ThresholdTracker` is fed consecutive scrapes and emits
:class:`ingest.schema.ErrorContext` records. Its rules are data
(:data:`DEFAULT_RULES`, a tuple of :class:`Rule`), not if-chains.

>>> r = parse_exposition('vllm:num_requests_waiting{model_name="m"} 3\\n', source="t", ts_ns=1)
>>> r.samples[0]["name"], r.samples[0]["value"], r.samples[0]["labels"]
('vllm:num_requests_waiting', 3.0, '{"model_name": "m"}')
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from pathlib import Path
from typing import Any

from graph.errors import CatalogError
from ingest import schema as S

__all__ = [
    "MAX_LINE",
    "PromParseResult",
    "parse_exposition",
    "parse_exposition_file",
    "family_of",
    "is_dcgm_blank",
    "RuleKind",
    "Rule",
    "DEFAULT_RULES",
    "ThresholdTracker",
]

#: Lines longer than this are quarantined unread (same limit as ingest.logs).
MAX_LINE = 1 << 20
_RAW_KEEP = 65536

# --------------------------------------------------------------------------- grammar

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
# name, then either a label block (quoted values may hold '}' and escapes) or
# blanks, then value, optional timestamp, optional OpenMetrics exemplar.
# Possessive runs (Python 3.11+): linear time, no backtracking on hostile lines.
_QUOTED = r"\"(?:[^\"\\]++|\\.)*+\""
_BLOCK = r"\{((?:[^\"}\\]++|" + _QUOTED + r")*+)\}"
_SAMPLE = re.compile(
    rf"({_NAME})"
    r"(?:[ \t]*+" + _BLOCK + r"[ \t]*+|[ \t]++)"
    r"([^ \t]++)"
    r"(?:[ \t]++([^ \t#][^ \t]*+))?"
    r"(?:[ \t]++(#.*))?"
    r"[ \t]*+"
)
_PAIR = re.compile(
    r"[ \t]*+([a-zA-Z_][a-zA-Z0-9_]*+)[ \t]*+=[ \t]*+\"((?:[^\"\\]++|\\.)*+)\"[ \t]*+(,?)[ \t]*+"
)
_NAME_AT = re.compile(_NAME)
_BLOCK_BODY = re.compile(r"(?:[^\"}\\]++|" + _QUOTED + r")*+")
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPE = {"n": "\n", "\\": "\\", '"': '"'}
_HELP = re.compile(rf"#[ \t]+HELP[ \t]+({_NAME})(?:[ \t]+(.*))?[ \t]*")
_TYPE = re.compile(rf"#[ \t]+TYPE[ \t]+({_NAME})[ \t]+([a-z]+)[ \t]*")
_UNIT = re.compile(rf"#[ \t]+UNIT[ \t]+({_NAME})(?:[ \t]+(.*))?[ \t]*")
_META_WORD = re.compile(r"#[ \t]+(HELP|TYPE|UNIT)\b")
_EXEMPLAR = re.compile(r"#[ \t]*+" + _BLOCK + r"[ \t]*+([^ \t]++)(?:[ \t]++([^ \t]++))?[ \t]*+")
_TS_INT = re.compile(r"-?[0-9]+")
_TS_FLOAT = re.compile(r"-?[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?")
_TYPES = frozenset(
    {"counter", "gauge", "histogram", "summary", "untyped", "unknown"}
    | {"info", "stateset", "gaugehistogram"}
)
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_gcount", "_gsum", "_info")

_HOST_LABELS = ("Hostname", "hostname", "instance")
_GPU_LABELS = ("UUID", "uuid", "gpu_uuid")

# DCGM blank values (dcgm_structs.h): INT64 0x7ffffffffffffff0.., INT32
# 0x7ffffff0.., FP64 2**47.. ; +1..+3 are NOT_FOUND, NOT_SUPPORTED, NOT_PERMISSIONED.
_DCGM_INT64_BLANK_MIN = 9.2e18
_DCGM_BLANKS = frozenset(
    [float(0x7FFFFFF0 + k) for k in range(4)] + [140737488355328.0 + k for k in range(4)]
)
_DCGM_PREFIXES = ("DCGM_", "dcgm_")


def is_dcgm_blank(name: str, value: float) -> bool:
    """True for a DCGM "blank"/not-supported sentinel on a DCGM metric (not a reading)."""
    return name.startswith(_DCGM_PREFIXES) and (
        value >= _DCGM_INT64_BLANK_MIN or value in _DCGM_BLANKS
    )


def family_of(name: str, types: Mapping[str, str]) -> tuple[str, str | None]:
    """(family, type) of a sample name: ``foo_bucket`` -> (``foo``, "histogram") when declared."""
    if name in types:
        return name, types[name]
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if base in types:
                return base, types[base]
    return name, None


# --------------------------------------------------------------------------- result


@dataclass
class PromParseResult:
    """One scrape, parsed. ``lines == len(samples) + metadata + len(quarantine)``."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    quarantine: list[dict[str, Any]] = field(default_factory=list)
    lines: int = 0
    metadata: int = 0
    types: dict[str, str] = field(default_factory=dict)
    helps: dict[str, str] = field(default_factory=dict)
    units: dict[str, str] = field(default_factory=dict)
    exemplars: list[dict[str, Any]] = field(default_factory=list)
    openmetrics: bool = False


class _Overlong:
    """Stand-in for a line over MAX_LINE: its head and true length only."""

    __slots__ = ("head", "size")

    def __init__(self, head: bytes | str, size: int) -> None:
        self.head, self.size = head, size


def _iter_lines(data: str | bytes | Iterable[bytes]) -> Iterator[str | bytes | _Overlong]:
    """Split on '\\n' only (label values may hold other line separators)."""
    if isinstance(data, str | bytes | bytearray):
        parts = data.split("\n" if isinstance(data, str) else b"\n")
        if parts and not parts[-1]:
            parts.pop()
        for p in parts:
            yield p if len(p) <= MAX_LINE else _Overlong(p[:_RAW_KEEP], len(p))
        return
    buf = b""
    over: _Overlong | None = None
    for chunk in data:
        if not chunk:
            continue
        if isinstance(chunk, str):  # a text-mode file or list of str lines
            chunk = chunk.encode("utf-8", "surrogatepass")
        if b"\n" not in chunk:
            if over is not None:
                over.size += len(chunk)
                continue
            buf += chunk
            if len(buf) > MAX_LINE:
                over, buf = _Overlong(buf[:_RAW_KEEP], len(buf)), b""
            continue
        pieces = chunk.split(b"\n")
        first = pieces[0]
        if over is not None:
            over.size += len(first)
            yield over
            over = None
        else:
            first = buf + first
            yield first if len(first) <= MAX_LINE else _Overlong(first[:_RAW_KEEP], len(first))
        for p in pieces[1:-1]:
            yield p if len(p) <= MAX_LINE else _Overlong(p[:_RAW_KEEP], len(p))
        buf = pieces[-1]
        if len(buf) > MAX_LINE:
            over, buf = _Overlong(buf[:_RAW_KEEP], len(buf)), b""
    if over is not None:
        yield over
    elif buf:
        yield buf


def _raw_text(raw: str | bytes) -> str:
    if isinstance(raw, str):
        return raw[:_RAW_KEEP].encode("utf-8", "replace").decode("utf-8")
    return bytes(raw[:_RAW_KEEP]).decode("utf-8", "replace")


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPE.sub(lambda m: _UNESCAPE.get(m[1], m[0]), value)


def _parse_labels(block: str) -> dict[str, str] | str:
    """Label dict, or the reason the block is malformed."""
    labels: dict[str, str] = {}
    pos, end = 0, len(block)
    if not block.strip(" \t"):
        return labels
    while pos < end:
        m = _PAIR.match(block, pos)
        if m is None:
            return f"malformed label at {block[pos : pos + 40]!r}"
        name = m[1]
        if name in labels:
            return f"duplicate label name {name!r}"
        labels[name] = _unescape(m[2])
        pos = m.end()
        if not m[3] and pos < end:
            return f"expected ',' between labels at {block[pos : pos + 40]!r}"
    return labels


def _diagnose(line: str) -> str:
    """Why a sample line did not match the grammar (only for the quarantine reason)."""
    name = _NAME_AT.match(line)
    if name is None:
        return "malformed metric name"
    rest = line[name.end() :].lstrip(" \t")
    if rest.startswith("{"):
        stop = _BLOCK_BODY.match(rest, 1).end()  # type: ignore[union-attr]
        if stop == len(rest):
            return "unterminated label set"
        if rest[stop] == '"':
            return "unterminated label value"
        if rest[stop] == "}" and not rest[stop + 1 :].strip(" \t"):
            return "missing value"
        return "malformed label set" if rest[stop] != "}" else "malformed sample line"
    if not rest:
        return "missing value"
    return "malformed sample line"


def _host_from(labels: Mapping[str, str]) -> str | None:
    for key in _HOST_LABELS:
        value = labels.get(key)
        if value:
            if key == "instance":
                head, sep, port = value.rpartition(":")
                if sep and port.isdigit() and head:
                    value = head.strip("[]")
            return value
    return None


def _gpu_from(labels: Mapping[str, str]) -> str | None:
    for key in _GPU_LABELS:
        value = labels.get(key)
        if value:
            return value
    return None


def _float(text: str) -> float:
    if not text.isascii() or "_" in text:
        raise ValueError(text)
    return float(text)


def parse_exposition(
    data: str | bytes | Iterable[bytes],
    *,
    source: str,
    ts_ns: int | None = None,
    host: str | None = None,
) -> PromParseResult:
    """Parse one scrape of Prometheus text (0.0.4) or OpenMetrics into METRICS rows.

    Parameters
    ----------
    data:
        The exposition: text, bytes, or an iterable of byte chunks or lines.
    source:
        Scrape file, URL or receiver; stored in every row.
    ts_ns:
        Scrape time for samples without their own timestamp (default: now).
        Sample timestamps are ms in Prometheus text and seconds in OpenMetrics
        (input ending in ``# EOF``).
    host:
        Host for every row; otherwise taken from the ``Hostname``, ``hostname``
        or ``instance`` label (port stripped) of each sample.

    Returns
    -------
    PromParseResult
        ``samples`` (METRICS rows, labels as JSON with sorted keys),
        ``quarantine`` (QUARANTINE rows with the reason), counts and metadata.
    """
    now = time.time_ns()
    default_ts = now if ts_ns is None else ts_ns
    res = PromParseResult()
    samples, quarantine = res.samples, res.quarantine
    types, helps = res.types, res.helps
    label_cache: dict[str, tuple[str, str | None, str | None, dict[str, str]] | str] = {}
    family_cache: dict[str, tuple[str, str | None]] = {}
    timed: list[tuple[dict[str, Any], str]] = []
    eof_seen = False

    def q(n: int, reason: str, raw: str | bytes) -> None:
        quarantine.append(S.quarantine_row(source, f"line {n}", reason, _raw_text(raw)))

    n = 0
    for raw in _iter_lines(data):
        n += 1
        if isinstance(raw, _Overlong):
            q(n, f"line longer than 1 MiB ({raw.size} bytes)", raw.head)
            continue
        if isinstance(raw, bytes | bytearray):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                q(n, "invalid UTF-8", raw)
                continue
        else:
            line = raw
            if not line.isascii():
                try:
                    line.encode("utf-8")
                except UnicodeEncodeError:
                    q(n, "invalid UTF-8 (lone surrogate)", raw)
                    continue
        if line.endswith("\r"):
            line = line[:-1]
        line = line.lstrip(" \t")
        if eof_seen:
            if line.strip(" \t"):
                q(n, "content after # EOF", raw)
            else:
                res.metadata += 1
            continue
        if not line:
            res.metadata += 1
            continue
        if line[0] == "#":
            if line.rstrip(" \t") == "# EOF":
                eof_seen = res.openmetrics = True
                res.metadata += 1
                continue
            word = _META_WORD.match(line)
            if word is None:
                res.metadata += 1  # plain comment
                continue
            kind = word[1]
            if kind == "HELP":
                m = _HELP.fullmatch(line)
                if m is None:
                    q(n, "malformed HELP line", raw)
                elif m[1] in helps:
                    q(n, f"duplicate HELP for {m[1]}", raw)
                else:
                    helps[m[1]] = _unescape(m[2] or "")
                    res.metadata += 1
            elif kind == "TYPE":
                m = _TYPE.fullmatch(line)
                if m is None:
                    q(n, "malformed TYPE line", raw)
                elif m[2] not in _TYPES:
                    q(n, f"unknown metric type {m[2]!r}", raw)
                elif m[1] in types:
                    q(n, f"duplicate TYPE for {m[1]}", raw)
                else:
                    types[m[1]] = m[2]
                    family_cache.clear()
                    res.metadata += 1
            else:
                m = _UNIT.fullmatch(line)
                if m is None:
                    q(n, "malformed UNIT line", raw)
                else:
                    res.units[m[1]] = m[2] or ""
                    res.metadata += 1
            continue

        m = _SAMPLE.fullmatch(line)
        if m is None:
            q(n, _diagnose(line), raw)
            continue
        name, block, value_text, ts_text, exemplar = m.groups()
        try:
            value = _float(value_text)
        except ValueError:
            q(n, f"bad float value {value_text[:40]!r}", raw)
            continue
        if block is None:
            block = ""
        cached = label_cache.get(block)
        if cached is None:
            parsed = _parse_labels(block)
            if isinstance(parsed, str):
                cached = parsed
            else:
                cached = (
                    json.dumps(parsed, sort_keys=True),
                    _host_from(parsed),
                    _gpu_from(parsed),
                    parsed,
                )
            label_cache[block] = cached
        if isinstance(cached, str):
            q(n, cached, raw)
            continue
        labels_json, label_host, gpu_uuid, labels = cached
        if is_dcgm_blank(name, value):
            q(n, f"DCGM blank sentinel {value_text} (not a reading)", raw)
            continue
        fam = family_cache.get(name)
        if fam is None:
            fam = family_cache[name] = family_of(name, types)
        family, ftype = fam
        if ftype == "histogram" and name == family + "_bucket":
            le = labels.get("le")
            if le is None:
                q(n, "histogram bucket without le label", raw)
                continue
            try:
                _float(le)
            except ValueError:
                q(n, f"bad le value {le[:40]!r}", raw)
                continue
        elif ftype == "summary" and name == family and "quantile" in labels:
            try:
                _float(labels["quantile"])
            except ValueError:
                q(n, f"bad quantile value {labels['quantile'][:40]!r}", raw)
                continue
        if ts_text is not None and not _TS_FLOAT.fullmatch(ts_text):
            q(n, f"bad timestamp {ts_text[:40]!r}", raw)
            continue
        if exemplar is not None:
            ex = _EXEMPLAR.fullmatch(exemplar)
            ex_labels = _parse_labels(ex[1]) if ex else "malformed exemplar"
            if ex is None or isinstance(ex_labels, str):
                q(n, f"malformed exemplar: {ex_labels if ex else exemplar[:40]}", raw)
                continue
            try:
                ex_value = _float(ex[2])
            except ValueError:
                q(n, f"bad exemplar value {ex[2][:40]!r}", raw)
                continue
            res.exemplars.append(
                {"line": n, "name": name, "labels": labels_json, "exemplar": ex_labels}
                | {"value": ex_value, "ts": ex[3]}
            )
        row = {
            "ts": default_ts,
            "host": host or label_host,
            "gpu_uuid": gpu_uuid,
            "name": name,
            "labels": labels_json,
            "value": value,
            "source": source,
        }
        samples.append(row)
        if ts_text is not None:
            timed.append((row, ts_text))
    res.lines = n

    for row, ts_text in timed:
        if res.openmetrics:  # seconds, possibly fractional
            try:
                row["ts"] = int(Decimal(ts_text) * 1_000_000_000)
            except InvalidOperation:  # pragma: no cover - the regex admits only decimals
                row["ts"] = default_ts
        elif _TS_INT.fullmatch(ts_text):  # ms, exact
            row["ts"] = int(ts_text) * 1_000_000
        else:
            row["ts"] = int(Decimal(ts_text) * 1_000_000)
    return res


def parse_exposition_file(path: str | Path, **kw: Any) -> PromParseResult:
    """Parse a saved scrape; ``source`` defaults to the path."""
    p = Path(path)
    kw.setdefault("source", str(p))
    with open(p, "rb") as fh:
        return parse_exposition(fh, **kw)


# --------------------------------------------------------------------------- rules


class RuleKind(StrEnum):
    """How a rule reads a series (see :class:`Rule`)."""

    AT_LEAST = "at_least"  # value >= threshold; fires on entering the state
    EQUALS = "equals"  # value == threshold; fires on entering the state
    BITMASK = "bitmask"  # int(value) & threshold != 0; fires on entering the state
    INCREASE = "increase"  # counter rose since the last scrape; a drop is a reset
    RISING_ABOVE = "rising_above"  # value > threshold and above the last scrape
    CHANGED_NONZERO = "changed_nonzero"  # changed to a non-zero value (last-Xid gauges)
    RATIO_BELOW = "ratio_below"  # delta(metric) / delta(denominator) < threshold


#: Kinds that need a previous value; the others fire on a first scrape too.
_DELTA_KINDS = frozenset(
    {RuleKind.INCREASE, RuleKind.RISING_ABOVE, RuleKind.CHANGED_NONZERO, RuleKind.RATIO_BELOW}
)


@dataclass(frozen=True, slots=True)
class Rule:
    """One threshold rule: which series, how to read them, which catalog code.

    ``code`` may hold ``{xid}``, filled from ``xid``: an Xid number, ``"value"``
    (the sample value) or ``"label:<name>"``. When the filled code is not in the
    catalog, ``fallback`` is used if it is; otherwise the hit is kept in
    :attr:`ThresholdTracker.unmapped`. ``new_series_from_zero``: a series that
    first appears after its source's first scrape counts from 0 (TGI and the
    dcgm-exporter Xid counter create series on the first event).
    """

    name: str
    metrics: tuple[str, ...]
    kind: RuleKind
    code: str
    threshold: float = 0.0
    labels: Mapping[str, str] = field(default_factory=dict)
    xid: int | str | None = None
    fallback: str | None = None
    denominator: tuple[str, ...] = ()
    min_denominator: float = 0.0
    new_series_from_zero: bool = False


_NVLINK_CRC = tuple(
    f"DCGM_FI_DEV_NVLINK_{kind}_ERROR_COUNT_{link}"
    for kind in ("CRC_FLIT", "CRC_DATA")
    for link in ("TOTAL", *(f"L{i}" for i in range(18)))
) + ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_TOTAL", "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_TOTAL")

#: The rules the toolkit ships. Metric names: reference section 3-4; codes: graph/catalog.toml.
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(
        "kv_cache_full",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        RuleKind.AT_LEAST,
        "KV_CACHE_NO_FREE_BLOCKS",
        0.99,
    ),
    Rule(
        "vllm_preemption",
        ("vllm:num_preemptions_total",),
        RuleKind.INCREASE,
        "SCHEDULER_PREEMPTION",
    ),
    Rule(
        "queue_backlog",
        ("vllm:num_requests_waiting", "tgi_queue_size", "nv_inference_pending_request_count"),
        RuleKind.RISING_ABOVE,
        "SCHEDULER_QUEUE_BACKLOG",
        100,
    ),
    Rule("vllm_nan_logits", ("vllm:corrupted_requests_total",), RuleKind.INCREASE, "LOGITS_NAN"),
    Rule(
        "dcgm_last_xid",
        ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR"),
        RuleKind.CHANGED_NONZERO,
        "GPU_XID_{xid}",
        xid="value",
        fallback="GPU_XID_OTHER",
    ),
    Rule(
        "dcgm_xid_count",
        ("DCGM_EXP_XID_ERRORS_COUNT",),
        RuleKind.INCREASE,
        "GPU_XID_{xid}",
        xid="label:xid",
        fallback="GPU_XID_OTHER",
        new_series_from_zero=True,
    ),
    Rule(
        "dcgm_ecc_dbe",
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",),
        RuleKind.INCREASE,
        "GPU_XID_48",
        xid=48,
    ),
    Rule(
        "dcgm_hw_thermal",
        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"),
        RuleKind.BITMASK,
        "GPU_HW_THERMAL_SLOWDOWN",
        0x40,
    ),
    Rule(
        "dcgm_hw_power_brake",
        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"),
        RuleKind.BITMASK,
        "GPU_HW_POWER_BRAKE",
        0x80,
    ),
    Rule(
        "dcgm_pcie_replay",
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL"),
        RuleKind.INCREASE,
        "PCIE_REPLAY_RISING",
    ),
    Rule("dcgm_nvlink_crc", _NVLINK_CRC, RuleKind.INCREASE, "NVLINK_CRC_ERRORS_RISING"),
    Rule(
        "dcgm_row_remap_pending",
        ("DCGM_FI_DEV_ROW_REMAP_PENDING",),
        RuleKind.EQUALS,
        "GPU_XID_63",
        1,
        xid=63,
    ),
    Rule(
        "dcgm_row_remap_failure",
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_ROW_REMAP_FAILED"),
        RuleKind.EQUALS,
        "GPU_XID_64",
        1,
        xid=64,
    ),
    Rule(
        "tgi_overloaded",
        ("tgi_request_failure",),
        RuleKind.INCREASE,
        "REQUEST_QUEUE_FULL",
        labels={"err": "overloaded"},
        new_series_from_zero=True,
    ),
    Rule(
        "triton_rejected",
        ("nv_inference_request_failure",),
        RuleKind.INCREASE,
        "REQUEST_QUEUE_FULL",
        labels={"reason": "REJECTED"},
    ),
    Rule(
        "tgi_validation",
        ("tgi_request_failure",),
        RuleKind.INCREASE,
        "TGI_TOTAL_TOKENS_EXCEEDED",
        labels={"err": "validation"},
        new_series_from_zero=True,
    ),
    Rule(
        "spec_decode_acceptance",
        ("vllm:spec_decode_num_accepted_tokens_total",),
        RuleKind.RATIO_BELOW,
        "SPEC_DECODE_ACCEPTANCE_COLLAPSE",
        0.1,
        denominator=("vllm:spec_decode_num_draft_tokens_total",),
        min_denominator=100,
    ),
)


def _event_id(*parts: object) -> str:
    """Deterministic id: the same observation fed twice gives the same id."""
    h = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=16).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class ThresholdTracker:
    """Feed consecutive scrapes; get ErrorContext records when a rule fires.

    Keeps the previous value per series (host, metric name, labels). Rules that
    need a previous value (increase, rising, changed, ratio) stay silent on a
    series' first scrape; state rules (at least, equals, bitmask) fire at once,
    and again only after the series has left the state.
    """

    def __init__(self, rules: Iterable[Rule] = DEFAULT_RULES, *, catalog: Any = None) -> None:
        if catalog is None:
            from graph.catalog import default_catalog

            catalog = default_catalog()
        self.catalog = catalog
        self.rules = tuple(rules)
        problems = [
            f"rule {r.name}: code {c} is not in the catalog"
            for r in self.rules
            for c in ([r.code] if "{" not in r.code else [])
            if c not in catalog
        ]
        if problems:
            raise CatalogError(str(getattr(catalog, "path", "catalog")), problems)
        self._by_metric: dict[str, list[Rule]] = {}
        self._ratio: dict[str, list[tuple[Rule, str]]] = {}
        for r in self.rules:
            if r.kind is RuleKind.RATIO_BELOW:
                for m in r.metrics:
                    self._ratio.setdefault(m, []).append((r, "num"))
                for m in r.denominator:
                    self._ratio.setdefault(m, []).append((r, "den"))
            else:
                for m in r.metrics:
                    self._by_metric.setdefault(m, []).append(r)
        self._prev: dict[tuple[Any, str, str], float] = {}
        self._ratio_prev: dict[tuple[int, Any, str], tuple[float, float]] = {}
        self._scopes: set[tuple[Any, Any]] = set()
        self._labels: dict[str, dict[str, str]] = {}
        #: Hits whose code (e.g. GPU_XID_N for an N the catalog lacks) had no catalog entry.
        self.unmapped: list[dict[str, Any]] = []

    def feed(self, samples: Iterable[Mapping[str, Any]] | PromParseResult) -> list[S.ErrorContext]:
        """Evaluate one scrape's METRICS rows against the rules; update the state."""
        rows = samples.samples if isinstance(samples, PromParseResult) else samples
        events: list[S.ErrorContext] = []
        ratio_now: dict[tuple[int, Any, str], dict[str, Any]] = {}
        scopes: set[tuple[Any, Any]] = set()
        for s in rows:
            name = s["name"]
            scope = (s.get("source"), s.get("host"))
            scopes.add(scope)
            rules = self._by_metric.get(name)
            ratio = self._ratio.get(name)
            if rules is None and ratio is None:
                continue
            value = float(s["value"])
            if not math.isfinite(value):
                continue
            labels = self._parse(s.get("labels"))
            key = (s.get("host"), name, s.get("labels") or "{}")
            prev = self._prev.get(key)
            for rule in rules or ():
                if not all(labels.get(k) == v for k, v in rule.labels.items()):
                    continue
                before = prev
                if before is None and rule.new_series_from_zero and scope in self._scopes:
                    before = 0.0
                if self._fires(rule, value, before):
                    event = self._event(rule, s, labels, value, before)
                    if event is not None:
                        events.append(event)
            self._prev[key] = value
            for rule, part in ratio or ():
                if all(labels.get(k) == v for k, v in rule.labels.items()):
                    group = ratio_now.setdefault((id(rule), s.get("host"), key[2]), {})
                    group[part] = value
                    group.setdefault("sample", s)
                    group["rule"] = rule
        for gkey, group in ratio_now.items():
            if "num" not in group or "den" not in group:
                continue
            rule = group["rule"]
            before = self._ratio_prev.get(gkey)
            self._ratio_prev[gkey] = (group["num"], group["den"])
            if before is None:
                continue
            d_num, d_den = group["num"] - before[0], group["den"] - before[1]
            if d_num < 0 or d_den <= 0 or d_den < rule.min_denominator:
                continue  # counter reset or too few drafts to judge
            ratio_value = d_num / d_den
            if ratio_value < rule.threshold:
                s = group["sample"]
                extra = {"numerator_delta": d_num, "denominator_delta": d_den}
                message = (
                    f"{s['name']} / {rule.denominator[0]} = {ratio_value:.3g} over "
                    f"{d_den:g} since the last scrape (< {rule.threshold:g}): rule {rule.name}"
                )
                labels = self._parse(s.get("labels"))
                event = self._event(
                    rule, s, labels, ratio_value, None, extra=extra, message=message
                )
                if event is not None:
                    events.append(event)
        self._scopes |= scopes
        return events

    def _parse(self, text: str | None) -> dict[str, str]:
        text = text or "{}"
        labels = self._labels.get(text)
        if labels is None:
            try:
                loaded = json.loads(text)
            except ValueError:
                loaded = {}
            labels = self._labels[text] = loaded if isinstance(loaded, dict) else {}
        return labels

    @staticmethod
    def _fires(rule: Rule, value: float, prev: float | None) -> bool:
        kind, thr = rule.kind, rule.threshold
        if kind in _DELTA_KINDS and prev is None:
            return False
        if kind is RuleKind.AT_LEAST:
            return value >= thr and not (prev is not None and prev >= thr)
        if kind is RuleKind.EQUALS:
            return value == thr and prev != thr
        if kind is RuleKind.BITMASK:
            mask = int(thr)
            now_set = 0 <= value < 2**63 and bool(int(value) & mask)
            was_set = prev is not None and 0 <= prev < 2**63 and bool(int(prev) & mask)
            return now_set and not was_set
        if kind is RuleKind.INCREASE:
            return value > prev  # type: ignore[operator]
        if kind is RuleKind.RISING_ABOVE:
            return value > thr and value > prev  # type: ignore[operator]
        if kind is RuleKind.CHANGED_NONZERO:
            return value != 0 and value != prev
        return False

    def _event(
        self,
        rule: Rule,
        s: Mapping[str, Any],
        labels: Mapping[str, str],
        value: float,
        prev: float | None,
        *,
        extra: Mapping[str, Any] | None = None,
        message: str | None = None,
    ) -> S.ErrorContext | None:
        xid: int | None = None
        if isinstance(rule.xid, int):
            xid = rule.xid
        elif rule.xid == "value":
            xid = int(value) if value.is_integer() else None
        elif isinstance(rule.xid, str) and rule.xid.startswith("label:"):
            text = labels.get(rule.xid[6:], "")
            xid = int(text) if text.isdigit() else None
        code_name = rule.code.format(xid=xid) if "{" in rule.code else rule.code
        attrs: dict[str, Any] = {
            "metric": s["name"],
            "labels": dict(labels),
            "value": value,
            "previous": prev,
            "rule": rule.name,
            "threshold": rule.threshold,
        }
        if extra:
            attrs.update(extra)
        code = self.catalog.get(code_name) if xid is not None or "{" not in rule.code else None
        if code is None and rule.fallback:
            code = self.catalog.get(rule.fallback)
        if code is None:
            self.unmapped.append({"code": code_name, "xid": xid, "ts": s["ts"]} | attrs)
            return None
        gpu = labels.get("gpu", "")
        host = s.get("host")
        ts = int(s["ts"])
        prev_text = "" if prev is None else f" (was {prev:g})"
        return S.ErrorContext.from_catalog(
            code,
            source=f"metric:{s.get('source')}",
            ts=ts,
            event_id=_event_id(code.name, s.get("source"), host, s["name"], s.get("labels"), ts),
            host=host,
            pid=None,
            gpu_uuid=s.get("gpu_uuid"),
            gpu_index=int(gpu) if gpu.isdigit() else None,
            xid=xid,
            confidence=1.0,
            message=message or f"{s['name']} {value:g}{prev_text}: rule {rule.name}",
            attrs=attrs,
        )
