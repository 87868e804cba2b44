"""`rca query`: gather one trace's evidence from the store and rank its root causes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graph.catalog import Catalog, default_catalog
from graph.errors import InputError, NotFoundError
from graph.topology import default_topology
from ingest import queries
from ingest import schema as S
from ingest.paths import default_db_path, spool_dir_for
from ingest.spool import load_spool
from ingest.store import Store
from rca.engine import (
    Diagnosis,
    Evidence,
    RootCause,
    Scope,
    Weights,
    evidence_from_groups,
    evidence_from_rows,
    rank_root_causes,
    sm_rule_edges,
)
from rca.engine import symptom_from_spans as _symptom_from_spans

__all__ = [
    "DEFAULT_WINDOW_S",
    "Gathered",
    "diagnose_trace",
    "gather_evidence",
    "open_store",
    "rank_gathered",
]

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


@dataclass
class Gathered:
    """What the ranking sees for one failed trace (see :func:`gather_evidence`)."""

    trace_id: str
    symptom: str | None
    symptom_ts: int
    evidence: list[Evidence]
    extra_edges: list[tuple[str, str, float]] = field(default_factory=list)
    drop_edges: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    window: tuple[int, int] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)  # records, for display


def _own_pids(records: list[dict[str, Any]], spans: list[dict[str, Any]]) -> list[int]:
    """The trace's processes as the host kernel names them: the pids of its
    in-process probe records and the host pid our span exporter stamps on a
    span's resource (:func:`ingest.schema.own_pid`, absent in a container's
    pid namespace, where ``os.getpid()`` is not the pid an NVRM Xid line
    prints). A pid an engine printed in its own log line, or OpenTelemetry's
    ``process.pid``, is that namespace's number, so it is not compared with
    the driver's."""
    pids = {
        int(r["pid"])
        for r in records
        if r.get("pid") is not None and str(r.get("source") or "").startswith("probe:")
    }
    for s in spans:
        res = s.get("resource")
        try:
            pid = (json.loads(res) if isinstance(res, str) else res or {}).get(S.HOST_PID_KEY)
        except (ValueError, AttributeError):
            continue
        if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
            pids.add(pid)
    return sorted(pids)


def gather_evidence(
    trace_id: str,
    store: Store,
    window_s: float = DEFAULT_WINDOW_S,
    catalog: Catalog | None = None,
) -> Gathered:
    """Collect the evidence of the failure seen by one trace.

    The trace's spans and records, then the records of the same request ids,
    GPUs and hosts in ``window_s`` before the symptom (and a short grace after
    it, for clock skew), plus the SM-fault reading of Xid 13/31 as edges.
    """
    tid = trace_id.strip().lower()
    if not tid or len(tid) > 64 or any(c not in "0123456789abcdef-" for c in tid):
        raise InputError(f"not a trace id: {trace_id!r} (expected 32 hex digits)")
    catalog = catalog or default_catalog()
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
            pids=_own_pids(rows.records, rows.spans),
        )
        # a trace whose records name no GPU (probes on a host without device ids)
        # still gets NVIDIA's SM reading for the GPUs its host's evidence names
        sm_gpus = gpus or queries.host_gpus(con, hosts=hosts, t_start=t_start, t_end=t_end)
        sm_rows = queries.fetch_sm_errors(con, gpus=sm_gpus, t_start=t_start, t_end=t_end)
    evidence = evidence_from_rows(rows.records, Scope.TRACE)
    evidence += evidence_from_groups(context)
    sm_add, sm_drop, sm_note = sm_rule_edges(
        [json.loads(r["sm_error"]) for r in sm_rows],
        {r["code"] for r in sm_rows},
        {e.code for e in evidence},
        catalog,
    )
    return Gathered(
        trace_id=tid,
        symptom=symptom,
        symptom_ts=t_sym,
        evidence=evidence,
        extra_edges=list(sm_add),
        drop_edges=list(sm_drop),
        notes=[sm_note] if sm_note else [],
        window=(t_start, t_end),
        rows=list(rows.records) + [r for g in context for r in g["rows"]],
    )


def rank_gathered(
    gathered: Gathered,
    *,
    catalog: Catalog | None = None,
    weights: Weights | None = None,
    top: int = 5,
) -> tuple[str | None, list[RootCause]]:
    """Rank the root causes in ``gathered`` on the default topology.

    Observed codes the topology does not connect to the symptom stay in the
    answer, last, with an explicitly inferred weak link: an unexplained error
    on the trace is worth showing, never worth hiding.
    """
    return rank_root_causes(
        default_topology(),
        gathered.evidence,
        catalog=catalog or default_catalog(),
        symptom=gathered.symptom,
        symptom_ts=gathered.symptom_ts,
        weights=weights,
        top=top,
        extra_edges=gathered.extra_edges,
        drop_edges=gathered.drop_edges,
        unconnected=True,
    )


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

    Gathers the trace's evidence (:func:`gather_evidence`) and ranks it on the
    topology (:func:`rank_gathered`).
    """
    tid = trace_id.strip().lower()
    if not tid or len(tid) > 64 or any(c not in "0123456789abcdef-" for c in tid):
        raise InputError(f"not a trace id: {trace_id!r} (expected 32 hex digits)")
    catalog = catalog or default_catalog()
    store = store or open_store(db)
    gathered = gather_evidence(tid, store, window_s, catalog)
    symptom, causes = rank_gathered(gathered, catalog=catalog, weights=weights, top=top)
    used = {e for c in causes[:1] for e in c.evidence}
    return Diagnosis(
        trace_id=gathered.trace_id,
        symptom=symptom,
        causes=causes,
        window=gathered.window,
        evidence_rows=sum(e.count for e in gathered.evidence),
        evidence=[r for r in gathered.rows if r["event_id"] in used],
        notes=list(gathered.notes),
    )
