"""Read queries the analysis layer needs; every statement is parameterized."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa

from ingest import schema as S

__all__ = [
    "TraceRows",
    "fetch_trace",
    "fetch_context",
    "recent_traces",
    "root_status_counts",
]

_EC_COLS = ", ".join(S.ERROR_CONTEXT.names)
_SPAN_COLS = ", ".join(S.SPANS.names)


def _dicts(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


@dataclass
class TraceRows:
    trace_id: str
    spans: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)


def fetch_trace(con: duckdb.DuckDBPyConnection, trace_id: str) -> TraceRows:
    spans = _dicts(
        con.execute(
            f"SELECT {_SPAN_COLS} FROM spans WHERE trace_id = ? ORDER BY start_ns", [trace_id]
        )
    )
    recs = _dicts(
        con.execute(
            f"SELECT {_EC_COLS} FROM error_context WHERE trace_id = ? ORDER BY ts", [trace_id]
        )
    )
    return TraceRows(trace_id, spans, recs)


def fetch_context(
    con: duckdb.DuckDBPyConnection,
    *,
    trace_id: str | None,
    t_start: int,
    t_end: int,
    hosts: list[str],
    gpus: list[str],
    request_ids: list[str],
    ids_per_group: int = 5,
    pids: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Records in [t_start, t_end] that share a request id, GPU or host with the trace,
    aggregated per (code, scope): a busy host's thousands of warnings become a few rows.

    Scope is ``request`` (same request id), ``other_process`` (an Xid that the
    driver attributes to a process, 13/31/43/94, naming a pid that is not one
    of ``pids``, the trace's own processes), ``gpu`` (same GPU) or ``host``. Records
    of other traces, and log records of other request ids, are kept only at
    layers 1-4 (shared hardware, memory and KV state), not their own
    engine/model/API symptoms. Each row carries ``n``,
    ``first_ts``, ``last_ts``, ``confidence``, ``severity``, and the earliest
    ``ids_per_group`` event ids with (ts, code, source, message) for display.
    """
    if not (hosts or gpus or request_ids):
        return []
    return _dicts(
        con.execute(
            "SELECT code,"
            " CASE WHEN list_contains($req, request_id) THEN 'request'"
            "      WHEN len($pids) > 0 AND xid IN (13, 31, 43, 94) AND pid IS NOT NULL"
            "           AND NOT list_contains($pids, pid) THEN 'other_process'"
            "      WHEN list_contains($gpus, gpu_uuid) THEN 'gpu' ELSE 'host' END AS scope,"
            " count(*) AS n, min(ts) AS first_ts, max(ts) AS last_ts,"
            " max(confidence) AS confidence, max(severity) AS severity,"
            " (list(event_id ORDER BY ts))[1:$k] AS event_ids,"
            " (list({'event_id': event_id, 'ts': ts, 'code': code, 'source': source,"
            "        'message': message} ORDER BY ts))[1:$k] AS rows"
            " FROM error_context"
            " WHERE ts BETWEEN $t0 AND $t1"
            " AND (list_contains($hosts, host) OR list_contains($gpus, gpu_uuid)"
            "      OR list_contains($req, request_id))"
            " AND (trace_id IS NULL OR (trace_id <> $tid"
            "      AND (layer <= 4 OR list_contains($req, request_id))))"
            # another request's own error (a log line naming its request id)
            # cannot fail this one, unless it is shared state (layers 1-4)
            " AND (request_id IS NULL OR list_contains($req, request_id) OR layer <= 4)"
            " GROUP BY ALL ORDER BY first_ts",
            {
                "req": request_ids,
                "gpus": gpus,
                "hosts": hosts,
                "t0": t_start,
                "t1": t_end,
                "tid": trace_id or "",
                "k": ids_per_group,
                "pids": [int(p) for p in (pids or [])],
            },
        )
    )


def recent_traces(
    con: duckdb.DuckDBPyConnection, *, limit: int = 20, min_http_status: int = 400
) -> list[dict[str, Any]]:
    """The most recent failed local-root spans (no parent, or a parent this store
    never saw: a gateway's or a client's): a starting point for ``rca query``."""
    return _dicts(
        con.execute(
            "SELECT s.trace_id, s.name, s.http_status, s.status_code, s.start_ns, s.end_ns,"
            " s.host FROM spans s"
            " WHERE (s.http_status >= ? OR s.status_code = 'ERROR') AND "
            + _LOCAL_ROOT
            + " ORDER BY s.start_ns DESC LIMIT ?",
            [min_http_status, limit],
        )
    )


#: A span with no parent, or whose parent is not in the store (remote parent).
_LOCAL_ROOT = (
    "(s.parent_span_id IS NULL OR NOT EXISTS (SELECT 1 FROM spans p"
    " WHERE p.trace_id = s.trace_id AND p.span_id = s.parent_span_id))"
)


def root_status_counts(con: duckdb.DuckDBPyConnection, trace_ids: list[str]) -> dict[int, int]:
    """HTTP status -> number of local-root spans, for the given traces (all if empty)."""
    rows = con.execute(
        "SELECT s.http_status, count(*) FROM spans s WHERE "
        + _LOCAL_ROOT
        + " AND s.http_status IS NOT NULL"
        " AND (len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], s.trace_id))"
        " GROUP BY 1 ORDER BY 1",
        [trace_ids, trace_ids],
    ).fetchall()
    return {int(s): int(n) for s, n in rows}


def fetch_event(con: duckdb.DuckDBPyConnection, event_id: str) -> dict[str, Any] | None:
    """One record by event id (a scan of the id column: for occasional lookups)."""
    rows = _dicts(
        con.execute(f"SELECT {_EC_COLS} FROM error_context WHERE event_id = ? LIMIT 1", [event_id])
    )
    return rows[0] if rows else None


def fetch_sm_errors(
    con: duckdb.DuckDBPyConnection, *, gpus: list[str], t_start: int, t_end: int
) -> list[dict[str, Any]]:
    """(code, sm_error JSON) of the Xid 13/31 records on these GPUs in the window."""
    if not gpus:
        return []
    return _dicts(
        con.execute(
            "SELECT code, sm_error FROM error_context WHERE ts BETWEEN ? AND ?"
            " AND list_contains(?::VARCHAR[], gpu_uuid) AND xid IN (13, 31)"
            " AND sm_error IS NOT NULL LIMIT 1000",
            [t_start, t_end, gpus],
        )
    )


# -- dashboard and notebook views (read-only; results as Arrow tables) -------------

#: Columns `evidence_counts` may group by (validated: they go into the SQL text).
EVIDENCE_GROUPS = ("code", "family", "layer", "source", "severity", "host")


def _arrow(con: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> pa.Table:
    return con.sql(sql, params=params).to_arrow_table()


def table_counts(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Rows per table and the time span of the evidence: a store's one-line summary."""
    row = con.execute(
        "SELECT (SELECT count(*) FROM error_context), (SELECT count(*) FROM spans),"
        " (SELECT count(*) FROM metrics), (SELECT count(*) FROM quarantine),"
        " (SELECT min(ts) FROM error_context), (SELECT max(ts) FROM error_context),"
        " (SELECT min(start_ns) FROM spans), (SELECT max(coalesce(end_ns, start_ns)) FROM spans)"
    ).fetchone()
    assert row is not None
    names = ("error_context", "spans", "metrics", "quarantine")
    out: dict[str, Any] = dict(zip(names, (int(x) for x in row[:4]), strict=True))
    starts = [x for x in (row[4], row[6]) if x is not None]
    ends = [x for x in (row[5], row[7]) if x is not None]
    out["first_ts"] = min(starts) if starts else None
    out["last_ts"] = max(ends) if ends else None
    return out


def failed_trace_table(
    con: duckdb.DuckDBPyConnection,
    *,
    t_start: int | None = None,
    t_end: int | None = None,
    min_http_status: int = 400,
    limit: int = 5000,
) -> pa.Table:
    """One row per trace with an HTTP status >= ``min_http_status`` or an ERROR span,
    newest first: root span name, worst HTTP status, start/end, host, service,
    error span count and the number of records carrying the trace id."""
    return _arrow(
        con,
        "WITH t AS ("
        " SELECT trace_id, min(start_ns) AS start_ns, max(coalesce(end_ns, start_ns)) AS end_ns,"
        " max(http_status) AS http_status,"
        " count(*) FILTER (WHERE status_code = 'ERROR') AS error_spans,"
        " count(*) AS spans,"
        " arg_min(name, CASE WHEN parent_span_id IS NULL THEN 0 ELSE 1 END) AS name,"
        " arg_min(host, CASE WHEN parent_span_id IS NULL THEN 0 ELSE 1 END) AS host,"
        " arg_min(service_name, CASE WHEN parent_span_id IS NULL THEN 0 ELSE 1 END) AS service"
        " FROM spans GROUP BY trace_id"
        " HAVING max(http_status) >= $min_status"
        " OR count(*) FILTER (WHERE status_code = 'ERROR') > 0)"
        " SELECT t.*, (SELECT count(*) FROM error_context e WHERE e.trace_id = t.trace_id)"
        " AS records FROM t"
        " WHERE ($t0 IS NULL OR t.start_ns >= $t0) AND ($t1 IS NULL OR t.start_ns <= $t1)"
        " ORDER BY t.start_ns DESC LIMIT $limit",
        {"min_status": min_http_status, "t0": t_start, "t1": t_end, "limit": limit},
    )


def fetch_events(con: duckdb.DuckDBPyConnection, event_ids: list[str]) -> pa.Table:
    """Full records for these event ids, in time order."""
    return _arrow(
        con,
        f"SELECT {_EC_COLS} FROM error_context WHERE list_contains(?::VARCHAR[], event_id)"
        " ORDER BY ts",
        [event_ids],
    )


def trace_spans(con: duckdb.DuckDBPyConnection, trace_id: str) -> pa.Table:
    """A trace's spans in start order (for a timeline)."""
    return _arrow(
        con, f"SELECT {_SPAN_COLS} FROM spans WHERE trace_id = ? ORDER BY start_ns", [trace_id]
    )


def metric_names(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Each metric name with its sample count, series (host, GPU) count and time span."""
    return _arrow(
        con,
        "SELECT name, count(*) AS samples, count(DISTINCT host) AS hosts,"
        " count(DISTINCT gpu_uuid) AS gpus, min(ts) AS first_ts, max(ts) AS last_ts"
        " FROM metrics GROUP BY name ORDER BY name",
    )


def metric_samples(
    con: duckdb.DuckDBPyConnection,
    names: list[str],
    *,
    t_start: int | None = None,
    t_end: int | None = None,
    host: str | None = None,
    gpu_uuid: str | None = None,
    limit: int = 200_000,
) -> pa.Table:
    """Samples of these metrics in time order (optionally one host / one GPU)."""
    return _arrow(
        con,
        "SELECT ts, name, host, gpu_uuid, labels, value, source FROM metrics"
        " WHERE list_contains($names, name)"
        " AND ($t0 IS NULL OR ts >= $t0) AND ($t1 IS NULL OR ts <= $t1)"
        " AND ($host IS NULL OR host = $host) AND ($gpu IS NULL OR gpu_uuid = $gpu)"
        " ORDER BY ts LIMIT $limit",
        {
            "names": names,
            "t0": t_start,
            "t1": t_end,
            "host": host,
            "gpu": gpu_uuid,
            "limit": limit,
        },
    )


def hardware_events(
    con: duckdb.DuckDBPyConnection,
    *,
    t_start: int | None = None,
    t_end: int | None = None,
    limit: int = 20_000,
) -> pa.Table:
    """Records that carry an Xid number or SM error registers, in time order."""
    return _arrow(
        con,
        "SELECT event_id, ts, host, gpu_uuid, gpu_index, code, family, layer, xid, sm_error,"
        " message FROM error_context"
        " WHERE (xid IS NOT NULL OR sm_error IS NOT NULL)"
        " AND ($t0 IS NULL OR ts >= $t0) AND ($t1 IS NULL OR ts <= $t1)"
        " ORDER BY ts LIMIT $limit",
        {"t0": t_start, "t1": t_end, "limit": limit},
    )


def _record_filter() -> str:
    """The WHERE clause of the record filters; its parameters: :func:`_record_params`."""
    return (
        " ($code IS NULL OR code = $code) AND ($family IS NULL OR family = $family)"
        " AND ($layer IS NULL OR layer = $layer) AND ($trace IS NULL OR trace_id = $trace)"
        " AND ($t0 IS NULL OR ts >= $t0) AND ($t1 IS NULL OR ts <= $t1)"
    )


def _record_params(
    code: str | None,
    family: str | None,
    layer: int | None,
    trace_id: str | None,
    t_start: int | None,
    t_end: int | None,
) -> dict[str, Any]:
    return {
        "code": code,
        "family": family,
        "layer": layer,
        "trace": trace_id,
        "t0": t_start,
        "t1": t_end,
    }


def evidence_counts(
    con: duckdb.DuckDBPyConnection,
    *,
    by: str = "family",
    bucket_s: int = 60,
    code: str | None = None,
    family: str | None = None,
    layer: int | None = None,
    trace_id: str | None = None,
    t_start: int | None = None,
    t_end: int | None = None,
) -> pa.Table:
    """Record counts per time bucket (``bucket_ts``, ns) and ``by`` column (``key``)."""
    if by not in EVIDENCE_GROUPS:
        raise ValueError(f"cannot group by {by!r}; one of {EVIDENCE_GROUPS}")
    return _arrow(
        con,
        f"SELECT (ts // $b) * $b AS bucket_ts, CAST({by} AS VARCHAR) AS key, count(*) AS n"
        " FROM error_context WHERE" + _record_filter() + " GROUP BY ALL ORDER BY 1, 2",
        {
            "b": max(1, int(bucket_s)) * 1_000_000_000,
            **_record_params(code, family, layer, trace_id, t_start, t_end),
        },
    )


def records_page(
    con: duckdb.DuckDBPyConnection,
    *,
    code: str | None = None,
    family: str | None = None,
    layer: int | None = None,
    trace_id: str | None = None,
    t_start: int | None = None,
    t_end: int | None = None,
    limit: int = 1000,
) -> pa.Table:
    """The newest records matching the filters (no ``raw``/``attrs`` payloads)."""
    return _arrow(
        con,
        "SELECT event_id, ts, trace_id, request_id, host, gpu_uuid, gpu_index, source, code,"
        " family, layer, severity, xid, kv_block, confidence, message FROM error_context"
        " WHERE" + _record_filter() + " ORDER BY ts DESC LIMIT $limit",
        {**_record_params(code, family, layer, trace_id, t_start, t_end), "limit": limit},
    )


def quarantine_page(con: duckdb.DuckDBPyConnection, *, limit: int = 1000) -> pa.Table:
    """The newest quarantined inputs with their reasons (raw text cut to 500 chars)."""
    return _arrow(
        con,
        "SELECT ts, source, origin, reason, left(raw, 500) AS raw FROM quarantine"
        " ORDER BY ts DESC LIMIT ?",
        [limit],
    )


def quarantine_reasons(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Quarantined inputs counted per reason and source."""
    return _arrow(
        con, "SELECT reason, source, count(*) AS n FROM quarantine GROUP BY ALL ORDER BY n DESC"
    )


__all__ += [
    "EVIDENCE_GROUPS",
    "table_counts",
    "failed_trace_table",
    "fetch_events",
    "trace_spans",
    "metric_names",
    "metric_samples",
    "hardware_events",
    "evidence_counts",
    "records_page",
    "quarantine_page",
    "quarantine_reasons",
]


def codes_by_host(con: duckdb.DuckDBPyConnection, host: str) -> dict[str, int]:
    """Evidence records per code on one host (the lab checks its ground truth with it)."""
    rows = con.execute(
        "SELECT code, count(*) FROM error_context WHERE host = ? GROUP BY code", [host]
    ).fetchall()
    return {str(c): int(n) for c, n in rows}


__all__ += ["codes_by_host"]


def host_gpus(
    con: duckdb.DuckDBPyConnection, *, hosts: list[str], t_start: int, t_end: int
) -> list[str]:
    """GPUs that records of these hosts name in the window."""
    if not hosts:
        return []
    rows = con.execute(
        "SELECT DISTINCT gpu_uuid FROM error_context WHERE ts BETWEEN ? AND ?"
        " AND list_contains(?::VARCHAR[], host) AND gpu_uuid IS NOT NULL ORDER BY 1 LIMIT 64",
        [t_start, t_end, hosts],
    ).fetchall()
    return [str(r[0]) for r in rows]


__all__ += ["host_gpus"]
