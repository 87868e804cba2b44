from __future__ import annotations

import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from graph.catalog import FAMILIES, LAYER_NAMES, load_catalog, parse_catalog
from graph.errors import CatalogError

GOOD = """
version = 1
[[code]]
name = "A_CODE"
id = 1001
layer = 1
stage = "decode"
trigger = "hardware_driver"
recoverability = "transient"
family = "gpu_hardware"
severity = "error"
summary = "s"
action = "a"
grounding = "g"
patterns = ['Xid \\(PCI:(?P<pci>[0-9a-f:]+)\\): 48,']
examples = ["NVRM: Xid (PCI:0000:19:00): 48, pid=1"]
causes = [{ code = "B_CODE", strength = 0.5 }]

[[code]]
name = "B_CODE"
id = 7500
layer = 7
stage = "transport"
trigger = "engine"
recoverability = "transient"
family = "engine_crash"
severity = "error"
summary = "s"
action = "a"
grounding = "g"
detectors = ["otel:http.response.status_code=500"]
"""


def _parse(text: str):
    return parse_catalog(tomllib.loads(text), "test.toml")


def _problems(text: str) -> list[str]:
    with pytest.raises(CatalogError) as exc:
        _parse(text)
    assert "test.toml" in str(exc.value)
    return exc.value.problems


def test_good_catalog_parses() -> None:
    cat = _parse(GOOD)
    assert [c.name for c in cat] == ["A_CODE", "B_CODE"]
    assert cat["A_CODE"].causes[0].code == "B_CODE"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('name = "B_CODE"', 'name = "A_CODE"', "duplicate name A_CODE"),
        ("id = 7500", "id = 1001\nlayer_x = 1", "unknown field(s) layer_x"),
        ("id = 7500", "id = 6500", "id // 1000 == layer 7"),
        ('stage = "transport"', 'stage = "warmup"', "stage 'warmup' is not one of"),
        ('trigger = "engine"', 'trigger = "cosmic_ray"', "trigger 'cosmic_ray'"),
        (
            'recoverability = "transient"\nfamily = "engine_crash"',
            'recoverability = "maybe"\nfamily = "engine_crash"',
            "recoverability 'maybe'",
        ),
        ('family = "engine_crash"', 'family = "gremlins"', "unknown family 'gremlins'"),
        (
            'severity = "error"\nsummary = "s"\naction = "a"\ngrounding = "g"\ndetectors',
            'severity = "loud"\nsummary = "s"\naction = "a"\ngrounding = "g"\ndetectors',
            "severity 'loud'",
        ),
        (
            'code = "B_CODE", strength = 0.5',
            'code = "NOPE", strength = 0.5',
            "edge to unknown code NOPE",
        ),
        (
            'code = "B_CODE", strength = 0.5',
            'code = "B_CODE", strength = 1.5',
            "strength 1.5, not in (0, 1]",
        ),
        ('code = "B_CODE", strength = 0.5', 'code = "A_CODE", strength = 0.5', "edge to itself"),
        ("layer = 1", "layer = 9", "layer 9 is not one of 1..7"),
        ('detectors = ["otel:http.response.status_code=500"]', "", "at least one pattern"),
        ("48, pid=1", "49, pid=1", "matches none of its examples"),
        ("(?P<pci>", "(?<=x)(?P<pci>", "look-around"),
        ("[0-9a-f:]+)", "[0-9a-f:+)", "does not compile"),
        (
            'summary = "s"\naction = "a"\ngrounding = "g"\npatterns',
            'summary = "s"\ngrounding = "g"\npatterns',
            "missing field(s) action",
        ),
        (
            'causes = [{ code = "B_CODE"',
            'wins_over = ["NOPE"]\ncauses = [{ code = "B_CODE"',
            "wins_over names NOPE",
        ),
        (
            'causes = [{ code = "B_CODE"',
            'wins_over = ["A_CODE"]\ncauses = [{ code = "B_CODE"',
            "wins_over names A_CODE",
        ),
    ],
)
def test_each_validation_error_is_reported(old: str, new: str, message: str) -> None:
    assert old in GOOD
    problems = _problems(GOOD.replace(old, new, 1))
    assert any(message in p for p in problems), problems


def test_wins_over_is_declared_precedence_between_two_codes() -> None:
    """A code drops out when another code matching the same line names it in
    ``wins_over``, whatever the spans; two codes may not name each other."""
    from ingest.classify import pick_match

    base = GOOD.replace('family = "engine_crash"', 'family = "timeout"')  # not a wrapper
    line = "NVRM: Xid (PCI:0000:19:00): 48, pid=1 and a much longer text after it"
    short, long = re.search(r"Xid \(PCI", line), re.search(r"Xid .* after it", line)
    assert short is not None and long is not None
    plain = _parse(base)  # no declaration: the longer span wins
    assert pick_match([(short, plain["A_CODE"]), (long, plain["B_CODE"])])[1].name == "B_CODE"
    a_wins = base.replace(
        'causes = [{ code = "B_CODE"', 'wins_over = ["B_CODE"]\ncauses = [{ code = "B_CODE"'
    )
    cat = _parse(a_wins)
    assert cat["A_CODE"].to_dict()["wins_over"] == ["B_CODE"]
    assert pick_match([(short, cat["A_CODE"]), (long, cat["B_CODE"])])[1].name == "A_CODE"
    assert pick_match([(long, cat["B_CODE"])])[1].name == "B_CODE"  # alone, B still names it
    both = a_wins.replace('detectors = ["otel', 'wins_over = ["A_CODE"]\ndetectors = ["otel')
    assert any("also wins over it" in p for p in _problems(both))


def test_several_problems_are_reported_together() -> None:
    text = GOOD.replace('family = "engine_crash"', 'family = "x"').replace("0.5", "2.0")
    assert len(_problems(text)) == 2


def test_unreadable_and_invalid_toml_files(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[code]\nname=")
    with pytest.raises(CatalogError, match="not valid TOML"):
        load_catalog(bad)


# ---- the shipped catalog -----------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    return load_catalog(check_patterns=True)


def test_shipped_catalog_is_complete(shipped) -> None:
    assert len(shipped) >= 137
    layers = Counter(c.layer for c in shipped)
    assert set(layers) == set(LAYER_NAMES)
    assert all(n >= 8 for n in layers.values()), layers
    assert set(c.family for c in shipped) == set(FAMILIES)


def test_every_code_is_produced_by_a_pattern_or_detector(shipped) -> None:
    for code in shipped:
        assert code.patterns or code.detectors, code.name
        for pat in code.patterns:
            assert any(re.search(pat, ex) for ex in code.examples), (code.name, pat)


def test_shipped_patterns_are_specific(shipped) -> None:
    """An example line of one code is not claimed by an unrelated code's pattern."""
    from ingest.normalize import LineClassifier

    clf = LineClassifier(shipped)
    wrong = []
    for code in shipped:
        for ex in code.examples:
            m = clf.classify(ex)
            if m is None or m.code.name != code.name:
                wrong.append((code.name, m.code.name if m else None, ex[:80]))
    # a few lines legitimately carry two codes (e.g. an access log 500 after an
    # engine error on the same line); everything else must round-trip
    assert len(wrong) <= len(shipped) // 20, wrong


def test_patterns_compile_in_polars_rust_regex(shipped) -> None:
    import polars as pl

    s = pl.Series([ex for c in shipped for ex in c.examples])
    for code in shipped:
        for pat in code.patterns:
            assert s.str.contains(pat).any(), (code.name, pat)


def test_ordinary_info_lines_match_no_code(shipped) -> None:
    from ingest.normalize import LineClassifier

    clf = LineClassifier(shipped)
    benign = [
        "INFO 05-12 10:01:02 metrics.py:351] Avg prompt throughput: 512.3 tokens/s, Avg "
        "generation throughput: 87.1 tokens/s, Running: 12 reqs, Swapped: 0 reqs, Pending: 0 "
        "reqs, GPU KV cache usage: 43.2%, CPU KV cache usage: 0.0%.",
        'INFO:     10.0.0.5:51234 - "POST /v1/completions HTTP/1.1" 200 OK',
        "INFO 11-29 10:13:31 api_server.py:712] vLLM API server version 0.6.3.post1",
        "Nov 29 09:58:42 gpu-node-07 kernel: [  602.004112] NVRM: GPU at PCI:0000:19:00: "
        "GPU-1c0f5a3e-7d2b-4e7a-9b1e-0a2c3d4e5f60",
        "Nov 29 10:01:17 gpu-node-07 kernel: [  756.402211] IPv6: ADDRCONF(NETDEV_CHANGE): "
        "veth3f2a1c9: link becomes ready",
        "2024-05-01T12:00:00.000Z INFO text_generation_router: router/src/main.rs:300: Connected",
    ]
    assert [clf.classify(line) for line in benign] == [None] * len(benign)


def test_catch_all_codes_lose_to_specific_ones(shipped) -> None:
    """GPU_XID_OTHER only wins when no specific Xid code matches; NVLink-class
    Xids land in interconnect even when the PCI id is masked."""
    from ingest.normalize import LineClassifier

    clf = LineClassifier(shipped)
    xid77 = "NVRM: Xid (PCI:0000:3b:00): 77, pid=2113, name=python3, Channel 0x00000018"
    assert clf.classify(xid77).code.name == "GPU_XID_OTHER"
    xid48 = (
        "NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable "
        "double bit error (DBE) has been detected on GPU in the framebuffer at physAddr "
        "0x7fffa8860 partition 7, subpartition 1."
    )
    assert clf.classify(xid48).code.name == "GPU_XID_48"
    masked = "NVRM: Xid (PCI:...): 136, link training failed"
    assert clf.classify(masked).code.family == "interconnect"


def test_a_wrapper_line_yields_the_cause_it_quotes(shipped) -> None:
    """engine_crash wrappers ("Exception in worker ... while processing method
    init_device: <cause>") lose to the cause's code on the same line, in both
    classifiers."""
    from ingest.classify import Normalizer
    from ingest.normalize import LineClassifier

    line = (
        "(VllmWorkerProcess pid=13359) ERROR 08-02 18:15:15 multiproc_worker_utils.py:226] "
        "Exception in worker VllmWorkerProcess while processing method init_device: Cannot "
        "re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use "
        "the 'spawn' start method"
    )
    assert LineClassifier(shipped).classify(line).code.name == "CUDA_FORK_REINIT"
    assert Normalizer(shipped, fallback=False).classify_line(line).code == "CUDA_FORK_REINIT"
    wrapper_only = line.split(": Cannot")[0]
    assert LineClassifier(shipped).classify(wrapper_only).code.family == "engine_crash"


# ---- round 5: message families found in the misses of holdout4 ----------------------
# Each line is public text (issue threads, docs, source strings) that is neither a
# holdout4 line nor a catalog example: a wording variant the general pattern must
# cover (another ring, device, rank, operator or error code than the example shows).
ROUND5_LINES = [
    # amdgpu hangs and resets (kernel bug reports, dri-devel)
    (
        "[   34.965321] amdgpu 0000:03:00.0: amdgpu: ring comp_1.1.0 timeout, signaled seq=7, "
        "emitted seq=9",
        "AMDGPU_GPU_HANG_RESET",
    ),
    ("[  437.537191] amdgpu 0000:00:07.0: amdgpu: GPU reset begin!", "AMDGPU_GPU_HANG_RESET"),
    ("amdgpu 0000:66:00.0: amdgpu: MES failed to respond to msg=RESET", "AMDGPU_GPU_HANG_RESET"),
    (
        "[Fri Apr 17 19:56:46 2026] amdgpu 0000:65:00.0: [drm] device wedged, but recovered "
        "through reset",
        "AMDGPU_GPU_HANG_RESET",
    ),
    # Ascend: torch_npu / CANN / HCCL
    (
        "RuntimeError: createHCCLComm:build/CMakeFiles/torch_npu.dir/compiler_depend.ts:1508 "
        "HCCL function error: HcclGetRootInfo(&hcclID), error code is 7",
        "HCCL_COMM_ERROR",
    ),
    (
        "[rank0]: [ERROR] 2025-03-26-11:49:12 (PID:3674, Device:0, RankID:0) ERR02200 DIST call "
        "hccl api failed.",
        "HCCL_COMM_ERROR",
    ),
    (
        "EI0006: Getting socket times out. Reason: 1. The remote does not initiate a connect "
        "request. some NPUs in the cluster are abnormal.",
        "HCCL_COMM_ERROR",
    ),
    (
        "[ERROR] HCCL(14830, python3.1):2026-02-09-11:31:31.825.623 [hccl_socket_manager.cc:816]"
        "[14263][Wait][LinkEstablish]wait socket establish timeout, role[1] rank[1] timeout[120 s]",
        "HCCL_COMM_ERROR",
    ),
    (
        "ERROR 05-27 09:53:02 [engine.py:448] SetPrecisionMode:build/CMakeFiles/torch_npu.dir/"
        "compiler_depend.ts:155 NPU function error: at_npu::native::AclSetCompileopt("
        "aclCompileOpt::ACL_PRECISION_MODE, precision_mode), error code is 500001",
        "ASCEND_ACL_ERROR",
    ),
    (
        "ERROR 05-13 09:39:22 core.py:291] RuntimeError: The Inner error is reported as above. "
        "The process exits for this inner error, and the current working operator name is "
        "lccl_allreduce.",
        "ASCEND_ACL_ERROR",
    ),
    (
        "EI0002: The wait execution of the Notify register times out. Reason: The Notify "
        "register has not received the Notify record from remote rank [0].",
        "ASCEND_TASK_TIMEOUT",
    ),
    (
        "worker-1: EI9999: 2024-07-03-11:28:40.419.527  The error from device(chipId:0, "
        "dieId:0), serial number is 1, hccl fftsplus task timeout occurred during task "
        "execution, stream_id:4, sq_id:4, task_id:5, stuck notify num:7, timeout:1836.",
        "ASCEND_TASK_TIMEOUT",
    ),
    (
        "RuntimeError: InnerRun:build/CMakeFiles/torch_npu.dir/compiler_depend.ts:194 OPS function "
        "error: MaxPoolGradWithArgmaxV1, error code is 500002",
        "ASCEND_ACL_ERROR",
    ),
    (
        "[rank1]: RuntimeError: InnerRunOpApi:torch_npu/csrc/framework/OpParamMaker.cpp:281 OPS "
        "function error: HcclAllreduce, error code is 6",
        "HCCL_COMM_ERROR",
    ),
    (
        "RuntimeError: CUDA error: CUBLAS_STATUS_INVALID_VALUE when calling "
        "cublasSgemmStridedBatched( handle, opa, opb, m, n, k, &alpha, a, lda, stridea, b, ldb, "
        "strideb, &beta, c, ldc, stridec, num_batches)",
        "CUBLAS_STATUS_OTHER",
    ),
    # process and worker deaths
    (
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -7) local_rank: "
        "0 (pid: 3311) of binary: /usr/bin/python",
        "PROCESS_CRASHED_BY_SIGNAL",
    ),
    (
        "Fatal Python error: _PyEval_EvalFrameDefault: Executing a cache.",
        "PROCESS_CRASHED_BY_SIGNAL",
    ),
    (
        "[2025-05-06 06:19:33] TpModelWorkerClient hit an exception: Traceback (most recent "
        "call last):",
        "ENGINE_THREAD_ABORTED",
    ),
    (
        "[signal SIGSEGV: segmentation violation code=0x80 addr=0x0 pc=0x7fa45a87f6b2]",
        "ENGINE_THREAD_ABORTED",
    ),
    (
        "ray.exceptions.RayTaskError(ActorDiedError): ray::TaskRunner.run() (pid=15334, "
        "ip=10.80.8.181, actor_id=fd3e78044484d6f1fdf0392301000000)",
        "RAY_ACTOR_DIED",
    ),
    ("Memory on the node (IP: 10.244.1.4) was 1.99GB / 2.00GB (0.997005)", "RAY_NODE_OOM"),
    # memory, compile, client, adapters, links
    ("MLU out of memory. Tried to allocate more than 1EB memory.", "TORCH_CUDA_OOM"),
    (
        "  what():  [FT][ERROR] CUDA runtime error: out of memory /workspace/FasterTransformer/"
        "src/fastertransformer/tensorrt_plugin/swin/swinTransformerPlugin.h:198",
        "CUDA_MALLOC_FAILED",
    ),
    (
        "torch._inductor.exc.InductorError: RuntimeError: No valid triton configs.",
        "TORCH_COMPILE_FAILED",
    ),
    ("RuntimeError: Capture cuda graph failed", "CUDA_GRAPH_CAPTURE_FAILED"),
    (
        "2025-03-09 18:20:41  [INFO] [LM STUDIO SERVER] Client disconnected. Stopping "
        "generation... (If the model is busy processing the prompt, it will finish first.)",
        "CLIENT_DISCONNECTED",
    ),
    (
        "ValueError: Target modules {'key', 'value', 'query'} not found in the base model. "
        "Please check the target modules and try again.",
        "LORA_TARGET_MODULES_MISMATCH",
    ),
    ("mlx5: n136-096-142: got completion with error:", "RDMA_TRANSPORT_ERROR"),
    (
        "Error 803: system has unsupported display driver / cuda driver combination "
        "(Triggered internally at  ../c10/cuda/CUDAFunctions.cpp:109.)",
        "CUDA_DRIVER_VERSION_INSUFFICIENT",
    ),
]


@pytest.mark.parametrize(("line", "code"), ROUND5_LINES)
def test_round5_message_families_match_their_code(shipped, line: str, code: str) -> None:
    from ingest.classify import Normalizer

    examples = {ex for c in shipped for ex in c.examples}
    assert line not in examples  # a variant, not the example itself
    assert Normalizer(shipped, fallback=False).classify_line(line).code == code


@pytest.mark.parametrize(
    "line",
    [
        # a child that exited with status 1 raised a Python exception: the cause is
        # that exception, not a signal
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0 "
        "(pid: 65043) of binary: /home/user/venv/bin/python",
        # a setting being logged, not a timeout
        "[INFO] ASCENDCL(1234,python):2025-01-01-00:00:00.000.000 stream synchronize timeout = "
        "1000ms",
        "amdgpu 0000:03:00.0: amdgpu: GPU reset(1) succeeded!",
    ],
)
def test_round5_patterns_stay_off_lookalike_lines(shipped, line: str) -> None:
    from ingest.classify import Normalizer

    res = Normalizer(shipped, fallback=False).classify_line(line)
    assert res.code not in {
        "PROCESS_CRASHED_BY_SIGNAL",
        "ASCEND_TASK_TIMEOUT",
        "AMDGPU_GPU_HANG_RESET",
    }


def test_no_pattern_matches_an_ordinary_line(shipped) -> None:
    """Every real ordinary line of the training corpus and generated server output:
    a catalog pattern that matches one of them flags healthy servers."""
    from ingest.classify import Normalizer
    from ingest.corpus import CORPUS_DIR, benign_lines

    lines = [
        line.rstrip("\n")
        for path in sorted(CORPUS_DIR.glob("benign_lines*.txt"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    lines += benign_lines(5000, seed=7)
    batch = Normalizer(shipped, fallback=False).classify_batch(lines)
    assert not batch.matches, [(lines[i][:100], m[0].name) for i, m in batch.matches.items()]


#: Prefilter literals of patterns that read a value off ordinary-looking stat
#: lines (vLLM's KV usage, queue and concurrency lines): they must see those.
STAT_LITERALS = {
    "gpu kv cache usage: ",
    " reqs, swapped: ",
    "pending: ",
    " reqs, waiting: ",
    "waiting: ",
    "maximum concurrency for ",
}


def test_prefilter_literals_rarely_occur_in_ordinary_lines(shipped) -> None:
    """Every line holding a pattern's prefilter literal runs that pattern's
    regex: a literal common in healthy output slows ingest for nothing (round
    14's NVML error-18 pattern keyed on ": 18", in 0.7% of the bench's lines)."""
    import polars as pl

    from ingest.classify import Normalizer
    from ingest.corpus import benign_lines

    norm = Normalizer(shipped, fallback=False)
    s = pl.Series(benign_lines(20000, seed=3))
    found = s.str.extract_many(norm._literals, ascii_case_insensitive=True, overlapping=True)
    per_literal = Counter(lit.lower() for lits in found.to_list() for lit in set(lits))
    common = {lit: n for lit, n in per_literal.items() if n > 0.005 * len(s)}
    assert set(common) <= STAT_LITERALS, common


def test_a_specific_cublas_code_beats_the_cublas_catch_all(shipped) -> None:
    from ingest.classify import Normalizer

    norm = Normalizer(shipped, fallback=False)
    gemm = "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx("
    assert norm.classify_line(gemm).code == "CUBLAS_STATUS_EXECUTION_FAILED"
    # NOT_SUPPORTED stays out of the catch-all: the corpus labels TGI's 424 that
    # quotes it as the engine failure (a labelling question, see CHANGELOG round 5)
    tgi = (
        '424 error {"error":"Backend error: Inference error: '
        'CublasError(CUBLAS_STATUS_NOT_SUPPORTED)","error_type":"Backend"}'
    )
    assert norm.classify_line(tgi).code != "CUBLAS_STATUS_OTHER"


def test_the_fallback_does_not_guess_the_family_of_an_attribute_error() -> None:
    """An AttributeError's family depends on the component that raised it: with no
    pattern the line stays unknown (the model guessed from the object's name and
    was wrong on every such corpus line); patterns still claim theirs."""
    from ingest.classify import default_normalizer

    norm = default_normalizer()
    line = "AttributeError: 'Qwen2Model' object has no attribute 'tree_indices'"
    assert norm.classify_line(line).code is None
    # a draft model's attribute, or a speculator's object, is a speculative-
    # decoding pattern (rounds 9 and 12)
    for draft in (
        "AttributeError: 'Qwen2Model' object has no attribute 'draft_tokens'",
        "AttributeError: 'MedusaHead' object has no attribute 'tree_indices'",
    ):
        assert norm.classify_line(draft).family == "speculative_decoding"
    lorax = "Server error: 'BLOOMSharded' object has no attribute 'load_adapter'"
    assert norm.classify_line(lorax).family == "lora_adapter"


# ---- round 6: message families found in the misses of holdout5 ----------------------
# Public text (issue threads and training logs found with find_string) that is neither
# a corpus line nor a catalog example: another rank, scale, signal or launcher format.
ROUND6_LINES = [
    (
        "[2023-07-24 13:21:32,378] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] "
        "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4294967296, reducing to 2147483648",
        "LOSS_SCALE_OVERFLOW",
    ),
    (
        "[2021-06-08 12:02:45,001] [INFO] [stage3.py:2323:_overflow_clean_up] [deepscale] "
        "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 16777216.0, reducing to 8388608.0",
        "LOSS_SCALE_OVERFLOW",
    ),
    (
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 1.52587890625e-05",
        "LOSS_SCALE_OVERFLOW",
    ),
    (
        "W0703 17:54:21.884000 925 torch/distributed/elastic/multiprocessing/api.py:1014] "
        "Sending process 1721 closing signal SIGTERM",
        "DIST_WORKER_GROUP_FAILED",
    ),
    (
        "*** SIGABRT (@0x3e80000086b) received by PID 2155 (TID 0x7f16261d2740) from PID 2155; "
        "stack trace: ***",
        "PROCESS_CRASHED_BY_SIGNAL",
    ),
    ("double free or corruption (out)", "PROCESS_CRASHED_BY_SIGNAL"),
]


@pytest.mark.parametrize(
    "line",
    [
        # Megatron's per-iteration report names the loss scale: no overflow by itself
        " iteration      400/    3000 | elapsed time per iteration (ms): 12879.0 | learning "
        "rate 6.300E-06 | lm loss 6.758929E+00 | loss scale 64.0 |",
        # NCCL proxy results other than ncclInternalError (3) are not internal errors
        "ubuntu:39964:40075 [0] proxy.cc:1519 NCCL WARN [Proxy Service 0] Failed to execute "
        "operation Connect from rank 0, retcode 2",
    ],
)
def test_round6_patterns_stay_off_lookalike_lines(shipped, line: str) -> None:
    from ingest.classify import Normalizer

    res = Normalizer(shipped, fallback=False).classify_line(line)
    assert res.code not in {"LOSS_SCALE_OVERFLOW", "NCCL_INTERNAL_ERROR"}


# Round 7: public wording variants (neither corpus lines nor catalog examples) of
# the message families added from holdout6's misses.
ROUND7_LINES = [
    # PyTorch checked_convert, another dtype name (a public test fixture's line)
    (
        "RuntimeError: value cannot be converted to type c10::BFloat16 without overflow",
        "SCALAR_DTYPE_OVERFLOW",
    ),
    # ollama's runner, without the time/source fields (a public troubleshooting note)
    (
        'level=WARN msg="truncating input prompt" limit=4096 prompt=4938 keep=5 new=4096',
        "TOKENIZER_SEQUENCE_EXCEEDS_MODEL_MAX",
    ),
    # ollama's newer %q quoting, JSON-escaped in a client's error body
    (
        '{"error":"model \\"muse-glimmer:30b\\" not found, try pulling it first"}',
        "MODEL_NOT_FOUND",
    ),
    # PyTorch's index kernel assertion with operator() as the kernel name
    (
        "../aten/src/ATen/native/cuda/IndexKernel.cu:92: operator(): block: [1193,0,0], thread: "
        '[124,0,0] Assertion `-sizes[i] <= index && index < sizes[i] && "index out of bounds"` '
        "failed.",
        "CUDA_ERROR_DEVICE_ASSERT",
    ),
    # NCCL quoting the CUDA error it hit: the CUDA error is the cause
    (
        "job-55s085tswg-master-0:832:2092 [5] include/alloc.h:388 NCCL WARN Cuda failure "
        "'an illegal memory access was encountered'",
        "CUDA_ERROR_ILLEGAL_ADDRESS",
    ),
    (
        "[ONNXRuntimeError] : 1 : FAIL : CUDA failure 999: unknown error ; GPU=0",
        "CUDA_ERROR_UNKNOWN",
    ),
]


# Rounds 21-22: the two codes added for message families many real lines said with no
# code to name. Variants written from the emitting projects' format strings (Caffe's
# solver, DETR-style trainers, OpenBLAS, libgomp), neither corpus lines nor examples.
ROUND21_22_LINES = [
    (
        "I1203 09:12:44.118230  9211 solver.cpp:218] Iteration 3400 (1.9 iter/s, 52.6s/100 "
        "iters), loss = inf",
        "NON_FINITE_LOSS",
    ),
    ("Loss is inf, stopping training", "NON_FINITE_LOSS"),
    (
        "OpenBLAS blas_thread_init: pthread_create failed for thread 7 of 32: Resource "
        "temporarily unavailable",
        "HOST_THREAD_LIMIT",
    ),
    # the bare line became a corpus line in round 26 (holdout24); a container's prefix
    (
        "vllm-1  | libgomp: Thread creation failed: Resource temporarily unavailable",
        "HOST_THREAD_LIMIT",
    ),
]


@pytest.mark.parametrize(("line", "code"), ROUND6_LINES + ROUND7_LINES + ROUND21_22_LINES)
def test_message_family_variants_match_their_code(shipped, line: str, code: str) -> None:
    """A variant (public text, or written from the emitting project's format
    string) that is neither a catalog example nor a corpus line."""
    from ingest.classify import Normalizer
    from ingest.corpus import real_corpus

    examples = {ex for c in shipped for ex in c.examples}
    errors, benign = real_corpus()
    assert line not in examples and line not in {e["text"] for e in errors} | set(benign)
    assert Normalizer(shipped, fallback=False).classify_line(line).code == code


@pytest.mark.parametrize(
    "line",
    [
        # a trainer's per-step report names the gradient norm: no fault by itself
        "{'loss': 1.2301, 'grad_norm': 0.5342, 'learning_rate': 1.9e-05, 'epoch': 0.12}",
        # kubectl: a pod that is running, restarted once
        "vllm-7c9d8f6b5-x2k4p      1/1     Running   1 (3h ago)   5h",
    ],
)
def test_round7_patterns_stay_off_lookalike_lines(shipped, line: str) -> None:
    from ingest.classify import Normalizer

    assert Normalizer(shipped, fallback=False).classify_line(line).code is None


@pytest.mark.parametrize(
    ("line", "code"),
    [
        # a trainer's initial best loss is inf before the first evaluation
        ("Epoch 0 | best val loss: inf", "NON_FINITE_LOSS"),
        (
            "I1203 09:12:44.118230  9211 solver.cpp:218] Iteration 3400, loss = 0.693147",
            "NON_FINITE_LOSS",
        ),
        (
            "{'loss_classifier': tensor(0.6931, device='cuda:0', grad_fn=<NllLossBackward0>)}",
            "NON_FINITE_LOSS",
        ),
        # NCCL retries a refused connect while its peers start: only an unreachable
        # host is evidence by itself
        (
            "node1:2071:2102 [0] NCCL INFO socketPollConnect: connect returned Connection "
            "refused, retrying (1/34) after sleep for 100 msec",
            "NCCL_SOCKET_CONNECT_FAILED",
        ),
    ],
)
def test_round21_and_22_patterns_stay_off_lookalike_lines(shipped, line: str, code: str) -> None:
    from ingest.classify import Normalizer

    assert Normalizer(shipped, fallback=False).classify_line(line).code != code
