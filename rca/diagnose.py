"""`rca diagnose`: a postmortem of crash logs and bundles with no trace id.

The files are ingested (into a temporary store, or ``--db``), every evidence
line becomes evidence of one incident, chained tracebacks add the causation
they show (deepest exception -> later ones), and the ranking names the deepest
cause, not the last line.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from graph.catalog import default_catalog
from graph.topology import default_topology
from ingest.classify import Normalizer
from ingest.pipeline import ingest_paths
from ingest.store import Store
from ingest.tracebacks import raised_at
from rca.engine import Diagnosis, Evidence, Scope, rank_root_causes, sm_rule_edges

__all__ = ["diagnose_paths", "traceback_edges"]

TRACEBACK_STRENGTH = 0.9


def traceback_edges(records: list[Any]) -> list[tuple[str, str, float]]:
    """(cause, effect, strength) for codes linked by one chained traceback."""
    chains: dict[tuple[str, int], list[tuple[int, str]]] = defaultdict(list)
    for r in records:
        tb = (r.attrs or {}).get("traceback")
        if tb:
            chains[(r.attrs["file"], tb["first_line"])].append((tb["position"], r.code))
    edges = []
    for items in chains.values():
        items.sort()
        for i, (_, cause) in enumerate(items):
            for _, effect in items[i + 1 :]:
                if cause != effect:
                    edges.append((cause, effect, TRACEBACK_STRENGTH))
    return edges


def diagnose_paths(
    paths: list[str | Path],
    *,
    db: str | Path | None = None,
    fmt: str = "auto",
    top: int = 5,
    host: str | None = None,
    normalizer: Normalizer | None = None,
) -> tuple[Diagnosis, dict[str, Any]]:
    """Rank the root causes shown by the given files; returns (diagnosis, ingest totals)."""
    with tempfile.TemporaryDirectory(prefix="rca-diagnose-") as tmp:
        store = Store(db if db is not None else Path(tmp) / "diagnose.duckdb")
        report = ingest_paths(
            store,
            paths,
            fmt=fmt,
            host=host,
            normalizer=normalizer,
            keep_records=True,
            reparse_skipped=True,
        )
    records = report.records
    catalog = default_catalog()
    evidence = [
        Evidence(
            event_id=r.event_id,
            code=r.code,
            ts=r.ts,
            scope=Scope.TRACE,
            confidence=r.confidence if r.confidence is not None else 1.0,
            severity=r.severity,
            message=r.message,
            source=r.source,
            guess=(r.attrs or {}).get("method") == "model",
        )
        for r in records
    ]
    extra, notes = traceback_edges(records), []
    sm_edges, sm_drop, sm_note = sm_rule_edges(
        [r.sm_error for r in records if r.xid in (13, 31) and r.sm_error],
        {r.code for r in records if r.xid in (13, 31)},
        {r.code for r in records},
        catalog,
    )
    extra += sm_edges
    if sm_note:
        notes.append(sm_note)
    symptom, causes = rank_root_causes(
        default_topology(),
        evidence,
        catalog=catalog,
        top=top,
        extra_edges=extra,
        drop_edges=sm_drop,
        unconnected=True,
    )
    used = {e for c in causes for e in c.evidence}
    shown = [
        {
            "event_id": r.event_id,
            "ts": r.ts,
            "code": r.code,
            "source": r.source,
            "message": r.message,
            "file": (r.attrs or {}).get("file"),
            "line": (r.attrs or {}).get("line"),
            **({"raised_at": where} if (where := raised_at(r.attrs)) else {}),
        }
        for r in records
        if r.event_id in used
    ]
    totals = report.totals()
    diag = Diagnosis(
        trace_id=None,
        symptom=symptom,
        causes=causes,
        evidence_rows=len(evidence),
        evidence=shown,
        notes=notes,
        unclassified=report.unclassified,
        unclassified_count=totals["unclassified"],
    )
    return diag, {"files": [f.to_dict() for f in report.files], **totals}


def diagnosis_dict(diag: Diagnosis) -> dict[str, Any]:
    """`rca query`'s JSON shape, each cause with its evidence lines (file, line)."""
    out = diag.to_dict()
    out["notes"] = list(diag.notes)
    lines = {e["event_id"]: e for e in diag.evidence}
    for cause, d in zip(diag.causes, out["causes"], strict=True):
        d["lines"] = [
            {"file": lines[i]["file"], "line": lines[i]["line"], "code": lines[i]["code"]}
            for i in cause.evidence
            if i in lines
        ]
    return out
