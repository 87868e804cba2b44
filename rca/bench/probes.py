"""`rca bench probes`: what the in-process torch probes cost a decoder step.

One fixed shape, a Llama-style decoder (4 layers, hidden 256, 4 heads, vocab
32,000; batch 4; a 128-token prompt, then 32 decode steps with a KV cache),
random weights from a fixed seed (transformers' ``LlamaForCausalLM`` when it is
installed, else the small decoder below), one thread. The modes alternate in one
process, one decode step each in turn (ABCDE ABCDE ...), and each mode is
compared with the model without any hook:

* ``off``: no checker at all;
* ``default``: :func:`probes.ops.instrument` with no arguments (a NaN/inf row
  check of the logits, input index bounds; only the logits module tapped);
* ``numerical``: NaN/inf/range on the output of every module;
* ``full``: the ``full`` tier on every module (all outputs, bounded samples,
  KV length and shape checks, allocator counters);
* ``kv_fingerprint``: no operator checks; KV fingerprints in the configuration
  recommended for production (:data:`probes.kvcache.PRODUCTION_VERIFY_PER_STEP`
  blocks re-verified per step, round-robin; a 16-token block is fingerprinted
  once, when it fills). The result carries that configuration (``kv_config``)
  with its detection latency in steps.

Each mode's checker is made once and kept across the repetitions (a serving
process instruments its model once; set-up and the first steps' planning are
not a per-request cost); each repetition is a new generation (new KV cache,
new KV fingerprints).

torch is imported inside the functions only (``import rca`` must stay light).
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Any

__all__ = ["run_probe_bench", "kv_config", "cache_kwarg", "MODES", "SHAPE", "SHAPES"]

MODES = ("off", "default", "numerical", "full", "kv_fingerprint")
SHAPE = {
    "layers": 4,
    "hidden": 256,
    "heads": 4,
    "intermediate": 1024,
    "vocab": 32000,
    "batch": 4,
    "prompt": 128,
    "decode_steps": 32,
    "kv_block": 16,
    "dtype": "float32",
}
# ``small`` is the default and the one CPU figures are quoted for. ``1b`` has
# the decoder stack of Llama-3.2-1B (16 layers, hidden 2048, 32 heads, MLP 8192;
# a 32,000 vocabulary and no grouped KV heads here) in bf16, batch 8, a
# 512-token prompt: on a GPU a decode step of ``small`` is bound by kernel
# launches, so the probes' fixed per-step cost weighs more there than in a
# served model; ``1b`` shows what a real model's step makes of it.
SHAPES: dict[str, dict[str, Any]] = {
    "small": SHAPE,
    "1b": {
        **SHAPE,
        "layers": 16,
        "hidden": 2048,
        "heads": 32,
        "intermediate": 8192,
        "batch": 8,
        "prompt": 512,
        "dtype": "bfloat16",
    },
}


def _build_model(device: Any, seed: int, shape: dict[str, Any]) -> tuple[Any, str]:
    import torch

    torch.manual_seed(seed)
    dtype = getattr(torch, shape["dtype"])
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=shape["vocab"],
            hidden_size=shape["hidden"],
            intermediate_size=shape["intermediate"],
            num_hidden_layers=shape["layers"],
            num_attention_heads=shape["heads"],
            num_key_value_heads=shape["heads"],
            max_position_embeddings=max(512, 2 * (shape["prompt"] + shape["decode_steps"])),
        )
        model = LlamaForCausalLM(cfg)
        kind = "transformers.LlamaForCausalLM"
    except ImportError:
        model = _small_llama(torch, shape)
        kind = "rca.bench.probes small decoder"
    return model.to(device=device, dtype=dtype).eval(), kind


def _small_llama(torch: Any, shape: dict[str, Any]) -> Any:
    """A Llama-style decoder in plain torch (RMSNorm, RoPE, SwiGLU, a KV cache of
    ``[(k, v), ...]`` tensors ``[batch, heads, seq, head_dim]``)."""
    nn, F = torch.nn, torch.nn.functional
    hidden, heads, inter = shape["hidden"], shape["heads"], shape["intermediate"]
    hd = hidden // heads

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))

        def forward(self, x: Any) -> Any:
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rope(x: Any, pos: Any) -> Any:
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=x.device).float() / hd))
        f = pos[..., None].float() * inv
        cos, sin = f.cos()[:, None], f.sin()[:, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(hidden, hidden, bias=False)
            self.k_proj = nn.Linear(hidden, hidden, bias=False)
            self.v_proj = nn.Linear(hidden, hidden, bias=False)
            self.o_proj = nn.Linear(hidden, hidden, bias=False)

        def forward(self, x: Any, pos: Any, kv: Any) -> tuple[Any, Any]:
            b, t, _ = x.shape
            q, k, v = (
                p(x).view(b, t, heads, hd).transpose(1, 2)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            q, k = rope(q, pos), rope(k, pos)
            if kv is not None:
                k, v = torch.cat((kv[0], k), 2), torch.cat((kv[1], v), 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=kv is None)
            return self.o_proj(o.transpose(1, 2).reshape(b, t, hidden)), (k, v)

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(hidden, inter, bias=False)
            self.up_proj = nn.Linear(hidden, inter, bias=False)
            self.down_proj = nn.Linear(inter, hidden, bias=False)

        def forward(self, x: Any) -> Any:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
            self.self_attn, self.mlp = Attention(), MLP()

        def forward(self, x: Any, pos: Any, kv: Any) -> tuple[Any, Any]:
            a, kv = self.self_attn(self.input_layernorm(x), pos, kv)
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x)), kv

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(shape["vocab"], hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(shape["layers"]))
            self.norm = RMSNorm()
            self.lm_head = nn.Linear(hidden, shape["vocab"], bias=False)

        def forward(self, input_ids: Any, position_ids: Any = None, cache: Any = None) -> Any:
            past = cache[0][0].shape[2] if cache else 0
            if position_ids is None:
                position_ids = torch.arange(
                    past, past + input_ids.shape[1], device=input_ids.device
                )
                position_ids = position_ids[None].expand(input_ids.shape[0], -1)
            x = self.embed_tokens(input_ids)
            new = []
            for i, layer in enumerate(self.layers):
                x, kv = layer(x, position_ids, cache[i] if cache else None)
                new.append(kv)
            return self.lm_head(self.norm(x[:, -1:])), new

    return Decoder()


def _twin(model: Any, kind: str, device: Any, shape: dict[str, Any]) -> Any:
    """Another module tree over the same parameter tensors (hooks are per module
    object; the weights, and so the memory traffic, are shared)."""
    import torch

    if kind.startswith("transformers"):
        from transformers import LlamaForCausalLM

        twin = LlamaForCausalLM(model.config)
    else:
        twin = _small_llama(torch, shape)
    twin.load_state_dict(model.state_dict(), assign=True)
    return twin.to(device=device, dtype=getattr(torch, shape["dtype"])).eval()


def cache_kwarg(model: Any) -> str:
    """The name under which a transformers model's forward takes its KV cache:
    ``cache`` since transformers 5.2x renamed it, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_config() -> dict[str, Any]:
    """The KV fingerprint configuration the bench measures: production's."""
    from probes.kvcache import PRODUCTION_VERIFY_PER_STEP

    return {"verify_per_step": PRODUCTION_VERIFY_PER_STEP}


def _kv_latency(verify_per_step: int | None, shape: dict[str, Any]) -> int:
    """Steps within which every finished block of the bench's cache (at its
    longest) is re-verified at least once."""
    blocks = (shape["prompt"] + shape["decode_steps"]) // shape["kv_block"]
    if verify_per_step is None:
        return 1
    k = max(1, verify_per_step // shape["batch"])
    return -(-blocks // k)


class _Lane:
    """One mode's generation, advanced one step at a time. The operator
    checker is the mode's own, kept across generations as a serving process
    keeps it (its one-time set-up is not a per-request cost); KV fingerprints
    start afresh with each generation's new sequences."""

    def __init__(
        self,
        mode: str,
        model: Any,
        hf: bool,
        ids: Any,
        traces: list[str],
        checker: Any,
        kv_block: int,
    ) -> None:
        from probes.kvcache import KVBlockChecker
        from probes.sink import MemorySink

        self.mode, self.model, self.hf, self.ids, self.traces = mode, model, hf, ids, traces
        self.checker, self.kv_block = checker, kv_block
        self.cache_kw = cache_kwarg(model) if hf else "cache"
        self.sink = checker.sink if checker is not None else MemorySink()
        self.kv = None
        if mode == "kv_fingerprint":
            self.kv = KVBlockChecker(self.sink, **kv_config())
        self.cache: Any = None
        if hf:
            from transformers.cache_utils import DynamicCache

            self.cache = DynamicCache(config=model.config)
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.probe_times: list[float] = []  # begin_step + end_step + KV step, host wall

    def step(self, sync: Any) -> None:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        ck = self.checker
        if ck is not None:
            ck.begin_step(self.traces)
        p = time.perf_counter() - t0
        if self.hf:
            kw = {self.cache_kw: self.cache}
            out = self.model(input_ids=self.ids, use_cache=True, logits_to_keep=1, **kw)
            logits = out.logits
        else:
            logits, self.cache = self.model(self.ids, cache=self.cache)
        self.ids = logits[:, -1].argmax(-1, keepdim=True)
        sync()  # every lane waits here, so the probes' own time below is host work
        t1 = time.perf_counter()
        if ck is not None:
            ck.end_step()
        if self.kv is not None:
            self.kv.step_sequences(self.cache, self.traces, block_size=self.kv_block)
        self.probe_times.append(p + time.perf_counter() - t1)
        sync()
        self.times.append(time.perf_counter() - t0)
        self.cpu_times.append(time.thread_time() - c0)

    def close(self) -> None:
        if self.sink.records:
            raise RuntimeError(f"mode {self.mode}: a healthy model gave {self.sink.codes()[:5]}")


def run_probe_bench(
    *,
    device: str = "cpu",
    reps: int = 9,
    warmup: int = 1,
    seed: int = 0,
    threads: int = 1,
    size: str = "small",
) -> dict[str, Any]:
    """Time each mode ``reps`` times; return medians and ratios vs ``off``.

    The modes run in lockstep, one step each in turn (ABCDE ABCDE ..., the
    starting mode rotating every step), each on its own module tree over the
    same weights, so a noisy moment of the machine hits them all alike. A ratio
    is the median over repetitions of (mode total / ``off`` total) in the same
    repetition. Returns ``{"ratio_default", "ratio_numerical", "ratio_full",
    "ratio_kv_fingerprint", "ratio_iqr": {mode: [p25, p75]} of the per-repetition
    ratios, "ms": {mode: {"total", "prefill", "decode_step"}},
    "ratio_prefill", "ratio_decode", "shape", "model", "device", ...}``.
    ``size`` picks one of :data:`SHAPES`.
    """
    import torch

    from probes.ops import instrument
    from probes.sink import MemorySink

    if size not in SHAPES:
        raise ValueError(f"unknown size {size!r}: one of {', '.join(SHAPES)}")
    shp = SHAPES[size]
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    dev = torch.device(device)
    checkers: dict[str, Any] = {}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    try:
        base, kind = _build_model(device, seed, shp)
        hf = kind.startswith("transformers")
        models = {m: base if m == "off" else _twin(base, kind, device, shp) for m in MODES}
        g = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(0, shp["vocab"], (shp["batch"], shp["prompt"]), generator=g).to(dev)
        traces = [f"{seed:08x}{i:024x}" for i in range(shp["batch"])]
        runs: list[dict[str, list[float]]] = []
        cpu_runs: list[dict[str, list[float]]] = []
        probe_runs: list[dict[str, list[float]]] = []
        for m in ("default", "numerical", "full"):
            checkers[m] = instrument(models[m], m, sink=MemorySink())
        with torch.inference_mode():
            for rep in range(warmup + reps):
                lanes = [
                    _Lane(m, models[m], hf, ids, traces, checkers.get(m), shp["kv_block"])
                    for m in MODES
                ]
                try:
                    for step in range(shp["decode_steps"] + 1):
                        k = (step + rep) % len(lanes)
                        for lane in lanes[k:] + lanes[:k]:
                            lane.step(sync)
                finally:
                    for lane in lanes:
                        lane.close()
                if rep >= warmup:
                    runs.append({lane.mode: lane.times for lane in lanes})
                    cpu_runs.append({lane.mode: lane.cpu_times for lane in lanes})
                    probe_runs.append({lane.mode: lane.probe_times for lane in lanes})
    finally:
        for ck in checkers.values():
            ck.detach()
        torch.set_num_threads(old_threads)

    def per_rep(mode: str, part: str, source: list[dict[str, list[float]]] = runs) -> list[float]:
        pick = {"total": slice(None), "prefill": slice(0, 1), "decode": slice(1, None)}[part]
        return [sum(r[mode][pick]) * 1e3 for r in source]

    def ratio(mode: str, part: str, source: list[dict[str, list[float]]] = runs) -> float:
        a, b = per_rep(mode, part, source), per_rep("off", part, source)
        return round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 4)

    steps = shp["decode_steps"]
    ms = {
        m: {
            "total": round(statistics.median(per_rep(m, "total")), 3),
            "prefill": round(statistics.median(per_rep(m, "prefill")), 3),
            "decode_step": round(statistics.median(per_rep(m, "decode")) / steps, 4),
        }
        for m in MODES
    }

    def spread(mode: str) -> list[float]:
        """The middle half of the per-repetition ratios: how much to trust a median."""
        a, b = per_rep(mode, "total"), per_rep("off", "total")
        q = statistics.quantiles([x / y for x, y in zip(a, b, strict=True)], n=4)
        return [round(q[0], 4), round(q[2], 4)]

    out: dict[str, Any] = {f"ratio_{m}": ratio(m, "total") for m in MODES if m != "off"}
    out["ratio_iqr"] = {m: spread(m) for m in MODES if m != "off"} if reps >= 2 else {}
    out["ratio_prefill"] = {m: ratio(m, "prefill") for m in MODES if m != "off"}
    out["ratio_decode"] = {m: ratio(m, "decode") for m in MODES if m != "off"}
    # the same ratios on this thread's CPU time (a shared machine's preemption
    # drops out; the work the probes add stays)
    out["ratio_cpu_time"] = {m: ratio(m, "total", cpu_runs) for m in MODES if m != "off"}
    # the probes' own calls per decode step (begin_step, end_step with its one
    # device read, the KV step), microseconds, median over repetitions: the
    # fixed cost a step pays whatever the model's size
    out["probe_us_per_decode_step"] = {
        m: round(statistics.median(sum(r[m][1:]) for r in probe_runs) / steps * 1e6, 1)
        for m in MODES
    }
    out["ms"] = ms
    kv = kv_config()
    out["kv_config"] = {
        **kv,
        "block_size": shp["kv_block"],
        "detection_latency_steps": _kv_latency(kv["verify_per_step"], shp),
    }
    off = per_rep("off", "total")
    out["off_total_ms_range"] = [round(min(off), 3), round(max(off), 3)]
    out.update(
        size=size,
        shape=dict(shp),
        model=kind,
        device=str(device),
        reps=reps,
        threads=threads,
        torch=torch.__version__,
        targets={"default": 1.02, "numerical": 1.05, "full": 1.10, "kv_fingerprint": 1.05},
    )
    return out


if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    size = sys.argv[2] if len(sys.argv) > 2 else "small"
    print(json.dumps(run_probe_bench(device=dev, size=size), indent=2))
