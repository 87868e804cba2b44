"""Every fault injector leaves its ground-truth code in the store, as evidence
of the failed request's trace (on the trace's own record when a probe in the
serving process caught it), and the demo runs end to end (short mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ingest import queries  # noqa: E402
from ingest.store import Store  # noqa: E402
from rca.lab.faults import FAULTS, fault_types  # noqa: E402
from rca.lab.runner import Scenario, run_scenario  # noqa: E402

#: Faults the in-process probes catch (operator checks, KV fingerprints): their
#: record is stamped with the failing request's trace id where it is made.
CAUGHT_IN_PROCESS = {
    "weight_inf",
    "norm_nan",
    "tokenizer_oov",
    "position_overflow",
    "kv_corruption",
}


@pytest.mark.parametrize("name", fault_types())
def test_injector_leaves_its_ground_truth_in_the_store(name: str, tmp_path: Path) -> None:
    store = Store(tmp_path / "lab.duckdb")
    sc = Scenario("t", f"lab-test-{name}", name, seed=7, n_requests=8, at_step=20)
    out = run_scenario(sc, store, tmp_path)
    with store.read() as con:
        codes = queries.codes_by_host(con, sc.host)
    assert out.code == FAULTS[name].code
    assert out.code in codes, f"{name}: {out.code} not among {sorted(codes)}"
    # the fault hit a request, which failed with the status the fault predicts
    assert out.incident_trace is not None, f"{name}: no request failed ({out.statuses})"
    hit = next(r for r in out.requests if r.trace_id == out.incident_trace)
    assert hit.status == FAULTS[name].status, f"{name}: status {hit.status}"
    # and the code reaches that request's trace: its own record (probes stamp
    # the trace id) or context the query joins by request, GPU, host and time
    # (the NVML poller's Xid and throttle records, kernel and engine lines)
    from rca.query import gather_evidence

    ev = gather_evidence(out.incident_trace, store).evidence
    assert out.code in {e.code for e in ev}, f"{name}: {sorted({e.code for e in ev})}"
    if name in CAUGHT_IN_PROCESS:  # the probe's own record carries the trace id
        assert any(e.code == out.code and e.scope == "trace" for e in ev), name


def test_there_are_enough_fault_types_over_the_families() -> None:
    from graph.catalog import default_catalog

    cat = default_catalog()
    families = {cat[f.code].family for f in FAULTS.values()}
    assert len(FAULTS) >= 20
    assert len(families) >= 15, sorted(families)


def test_demo_quick_end_to_end(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rca.cli import app

    db = tmp_path / "demo.duckdb"
    res = CliRunner().invoke(app, ["demo", "--quick", "--seed", "3", "--db", str(db), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert set(report) >= {"incidents", "requests"}
    assert len(report["incidents"]) == 3
    for inc in report["incidents"]:
        assert set(inc) >= {"trace_id", "injected", "causes"}
        assert inc["injected"]["code"] and inc["injected"]["family"]
        assert inc["causes"], inc
        assert inc["causes"][0]["code"] == inc["injected"]["code"], inc["causes"][0]
    assert sum(report["requests"].values()) > 10
    assert any(int(s) >= 400 for s in report["requests"])
    # rca traces lists them, though their server spans have a remote parent
    # (the client's traceparent): local roots count
    tr = CliRunner().invoke(app, ["traces", "--db", str(db), "--json", "--limit", "500"])
    listed = {r["trace_id"] for r in json.loads(tr.output)}
    assert {i["trace_id"] for i in report["incidents"]} <= listed
    # the store is left where rca query finds it
    tid = report["incidents"][0]["trace_id"]
    q = CliRunner().invoke(app, ["query", "--trace-id", tid, "--db", str(db), "--json"])
    assert q.exit_code == 0, q.output
    assert json.loads(q.output)["causes"][0]["code"] == report["incidents"][0]["injected"]["code"]
