"""`rca bench probes` runs every mode on a healthy model without a record (a
false alarm would raise) and prints the figures it promises."""

from __future__ import annotations

import inspect
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


def test_probe_bench_size_is_checked_and_a_bf16_shape_runs_clean(monkeypatch) -> None:
    """An unknown --size is a one-line error; a bf16 shape (what ``1b`` uses on
    a GPU, made tiny here) runs every mode without a false alarm."""
    from typer.testing import CliRunner

    from graph.errors import RcaError
    from rca.bench import probes as bench
    from rca.cli import app

    res = CliRunner().invoke(app, ["bench", "probes", "--size", "huge"])
    assert isinstance(res.exception, RcaError)  # rca.cli.main prints it on one line
    assert "--size must be one of small, 1b, not 'huge'" in str(res.exception)
    tiny = {**bench.SHAPE, "layers": 1, "hidden": 64, "intermediate": 128, "vocab": 512}
    monkeypatch.setitem(bench.SHAPES, "tiny", {**tiny, "prompt": 32, "decode_steps": 4})
    monkeypatch.setitem(bench.SHAPES["tiny"], "dtype", "bfloat16")
    out = bench.run_probe_bench(size="tiny", reps=2)
    assert out["size"] == "tiny" and out["shape"]["dtype"] == "bfloat16"
    assert out["kv_config"]["detection_latency_steps"] >= 1


def test_probe_bench_passes_the_cache_under_the_name_the_forward_takes() -> None:
    """transformers before 5.2x calls the forward's cache ``past_key_values``:
    the bench's lane must hand the cache over under that name, or every decode
    step would run without its KV cache (and the KV probe would see nothing)."""
    import torch

    transformers = pytest.importorskip("transformers")
    from rca.bench import probes as bench

    shape = {**bench.SHAPE, "layers": 1, "hidden": 64, "intermediate": 128, "vocab": 512}
    model, kind = bench._build_model("cpu", 0, shape)
    if not kind.startswith("transformers"):
        pytest.skip("transformers' Llama is not importable")

    class OldNames(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, past_key_values=None, use_cache=None, logits_to_keep=0):
            names = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
            kw = "cache" if "cache" in names else "past_key_values"
            return self.inner(
                input_ids=input_ids,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **{kw: past_key_values},
            )

    ids = torch.randint(0, 512, (2, 8))
    lane = bench._Lane("off", OldNames(), True, ids, ["a" * 32, "b" * 32], None, 16)
    assert lane.cache_kw == "past_key_values"
    with torch.inference_mode():
        for _ in range(3):
            lane.step(lambda: None)
    assert lane.cache.get_seq_length() == 10  # the prompt's 8 tokens, then 2 decode steps
