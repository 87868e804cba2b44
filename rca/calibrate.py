"""Learn the ranking's :class:`rca.engine.Weights` from labelled incidents.

The engine scores a candidate cause as ``w . f`` over interpretable features
(``RootCause.features``) and turns the scores of one answer into a softmax.
That is a conditional logit, so the weights are fitted as one: maximize the
log-probability of the true cause among each incident's candidates, with an L2
penalty pulling the weights back toward the starting (hand-set) ones, by
L-BFGS (scipy). The penalty is chosen by cross-validation on the training
incidents only, and the learned weights replace the starting ones only when
they do at least as well on the validation folds (AC@1, then log-likelihood).
Incidents whose true cause is not among the candidates teach nothing (no
weight can rank an absent code) and are left out of the fit.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from graph.catalog import Catalog, default_catalog
from rca.engine import Weights

if TYPE_CHECKING:
    from rca.query import Gathered

__all__ = [
    "CandidateSet",
    "Calibration",
    "calibrate",
    "candidate_sets",
    "fit_conditional_logit",
    "rank_codes",
    "accuracy_at",
    "mean_nll",
]

NAMES = Weights.names()
L2_GRID = (0.003, 0.03, 0.3, 3.0)


class Labelled(Protocol):
    """What calibration needs of an incident (``rca.bench.accuracy.Incident`` fits)."""

    gathered: Gathered
    code: str
    fault: str


@dataclass
class CandidateSet:
    """One incident's candidates as the engine sees them; features do not depend on weights."""

    codes: list[str]
    layers: list[int]
    x: np.ndarray  # (candidates, features) in Weights.names() order
    label: int | None  # index of the true code, None when it is not a candidate


def candidate_sets(items: Sequence[Labelled], catalog: Catalog | None = None) -> list[CandidateSet]:
    """Every candidate of every incident with its features (one engine call each)."""
    from rca.query import rank_gathered

    cat = catalog or default_catalog()
    out: list[CandidateSet] = []
    for it in items:
        _, causes = rank_gathered(it.gathered, catalog=cat, top=sys.maxsize)
        codes = [c.code for c in causes]
        x = np.array([[c.features.get(k, 0.0) for k in NAMES] for c in causes], dtype=float)
        out.append(
            CandidateSet(
                codes=codes,
                layers=[c.layer for c in causes],
                x=x.reshape(len(causes), len(NAMES)),
                label=codes.index(it.code) if it.code in codes else None,
            )
        )
    return out


def _vec(w: Weights) -> np.ndarray:
    return np.array([getattr(w, k) for k in NAMES], dtype=float)


def _weights(v: np.ndarray) -> Weights:
    return Weights(**{k: float(round(x, 6)) for k, x in zip(NAMES, v, strict=True)})


def rank_codes(cs: CandidateSet, w: np.ndarray) -> list[str]:
    """The engine's order: score, then lower layer, then code name."""
    s = cs.x @ w if len(cs.codes) else np.zeros(0)
    order = sorted(range(len(cs.codes)), key=lambda i: (-s[i], cs.layers[i], cs.codes[i]))
    return [cs.codes[i] for i in order]


def accuracy_at(sets: Sequence[CandidateSet], w: np.ndarray, k: int = 1) -> float:
    if not sets:
        return 0.0
    hits = sum(
        1 for cs in sets if cs.label is not None and cs.codes[cs.label] in rank_codes(cs, w)[:k]
    )
    return hits / len(sets)


def _stack(sets: Sequence[CandidateSet]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Learnable sets as one matrix, group start offsets and label rows."""
    use = [cs for cs in sets if cs.label is not None and len(cs.codes) > 1]
    if not use:
        return np.zeros((0, len(NAMES))), np.zeros(0, dtype=int), np.zeros(0, dtype=int)
    x = np.vstack([cs.x for cs in use])
    sizes = np.array([len(cs.codes) for cs in use])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    labels = starts + np.array([cs.label for cs in use])
    return x, starts, labels


def _nll_grad(
    w: np.ndarray, x: np.ndarray, starts: np.ndarray, labels: np.ndarray
) -> tuple[float, np.ndarray]:
    """Mean negative log-likelihood of the true codes and its gradient."""
    n = len(starts)
    if n == 0:
        return 0.0, np.zeros_like(w)
    s = x @ w
    mx = np.maximum.reduceat(s, starts)
    sizes = np.diff(np.append(starts, len(s)))
    e = np.exp(s - np.repeat(mx, sizes))
    z = np.add.reduceat(e, starts)
    p = e / np.repeat(z, sizes)
    nll = float(np.sum(np.log(z) + mx - s[labels])) / n
    expect = np.add.reduceat(p[:, None] * x, starts, axis=0)  # (n, K)
    grad = (expect.sum(axis=0) - x[labels].sum(axis=0)) / n
    return nll, grad


def mean_nll(sets: Sequence[CandidateSet], w: np.ndarray) -> float:
    return _nll_grad(w, *_stack(sets))[0]


def fit_conditional_logit(
    sets: Sequence[CandidateSet], *, l2: float = 0.3, start: Weights | None = None
) -> np.ndarray:
    """Weights maximizing the conditional log-likelihood, L2-pulled toward ``start``."""
    from scipy.optimize import minimize

    w0 = _vec(start or Weights())
    x, starts, labels = _stack(sets)
    if len(starts) == 0:
        return w0

    def f(w: np.ndarray) -> tuple[float, np.ndarray]:
        nll, g = _nll_grad(w, x, starts, labels)
        d = w - w0
        return nll + 0.5 * l2 * float(d @ d), g + l2 * d

    res = minimize(f, w0, jac=True, method="L-BFGS-B", options={"maxiter": 500})
    return np.asarray(res.x, dtype=float)


def _folds(strata: Sequence[str], k: int, seed: int) -> list[list[int]]:
    """Indices in ``k`` folds, each stratum dealt round-robin after a seeded shuffle."""
    by: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(strata):
        by[s].append(i)
    rng = random.Random(seed)
    folds: list[list[int]] = [[] for _ in range(k)]
    j = 0
    for s in sorted(by):
        idx = by[s]
        rng.shuffle(idx)
        for i in idx:
            folds[j % k].append(i)
            j += 1
    return [f for f in folds if f]


@dataclass
class Calibration:
    weights: Weights
    source: str  # "learned" or "hand" (the starting weights were kept)
    l2: float | None
    train: int
    learnable: int  # training incidents whose true code is among the candidates
    cv: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights": self.weights.to_dict(),
            "source": self.source,
            "l2": self.l2,
            "train": self.train,
            "learnable": self.learnable,
            "cv": {k: round(v, 4) for k, v in self.cv.items()},
        }


def calibrate(
    items: Sequence[Labelled],
    *,
    start: Weights | None = None,
    folds: int = 3,
    seed: int = 0,
    l2_grid: Sequence[float] = L2_GRID,
    catalog: Catalog | None = None,
    sets: Sequence[CandidateSet] | None = None,
) -> Calibration:
    """Fit weights on ``items`` (the training split only), keeping ``start`` unless beaten.

    The L2 strength is picked by stratified (fault type) cross-validation; the
    learned weights are kept only if their validation AC@1 is at least that of
    ``start`` (ties: lower validation log-loss).
    """
    start = start or Weights()
    w0 = _vec(start)
    sets = list(sets) if sets is not None else candidate_sets(items, catalog)
    learnable = sum(1 for cs in sets if cs.label is not None)
    fold_idx = _folds([it.fault for it in items], max(2, min(folds, len(items))), seed)
    if learnable < 4 or len(fold_idx) < 2:
        return Calibration(start, "hand", None, len(items), learnable, {})

    def cv(weights_for: Any) -> tuple[float, float]:
        hits = 0.0
        nll = 0.0
        for f in fold_idx:
            held = set(f)
            fit = [sets[i] for i in range(len(sets)) if i not in held]
            val = [sets[i] for i in f]
            w = weights_for(fit)
            hits += accuracy_at(val, w) * len(val)
            nll += mean_nll(val, w) * len(val)
        return hits / len(sets), nll / len(sets)

    hand_ac1, hand_nll = cv(lambda _fit: w0)
    best: tuple[float, float, float] | None = None  # (ac1, -nll, l2)
    for l2 in l2_grid:
        ac1, nll = cv(lambda fit, l2=l2: fit_conditional_logit(fit, l2=l2, start=start))
        if best is None or (ac1, -nll) > best[:2]:
            best = (ac1, -nll, l2)
    assert best is not None
    ac1, neg_nll, l2 = best
    figures = {
        "hand_ac1": hand_ac1,
        "hand_nll": hand_nll,
        "learned_ac1": ac1,
        "learned_nll": -neg_nll,
    }
    if (ac1, neg_nll) < (hand_ac1, -hand_nll):
        return Calibration(start, "hand", l2, len(items), learnable, figures)
    w = fit_conditional_logit(sets, l2=l2, start=start)
    return Calibration(_weights(w), "learned", l2, len(items), learnable, figures)
