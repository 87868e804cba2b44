"""Vectorized text -> code classification for batches of lines.

1. One combined regex of every catalog pattern (Rust regex through polars)
   selects the candidate lines: most server output is dropped here at
   millions of lines per second.
2. Each pattern runs over the candidates only; when several codes match a
   line, a specific code beats a catch-all, a cause beats an engine_crash
   wrapper that quotes it, then the longest matched span wins (see
   :func:`match_rank`).
3. Lines no pattern knows but that look like errors go to a learned fallback
   (scikit-learn: TF-IDF over words and character n-grams + logistic
   regression, trained on the catalog's examples and on ordinary server
   output as the "no fault" class). It answers only above a confidence
   threshold: a confident wrong answer is worse than "unknown".
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import polars as pl

from graph.catalog import Catalog, Code, default_catalog

__all__ = [
    "Batch",
    "LineResult",
    "Normalizer",
    "default_normalizer",
    "required_literals",
    "match_rank",
    "ERRORISH",
]

#: Lines worth showing to the learned fallback when no pattern matched.
ERRORISH = (
    r"(?i)(error|exception|traceback|fail|fatal|abort|panic|killed|timed? ?out|timeout|"
    r"refused|denied|invalid|illegal|cannot|can't|unable|not found|nan\b|\binf\b|overflow|"
    r"out of memory|oom|segfault|segmentation|assert|corrupt|mismatch|unavailable|exceed|"
    r"\bWARN\b|\[E\]|\bE\d{4} )"
)
#: Traceback structure and PyTorch/CUDA hint lines: never a fault by themselves.
STRUCTURE = (
    r"(?:^|\] |: )(?:Traceback \(most recent call last\)|\s*File \"|During handling of the above"
    r"|The above exception was the direct cause|CUDA kernel errors might be asynchronously"
    r"|For debugging consider passing CUDA_LAUNCH_BLOCKING|Compile with `TORCH_USE_CUDA_DSA`)"
)
_GENERIC_FIELDS = (
    ("pci", re.compile(r"PCI:(?P<v>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})")),
    ("pid", re.compile(r"\bpid[=: ]'?(?P<v>\d+)")),
    ("request_id", re.compile(r"\b(?P<v>(?:chatcmpl|cmpl|req)-[0-9A-Za-z_-]{6,})")),
    ("rank", re.compile(r"\[?[Rr]ank ?(?P<v>\d+)\]?")),
    ("http_status", re.compile(r'HTTP/\d(?:\.\d)?" (?P<v>[1-5]\d\d)\b')),
)
NONE_LABEL = "__none__"


@dataclass(frozen=True, slots=True)
class LineResult:
    line: int
    code: str | None
    family: str | None
    layer: int | None
    severity: str | None
    confidence: float | None
    fields: dict[str, Any] = field(default_factory=dict)
    method: str | None = None  # "pattern" | "model" | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "code": self.code,
            "family": self.family,
            "layer": self.layer,
            "severity": self.severity,
            "confidence": self.confidence,
            "fields": self.fields,
        }


def required_literals(pattern: str, *, avoid: Sequence[str] = ()) -> list[str] | None:
    """Literal strings at least one of which every match of ``pattern`` contains.

    Walks Python's parse of the pattern: runs of literal characters in the
    top-level sequence, or a required group's or alternation's own literals.
    Of the possible sets it picks the one least found in ``avoid`` (sample
    ordinary lines, lower-cased), then the longest. None when there is none.
    """
    import re._constants as C
    import re._parser as P

    def walk(seq: Any, top: bool = False) -> Any:
        cands: list[list[str]] = []
        run: list[str] = []
        for op, av in seq:
            if op is C.LITERAL:
                run.append(chr(av))
                continue
            if run:
                cands.append(["".join(run)])
                run = []
            if op is C.SUBPATTERN:
                sub = walk(av[-1])
            elif op is C.BRANCH:
                alts: list[str] | None = []
                for branch in av[1]:
                    lits = walk(branch)
                    if not lits:
                        alts = None
                        break
                    alts += lits
                sub = alts or None
            elif op in (C.MAX_REPEAT, C.MIN_REPEAT) and av[0] >= 1:
                sub = walk(av[2])
            else:
                sub = None
            if sub:
                cands.append(sub)
        if run:
            cands.append(["".join(run)])
        if not cands:
            return None
        if top:
            return cands
        return max(cands, key=lambda alts: min(len(a) for a in alts))

    sets = walk(P.parse(pattern), top=True)
    if not sets:
        return None

    def cost(alts: list[str]) -> tuple[int, int]:
        low = [a.lower() for a in alts]
        hits = sum(1 for line in avoid if any(a in line for a in low))
        return hits, -min(len(a) for a in alts)

    return min(sets, key=cost)


def _coerce(v: str) -> Any:
    return int(v) if v.isdigit() and len(v) < 19 else v


def match_rank(code: Code, match: re.Match[str]) -> tuple[int, int, int]:
    """Which of several codes matching one line wins: a specific code over a
    catch-all (``*_OTHER``), then a cause over a wrapper (an ``engine_crash``
    line such as "Failed to initialize executor on rank 0: CUDA out of memory"
    quotes its cause, and the cause is the evidence), then the longest span."""
    return (
        not code.name.endswith("_OTHER"),
        code.family != "engine_crash",
        match.end() - match.start(),
    )


class Batch:
    """Results of one batch: ``matches`` maps a line index to (code, confidence,
    fields, method); lines absent from it carry no fault evidence."""

    __slots__ = ("n", "matches")

    def __init__(self, n: int) -> None:
        self.n = n
        self.matches: dict[int, tuple[Code, float, dict[str, Any], str]] = {}

    def set(self, idx: int, code: Code, conf: float, fields: dict[str, Any], method: str) -> None:
        self.matches[idx] = (code, conf, fields, method)


class _Fallback:
    """TF-IDF + a log-loss linear model over catalog examples and real lines vs
    ordinary lines."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        training: Sequence[tuple[str, str | None]] = (),
        seed: int = 0,
    ) -> None:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import SGDClassifier
        from sklearn.pipeline import FeatureUnion

        from ingest.corpus import TRACEBACK_BOILERPLATE, benign_lines

        texts: list[str] = []
        labels: list[str] = []
        for code in catalog:
            for ex in code.examples:
                texts.append(_strip_numbers(ex))
                labels.append(code.name)
        for text, code in training:  # real lines: (text, code) or (text, None) if ordinary
            if code is None or code in catalog:
                texts.append(_strip_numbers(text))
                labels.append(code or NONE_LABEL)
        benign = benign_lines(max(400, len(texts) // 2), seed=seed)
        benign += list(TRACEBACK_BOILERPLATE) * 3
        texts += [_strip_numbers(b) for b in benign]
        labels += [NONE_LABEL] * len(benign)
        features = FeatureUnion(
            [
                (
                    "words",
                    TfidfVectorizer(
                        token_pattern=r"[A-Za-z_][A-Za-z_]+",
                        ngram_range=(1, 2),
                        sublinear_tf=True,
                        min_df=1,
                    ),
                ),
                (
                    "chars",
                    TfidfVectorizer(
                        analyzer="char_wb",
                        ngram_range=(3, 5),
                        sublinear_tf=True,
                        min_df=2,
                        max_features=60000,
                    ),
                ),
            ]
        )
        # The family is learned (23 classes: SGD on the log loss, probabilities in
        # about a second; lbfgs over 186 code classes took ~30 s); the code within
        # the family is the nearest code centroid (cosine) of the training lines.
        fam_labels = [catalog[c].family if c != NONE_LABEL else NONE_LABEL for c in labels]
        clf = SGDClassifier(loss="log_loss", alpha=1e-5, max_iter=30, tol=None, random_state=seed)
        self.features = features
        x = features.fit_transform(texts)
        self.clf = clf.fit(x, fam_labels)
        self.families = list(clf.classes_)
        codes = sorted({c for c in labels if c != NONE_LABEL})
        self.codes = codes
        self.code_family = [catalog[c].family for c in codes]
        rows_of = {c: [i for i, lab in enumerate(labels) if lab == c] for c in codes}
        cent = np.vstack([np.asarray(x[rows_of[c]].mean(axis=0)) for c in codes])
        cent /= np.linalg.norm(cent, axis=1, keepdims=True) + 1e-12
        self.centroids = cent

    def predict(self, lines: Sequence[str]) -> tuple[list[str], np.ndarray]:
        """(code, confidence) per line: the most probable family and its probability;
        the code is that family's code nearest to the line (NONE_LABEL if ordinary)."""
        x = self.features.transform([_strip_numbers(t) for t in lines])
        proba = self.clf.predict_proba(x)
        best = proba.argmax(axis=1)
        sims = np.asarray(x @ self.centroids.T)
        out: list[str] = []
        for row, b in enumerate(best):
            fam = self.families[b]
            if fam == NONE_LABEL:
                out.append(NONE_LABEL)
                continue
            cand = [k for k, f in enumerate(self.code_family) if f == fam]
            out.append(self.codes[max(cand, key=lambda k: sims[row, k])])
        return out, proba[np.arange(len(lines)), best]


_NUM = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")
#: Log-level words: whether a line goes to the model at all is decided by
#: ERRORISH; its family must come from what the line says, not from its level
#: (with the level kept, any "ERROR <vague text>" line scored as engine_crash).
_LEVEL = re.compile(r"\b(?:ERROR|WARNING|WARN|INFO|DEBUG|CRITICAL|FATAL|TRACE)\b:?")


def _strip_numbers(text: str) -> str:
    """The text the model sees: numbers and hex collapsed, log levels dropped."""
    return _NUM.sub("0", _LEVEL.sub(" ", text))


class Normalizer:
    """Classify batches of lines against the catalog; build once, reuse."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        fallback: bool = True,
        threshold: float = 0.6,
        training: Sequence[tuple[str, str | None]] | None = None,
    ) -> None:
        """``training``: real (text, code-or-None) lines for the fallback, besides the
        catalog's examples; None means the shipped corpus (ingest/data/corpus)."""
        self.catalog = catalog
        self.threshold = threshold
        self._training = training
        self._use_fallback = fallback
        self._fallback: _Fallback | None = None
        self._rules: list[tuple[re.Pattern[str], Code]] = []
        self._by_literal: dict[str, list[int]] = {}
        self._no_literal: list[int] = []
        from ingest.corpus import benign_lines

        avoid = [line.lower() for line in benign_lines(3000, seed=99)]
        for code in catalog:
            for pat in code.patterns:
                i = len(self._rules)
                self._rules.append((re.compile(pat), code))
                lits = required_literals(pat, avoid=avoid)
                if not lits:
                    self._no_literal.append(i)
                for lit in lits or ():
                    self._by_literal.setdefault(lit.lower(), []).append(i)
        self._literals = sorted(self._by_literal)

    def retrained(self, training: Sequence[tuple[str, str | None]]) -> Normalizer:
        """A copy sharing the compiled patterns whose fallback learns from
        ``training`` instead (cross-validation folds, held-out scoring)."""
        other = copy.copy(self)
        other._training = list(training)
        other._fallback = None
        return other

    # -- batches -------------------------------------------------------------
    def classify_batch(self, lines: Sequence[str]) -> Batch:
        """Columnar results for a batch: only matched lines cost Python work."""
        n = len(lines)
        batch = Batch(n)
        if n == 0:
            return batch
        s = pl.Series("t", lines, dtype=pl.String)
        hit = s.str.contains_any(self._literals, ascii_case_insensitive=True).fill_null(False)
        hit = hit.to_numpy().copy()
        cand = np.flatnonzero(hit)
        if len(cand):
            found = s.gather(cand).str.extract_many(
                self._literals, ascii_case_insensitive=True, overlapping=True
            )
            for idx, lits in zip(cand.tolist(), found.to_list(), strict=True):
                text = lines[idx]
                rule_ids = {r for lit in lits for r in self._by_literal[lit.lower()]}
                best, best_key = None, (-1, -1, -1)
                for r in sorted(rule_ids.union(self._no_literal)):
                    rx, code = self._rules[r]
                    mt = rx.search(text)
                    if mt is not None and (key := match_rank(code, mt)) > best_key:
                        best, best_key = (mt, code), key
                if best is None:
                    hit[idx] = False
                    continue
                mt, code = best
                f = {k: _coerce(v) for k, v in mt.groupdict().items() if v}
                batch.set(idx, code, 1.0, self._generic_fields(text, f), "pattern")
        if self._use_fallback:
            errorish = s.str.contains(ERRORISH).fill_null(False).to_numpy() & ~hit
            errorish &= ~s.str.contains(STRUCTURE).fill_null(False).to_numpy()
            rest = np.flatnonzero(errorish).tolist()
            if rest:
                labels, probs = self._model().predict([lines[i] for i in rest])
                for idx, lab, p in zip(rest, labels, probs, strict=True):
                    if lab != NONE_LABEL and p >= self.threshold:
                        f = self._generic_fields(lines[idx], {})
                        batch.set(idx, self.catalog[lab], float(p), f, "model")
        return batch

    def classify(self, lines: Sequence[str], *, first_line: int = 1) -> list[LineResult]:
        """One result per input line, in order (``line`` counts from first_line)."""
        b = self.classify_batch(lines)
        empty = LineResult(0, None, None, None, None, None)
        out = []
        for i in range(len(lines)):
            m = b.matches.get(i)
            if m is None:
                out.append(dataclasses.replace(empty, line=first_line + i, fields={}))
                continue
            code, conf, fields, method = m
            out.append(
                LineResult(
                    first_line + i,
                    code.name,
                    code.family,
                    code.layer,
                    str(code.severity),
                    round(conf, 3),
                    fields,
                    method,
                )
            )
        return out

    def classify_line(self, line: str) -> LineResult:
        return self.classify([line])[0]

    # -- internals -----------------------------------------------------------
    def _model(self) -> _Fallback:
        if self._fallback is None:
            from ingest.corpus import training_corpus

            training = self._training if self._training is not None else training_corpus()
            self._fallback = _Fallback(self.catalog, training=training)
        return self._fallback

    @staticmethod
    def _generic_fields(text: str, fields: dict[str, Any]) -> dict[str, Any]:
        for name, rx in _GENERIC_FIELDS:
            if name not in fields and (m := rx.search(text)):
                fields[name] = _coerce(m["v"])
        return fields


@cache
def default_normalizer() -> Normalizer:
    return Normalizer(default_catalog())
