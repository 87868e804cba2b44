"""The one definition of the joint record and of the store's tables.

Every table is declared once, as a tuple of :class:`Column`; the DuckDB DDL, the
Arrow schema and the polars schema are all derived from it, and the
:class:`ErrorContext` dataclass is checked against it at import time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

__all__ = [
    "SCHEMA_VERSION",
    "Column",
    "Table",
    "ERROR_CONTEXT",
    "SPANS",
    "QUARANTINE",
    "METRICS",
    "TABLES",
    "ErrorContext",
    "Span",
    "new_event_id",
    "own_pid",
    "HOST_PID_KEY",
    "arrow_schema",
    "polars_schema",
    "create_table_sql",
    "records_to_arrow",
    "quarantine_row",
    "arrow_to_records",
]

#: Bumped whenever a migration is added to :mod:`ingest.migrations`.
SCHEMA_VERSION = 3


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    duck: str  # DuckDB type
    arrow: pa.DataType
    nullable: bool = True
    doc: str = ""


@dataclass(frozen=True, slots=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    indexes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]


def _c(name: str, duck: str, arrow: pa.DataType, nullable: bool = True, doc: str = "") -> Column:
    return Column(name, duck, arrow, nullable, doc)


_STR = pa.string()

ERROR_CONTEXT = Table(
    "error_context",
    (
        _c("event_id", "VARCHAR", _STR, False, "time-ordered UUIDv7, hex with dashes"),
        _c("ts", "BIGINT", pa.int64(), False, "event time, ns since the Unix epoch (UTC)"),
        _c("trace_id", "VARCHAR", _STR, doc="W3C trace id, 32 lowercase hex"),
        _c("span_id", "VARCHAR", _STR, doc="W3C span id, 16 lowercase hex"),
        _c("request_id", "VARCHAR", _STR, doc="engine request id (vLLM cmpl-..., TGI, Triton)"),
        _c("host", "VARCHAR", _STR),
        _c(
            "pid",
            "INTEGER",
            pa.int32(),
            doc="probes: the host's pid (NULL in a container's pid namespace); "
            "parsed lines: the pid they print (a kernel Xid line: the host's)",
        ),
        _c("gpu_uuid", "VARCHAR", _STR, doc="GPU-xxxxxxxx-... as NVML prints it"),
        _c("gpu_index", "INTEGER", pa.int32()),
        _c("source", "VARCHAR", _STR, False, "probe or parser that produced the row"),
        _c("code", "VARCHAR", _STR, False, "catalog code name"),
        _c("layer", "TINYINT", pa.int8(), False, "1..7"),
        _c("stage", "VARCHAR", _STR),
        _c("family", "VARCHAR", _STR, False),
        _c("severity", "VARCHAR", _STR, False, "info | warning | error | critical"),
        _c("recoverability", "VARCHAR", _STR),
        _c("xid", "INTEGER", pa.int32(), doc="NVIDIA Xid number"),
        _c("sm_error", "VARCHAR", _STR, doc="JSON: gpc, tpc, sm, exception, esr pairs"),
        _c("kv_block", "BIGINT", pa.int64()),
        _c("kv_hash", "VARCHAR", _STR, doc="KV block fingerprint, hex"),
        _c("confidence", "FLOAT", pa.float32(), doc="1.0 for exact evidence"),
        _c("message", "VARCHAR", _STR),
        _c("attrs", "VARCHAR", _STR, doc="JSON object: op, tensor stats, seq_len, model..."),
        _c("raw", "VARCHAR", _STR, doc="original text where the row came from a log"),
    ),
    indexes=(("error_context_trace_idx", ("trace_id",)),),
)

SPANS = Table(
    "spans",
    (
        _c("trace_id", "VARCHAR", _STR, False),
        _c("span_id", "VARCHAR", _STR, False),
        _c("parent_span_id", "VARCHAR", _STR),
        _c("name", "VARCHAR", _STR, False),
        _c("kind", "VARCHAR", _STR, doc="SERVER | CLIENT | INTERNAL | PRODUCER | CONSUMER"),
        _c("start_ns", "BIGINT", pa.int64(), False),
        _c("end_ns", "BIGINT", pa.int64()),
        _c("status_code", "VARCHAR", _STR, doc="UNSET | OK | ERROR"),
        _c("status_message", "VARCHAR", _STR),
        _c("http_status", "INTEGER", pa.int32()),
        _c("service_name", "VARCHAR", _STR),
        _c("host", "VARCHAR", _STR),
        _c("attributes", "VARCHAR", _STR, doc="JSON object"),
        _c("resource", "VARCHAR", _STR, doc="JSON object"),
    ),
    indexes=(("spans_trace_idx", ("trace_id",)),),
)

QUARANTINE = Table(
    "quarantine",
    (
        _c("quarantine_id", "VARCHAR", _STR, False),
        _c("ts", "BIGINT", pa.int64(), False, "when it was quarantined, ns"),
        _c("source", "VARCHAR", _STR, False, "file path, segment name or receiver"),
        _c("origin", "VARCHAR", _STR, doc="line number or byte offset in the source"),
        _c("reason", "VARCHAR", _STR, False),
        _c("raw", "VARCHAR", _STR, doc="the raw text (invalid UTF-8 replaced, bounded)"),
    ),
)

METRICS = Table(
    "metrics",
    (
        _c("ts", "BIGINT", pa.int64(), False, "sample time, ns"),
        _c("host", "VARCHAR", _STR),
        _c("gpu_uuid", "VARCHAR", _STR),
        _c(
            "name",
            "VARCHAR",
            _STR,
            False,
            "metric name as exposed, e.g. vllm:num_preemptions_total",
        ),
        _c("labels", "VARCHAR", _STR, doc="JSON object of the sample's labels"),
        _c("value", "DOUBLE", pa.float64(), False),
        _c("source", "VARCHAR", _STR, False, "scrape file, URL or receiver"),
    ),
    indexes=(),
)

TABLES: tuple[Table, ...] = (ERROR_CONTEXT, SPANS, QUARANTINE, METRICS)


def arrow_schema(table: Table) -> pa.Schema:
    return pa.schema([pa.field(c.name, c.arrow, nullable=c.nullable) for c in table.columns])


def polars_schema(table: Table) -> dict[str, Any]:
    import polars as pl

    return dict(pl.from_arrow(arrow_schema(table).empty_table()).schema)


def create_table_sql(table: Table) -> list[str]:
    cols = ",\n  ".join(
        f"{c.name} {c.duck}{'' if c.nullable else ' NOT NULL'}" for c in table.columns
    )
    stmts = [f"CREATE TABLE IF NOT EXISTS {table.name} (\n  {cols}\n)"]
    for idx_name, idx_cols in table.indexes:
        stmts.append(
            f"CREATE INDEX IF NOT EXISTS {idx_name} ON {table.name} ({', '.join(idx_cols)})"
        )
    return stmts


def new_event_id(ts_ns: int | None = None) -> str:
    """A UUIDv7 (RFC 9562): 48-bit ms timestamp, then random bits; sorts by time."""
    ms = (time.time_ns() if ts_ns is None else ts_ns) // 1_000_000
    rand = int.from_bytes(secrets.token_bytes(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= ((rand >> 62) & 0xFFF) << 64
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_HOST = os.uname().nodename if hasattr(os, "uname") else "localhost"

#: The inode of the kernel's initial pid namespace (PROC_PID_INIT_INO,
#: include/linux/proc_ns.h): ``/proc/self/ns/pid`` reads ``pid:[4026531836]``
#: in a process that is not in a container's pid namespace.
_INIT_PID_NS = "pid:[4026531836]"
_PROC = "/proc"
_own: tuple[int, int | None] | None = None  # (os.getpid(), host pid) of this process
#: A stored span resource's key for the exporting process's host pid (set by
#: probes.otel's exporter from :func:`own_pid`; absent where it is not known).
#: OpenTelemetry's ``process.pid`` stays ``os.getpid()``, the namespace's number.
HOST_PID_KEY = "rca.host_pid"


def own_pid() -> int | None:
    """This process's pid as the host kernel names it, or None when it cannot
    be known: the pid an NVRM Xid line prints, so a record's ``pid`` compares
    with the driver's.

    In the initial pid namespace (a process on the host) it is
    :func:`os.getpid`. In a container's pid namespace ``os.getpid()`` is the
    container's number (often 1 or a few dozen) while the driver prints the
    host's, so comparing them would make every Xid look like another
    process's. There, the host pid is read from ``NSpid`` in
    ``/proc/self/status`` only when ``/proc`` is the host's (its first entry is
    then the host pid); otherwise None. Without ``/proc`` (not Linux) there are
    no pid namespaces: ``os.getpid()``. Cached per process (a fork re-reads)."""
    global _own
    pid = os.getpid()
    if _own is not None and _own[0] == pid:
        return _own[1]
    try:
        ns = os.readlink(f"{_PROC}/self/ns/pid")
    except OSError:
        host: int | None = pid  # no procfs: no pid namespaces to tell apart
    else:
        host = pid if ns == _INIT_PID_NS else _host_pid_from_proc()
    _own = (pid, host)
    return host


def _host_pid_from_proc() -> int | None:
    """NSpid's outermost entry, when ``/proc`` belongs to the initial namespace."""
    try:
        if os.readlink(f"{_PROC}/1/ns/pid") != _INIT_PID_NS:
            return None
        with open(f"{_PROC}/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    return int(ids[0]) if len(ids) > 1 else None
    except (OSError, ValueError):
        return None
    return None


@dataclass(slots=True)
class ErrorContext:
    """One piece of evidence, whatever its source (probe, parser, receiver).

    ``attrs`` and ``sm_error`` are dicts here and JSON text in the store.
    Prompts and completions never go in: lengths and hashes only.
    """

    code: str
    family: str
    layer: int
    severity: str
    source: str
    ts: int = field(default_factory=time.time_ns)
    event_id: str = ""
    trace_id: str | None = None
    span_id: str | None = None
    request_id: str | None = None
    host: str | None = _HOST
    pid: int | None = field(default_factory=own_pid)  # the host's pid (None: not known)
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    stage: str | None = None
    recoverability: str | None = None
    xid: int | None = None
    sm_error: dict[str, Any] | None = None
    kv_block: int | None = None
    kv_hash: str | None = None
    confidence: float | None = 1.0
    message: str | None = None
    attrs: dict[str, Any] | None = None
    raw: str | None = None

    def __post_init__(self) -> None:
        if not self.event_id:
            self.event_id = new_event_id(self.ts)

    def to_row(self) -> dict[str, Any]:
        """The row as stored: JSON columns serialized."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in _JSON_FIELDS:
            if row[key] is not None and not isinstance(row[key], str):
                row[key] = json.dumps(row[key], sort_keys=True, default=str)
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ErrorContext:
        data = dict(row)
        for key in _JSON_FIELDS:
            if isinstance(data.get(key), str):
                data[key] = json.loads(data[key])
        if data.get("confidence") is not None:
            data["confidence"] = float(data["confidence"])
        return cls(**{k: data[k] for k in _FIELD_NAMES if k in data})

    @classmethod
    def from_catalog(cls, code: Any, *, source: str, **kw: Any) -> ErrorContext:
        """Build a record whose code-level fields come from a catalog entry."""
        return cls(
            code=code.name,
            family=code.family,
            layer=code.layer,
            severity=code.severity,
            stage=kw.pop("stage", code.stage),
            recoverability=kw.pop("recoverability", code.recoverability),
            source=source,
            **kw,
        )


_JSON_FIELDS = ("attrs", "sm_error")
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ErrorContext))


@dataclass(slots=True)
class Span:
    trace_id: str
    span_id: str
    name: str
    start_ns: int
    end_ns: int | None = None
    parent_span_id: str | None = None
    kind: str | None = "INTERNAL"
    status_code: str | None = "UNSET"
    status_message: str | None = None
    http_status: int | None = None
    service_name: str | None = None
    host: str | None = None
    attributes: dict[str, Any] | None = None
    resource: dict[str, Any] | None = None

    def to_row(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("attributes", "resource"):
            if row[key] is not None and not isinstance(row[key], str):
                row[key] = json.dumps(row[key], sort_keys=True, default=str)
        return row


def _check_dataclass(cls: type, table: Table) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    if names != set(table.names):
        raise RuntimeError(
            f"{cls.__name__} fields and table {table.name} columns differ: "
            f"{sorted(names ^ set(table.names))}"
        )


_check_dataclass(ErrorContext, ERROR_CONTEXT)
_check_dataclass(Span, SPANS)


def quarantine_row(
    source: str, origin: str, reason: str, raw: bytes | str, *, keep: int = 64 * 1024
) -> dict[str, Any]:
    """A QUARANTINE row: the raw text (first ``keep`` bytes, invalid UTF-8
    replaced) with where it came from and why it was not used."""
    now = time.time_ns()
    text = raw[:keep].decode("utf-8", "replace") if isinstance(raw, bytes) else raw[:keep]
    return {
        "quarantine_id": new_event_id(now),
        "ts": now,
        "source": source,
        "origin": origin,
        "reason": reason,
        "raw": text,
    }


def records_to_arrow(
    records: list[ErrorContext] | list[dict[str, Any]], table: Table = ERROR_CONTEXT
) -> pa.Table:
    rows = [r if isinstance(r, dict) else r.to_row() for r in records]
    return pa.Table.from_pylist(rows, schema=arrow_schema(table))


def arrow_to_records(tab: pa.Table) -> list[ErrorContext]:
    return [ErrorContext.from_row(r) for r in tab.to_pylist()]
