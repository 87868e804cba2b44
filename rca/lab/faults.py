"""Fault injectors for the lab, each with its ground truth.

A fault is an object with the hooks of ``docs/lab.md`` (``on_load``,
``on_start``, ``on_submit``, ``before_step``, ``after_forward``,
``after_step``), a ground-truth catalog ``code`` (its family comes from the
catalog), the HTTP ``status`` its victims should see, optional ``config``
overrides for the engine, and optional extra requests (``workload``) that it
needs (a request with a bad parameter, a long prompt, a LoRA request...).

Everything a fault does is real in the lab: an inf written into a weight, a
bit flipped in a finished KV block, a tokenizer that hands out ids past the
embedding, an adapter file with the wrong rank, a truncated checkpoint, a burst
that fills the queue. What a CPU cannot do for real (an Xid, an ECC counter,
an NVLink CRC counter, a thermal clock event, a kernel OOM kill) is scripted
as the driver would show it (the fake NVML the real poller reads, and kernel
log lines in the driver's own wording) together with its real downstream
effect in the lab (bit flips in the KV cache, a step that raises the CUDA
error text, steps that slow down).

``victims`` collects the request ids a fault hit; the runner scores the trace
of the first victim that failed.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

__all__ = ["Fault", "FAULTS", "fault_types", "make_fault", "NOISE_FAULTS"]


class LabFaultError(RuntimeError):
    """Raised inside a step by a fault that scripts a device error."""


@dataclass
class Fault:
    """Base class. Subclasses set ``name``, ``code``, ``status`` and hooks."""

    name: ClassVar[str] = ""
    code: ClassVar[str] = ""
    status: ClassVar[int] = 500
    #: scripted (hardware/driver evidence from the fake NVML and kernel lines)
    scripted: ClassVar[bool] = False
    rng: random.Random = field(default_factory=random.Random)
    #: tick of the workload clock at which the fault acts (the runner arms it then)
    at_step: int = 20
    armed: bool = False
    victims: list[str] = field(default_factory=list)  # trace ids
    inject_ns: int | None = None
    fired: bool = False

    # -- what the runner asks of a fault ------------------------------------------
    def config(self) -> dict[str, Any]:
        """Engine config overrides (LabConfig field -> value)."""
        return {}

    def workload(self) -> list[dict[str, Any]]:
        """Extra requests: dicts with ``at`` (arrival tick), ``body`` (JSON body),
        optionally ``path`` (default /v1/completions), ``victim`` (True: a
        victim of this fault by construction) and ``traffic`` (True: ordinary
        requests that only make sure something is in flight when the fault
        acts; sending them does not mark the injection time).

        By default: three ordinary requests arriving just after the fault is
        armed, so a fault inside the engine always meets traffic."""
        return [
            {
                "at": self.at_step + i,
                "body": {"prompt": f"status report {i} for the on-call rotation", "max_tokens": 24},
                "traffic": True,
            }
            for i in range(3)
        ]

    def family(self) -> str:
        from graph.catalog import default_catalog

        return default_catalog()[self.code].family

    def mark(self, engine: Any = None) -> None:
        if self.inject_ns is None:
            self.inject_ns = time.time_ns()
        self.fired = True

    def _strike(self, batch: Any) -> bool:
        """Act now? True once: the first step after arming (the fault is then
        marked and the batch's traces become its victims)."""
        if self.fired or not self.armed:
            return False
        self.mark()
        self._batch_victims(batch)
        return True

    def _batch_victims(self, batch: Any) -> None:
        for tid in getattr(batch, "trace_ids", []) or []:
            if tid and tid not in self.victims:
                self.victims.append(tid)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _pci(engine: Any) -> str:
    """The fake GPU's PCI bus id in the kernel's short form (0000:3b:00)."""
    try:
        dev = engine.nvml.nvmlDeviceGetHandleByIndex(0)
        bus = engine.nvml.nvmlDeviceGetPciInfo(dev).busId
        bus = bus.decode() if isinstance(bus, bytes) else str(bus)
    except Exception:
        bus = "00000000:3B:00.0"
    dom, b, rest = bus.split(":")
    return f"{dom[-4:]}:{b.lower()}:{rest.split('.')[0]}"


def _script(engine: Any, name: str, value: Any, device: int = 0) -> None:
    """Change one scripted NVML reading from now on (list values: per call)."""
    engine.nvml.set_value(device, name, value)


def _xid(
    engine: Any,
    xid: int,
    text: str,
    *,
    pid: int | None = None,
    name: str = "python3",
    event: bool = True,
    pci: str | None = None,
) -> None:
    """One Xid as the driver reports it: the NVML event (unless ``event`` is
    False: a second line of the same Xid) and the kernel line, in NVRM's
    words (``pid``/``name`` unknown when the driver names no process)."""
    if event:
        engine.nvml.push_event(0, "xid", xid)
    who = f"pid={pid}, name={name}" if pid is not None else "pid='<unknown>', name=<unknown>"
    engine.kernel_log(f"NVRM: Xid (PCI:{pci or _pci(engine)}): {xid}, {who}, {text}")


def _full_blocks(batch: Any, engine: Any) -> list[tuple[str, int]]:
    """(trace id, block id) of finished blocks that rows of the batch read and
    will read again: a row that takes its last token this step finishes before
    the next step's attention, and its request would succeed whatever its
    blocks hold (the kv_corruption test saw all 200s 1 run in 4)."""
    out: list[tuple[str, int]] = []
    bs = engine.config.block_size
    prefill = list(getattr(batch, "prefill_rows", []) or [False] * len(batch.trace_ids))
    seqs = list(getattr(batch, "seqs", []) or [None] * len(batch.trace_ids))
    rows = zip(batch.trace_ids, batch.block_tables, batch.context_lens, prefill, seqs, strict=False)
    for tid, table, n, pf, seq in rows:
        if pf:  # a row still prefilling rewrites its cache this step
            continue
        if seq is not None and seq.max_tokens - len(seq.output_ids) < 2:
            continue  # its last token: it never reads these blocks again
        full = int(n) // bs
        out += [(tid, int(b)) for b in table.tolist()[:full]]
    return out


def _flip_to_nonfinite(t: Any, block: int, layer: int, rng: random.Random) -> int:
    """Flip exponent bits of a few float32 words of one block (a DBE-like burst)
    so they read as inf/NaN; returns how many words changed."""
    import torch

    blk = t[layer, block]
    flat = blk.view(-1)
    n = min(4, flat.numel())
    start = rng.randrange(0, max(1, flat.numel() - n))
    words = flat[start : start + n].clone().view(torch.int32)
    words ^= 0x7F800000  # the exponent bits: finite values turn huge or inf/NaN
    words |= 0x7F800000
    flat[start : start + n] = words.view(torch.float32)
    return n


def _raise_cuda(msg: str) -> None:
    raise RuntimeError(msg)


# ---------------------------------------------------------------------------
# numerical
# ---------------------------------------------------------------------------
@dataclass
class WeightInf(Fault):
    """An inf lands in an MLP weight (a bad update, a corrupted shard): every
    request's activations turn non-finite from that module on."""

    name: ClassVar[str] = "weight_inf"
    code: ClassVar[str] = "ACTIVATION_INF"
    status: ClassVar[int] = 500

    def before_step(self, engine: Any, batch: Any) -> None:
        if self.fired or not self.armed:
            return
        import torch

        layer = self.rng.randrange(engine.config.layers)
        w = engine.model.layers[layer].mlp.down_proj.weight
        with torch.no_grad():
            w.view(-1)[self.rng.randrange(w.numel())] = float("inf")
        self.mark()
        self._batch_victims(batch)


@dataclass
class LogitsNaN(Fault):
    """A NaN in the final norm's weight: only the logits go bad."""

    name: ClassVar[str] = "norm_nan"
    code: ClassVar[str] = "LOGITS_NAN"
    status: ClassVar[int] = 500

    def before_step(self, engine: Any, batch: Any) -> None:
        if self.fired or not self.armed:
            return
        import torch

        with torch.no_grad():
            # a row of a real byte token (ids past the tokenizer are masked)
            engine.model.lm_head.weight[self.rng.randrange(256)] = float("nan")
        self.mark()
        self._batch_victims(batch)


# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------
@dataclass
class KVBitFlip(Fault):
    """A finished KV block changes under a running request (a kernel writing
    through a stale block table): its values turn non-finite."""

    name: ClassVar[str] = "kv_corruption"
    code: ClassVar[str] = "KV_BLOCK_HASH_MISMATCH"
    status: ClassVar[int] = 500

    def after_step(self, engine: Any, batch: Any) -> None:
        # after this step's forward: the KV probe's check at the end of the step
        # sees the change, the next step's attention reads the bad values
        if self.fired or not self.armed:
            return
        blocks = _full_blocks(batch, engine)
        if not blocks:
            return
        tid, block = self.rng.choice(blocks)
        _flip_to_nonfinite(engine.pool.k, block, self.rng.randrange(engine.config.layers), self.rng)
        self.mark()
        self.victims.append(tid)


@dataclass
class KVBlockLeak(Fault):
    """Blocks are never returned to the pool (a leak in the block manager):
    the pool runs dry, the scheduler preempts, requests time out."""

    name: ClassVar[str] = "kv_block_leak"
    code: ClassVar[str] = "KV_CACHE_NO_FREE_BLOCKS"
    status: ClassVar[int] = 504

    def config(self) -> dict[str, Any]:
        return {"request_timeout_s": 1.0}

    def workload(self) -> list[dict[str, Any]]:
        return [
            {"at": self.at_step + 2 + i, "body": {"prompt": f"report {i} " * 4, "max_tokens": 16}}
            for i in range(6)
        ]

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self.armed:
            return
        # every block that comes free is lost again: the pool drains for good
        n = engine.allocator.num_free
        if n:
            engine.allocator.allocate(n)
        if not self.fired:
            self.mark()
            engine.log_line(
                "ERROR", "block_manager.py:412", f"Cannot get {n} free blocks from the pool"
            )
        self._batch_victims(batch)


# ---------------------------------------------------------------------------
# attention / positions, tokenizer
# ---------------------------------------------------------------------------
@dataclass
class PositionOverflow(Fault):
    """A position-id bug: rows continue past the RoPE table (an off-by-offset
    after recompute), the index check fires and the rotary lookup fails."""

    name: ClassVar[str] = "position_overflow"
    code: ClassVar[str] = "POSITION_OUT_OF_RANGE"
    status: ClassVar[int] = 500

    def before_step(self, engine: Any, batch: Any) -> None:
        if self.fired or not self.armed or batch.is_prefill:
            return
        batch.positions.add_(engine.config.max_position)
        self.mark()
        self._batch_victims(batch)


@dataclass
class TokenizerOOV(Fault):
    """The tokenizer's added tokens outgrow the model's embedding (a tokenizer
    from another revision): ids past the vocabulary reach the model."""

    name: ClassVar[str] = "tokenizer_oov"
    code: ClassVar[str] = "TOKEN_ID_OUT_OF_VOCAB"
    status: ClassVar[int] = 500

    def before_step(self, engine: Any, batch: Any) -> None:
        if self.fired or not self.armed or not batch.is_prefill:
            return
        # one prompt carries the bad ids: the last row that is prefilling
        rows = [i for i, pre in enumerate(batch.prefill_rows or []) if pre]
        r = rows[-1] if rows else batch.token_ids.shape[0] - 1
        batch.token_ids[r] = engine.config.vocab_size + 7
        self.mark()
        # that prompt's trace is the incident: the probe's record names its row
        tid = batch.trace_ids[r] if r < len(batch.trace_ids) else None
        if tid:
            self.victims.append(tid)
        self._batch_victims(batch)


@dataclass
class DetokenizeUTF8(Fault):
    """Strict detokenization of byte tokens that are not valid UTF-8."""

    name: ClassVar[str] = "detokenize_utf8"
    code: ClassVar[str] = "DETOKENIZE_INVALID_UTF8"
    status: ClassVar[int] = 500

    def config(self) -> dict[str, Any]:
        return {"strict_detokenize": True}

    def after_forward(self, engine: Any, batch: Any, logits: Any) -> Any:
        if not self.armed or self.fired:
            return logits
        # a model that favours a lone continuation byte (0x80..0xBF)
        logits[..., 0x9F] += 1e4
        self.mark()
        self._batch_victims(batch)
        return logits


# ---------------------------------------------------------------------------
# request validation, overload, scheduler, timeouts
# ---------------------------------------------------------------------------
@dataclass
class PromptTooLong(Fault):
    name: ClassVar[str] = "prompt_too_long"
    code: ClassVar[str] = "CONTEXT_LENGTH_EXCEEDED"
    status: ClassVar[int] = 413

    def workload(self) -> list[dict[str, Any]]:
        return [
            {"at": self.at_step, "body": {"prompt": "x" * 700, "max_tokens": 8}, "victim": True}
        ]


@dataclass
class BadSamplingParam(Fault):
    name: ClassVar[str] = "bad_sampling_param"
    code: ClassVar[str] = "SAMPLING_PARAM_INVALID"
    status: ClassVar[int] = 400

    def workload(self) -> list[dict[str, Any]]:
        body = self.rng.choice(
            [
                {"prompt": "hello there", "max_tokens": 8, "temperature": -0.5},
                {"prompt": "hello there", "max_tokens": 8, "top_p": 1.7},
            ]
        )
        return [{"at": self.at_step, "body": body, "victim": True}]


@dataclass
class QueueFlood(Fault):
    """A client retries in a tight loop: the waiting queue fills, 429s."""

    name: ClassVar[str] = "queue_flood"
    code: ClassVar[str] = "REQUEST_QUEUE_FULL"
    status: ClassVar[int] = 429

    def config(self) -> dict[str, Any]:
        return {"max_waiting": 6, "max_num_seqs": 2}

    def workload(self) -> list[dict[str, Any]]:
        # 40 at once against 2 running + 6 waiting slots, each asking for the
        # most tokens the server allows: a running pair holds its slots for 128
        # steps, so the queue overflows however the arrivals interleave with the
        # engine's steps. (8 slots and 24 tokens left it to timing: the engine
        # thread sometimes finished whole batches between arrivals, and none got
        # a 429.)
        body = {"max_tokens": 128}  # LabConfig.max_tokens_limit
        return [
            {"at": self.at_step, "body": {"prompt": f"retry {i}", **body}, "victim": True}
            for i in range(40)
        ]


@dataclass
class SchedulerStarvation(Fault):
    """A deploy sets max_num_seqs to 1: the waiting queue backs up, requests
    time out while the one slot crawls."""

    name: ClassVar[str] = "scheduler_backlog"
    code: ClassVar[str] = "SCHEDULER_QUEUE_BACKLOG"
    status: ClassVar[int] = 504

    def config(self) -> dict[str, Any]:
        return {"max_num_seqs": 1, "request_timeout_s": 1.0, "max_waiting": 512}

    def workload(self) -> list[dict[str, Any]]:
        return [
            {"at": self.at_step, "body": {"prompt": f"job {i}", "max_tokens": 24}, "victim": True}
            for i in range(130)
        ]

    def before_step(self, engine: Any, batch: Any) -> None:
        if self.armed:
            time.sleep(0.01)  # the single slot's long decode


@dataclass
class ShmBroadcastStall(Fault):
    """A worker stops answering the engine's broadcast: steps hang, 504."""

    name: ClassVar[str] = "worker_stall"
    code: ClassVar[str] = "ENGINE_SHM_BROADCAST_STALL"
    status: ClassVar[int] = 504

    def config(self) -> dict[str, Any]:
        return {"request_timeout_s": 0.8}

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self._strike(batch):
            return
        engine.log_line(
            "WARNING",
            "shm_broadcast.py:501",
            "No available shared memory broadcast block found in 60 seconds. This typically "
            "happens when some processes are hanging or doing some time-consuming work "
            "(e.g. compilation, weight/kv cache quantization).",
        )
        time.sleep(1.2)


@dataclass
class NcclWatchdog(Fault):
    """A collective never completes: NCCL's watchdog times out and kills the engine."""

    name: ClassVar[str] = "nccl_watchdog"
    code: ClassVar[str] = "NCCL_WATCHDOG_TIMEOUT"
    status: ClassVar[int] = 500

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self._strike(batch):
            return
        engine.log_line(
            "ERROR",
            "ProcessGroupNCCL.cpp:632",
            "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2113, "
            "OpType=ALLREDUCE, NumelIn=524288, NumelOut=524288, Timeout(ms)=600000) ran for "
            "600044 milliseconds before timing out.",
        )
        _raise_cuda(
            "NCCL communicator was aborted on rank 0. Original reason for failure was: "
            "[Rank 0] Watchdog caught collective operation timeout"
        )


# ---------------------------------------------------------------------------
# speculative decoding, LoRA
# ---------------------------------------------------------------------------
@dataclass
class DraftCollapse(Fault):
    """The draft model is swapped for a different checkpoint: acceptance
    collapses, every step verifies k rejected tokens, requests time out."""

    name: ClassVar[str] = "spec_acceptance_collapse"
    code: ClassVar[str] = "SPEC_DECODE_ACCEPTANCE_COLLAPSE"
    status: ClassVar[int] = 504

    def config(self) -> dict[str, Any]:
        return {"spec_k": 4, "request_timeout_s": 0.5, "stats_every": 5}

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self.armed:
            return
        if not self.fired:
            import torch

            g = torch.Generator().manual_seed(self.rng.randrange(1 << 30))
            with torch.no_grad():
                for p in engine.draft.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * p.std().clamp(min=1e-3))
            self.mark()
        time.sleep(0.05)  # rejected drafts: each step re-does the work
        self._batch_victims(batch)


@dataclass
class DraftModelError(Fault):
    """The draft model raises (a shape the proposer does not support)."""

    name: ClassVar[str] = "spec_draft_error"
    code: ClassVar[str] = "SPEC_DECODE_DRAFT_MODEL_ERROR"
    status: ClassVar[int] = 500

    def config(self) -> dict[str, Any]:
        return {"spec_k": 3}

    def on_start(self, engine: Any) -> None:
        fault = self
        orig = engine.draft.forward

        def broken(*a: Any, **kw: Any) -> Any:
            if fault.armed:
                fault.mark()
                raise NotImplementedError(
                    "Speculative decoding with draft model is not supported yet. Please "
                    "consider using other speculative decoding methods such as ngram, medusa, "
                    "eagle, or deepseek_mtp."
                )
            return orig(*a, **kw)

        engine.draft.forward = broken

    def before_step(self, engine: Any, batch: Any) -> None:
        if self.armed and not self.victims:
            self._batch_victims(batch)


def _write_adapter(path: Path, engine_config: Any, *, rank: int, targets: list[str]) -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    h = engine_config.hidden_size
    weights = {
        t: (torch.randn(rank, h, generator=g) * 0.01, torch.randn(h, rank, generator=g) * 0.01)
        for t in targets
    }
    torch.save(
        {"rank": rank, "alpha": 2 * rank, "target_modules": targets, "weights": weights}, path
    )


@dataclass
class LoraBadRank(Fault):
    """An adapter trained with rank 64 is hot-loaded on a server capped at 16."""

    name: ClassVar[str] = "lora_rank"
    code: ClassVar[str] = "LORA_RANK_EXCEEDS_MAX"
    status: ClassVar[int] = 404
    rank: int = 64
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    adapter: str = "support-bot"

    def workload(self) -> list[dict[str, Any]]:
        """Hot-load the adapter, then a request that asks for it (the victim)."""
        return [
            {
                "at": self.at_step,
                "path": "/v1/load_lora_adapter",
                "body": {"lora_name": self.adapter, "lora_path": "@adapter"},
            },
            {
                "at": self.at_step + 2,
                "body": {"prompt": "hi", "max_tokens": 8, "model": self.adapter},
                "victim": True,
            },
        ]

    def on_start(self, engine: Any) -> None:
        path = Path(engine.run_dir) / f"{self.adapter}.pt"
        _write_adapter(path, engine.config, rank=self.rank, targets=list(self.targets))
        self.adapter_path = str(path)


@dataclass
class LoraBadTargets(LoraBadRank):
    name: ClassVar[str] = "lora_target_modules"
    code: ClassVar[str] = "LORA_TARGET_MODULES_MISMATCH"
    rank: int = 8
    targets: tuple[str, ...] = ("q_proj", "gate_up_proj")


# ---------------------------------------------------------------------------
# model loading, config, host resources
# ---------------------------------------------------------------------------
@dataclass
class _StartupFault(Fault):
    """A deployment setting the engine refuses at load: every request gets 503."""

    status: ClassVar[int] = 503
    overrides: ClassVar[dict[str, Any]] = {}

    def config(self) -> dict[str, Any]:
        return dict(self.overrides)

    def on_load(self, engine: Any, state_dict: Any) -> None:
        self.mark()


@dataclass
class CheckpointTruncated(_StartupFault):
    """The weights file was cut short by a failed copy: loading fails, 503s."""

    name: ClassVar[str] = "checkpoint_truncated"
    code: ClassVar[str] = "MODEL_WEIGHTS_LOAD_FAILED"
    overrides: ClassVar[dict[str, Any]] = {"truncate_checkpoint": True}


@dataclass
class ConfigMaxModelLen(_StartupFault):
    """max_model_len set past the model's position table: startup refuses."""

    name: ClassVar[str] = "config_max_model_len"
    code: ClassVar[str] = "CONFIG_MAX_MODEL_LEN_TOO_LARGE"
    overrides: ClassVar[dict[str, Any]] = {"max_model_len": 4096}


@dataclass
class ConfigTPHeads(_StartupFault):
    name: ClassVar[str] = "config_tp_heads"
    code: ClassVar[str] = "CONFIG_TP_HEADS_NOT_DIVISIBLE"
    overrides: ClassVar[dict[str, Any]] = {"tensor_parallel_size": 3}


@dataclass
class HostOOMKill(Fault):
    """The kernel's OOM killer takes the engine's worker: the engine dies."""

    name: ClassVar[str] = "host_oom_kill"
    code: ClassVar[str] = "HOST_OOM_KILL"
    status: ClassVar[int] = 500
    scripted: ClassVar[bool] = True

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self._strike(batch):
            return
        pid = 40000 + self.rng.randrange(9999)
        engine.kernel_log(
            f"Out of memory: Killed process {pid} (VllmWorker) total-vm:81234567kB, "
            f"anon-rss:61234567kB, file-rss:123456kB, shmem-rss:0kB, UID:0 pgtables:120000kB "
            f"oom_score_adj:0"
        )
        raise LabFaultError("Worker proc VllmWorker-0 died unexpectedly, shutting down executor.")


@dataclass
class TooManyOpenFiles(LoraBadRank):
    """The process hits its open-files limit while loading a good adapter."""

    name: ClassVar[str] = "too_many_open_files"
    code: ClassVar[str] = "TOO_MANY_OPEN_FILES"
    rank: int = 8
    adapter: str = "sql-helper"

    def on_start(self, engine: Any) -> None:
        super().on_start(engine)
        fault = self

        def load(name: str, p: str) -> Any:
            fault.mark()
            raise OSError(24, "Too many open files")

        engine.lora.load = load


# ---------------------------------------------------------------------------
# scripted hardware and driver evidence with its real effect
# ---------------------------------------------------------------------------
@dataclass
class Xid48DBE(Fault):
    """Double-bit ECC error in the framebuffer: NVML event and counter, the
    driver's Xid 48 line, and the flipped bits in a KV block, which the KV
    probe catches, then NaN logits, then 500s."""

    name: ClassVar[str] = "xid48_dbe"
    code: ClassVar[str] = "GPU_XID_48"
    status: ClassVar[int] = 500
    scripted: ClassVar[bool] = True

    def after_step(self, engine: Any, batch: Any) -> None:
        if self.fired or not self.armed:
            return
        blocks = _full_blocks(batch, engine)
        if not blocks:
            return
        self.mark()
        _script(engine, ("nvmlDeviceGetTotalEccErrors", 1, 0), 2)  # DBE, volatile
        _xid(
            engine,
            48,
            "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
            f"at physAddr 0x{self.rng.randrange(1 << 36):x} partition 3, subpartition 1",
        )
        for tid, block in self.rng.sample(blocks, min(2, len(blocks))):
            _flip_to_nonfinite(
                engine.pool.v, block, self.rng.randrange(engine.config.layers), self.rng
            )
            self.victims.append(tid)


@dataclass
class Xid13App(Fault):
    """An application kernel reads out of bounds: Xid 13 on scattered SMs,
    then the illegal-address error kills the engine (NVIDIA's rule: the
    application, not the GPU)."""

    name: ClassVar[str] = "illegal_address_app"
    code: ClassVar[str] = "CUDA_ERROR_ILLEGAL_ADDRESS"
    status: ClassVar[int] = 500
    scripted: ClassVar[bool] = True
    same_sm: ClassVar[bool] = False

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self._strike(batch):
            return
        pci = _pci(engine)
        pid = os.getpid()  # the driver names the process whose kernel faulted: the engine
        for i in range(4):
            if self.same_sm:
                gpc, tpc, sm = 3, 1, 0
            else:
                gpc, tpc, sm = (i * 2 + self.rng.randrange(2)) % 8, self.rng.randrange(6), i % 2
            _xid(
                engine,
                13,
                f"Graphics SM Warp Exception on (GPC {gpc}, TPC {tpc}, SM {sm}): "
                "Out Of Range Address",
                pid=pid,
                pci=pci,
            )
            _xid(
                engine,
                13,
                f"Graphics Exception: ESR 0x50{gpc}648=0x102000e 0x50{gpc}650=0x24 "
                f"0x50{gpc}644=0xd3eff2 0x50{gpc}64c=0x17f",
                pid=pid,
                pci=pci,
                event=False,
            )
        _raise_cuda("CUDA error: an illegal memory access was encountered")


@dataclass
class Xid13Hardware(Xid13App):
    """The same SM faults again and again: the GPU, not the application."""

    name: ClassVar[str] = "xid13_bad_sm"
    code: ClassVar[str] = "GPU_XID_13"
    same_sm: ClassVar[bool] = True


@dataclass
class Xid79FellOffBus(Fault):
    name: ClassVar[str] = "xid79_off_bus"
    code: ClassVar[str] = "GPU_XID_79"
    status: ClassVar[int] = 500
    scripted: ClassVar[bool] = True

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self._strike(batch):
            return
        _xid(engine, 79, "GPU has fallen off the bus.")
        engine.kernel_log("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.")
        _script(engine, "nvmlDeviceGetPowerUsage", "GpuIsLost")
        _raise_cuda("CUDA error: unspecified launch failure")


@dataclass
class Xid74NVLink(Fault):
    name: ClassVar[str] = "xid74_nvlink"
    code: ClassVar[str] = "GPU_XID_74"
    status: ClassVar[int] = 500
    scripted: ClassVar[bool] = True

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self._strike(batch):
            return
        link = self.rng.randrange(4)
        _xid(
            engine,
            74,
            f"NVLink: fatal error detected on link {link}(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
        )
        _raise_cuda("CUDA error: uncorrectable NVLink error detected during the execution")


@dataclass
class NVLinkCRC(Fault):
    """NVLink CRC errors climb (a bad cable); the collective fails on it."""

    name: ClassVar[str] = "nvlink_crc"
    code: ClassVar[str] = "NVLINK_CRC_ERRORS_RISING"
    status: ClassVar[int] = 500
    scripted: ClassVar[bool] = True

    def nvml_script(self) -> dict[str, Any]:
        return {"devices": [{"nvlink_links": 2}]}

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self.armed:
            return
        if not self.fired:
            self.mark()
            base = 0
            _script(engine, "nvmlDeviceGetNvLinkErrorCounter", lambda i, *a: base + 37 * i)
            self._fail_at = engine.step_no + 6
            return
        if engine.step_no >= getattr(self, "_fail_at", 1 << 30):
            self._batch_victims(batch)
            self._fail_at = 1 << 30
            _raise_cuda("CUDA error: uncorrectable NVLink error detected during the execution")


@dataclass
class ThermalSlowdown(Fault):
    """Cooling fails: HW thermal slowdown, steps crawl, requests time out."""

    name: ClassVar[str] = "thermal_slowdown"
    code: ClassVar[str] = "GPU_HW_THERMAL_SLOWDOWN"
    status: ClassVar[int] = 504
    scripted: ClassVar[bool] = True

    def config(self) -> dict[str, Any]:
        return {"request_timeout_s": 0.8}

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self.armed:
            return
        if not self.fired:
            self.mark()
            _script(engine, "nvmlDeviceGetCurrentClocksEventReasons", 0x40 | 0x20)
            _script(engine, "nvmlDeviceGetTemperature", 94)
            _script(engine, "nvmlDeviceGetTemperatureV", 94)
        self._batch_victims(batch)
        time.sleep(0.05)  # clocks at a fraction: every step is slower


@dataclass
class Xid119GSP(Fault):
    name: ClassVar[str] = "xid119_gsp_timeout"
    code: ClassVar[str] = "GPU_XID_119"
    status: ClassVar[int] = 500
    scripted: ClassVar[bool] = True

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self._strike(batch):
            return
        _xid(
            engine,
            119,
            "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 "
            "(GSP_RM_CONTROL) (0x20801348 0x4).",
            pid=2024380,
        )
        _raise_cuda("CUDA error: unknown error")


@dataclass
class GpuOOM(Fault):
    """Another process on the GPU takes its memory: the next prefill's
    allocation fails (CUDA's caching allocator text)."""

    name: ClassVar[str] = "gpu_oom"
    code: ClassVar[str] = "TORCH_CUDA_OOM"
    status: ClassVar[int] = 500
    scripted: ClassVar[bool] = True

    def before_step(self, engine: Any, batch: Any) -> None:
        if not self._strike(batch):
            return
        import torch

        total = 80 * (1 << 30)
        _script(engine, "nvmlDeviceGetMemoryInfo", {"total": total, "used": total - (300 << 20)})
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 1.74 GiB. GPU 0 has a total capacity of "
            "79.10 GiB of which 291.06 MiB is free. Process 4121 has 41.02 GiB memory in use. "
            "Of the allocated memory 36.11 GiB is allocated by PyTorch, and 1.02 GiB is reserved "
            "by PyTorch but unallocated."
        )


# ---------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------
FAULTS: dict[str, type[Fault]] = {
    f.name: f
    for f in (
        WeightInf,
        LogitsNaN,
        KVBitFlip,
        KVBlockLeak,
        PositionOverflow,
        TokenizerOOV,
        DetokenizeUTF8,
        PromptTooLong,
        BadSamplingParam,
        QueueFlood,
        SchedulerStarvation,
        ShmBroadcastStall,
        NcclWatchdog,
        DraftCollapse,
        DraftModelError,
        LoraBadRank,
        LoraBadTargets,
        CheckpointTruncated,
        ConfigMaxModelLen,
        ConfigTPHeads,
        HostOOMKill,
        TooManyOpenFiles,
        Xid48DBE,
        Xid13App,
        Xid13Hardware,
        Xid79FellOffBus,
        Xid74NVLink,
        NVLinkCRC,
        ThermalSlowdown,
        Xid119GSP,
        GpuOOM,
    )
}

#: faults that can run beside another one without stopping the engine first
NOISE_FAULTS = ("bad_sampling_param", "prompt_too_long", "queue_flood")


def fault_types() -> list[str]:
    return sorted(FAULTS)


def make_fault(name: str, rng: random.Random, at_step: int | None = None) -> Fault:
    cls = FAULTS[name]
    f = cls(rng=rng)
    if at_step is not None:
        f.at_step = at_step
    return f
