"""Quality gates on real text: they fail if the classifier or the postmortem
ranking gets worse.

* ``ingest/data/corpus``: the training corpus, scored by cross-validation;
* ``tests/fixtures/real/dev``: the development set (the first held-out set,
  looked at for error analysis, never trained on), scored as shipped;
* ``tests/fixtures/real/crashlogs``: real multi-line crash logs.

The thresholds sit a few points under the measured figures (see CHANGELOG),
so a real regression fails and run-to-run noise does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from graph.catalog import default_catalog
from ingest.corpus import real_corpus
from rca.bench.corpus import evaluate_corpus

REAL = Path(__file__).with_name("fixtures") / "real"
CRASHLOGS = REAL / "crashlogs"
DEV = REAL / "dev"


@pytest.fixture(scope="module")
def scores() -> dict:
    return evaluate_corpus(crashlogs=CRASHLOGS, folds=3)


@pytest.fixture(scope="module")
def dev_scores() -> dict:
    return evaluate_corpus(DEV, None, folds=0)


def test_corpus_is_real_and_broad() -> None:
    errors, benign = real_corpus()
    assert len(errors) >= 290 and len({e["project"] for e in errors}) >= 5
    assert len({e["family"] for e in errors}) >= 20
    assert len(benign) >= 450


def test_training_corpus_never_holds_a_dev_line() -> None:
    """The dev set is for error analysis only: none of its lines may train the
    fallback (the corpus) or be a catalog example added for it."""
    errors, benign = real_corpus()
    dev_errors, dev_benign = real_corpus(DEV)
    dev = {e["text"] for e in dev_errors} | set(dev_benign)
    assert not dev & ({e["text"] for e in errors} | set(benign))
    # Lines equal to catalog examples that predate the dev set are counted apart
    # by the bench (``family_accuracy_unseen``); no more may appear.
    examples = {ex for code in default_catalog() for ex in code.examples}
    assert len(dev & examples) <= 27


def test_ordinary_lines_are_not_flagged(scores, dev_scores) -> None:
    assert scores["benign_flagged_share"] <= 0.03, scores["flagged_benign"]
    assert dev_scores["benign_flagged_share"] <= 0.03, dev_scores["flagged_benign"]


def test_answers_are_rarely_wrong(scores, dev_scores) -> None:
    # a confident wrong family is worse than "unknown"
    assert scores["precision_when_answered"] >= 0.97, scores["misses"]
    assert dev_scores["precision_when_answered"] >= 0.95, dev_scores["misses"]


def test_family_accuracy_does_not_regress(scores) -> None:
    # measured 0.95 (5-fold); many corpus lines are also catalog examples, so
    # this mostly guards the patterns and the model against regressions
    assert scores["family_accuracy"] >= 0.93, scores["misses"]


def test_dev_set_scored_as_shipped(dev_scores) -> None:
    """Real lines from other threads, never trained on (measured 0.873 overall,
    0.857 on the 154 lines that are not catalog examples; 0.757 before this
    round). Looked at for error analysis, so optimistic for unseen text."""
    assert dev_scores["error_lines"] >= 150 and dev_scores["projects"] >= 5
    assert dev_scores["family_accuracy"] >= 0.85, dev_scores["misses"]
    assert dev_scores["family_accuracy_unseen"] >= 0.83, dev_scores["misses"]


def test_postmortems_name_the_deepest_cause(scores) -> None:
    assert scores["crashlogs"] >= 13
    assert scores["crashlogs_top1"] >= 12, scores["crashlog_answers"]


def test_wrapper_line_yields_the_cause_it_quotes() -> None:
    """A wrapper (engine_crash) line that quotes its cause is evidence of the cause."""
    from ingest.classify import Normalizer

    norm = Normalizer(default_catalog(), fallback=False)
    line = (
        "[05/27/2025-21:12:36] [TRT-LLM] [E] Failed to initialize executor on rank 3: "
        "[TensorRT-LLM][ERROR] CUDA runtime error in cudaMemsetAsync(fc1_act_sf_flat, 0x0, "
        "getOffsetFlatSFArray(num_experts_per_node, num_rows, cols), stream): an illegal memory "
        "access was encountered (/builds/ftp/moe_kernels.cu:1282)"
    )
    assert norm.classify_line(line).family == "illegal_memory_access"
    assert norm.classify_line(line.split(": [TensorRT-LLM]")[0]).code == (
        "TRTLLM_EXECUTOR_INIT_FAILED"
    )


# --- New held-out set ------------------------------------------------------
# tests/fixtures/real/holdout2 was gathered while the classifier was being
# changed, by someone who never ran it, and scored once afterwards (0.650 family
# accuracy on 226 fault lines from 67 projects, 92.5% precision when it
# answers, 0/406 ordinary lines flagged). Its misses are not used to tune: this
# gate only keeps the figure from falling.
HOLDOUT2 = REAL / "holdout2"


def test_independent_holdout2_scored_as_shipped() -> None:
    s = evaluate_corpus(HOLDOUT2, None, folds=0)
    assert s["error_lines"] >= 150 and s["projects"] >= 5
    assert s["family_accuracy"] >= 0.62
    assert s["precision_when_answered"] >= 0.90
    assert s["benign_flagged_share"] <= 0.03
