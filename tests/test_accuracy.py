"""The accuracy benchmark's machinery on fabricated incidents (no lab needed)."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from graph.topology import ancestors, default_topology
from rca.bench import accuracy as acc
from rca.bench import baselines
from rca.bench.accuracy import Incident
from rca.bench.rcaeval_adapter import MethodOutcome, run_rcaeval, safe_names
from rca.calibrate import calibrate, candidate_sets, fit_conditional_logit
from rca.engine import Evidence, Scope, Weights
from rca.query import Gathered

S = 1_000_000_000
T0 = 1_700_000_000 * S
#: fault type -> (root code, the effect it causes); both reach HTTP_500.
FAULTS = {
    "xid48": ("GPU_XID_48", "LOGITS_NAN"),
    "ecc": ("CUDA_ERROR_ECC_UNCORRECTABLE", "ENGINE_DEAD"),
    "cuda_oom": ("TORCH_CUDA_OOM", "ENGINE_DEAD"),
    "nvlink": ("GPU_XID_145", "NCCL_WATCHDOG_TIMEOUT"),
    "host_oom": ("HOST_OOM_KILL", "ENGINE_DEAD"),
    "kv_leak": ("KV_POOL_LEAK_DETECTED", "ENGINE_DEAD"),
    "max_len": ("CONFIG_MAX_MODEL_LEN_TOO_LARGE", "POSITION_OUT_OF_RANGE"),
    "kv_xfer": ("KV_TRANSFER_CONNECTION_FAILED", "KV_TRANSFER_LOAD_FAILED"),
    "misaligned": ("CUDA_ERROR_MISALIGNED_ADDRESS", "ENGINE_DEAD"),
    "launch_timeout": ("CUDA_ERROR_LAUNCH_TIMEOUT", "ENGINE_DEAD"),
}
NOISE = ["SCHEDULER_PREEMPTION", "SCHEDULER_QUEUE_BACKLOG", "GPU_XID_63"]
#: deliberately bad: the hand-set weights with their signs flipped
BAD = Weights(**{k: -v for k, v in Weights().to_dict().items()})


def _ev(i: int, code: str, t_s: float, scope: str = Scope.TRACE, n: int = 1) -> Evidence:
    return Evidence(f"e{i}-{code}", code, T0 + int(t_s * S), scope=scope, count=n)


def _frame(root: str, effect: str, rng: np.random.Generator) -> tuple[pd.DataFrame, float]:
    n = 150
    t = T0 / S + np.arange(n) * 0.1  # the lab samples per step: faster than 1 s
    df = pd.DataFrame({"time": t})
    for col in ("root_signal", "effect_signal", "noise_a", "noise_b"):
        df[col] = rng.normal(0.0, 1.0, n)
    inject = float(t[100])
    df.loc[df["time"] >= inject, "root_signal"] += 12.0
    df.loc[df["time"] >= inject + 2.0, "effect_signal"] += 4.0
    return df, inject


def make_incidents(n_per_fault: int = 3, seed: int = 0) -> list[Incident]:
    from graph.catalog import default_catalog

    cat = default_catalog()
    rng = np.random.default_rng(seed)
    out = []
    for fault, (root, effect) in FAULTS.items():
        for k in range(n_per_fault):
            evidence = [
                _ev(k, root, 1.0, Scope.GPU if cat[root].layer <= 2 else Scope.TRACE),
                _ev(k, effect, 2.0, n=3),
                _ev(k, NOISE[k % len(NOISE)], 0.5 + k, Scope.HOST, n=2),
            ]
            frame, inject = _frame(root, effect, rng)
            out.append(
                Incident(
                    incident_id=f"{fault}-{k}",
                    fault=fault,
                    family=cat[root].family,
                    code=root,
                    gathered=Gathered(f"{k:032x}", "HTTP_500", T0 + 3 * S, evidence),
                    frame=frame,
                    inject_time=inject,
                    column_codes={
                        "root_signal": root,
                        "effect_signal": effect,
                        "noise_a": NOISE[0],
                        "noise_b": NOISE[1],
                    },
                )
            )
    return out


def test_fabricated_chains_are_real_topology_paths() -> None:
    g = default_topology()
    up = ancestors(g, "HTTP_500")
    for root, effect in FAULTS.values():
        assert g.has_edge(root, effect) and effect in up


def test_metrics_on_known_rankings() -> None:
    ans = ["GPU_XID_48"]
    perfect = [MethodOutcome(["GPU_XID_48", "LOGITS_NAN", "HTTP_500"])]
    assert acc.score(perfect, ans)["ac1"] == 1.0
    five = ["LOGITS_NAN", "ENGINE_DEAD", "HTTP_500", "TORCH_CUDA_OOM", "GPU_XID_48"]
    last = acc.score([MethodOutcome(five)], ans)
    assert (last["ac1"], last["ac3"], last["avg5"]) == (0.0, 0.0, 0.2)
    second = acc.score([MethodOutcome(["LOGITS_NAN", "GPU_XID_48"])], ans)
    assert (second["ac1"], second["ac3"], second["avg5"]) == (0.0, 1.0, 0.8)
    failed = acc.score([MethodOutcome([], failed=True)], ans)
    assert failed["ac1"] == failed["avg5"] == 0.0 and failed["failures"] == 1
    # a wrong code of the right family still counts at the family level
    same_family = acc.score([MethodOutcome(["GPU_XID_79", "GPU_XID_48"])], ans)
    assert same_family["ac1"] == 0.0 and same_family["family_ac1"] == 1.0
    half = acc.score([MethodOutcome(["GPU_XID_48"]), MethodOutcome(["LOGITS_NAN"])], ans * 2)
    assert half["ac1"] == 0.5


def test_split_is_stratified_by_fault_type_and_seeded() -> None:
    incs = make_incidents(4)
    train, test = acc.stratified_split(incs, 0.5, seed=3)
    assert len(train) == len(test) == 20
    for fault in FAULTS:
        assert sum(i.fault == fault for i in train) == 2
    again = acc.stratified_split(incs, 0.5, seed=3)
    assert [i.incident_id for i in again[0]] == [i.incident_id for i in train]
    assert {i.incident_id for i in train}.isdisjoint(i.incident_id for i in test)


def test_earliest_error_record_first_ties_by_layer_warnings_last() -> None:
    ev = [
        _ev(0, "LOGITS_NAN", 2.0),
        _ev(0, "GPU_XID_48", 2.0),  # same time, lower layer: first
        Evidence("w", "SCHEDULER_PREEMPTION", T0, severity="warning"),  # earliest, a warning
        _ev(0, "ENGINE_DEAD", 3.0),
    ]
    got = baselines.earliest_error(Gathered("a" * 32, "HTTP_500", T0 + 4 * S, ev))
    assert got == ["GPU_XID_48", "LOGITS_NAN", "ENGINE_DEAD", "SCHEDULER_PREEMPTION"]


def test_most_severe_by_catalog_severity_then_layer_then_time() -> None:
    ev = [
        _ev(0, "TORCH_CUDA_OOM", 1.0),  # error
        _ev(0, "ENGINE_DEAD", 2.0),  # critical, layer 5
        _ev(0, "HOST_OOM_KILL", 3.0),  # critical, layer 4
        _ev(0, "SCHEDULER_PREEMPTION", 0.0),  # warning
    ]
    got = baselines.most_severe(Gathered("a" * 32, "HTTP_500", T0 + 4 * S, ev))
    assert got == ["HOST_OOM_KILL", "ENGINE_DEAD", "TORCH_CUDA_OOM", "SCHEDULER_PREEMPTION"]


def test_pagerank_flows_from_the_symptom_to_the_cause() -> None:
    # the effect is louder (more rows) but the walk ends at the cause
    ev = [_ev(0, "TORCH_CUDA_OOM", 1.0), _ev(0, "ENGINE_DEAD", 2.0, n=20)]
    got = baselines.pagerank(Gathered("a" * 32, "HTTP_500", T0 + 4 * S, ev))
    assert got == ["TORCH_CUDA_OOM", "ENGINE_DEAD"]
    assert baselines.most_severe(Gathered("a" * 32, "HTTP_500", T0, ev))[0] == "ENGINE_DEAD"


def test_rcaeval_methods_find_the_jumping_column() -> None:
    incs = make_incidents(1)
    for name in ("baro", "nsigma"):
        outs = [acc.run_method(name, i) for i in incs]
        assert not any(o.failed for o in outs), [o.why for o in outs]
        assert acc.score(outs, [i.code for i in incs])["ac1"] == 1.0
    circa = acc.run_method("circa", incs[0])
    assert not circa.failed, circa.why
    assert circa.ranks and set(circa.ranks) <= set(incs[0].column_codes.values())


def test_circa_gets_names_it_can_split() -> None:
    names = safe_names(["kv_cache_usage", "nan", "gpu_xid", "gpu-0_xid"])
    assert all(n.count("_") == 1 for n in names.values())
    assert len(set(names.values())) == 4


def test_rcaeval_fallback_on_stderr_counts_as_a_failure() -> None:
    inc = make_incidents(1)[0]

    def crashing(data, inject_time=None, dataset=None, **kw):
        print(
            "circa failed (ValueError: boom); returning the unranked column order", file=sys.stderr
        )
        return {"ranks": list(data.columns.drop("time"))}

    out = run_rcaeval("circa", inc.frame, inc.inject_time, inc.column_codes, method=crashing)
    assert out.failed and out.ranks == [] and "unranked column order" in out.why
    # the real CIRCA on a frame it cannot handle (every series constant) falls back too
    flat = inc.frame.assign(**{c: 1.0 for c in inc.column_codes})
    real = acc.run_method("circa", replace(inc, frame=flat))
    assert real.failed and real.ranks == []
    assert acc.score([real], [inc.code])["failures"] == 1
    # no frame at all is a failure, not a crash
    assert acc.run_method("baro", replace(inc, frame=None)).failed


def test_rcaeval_method_past_its_time_is_a_failure() -> None:
    import time

    inc = make_incidents(1)[0]

    def slow(data, inject_time=None, dataset=None, **kw):
        time.sleep(30)
        return {"ranks": ["root_signal"]}

    out = run_rcaeval(
        "circa", inc.frame, inc.inject_time, inc.column_codes, method=slow, timeout_s=0.5
    )
    assert out.failed and out.ranks == [] and "timed out" in out.why
    # a method in time answers the same in a forked process as in this one
    forked = acc.run_method("circa", inc, timeout_s=20)
    assert not forked.failed and forked.ranks == acc.run_method("circa", inc).ranks
    assert forked.ranks[0] == inc.code


def test_calibration_beats_bad_starting_weights_on_held_out() -> None:
    incs = make_incidents(4, seed=1)
    train, test = acc.stratified_split(incs, 0.5, seed=0)
    cal = calibrate(train, start=BAD, seed=0)
    assert cal.source == "learned" and cal.learnable == len(train)
    test_sets = candidate_sets(test)
    from rca.calibrate import accuracy_at

    bad_ac1 = accuracy_at(test_sets, np.array(list(BAD.to_dict().values())))
    new_ac1 = accuracy_at(test_sets, np.array(list(cal.weights.to_dict().values())))
    assert bad_ac1 < 0.5 and new_ac1 > bad_ac1 and new_ac1 >= 0.9
    # and through the real ranking call
    outs = [acc.run_method("ours", i, weights=cal.weights) for i in test]
    assert acc.score(outs, [i.code for i in test])["ac1"] >= 0.9


def test_calibration_keeps_the_hand_weights_when_learning_does_worse(monkeypatch) -> None:
    incs = make_incidents(3)
    monkeypatch.setattr(
        "rca.calibrate.fit_conditional_logit",
        lambda sets, l2=0.3, start=None: np.array(list(BAD.to_dict().values())),
    )
    cal = calibrate(incs, seed=0)
    assert cal.source == "hand" and cal.weights == Weights()
    assert cal.cv["learned_ac1"] < cal.cv["hand_ac1"]


def test_conditional_logit_gradient_matches_finite_differences() -> None:
    from rca.calibrate import _nll_grad, _stack

    sets = candidate_sets(make_incidents(1))
    x, starts, labels = _stack(sets)
    w = np.linspace(-1.0, 1.0, x.shape[1])
    f0, g = _nll_grad(w, x, starts, labels)
    eps = 1e-6
    num = [
        (_nll_grad(w + eps * np.eye(len(w))[i], x, starts, labels)[0] - f0) / eps
        for i in range(len(w))
    ]
    assert np.allclose(g, num, atol=1e-4)
    assert fit_conditional_logit([], start=BAD).tolist() == list(BAD.to_dict().values())


def test_weights_round_trip_toml_and_json(tmp_path) -> None:
    w = Weights(chain=1.25, late=-3.5)
    assert Weights.load(w.save(tmp_path / "w.toml", comment="learned")) == w
    assert Weights.load(w.save(tmp_path / "w.json")) == w
    with pytest.raises(ValueError, match="unknown weight"):
        Weights.from_dict({"chian": 1.0})
    from graph.errors import InputError

    (tmp_path / "bad.toml").write_text("[weights]\nchian = 1.0\n")
    with pytest.raises(InputError, match="unknown weight"):
        Weights.load(tmp_path / "bad.toml")
    with pytest.raises(InputError, match="cannot read weights"):
        Weights.load(tmp_path / "missing.toml")


def _run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    from rca.cli import main

    monkeypatch.setattr(sys, "argv", ["rca", *argv])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_says_so_in_one_line_when_the_lab_is_missing(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "rca.lab.runner", None)  # import fails like a missing file
    code, out, err = _run_cli(["bench", "accuracy", "--incidents", "10"], monkeypatch, capsys)
    assert code == 1 and out == ""
    assert err.strip().count("\n") == 0 and "lab is missing" in err and "Traceback" not in err


def test_cli_json_on_fabricated_incidents(monkeypatch, capsys, tmp_path) -> None:
    fake = types.ModuleType("rca.lab.runner")
    fake.generate_incidents = lambda n, seed: make_incidents(n // len(FAULTS), seed)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rca.lab.runner", fake)
    code, out, err = _run_cli(
        ["bench", "accuracy", "--incidents", "40", "--seed", "2", "--json"], monkeypatch, capsys
    )
    assert code == 0, err
    res = json.loads(out)
    assert (res["incidents"], res["train"], res["held_out"]) == (40, 20, 20)
    assert set(res["baselines"]) == {
        "earliest",
        "most_severe",
        "pagerank",
        "baro",
        "nsigma",
        "circa",
    }
    assert {"ac1", "ac3", "avg5"} <= set(res["ours"])
    assert res["ours"]["ac1"] >= 0.9 and res["baselines"]["baro"]["ac1"] >= 0.9
    assert set(res["weights"]) == set(Weights.names())
    assert set(res["per_family"]) == {i.family for i in make_incidents(1)}
    # text mode prints the tables, and the learned weights can be kept
    saved = tmp_path / "weights.toml"
    argv = ["bench", "accuracy", "--incidents", "20", "--save-weights", str(saved)]
    code, out, _ = _run_cli(argv, monkeypatch, capsys)
    assert code == 0 and "AC@1" in out and "ours (calibrated)" in out and "circa" in out
    assert "--incidents 20" in saved.read_text()
    assert all(np.isfinite(v) for v in Weights.load(saved).to_dict().values())


def test_frame_from_lab_series() -> None:
    series = [
        {"ts": T0 + 2 * S // 100, "step": 2, "kv_usage": 0.5, "gpu_xid": 0.0, "note": "x"},
        {"ts": T0, "step": 1, "kv_usage": 0.4, "gpu_xid": 1.0, "note": "y"},
    ]
    df = acc.frame_from_series(series)
    assert list(df.columns) == ["time", "kv_usage", "gpu_xid"]
    assert df["time"].tolist() == [T0 / S, T0 / S + 0.02]


def test_frame_preparation_for_rcaeval() -> None:
    from rca.bench.rcaeval_adapter import prepare_frame

    inc = make_incidents(1)[0]
    df = inc.frame.copy()
    df["copy_signal"] = 3.0 * df["root_signal"] + 1.0  # an exact copy makes PC's matrix singular
    df["flat_signal"] = 7.0
    df.loc[df.index[-1], "noise_a"] = np.inf
    out, t_inj, back = prepare_frame(df, inc.inject_time, independent=True)
    assert set(back.values()) == {"root_signal", "effect_signal", "noise_a", "noise_b"}
    assert np.isfinite(out.drop(columns="time").to_numpy()).all()
    # re-timed to 1 s samples, the inject time still splits them where it did
    assert out["time"].diff().dropna().eq(1.0).all()
    assert (out["time"] < t_inj).sum() == (df["time"] < inc.inject_time).sum() == 100
    circa = acc.run_method("circa", replace(inc, frame=df))
    assert not circa.failed and circa.ranks


def test_a_ranking_with_no_mapped_series_is_a_failure_with_a_reason() -> None:
    inc = make_incidents(1)[0]
    one_after = inc.frame[inc.frame["time"] <= inc.inject_time]  # a single anomalous sample
    out = acc.run_method("baro", replace(inc, frame=one_after))
    assert out.failed and "1 from it" in out.why
