"""Speculative decoding with a draft model.

The draft is a smaller :class:`TinyLlama` (the target's first layers, same
embeddings and head, copied at start) with its own paged KV pool that shares
the target's block tables. Per decode step it proposes ``k`` tokens greedily;
the target scores ``[last, d1..dk]`` in one forward and samples ``t0..tk``;
drafts are accepted while ``d_{j+1} == t_j``, and the step emits ``t0..ta``.
The emitted tokens are always the target's own samples, so greedy output is
the same with and without speculation; only the tokens per step change.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from rca.lab.kvcache import KVPool
from rca.lab.model import LabConfig, TinyLlama, draft_config

__all__ = ["DraftModelProposer"]


class DraftModelProposer:
    """Proposes ``k`` tokens per sequence; tracks drafted and accepted counts."""

    def __init__(self, target: TinyLlama, cfg: LabConfig, k: int, vocab_limit: int) -> None:
        self.k = k
        self.vocab_limit = vocab_limit
        self.model = TinyLlama(draft_config(cfg))
        self.sync_from(target)
        dc = self.model.config
        self.pool = KVPool(
            dc.num_layers, cfg.num_blocks, cfg.block_size, dc.num_kv_heads, dc.head_dim
        )
        self.drafted = 0
        self.accepted = 0
        self.steps = 0
        self.steps_rows = 0  # (step, row) pairs verified
        self.errors = 0
        self.log_t = time.monotonic()
        self.log_acc = 0
        self.log_drafted = 0
        self.per_position = [0] * k

    @torch.no_grad()
    def sync_from(self, target: TinyLlama) -> None:
        """Copy the shared weights (embeddings, first layers, norm, head)."""
        own = self.model.state_dict()
        src = target.state_dict()
        for name in own:
            if name in src:
                own[name] = src[name].clone()
        self.model.load_state_dict(own)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 1.0

    @torch.no_grad()
    def propose(self, seqs: Seq[Any], block_tables: torch.Tensor) -> torch.Tensor:
        """Draft tokens ``[B, k]``; advances each sequence's ``draft_computed``."""
        b = len(seqs)
        n = [s.total_len - s.draft_computed for s in seqs]
        t = max(n)
        ids = torch.zeros(b, t, dtype=torch.long)
        pos = torch.zeros(b, t, dtype=torch.long)
        for i, s in enumerate(seqs):
            toks = s.all_ids()[s.draft_computed :]
            ids[i, : len(toks)] = torch.tensor(toks)
            pos[i, : len(toks)] = torch.arange(s.draft_computed, s.total_len)
        qlens = torch.tensor(n)
        out = torch.zeros(b, self.k, dtype=torch.long)
        logits = self.model(ids, pos, self.pool, block_tables, qlens)
        cur = logits[:, : self.vocab_limit].argmax(-1)
        out[:, 0] = cur
        last = torch.tensor([s.total_len for s in seqs])
        ones = torch.ones(b, dtype=torch.long)
        for j in range(1, self.k):
            logits = self.model(
                cur[:, None], (last + j - 1)[:, None], self.pool, block_tables, ones
            )
            cur = logits[:, : self.vocab_limit].argmax(-1)
            out[:, j] = cur
        for s in seqs:
            s.draft_computed = s.total_len
        return out

    def record(self, accepted: list[int]) -> None:
        self.steps += 1
        for a in accepted:
            self.steps_rows += 1
            self.drafted += self.k
            self.accepted += a
            for j in range(a):
                self.per_position[j] += 1
