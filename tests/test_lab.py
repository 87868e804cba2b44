"""The fault-injection lab's serving stack: model, paged KV, scheduler, sampler,
speculative decoding, LoRA, engine and HTTP server, with the real probes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ingest import schema as S  # noqa: E402
from ingest.logs import parse_log_file  # noqa: E402
from ingest.prometheus import parse_exposition  # noqa: E402
from probes.sink import MemorySink  # noqa: E402
from rca.lab.engine import LabEngine, LabRequest  # noqa: E402
from rca.lab.kvcache import KVPool  # noqa: E402
from rca.lab.lora import LoraLoadError, random_adapter, save_adapter  # noqa: E402
from rca.lab.model import LabConfig, TinyLlama  # noqa: E402
from rca.lab.server import LabClient, build_app  # noqa: E402
from rca.lab.tokenizer import ByteTokenizer, DetokenizeError, TokenIdError  # noqa: E402

torch.set_num_threads(1)


def _engine(tmp_path: Path, name: str = "run", **cfg: Any) -> tuple[LabEngine, MemorySink]:
    faults = cfg.pop("faults", None)
    sink = MemorySink()
    eng = LabEngine(LabConfig(**cfg), tmp_path / name, sink=sink, faults=faults)
    assert eng.loaded, eng.load_error
    return eng, sink


def _log_codes(eng: LabEngine) -> list[str]:
    return [str(r.code) for r in parse_log_file(eng.run_dir / "engine.log").records]


# ---------------------------------------------------------------------------
# model, tokenizer
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_paged_attention_equals_dense_reference(kv_heads: int) -> None:
    cfg = LabConfig(num_kv_heads=kv_heads, num_blocks=16, block_size=4, seed=3)
    model = TinyLlama(cfg).eval()
    pool = KVPool(cfg.num_layers, cfg.num_blocks, cfg.block_size, kv_heads, cfg.head_dim)
    table = torch.tensor([[11, 2, 7, 0, 5]])  # scattered blocks: paging must matter
    ids = list(range(40, 53))  # 13-token prompt: blocks not aligned
    with torch.no_grad():
        got = model(torch.tensor([ids]), torch.arange(13)[None], pool, table, torch.tensor([13]))
        for _ in range(6):
            ref = model.forward_dense(torch.tensor([ids]))[:, -1]
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            nxt = int(got.argmax(-1))
            ids.append(nxt)
            p = len(ids) - 1
            got = model(torch.tensor([[nxt]]), torch.tensor([[p]]), pool, table, torch.tensor([1]))
    # batched, with padding: row 0 prefill of 5, row 1 prefill of 3
    pool2 = KVPool(cfg.num_layers, cfg.num_blocks, cfg.block_size, kv_heads, cfg.head_dim)
    a, b = [1, 2, 3, 4, 5], [9, 8, 7]
    ids2 = torch.tensor([a, b + [0, 0]])
    pos2 = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]])
    bt = torch.tensor([[3, 4], [8, 9]])
    with torch.no_grad():
        out = model(ids2, pos2, pool2, bt, torch.tensor([5, 3]))
        torch.testing.assert_close(
            out[0], model.forward_dense(torch.tensor([a]))[0, -1], rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(
            out[1], model.forward_dense(torch.tensor([b]))[0, -1], rtol=1e-4, atol=1e-4
        )


def test_tokenizer_round_trip_and_errors() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 123"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_token_id and max(ids[1:]) < 256
    assert tok.decode(ids) == text
    with pytest.raises(
        DetokenizeError, match="can't decode bytes in position 0-1: unexpected end of data"
    ):
        tok.decode([0xE2, 0x9C])
    assert tok.decode([0xE2, 0x9C], errors="replace") == "\ufffd"
    with pytest.raises(TokenIdError, match="Token id 300 is out of vocabulary"):
        tok.decode([65, 300])


# ---------------------------------------------------------------------------
# engine
# ---------------------------------------------------------------------------
def test_engine_end_to_end_metrics_series_and_log(tmp_path: Path) -> None:
    eng, sink = _engine(tmp_path, stats_every=5)
    futs = [
        eng.submit(LabRequest(prompt=f"hello {i}", max_tokens=12, trace_id=f"{i + 1:032x}"))
        for i in range(6)
    ]
    eng.run_until_idle()
    res = [f.result() for f in futs]
    assert [r.status for r in res] == [200] * 6
    assert all(r.usage["completion_tokens"] == 12 and r.finish_reason == "length" for r in res)
    assert all(r.request_id.startswith("cmpl-") and len(r.request_id) == 37 for r in res)
    # deterministic for a seed
    eng2, _ = _engine(tmp_path, "again")
    f2 = eng2.submit(LabRequest(prompt="hello 0", max_tokens=12))
    eng2.run_until_idle()
    assert f2.result().token_ids == res[0].token_ids
    # no probe record on a healthy run; NVML samples through the poller
    assert not [r for r in sink.records if isinstance(r, S.ErrorContext)]
    assert any(m["name"] == "nvml_gpu_temp_c" and m["value"] == 45 for m in sink.metrics)
    # series: one sample per step, every column mapped to a catalog code
    from graph.catalog import default_catalog

    cat = default_catalog()
    row = eng.series[-1]
    assert len(eng.series) == eng.step_no  # no idle calls here
    assert set(eng.series_codes) <= set(row)
    assert all(code in cat for code in eng.series_codes.values())
    assert row["gpu_temp"] == 45 and row["gpu_power"] == 120
    # metrics parse with the project's own parser
    parsed = parse_exposition(eng.metrics_text(), source="test")
    names = {s["name"] for s in parsed.samples}
    assert not parsed.quarantine
    assert {
        "vllm:num_requests_running",
        "vllm:request_success_total",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:generation_tokens_total",
    } <= names
    gen = [s for s in parsed.samples if s["name"] == "vllm:generation_tokens_total"]
    assert gen[0]["value"] == 72
    log = (eng.run_dir / "engine.log").read_text()
    assert "Avg prompt throughput:" in log and f"Finished request {res[0].request_id}." in log


def test_scheduler_preempts_with_a_small_pool_and_all_finish(tmp_path: Path) -> None:
    eng, sink = _engine(tmp_path, num_blocks=34, max_model_len=128, stats_every=1000)
    futs = [
        eng.submit(LabRequest(prompt="p" * 30, max_tokens=60, trace_id=f"{i + 1:032x}"))
        for i in range(6)
    ]
    eng.run_until_idle()
    assert [f.result().status for f in futs] == [200] * 6
    assert all(len(f.result().token_ids) == 60 for f in futs)
    assert eng.scheduler.num_preemptions > 0
    assert eng.allocator.num_free == eng.allocator.num_blocks
    assert "SCHEDULER_PREEMPTION" in _log_codes(eng)
    assert sum(r["sched_preemptions"] for r in eng.series) == eng.scheduler.num_preemptions
    # preemption by recompute does not change greedy output
    ref, _ = _engine(tmp_path, "ref")
    f = ref.submit(LabRequest(prompt="p" * 30, max_tokens=60))
    ref.run_until_idle()
    assert futs[-1].result().token_ids == f.result().token_ids


def test_scheduler_priority_queue_bound_and_preempted_go_first() -> None:
    from rca.lab.kvcache import BlockAllocator
    from rca.lab.scheduler import QueueFullError, Scheduler, Sequence

    def seq(order: int, n: int, priority: int = 0) -> Sequence:
        return Sequence(
            f"cmpl-{order}",
            None,
            [1] * n,
            8,
            0.0,
            1.0,
            torch.Generator(),
            order=order,
            priority=priority,
        )

    preempted: list[str] = []
    sched = Scheduler(
        BlockAllocator(4),
        4,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        max_waiting=3,
        on_preempt=lambda s: preempted.append(s.request_id),
    )
    a, b, c = seq(1, 6), seq(2, 6), seq(3, 3, priority=-1)
    for s_ in (a, b, c):
        sched.add(s_)
    with pytest.raises(QueueFullError, match="Exceeds maximum queue size"):
        sched.add(seq(4, 2))
    out = sched.schedule()
    assert [s_.request_id for s_, _ in out.rows] == ["cmpl-3", "cmpl-1"]  # priority first
    assert [n for _, n in out.rows] == [3, 6] and sched.allocator.num_free == 1
    for s_, n in out.rows:  # the prefill ran: one token each
        s_.num_computed += n
        s_.output_ids.append(5)
    c.output_ids += [5] * 8  # c needs two more blocks, one is free: a is preempted
    out = sched.schedule()
    assert preempted == ["cmpl-1"] and [s_.request_id for s_, _ in out.rows] == ["cmpl-3"]
    assert sched.waiting[0] is a and a.num_computed == 0 and a.block_table == []


def test_spec_decoding_gives_the_same_greedy_output(tmp_path: Path) -> None:
    outs = {}
    for k in (0, 3):
        eng, sink = _engine(tmp_path, f"spec{k}", spec_k=k, stats_every=5)
        futs = [eng.submit(LabRequest(prompt=f"speculate {i}", max_tokens=30)) for i in range(4)]
        steps = eng.run_until_idle()
        outs[k] = ([f.result().token_ids for f in futs], steps, eng)
    assert outs[3][0] == outs[0][0]
    eng = outs[3][2]
    assert eng.proposer is not None and 0.1 < eng.proposer.acceptance_rate <= 1
    assert outs[3][1] < outs[0][1]  # fewer steps for the same tokens
    assert "vllm:spec_decode_draft_acceptance_rate" in eng.metrics_text()
    assert (
        "SpecDecoding metrics: Mean acceptance length" in (eng.run_dir / "engine.log").read_text()
    )
    assert eng.series[-1]["spec_acceptance"] == pytest.approx(eng.proposer.acceptance_rate)


def test_nan_in_lm_head_gives_a_probe_record_with_the_trace_id_and_500(tmp_path: Path) -> None:
    eng, sink = _engine(tmp_path)
    with torch.no_grad():
        eng.model.lm_head.weight[7, 3] = float("nan")
    tid = "ab" * 16
    fut = eng.submit(LabRequest(prompt="hi", trace_id=tid))
    eng.run_until_idle()
    assert fut.result().status == 500 and eng.dead
    recs = [r for r in sink.records if isinstance(r, S.ErrorContext)]
    assert ("LOGITS_NAN", tid) in [(str(r.code), r.trace_id) for r in recs]
    assert eng.submit(LabRequest(prompt="again")).result().status == 503
    codes = _log_codes(eng)
    assert "SAMPLER_PROB_INF_NAN" in codes and "ENGINE_DEAD" in codes
    log = (eng.run_dir / "engine.log").read_text()
    assert "The above exception was the direct cause of the following exception" in log


def test_kv_bit_flip_in_a_sealed_block_is_caught_with_the_trace_id(tmp_path: Path) -> None:
    class Flip:
        """Flips a bit of a block the batch reads, the way the injectors pick it."""

        done = False

        def before_step(self, engine: LabEngine, batch: Any) -> None:
            if self.done or batch.is_prefill or engine.step_no < 4:
                return
            full = int(batch.context_lens[0]) // engine.config.block_size
            if full >= 2:
                block = int(batch.block_tables[0, 1])
                engine.pool.k[0, block, 0, 0, 0] += 1.0
                self.done = True

    eng, sink = _engine(tmp_path, faults=[Flip()])
    tid = "cd" * 16
    fut = eng.submit(LabRequest(prompt="x" * 20, max_tokens=20, trace_id=tid))
    eng.run_until_idle()
    assert fut.result().status == 200
    recs = [r for r in sink.records if isinstance(r, S.ErrorContext)]
    assert [(str(r.code), r.trace_id) for r in recs] == [("KV_BLOCK_HASH_MISMATCH", tid)]
    assert sum(r["kv_hash_mismatch"] for r in eng.series) == 1


def test_background_loop_serves_concurrent_requests(tmp_path: Path) -> None:
    import asyncio

    eng, sink = _engine(tmp_path, num_blocks=40, max_model_len=128)
    eng.start()
    try:
        client = LabClient(build_app(eng))

        async def burst() -> list[tuple[int, Any]]:
            return await asyncio.gather(
                *[
                    client.acomplete(prompt=f"r{i}" * 10, max_tokens=40, temperature=0.7, seed=i)
                    for i in range(12)
                ]
            )

        res = asyncio.run(burst())
    finally:
        eng.stop()
    assert [s for s, _ in res] == [200] * 12
    assert len({b["id"] for _, b in res}) == 12
    assert eng.scheduler.num_preemptions > 0  # 12 x 7 blocks > 40
    assert not eng.running


# ---------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------
def test_lora_changes_output_and_bad_adapters_are_refused(tmp_path: Path) -> None:
    eng, sink = _engine(tmp_path, max_lora_rank=16)
    good = random_adapter(eng.model, tmp_path / "good.pt", rank=8, seed=1)
    client = LabClient(build_app(eng))
    status, body = client.post(
        "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(good)}
    )
    assert status == 200 and "added successfully" in body
    s0, base = client.complete(prompt="select", max_tokens=10)
    s1, tuned = client.complete(prompt="select", max_tokens=10, model="sql")
    assert (s0, s1) == (200, 200)
    assert base["choices"][0]["text"] != tuned["choices"][0]["text"]
    assert tuned["model"] == "sql"
    # refused, with vLLM's words
    big = random_adapter(eng.model, tmp_path / "big.pt", rank=32)
    with pytest.raises(LoraLoadError, match="LoRA rank 32 is greater than max_lora_rank 16"):
        eng.load_lora("big", big)
    a = torch.zeros(4, 64)
    wrong = save_adapter(
        tmp_path / "mlp.pt",
        rank=4,
        alpha=8,
        target_modules=["gate_up_proj"],
        weights={"layers.0.mlp.gate_up_proj": (a, a)},
    )
    status, body = client.post("/v1/load_lora_adapter", {"lora_name": "w", "lora_path": str(wrong)})
    assert status == 400 and "expected target modules in" in body["error"]["message"]
    shape = save_adapter(
        tmp_path / "shape.pt",
        rank=4,
        alpha=8,
        target_modules=["q_proj"],
        weights={"layers.0.self_attn.q_proj": (torch.zeros(4, 32), a.T)},
    )
    with pytest.raises(LoraLoadError, match="size mismatch"):
        eng.load_lora("shape", shape)
    status, body = client.post(
        "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "nope.pt")}
    )
    assert status == 400 and "No adapter found for" in body["error"]["message"]
    assert eng.lora.names() == ["sql"]
    codes = _log_codes(eng)
    assert {
        "LORA_RANK_EXCEEDS_MAX",
        "LORA_TARGET_MODULES_MISMATCH",
        "LORA_ADAPTER_LOAD_FAILED",
    } <= set(codes)


# ---------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------
def _spans(sink: MemorySink) -> list[S.Span]:
    return [r for r in sink.records if isinstance(r, S.Span)]


def test_server_statuses_spans_and_access_lines(tmp_path: Path) -> None:
    eng, sink = _engine(tmp_path, max_waiting=2)
    client = LabClient(build_app(eng))
    status, body = client.complete(prompt="hello", max_tokens=5)
    assert status == 200 and body["id"].startswith("cmpl-")
    assert body["usage"]["completion_tokens"] == 5
    span = _spans(sink)[-1]
    assert span.http_status == 200 and span.attributes["gen_ai.response.id"] == body["id"]
    assert span.attributes["http.route"] == "/v1/completions"

    cases = [
        ({"prompt": "x", "temperature": -1}, 400, "temperature must be non-negative"),
        ({"prompt": "x", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "'max_tokens' must be an integer"),
        ({"prompt": [65, 9999]}, 400, "Token id 9999 is out of vocabulary"),
        ({"prompt": "x", "model": "nope"}, 404, "The model `nope` does not exist."),
        ({"prompt": "x" * 300}, 413, "maximum context length is 256 tokens"),
    ]
    for payload, want, text in cases:
        status, body = client.complete(**payload)
        assert status == want, (payload, body)
        assert text in body["error"]["message"] and body["error"]["code"] == want
        assert _spans(sink)[-1].http_status == want
    assert client.post("/v1/completions", raw=b"{not json")[0] == 400
    assert client.post("/v1/completions", raw=b"x" * (2 << 20))[0] == 413
    assert client.get("/nowhere")[0] == 404
    assert client.get("/health") == (200, None)
    status, st = client.get("/health/checker_status")
    assert status == 200 and isinstance(st, dict)
    status, st = client.post("/health/checker_status", {"tiers": "full"})
    assert status == 200 and client.get("/health/checker_status")[1] == st
    assert client.post("/health/checker_status", {"nope": 1})[0] == 400
    status, text = client.get("/metrics")
    assert status == 200 and "vllm:num_requests_waiting" in text

    # 429: the waiting queue is full (two queued, nobody stepping)
    for _ in range(2):
        eng.submit(LabRequest(prompt="queued"))
    status, body = client.complete(prompt="one more")
    assert status == 429 and "Exceeds maximum queue size" in body["error"]["message"]
    eng.run_until_idle()
    codes = _log_codes(eng)
    for c in ("HTTP_400", "HTTP_404", "HTTP_413", "HTTP_429", "REQUEST_QUEUE_FULL"):
        assert c in codes, c


def test_server_504_from_a_slow_step_and_500_then_503_from_a_failing_one(
    tmp_path: Path,
) -> None:
    class Slow:
        def before_step(self, engine: LabEngine, batch: Any) -> None:
            time.sleep(0.03)

    eng, sink = _engine(tmp_path, "slow", faults=[Slow()])
    client = LabClient(build_app(eng))
    status, body = client.complete(prompt="slow", max_tokens=20, timeout=0.05)
    assert status == 504 and "timed out" in body["error"]["message"]
    assert client.complete(prompt="ok", max_tokens=2)[0] == 200  # the engine goes on
    assert "HTTP_504" in _log_codes(eng)

    class Boom:
        def before_step(self, engine: LabEngine, batch: Any) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng, sink = _engine(tmp_path, "boom", faults=[Boom()])
    client = LabClient(build_app(eng))
    status, body = client.complete(prompt="boom")
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    span = _spans(sink)[-1]
    assert span.http_status == 500 and span.status_code == "ERROR"
    assert span.attributes["gen_ai.response.id"].startswith("cmpl-")
    assert client.complete(prompt="after")[0] == 503
    assert client.get("/health")[0] == 503
    codes = _log_codes(eng)
    assert {"CUDA_ERROR_ILLEGAL_ADDRESS", "ENGINE_DEAD", "HTTP_500", "HTTP_503"} <= set(codes)


def test_server_nan_probe_record_carries_the_span_trace_id(tmp_path: Path) -> None:
    eng, sink = _engine(tmp_path)
    with torch.no_grad():
        eng.model.lm_head.weight[0, 0] = float("nan")
    client = LabClient(build_app(eng))
    status, body = client.complete(prompt="nan please")
    assert status == 500
    span = [s for s in _spans(sink) if s.http_status == 500][-1]
    recs = [r for r in sink.records if isinstance(r, S.ErrorContext)]
    nan = [r for r in recs if str(r.code) == "LOGITS_NAN"]
    assert nan and nan[0].trace_id == span.trace_id
    assert nan[0].request_id == span.attributes["gen_ai.response.id"]


class _DropHead:
    def on_load(self, engine: LabEngine, state: dict) -> None:
        del state["lm_head.weight"]


@pytest.mark.parametrize(
    ("cfg", "faults", "code"),
    [
        ({}, [_DropHead()], "ENGINE_CORE_STARTUP_FAILED"),
        ({"truncate_checkpoint": True}, [], "MODEL_WEIGHTS_LOAD_FAILED"),
        ({"tensor_parallel_size": 3}, [], "CONFIG_TP_HEADS_NOT_DIVISIBLE"),
        ({"max_model_len": 4096}, [], "CONFIG_MAX_MODEL_LEN_TOO_LARGE"),
        ({"num_blocks": 8}, [], "KV_CACHE_MAX_SEQ_LEN_EXCEEDS_CAPACITY"),
    ],
)
def test_load_failures_give_503(tmp_path: Path, cfg: dict, faults: list, code: str) -> None:
    eng = LabEngine(LabConfig(**cfg), tmp_path / "bad", sink=MemorySink(), faults=faults)
    assert not eng.loaded
    client = LabClient(build_app(eng))
    assert client.complete(prompt="x")[0] == 503
    assert client.get("/health")[0] == 503
    codes = _log_codes(eng)
    assert code in codes and "ENGINE_CORE_STARTUP_FAILED" in codes


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    eng, _ = _engine(tmp_path, "a", checkpoint=str(tmp_path / "w.safetensors"))
    assert (tmp_path / "w.safetensors").exists()
    f1 = eng.submit(LabRequest(prompt="same", max_tokens=6))
    eng.run_until_idle()
    ref, _ = _engine(tmp_path, "b")
    f2 = ref.submit(LabRequest(prompt="same", max_tokens=6))
    ref.run_until_idle()
    assert f1.result().token_ids == f2.result().token_ids
