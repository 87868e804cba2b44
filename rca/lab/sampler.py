"""Greedy / temperature / top-p sampling with a seeded generator per request.

Probabilities are computed for every row (greedy rows too) and checked: a
non-finite or negative entry raises the ``RuntimeError`` that
``torch.multinomial`` raises (a fatal step error, as in vLLM), after the ops
probe has had them through :meth:`probes.ops.Checker.check_probs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Sampler", "SamplingRow", "PROB_ERROR"]

PROB_ERROR = "probability tensor contains either `inf`, `nan` or element < 0"


class SamplingRow:
    """Per-row parameters: ``temperature`` (0: greedy), ``top_p``, ``generator``."""

    __slots__ = ("temperature", "top_p", "generator")

    def __init__(self, temperature: float, top_p: float, generator: torch.Generator) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.generator = generator


class Sampler:
    def __init__(self, vocab_limit: int, checker: Any = None) -> None:
        self.vocab_limit = vocab_limit  # the tokenizer's ids; padded rows never sampled
        self.checker = checker
        self.errors = 0

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Softmax of ``logits`` ``[B, V]`` or ``[B, n, V]`` per row's temperature
        (1 for greedy rows), top-p applied; checked; raises on bad values."""
        x = logits[..., : self.vocab_limit].float()
        temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows])
        shape = (len(rows),) + (1,) * (x.dim() - 1)
        p = torch.softmax(x / temps.view(shape), dim=-1)
        top = torch.tensor([r.top_p for r in rows])
        if bool((top < 1.0).any()):
            sp, idx = p.sort(dim=-1, descending=True)
            cum = sp.cumsum(-1)
            drop = (cum - sp) > top.view(shape)
            sp = sp.masked_fill(drop, 0.0)
            p = torch.zeros_like(p).scatter(-1, idx, sp)
            p = p / p.sum(-1, keepdim=True)
        if self.checker is not None:
            self.checker.check_probs(p)
        if not bool(torch.isfinite(p).all()) or bool((p < 0).any()):
            self.errors += 1
            raise RuntimeError(PROB_ERROR)
        return p

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids ``[B]`` (or ``[B, n]``, the n positions drawn in order)."""
        p = self.probs(logits, rows)
        greedy = logits[..., : self.vocab_limit].argmax(-1)
        out = greedy.clone()
        for i, r in enumerate(rows):
            if r.temperature > 0:
                pi = p[i] if p.dim() == 3 else p[i : i + 1]
                out[i] = torch.multinomial(pi, 1, generator=r.generator).view(out[i].shape)
        return out
