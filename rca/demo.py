"""`rca demo`: the fault-injection lab end to end, or a bundled example.

:func:`run_lab_demo` (the default) starts the lab (``rca/lab``) on a few
simulated replicas, drives a mixed workload with one injected fault each (a
scripted Xid 48 with real KV bit flips, an inf in a weight, a leaking KV
block manager, a flood of retries, an adapter with too high a rank, an
application kernel reading out of bounds), captures everything through the
real probes, spool and ingest into the store, and answers each incident.

:func:`run_demo` with ``example`` loads a bundled example instead: realistic
text (a kernel log with Xid lines, a vLLM server log with a chained traceback,
OTLP/JSON traces as a Collector file exporter writes them) plus the records our
probes would have emitted, which go through the real spool. Loading an example
is idempotent: a second run adds nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graph.catalog import default_catalog
from ingest import queries
from ingest import schema as S
from ingest.logs import parse_log_file
from ingest.otlp import parse_otlp_file
from ingest.paths import default_db_path, spool_dir_for
from ingest.spool import SpoolWriter, load_spool
from ingest.store import Store
from rca.engine import Diagnosis
from rca.query import diagnose_trace

__all__ = ["EXAMPLES_DIR", "DEMO_FAULTS", "DemoReport", "load_example", "run_demo", "run_lab_demo"]

#: The faults `rca demo` injects, one per simulated replica (a mix of families).
DEMO_FAULTS = (
    "xid48_dbe",
    "weight_inf",
    "kv_block_leak",
    "queue_flood",
    "lora_rank",
    "illegal_address_app",
)
#: The short mode (tests): fewer replicas.
DEMO_FAULTS_QUICK = ("xid48_dbe", "queue_flood", "lora_rank")

EXAMPLES_DIR = Path(__file__).with_name("examples")


@dataclass
class DemoReport:
    description: str
    db: str
    counts: dict[str, int]
    requests: dict[int, int]
    incidents: list[Diagnosis]
    expected: dict[str, str]
    next_commands: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "db": self.db,
            "description": self.description,
            "requests": {str(k): v for k, v in sorted(self.requests.items())},
            "incidents": [
                {
                    "trace_id": d.trace_id,
                    "symptom": d.symptom,
                    "injected": {
                        "code": self.expected.get(d.trace_id or ""),
                        "family": _family(self.expected.get(d.trace_id or "")),
                    },
                    "causes": [c.to_dict() for c in d.causes],
                }
                for d in self.incidents
            ],
            "next": self.next_commands,
        }


def _family(code: str | None) -> str | None:
    c = default_catalog().get(code) if code else None
    return c.family if c else None


def load_example(store: Store, name: str = "xid48_ecc") -> dict[str, int]:
    """Ingest one bundled example (idempotent); returns rows added per table."""
    folder = EXAMPLES_DIR / name
    manifest = json.loads((folder / "manifest.json").read_text())
    key = f"example:{manifest['name']}:v{manifest['version']}"
    with store.writer_lock(), store.write() as con:
        if Store.source_loaded(con, key):
            return {"error_context": 0, "spans": 0, "quarantine": 0}
    counts = {"error_context": 0, "spans": 0, "quarantine": 0}
    records: list[S.ErrorContext] = []
    spans: list[S.Span] = []
    quarantine: list[dict[str, Any]] = []
    gpu_map: dict = {}
    for f in manifest["files"]:
        path = folder / f["path"]
        if f["format"] == "log":
            res = parse_log_file(
                path, host=manifest["host"], year=manifest["year"], gpu_map=gpu_map
            )
            gpu_map.update(res.gpu_map)
            records += res.records
            quarantine += res.quarantine
        elif f["format"] == "otlp-json":
            ores = parse_otlp_file(path)
            spans += ores.spans
            quarantine += ores.quarantine
        elif f["format"] == "probe-spool":
            # what the in-process probes emitted: written through the real spool
            writer = SpoolWriter(spool_dir_for(store.path), strict=True)
            for row in json.loads(path.read_text())["records"]:
                code = default_catalog()[row.pop("code")]
                writer.emit(S.ErrorContext.from_catalog(code, **row))
            writer.close()
    rep = load_spool(store, spool_dir_for(store.path))
    counts["error_context"] += rep.rows["error_context"]
    with store.writer_lock(), store.write() as con:
        con.execute("BEGIN TRANSACTION")
        counts["error_context"] += Store.insert_arrow(
            con, S.ERROR_CONTEXT, S.records_to_arrow(records)
        )
        counts["spans"] += Store.insert_arrow(con, S.SPANS, S.records_to_arrow(spans, S.SPANS))
        counts["quarantine"] += Store.insert_arrow(
            con, S.QUARANTINE, S.records_to_arrow(quarantine, S.QUARANTINE)
        )
        Store.mark_source_loaded(con, key, str(folder), sum(counts.values()))
        con.execute("COMMIT")
    return counts


def run_demo(db: str | Path | None = None, name: str = "xid48_ecc") -> DemoReport:
    store = Store(db if db is not None else default_db_path())
    counts = load_example(store, name)
    manifest = json.loads((EXAMPLES_DIR / name / "manifest.json").read_text())
    expected: dict[str, str] = manifest.get("expected", {})
    with store.read() as con:
        failed = [r for r in queries.recent_traces(con, limit=1000) if r["trace_id"] in expected]
        statuses = queries.root_status_counts(con, list(expected) + _all_trace_ids(manifest))
    incidents = [
        diagnose_trace(r["trace_id"], store=store)
        for r in sorted(failed, key=lambda r: r["start_ns"])
    ]
    db_arg = "" if db is None else f" --db {db}"
    nxt = [f"rca query --trace-id {d.trace_id}{db_arg}" for d in incidents[:1]]
    nxt += [f"rca query --trace-id {incidents[0].trace_id} --json{db_arg}"] if incidents else []
    nxt += [f"rca traces{db_arg}", "rca codes --layer 1"]
    return DemoReport(
        manifest["description"], str(store.path), counts, statuses, incidents, expected, nxt
    )


def _all_trace_ids(manifest: dict[str, Any]) -> list[str]:
    return manifest.get("traces", [])


def run_lab_demo(
    db: str | Path | None = None,
    *,
    quick: bool = False,
    seed: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> DemoReport:
    """Run the lab with injected faults into the store and answer each incident."""
    import secrets
    import tempfile

    from rca.lab.runner import Scenario, run_scenario

    store = Store(db if db is not None else default_db_path())
    faults = DEMO_FAULTS_QUICK if quick else DEMO_FAULTS
    run = secrets.token_hex(3) if seed is None else f"s{seed}"
    rng_seed = seed if seed is not None else int.from_bytes(secrets.token_bytes(4), "big")
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="rca-demo-") as work:
        for i, name in enumerate(faults):
            if progress is not None:
                progress(i, len(faults), name)
            sc = Scenario(
                scenario_id=f"{run}-{i}",
                host=f"lab-demo-{run}-{i}",
                primary=name,
                seed=(rng_seed * 31 + i) % (1 << 30),
                n_requests=10,
                at_step=20 + 3 * i,
                noise_bad_client=i % 2 == 0,
                tight_pool=i % 3 == 0,
            )
            out = run_scenario(sc, store, Path(work))
            for retry in range(2):  # the fault met no request (it can act between requests)
                if out.incident_trace is not None:
                    break
                sc = dataclasses.replace(
                    sc,
                    scenario_id=f"{sc.scenario_id}r{retry}",
                    host=f"{sc.host}r{retry}",  # a fresh replica: no evidence carried over
                    seed=sc.seed + 1000 * (retry + 1),
                )
                out = run_scenario(sc, store, Path(work))
            outcomes.append(out)
        if progress is not None:
            progress(len(faults), len(faults), "done")
    statuses: dict[int, int] = {}
    for o in outcomes:
        for st, n in o.statuses.items():
            statuses[st] = statuses.get(st, 0) + n
    expected = {o.incident_trace: o.code for o in outcomes if o.incident_trace}
    incidents = [diagnose_trace(t, store=store) for t in expected]
    db_arg = "" if db is None else f" --db {db}"
    nxt = [f"rca query --trace-id {d.trace_id}{db_arg}" for d in incidents[:1]]
    nxt += [f"rca traces{db_arg}", f"rca dashboard{db_arg}"]
    desc = (
        f"fault-injection lab: {len(outcomes)} replicas (hosts lab-demo-{run}-N), "
        f"one injected fault each: {', '.join(faults)}"
    )
    counts = {
        "replicas": len(outcomes),
        "requests": sum(statuses.values()),
        "incidents": len(incidents),
    }
    return DemoReport(desc, str(store.path), counts, statuses, incidents, expected, nxt)
