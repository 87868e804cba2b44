"""`rca bench probes` runs every mode on a healthy model without a record (a
false alarm would raise) and prints the figures it promises."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


def test_probe_bench_runs_every_mode_clean_and_reports_ratios() -> None:
    from typer.testing import CliRunner

    from rca.cli import app

    res = CliRunner().invoke(app, ["bench", "probes", "--reps", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    modes = ("default", "numerical", "full", "kv_fingerprint")
    for m in modes:
        assert 0.5 < out[f"ratio_{m}"] < 3.0
        lo, hi = out["ratio_iqr"][m]
        assert lo <= hi
    assert set(out["ms"]) == {"off", *modes}
    assert out["shape"]["vocab"] == 32000 and out["reps"] == 2
    assert out["kv_config"]["detection_latency_steps"] >= 1
