"""Continuous batching: a bounded, priority-FIFO waiting queue, a running set, a
token budget per step, and preemption by recompute of the youngest running
sequence when the KV pool has no free block (vLLM's V0 policy)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rca.lab.kvcache import BlockAllocator, blocks_needed

__all__ = ["Sequence", "Scheduler", "ScheduledBatch", "QueueFullError"]


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"Exceeds maximum queue size ({limit} waiting requests)")
        self.limit = limit


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request_id: str
    trace_id: str | None
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    generator: torch.Generator
    order: int
    priority: int = 0
    lora: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the pool
    draft_computed: int = 0  # same, in the draft's pool
    sealed: int = 0  # leading blocks sealed with the KV checker
    preemptions: int = 0
    status: str = "waiting"  # waiting | running | finished
    first_token_at: float | None = None
    future: Any = None
    request: Any = None

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def key(self) -> tuple[int, int]:
        return (self.priority, self.order)


@dataclass
class ScheduledBatch:
    """What one step runs: ``(sequence, new tokens)`` per row, and who was preempted."""

    rows: list[tuple[Sequence, int]]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.rows)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_waiting: int,
        on_preempt: Callable[[Sequence], None] | None = None,
        on_free: Callable[[Sequence, list[int]], None] | None = None,
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.on_preempt = on_preempt
        self.on_free = on_free
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(self.max_waiting)
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = "waiting"
        bisect.insort(self.waiting, seq, key=lambda s: s.key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def free_blocks(self, seq: Sequence) -> None:
        if seq.block_table:
            released = self.allocator.free(seq.block_table)
            if self.on_free is not None:
                self.on_free(seq, released)
        seq.block_table = []
        seq.num_computed = seq.draft_computed = seq.sealed = 0

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (done, failed or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)
        seq.status = "finished"

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq)

    # ------------------------------------------------------------------ step
    def schedule(self, lookahead: int = 0) -> ScheduledBatch:
        """Pick this step's rows: running sequences first (oldest first, each
        with room for 1 + ``lookahead`` tokens, preempting the youngest when no
        block is free), then waiting ones while seats, tokens and blocks last."""
        bs = self.block_size
        rows: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            need = seq.total_len - seq.num_computed
            want = blocks_needed(seq.total_len + lookahead, bs) - len(seq.block_table)
            while want > 0 and not self.allocator.can_allocate(want):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != "running":
                break
            if want > 0:
                seq.block_table += self.allocator.allocate(want)
            rows.append((seq, need))
            budget -= need
            i += 1
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = seq.total_len
            if need > budget:
                break
            nb = blocks_needed(seq.total_len, bs)
            if not self.allocator.can_allocate(nb):
                break
            self.waiting.pop(0)
            seq.block_table = self.allocator.allocate(nb)
            seq.num_computed = seq.draft_computed = seq.sealed = 0
            seq.status = "running"
            self.running.append(seq)
            rows.append((seq, need))
            budget -= need
        return ScheduledBatch(rows, preempted)
