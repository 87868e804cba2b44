from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rca.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture
def demo_db(tmp_path: Path) -> Path:
    db = tmp_path / "demo.duckdb"
    res = runner.invoke(app, ["demo", "--example", "xid48_ecc", "--db", str(db), "--json"])
    assert res.exit_code == 0, res.output
    return db


def test_demo_example_answers_every_incident_with_the_planted_cause(tmp_path: Path) -> None:
    db = tmp_path / "demo.duckdb"
    res = runner.invoke(app, ["demo", "--example", "xid48_ecc", "--db", str(db), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["requests"] == {"200": 3, "500": 2, "503": 1}
    assert len(report["incidents"]) == 3
    for inc in report["incidents"]:
        top = inc["causes"][0]
        assert top["code"] == inc["injected"]["code"] == "GPU_XID_48"
        assert top["chain"][0] == "GPU_XID_48" and top["chain"][-1] == inc["symptom"]
        assert top["evidence"]
    chains = {tuple(i["causes"][0]["chain"]) for i in report["incidents"]}
    assert ("GPU_XID_48", "KV_BLOCK_HASH_MISMATCH", "LOGITS_NAN", "HTTP_500") in chains
    # idempotent: a second run adds nothing and answers the same
    again = json.loads(
        runner.invoke(app, ["demo", "--example", "xid48_ecc", "--db", str(db), "--json"]).output
    )
    assert again["incidents"] == report["incidents"]
    with __import__("duckdb").connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM spans").fetchone()[0] == 12


def test_query_json_shape(demo_db: Path) -> None:
    tid = "000b019542c0d3a5fc78cb0dbcbaf7fb"
    res = runner.invoke(app, ["query", "--trace-id", tid, "--db", str(demo_db), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out) == {"trace_id", "symptom", "causes"}
    assert out["trace_id"] == tid and out["symptom"] == "HTTP_500"
    first = out["causes"][0]
    assert {"rank", "code", "family", "layer", "score", "chain", "evidence", "action"} <= set(first)
    assert first["chain"] == ["GPU_XID_48", "KV_BLOCK_HASH_MISMATCH", "LOGITS_NAN", "HTTP_500"]
    assert [c["rank"] for c in out["causes"]] == list(range(1, len(out["causes"]) + 1))


def test_query_text_output_shows_chain_action_and_evidence(demo_db: Path) -> None:
    res = runner.invoke(
        app, ["query", "-t", "f59dae616a6ceac9f548385c3f004b69", "--db", str(demo_db)]
    )
    assert res.exit_code == 0, res.output
    assert "GPU_XID_48 -> CUDA_ERROR_ECC_UNCORRECTABLE -> ENGINE_DEAD -> HTTP_500" in res.output
    assert "action:" in res.output and "NVRM: Xid (PCI:0000:19:00): 48" in res.output


def test_unknown_trace_is_a_clear_error_with_status_1(demo_db: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rca.cli", "query", "--trace-id", "f" * 32, "--db", str(demo_db)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1
    assert "trace ffffffffffffffffffffffffffffffff not found" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rca.cli",
            "query",
            "--trace-id",
            "x'; DROP TABLE spans;--",
            "--db",
            str(demo_db),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "not a trace id" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_codes_json_lists_required_fields_and_filters() -> None:
    res = runner.invoke(app, ["codes", "--json"])
    assert res.exit_code == 0
    codes = json.loads(res.output)
    assert len(codes) >= 137
    for c in codes:
        assert {
            "code",
            "id",
            "layer",
            "stage",
            "family",
            "recoverability",
            "action",
            "causes",
        } <= set(c)
    l1 = json.loads(runner.invoke(app, ["codes", "--layer", "1", "--json"]).output)
    assert l1 and all(c["layer"] == 1 for c in l1)
    fam = json.loads(
        runner.invoke(app, ["codes", "--family", "kv_cache_integrity", "--json"]).output
    )
    assert "KV_BLOCK_HASH_MISMATCH" in {c["code"] for c in fam}
    assert runner.invoke(app, ["codes", "--layer", "9"]).exit_code != 0


def test_codes_on_a_broken_catalog_names_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "c.toml"
    bad.write_text(
        (ROOT / "tests/fixtures/mini_catalog.toml")
        .read_text()
        .replace('family = "numerical"', 'family = "gremlins"')
    )
    proc = subprocess.run(
        [sys.executable, "-m", "rca.cli", "codes", "--catalog", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1
    assert "LOGITS_NAN" in proc.stderr and "unknown family 'gremlins'" in proc.stderr


def test_load_command_reports_rows(tmp_path: Path) -> None:
    from ingest import schema as S
    from ingest.spool import SpoolWriter

    db = tmp_path / "x.duckdb"
    w = SpoolWriter(tmp_path / "spool")
    w.emit(
        S.ErrorContext(
            code="LOGITS_NAN",
            family="numerical",
            layer=6,
            severity="error",
            source="probe:ops",
            trace_id="a" * 32,
        )
    )
    w.close()
    res = runner.invoke(app, ["load", "--db", str(db), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["rows"]["error_context"] == 1
    res = runner.invoke(app, ["load", "--db", str(db), "--json"])
    assert json.loads(res.output)["rows"]["error_context"] == 0


def test_default_db_location_honours_env(tmp_path: Path, monkeypatch) -> None:
    from ingest.paths import default_db_path, spool_dir_for

    monkeypatch.setenv("RCA_HOME", str(tmp_path / "h"))
    assert default_db_path() == tmp_path / "h" / "rca.duckdb"
    assert spool_dir_for() == tmp_path / "h" / "spool"
    monkeypatch.setenv("RCA_DB", str(tmp_path / "other.duckdb"))
    assert default_db_path() == tmp_path / "other.duckdb"
    assert spool_dir_for(default_db_path()) == tmp_path / "spool"


def test_importing_rca_stays_light() -> None:
    code = (
        "import sys, rca, rca.cli, rca.query, rca.engine, ingest.store, graph.topology\n"
        "heavy = [m for m in ('torch', 'streamlit', 'pynvml', 'plotly') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_bench_query_small_run_prints_the_figures() -> None:
    res = runner.invoke(app, ["bench", "query", "--rows", "20000", "--queries", "20", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["rows"] == 20000
    for key in ("query_p50_ms", "query_p99_ms", "cli_wall_s"):
        assert out[key] > 0
    assert out["query_p50_ms"] <= out["query_p99_ms"]


def test_readme_cli_reference_lists_every_command() -> None:
    import re

    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"^\| `rca ((?:bench |probe |lab )?[a-z]+)", readme, re.M))

    def name(c) -> str:
        return c.name or c.callback.__name__.replace("_", "-")

    commands = {name(c) for c in app.registered_commands}
    groups = {g.name: g.typer_instance for g in app.registered_groups}
    for group in ("bench", "probe", "lab"):
        commands |= {f"{group} {name(c)}" for c in groups[group].registered_commands}
    assert commands == documented


def test_bench_ingest_small_run_prints_the_figures() -> None:
    res = runner.invoke(
        app,
        [
            "bench",
            "ingest",
            "--lines",
            "20000",
            "--load-rows",
            "20000",
            "--drain3-lines",
            "2000",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["lines"] == 20000 and out["fault_lines_found"] >= 600
    for key in (
        "normalize_lines_per_s",
        "drain3_lines_per_s",
        "load_rows_per_s",
        "raw_duckdb_rows_per_s",
        "peak_rss_mb",
    ):
        assert out[key] > 0
    assert out["ratio_vs_drain3"] == round(
        out["normalize_lines_per_s"] / out["drain3_lines_per_s"], 1
    )


@pytest.mark.parametrize(
    ("sms", "root"),
    [
        ([(3, 1, 0)] * 3, "GPU_XID_13"),
        ([(3, 1, 0), (5, 0, 1), (1, 2, 0)], "CUDA_ERROR_ILLEGAL_ADDRESS"),
    ],
)
def test_query_applies_nvidias_sm_rule(tmp_path: Path, sms, root) -> None:
    from graph.catalog import load_catalog
    from ingest import schema as S
    from ingest.store import Store

    cat = load_catalog()
    db = tmp_path / "sm.duckdb"
    tid, gpu, t0 = "ef" * 16, "GPU-77a0be41-05c2-4c1d-8f7e-2b9d6a1c3e44", 1_795_000_000 * 10**9
    recs = [
        S.ErrorContext.from_catalog(
            cat["GPU_XID_13"],
            source="log:kern.log",
            ts=t0 + i,
            host="n1",
            gpu_uuid=gpu,
            xid=13,
            sm_error={"kind": "sm_exception", "gpc": g, "tpc": t, "sm": m, "exception": "x"},
        )
        for i, (g, t, m) in enumerate(sms)
    ]
    recs.append(
        S.ErrorContext.from_catalog(
            cat["CUDA_ERROR_ILLEGAL_ADDRESS"],
            source="probe:ops",
            ts=t0 + 10**8,
            host="n1",
            gpu_uuid=gpu,
            trace_id=tid,
        )
    )
    store = Store(db)
    store.insert_records(recs)
    store.insert_spans(
        [
            S.Span(
                trace_id=tid,
                span_id="12" * 8,
                name="POST /v1/completions",
                kind="SERVER",
                start_ns=t0 - 10**9,
                end_ns=t0 + 2 * 10**8,
                status_code="ERROR",
                http_status=500,
                host="n1",
            )
        ]
    )
    from rca.query import diagnose_trace

    diag = diagnose_trace(tid, db=db)
    assert diag.causes[0].code == root
    assert diag.notes and diag.notes[0].startswith("Xid 13/31 SM faults")
