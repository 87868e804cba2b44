"""``LabEngine``: the lab's serving engine with the real probes wired in.

One step: deadlines, the scheduler picks a batch, ``before_step`` hooks, the ops
checker's step begins (row i -> trace id i), explicit index checks (token ids,
positions, block tables), the forward (speculative when enabled), the
``after_forward`` hooks, sampling, the checker's read-back, ``after_step`` hooks,
commit (seal full KV blocks, finish requests, release blocks), the KV fingerprint
check, an NVML poll every few steps, one sample of ``series``. A fatal error in a
step is logged as vLLM logs it (the error, then ``EngineDeadError`` as its direct
cause), fails the requests in flight with 500, and the engine is dead afterwards
(503). See ``docs/lab.md`` for the contract.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import random
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rca.lab.kvcache import BlockAllocator, KVPool, blocks_needed
from rca.lab.lora import LoraLoadError, LoraManager
from rca.lab.model import LabConfig, TinyLlama, read_state_dict
from rca.lab.sampler import Sampler, SamplingRow
from rca.lab.scheduler import QueueFullError, Scheduler, Sequence
from rca.lab.spec import DraftModelProposer
from rca.lab.tokenizer import EOS, ByteTokenizer, DetokenizeError, TokenIdError

__all__ = [
    "LabEngine",
    "LabRequest",
    "LabResult",
    "Batch",
    "EngineDeadError",
    "new_request_id",
    "SERIES_CODES",
    "healthy_nvml_script",
]

_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DEAD_MSG = "EngineCore encountered an issue. See stack trace (above) for the root cause."

#: series column -> the catalog code the signal is evidence of
SERIES_CODES: dict[str, str] = {
    "gpu_temp": "GPU_HW_THERMAL_SLOWDOWN",
    "gpu_power": "GPU_HW_POWER_BRAKE",
    "gpu_throttle": "GPU_HW_THERMAL_SLOWDOWN",
    "gpu_xid_count": "GPU_XID_OTHER",
    "gpu_ecc_dbe": "GPU_XID_48",
    "gpu_ecc_sbe": "GPU_ECC_SBE_STORM",
    "gpu_pcie_replay": "PCIE_REPLAY_RISING",
    "gpu_up": "NVML_GPU_IS_LOST",
    "gpu_mem_used": "TORCH_CUDA_OOM",
    "kv_usage": "KV_CACHE_NO_FREE_BLOCKS",
    "kv_free_blocks": "KV_CACHE_NO_FREE_BLOCKS",
    "kv_hash_mismatch": "KV_BLOCK_HASH_MISMATCH",
    "sched_waiting": "SCHEDULER_QUEUE_BACKLOG",
    "sched_running": "SCHEDULER_QUEUE_BACKLOG",
    "sched_preemptions": "SCHEDULER_PREEMPTION",
    "model_nonfinite": "LOGITS_NAN",
    "model_activation_inf": "ACTIVATION_INF",
    "model_logit_absmax": "LOGITS_NAN",
    "model_token_oob": "TOKEN_ID_OUT_OF_VOCAB",
    "model_position_oob": "POSITION_OUT_OF_RANGE",
    "model_block_table_oob": "CUDA_ERROR_ILLEGAL_ADDRESS",
    "sampler_errors": "SAMPLER_PROB_INF_NAN",
    "tokenizer_errors": "DETOKENIZE_INVALID_UTF8",
    "spec_acceptance": "SPEC_DECODE_ACCEPTANCE_COLLAPSE",
    "spec_errors": "SPEC_DECODE_PROPOSER_ERROR",
    "lora_errors": "LORA_ADAPTER_LOAD_FAILED",
    "http_4xx": "HTTP_400",
    "http_404": "MODEL_NOT_FOUND",
    "http_413": "CONTEXT_LENGTH_EXCEEDED",
    "http_429": "REQUEST_QUEUE_FULL",
    "http_5xx": "HTTP_500",
    "http_503": "HTTP_503",
    "http_504": "HTTP_504",
    "latency_ms": "HTTP_504",
    "engine_step_ms": "ENGINE_SHM_BROADCAST_STALL",
    "engine_dead": "ENGINE_DEAD",
    "host_rss_mb": "HOST_OOM_KILL",
}

_RECORD_COLUMNS = {
    "LOGITS_NAN": "model_nonfinite",
    "ACTIVATION_INF": "model_activation_inf",
    "TOKEN_ID_OUT_OF_VOCAB": "model_token_oob",
    "POSITION_OUT_OF_RANGE": "model_position_oob",
    "CUDA_ERROR_ILLEGAL_ADDRESS": "model_block_table_oob",
    "SAMPLER_PROB_INF_NAN": "sampler_errors",
}


def new_request_id(rng: random.Random | None = None) -> str:
    """``cmpl-<32 hex>`` as vLLM's OpenAI server names completions."""
    if rng is None:
        return f"cmpl-{uuid.uuid4().hex}"
    return f"cmpl-{rng.getrandbits(128):032x}"


def healthy_nvml_script(host: str, nvlink_links: int = 0) -> dict[str, Any]:
    """One healthy GPU for :class:`probes.fake_nvml.FakeNvml`: ~45 C, ~120 W, no
    ECC errors, no throttling, a UUID stable for the host name, ``nvlink_links``
    active NVLink links."""
    u = uuid.uuid5(uuid.NAMESPACE_DNS, f"rca-lab-gpu0.{host}")
    return {
        "devices": [
            {
                "uuid": f"GPU-{u}",
                "name": "NVIDIA H100 80GB HBM3",
                "pci_bus_id": "00000000:3B:00.0",
                "nvlink_links": nvlink_links,
                "values": {
                    "nvmlDeviceGetTemperatureV": 45,
                    "nvmlDeviceGetTemperature": 45,
                    "nvmlDeviceGetPowerUsage": 120_000,
                    "nvmlDeviceGetCurrentClocksEventReasons": 0,
                    "nvmlDeviceGetCurrentClocksThrottleReasons": 0,
                    "nvmlDeviceGetUtilizationRates": {"gpu": 35, "memory": 20},
                    "nvmlDeviceGetMemoryInfo": {"total": 80 << 30, "used": 71 << 30},
                },
            }
        ]
    }


def _merge_script(base: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
    if not over:
        return base
    out = dict(base)
    for key, value in over.items():
        if key == "devices" and isinstance(value, list):
            devs = []
            for i, dev in enumerate(value):
                ref = base["devices"][i] if i < len(base["devices"]) else {}
                merged = {**ref, **dev}
                merged["values"] = {**ref.get("values", {}), **dev.get("values", {})}
                devs.append(merged)
            out["devices"] = devs
        else:
            out[key] = value
    return out


class EngineDeadError(RuntimeError):
    """The engine loop died (vLLM's ``EngineDeadError``)."""


@dataclass
class LabRequest:
    prompt: str = ""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    lora: str | None = None
    timeout_s: float | None = None
    request_id: str = field(default_factory=new_request_id)
    trace_id: str | None = None
    prompt_token_ids: list[int] | None = None
    priority: int = 0


@dataclass
class LabResult:
    status: int
    text: str | None = None
    finish_reason: str | None = None
    error_type: str | None = None
    message: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    request_id: str | None = None
    token_ids: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class Batch:
    """What the hooks see of one step (tensors are the ones the forward uses)."""

    request_ids: list[str]
    trace_ids: list[str | None]
    block_tables: torch.Tensor  # [B, M]
    positions: torch.Tensor  # [B, T]
    token_ids: torch.Tensor  # [B, T]
    is_prefill: bool  # some row is prefilling (prompt or recompute)
    query_lens: torch.Tensor  # [B] real tokens per row this step (the rest is padding)
    context_lens: torch.Tensor  # [B] tokens already in the KV cache before this step
    seqs: list[Sequence]
    prefill_rows: list[bool] = field(default_factory=list)
    spec: bool = False


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


def _error(status: int, message: str, request_id: str | None = None) -> LabResult:
    return LabResult(
        status, error_type=_ERROR_TYPES.get(status), message=message, request_id=request_id
    )


class LabEngine:
    """The lab engine; see the module docstring and ``docs/lab.md``."""

    def __init__(
        self,
        config: LabConfig | None = None,
        run_dir: str | Path = ".",
        *,
        host: str = "lab-node-0",
        faults: list[Any] | None = None,
        sink: Any = None,
        tracer_provider: Any = None,
        fake_nvml_script: dict[str, Any] | None = None,
    ) -> None:
        torch.set_num_threads(1)
        from probes.fake_nvml import FakeNvml
        from probes.kvcache import KVBlockChecker
        from probes.nvml import NvmlPoller

        self.config = cfg = config if config is not None else LabConfig()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.faults = list(faults or [])
        self._log_lock = threading.Lock()
        self._engine_log = open(self.run_dir / "engine.log", "a", encoding="utf-8")  # noqa: SIM115
        self._kern_log = open(self.run_dir / "kern.log", "a", encoding="utf-8")  # noqa: SIM115
        if sink is None:
            from probes.sink import SpoolSink

            sink = SpoolSink(self.run_dir / "spool")
        self.sink = sink
        self._own_provider = tracer_provider is None
        self.tracer_provider = tracer_provider or self._make_provider()
        self._rng = random.Random(cfg.seed)
        self.tokenizer = ByteTokenizer()
        self.nvml = FakeNvml(
            _merge_script(healthy_nvml_script(host, cfg.nvlink_links), fake_nvml_script)
        )
        self.poller = NvmlPoller(sink, self.nvml, host=host)
        self.kv_checker = KVBlockChecker(sink, verify_per_step=cfg.kv_verify_per_step)

        self.step_no = 0
        self._stalled = False
        self.dead = False
        self.loaded = False
        self.load_error: BaseException | None = None
        self.series: list[dict[str, float]] = []
        self.series_codes = dict(SERIES_CODES)
        self._lock = threading.RLock()
        #: one entry per submit waiting for the lock: the step loop lets them in
        #: between steps (deque append/pop are atomic across threads)
        self._knocking: deque[None] = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._counts: Counter[str] = Counter()  # per-sample counters (reset each sample)
        self.totals: Counter[str] = Counter()  # cumulative (metrics)
        self.success: Counter[str] = Counter()  # finished_reason -> n
        self.status_counts: Counter[int] = Counter()
        self._e2e: list[int] = [0] * (len(_E2E_BUCKETS) + 1)
        self._e2e_sum = 0.0
        self._latencies: list[float] = []
        self._stats_t = time.monotonic()
        self._stats_tokens = (0, 0)
        self._logit_absmax = 0.0
        self._order = 0
        self._calls = 0
        self._pending_release: list[tuple[list[int], str | None, str | None]] = []

        self.log_line(
            "INFO",
            "llm_engine.py:234",
            "Initializing a V0 LLM engine (v0.6.3.post1) with config: "
            f"model='{cfg.served_model_name}', "
            f"dtype=torch.float32, max_seq_len={cfg.max_model_len}, device_config=cpu, "
            f"seed={cfg.seed}, served_model_name={cfg.served_model_name}, "
            f"num_scheduler_steps=1, enable_prefix_caching=False, "
            f"speculative_config={'k=' + str(cfg.spec_k) if cfg.spec_k else None}",
        )
        self.model = TinyLlama(cfg)
        self.model.eval()
        self.draft: TinyLlama | None = None
        self.proposer: DraftModelProposer | None = None
        self.pool = KVPool(
            cfg.num_layers, cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim
        )
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.scheduler = Scheduler(
            self.allocator,
            cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_waiting=cfg.max_waiting,
            on_preempt=self._on_preempt,
            on_free=self._on_free,
        )
        self.lora = LoraManager(
            self.model, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank
        )
        self.checker: Any = None
        self.sampler = Sampler(self.tokenizer.vocab_size)
        try:
            self._load()
        except Exception as exc:
            self.load_error = exc
            try:
                raise RuntimeError(
                    "Engine core initialization failed. See root cause above."
                ) from exc
            except RuntimeError as err:
                self.log_exception(err, where="core.py:390", message="EngineCore failed to start.")
            return
        self.loaded = True
        self.poller.poll_once()
        self.log_line("INFO", "api_server.py:541", f"Started server process [{os.getpid()}]")
        self.log_line(
            "INFO",
            "launcher.py:19",
            "Available routes are: /v1/completions, /health, "
            "/metrics, /v1/load_lora_adapter, /health/checker_status",
        )
        for f in self.faults:
            if hasattr(f, "on_start"):
                f.on_start(self)

    # ------------------------------------------------------------------ setup
    def _make_provider(self) -> Any:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        from probes.otel import SpoolSpanExporter

        provider = TracerProvider(
            resource=Resource.create({"service.name": "vllm-lab", "host.name": self.host})
        )
        provider.add_span_processor(SimpleSpanProcessor(SpoolSpanExporter(self.sink)))
        return provider

    def _load(self) -> None:
        from probes.ops import instrument

        cfg = self.config
        if cfg.checkpoint or cfg.truncate_checkpoint:
            path = Path(cfg.checkpoint or self.run_dir / "model.safetensors")
            if not path.exists():
                self.model.save_checkpoint(path)
            if cfg.truncate_checkpoint:  # a copy that stopped half way
                data = path.read_bytes()
                path.write_bytes(data[: len(data) // 2])
            self.log_line("INFO", "weight_utils.py:254", f"Loading weights from {path}")
            state = read_state_dict(path)
        else:
            state = self.model.state_dict()
        for f in self.faults:
            if hasattr(f, "on_load"):
                f.on_load(self, state)
        cfg = self.config  # a fault may have swapped it
        if cfg.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"User-specified max_model_len ({cfg.max_model_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={cfg.max_position_embeddings} or "
                "model_max_length=None in model's config.json). This may lead to incorrect model "
                "outputs or CUDA errors."
            )
        if cfg.tensor_parallel_size < 1 or cfg.num_heads % cfg.tensor_parallel_size:
            raise ValueError(
                f"Total number of attention heads ({cfg.num_heads}) must be divisible by "
                f"tensor parallel size ({cfg.tensor_parallel_size})."
            )
        kv_tokens = cfg.num_blocks * cfg.block_size
        if cfg.num_blocks <= 0:
            raise ValueError(
                "No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine."
            )
        if kv_tokens < cfg.max_model_len:
            raise ValueError(
                f"The model's max seq len ({cfg.max_model_len}) is larger than the maximum number "
                f"of tokens that can be stored in KV cache ({kv_tokens}). Try increasing "
                "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
                "engine."
            )
        self.model.load_state_dict(state)
        self.checker = instrument(
            self.model,
            cfg.checker_tiers,
            sink=self.sink,
            max_positions=cfg.max_position_embeddings,
        )
        self.sampler.checker = self.checker
        if cfg.spec_k > 0:
            self.proposer = DraftModelProposer(
                self.model, cfg, cfg.spec_k, self.tokenizer.vocab_size
            )
            self.draft = self.proposer.model
        self.log_line("INFO", "model_runner.py:1072", "Loading model weights took 0.0010 GB")
        self.log_line(
            "INFO", "gpu_executor.py:122", f"# GPU blocks: {cfg.num_blocks}, # CPU blocks: 0"
        )
        self.log_line(
            "INFO",
            "gpu_executor.py:126",
            f"Maximum concurrency for {cfg.max_model_len} tokens per request: "
            f"{kv_tokens / cfg.max_model_len:.2f}x",
        )

    # ------------------------------------------------------------------ logs
    def _now_prefix(self, level: str, where: str) -> str:
        now = dt.datetime.now(dt.UTC)
        return f"{level} {now:%m-%d %H:%M:%S} [{where}]"

    def log_line(self, level: str, where: str, message: str) -> None:
        """One vLLM-format line (``INFO 11-29 19:02:03 [engine.py:312] ...``)."""
        self._write(self._engine_log, f"{self._now_prefix(level, where)} {message}\n")

    def _write(self, fh: Any, text: str) -> None:
        with self._log_lock:
            if not fh.closed:  # after close(): dropped, never raised into a caller
                fh.write(text)
                fh.flush()

    def log_raw(self, text: str) -> None:
        """Lines as they are (uvicorn's access lines share the engine's stdout)."""
        self._write(self._engine_log, text if text.endswith("\n") else text + "\n")

    def log_exception(
        self, exc: BaseException, *, where: str = "engine.py:160", message: str | None = None
    ) -> None:
        """An ERROR line, then the full chained traceback (as ``logger.exception``)."""
        tb = "".join(traceback.format_exception(exc))
        msg = message or f"Error in engine step: {type(exc).__name__}: {exc}"
        self._write(self._engine_log, f"{self._now_prefix('ERROR', where)} {msg}\n{tb}")

    def kernel_log(self, message: str) -> None:
        """One dmesg -T line in ``kern.log``."""
        now = dt.datetime.now(dt.UTC)
        self._write(self._kern_log, f"[{now:%a %b %d %H:%M:%S %Y}] {message}\n")

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return new_request_id()

    def submit(self, request: LabRequest) -> Future[LabResult]:
        """Validate and queue a request; the future resolves when it ends."""
        fut: Future[LabResult] = Future()
        rid = request.request_id
        try:
            for f in self.faults:
                if hasattr(f, "on_submit"):
                    f.on_submit(self, request)
            self._knocking.append(None)
            try:
                res = self._admit(request, fut)
            finally:
                self._knocking.pop()
        except Exception as exc:
            self.log_exception(
                exc,
                where="serving_completion.py:164",
                message=f"Error in preprocessing request {rid}",
            )
            res = _error(500, f"{type(exc).__name__}: {exc}", rid)
        if res is not None:
            if 400 <= res.status < 500 and res.status != 429:  # 429 is logged when queued
                self.log_line(
                    "WARNING",
                    "serving_completion.py:190",
                    f"Rejected request {rid} ({res.status}): {res.message}",
                )
            self._resolve(fut, res)
        else:
            self._wake.set()
        return fut

    def _admit(self, req: LabRequest, fut: Future[LabResult]) -> LabResult | None:
        cfg = self.config
        rid = req.request_id
        if not self.loaded:
            return _error(503, f"The engine is not loaded: {self.load_error}", rid)
        if self.dead:
            return _error(503, _DEAD_MSG, rid)
        if not isinstance(req.temperature, (int, float)) or req.temperature < 0:
            return _error(400, f"temperature must be non-negative, got {req.temperature}.", rid)
        if not isinstance(req.top_p, (int, float)) or not 0 < req.top_p <= 1:
            return _error(400, f"top_p must be in (0, 1], got {req.top_p}.", rid)
        if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            return _error(400, f"max_tokens must be at least 1, got {req.max_tokens}.", rid)
        if req.max_tokens > cfg.max_tokens_limit:
            return _error(
                400,
                f"max_tokens must be at most {cfg.max_tokens_limit}, got {req.max_tokens}.",
                rid,
            )
        if req.prompt_token_ids is not None:
            ids = [int(t) for t in req.prompt_token_ids]
            if not ids:
                return _error(400, "The prompt cannot be empty.", rid)
            bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                return _error(400, f"Token id {bad[0]} is out of vocabulary", rid)
        else:
            ids = self.tokenizer.encode(req.prompt, add_bos=True)
        if len(ids) > cfg.max_model_len:
            return _error(
                413,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {len(ids) + req.max_tokens} tokens ({len(ids)} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length of the messages "
                "or completion.",
                rid,
            )
        if len(ids) + req.max_tokens > cfg.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {len(ids) + req.max_tokens} tokens ({len(ids)} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length of the messages "
                "or completion.",
                rid,
            )
        if req.lora is not None and req.lora not in self.lora:
            return _error(404, f"The model `{req.lora}` does not exist.", rid)
        seed = req.seed if req.seed is not None else self._rng.getrandbits(63)
        timeout = req.timeout_s if req.timeout_s is not None else cfg.request_timeout_s
        now = time.monotonic()
        with self._lock:
            if self.dead:  # it died while this request was being validated
                return _error(503, _DEAD_MSG, rid)
            self._order += 1
            seq = Sequence(
                request_id=rid,
                trace_id=req.trace_id,
                prompt_ids=ids,
                max_tokens=req.max_tokens,
                temperature=float(req.temperature),
                top_p=float(req.top_p),
                generator=torch.Generator().manual_seed(int(seed)),
                order=self._order,
                priority=req.priority,
                lora=req.lora,
                arrival=now,
                deadline=now + timeout if timeout is not None else None,
                future=fut,
                request=req,
            )
            try:
                self.scheduler.add(seq)
            except QueueFullError as exc:
                self.log_line(
                    "WARNING", "async_llm_engine.py:642", f"Request {rid} rejected: {exc}"
                )
                return _error(429, str(exc), rid)
        self.log_line("INFO", "async_llm_engine.py:208", f"Added request {rid}.")
        return None

    def _resolve(self, fut: Future[LabResult], res: LabResult) -> None:
        with self._lock:
            self._count_status(res.status)
        if not fut.done():
            fut.set_result(res)

    def _count_status(self, s: int) -> None:
        self.status_counts[s] += 1
        if s != 200:
            key = {
                404: "http_404",
                413: "http_413",
                429: "http_429",
                503: "http_503",
                504: "http_504",
            }.get(s)
            if key:
                self._counts[key] += 1
            self._counts["http_5xx" if s >= 500 else "http_4xx"] += 1

    # ------------------------------------------------------------------ driving
    def start(self) -> None:
        """Run steps on a background thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="lab-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self.scheduler.has_work() and self.loaded and not self.dead
            if not busy or self._stalled:  # idle, or waiting for blocks: do not spin
                self._wake.wait(0.02)
                self._wake.clear()
            self.step()
            if self._knocking:
                # a lock is not fair: stepping straight on, this thread would
                # take it back before a waiting submit wakes, and the server
                # would stall until the batch drained. vLLM's engine core takes
                # new requests from its input queue between steps; so does this.
                time.sleep(0.0005)

    def stop(self) -> None:
        """Stop the loop, flush the sink and the logs; idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        flush = getattr(self.sink, "flush", None)
        if flush is not None:
            flush()

    def close(self) -> None:
        """:meth:`stop`, then close the logs and the engine's own tracer provider."""
        self.stop()
        if self._own_provider:
            with contextlib.suppress(Exception):
                self.tracer_provider.shutdown()
            self._own_provider = False
        with self._log_lock:
            self._engine_log.close()
            self._kern_log.close()

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        """Step until no request is left (or ``max_steps``); returns steps run."""
        n = 0
        while n < max_steps and self.scheduler.has_work() and self.loaded and not self.dead:
            self.step()
            n += 1
        return n

    def drive(self, fut: Future[LabResult], max_steps: int = 100_000) -> None:
        """Step synchronously until ``fut`` is done (no background loop)."""
        n = 0
        while not fut.done() and n < max_steps and self.loaded and not self.dead:
            if not self.scheduler.has_work():
                break
            self.step()
            n += 1

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """One engine step. Called with nothing to run (idle, dead or never
        loaded) it still polls NVML every ``poll_every`` calls and samples the
        series, as the poller thread and the metrics loop of a real server go on."""
        with self._lock:
            self._calls += 1
            if not self.loaded or self.dead:
                self._idle_tick()
                return
            t0 = time.perf_counter()
            self._expire()
            k = self.proposer.k if self.proposer is not None else 0
            sb = self.scheduler.schedule(lookahead=k) if self.scheduler.has_work() else None
            if sb is None or not sb.rows:
                self._release_pending()
                self._idle_tick()
                self._stalled = sb is not None  # work waiting, nothing schedulable
                return
            self._stalled = False
            self.step_no += 1
            try:
                self._run(sb.rows)
            except Exception as exc:
                self._fatal(exc)
            self._post_step(t0)

    def sample(self) -> None:
        """Poll NVML and append one ``series`` sample now (an observer's scrape)."""
        with self._lock:
            try:
                self.poller.poll_once()
                self._sample(0.0)
            except Exception as exc:  # bookkeeping must not kill the engine
                self.log_exception(exc, where="metrics.py:120", message="Error in engine metrics")

    def _idle_tick(self) -> None:
        if self._calls % max(1, self.config.poll_every) == 0:
            self.sample()

    def _expire(self) -> None:
        now = time.monotonic()
        sched = self.scheduler
        for seq in [s for s in sched.waiting + sched.running if s.deadline and now > s.deadline]:
            waited = now - seq.arrival
            sched.finish(seq)
            self.log_line(
                "WARNING",
                "async_llm_engine.py:870",
                f"Request {seq.request_id} exceeded its deadline after {waited:.2f} s "
                f"({len(seq.output_ids)} tokens generated); aborting it.",
            )
            self._resolve(
                seq.future, _error(504, f"Request timed out after {waited:.2f} s", seq.request_id)
            )

    def _build(self, rows: list[tuple[Sequence, int]], spec: bool) -> Batch:
        seqs = [s for s, _ in rows]
        b = len(seqs)
        k = self.proposer.k if (spec and self.proposer is not None) else 0
        width = k + 1 if spec else max(n for _, n in rows)
        ids = torch.full((b, width), self.tokenizer.pad_token_id, dtype=torch.long)
        pos = torch.zeros(b, width, dtype=torch.long)
        qlens = torch.zeros(b, dtype=torch.long)
        m = max(len(s.block_table) for s in seqs)
        bt = torch.zeros(b, m, dtype=torch.long)
        for i, (s, n) in enumerate(rows):
            if spec:
                ids[i, 0] = s.all_ids()[-1]
                pos[i] = torch.arange(s.total_len - 1, s.total_len + k)
                qlens[i] = k + 1
            else:
                toks = s.all_ids()[s.num_computed : s.num_computed + n]
                ids[i, :n] = torch.tensor(toks)
                pos[i, :n] = torch.arange(s.num_computed, s.num_computed + n)
                qlens[i] = n
            bt[i, : len(s.block_table)] = torch.tensor(s.block_table)
        prefill = [s.num_computed < s.total_len - 1 for s in seqs]
        return Batch(
            request_ids=[s.request_id for s in seqs],
            trace_ids=[s.trace_id for s in seqs],
            block_tables=bt,
            positions=pos,
            token_ids=ids,
            is_prefill=any(prefill),
            prefill_rows=prefill,
            query_lens=qlens,
            context_lens=torch.tensor([s.num_computed for s in seqs]),
            seqs=seqs,
            spec=spec,
        )

    def _spec_ok(self, rows: list[tuple[Sequence, int]]) -> bool:
        p = self.proposer
        if p is None:
            return False
        limit = self.config.max_position_embeddings
        bs = self.config.block_size
        return all(
            n == 1
            and s.num_computed == s.total_len - 1
            and s.total_len + p.k <= limit
            and blocks_needed(s.total_len + p.k, bs) <= len(s.block_table)
            for s, n in rows
        )

    @torch.no_grad()
    def _run(self, rows: list[tuple[Sequence, int]]) -> None:
        cfg = self.config
        spec = self._spec_ok(rows)
        batch = self._build(rows, spec)
        self._counts["prompt_tokens"] += sum(
            int(q)
            for q, pf in zip(batch.query_lens.tolist(), batch.prefill_rows, strict=True)
            if pf
        )
        for f in self.faults:
            if hasattr(f, "before_step"):
                f.before_step(self, batch)
        self._kv_check()  # the blocks this step reads, before the forward reads them
        self._release_pending()  # blocks freed by preemption or deadlines: reusable now
        ck = self.checker
        ck.begin_step(batch.trace_ids, request_ids=batch.request_ids)
        records: list[Any] = []
        try:
            if spec:
                assert self.proposer is not None
                try:
                    drafts = self.proposer.propose(batch.seqs, batch.block_tables)
                except Exception:
                    self.proposer.errors += 1
                    self._counts["spec_errors"] += 1
                    raise
                batch.token_ids[:, 1:] = drafts
            ck.check_token_ids(batch.token_ids, cfg.vocab_size)
            ck.check_positions(batch.positions, cfg.max_position_embeddings)
            used = torch.tensor([len(s.block_table) for s in batch.seqs])
            ck.check_block_table(batch.block_tables, cfg.num_blocks, blocks_used=used)
            lctx = self.lora.context([s.lora for s in batch.seqs])
            logits = self.model(
                batch.token_ids,
                batch.positions,
                self.pool,
                batch.block_tables,
                batch.query_lens,
                all_logits=spec,
                lora=lctx,
            )
            for f in self.faults:
                if hasattr(f, "after_forward"):
                    out = f.after_forward(self, batch, logits)
                    if out is not None:
                        logits = out
            srows = [SamplingRow(s.temperature, s.top_p, s.generator) for s in batch.seqs]
            try:
                tokens = self.sampler.sample(logits, srows)
            except RuntimeError:
                self._counts["sampler_errors"] += 1
                raise
            fin = logits[torch.isfinite(logits)]
            self._logit_absmax = float(fin.abs().max()) if fin.numel() else 0.0
        finally:
            records = ck.end_step()
            for r in records:
                col = _RECORD_COLUMNS.get(str(getattr(r, "code", "")))
                if col:
                    self._counts[col] += 1
        for f in self.faults:
            if hasattr(f, "after_step"):
                f.after_step(self, batch)
        self._commit(batch, tokens)

    def _commit(self, batch: Batch, tokens: torch.Tensor) -> None:
        bs = self.config.block_size
        k = self.proposer.k if (batch.spec and self.proposer is not None) else 0
        toks = tokens.tolist()
        accepted: list[int] = []
        for i, seq in enumerate(batch.seqs):
            if seq.status != "running":
                continue
            if batch.spec:
                drafts = batch.token_ids[i, 1:].tolist()
                row = toks[i]
                a = 0
                while a < k and drafts[a] == row[a]:
                    a += 1
                accepted.append(a)
                old = seq.total_len
                emitted = row[: a + 1]
                seq.num_computed = old + a
                seq.draft_computed = old + min(a, k - 1)
            else:
                seq.num_computed += int(batch.query_lens[i])
                emitted = [toks[i]]
            if seq.first_token_at is None:
                seq.first_token_at = time.monotonic()
            reason = None
            for t in emitted:
                seq.output_ids.append(int(t))
                self._counts["generation_tokens"] += 1
                if t == EOS:
                    reason = "stop"
                    break
                if len(seq.output_ids) >= seq.max_tokens:
                    reason = "length"
                    break
            full = min(seq.num_computed, seq.total_len) // bs
            if full > seq.sealed:
                self.kv_checker.seal(
                    seq.block_table[seq.sealed : full],
                    trace_id=seq.trace_id,
                    request_id=seq.request_id,
                )
                seq.sealed = full
            if reason is not None:
                self._finish(seq, reason)
        if batch.spec and self.proposer is not None:
            self.proposer.record(accepted)

    def _detokenize(self, ids: list[int]) -> str:
        mode = "strict" if self.config.strict_detokenize else "replace"
        return self.tokenizer.decode(ids, errors=mode)

    def _finish(self, seq: Sequence, reason: str) -> None:
        from probes.ops import RequestOutput

        self.scheduler.finish(seq)
        out = seq.output_ids[:-1] if reason == "stop" else seq.output_ids
        try:
            text = self._detokenize(out)
        except (DetokenizeError, TokenIdError) as exc:
            self._counts["tokenizer_errors"] += 1
            self.log_exception(
                exc,
                where="detokenizer.py:115",
                message=f"Error in detokenizing output of request {seq.request_id}: {exc}",
            )
            self._resolve(seq.future, _error(500, f"{type(exc).__name__}: {exc}", seq.request_id))
            return
        latency = time.monotonic() - seq.arrival
        self._latencies.append(latency)
        self._e2e_sum += latency
        self._e2e[
            next((i for i, b in enumerate(_E2E_BUCKETS) if latency <= b), len(_E2E_BUCKETS))
        ] += 1
        self.success[reason] += 1
        self.totals["prompt_tokens"] += len(seq.prompt_ids)
        self.totals["generation_tokens"] += len(out)
        self.checker.end_request(
            RequestOutput(
                trace_id=seq.trace_id,
                request_id=seq.request_id,
                text=text,
                finish_reason=reason,
                completion_tokens=len(out),
            )
        )
        self.log_line("INFO", "async_llm_engine.py:140", f"Finished request {seq.request_id}.")
        usage = {
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(out),
            "total_tokens": len(seq.prompt_ids) + len(out),
        }
        self._resolve(
            seq.future,
            LabResult(
                200,
                text=text,
                finish_reason=reason,
                usage=usage,
                request_id=seq.request_id,
                token_ids=list(out),
            ),
        )

    def _fatal(self, exc: Exception) -> None:
        self.dead = True
        try:
            raise EngineDeadError(_DEAD_MSG) from exc
        except EngineDeadError as dead:
            self.log_exception(
                dead, where="async_llm_engine.py:65", message="Engine background task failed"
            )
        sched = self.scheduler
        for seq in list(sched.running) + list(sched.waiting):
            sched.finish(seq)
            self._resolve(seq.future, _error(500, _DEAD_MSG, seq.request_id))
        with contextlib.suppress(Exception):  # the GPU poller goes on after the engine
            self.poller.poll_once()

    def _on_preempt(self, seq: Sequence) -> None:
        self._counts["sched_preemptions"] += 1
        self.log_line(
            "WARNING",
            "scheduler.py:1560",
            f"Sequence group {seq.request_id} is preempted by PreemptionMode.RECOMPUTE mode "
            "because there is not enough KV cache space. This can affect the end-to-end "
            "performance. Increase gpu_memory_utilization or tensor_parallel_size to provide "
            "more KV cache memory. total_cumulative_preemption_cnt="
            f"{self.scheduler.num_preemptions}",
        )

    def _on_free(self, seq: Sequence, released: list[int]) -> None:
        # released after this step's KV check: a block that changed just before
        # its request ended is still caught
        if released:
            self._pending_release.append((released, seq.trace_id, seq.request_id))

    def _release_pending(self) -> None:
        for blocks, tid, rid in self._pending_release:
            self.kv_checker.release(blocks, trace_id=tid, request_id=rid)
        self._pending_release = []

    def _kv_check(self) -> None:
        before = self.kv_checker.mismatches
        self.kv_checker.step(self.pool.caches())
        self._counts["kv_hash_mismatch"] += self.kv_checker.mismatches - before

    # ------------------------------------------------------------------ after a step
    def _post_step(self, t0: float) -> None:
        try:
            self._kv_check()
            self._release_pending()
            if self.step_no % max(1, self.config.poll_every) == 0:
                self.poller.poll_once()
            self._sample((time.perf_counter() - t0) * 1000.0)
            if self.step_no % max(1, self.config.stats_every) == 0:
                self._log_stats()
        except Exception as exc:  # bookkeeping must not kill the engine
            self.log_exception(exc, where="metrics.py:120", message="Error in engine metrics")

    def _gpu_values(self) -> dict[str, float]:
        r = self.poller.readings()
        if not r:
            return {}
        v = r[0]["values"]
        reasons = int(v.get("nvml_clocks_event_reasons", 0))
        xids = sum(val for key, val in v.items() if key.startswith("nvml_xid_events_total"))
        return {
            "gpu_temp": float(v.get("nvml_gpu_temp_c", 0.0)),
            "gpu_power": float(v.get("nvml_power_w", 0.0)),
            "gpu_throttle": float(bool(reasons & ~0x1)),
            "gpu_xid_count": float(xids),
            "gpu_ecc_dbe": float(v.get("nvml_ecc_uncorrected_volatile_total", 0.0)),
            "gpu_ecc_sbe": float(v.get("nvml_ecc_sbe_events_total", 0.0)),
            "gpu_pcie_replay": float(v.get("nvml_pcie_replay_total", 0.0)),
            "gpu_up": 0.0 if r[0]["lost"] else 1.0,
            "gpu_mem_used": float(v.get("nvml_fb_used_bytes", 0.0)) / 2**20,
        }

    def _sample(self, step_ms: float) -> None:
        c = self._counts
        lat = self._latencies
        row: dict[str, float] = {"ts": float(time.time_ns()), "step": float(self.step_no)}
        row.update(self._gpu_values())
        row.update(
            {
                "kv_usage": self.allocator.usage,
                "kv_free_blocks": float(self.allocator.num_free),
                "kv_hash_mismatch": float(c["kv_hash_mismatch"]),
                "sched_waiting": float(len(self.scheduler.waiting)),
                "sched_running": float(len(self.scheduler.running)),
                "sched_preemptions": float(c["sched_preemptions"]),
                "model_nonfinite": float(c["model_nonfinite"]),
                "model_activation_inf": float(c["model_activation_inf"]),
                "model_logit_absmax": self._logit_absmax,
                "model_token_oob": float(c["model_token_oob"]),
                "model_position_oob": float(c["model_position_oob"]),
                "model_block_table_oob": float(c["model_block_table_oob"]),
                "sampler_errors": float(c["sampler_errors"]),
                "tokenizer_errors": float(c["tokenizer_errors"]),
                "spec_acceptance": self.proposer.acceptance_rate if self.proposer else 1.0,
                "spec_errors": float(c["spec_errors"]),
                "lora_errors": float(self.lora.errors),
                "http_4xx": float(c["http_4xx"]),
                "http_404": float(c["http_404"]),
                "http_413": float(c["http_413"]),
                "http_429": float(c["http_429"]),
                "http_5xx": float(c["http_5xx"]),
                "http_503": float(c["http_503"]),
                "http_504": float(c["http_504"]),
                "latency_ms": 1000.0 * sum(lat) / len(lat) if lat else 0.0,
                "engine_step_ms": step_ms,
                "engine_dead": float(self.dead),
                "host_rss_mb": _rss_mb(),
            }
        )
        self.series.append(row)
        for key in list(c):
            if key not in ("prompt_tokens", "generation_tokens"):
                c[key] = 0
        self._latencies = []

    def _log_stats(self) -> None:
        now = time.monotonic()
        dt_s = max(now - self._stats_t, 1e-6)
        p, g = self._counts["prompt_tokens"], self._counts["generation_tokens"]
        self._counts["prompt_tokens"] = self._counts["generation_tokens"] = 0
        self._stats_t = now
        self.log_line(
            "INFO",
            "metrics.py:351",
            f"Avg prompt throughput: {p / dt_s:.1f} tokens/s, Avg generation throughput: "
            f"{g / dt_s:.1f} tokens/s, Running: {len(self.scheduler.running)} reqs, Swapped: 0 "
            f"reqs, Pending: {len(self.scheduler.waiting)} reqs, GPU KV cache usage: "
            f"{100 * self.allocator.usage:.1f}%, CPU KV cache usage: 0.0%.",
        )
        p_ = self.proposer
        if p_ is not None and p_.drafted:
            steps = max(1, p_.steps_rows)
            per = ", ".join(f"{x / steps:.3f}" for x in p_.per_position)
            elapsed = max(now - p_.log_t, 1e-6)
            acc, drafted = p_.accepted - p_.log_acc, p_.drafted - p_.log_drafted
            p_.log_t, p_.log_acc, p_.log_drafted = now, p_.accepted, p_.drafted
            self.log_line(
                "INFO",
                "metrics.py:101",
                # per logging interval, as vLLM V1's SpecDecodingLogging prints them
                f"SpecDecoding metrics: Mean acceptance length: "
                f"{1 + acc / max(1, drafted // max(1, p_.k)):.2f}, "
                f"Accepted throughput: {acc / elapsed:.2f} tokens/s, Drafted throughput: "
                f"{drafted / elapsed:.2f} tokens/s, Accepted: {acc} tokens, Drafted: {drafted} "
                f"tokens, Per-position acceptance rate: {per}, Avg Draft acceptance rate: "
                f"{100 * acc / max(1, drafted):.1f}%",
            )

    # ------------------------------------------------------------------ LoRA
    def load_lora(self, name: str, path: str | Path) -> None:
        """Hot-load an adapter; a bad one is logged (vLLM's wording) and re-raised."""
        try:
            with self._lock:
                self.lora.load(name, path)
        except Exception as exc:
            if not isinstance(exc, LoraLoadError):
                self.lora.errors += 1
            self.log_exception(
                exc,
                where="worker_manager.py:107",
                message=f"Error loading LoRA adapter {name}: {exc}",
            )
            raise
        self.log_line(
            "INFO",
            "serving_models.py:184",
            f"Loaded new LoRA adapter: name '{name}', path '{path}'",
        )

    # ------------------------------------------------------------------ metrics
    def metrics_text(self) -> str:
        """Prometheus exposition with vLLM's metric names."""
        name = self.config.served_model_name
        lab = f'model_name="{name}"'
        lines: list[str] = []

        def metric(mname: str, mtype: str, helptext: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {mname} {helptext}")
            lines.append(f"# TYPE {mname} {mtype}")
            for suffix_labels, value in samples:
                lines.append(f"{mname}{suffix_labels} {value}")

        usage = self.allocator.usage
        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests running.",
            [(f"{{{lab}}}", float(len(self.scheduler.running)))],
        )
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting.",
            [(f"{{{lab}}}", float(len(self.scheduler.waiting)))],
        )
        metric(
            "vllm:gpu_cache_usage_perc",
            "gauge",
            "GPU KV-cache usage. 1 means 100 percent.",
            [(f"{{{lab}}}", usage)],
        )
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent.",
            [(f"{{{lab}}}", usage)],
        )
        metric(
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemptions.",
            [(f"{{{lab}}}", float(self.scheduler.num_preemptions))],
        )
        metric(
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            [(f"{{{lab}}}", float(self.totals["prompt_tokens"]))],
        )
        metric(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens.",
            [(f"{{{lab}}}", float(self.totals["generation_tokens"]))],
        )
        metric(
            "vllm:request_success_total",
            "counter",
            "Count of successfully processed requests.",
            [
                (f'{{finished_reason="{r}",{lab}}}', float(n))
                for r, n in sorted(self.success.items())
            ]
            or [(f'{{finished_reason="stop",{lab}}}', 0.0)],
        )
        cum = 0
        buckets = []
        for b, n in zip(_E2E_BUCKETS, self._e2e, strict=False):
            cum += n
            buckets.append((f'_bucket{{le="{b}",{lab}}}', float(cum)))
        total = sum(self._e2e)
        buckets.append((f'_bucket{{le="+Inf",{lab}}}', float(total)))
        buckets.append((f"_sum{{{lab}}}", self._e2e_sum))
        buckets.append((f"_count{{{lab}}}", float(total)))
        metric(
            "vllm:e2e_request_latency_seconds",
            "histogram",
            "Histogram of end to end request latency in seconds.",
            buckets,
        )
        if self.proposer is not None:
            p = self.proposer
            metric(
                "vllm:spec_decode_draft_acceptance_rate",
                "gauge",
                "Speculative token acceptance rate.",
                [(f"{{{lab}}}", p.acceptance_rate)],
            )
            metric(
                "vllm:spec_decode_num_accepted_tokens_total",
                "counter",
                "Number of accepted tokens.",
                [(f"{{{lab}}}", float(p.accepted))],
            )
            metric(
                "vllm:spec_decode_num_draft_tokens_total",
                "counter",
                "Number of draft tokens.",
                [(f"{{{lab}}}", float(p.drafted))],
            )
        return "\n".join(lines) + "\n"


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0
