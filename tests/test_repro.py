from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graph.catalog import load_catalog
from ingest import schema as S
from ingest.store import Store
from rca.cli import app

runner = CliRunner()


def _store_record(tmp_path: Path, attrs: dict) -> tuple[Path, str]:
    db = tmp_path / "r.duckdb"
    rec = S.ErrorContext.from_catalog(
        load_catalog()["LOGITS_NAN"],
        source="probe:ops",
        trace_id="ab" * 16,
        message="nan in logits of lm_head",
        attrs=attrs,
    )
    Store(db).insert_records([rec])
    return db, rec.event_id


def test_repro_script_reproduces_a_numerical_failure(tmp_path: Path) -> None:
    attrs = {
        "check": "numerical",
        "module": "lm_head",
        "kind": "nan",
        "shape": [4, 32000],
        "dtype": "float32",
        "snapshot": {"of": "input", "k": 4, "values": [0.5, float("nan"), float("inf"), -1.0]},
    }
    db, eid = _store_record(tmp_path, attrs)
    out = tmp_path / "repro.py"
    res = runner.invoke(app, ["repro", eid, "--db", str(db), "--out", str(out)])
    assert res.exit_code == 0, res.output
    run = subprocess.run([sys.executable, str(out)], capture_output=True, text=True)
    assert run.returncode == 1
    assert "reproduced: 2 of 4 snapshot values fail the numerical check" in run.stdout
    assert "lm_head" in out.read_text()


def test_repro_of_an_index_check_and_of_a_healthy_snapshot(tmp_path: Path) -> None:
    attrs = {
        "check": "token_ids",
        "site": "input_ids",
        "lo": 0,
        "hi_exclusive": 32000,
        "snapshot": {"of": "checked", "k": 3, "values": [17, 31999, 32000]},
    }
    db, eid = _store_record(tmp_path, attrs)
    out = tmp_path / "r.py"
    runner.invoke(app, ["repro", eid, "--db", str(db), "--out", str(out)])
    run = subprocess.run([sys.executable, str(out)], capture_output=True, text=True)
    assert run.returncode == 1 and "value[2] = 32000" in run.stdout
    attrs["snapshot"]["values"] = [1, 2, 3]
    db2, eid2 = _store_record(tmp_path / "b", attrs)
    runner.invoke(app, ["repro", eid2, "--db", str(db2), "--out", str(out)])
    assert subprocess.run([sys.executable, str(out)], capture_output=True).returncode == 0


def test_repro_without_a_snapshot_says_how_to_get_one(tmp_path: Path) -> None:
    db, eid = _store_record(tmp_path, {"check": "numerical", "module": "lm_head"})
    proc = subprocess.run(
        [sys.executable, "-m", "rca.cli", "repro", eid, "--db", str(db)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 1 and "snapshot=True" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "rca.cli", "repro", "nope", "--db", str(db)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 1 and "event nope not found" in proc.stderr


def test_repro_from_a_real_checker_record(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from probes.ops import instrument
    from probes.sink import MemorySink

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    sink = MemorySink()
    checker = instrument(model, "numerical", sink=sink, snapshot=True)
    with checker.step(["cd" * 16]):
        model(torch.ones(1, 8))
    recs = [r for r in sink.records if isinstance(r, S.ErrorContext) and r.attrs.get("snapshot")]
    assert recs, [r.code for r in sink.records]
    db = tmp_path / "x.duckdb"
    Store(db).insert_records(recs)
    out = tmp_path / "r.py"
    res = runner.invoke(app, ["repro", recs[0].event_id, "--db", str(db), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "import math" in out.read_text()
