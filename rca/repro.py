"""`rca repro EVENT_ID`: a standalone script that re-runs a failed operator check.

It rebuilds the bounded input snapshot saved with the record (opt-in:
``instrument(model, snapshot=True)``; never whole tensors, never prompts by
default) and re-runs the same check with plain Python, so the failure can be
reproduced and bisected away from the server. The script exits 1 when the
failure reproduces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from graph.errors import InputError, NotFoundError
from ingest import queries

__all__ = ["repro_script", "write_repro"]

_TEMPLATE = '''#!/usr/bin/env python3
"""Reproduce rca event {event_id}: {code} ({message})

Recorded by {source} on host {host}, trace {trace_id}.
The values below are the bounded snapshot saved with the record ({n} of the
{of} values of {where}, shape {shape}, dtype {dtype}). To re-run the op itself,
load your model and call the module named above on a tensor built from them:
    x = torch.tensor(VALUES, dtype=torch.{dtype})
"""
import math
import sys

CHECK = {check!r}
VALUES = {values}
LIMITS = {limits}


def as_float(v):
    return float(v)  # "nan", "inf" and "-inf" parse too


def failures(values, check, limits):
    bad = []
    for i, raw in enumerate(values):
        v = as_float(raw)
        if check == "numerical":
            lo, hi = limits.get("range") or (None, None)
            if math.isnan(v) or math.isinf(v):
                bad.append((i, raw, "non-finite"))
            elif lo is not None and not (float(lo) <= v <= float(hi)):
                bad.append((i, raw, f"outside [{{lo}}, {{hi}}]"))
        else:
            lo = limits.get("lo")
            hi = limits.get("hi_exclusive")
            if (lo is not None and v < lo) or (hi is not None and v >= hi):
                bad.append((i, raw, f"outside [{{lo}}, {{hi}})"))
    return bad


if __name__ == "__main__":
    bad = failures(VALUES, CHECK, LIMITS)
    for i, raw, why in bad[:20]:
        print(f"value[{{i}}] = {{raw}}: {{why}}")
    if bad:
        n = len(VALUES)
        print(f"reproduced: {{len(bad)}} of {{n}} snapshot values fail the {{CHECK}} check")
        sys.exit(1)
    print("not reproduced: every snapshot value passes the check")
'''


def repro_script(record: dict[str, Any]) -> str:
    attrs = record.get("attrs") or {}
    if isinstance(attrs, str):
        attrs = json.loads(attrs)
    snap = attrs.get("snapshot")
    if not snap or not snap.get("values"):
        raise InputError(
            f"record {record['event_id']} ({record['code']}) has no input snapshot: snapshots "
            "are opt-in, enable them with instrument(model, snapshot=True) (or "
            '{"snapshot": true} on /health/checker_status) and reproduce the failure'
        )
    limits = {k: attrs[k] for k in ("range", "lo", "hi_exclusive") if k in attrs}
    return _TEMPLATE.format(
        event_id=record["event_id"],
        code=record["code"],
        message=(record.get("message") or "").replace('"""', "'''")[:200],
        source=record.get("source"),
        host=record.get("host"),
        trace_id=record.get("trace_id"),
        n=len(snap["values"]),
        of=snap.get("of", "input"),
        where=attrs.get("module") or attrs.get("site") or "?",
        shape=attrs.get("shape"),
        dtype=attrs.get("dtype", "float32"),
        check=attrs.get("check", "numerical"),
        values=json.dumps(snap["values"]).replace("NaN", '"nan"').replace("Infinity", '"inf"'),
        limits=json.dumps(limits),
    )


def write_repro(
    event_id: str, *, db: str | Path | None = None, out: str | Path | None = None
) -> Path:
    """Write the script for a stored event; returns its path."""
    from rca.query import open_store

    store = open_store(db)
    with store.read() as con:
        record = queries.fetch_event(con, event_id.strip())
    if record is None:
        raise NotFoundError(f"event {event_id} not found in {store.path}")
    path = Path(out) if out else Path(f"repro_{event_id[:8]}.py")
    path.write_text(repro_script(record))
    path.chmod(0o755)
    return path
