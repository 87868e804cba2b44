"""Read queries the analysis layer needs; every statement is parameterized."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import duckdb

from ingest import schema as S
from ingest.store import Store

__all__ = ["TraceRows", "fetch_trace", "fetch_context", "fetch_events", "recent_traces"]

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
    context: list[dict[str, Any]] = field(default_factory=list)


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
    limit: int = 5000,
) -> list[dict[str, Any]]:
    """Records in [t_start, t_end] sharing a host, GPU or request id, outside the trace."""
    if not (hosts or gpus or request_ids):
        return []
    return _dicts(
        con.execute(
            f"SELECT {_EC_COLS} FROM error_context"
            " WHERE ts BETWEEN ? AND ?"
            " AND (list_contains(?::VARCHAR[], host) OR list_contains(?::VARCHAR[], gpu_uuid)"
            "      OR list_contains(?::VARCHAR[], request_id))"
            " AND (trace_id IS NULL OR trace_id <> ?)"
            " ORDER BY ts DESC LIMIT ?",
            [t_start, t_end, hosts, gpus, request_ids, trace_id or "", limit],
        )
    )


def fetch_events(con: duckdb.DuckDBPyConnection, event_ids: list[str]) -> list[dict[str, Any]]:
    return _dicts(
        con.execute(
            f"SELECT {_EC_COLS} FROM error_context WHERE list_contains(?::VARCHAR[], event_id)"
            " ORDER BY ts",
            [event_ids],
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


def open_for_query(store: Store):  # type: ignore[no-untyped-def]
    return store.read()


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
