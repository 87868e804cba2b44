"""Operator checks (probes.ops): injected faults come back as the right code, on
the right module, with the trace id of the batch row that carried them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zlib
from collections import Counter
from contextlib import contextmanager, suppress

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from ingest import schema as S  # noqa: E402
from probes.ops import (  # noqa: E402
    Checker,
    RequestOutput,
    checker_status_handler,
    instrument,
    set_tiers,
    validate_json_schema,
)
from probes.sink import MemorySink  # noqa: E402

TRACES = [f"{i:02x}" * 16 for i in range(1, 5)]
VOCAB = 96


def llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


class TinyLM(nn.Module):
    """A hand-written model: embedding, two blocks, a head (no transformers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16)) for _ in range(2)
        )
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def ids(rows=4, t=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, t), generator=g)


@contextmanager
def poisoned(param, value=math.inf):
    """A weight entry set to ``value`` for the duration of the block."""
    with torch.no_grad():
        old = param.view(-1)[0].item()
        param.view(-1)[0] = value
    try:
        yield
    finally:
        with torch.no_grad():
            param.view(-1)[0] = old


def run(checker, model, traces=TRACES, **kw):
    checker.begin_step(traces)
    # on CPU an out-of-range index raises; on CUDA it would be a device assert
    with torch.inference_mode(), suppress(IndexError, RuntimeError):
        model(**kw)
    return checker.end_step()


def by_code(records):
    out = {}
    for r in records:
        out.setdefault(r.code, []).append(r)
    return out


# ---------------------------------------------------------------------------
# numerical
# ---------------------------------------------------------------------------
def test_inf_weight_reports_activation_inf_at_the_module_with_each_rows_trace():
    model, sink = llama(), MemorySink()
    ck = instrument(model, "numerical", sink=sink)
    with poisoned(model.model.layers[1].mlp.down_proj.weight):
        recs = run(ck, model, input_ids=ids())
    got = by_code(recs)
    assert set(got) == {"ACTIVATION_INF", "LOGITS_NAN"}
    act = got["ACTIVATION_INF"]
    assert [r.trace_id for r in act] == TRACES
    assert {r.attrs["module"] for r in act} == {"model.layers.1.mlp.down_proj"}
    assert all(r.attrs["row"] == i for i, r in enumerate(act))
    assert act[0].attrs["downstream"]["count"] >= 2  # layer, norm, lm_head followed it
    assert {r.attrs["module"] for r in got["LOGITS_NAN"]} == {"lm_head"}
    assert sink.codes() == [r.code for r in recs]
    assert all(r.source == "probe:ops" and r.layer == 6 for r in recs)


def test_default_tier_sees_the_logits_only():
    model, sink = llama(), MemorySink()
    ck = instrument(model, sink=sink)
    assert ck.status()["active"] == {"lm_head": "numerical"}
    hooked = [n for n, m in model.named_modules() if m._forward_hooks or tapped(m)]
    assert hooked == ["lm_head"]  # production hooks only what it checks
    assert not model.lm_head._forward_hooks  # a tap: PyTorch's fast call path stays
    assert run(ck, model, input_ids=ids()) == []
    with poisoned(model.model.layers[0].self_attn.o_proj.weight, math.nan):
        recs = run(ck, model, input_ids=ids())
    assert {r.code for r in recs} == {"LOGITS_NAN"}
    assert [r.trace_id for r in recs] == TRACES
    assert recs[0].attrs["kind"] == "nan" and recs[0].attrs["module"] == "lm_head"


def test_fault_in_one_row_names_only_that_rows_trace():
    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, "numerical", sink=sink)
    x = ids() % (VOCAB - 1)
    x[2, 3] = VOCAB - 1  # a token only row 2 has
    with torch.no_grad():
        model.embed.weight[VOCAB - 1] = math.inf
    recs = run(ck, model, input_ids=x)
    first = [r for r in recs if r.code == "ACTIVATION_INF"]
    assert [r.trace_id for r in first] == [TRACES[2]]
    assert first[0].attrs["module"] == "embed"


def test_value_range_violation_is_reported_with_the_bounds():
    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, "numerical", sink=sink, value_limits={"blocks.0.0": (-1e-3, 1e-3)})
    recs = run(ck, model, input_ids=ids())
    assert {r.attrs["module"] for r in recs} == {"blocks.0.0"}
    assert recs[0].attrs["kind"] == "range" and recs[0].attrs["range"] == [-0.001, 0.001]
    assert recs[0].confidence == 0.5


# ---------------------------------------------------------------------------
# memory: index bounds
# ---------------------------------------------------------------------------
def test_out_of_vocab_token_id():
    model, sink = llama(), MemorySink()
    ck = instrument(model, sink=sink)
    x = ids()
    x[1, 4] = VOCAB + 7
    recs = run(ck, model, input_ids=x)
    assert [(r.code, r.trace_id) for r in recs] == [("TOKEN_ID_OUT_OF_VOCAB", TRACES[1])]
    a = recs[0].attrs
    assert a["max"] == VOCAB + 7 and a["hi_exclusive"] == VOCAB and a["row"] == 1


def test_out_of_vocab_on_a_hand_written_model():
    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, sink=sink)
    x = ids()
    x[3, 0] = -1
    recs = run(ck, model, input_ids=x)
    assert [(r.code, r.trace_id) for r in recs] == [("TOKEN_ID_OUT_OF_VOCAB", TRACES[3])]


def test_position_past_the_cache_length():
    from transformers.cache_utils import DynamicCache

    model, sink = llama(), MemorySink()
    ck = instrument(model, sink=sink)
    cache = DynamicCache(config=model.config)
    assert run(ck, model, input_ids=ids(t=8), cache=cache, use_cache=True) == []
    pos = torch.tensor([[8], [8], [8 + 5], [8]])
    nxt = ids(t=1, seed=2)
    recs = run(ck, model, input_ids=nxt, cache=cache, use_cache=True, position_ids=pos)
    assert [(r.code, r.trace_id) for r in recs] == [("POSITION_OUT_OF_RANGE", TRACES[2])]
    assert recs[0].attrs["hi_exclusive"] == 9 and recs[0].attrs["cache_len"] == 9


def test_kv_length_vs_positions_is_a_full_tier_state_check():
    from transformers.cache_utils import DynamicCache

    model, sink = llama(), MemorySink()
    ck = instrument(model, "full", sink=sink)
    cache = DynamicCache(config=model.config)
    assert run(ck, model, input_ids=ids(t=8), cache=cache, use_cache=True) == []
    pos = torch.tensor([[8], [3], [8], [8]])  # row 1 repeats an old position
    recs = run(ck, model, input_ids=ids(t=1), cache=cache, use_cache=True, position_ids=pos)
    assert [(r.code, r.trace_id) for r in recs] == [("KV_LENGTH_POSITION_MISMATCH", TRACES[1])]


def test_block_table_and_cu_seqlens_bounds():
    sink = MemorySink()
    ck = Checker(sink)
    ck.begin_step(TRACES[:3])
    table = torch.tensor([[0, 5, 9], [3, 4, 0], [7, 70, 0]])
    ck.check_block_table(table, num_blocks=64, blocks_used=torch.tensor([3, 2, 2]))
    ck.check_cu_seqlens(torch.tensor([0, 4, 3, 9]), num_tokens=9)  # row 1 goes backwards
    recs = ck.end_step()
    assert sorted((r.attrs["check"], r.trace_id) for r in recs) == [
        ("block_table", TRACES[2]),
        ("cu_seqlens", TRACES[1]),
    ]
    assert all(r.code == "CUDA_ERROR_ILLEGAL_ADDRESS" for r in recs)


# ---------------------------------------------------------------------------
# semantic
# ---------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_semantic_rules_report_schema_and_finish_reason_violations():
    sink = MemorySink()
    ck = Checker(sink)
    ok = RequestOutput(
        trace_id=TRACES[0],
        finish_reason="tool_calls",
        tools=[WEATHER],
        tool_calls=[{"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
    )
    assert ck.end_request(ok) == []
    bad = RequestOutput(
        trace_id=TRACES[1],
        request_id="cmpl-9",
        finish_reason="abort",
        tools=[WEATHER],
        tool_calls=[
            {"function": {"name": "get_weather", "arguments": '{"city": 42, "days": 0}'}},
            {"function": {"name": "get_weather", "arguments": '{"city": "Oslo"'}},
        ],
    )
    recs = ck.end_request(bad)
    assert sorted(r.code for r in recs) == [
        "INVALID_FINISH_REASON",
        "OUTPUT_SCHEMA_VIOLATION",
        "OUTPUT_SCHEMA_VIOLATION",
    ]
    assert {r.trace_id for r in recs} == {TRACES[1]} and {r.request_id for r in recs} == {"cmpl-9"}
    schema = [r for r in recs if r.code == "OUTPUT_SCHEMA_VIOLATION"]
    assert schema[0].attrs["violations"] == [
        "$.city: expected string, got integer",
        "$.days: violates minimum 1",
    ]
    assert schema[1].attrs["error"] == "parse"
    assert "Oslo" not in json.dumps([r.to_row() for r in recs])  # no content, ever


def test_json_response_format_and_empty_completion():
    ck = Checker(MemorySink())
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "array", "maxItems": 1}}}
    out = RequestOutput(
        trace_id=TRACES[2], text="[1, 2]", response_format=fmt, finish_reason="stop"
    )
    assert [r.code for r in ck.end_request(out)] == ["OUTPUT_SCHEMA_VIOLATION"]
    empty = RequestOutput(trace_id=TRACES[2], text="  \n", finish_reason="stop")
    assert [r.code for r in ck.end_request(empty)] == ["EMPTY_COMPLETION"]


def test_schema_validator_subset():
    schema = {
        "$defs": {"pos": {"type": "integer", "exclusiveMinimum": 0}},
        "type": "object",
        "properties": {
            "n": {"$ref": "#/$defs/pos"},
            "tag": {"enum": ["a", "b"]},
            "xs": {"type": "array", "items": {"type": "number"}},
        },
        "anyOf": [{"required": ["n"]}, {"required": ["tag"]}],
    }
    assert validate_json_schema({"n": 3, "xs": [1, 2.5]}, schema) == []
    assert validate_json_schema({"n": 0, "tag": "c", "xs": ["x"]}, schema) == [
        "$.n: violates exclusiveMinimum 0",
        "$.tag: not one of the 2 allowed values",
        "$.xs[0]: expected number, got string",
    ]
    assert validate_json_schema({}, schema) == ["$: matches none of anyOf (2)"]


# ---------------------------------------------------------------------------
# cost rules: no host read per op, sampling, tiers
# ---------------------------------------------------------------------------
SYNCS = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__")


@pytest.fixture
def sync_counter(monkeypatch):
    counts: Counter[str] = Counter()
    for name in SYNCS:
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            counts[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


@pytest.mark.parametrize("make", [llama, lambda: TinyLM().eval()], ids=["llama", "tiny"])
def test_no_host_read_during_the_forward_pass(make, sync_counter):
    model = make()
    x = ids()
    with torch.inference_mode():
        model(input_ids=x)
        sync_counter.clear()
        model(input_ids=x)
    baseline = sum(sync_counter.values())  # what the model itself reads, if anything
    ck = instrument(model, "full", sink=MemorySink(), snapshot=True)
    ck.host_shortcuts = False  # CPU-only shortcuts read host memory: follow the device path
    ck.begin_step(TRACES)
    sync_counter.clear()
    with torch.inference_mode():
        model(input_ids=x)
    assert sum(sync_counter.values()) == baseline  # every check only launched kernels
    ck.end_step()  # the one read of the step happens here


def test_sampling_one_in_n_checks_only_the_sampled_requests():
    model, sink = TinyLM().eval(), MemorySink()
    traces = [f"{i:032x}" for i in range(16)]
    ck = instrument(model, "numerical", sink=sink, sample_every=4)
    expected = [t for t in traces if zlib.crc32(t.encode()) % 4 == 0]
    assert 0 < len(expected) < len(traces)
    with poisoned(model.head.bias):
        recs = run(ck, model, traces, input_ids=ids(rows=16))
        assert sorted({r.trace_id for r in recs}) == sorted(expected)
        unsampled = [t for t in traces if t not in expected][:4]
        ck.begin_step(unsampled)
        with torch.inference_mode():
            model(input_ids=ids(rows=4))
        assert ck._order == [] and ck._iorder == []  # nothing was even computed
        assert ck.end_step() == []


def test_tier_switch_at_run_time_without_reinstrumenting():
    model, sink = llama(), MemorySink()
    ck = instrument(model, sink=sink)
    handler = checker_status_handler(ck)
    with poisoned(model.model.layers[0].mlp.up_proj.weight):
        assert {r.code for r in run(ck, model, input_ids=ids())} == {"LOGITS_NAN"}
        set_tiers(model, "numerical")  # by model: finds the checker
        recs = run(ck, model, input_ids=ids())
        assert {r.attrs["module"] for r in recs if r.code == "ACTIVATION_INF"} == {
            "model.layers.0.mlp.up_proj"
        }
        status, body = handler("POST", json.dumps({"tiers": "off"}))
        assert status == 200 and body["sites"]["numerical"] == 0 and body["bounds"] is False
        assert run(ck, model, input_ids=ids()) == []
        status, body = handler("POST", b'{"tiers": {"preset": "default", "lm_head": "full"}}')
        assert status == 200 and body["active"] == {"lm_head": "full"}
        recs = run(ck, model, input_ids=ids())
        assert {r.attrs["tier"] for r in recs} == {"full"} and "sample" in recs[0].attrs
    status, body = handler("GET")
    assert status == 200 and body["failures"]["LOGITS_NAN"] >= 3 * len(TRACES)
    assert handler("POST", '{"tiers": "loud"}')[0] == 400
    assert handler("POST", '{"verbose": 1}')[0] == 400
    assert handler("DELETE")[0] == 405


def tapped(m: nn.Module) -> bool:
    return "_rca_tap" in m.__dict__


def test_taps_restore_forward_follow_deepcopy_and_survive_a_later_wrapper():
    import copy

    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, "numerical", sink=sink)
    leaves = [m for m in model.modules() if tapped(m)]
    assert leaves and not any(m._forward_hooks for m in leaves)
    # a deep copy runs its own weights and reports to the same checker
    twin = copy.deepcopy(model)
    with poisoned(twin.blocks[1][0].weight):
        assert run(ck, model, input_ids=ids()) == []
        recs = run(ck, twin, input_ids=ids())
    assert {r.attrs["module"] for r in recs if r.code == "ACTIVATION_INF"} == {"blocks.1.0"}
    # something wraps a forward after the tap (as accelerate does): detach keeps its wrapper
    head = model.head
    seen = []
    inner = head.forward

    def outer(*a, **k):
        seen.append(1)
        return inner(*a, **k)

    head.forward = outer
    ck.detach()
    assert not any(tapped(m) or m._forward_hooks for m in model.modules() if m is not head)
    assert all("forward" not in m.__dict__ for m in model.modules() if m is not head)
    with poisoned(model.blocks[0][0].weight), torch.inference_mode():
        model(input_ids=ids())
    assert seen and sink.records == recs  # the wrapper ran; the inert tap reported nothing


def test_tier_switch_with_all_modules_hooked_keeps_the_hooks():
    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, sink=sink, modules="all")
    hooks = {n: len(m._forward_hooks) for n, m in model.named_modules()}
    with poisoned(model.blocks[0][0].weight):
        assert {r.attrs["module"] for r in run(ck, model, input_ids=ids())} == {"head"}
        ck.set_tiers("numerical")
        assert {n: len(m._forward_hooks) for n, m in model.named_modules()} == hooks
        recs = run(ck, model, input_ids=ids())
    assert {r.attrs["module"] for r in recs if r.code == "ACTIVATION_INF"} == {"blocks.0.0"}


# ---------------------------------------------------------------------------
# records, recoverability, robustness
# ---------------------------------------------------------------------------
def test_rerun_tells_persistent_from_transient_faults():
    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, "numerical", sink=sink)
    x = ids()

    def forward():
        with torch.inference_mode():
            model(input_ids=x)

    with poisoned(model.blocks[1][0].weight):
        ck.begin_step(TRACES)
        forward()
        recs = ck.end_step(rerun=forward)
    first = [r for r in recs if r.attrs["module"] == "blocks.1.0"]
    assert first and all(r.recoverability == "state_pollution" for r in first)
    assert first[0].attrs["rerun"] == {"reproduced": True}

    calls = []

    def flaky(module, args, out):  # a one-off bit flip: NaN on the first call only
        calls.append(1)
        return torch.full_like(out, math.nan) if len(calls) == 1 else out

    handle = model.blocks[0][2].register_forward_hook(flaky, prepend=True)
    try:
        ck.begin_step(TRACES)
        forward()
        recs = ck.end_step(rerun=forward)
    finally:
        handle.remove()
    first = [r for r in recs if r.attrs["module"] == "blocks.0.2"]
    assert first and all(r.recoverability == "transient" for r in first)


def test_records_carry_bounded_stats_and_opt_in_snapshot_and_store_as_json():
    model = TinyLM().eval()
    for snapshot in (False, True):
        sink = MemorySink()
        ck = instrument(
            model, "full", sink=sink, stats_sample=8, snapshot=snapshot, snapshot_elems=4
        )
        assert run(ck, model, input_ids=ids()) == []  # a clean step first: planned shapes
        with poisoned(model.blocks[0][0].bias):
            recs = run(ck, model, input_ids=ids())
        ck.detach()
        first = next(r for r in recs if r.attrs["module"] == "blocks.0.0")
        assert first.attrs["sample"]["n"] == 8 and first.attrs["sample"]["nonfinite"] >= 1
        assert ("snapshot" in first.attrs) is snapshot
        if snapshot:
            assert len(first.attrs["snapshot"]["values"]) == 4
        for rec in recs:
            row = rec.to_row()
            json.loads(row["attrs"], parse_constant=pytest.fail)  # no NaN/Infinity tokens
            assert S.ErrorContext.from_row(row).attrs == rec.attrs


def test_logging_is_rate_limited_per_code(caplog):
    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, sink=sink)
    with poisoned(model.head.weight), caplog.at_level("WARNING", logger="rca.probes.ops"):
        run(ck, model, input_ids=ids())
        run(ck, model, input_ids=ids())
    assert len(sink.records) == 2 * len(TRACES)  # every record reaches the sink
    assert sum("LOGITS_NAN" in m for m in caplog.messages) == 1
    assert ck.log.suppressed["LOGITS_NAN"] == 2 * len(TRACES) - 1


def test_a_failing_sink_or_check_never_raises_into_the_model():
    class Broken:
        def emit(self, record):
            raise OSError("disk full")

    model = TinyLM().eval()
    ck = instrument(model, "full", sink=Broken())
    ck.check("weird", torch.ones(2, 3, dtype=torch.complex64))  # not a float tensor: ignored
    with poisoned(model.head.weight):
        recs = run(ck, model, input_ids=ids())
    assert recs and ck.errors >= 1


def test_decorator_and_explicit_checks():
    sink = MemorySink()
    ck = Checker(sink)

    @ck.op("sampler.logits")
    def scale(x):
        return x * 2

    ck.begin_step(TRACES[:2])
    scale(torch.tensor([[1.0, 2.0], [math.inf, 0.0]]))
    ck.check_probs(torch.tensor([[0.5, 0.5], [1.5, -0.5]]))
    recs = ck.end_step()
    assert sorted((r.code, r.trace_id) for r in recs) == [
        ("ACTIVATION_INF", TRACES[1]),
        ("SAMPLER_PROB_INF_NAN", TRACES[1]),
    ]


def test_importing_probes_and_rca_does_not_import_torch():
    code = (
        "import sys, probes, probes.sink, rca, rca.bench, rca.bench.probes\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_module_output_is_checked_in_the_numerical_tier():
    """Hooks queue outputs; a layer's (or the model's) end checks them in grouped
    sums, through a plan made on the first step. A NaN written into any one
    leaf module's output, row 2, on a later step is found, and that module is
    named as the first fault of the row."""
    model = llama()
    names = {m: n for n, m in model.named_modules()}
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    checked = 0
    for mod in leaves:
        hit: dict[str, bool] = {}

        def inject(module, args, output, hit=hit):
            x = output if isinstance(output, torch.Tensor) else output[0]
            if hit.get("armed") and isinstance(x, torch.Tensor) and x.is_floating_point():
                x[2].view(-1)[1] = math.nan
                hit["done"] = True

        ck = instrument(model, "numerical", sink=MemorySink())
        handle = mod.register_forward_hook(inject, prepend=True)
        try:
            assert run(ck, model, input_ids=ids()) == []  # plans the shapes
            hit["armed"] = True
            recs = run(ck, model, input_ids=ids())
        finally:
            handle.remove()
            ck.detach()
        if not hit.get("done"):
            continue  # no float output (an embedding's ids, say)
        checked += 1
        rows = [r for r in recs if r.attrs.get("row") == 2 and r.attrs["check"] == "numerical"]
        first = min(rows, key=lambda r: "downstream" not in r.attrs)  # the row's head record
        name = names[mod] or "<root>"
        assert first.attrs["module"] == name, (name, [r.attrs["module"] for r in rows])
        assert first.attrs["kind"] == "nan" and first.trace_id == TRACES[2]
        assert all(r.attrs.get("row") == 2 for r in recs if r.attrs["check"] == "numerical")
    assert checked >= 20


def test_a_sum_that_overflows_on_finite_values_is_not_a_fault():
    ck = Checker(MemorySink())
    big = torch.full((4, 8), 3e38)
    bad = big.clone()
    bad[3, 5] = math.inf
    ck.begin_step(TRACES)
    ck.check("big", big)  # every row sums past float32's max: still finite values
    ck.check("bad", bad)
    recs = ck.end_step()
    assert [(r.attrs["site"], r.attrs["row"], r.attrs["kind"]) for r in recs] == [
        ("bad", 3, "+inf")
    ]
    assert recs[0].attrs["max"] == "inf" and recs[0].attrs["min"] == _num_f32_max()


def _num_f32_max():
    return float(f"{3e38:.6g}")


class _Wide(nn.Module):
    def forward(self, x):
        return x.repeat(1, 1, 704)  # [4, 6, 11264]: not kept by reference either


class _Scrub(nn.Module):
    def forward(self, x):
        x.zero_()  # overwrites the wide output in place, before the layer ends
        return x[..., :16] + 0


class _WideModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), _Wide(), _Scrub())])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_a_big_output_is_checked_when_its_hook_runs():
    """An output over ``group_max_elems`` (prefill) is reduced in its own hook,
    while it is still in the CPU caches: a NaN in it is found even when a later
    module of the layer overwrites it in place (too big to be kept by
    reference, it is reported from its row sum), and the smaller output queued
    before it keeps its place as the row's first fault."""
    model, sink = _WideModel(), MemorySink()
    ck = instrument(model, "numerical", sink=sink)
    assert ck.detail_max_elems < 4 * 6 * 11264
    armed = {"on": False}

    def inject(module, args, output):
        if armed["on"]:
            output[1, 2, 3] = math.nan

    handle = model.blocks[0][0].register_forward_hook(inject, prepend=True)
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(3))
    try:
        assert run(ck, model, x=x) == []
        armed["on"] = True
        recs = run(ck, model, x=x)
    finally:
        handle.remove()
        ck.detach()
    rows = {r.attrs["row"] for r in recs}
    assert rows == {1} and {r.trace_id for r in recs} == {TRACES[1]}
    mods = {r.attrs["module"]: r for r in recs}
    assert set(mods) == {"blocks.0.0", "blocks.0.1"}  # the wide output, zeroed since
    assert mods["blocks.0.1"].attrs["row_sum"] == "nan"
    head = next(r for r in recs if "downstream" in r.attrs)
    assert head.attrs["module"] == "blocks.0.0" and head.attrs["kind"] == "nan"


@pytest.mark.parametrize("shortcuts", [True, False])
def test_min_max_sites_all_clear_test_in_python_sees_nan_and_limits(shortcuts):
    """Sites with value limits keep row min/max; a step with a few such cells is
    cleared in plain Python: NaN and a value past a float32 bound still fail,
    unwritten (neutral) cells and in-range values pass."""
    ck = Checker(MemorySink(), value_limits={"lim*": (-1.0, 0.5)})
    ck.host_shortcuts = shortcuts  # off: the host-copy test a GPU's read-back takes
    ok = torch.full((4, 8), 0.25)
    for bad, kind in ((math.nan, "nan"), (0.5000001, "range"), (-math.inf, "-inf")):
        x = ok.clone()
        x[2, 3] = bad
        ck.begin_step(TRACES)
        ck.check("lim_ok", ok)
        ck.check("lim_bad", x)
        recs = ck.end_step()
        assert [(r.attrs["site"], r.attrs["row"], r.attrs["kind"]) for r in recs] == [
            ("lim_bad", 2, kind)
        ]
    ck.begin_step(TRACES)
    ck.check("lim_ok", ok)
    ck.check("lim_edge", torch.full((4, 8), 0.5))  # on the bound: in range
    assert ck.end_step() == []


def test_a_tap_becomes_a_hook_when_the_module_gets_hooks_after_a_later_wrapper():
    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, "numerical", sink=sink)
    lin = model.blocks[0][0]
    inner = lin.forward
    lin.forward = lambda *a, **k: inner(*a, **k)  # wrapped after the tap
    h = lin.register_forward_hook(lambda m, a, out: torch.full_like(out, math.nan))
    try:
        recs = run(ck, model, input_ids=ids())
    finally:
        h.remove()
    assert {r.attrs["module"] for r in recs if r.code == "ACTIVATION_INF"} == {"blocks.0.0"}
    ck.detach()
    assert not lin._forward_hooks


@pytest.mark.parametrize("shortcuts", [True, False])
def test_index_checks_agree_with_and_without_host_shortcuts(shortcuts):
    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, "default", sink=sink)
    ck.host_shortcuts = shortcuts
    x = ids(rows=4, t=1)
    assert run(ck, model, input_ids=x) == []
    bad = x.clone()
    bad[2, 0] = VOCAB + 5
    recs = [r for r in run(ck, model, input_ids=bad) if r.code == "TOKEN_ID_OUT_OF_VOCAB"]
    assert [(r.trace_id, r.attrs["row"]) for r in recs] == [(TRACES[2], 2)]
    assert recs[0].attrs["max"] == VOCAB + 5 and recs[0].attrs["hi_exclusive"] == VOCAB
    assert run(ck, model, input_ids=x) == []  # the next clean step is clean again


def test_compiled_model_with_all_modules_hooked_reports_through_the_device_mask():
    """``modules="all"`` before ``torch.compile``: TorchDynamo traces the hooks
    (is_dynamo_compiling is True then), the traced checks accumulate into the
    buffers, and end_step evaluates every site (graph mode)."""
    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, "numerical", sink=sink, modules="all")
    compiled = torch.compile(model, backend="eager")
    assert run(ck, compiled, input_ids=ids()) == [] and ck._graph_mode
    with poisoned(model.blocks[1][0].weight):
        recs = run(ck, compiled, input_ids=ids())
    act = [r for r in recs if r.code == "ACTIVATION_INF"]
    assert {r.attrs["module"] for r in act} >= {"blocks.1.0"}
    assert sorted({r.trace_id for r in act}) == sorted(TRACES)
    torch._dynamo.reset()


def test_taps_keep_the_forward_signature_so_generate_behaves_the_same():
    """transformers' generate() reads ``model.forward``'s signature to choose its
    arguments: a tapped model shows the same one and generates the same tokens."""
    import inspect

    model = llama()
    sig = inspect.signature(model.forward)
    x = ids(rows=2, t=5)
    with torch.inference_mode():
        ref = model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
    ck = instrument(model, "numerical", sink=MemorySink())
    assert inspect.signature(model.forward) == sig
    assert str(inspect.signature(model.lm_head.forward)) == "(input: torch.Tensor) -> torch.Tensor"
    ck.begin_step(TRACES[:2])
    with torch.inference_mode():
        out = model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    assert ck.end_step() == []


def test_containers_returning_their_last_childs_output_lose_their_tap():
    """``blocks.N`` (a Sequential) and the root return their last child's very
    tensor: after ALIAS_STEPS steps their taps go, the child still checks that
    tensor, and ``full`` (which checks a container's other outputs) brings the
    taps back."""
    from probes.ops import ALIAS_STEPS

    model, sink = TinyLM().eval(), MemorySink()
    ck = instrument(model, "numerical", sink=sink)
    x = ids(rows=4, t=1)
    for _ in range(ALIAS_STEPS - 1):
        assert run(ck, model, input_ids=x) == []
    assert ck.status()["aliased"] == []
    assert run(ck, model, input_ids=x) == []
    assert set(ck.status()["aliased"]) == {"<root>", "blocks.0", "blocks.1"}
    assert not tapped(model.blocks[0]) and tapped(model.blocks[0][2])
    with poisoned(model.blocks[1][2].weight):
        recs = run(ck, model, input_ids=x)
    first = [r for r in recs if "downstream" in r.attrs]
    assert {r.attrs["module"] for r in first} == {"blocks.1.2"}
    assert {r.trace_id for r in first} == set(TRACES)
    ck.set_tiers("full")
    assert ck.status()["aliased"] == [] and tapped(model.blocks[0])


# ---------------------------------------------------------------------------
# a GPU's read and reset path (pinned host twins), taken here on the CPU
# ---------------------------------------------------------------------------
def mirrored(model, tiers="default"):
    ck = Checker(MemorySink())
    ck._force_mirror = True  # the path a CUDA device takes, minus the pinning
    ck = instrument(model, tiers, checker=ck)
    ck.host_shortcuts = False
    assert ck._mirror is not None and ck._fnp is None
    return ck


def test_gpu_read_path_names_the_faulty_rows_and_resets_between_steps():
    model = llama()
    ck = mirrored(model, "numerical")
    assert run(ck, model, input_ids=ids()) == []
    with poisoned(model.model.layers[1].mlp.down_proj.weight):
        recs = run(ck, model, input_ids=ids())
    got = by_code(recs)
    assert set(got) == {"ACTIVATION_INF", "LOGITS_NAN"}
    assert [r.trace_id for r in got["ACTIVATION_INF"]] == TRACES
    assert run(ck, model, input_ids=ids()) == []  # the buffers were reset to neutral
    x = ids()
    x[1, 4] = VOCAB + 7
    recs = run(ck, model, input_ids=x)
    assert [(r.code, r.trace_id) for r in recs] == [("TOKEN_ID_OUT_OF_VOCAB", TRACES[1])]
    assert recs[0].attrs["max"] == VOCAB + 7 and recs[0].attrs["hi_exclusive"] == VOCAB
    assert run(ck, model, input_ids=ids()) == []


def test_gpu_read_path_costs_a_few_torch_ops_per_step():
    """Measured on an H200 host, each torch op of the step's read costs ~10 us
    of host time: the read and reset are three whole-buffer copies and two
    neutral copies, where the gather path took ~26 ops (~350 us a decode
    step). The full tier's own end-of-step checks come on top of either."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def end_step_ops(tiers, mirror):
        model = llama()
        ck = mirrored(model, tiers) if mirror else instrument(model, tiers, sink=MemorySink())
        if not mirror:  # the older GPU path: gathers of the cells in use
            ck.host_shortcuts = False
            ck._fnp = ck._snp = ck._inp = None
        for _ in range(2):
            assert run(ck, model, input_ids=ids(t=1)) == []
        ck.begin_step(TRACES)
        with torch.inference_mode():
            model(input_ids=ids(t=1))
        Count.n = 0
        with Count():
            assert ck.end_step() == []
        return Count.n

    assert end_step_ops("default", True) <= 6
    for tiers in ("default", "full"):
        assert end_step_ops(tiers, True) + 15 <= end_step_ops(tiers, False), tiers
