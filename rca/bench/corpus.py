"""`rca bench corpus DIR`: how well text becomes evidence, on a labelled real corpus.

DIR holds ``error_lines.jsonl`` (real fault lines with the family, and code,
an engineer gives them), ``benign_lines.txt`` (real ordinary lines) and
``crashlogs/`` with ``expected.json`` (the deepest cause of each real crash
log). Prints family accuracy on fault lines (and how many stayed unknown),
the share of ordinary lines flagged, and how many crash logs `rca diagnose`
answers with the expected cause first.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from graph.errors import InputError
from ingest.classify import Normalizer, default_normalizer

__all__ = ["evaluate_corpus"]


def evaluate_corpus(folder: str | Path, *, normalizer: Normalizer | None = None) -> dict[str, Any]:
    root = Path(folder)
    if not (root / "error_lines.jsonl").is_file():
        raise InputError(f"{root}: no error_lines.jsonl (see `rca bench corpus --help`)")
    norm = normalizer or default_normalizer()
    rows = [
        json.loads(x) for x in (root / "error_lines.jsonl").read_text().splitlines() if x.strip()
    ]
    results = norm.classify([r["text"] for r in rows])
    right = unknown = 0
    per_family: dict[str, Counter] = defaultdict(Counter)
    misses = []
    for r, res in zip(rows, results, strict=True):
        fam = r["family"]
        if res.family == fam:
            right += 1
            per_family[fam]["right"] += 1
        elif res.family is None:
            unknown += 1
            per_family[fam]["unknown"] += 1
            misses.append({"text": r["text"][:160], "want": fam, "got": None})
        else:
            per_family[fam]["wrong"] += 1
            misses.append(
                {
                    "text": r["text"][:160],
                    "want": fam,
                    "got": res.family,
                    "code": res.code,
                    "method": res.method,
                }
            )
    benign = [x for x in (root / "benign_lines.txt").read_text().splitlines() if x.strip()]
    flagged = [
        (x, res.code) for x, res in zip(benign, norm.classify(benign), strict=True) if res.code
    ]
    out: dict[str, Any] = {
        "error_lines": len(rows),
        "projects": len({r["project"] for r in rows}),
        "family_accuracy": round(right / len(rows), 4) if rows else None,
        "unknown": unknown,
        "wrong": len(rows) - right - unknown,
        "benign_lines": len(benign),
        "benign_flagged": len(flagged),
        "benign_flagged_share": round(len(flagged) / len(benign), 4) if benign else None,
        "per_family": {k: dict(v) for k, v in sorted(per_family.items())},
        "misses": misses,
        "flagged_benign": [{"text": x[:160], "code": c} for x, c in flagged],
    }
    crash = root / "crashlogs" / "expected.json"
    if crash.is_file():
        from rca.diagnose import diagnose_paths

        expected = json.loads(crash.read_text())
        answers = {}
        for name, want in sorted(expected.items()):
            diag, _ = diagnose_paths([root / "crashlogs" / name])
            ranked = [c.code for c in diag.causes]
            answers[name] = {
                "want": want["code"],
                "got": ranked[:3],
                "top1": bool(ranked) and ranked[0] == want["code"],
                "family_top1": bool(diag.causes) and diag.causes[0].family == want["family"],
            }
        out["crashlogs"] = len(answers)
        out["crashlogs_top1"] = sum(a["top1"] for a in answers.values())
        out["crashlogs_family_top1"] = sum(a["family_top1"] for a in answers.values())
        out["crashlog_answers"] = answers
    return out
