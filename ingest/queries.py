"""Read queries the analysis layer needs; every statement is parameterized."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import duckdb

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
) -> list[dict[str, Any]]:
    """Records in [t_start, t_end] that share a request id, GPU or host with the trace,
    aggregated per (code, scope): a busy host's thousands of warnings become a few rows.

    Scope is ``request`` (same request id), ``gpu`` (same GPU) or ``host``. Records
    of other traces are kept only at layers 1-4 (shared hardware, memory and KV
    state), not their own engine/model/API symptoms. Each row carries ``n``,
    ``first_ts``, ``last_ts``, ``confidence``, ``severity``, and the earliest
    ``ids_per_group`` event ids with (ts, code, source, message) for display.
    """
    if not (hosts or gpus or request_ids):
        return []
    return _dicts(
        con.execute(
            "SELECT code,"
            " CASE WHEN list_contains($req, request_id) THEN 'request'"
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
            " GROUP BY ALL ORDER BY first_ts",
            {
                "req": request_ids,
                "gpus": gpus,
                "hosts": hosts,
                "t0": t_start,
                "t1": t_end,
                "tid": trace_id or "",
                "k": ids_per_group,
            },
        )
    )


def recent_traces(
    con: duckdb.DuckDBPyConnection, *, limit: int = 20, min_http_status: int = 400
) -> list[dict[str, Any]]:
    """The most recent failed server spans: a starting point for ``rca query``."""
    return _dicts(
        con.execute(
            "SELECT trace_id, name, http_status, status_code, start_ns, end_ns, host FROM spans"
            " WHERE parent_span_id IS NULL AND (http_status >= ? OR status_code = 'ERROR')"
            " ORDER BY start_ns DESC LIMIT ?",
            [min_http_status, limit],
        )
    )


def root_status_counts(con: duckdb.DuckDBPyConnection, trace_ids: list[str]) -> dict[int, int]:
    """HTTP status -> number of root server spans, for the given traces (all if empty)."""
    rows = con.execute(
        "SELECT http_status, count(*) FROM spans WHERE parent_span_id IS NULL"
        " AND http_status IS NOT NULL"
        " AND (len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], trace_id))"
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
