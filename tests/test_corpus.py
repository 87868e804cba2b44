"""Quality gates on real text (the corpus under ingest/data/corpus and the real
crash logs under tests/fixtures/real): they fail if the classifier or the
postmortem ranking gets worse."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.corpus import real_corpus
from rca.bench.corpus import evaluate_corpus

CRASHLOGS = Path(__file__).with_name("fixtures") / "real" / "crashlogs"


@pytest.fixture(scope="module")
def scores() -> dict:
    return evaluate_corpus(crashlogs=CRASHLOGS, folds=3)


def test_corpus_is_real_and_broad() -> None:
    errors, benign = real_corpus()
    assert len(errors) >= 150 and len({e["project"] for e in errors}) >= 5
    assert len({e["family"] for e in errors}) >= 16
    assert len(benign) >= 300


def test_ordinary_lines_are_not_flagged(scores) -> None:
    assert scores["benign_flagged_share"] <= 0.03, scores["flagged_benign"]


def test_answers_are_rarely_wrong(scores) -> None:
    # a confident wrong family is worse than "unknown"
    assert scores["precision_when_answered"] >= 0.9, scores["misses"]


def test_family_accuracy_does_not_regress(scores) -> None:
    assert scores["family_accuracy"] >= 0.5


def test_postmortems_name_the_deepest_cause(scores) -> None:
    assert scores["crashlogs"] >= 12
    assert scores["crashlogs_top1"] >= 10, scores["crashlog_answers"]


HOLDOUT = Path(__file__).with_name("fixtures") / "real" / "holdout"


def test_independent_holdout_scored_as_shipped() -> None:
    """Real lines gathered separately from other threads, never trained on."""
    res = evaluate_corpus(HOLDOUT, None, folds=0)
    assert res["error_lines"] >= 150 and res["projects"] >= 5
    assert res["benign_flagged_share"] <= 0.03, res["flagged_benign"]
    assert res["precision_when_answered"] >= 0.9, res["misses"]
    assert res["family_accuracy"] >= 0.55
