"""KV block fingerprints (probes.kvcache): a finished block that changes is
reported with its number, its layer and the requests that share it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from probes.kvcache import (  # noqa: E402
    KVBlockChecker,
    block_fingerprints,
    diff,
    fingerprint_hex,
    snapshot,
)
from probes.sink import MemorySink  # noqa: E402

A, B, C = "a" * 32, "b" * 32, "c" * 32


def paged(layers=2, blocks=32, dtype=torch.float16, seed=0):
    """vLLM-style per-layer (K, V), each [num_blocks, block_size, heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, 16, 4, 32)
    return {
        f"model.layers.{i}.self_attn": (
            torch.randn(shape, generator=g).to(dtype),
            torch.randn(shape, generator=g).to(dtype),
        )
        for i in range(layers)
    }


def flip_bit(t, block, bit=3):
    words = t[block].view(torch.int16).view(-1)
    words[123] ^= 1 << bit


def test_flipped_bit_in_a_finished_block_names_block_layer_and_requests():
    caches, sink = paged(), MemorySink()
    kv = KVBlockChecker(sink)
    kv.seal([3, 5, 7], trace_id=A, request_id="cmpl-a")
    kv.share([5], trace_id=B, request_id="cmpl-b")  # a prefix-cache hit
    assert kv.step(caches) == []  # references taken
    assert kv.step(caches) == []  # unchanged
    flip_bit(caches["model.layers.1.self_attn"][1], 5)
    recs = kv.step(caches)
    assert [(r.code, r.kv_block, r.trace_id, r.request_id) for r in recs] == [
        ("KV_BLOCK_HASH_MISMATCH", 5, A, "cmpl-a")
    ]
    rec = recs[0]
    assert rec.attrs["layer"] == "model.layers.1.self_attn" and rec.attrs["part"] == "v"
    assert rec.attrs["requests"] == [A, B] and rec.attrs["request_ids"] == ["cmpl-a", "cmpl-b"]
    assert rec.kv_hash == rec.attrs["found"] != rec.attrs["expected"]
    assert len(rec.kv_hash) == 16 and rec.layer == 4 and rec.source == "probe:kvcache"
    assert sink.codes() == ["KV_BLOCK_HASH_MISMATCH"]
    assert kv.step(caches) == []  # reported once, then re-baselined


def test_open_and_released_blocks_may_change():
    caches = paged()
    kv = KVBlockChecker(MemorySink())
    kv.seal([1, 2], trace_id=A)
    kv.step(caches)
    flip_bit(caches["model.layers.0.self_attn"][0], 9)  # block 9 was never sealed
    kv.release([2], trace_id=A)
    flip_bit(caches["model.layers.0.self_attn"][0], 2)  # freed, then reused
    assert kv.step(caches) == []
    kv.seal([2], trace_id=B)
    kv.step(caches)
    kv.release([1, 2])  # no request named: forgotten
    flip_bit(caches["model.layers.0.self_attn"][1], 1)
    assert kv.step(caches) == []


def test_swapped_words_are_caught_by_the_weighted_sum_not_the_xor():
    cache = paged(layers=1)["model.layers.0.self_attn"][0]
    before = block_fingerprints(cache)
    xor = torch.hash_tensor(cache[4].view(torch.int64))
    block = cache[4].view(-1)  # fp16: elements 12 and 500 sit in the same 16 bits of a word
    a, b = block[12].clone(), block[500].clone()
    block[12], block[500] = b, a
    assert torch.equal(xor, torch.hash_tensor(cache[4].view(torch.int64)))  # xor is blind
    after = block_fingerprints(cache)
    assert (after != before).nonzero().flatten().tolist() == [4]


def test_fingerprint_does_not_depend_on_layout_batch_or_chunking():
    cache = paged(layers=1, dtype=torch.bfloat16)["model.layers.0.self_attn"][0]
    fp = block_fingerprints(cache)
    assert fp.dtype == torch.int64 and fp.shape == (32,)
    strided = cache.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    assert torch.equal(block_fingerprints(strided), fp)
    assert torch.equal(block_fingerprints(cache[[3, 17]]), fp[[3, 17]])
    assert torch.equal(block_fingerprints(cache, chunk_bytes=1), fp)
    odd = torch.zeros(4, 3, 3, dtype=torch.uint8)  # no 64-bit view possible
    odd[2, 1, 1] = 1
    assert (block_fingerprints(odd) != block_fingerprints(torch.zeros_like(odd))).tolist() == [
        False,
        False,
        True,
        False,
    ]


def test_snapshot_and_diff():
    caches = paged()
    before = snapshot(caches, [0, 6])
    caches["model.layers.0.self_attn"][0][6, 0, 0, 0] += 1
    changed = diff(before, snapshot(caches, [0, 6]))
    assert [(layer, part, block) for layer, part, block, _, _ in changed] == [
        ("model.layers.0.self_attn", "k", 6)
    ]
    old, new = changed[0][3:]
    assert fingerprint_hex(old) != fingerprint_hex(new)


def test_verify_budget_covers_every_block_round_robin():
    caches = paged(layers=1)
    kv = KVBlockChecker(MemorySink(), verify_per_step=2)
    kv.seal(range(6), trace_id=A)
    kv.step(caches)
    flip_bit(caches["model.layers.0.self_attn"][0], 5)
    found = [r.kv_block for _ in range(3) for r in kv.step(caches)]
    assert found == [5]


def test_transformers_dynamic_cache_rows_and_blocks():
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    cache, sink = DynamicCache(config=cfg), MemorySink()
    kv = KVBlockChecker(sink)
    ids = torch.randint(0, 64, (3, 9))
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        assert kv.step_sequences(cache, [A, B, C], block_size=4) == []
        for _ in range(4):
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=tok, cache=cache, use_cache=True)
            assert kv.step_sequences(cache, [A, B, C], block_size=4) == []
    with torch.inference_mode():
        values = cache.layers[1].values  # [batch, kv_heads, seq, head_dim]
        values[2, 1, 5, 0] = values[2, 1, 5, 0] * 3 + 1  # row 2, token 5: block 1
        recs = kv.step_sequences(cache, [A, B, C], block_size=4)
    assert [(r.kv_block, r.trace_id, r.attrs["layer"], r.attrs["part"]) for r in recs] == [
        (1, C, "1", "v")
    ]
    assert recs[0].attrs["row"] == 2 and recs[0].attrs["token_range"] == [4, 8]
    assert sink.codes() == ["KV_BLOCK_HASH_MISMATCH"]


def test_a_broken_sink_never_raises():
    class Broken:
        def emit(self, record):
            raise OSError("disk full")

    caches = paged(layers=1)
    kv = KVBlockChecker(Broken())
    kv.seal([0], trace_id=A)
    kv.step(caches)
    flip_bit(caches["model.layers.0.self_attn"][0], 0)
    assert len(kv.step(caches)) == 1 and kv.errors == 1
    assert kv.step("not a cache") == [] and kv.errors == 2


def seq_cache(rows=2, blocks=10, layers=2, seed=0):
    """Legacy per-sequence cache: per layer (K, V), each [rows, heads, seq, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (rows, 2, blocks * 4, 8)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(layers)
    ]


def test_sequence_blocks_are_fingerprinted_once_with_the_block_definition():
    cache = seq_cache()
    kv = KVBlockChecker(MemorySink(), verify_per_step=2)
    assert kv.step_sequences(cache, [A, B], block_size=4) == []
    k = cache[1][0]  # layer 1, K: [rows, heads, seq, head_dim]
    blocks = k.unflatten(2, (10, 4)).transpose(1, 2)  # [rows, blocks, heads, 4, head_dim]
    expected = block_fingerprints(blocks.reshape(20, 2, 4, 8)).view(2, 10)
    assert torch.equal(kv._seq_refs[2, :, :10], expected)


@pytest.mark.parametrize("budget", [2, 4, 6])
def test_sequence_budget_catches_a_flip_within_the_stated_latency(budget):
    rows, blocks = 2, 10
    k = max(1, budget // rows)
    bound = -(-blocks // k)  # ceil(known / k)
    for block in range(blocks):
        for lead in range(bound):  # the flip lands at every cursor position
            cache = seq_cache(rows, blocks)
            kv = KVBlockChecker(MemorySink(), verify_per_step=budget)
            kv.step_sequences(cache, [A, B], block_size=4)
            for _ in range(lead):
                assert kv.step_sequences(cache, [A, B], block_size=4) == []
            cache[0][1][1, 0, block * 4 + 2, 5] += 1.0  # layer 0, V, row 1
            caught = [
                (n, r.kv_block, r.trace_id, r.attrs["part"])
                for n in range(1, bound + 1)
                for r in kv.step_sequences(cache, [A, B], block_size=4)
            ]
            assert len(caught) == 1 and caught[0][1:] == (block, B, "v"), (block, lead, caught)
            assert caught[0][0] <= bound


def test_sequence_growth_and_reset_rows_take_new_references():
    cache = seq_cache(rows=2, blocks=3)
    kv = KVBlockChecker(MemorySink(), verify_per_step=2)
    kv.step_sequences(cache, [A, B], block_size=4)
    grown = [tuple(torch.cat((t, torch.randn(2, 2, 8, 8)), 2) for t in layer) for layer in cache]
    assert kv.step_sequences(grown, [A, B], block_size=4) == []  # blocks 3, 4 are new
    grown[0][0][0, 1, 17, 3] += 1.0  # row 0, block 4
    found = [r.kv_block for _ in range(5) for r in kv.step_sequences(grown, [A, B], block_size=4)]
    assert found == [4]
    for t in grown[1]:
        t[1].normal_()  # row 1 now holds another sequence
    recs = kv.step_sequences(grown, [A, C], block_size=4, reset_rows=[1])
    assert recs == []
    assert [kv.step_sequences(grown, [A, C], block_size=4) for _ in range(5)] == [[]] * 5


@pytest.mark.parametrize("limit", [1 << 30, 3 * (2 * 2 * 3 * 4 * 32), 64])  # 1, 3 per buffer, loop
def test_sequence_window_fingerprints_agree_whatever_the_stack_limit(monkeypatch, limit):
    """One buffer for every layer, buffers of a few layers (a GPU's chunks), or
    a part at a time: the same fingerprints as the block definition."""
    import probes.kvcache as kvmod

    monkeypatch.setattr(kvmod, "_STACK_BYTES", limit)
    cache = seq_cache(rows=2, blocks=10, layers=4)
    tensors = [t for layer in cache for t in layer]  # 8 parts of [2, 2, 40, 8]
    got = kvmod._seq_range(tensors, 3, 6, 4)  # blocks 3..5
    want = torch.stack(
        [
            block_fingerprints(t[:, :, 12:24].unflatten(2, (3, 4)).transpose(1, 2), lead=2)
            for t in tensors
        ]
    )
    assert got.shape == (8, 2, 3) and torch.equal(got, want)
