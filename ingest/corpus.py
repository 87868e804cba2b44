"""Realistic ordinary server output (not evidence of a fault), from the formats
vLLM, TGI, Triton, NCCL, uvicorn and the kernel really print.

Used as the negative class of the learned fallback classifier and as the bulk
of the lines in ``rca bench ingest``. Values vary; the shapes are real.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = [
    "benign_lines",
    "BENIGN_TEMPLATES",
    "TRACEBACK_BOILERPLATE",
    "CORPUS_DIR",
    "BASE_SET",
    "LEXICON_PATH",
    "SYNTHETIC_PATH",
    "corpus_sets",
    "family_lexicon",
    "real_corpus",
    "synthetic_lines",
    "training_corpus",
    "training_label",
]

#: Real lines gathered from public issue threads and source (see SOURCES.md there).
CORPUS_DIR = Path(__file__).with_name("data") / "corpus"
#: Phrases each fault family's lines typically say (family-model training text).
LEXICON_PATH = Path(__file__).with_name("data") / "family_lexicon.toml"
#: Fault lines written from knowledge, not copied from a log (see synthetic_lines.md).
SYNTHETIC_PATH = Path(__file__).with_name("data") / "synthetic_lines.jsonl"


def family_lexicon(path: str | Path = LEXICON_PATH) -> list[tuple[str, str]]:
    """(phrase, family) pairs of the family lexicon, in file order: knowledge
    the family model learns from, never counted as corpus lines. A family the
    catalog does not know is an error (a typo would silently teach nothing)."""
    import tomllib

    from graph.catalog import FAMILIES

    data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    out: list[tuple[str, str]] = []
    for fam, table in data.items():
        if fam not in FAMILIES:
            raise ValueError(f"{path}: [{fam}] is not a fault family")
        out += [(str(p), fam) for p in table.get("phrases", [])]
    return out


def synthetic_lines(path: str | Path = SYNTHETIC_PATH) -> list[tuple[str, str]]:
    """(text, label) pairs of the written fault lines, in file order: lines an
    engineer (a language-model assistant acting as one) wrote from knowledge of
    how each family's faults are printed, labelled with a catalog code or, when
    none fits, the family. The fallback trains on them next to the catalog's
    examples; no figure counts them as real lines. A family or code the catalog
    does not know, or a code of another family, is an error."""
    from graph.catalog import FAMILIES, default_catalog

    catalog = default_catalog()
    out: list[tuple[str, str]] = []
    for n, x in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not x.strip():
            continue
        d = json.loads(x)
        text, fam, code = d["text"], d["family"], d.get("code")
        if fam not in FAMILIES:
            raise ValueError(f"{path}:{n}: {fam!r} is not a fault family")
        if code is not None and (code not in catalog or catalog[code].family != fam):
            raise ValueError(f"{path}:{n}: {code!r} is not a catalog code of family {fam}")
        out.append((str(text), str(code or fam)))
    return out


BENIGN_TEMPLATES: tuple[str, ...] = (
    "INFO {md} {hms} metrics.py:351] Avg prompt throughput: {f1} tokens/s, Avg generation "
    "throughput: {f2} tokens/s, Running: {n1} reqs, Swapped: 0 reqs, Pending: {n2} reqs, GPU KV "
    "cache usage: {pct}%, CPU KV cache usage: 0.0%.",
    "INFO {md} {hms} [loggers.py:123] Engine 000: Avg prompt throughput: {f1} tokens/s, Avg "
    "generation throughput: {f2} tokens/s, Running: {n1} reqs, Waiting: {n2} reqs, GPU KV cache "
    "usage: {pct}%, Prefix cache hit rate: {pct2}%",
    'INFO:     {ip}:{port} - "POST /v1/chat/completions HTTP/1.1" 200 OK',
    'INFO:     {ip}:{port} - "POST /v1/completions HTTP/1.1" 200 OK',
    'INFO:     {ip}:{port} - "GET /health HTTP/1.1" 200 OK',
    'INFO:     {ip}:{port} - "GET /metrics HTTP/1.1" 200 OK',
    'INFO:     {ip}:{port} - "GET /v1/models HTTP/1.1" 200 OK',
    "INFO {md} {hms} [async_llm.py:261] Added request chatcmpl-{hex}.",
    "INFO {md} {hms} [logger.py:43] Received request cmpl-{hex}-0: params: SamplingParams(n=1, "
    "temperature={t}, top_p=0.95, max_tokens={n3}), lora_request: None.",
    "INFO {md} {hms} [engine.py:310] Finished request cmpl-{hex}.",
    "INFO {md} {hms} [gpu_model_runner.py:1712] Model loading took {f3} GiB and {f4} seconds",
    "INFO {md} {hms} [gpu_worker.py:227] Available KV cache memory: {f3} GiB",
    "INFO {md} {hms} [kv_cache_utils.py:716] GPU KV cache size: {n4} tokens",
    "INFO {md} {hms} [kv_cache_utils.py:720] Maximum concurrency for 8192 tokens per request: "
    "{f1}x",
    "INFO {md} {hms} [gpu_model_runner.py:2030] Graph capturing finished in {n1} secs, took "
    "{f5} GiB",
    "INFO {md} {hms} [core.py:171] init engine (profile, create kv cache, warmup model) took "
    "{f4} seconds",
    "INFO {md} {hms} [api_server.py:1350] Starting vLLM API server 0 on http://0.0.0.0:8000",
    "INFO {md} {hms} [launcher.py:37] Route: /v1/chat/completions, Methods: POST",
    "INFO {md} {hms} [default_loader.py:262] Loading weights took {f4} seconds",
    "Loading safetensors checkpoint shards:  {pct0}% Completed | {n5}/4 [00:0{n5}<00:00,  "
    "{f6}it/s]",
    "{iso}  INFO text_generation_router::server: router/src/server.rs:1865: Connected",
    "{iso}  INFO generate{{parameters=GenerateParameters {{ best_of: None, temperature: Some({t}),"
    ' max_new_tokens: Some({n3}) }} total_time="{f4}s" validation_time="{f7}ms" '
    'queue_time="{f7}ms" inference_time="{f4}s" time_per_token="{f7}ms" '
    'seed="None"}}: text_generation_router::server: router/src/server.rs:305: Success',
    "{iso}  INFO text_generation_launcher: Waiting for shard to be ready... rank=0",
    "{iso}  INFO shard-manager: text_generation_launcher: Shard ready in {f4}s rank=0",
    "I{md2} {hms}.{us} 1 grpc_server.cc:2495] Started GRPCInferenceService at 0.0.0.0:8001",
    "I{md2} {hms}.{us} 1 http_server.cc:4694] Started HTTPService at 0.0.0.0:8000",
    "I{md2} {hms}.{us} 1 model_lifecycle.cc:818] successfully loaded 'ensemble'",
    "I{md2} {hms}.{us} 1 server.cc:674] +------------------+---------+--------+",
    "gpu-node-{n6}:{pid}:{pid} [0] NCCL INFO Channel 0{n5}/24 :    0   1   2   3   4   5   6   7",
    "gpu-node-{n6}:{pid}:{pid} [0] NCCL INFO Connected all rings",
    "gpu-node-{n6}:{pid}:{pid} [0] NCCL INFO comm 0x{hex8} rank 0 nranks 8 cudaDev 0 nvmlDev 0 "
    "busId 19000 commId 0x{hex8} - Init COMPLETE",
    "gpu-node-{n6}:{pid}:{pid} [0] NCCL INFO Using network IB",
    "{mon} {day} {hms} gpu-node-{n6} kernel: [{up}] IPv6: ADDRCONF(NETDEV_CHANGE): veth{hex8}: "
    "link becomes ready",
    "{mon} {day} {hms} gpu-node-{n6} kernel: [{up}] cni0: port {n5}(veth{hex8}) entered "
    "forwarding state",
    "{mon} {day} {hms} gpu-node-{n6} systemd[1]: Started Session {n4} of User root.",
    "{mon} {day} {hms} gpu-node-{n6} kernel: [{up}] nvidia-uvm: Loaded the UVM driver, major "
    "device number 511.",
    "DEBUG {md} {hms} [core.py:722] EngineCore loop active.",
    "WARNING {md} {hms} [__init__.py:2662] We must use the `spawn` multiprocessing start method.",
    "INFO {md} {hms} [__init__.py:239] Automatically detected platform cuda.",
)


#: Lines that travel with faults but state none: traceback structure and the
#: hints PyTorch and CUDA print after the real error. The classifier must not
#: take them for the fault (the line above or below is the evidence).
TRACEBACK_BOILERPLATE: tuple[str, ...] = (
    "Traceback (most recent call last):",
    '  File "/usr/local/lib/python3.10/dist-packages/vllm/engine/async_llm_engine.py", line 51,'
    " in _log_task_completion",
    "    return_value = task.result()",
    '  File "uvloop/cbhandles.pyx", line 63, in uvloop.loop.Handle._run',
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "HIP kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.",
    "For debugging consider passing AMD_SERIALIZE_KERNEL=3",
    "Compile with `TORCH_USE_HIP_DSA` to enable device-side assertions.",
    "Exception in callback functools.partial(<function _log_task_completion at 0x7f3b2c1e8c10>, "
    "error_callback=<bound method AsyncLLMEngine._error_callback of "
    "<vllm.engine.async_llm_engine.AsyncLLMEngine object at 0x7f3b2a9d4b50>>)",
    "handle: <Handle functools.partial(<function _log_task_completion at 0x7f3b2c1e8c10>)>",
    "ERROR 11-29 10:14:03 async_llm_engine.py:61] Traceback (most recent call last):",
    "    raise AsyncEngineDeadError(",
    "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "[rank0]: Traceback (most recent call last):",
    "Error executing job with overrides: []",
    "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.",
)


def _values(rng: random.Random) -> dict[str, object]:
    h, m, s = rng.randrange(24), rng.randrange(60), rng.randrange(60)
    return {
        "md": f"{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
        "md2": f"{rng.randrange(1, 13):02d}{rng.randrange(1, 29):02d}",
        "hms": f"{h:02d}:{m:02d}:{s:02d}",
        "iso": f"2026-11-{rng.randrange(1, 29):02d}T{h:02d}:{m:02d}:{s:02d}."
        f"{rng.randrange(10**6):06d}Z",
        "mon": rng.choice(["Nov", "Dec"]),
        "day": rng.randrange(1, 29),
        "up": f"{rng.uniform(10, 900000):12.6f}",
        "us": f"{rng.randrange(10**6):06d}",
        "f1": f"{rng.uniform(0, 5000):.1f}",
        "f2": f"{rng.uniform(0, 900):.1f}",
        "f3": f"{rng.uniform(1, 70):.2f}",
        "f4": f"{rng.uniform(0.1, 90):.2f}",
        "f5": f"{rng.uniform(0.1, 2):.2f}",
        "f6": f"{rng.uniform(0.5, 9):.2f}",
        "f7": f"{rng.uniform(0.01, 90):.3f}",
        "t": f"{rng.uniform(0, 1.2):.1f}",
        "n1": rng.randrange(0, 256),
        "n2": rng.randrange(0, 64),
        "n3": rng.randrange(16, 4096),
        "n4": rng.randrange(1000, 900000),
        "n5": rng.randrange(1, 5),
        "n6": f"{rng.randrange(0, 64):02d}",
        "pct": f"{rng.uniform(0, 95):.1f}",  # >= 98% is a KV-pressure signal
        "pct2": f"{rng.uniform(0, 99):.1f}",
        "pct0": rng.choice([0, 25, 50, 75, 100]),
        "ip": f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}",
        "port": rng.randrange(1024, 65535),
        "hex": f"{rng.getrandbits(128):032x}",
        "hex8": f"{rng.getrandbits(32):08x}",
        "pid": rng.randrange(100, 99999),
    }


def benign_lines(n: int, *, seed: int = 0) -> list[str]:
    """``n`` ordinary lines drawn from :data:`BENIGN_TEMPLATES`."""
    rng = random.Random(seed)
    return [rng.choice(BENIGN_TEMPLATES).format(**_values(rng)) for _ in range(n)]


#: Name of the set a corpus line belongs to when it carries no ``set`` field.
BASE_SET = "corpus"


def corpus_sets(
    folder: str | Path = CORPUS_DIR,
) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
    """The corpus split by provenance: set name -> (fault lines, ordinary lines).

    A fault line's set is its ``set`` field (``BASE_SET`` without one); ordinary
    lines of set S are in ``benign_lines.S.txt`` (``benign_lines.txt``: the base
    set). The shipped corpus holds the lines gathered for it plus the former
    held-out sets (``dev``, ``holdout2``, ``holdout3``; ``holdout4``,
    ``holdout5`` since round 6), moved in once scored; a plain folder (a new
    held-out set) is one set."""
    root = Path(folder)
    sets: dict[str, tuple[list[dict[str, Any]], list[str]]] = {}
    for x in (root / "error_lines.jsonl").read_text(encoding="utf-8").splitlines():
        if x.strip():
            e = json.loads(x)
            sets.setdefault(str(e.get("set", BASE_SET)), ([], []))[0].append(e)
    for path in sorted(root.glob("benign_lines*.txt")):
        name = path.name.removeprefix("benign_lines").removesuffix(".txt").lstrip(".") or BASE_SET
        lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        sets.setdefault(name, ([], []))[1].extend(lines)
    if not (root / "benign_lines.txt").is_file():
        raise FileNotFoundError(2, "No such file", str(root / "benign_lines.txt"))
    return sets


def real_corpus(folder: str | Path = CORPUS_DIR) -> tuple[list[dict[str, Any]], list[str]]:
    """(labelled real fault lines, real ordinary lines) from a corpus folder, all
    its sets together (see :func:`corpus_sets`)."""
    errors: list[dict[str, Any]] = []
    benign: list[str] = []
    for errs, ben in corpus_sets(folder).values():
        errors += errs
        benign += ben
    return errors, benign


def training_label(line: dict[str, Any]) -> str:
    """What a labelled fault line teaches the fallback: its catalog code, or its
    family when no code fits (the family is still learned)."""
    return str(line.get("code") or line["family"])


def training_corpus(folder: str | Path = CORPUS_DIR) -> list[tuple[str, str | None]]:
    """(text, label) pairs for the learned fallback: labelled fault lines (label:
    a code, or a family for lines no code fits) and ordinary lines (None).
    Empty if the corpus is not installed."""
    try:
        errors, benign = real_corpus(folder)
    except FileNotFoundError:
        return []
    return [(e["text"], training_label(e)) for e in errors] + [(b, None) for b in benign]
