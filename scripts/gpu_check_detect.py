#!/usr/bin/env python3
"""Check on a real GPU that the torch probes see planted faults and add no host sync.

    PYTHONPATH=. python3 scripts/gpu_check_detect.py [--device cuda] [--out detect.json]

The unit tests run on CPU; this runs the same probes on CUDA tensors:

1. host syncs: each tier (default, numerical, full) runs a forward pass under
   ``torch.cuda.set_sync_debug_mode("warn")``, which warns on every operation
   that makes the host wait for the GPU; the probes must add none to what the
   model itself does (the step's one read is ``end_step``, outside);
2. a NaN planted in one row's logits (default tier): LOGITS_NAN for that row's
   trace only;
3. an inf planted in one weight (numerical tier): ACTIVATION_INF at that module
   for every row;
4. a KV-cache value changed in a finished block of transformers' DynamicCache:
   KV_BLOCK_HASH_MISMATCH naming the block, layer, part and row's trace.

Prints one JSON object (also to ``--out``); exit status 1 when a check fails.
Needs torch and transformers; on CPU (the dry run) the sync count is skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from probes.kvcache import KVBlockChecker  # noqa: E402
from probes.ops import instrument  # noqa: E402
from probes.sink import MemorySink  # noqa: E402
from rca.bench.probes import cache_kwarg  # noqa: E402

TRACES = [f"{i:02x}" * 16 for i in range(1, 5)]
VOCAB = 512


def _model(dev: torch.device) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(cfg).to(dev).eval()


def _syncs(dev: torch.device, fn: Any) -> int | None:
    """Synchronizing operations while ``fn`` runs (CUDA's sync debug mode)."""
    if dev.type != "cuda":
        fn()
        return None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g).to(dev)
    res: dict[str, Any] = {"device": str(dev), "torch": torch.__version__}
    res["transformers"] = transformers.__version__
    if dev.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(dev)
    ok = True

    # 1. host syncs per tier
    syncs: dict[str, Any] = {}
    with torch.inference_mode():
        base = _model(dev)
        base(input_ids=ids)
        syncs["model_alone"] = _syncs(dev, lambda: base(input_ids=ids))
        for tier in ("default", "numerical", "full"):
            model = _model(dev)
            ck = instrument(model, tier, sink=MemorySink())
            ck.begin_step(TRACES)
            model(input_ids=ids)  # first pass: plans and buffers
            ck.end_step()
            ck.begin_step(TRACES)
            syncs[tier] = _syncs(dev, lambda m=model: m(input_ids=ids))
            recs = ck.end_step()
            syncs[f"{tier}_records"] = len(recs)
            ck.detach()
    res["syncs_during_forward"] = syncs
    if dev.type == "cuda":
        added = {t: syncs[t] - syncs["model_alone"] for t in ("default", "numerical", "full")}
        res["syncs_added_by_probes"] = added
        ok &= all(v <= 0 for v in added.values())
    ok &= all(syncs[f"{t}_records"] == 0 for t in ("default", "numerical", "full"))

    # 2. NaN in one row's logits, default tier
    model, sink = _model(dev), MemorySink()
    ck = instrument(model, sink=sink)

    def plant_nan(_mod: Any, _inp: Any, out: Any) -> Any:
        out[2, -1, 7] = math.nan  # row 2 only, on the device
        return out

    h = model.lm_head.register_forward_hook(plant_nan)
    with torch.inference_mode():
        ck.begin_step(TRACES)
        model(input_ids=ids)
        recs = ck.end_step()
    h.remove()
    got = [(r.code, r.trace_id, r.attrs.get("module")) for r in recs]
    res["nan_in_row_2"] = got
    ok &= got == [("LOGITS_NAN", TRACES[2], "lm_head")]

    # 3. inf weight, numerical tier
    model, sink = _model(dev), MemorySink()
    ck = instrument(model, "numerical", sink=sink)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.view(-1)[0] = math.inf
    with torch.inference_mode():
        ck.begin_step(TRACES)
        model(input_ids=ids)
        recs = ck.end_step()
    act = [r for r in recs if r.code == "ACTIVATION_INF"]
    res["inf_weight"] = {
        "codes": sorted({r.code for r in recs}),
        "modules": sorted({r.attrs["module"] for r in act}),
        "traces": [r.trace_id for r in act],
    }
    ok &= res["inf_weight"]["modules"] == ["model.layers.1.mlp.down_proj"]
    ok &= res["inf_weight"]["traces"] == TRACES

    # 4. a changed value in a finished KV block
    model = _model(dev)
    cache, sink = DynamicCache(config=model.config), MemorySink()
    kv, kw = KVBlockChecker(sink), cache_kwarg(model)
    clean = True
    with torch.inference_mode():
        out = model(input_ids=ids[:3, :9], use_cache=True, **{kw: cache})
        clean &= kv.step_sequences(cache, TRACES[:3], block_size=4) == []
        for _ in range(4):
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=tok, use_cache=True, **{kw: cache})
            clean &= kv.step_sequences(cache, TRACES[:3], block_size=4) == []
        values = cache.layers[1].values
        values[2, 1, 5, 0] = values[2, 1, 5, 0] * 3 + 1  # row 2, token 5: block 1
        recs = kv.step_sequences(cache, TRACES[:3], block_size=4)
    got = [(r.code, r.kv_block, r.trace_id, r.attrs["layer"], r.attrs["part"]) for r in recs]
    res["kv_flip"] = {"clean_steps_quiet": clean, "records": got}
    ok &= clean and got == [("KV_BLOCK_HASH_MISMATCH", 1, TRACES[2], "1", "v")]

    res["ok"] = bool(ok)
    text = json.dumps(res, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
