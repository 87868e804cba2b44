"""`rca query`: gather one trace's evidence from the store and rank its root causes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from graph.catalog import Catalog, default_catalog
from graph.errors import InputError, NotFoundError
from graph.topology import default_topology
from ingest import queries
from ingest.paths import default_db_path, spool_dir_for
from ingest.spool import load_spool
from ingest.store import Store
from rca.engine import (
    Diagnosis,
    Scope,
    Weights,
    evidence_from_groups,
    evidence_from_rows,
    rank_root_causes,
    sm_rule_edges,
)
from rca.engine import symptom_from_spans as _symptom_from_spans

__all__ = ["diagnose_trace", "open_store", "DEFAULT_WINDOW_S"]

DEFAULT_WINDOW_S = 300.0
_REQUEST_ID_KEYS = (
    "gen_ai.response.id",
    "request_id",
    "llm.request_id",
    "vllm.request_id",
    "rca.request_id",
)


def open_store(db: str | Path | None = None, *, load: bool = True) -> Store:
    """The store at ``db`` (default location if None), with the spool loaded first."""
    store = Store(db if db is not None else default_db_path())
    if load:
        load_spool(store, spool_dir_for(store.path), blocking=False)
    return store


def _request_ids(spans: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[str]:
    ids = {r["request_id"] for r in records if r.get("request_id")}
    for sp in spans:
        try:
            attrs = json.loads(sp.get("attributes") or "{}")
        except ValueError:
            continue
        for key in _REQUEST_ID_KEYS:
            if isinstance(attrs.get(key), str):
                ids.add(attrs[key])
    return sorted(ids)


def diagnose_trace(
    trace_id: str,
    *,
    store: Store | None = None,
    db: str | Path | None = None,
    window_s: float = DEFAULT_WINDOW_S,
    catalog: Catalog | None = None,
    weights: Weights | None = None,
    top: int = 5,
) -> Diagnosis:
    """Rank the root causes of the failure seen by one trace.

    Gathers the trace's spans and records, then the records of the same
    request ids, GPUs and hosts in ``window_s`` before the symptom (and a
    short grace after it, for clock skew), and ranks them on the topology.
    """
    tid = trace_id.strip().lower()
    if not tid or len(tid) > 64 or any(c not in "0123456789abcdef-" for c in tid):
        raise InputError(f"not a trace id: {trace_id!r} (expected 32 hex digits)")
    catalog = catalog or default_catalog()
    store = store or open_store(db)
    with store.read() as con:
        rows = queries.fetch_trace(con, tid)
        if not rows.spans and not rows.records:
            raise NotFoundError(f"trace {tid} not found in {store.path}")
        symptom, t_sym = _symptom_from_spans(rows.spans, catalog)
        if not t_sym:
            t_sym = max(
                [r["ts"] for r in rows.records]
                + [s.get("end_ns") or s["start_ns"] for s in rows.spans]
            )
        t_first = min([r["ts"] for r in rows.records] + [s["start_ns"] for s in rows.spans])
        t_start = min(t_first, t_sym) - int(window_s * 1e9)
        t_end = max([t_sym + 5_000_000_000] + [r["ts"] for r in rows.records])
        hosts = sorted({x["host"] for x in rows.spans + rows.records if x.get("host")})
        gpus = sorted({r["gpu_uuid"] for r in rows.records if r.get("gpu_uuid")})
        req_ids = _request_ids(rows.spans, rows.records)
        context = queries.fetch_context(
            con,
            trace_id=tid,
            t_start=t_start,
            t_end=t_end,
            hosts=hosts,
            gpus=gpus,
            request_ids=req_ids,
        )
        sm_rows = queries.fetch_sm_errors(con, gpus=gpus, t_start=t_start, t_end=t_end)
        evidence = evidence_from_rows(rows.records, Scope.TRACE)
        evidence += evidence_from_groups(context)
        sm_add, sm_drop, sm_note = sm_rule_edges(
            [json.loads(r["sm_error"]) for r in sm_rows],
            {r["code"] for r in sm_rows},
            {e.code for e in evidence},
            catalog,
        )
        symptom, causes = rank_root_causes(
            default_topology(),
            evidence,
            catalog=catalog,
            symptom=symptom,
            symptom_ts=t_sym,
            weights=weights,
            top=top,
            extra_edges=sm_add,
            drop_edges=sm_drop,
        )
    used = {e for c in causes[:1] for e in c.evidence}
    shown = [r for r in rows.records if r["event_id"] in used]
    shown += [r for g in context for r in g["rows"] if r["event_id"] in used]
    return Diagnosis(
        trace_id=tid,
        symptom=symptom,
        causes=causes,
        window=(t_start, t_end),
        evidence_rows=sum(e.count for e in evidence),
        evidence=shown,
        notes=[sm_note] if sm_note else [],
    )
