"""`rca bench corpus`: how well text becomes evidence, on a labelled real corpus.

Three kinds of real text, and how each is scored (the output's ``set`` says
which one a figure is about):

* the training corpus (``ingest/data/corpus``: real fault lines labelled with
  the family and code an engineer gives them, and real ordinary lines) also
  trains the learned fallback, so it is scored with k-fold cross-validation:
  each fold is classified by a fallback trained without it;
* the development set (``tests/fixtures/real/dev``, the first held-out set,
  now used for error analysis) and any later held-out set are scored with
  ``folds=0`` by the shipped classifier, which never trains on them. Lines
  identical to a catalog example are counted apart
  (``family_accuracy_unseen``): the patterns were checked against them, so
  they are not unseen text;
* crash logs (a folder with ``expected.json``) are diagnosed with a fallback
  trained on the catalog's examples only.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from graph.catalog import default_catalog
from graph.errors import InputError
from ingest.classify import Normalizer
from ingest.corpus import CORPUS_DIR, real_corpus

__all__ = ["evaluate_corpus", "DEFAULT_CRASHLOGS", "DEFAULT_DEV"]

DEFAULT_CRASHLOGS = Path("tests/fixtures/real/crashlogs")
#: The development set: real lines for error analysis, never trained on.
DEFAULT_DEV = Path("tests/fixtures/real/dev")


def evaluate_corpus(
    corpus: str | Path = CORPUS_DIR,
    crashlogs: str | Path | None = DEFAULT_CRASHLOGS,
    *,
    folds: int = 5,
    seed: int = 0,
    threshold: float | None = None,
) -> dict[str, Any]:
    """Score a labelled corpus. With ``folds`` >= 2 the fallback is trained on the
    other folds of this corpus (cross-validation); with ``folds`` = 0 the corpus
    is a held-out set scored by the shipped classifier (trained on the shipped
    corpus), which must not contain any of its lines."""
    try:
        errors, benign = real_corpus(corpus)
    except FileNotFoundError as exc:
        raise InputError(f"{corpus}: not a corpus folder ({exc.filename} missing)") from exc
    catalog = default_catalog()
    rng = random.Random(seed)
    e_fold = [i % max(folds, 1) for i in range(len(errors))]
    b_fold = [i % max(folds, 1) for i in range(len(benign))]
    rng.shuffle(e_fold)
    rng.shuffle(b_fold)
    got: list[Any] = [None] * len(errors)
    flagged: list[tuple[str, str]] = []
    shipped = Normalizer(catalog, threshold=threshold)
    if folds == 0:
        norm = shipped
        got = norm.classify([e["text"] for e in errors])
        flagged = [
            (b, r.code) for b, r in zip(benign, norm.classify(benign), strict=True) if r.code
        ]
    for k in range(folds if folds >= 2 else 0):
        train = [
            (e["text"], e["code"])
            for e, f in zip(errors, e_fold, strict=True)
            if f != k and e.get("code")
        ]
        train += [(b, None) for b, f in zip(benign, b_fold, strict=True) if f != k]
        norm = shipped.retrained(train)
        idx = [i for i, f in enumerate(e_fold) if f == k]
        for i, res in zip(idx, norm.classify([errors[i]["text"] for i in idx]), strict=True):
            got[i] = res
        held = [b for b, f in zip(benign, b_fold, strict=True) if f == k]
        flagged += [(b, r.code) for b, r in zip(held, norm.classify(held), strict=True) if r.code]
    right = unknown = by_pattern = by_model = 0
    examples = {ex for code in catalog for ex in code.examples}
    seen = [e["text"] in examples for e in errors]
    right_unseen = 0
    per_family: dict[str, Counter] = defaultdict(Counter)
    misses = []
    for e, res, is_example in zip(errors, got, seen, strict=True):
        fam = e["family"]
        if res.family == fam:
            right += 1
            right_unseen += not is_example
            per_family[fam]["right"] += 1
            by_pattern += res.method == "pattern"
            by_model += res.method == "model"
        elif res.family is None:
            unknown += 1
            per_family[fam]["unknown"] += 1
            misses.append({"text": e["text"][:160], "want": fam, "got": None})
        else:
            per_family[fam]["wrong"] += 1
            misses.append(
                {
                    "text": e["text"][:160],
                    "want": fam,
                    "got": res.family,
                    "code": res.code,
                    "method": res.method,
                }
            )
    n = len(errors)
    n_unseen = n - sum(seen)
    out: dict[str, Any] = {
        "set": (
            f"{corpus}: training corpus, {folds}-fold cross-validation"
            if folds >= 2
            else f"{corpus}: not trained on, scored by the shipped classifier"
        ),
        "error_lines": n,
        "projects": len({e["project"] for e in errors}),
        "folds": folds,
        "family_accuracy": round(right / n, 4) if n else None,
        "catalog_example_lines": n - n_unseen,
        "family_accuracy_unseen": round(right_unseen / n_unseen, 4) if n_unseen else None,
        "right_by_pattern": by_pattern,
        "right_by_model": by_model,
        "unknown": unknown,
        "wrong": n - right - unknown,
        "precision_when_answered": round(right / (n - unknown), 4) if n > unknown else None,
        "benign_lines": len(benign),
        "benign_flagged": len(flagged),
        "benign_flagged_share": round(len(flagged) / len(benign), 4) if benign else None,
        "per_family": {k: dict(v) for k, v in sorted(per_family.items())},
        "by_round": _by_round(errors, got),
        "misses": misses,
        "flagged_benign": [{"text": x[:160], "code": c} for x, c in flagged],
    }
    crash = Path(crashlogs) / "expected.json" if crashlogs else None
    if crash is not None and crash.is_file():
        from rca.diagnose import diagnose_paths

        unseen = shipped.retrained([])
        expected = json.loads(crash.read_text())
        answers = {}
        for name, want in sorted(expected.items()):
            diag, _ = diagnose_paths([crash.parent / name], normalizer=unseen)
            ranked = [c.code for c in diag.causes]
            answers[name] = {
                "want": want["code"],
                "got": ranked[:3],
                "top1": bool(ranked) and ranked[0] == want["code"],
                "family_top1": bool(diag.causes) and diag.causes[0].family == want["family"],
            }
        out["crashlogs_set"] = (
            f"{Path(crashlogs)}: diagnosed, fallback trained on catalog examples only"
        )
        out["crashlogs"] = len(answers)
        out["crashlogs_top1"] = sum(a["top1"] for a in answers.values())
        out["crashlogs_family_top1"] = sum(a["family_top1"] for a in answers.values())
        out["crashlog_answers"] = answers
    return out


def _by_round(errors: list[dict[str, Any]], got: list[Any]) -> dict[str, dict[str, Any]]:
    """Family accuracy and precision per gathering round (a line's optional
    ``round`` field; lines without one are from the first rounds): a gate on the
    earlier lines still catches regressions when a later round adds harder text."""
    groups: dict[str, list[tuple[str, str | None]]] = defaultdict(list)
    for e, res in zip(errors, got, strict=True):
        groups[str(e.get("round", "1-2"))].append((e["family"], res.family))
    out = {}
    for name, pairs in sorted(groups.items()):
        n = len(pairs)
        right = sum(want == fam for want, fam in pairs)
        answered = sum(fam is not None for _, fam in pairs)
        out[name] = {
            "error_lines": n,
            "family_accuracy": round(right / n, 4),
            "precision_when_answered": round(right / answered, 4) if answered else None,
        }
    return out
