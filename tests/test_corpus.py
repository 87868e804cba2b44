"""Quality gates on real text: they fail if the classifier or the postmortem
ranking gets worse.

* ``ingest/data/corpus``: the training corpus, made of sets (the lines gathered
  for it and the former held-out sets ``dev``, ``holdout2``, ``holdout3``,
  trained on since round 4, ``holdout4``, ``holdout5``, since round 6,
  ``holdout6`` since round 7), scored by k-fold cross-validation and by
  leave-one-set-out (train without a set, score it: the estimate for a new set);
* ``tests/fixtures/real/crashlogs``: real multi-line crash logs;
* ``tests/fixtures/real/<set>``: an independent set not yet trained on, scored
  once as shipped and gated below (``HOLDOUT_GATES``).

The thresholds sit a few points under the measured figures (see CHANGELOG),
so a real regression fails and run-to-run noise does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from graph.catalog import FAMILIES, default_catalog
from ingest.corpus import BASE_SET, CORPUS_DIR, corpus_sets, real_corpus, training_corpus
from rca.bench.corpus import evaluate_corpus

REAL = Path(__file__).with_name("fixtures") / "real"
CRASHLOGS = REAL / "crashlogs"
#: Sets moved into the training corpus once scored (round 4; holdout4 and
#: holdout5 in round 6; holdout6 in round 7; holdout7 in round 9; holdout8 in
#: round 10; holdout9 in round 11; holdout10 in round 12; holdout11 in round
#: 13; holdout12 in round 14; holdout13 in round 15; holdout14 in round 16;
#: holdout15 in round 17; holdout16 in round 18; holdout17 in round 19;
#: holdout18 in round 20; holdout19 in round 21; holdout20 in round 22;
#: holdout21 in round 23; holdout22 in round 24; holdout23 in round 25;
#: holdout24 in round 26).
FORMER_HOLDOUTS = (
    "dev",
    "holdout2",
    "holdout3",
    "holdout4",
    "holdout5",
    "holdout6",
    "holdout7",
    "holdout8",
    "holdout9",
    "holdout10",
    "holdout11",
    "holdout12",
    "holdout13",
    "holdout14",
    "holdout15",
    "holdout16",
    "holdout17",
    "holdout18",
    "holdout19",
    "holdout20",
    "holdout21",
    "holdout22",
    "holdout23",
    "holdout24",
)
#: Gates, a few points under what round 4 measured (3-fold: 0.896 family
#: accuracy, precision 0.964, 1-3/1753 ordinary lines flagged; leave one set
#: out: dev 0.972, holdout2 0.876-0.889, holdout3 0.848-0.852, pooled
#: precision 0.953, 1/1077 flagged: a line or two move with each catalog
#: change). Before round 4's patterns, leave one set out measured
#: 0.884 / 0.711 / 0.621 (pooled 0.726). Round 5 (patterns from holdout4's
#: misses): 3-fold 0.899, precision 0.968, 2/1753 flagged; leave one set out
#: dev 0.978, holdout2 0.893, holdout3 0.852, pooled 0.901 at precision 0.953.
#: Round 6 (holdout4 and holdout5 moved in; 1,543 fault lines, 2,390 ordinary):
#: before its patterns, leave one set out measured holdout5 0.713 (never
#: studied: the honest figure), holdout4 0.908, holdout2 0.880, holdout3 0.856,
#: dev 0.978, pooled 0.872 at precision 0.967; after (optimistic for holdout5,
#: whose misses were studied): 3-fold 0.907, precision 0.980, 3/2390 flagged;
#: leave one set out dev 0.978, holdout2 0.880, holdout3 0.860, holdout4 0.933,
#: holdout5 0.919, pooled 0.910 at precision 0.974, 2/1715 flagged.
#: Round 7 (holdout6 moved in, its misses studied; 1,714 fault lines, 2,685
#: ordinary): 5-fold 0.914 at precision 0.984, 2/2685 flagged; leave one set
#: out dev 0.972, holdout2 0.889, holdout3 0.889, holdout4 0.937, holdout5
#: 0.913, holdout6 0.930 (optimistic: studied), pooled 0.920 at precision
#: 0.981, 4/2,010 flagged.
#: Round 8 (the fallback: a fault-vs-ordinary gate, then the family; catalog
#: summaries as family training texts; no pattern or corpus change), before ->
#: after: 5-fold 0.914 -> 0.917 (precision 0.984 -> 0.983, 2 -> 3/2685
#: flagged); leave one set out dev 0.972 -> 0.972, holdout2 0.889 -> 0.907,
#: holdout3 0.889 -> 0.885, holdout4 0.937 -> 0.941, holdout5 0.913 -> 0.925,
#: holdout6 0.930 -> 0.936, pooled 0.920 -> 0.925 at precision 0.981 -> 0.981,
#: 4 -> 3/2,010 flagged.
#: Round 9 (holdout7 moved in, patterns from its misses; 1,802 fault lines,
#: 2,876 ordinary): 5-fold 0.919 at precision 0.985, 4/2,876 flagged; leave one
#: set out dev 0.972, holdout2 0.911, holdout3 0.885, holdout4 0.941, holdout5
#: 0.919, holdout6 0.936, holdout7 0.921 (optimistic: studied), pooled 0.925
#: at precision 0.979.
#: Round 10 (holdout8 moved in, patterns from its misses, the family lexicon,
#: threshold 0.55; 1,987 fault lines, 3,174 ordinary): 5-fold 0.931 at
#: precision 0.979, 6/3,174 flagged; leave one set out dev 0.967, holdout2
#: 0.911, holdout3 0.893, holdout4 0.945, holdout5 0.938, holdout6 0.953,
#: holdout7 0.932, holdout8 0.914 (optimistic: studied), pooled 0.930 at
#: precision 0.977.
#: Round 11 (holdout9 moved in, patterns from its misses; 2,184 fault lines,
#: 3,524 ordinary): 5-fold 0.922 at precision 0.978, 5/3,524 flagged; leave
#: one set out holdout8 0.908, holdout9 0.863 (optimistic: studied), pooled
#: 0.920 at precision 0.975.
#: Round 12 (holdout10 moved in, patterns from its misses; 2,385 fault lines,
#: 3,835 ordinary): 5-fold 0.924 at precision 0.976, 5/3,835 flagged; leave
#: one set out holdout9 0.863, holdout10 0.915 (optimistic: studied), pooled
#: 0.923 at precision 0.977.
#: Round 13 (holdout11 moved in, patterns from its misses, the written lines,
#: a wider ERRORISH; 2,545 fault lines, 4,176 ordinary): 5-fold 0.925 at
#: precision 0.977, 10/4,176 flagged; leave one set out holdout10 0.935,
#: holdout11 0.881 (optimistic: studied), pooled 0.923 at precision 0.977.
#: Round 14 (holdout12 moved in, patterns from its misses, a third batch of
#: written lines, more ERRORISH words; 2,749 fault lines, 4,519 ordinary):
#: 5-fold 0.928 at precision 0.979, 14/4,519 flagged; leave one set out
#: holdout11 0.888, holdout12 0.858 (optimistic: studied), pooled 0.919 at
#: precision 0.975.
#: Round 15 (holdout13 moved in, patterns from its misses, more ERRORISH words;
#: 2,935 fault lines, 4,853 ordinary): 5-fold 0.927 at precision 0.979,
#: 14/4,853 flagged; leave one set out holdout12 0.858, holdout13 0.968
#: (optimistic: studied), pooled 0.924 at precision 0.975.
#: Round 16 (holdout14 moved in, patterns from its misses, more ERRORISH words;
#: 3,150 fault lines, 5,191 ordinary): 5-fold 0.928 at precision 0.977,
#: 14/5,191 flagged; leave one set out holdout13 0.957, holdout14 0.935
#: (optimistic: studied), pooled 0.924 at precision 0.976.
#: Round 17 (holdout15 moved in, patterns from its misses, more ERRORISH words;
#: 3,341 fault lines, 5,529 ordinary): 5-fold 0.927 at precision 0.975,
#: 17/5,529 flagged; leave one set out holdout14 0.930, holdout15 0.911
#: (optimistic: studied), pooled 0.923 at precision 0.974.
#: Round 18 (holdout16 moved in, patterns from its misses, more ERRORISH words;
#: 3,543 fault lines, 5,879 ordinary; identifiers split into words, word_view):
#: 5-fold 0.928 at precision 0.976, 20/5,879 flagged; leave one set out
#: holdout15 0.895, holdout16 0.946 (optimistic: studied), pooled 0.925 at
#: precision 0.975.
#: Round 19 (holdout17 moved in, patterns from its misses; 3,672 fault lines,
#: 6,172 ordinary): 5-fold 0.928 at precision 0.979, 19/6,172 flagged; leave
#: one set out holdout16 0.941, holdout17 0.907 (optimistic: studied), pooled
#: 0.923 at precision 0.974.
#: Round 20 (holdout18 moved in, patterns from its misses; 3,842 fault lines,
#: 6,485 ordinary): 5-fold 0.932 at precision 0.978, 21/6,485 flagged; leave
#: one set out holdout17 0.907, holdout18 0.994 (optimistic: studied), pooled
#: 0.927 at precision 0.976.
#: Round 21 (holdout19 moved in, patterns from its misses, a new code
#: NON_FINITE_LOSS; 4,000 fault lines, 6,786 ordinary): 5-fold 0.932 at
#: precision 0.980, 20/6,786 flagged; leave one set out holdout18 0.982,
#: holdout19 1.000 (optimistic: studied), pooled 0.930 at precision 0.978.
#: Round 22 (holdout20 moved in, patterns from its misses, a new code
#: HOST_THREAD_LIMIT; 4,173 fault lines, 7,095 ordinary): 5-fold 0.934 at
#: precision 0.979, 21/7,095 flagged; leave one set out holdout19 1.000,
#: holdout20 0.919 (optimistic: studied), pooled 0.930 at precision 0.978.
#: Round 23 (holdout21 moved in, 17 patterns from its misses; 4,334 fault
#: lines, 7,409 ordinary): 5-fold 0.931 at precision 0.977, 20/7,409 flagged;
#: leave one set out holdout20 0.919, holdout21 0.901 (optimistic: studied),
#: pooled 0.929 at precision 0.978.
#: Round 24 (holdout22 moved in, 17 patterns from its misses, a new code
#: DNS_RESOLUTION_FAILED; 4,509 fault lines, 7,730 ordinary): 5-fold 0.931 at
#: precision 0.978, 23/7,730 flagged; leave one set out holdout21 0.901,
#: holdout22 0.931 (optimistic: studied), pooled 0.930 at precision 0.977.
#: Round 25 (holdout23 moved in, 20 patterns from its misses; 4,661 fault
#: lines, 8,029 ordinary): 5-fold 0.931 at precision 0.978, 19/8,029 flagged;
#: leave one set out holdout22 0.937, holdout23 0.941 (optimistic: studied),
#: pooled 0.930 at precision 0.977.
#: Round 26 (holdout24 moved in, 14 patterns from its misses; 4,816 fault
#: lines, 8,357 ordinary): 5-fold 0.931 at precision 0.979, 24/8,357 flagged;
#: leave one set out holdout23 0.941, holdout24 0.890 (optimistic: studied),
#: pooled 0.928 at precision 0.977.
KFOLD_MIN = 0.88
#: Fault lines a former held-out set has at least: the issue's 150, except
#: holdout7, gathered when unused public text ran out, and holdout17, gathered
#: when the session's search budget ran out.
SET_MIN_LINES = {"holdout7": 85, "holdout17": 120}
LOSO_MIN = {
    "dev": 0.94,
    "holdout2": 0.88,
    "holdout3": 0.86,
    "holdout4": 0.91,
    "holdout5": 0.89,
    "holdout6": 0.91,
    "holdout7": 0.89,
    "holdout8": 0.88,
    "holdout9": 0.83,
    "holdout10": 0.88,
    "holdout11": 0.85,
    "holdout12": 0.83,
    "holdout13": 0.93,
    "holdout14": 0.90,
    "holdout15": 0.88,
    "holdout16": 0.92,
    "holdout17": 0.88,
    "holdout18": 0.96,
    "holdout19": 0.97,
    "holdout20": 0.89,
    "holdout21": 0.87,
    "holdout22": 0.90,
    "holdout23": 0.91,
    "holdout24": 0.87,
}


@pytest.fixture(scope="module")
def scores() -> dict:
    """3-fold cross-validation, leave-one-set-out and the crash logs, in one call."""
    return evaluate_corpus(crashlogs=CRASHLOGS, folds=3)


def test_corpus_is_real_and_broad() -> None:
    errors, benign = real_corpus()
    assert len(errors) >= 1540 and len({e["project"] for e in errors}) >= 180
    assert len({e["family"] for e in errors}) == len(FAMILIES)
    assert len(benign) >= 2380
    sets = corpus_sets()
    assert {BASE_SET, *FORMER_HOLDOUTS} <= set(sets)  # a new set joins once scored
    for name in FORMER_HOLDOUTS:  # each set gathered apart, with its own sources
        errs, ben = sets[name]
        assert len(errs) >= SET_MIN_LINES.get(name, 150) and len(ben) >= 190, name
        assert (CORPUS_DIR / f"SOURCES.{name}.md").is_file()


def test_corpus_lines_are_labelled_consistently() -> None:
    """Every fault line has a family, and its code (when one fits) is a catalog
    code of that family; no line appears twice, in or across sets."""
    catalog = default_catalog()
    errors, benign = real_corpus()
    for e in errors:
        assert e["family"] in FAMILIES, e
        assert e["code"] is None or catalog[e["code"]].family == e["family"], e
    texts = [e["text"].strip() for e in errors] + [b.strip() for b in benign]
    assert len(texts) == len(set(texts))


def test_the_fallback_trains_on_every_corpus_file() -> None:
    """Every set's fault lines (also those no code fits: their family is
    learned) and every ordinary-lines file are training data, so each is part
    of the cached model's key."""
    training = training_corpus()
    errors, benign = real_corpus()
    assert len(training) == len(errors) + len(benign)
    labels = {t: lab for t, lab in training}
    for name, (errs, ben) in corpus_sets().items():
        assert all(labels[e["text"]] == (e["code"] or e["family"]) for e in errs), name
        assert all(labels[b] is None for b in ben), name


def test_ordinary_lines_are_not_flagged(scores) -> None:
    assert scores["benign_flagged_share"] <= 0.03, scores["flagged_benign"]
    for name, s in scores["leave_one_set_out"].items():
        assert s["benign_flagged_share"] <= 0.03, (name, scores["leave_one_set_out_flagged"])


def test_answers_are_rarely_wrong(scores) -> None:
    # a confident wrong family is worse than "unknown"
    assert scores["precision_when_answered"] >= 0.95, scores["misses"]
    loso = scores["leave_one_set_out"]["pooled"]
    assert loso["precision_when_answered"] >= 0.93, scores["leave_one_set_out_misses"]


def test_family_accuracy_does_not_regress(scores) -> None:
    """3-fold cross-validation over all 1,714 lines (measured: see KFOLD_MIN)."""
    assert scores["family_accuracy"] >= KFOLD_MIN, scores["misses"]
    rounds = scores["by_round"]
    # the first rounds' lines, mostly catalog-covered (measured 0.954), and the
    # third round's harder text from projects they never saw (0.736)
    assert rounds["1-2"]["family_accuracy"] >= 0.92, scores["misses"]
    assert rounds["3"]["family_accuracy"] >= 0.70, scores["misses"]


def test_leave_one_set_out(scores) -> None:
    """Train without one former held-out set, score it: the honest estimate of
    accuracy on a set gathered apart (optimistic still: round 4's patterns were
    written after reading these sets' misses). Measured: see LOSO_MIN."""
    loso = scores["leave_one_set_out"]
    for name, floor in LOSO_MIN.items():
        assert loso[name]["error_lines"] >= SET_MIN_LINES.get(name, 150), name
        assert loso[name]["family_accuracy"] >= floor, (name, scores["leave_one_set_out_misses"])


def test_postmortems_name_the_deepest_cause(scores) -> None:
    assert scores["crashlogs"] >= 13
    assert scores["crashlogs_top1"] >= 13, scores["crashlog_answers"]


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


# --- Independent sets not yet trained on ------------------------------------
# Independent sets, gathered by someone who never ran the classifier, each
# scored ONCE as shipped with
#   .venv/bin/rca bench corpus --corpus tests/fixtures/real/<set> --folds 0
# and gated a little under that figure so it cannot fall; once studied, a set
# moves into the training corpus (FORMER_HOLDOUTS) and leaves this dict.
#
# Former entries: holdout4 (round 4: family 0.693, precision 0.965, 1/392
# ordinary lines flagged; after round 5, which studied its misses: 0.899-0.908,
# 0.986-0.991, 1/392) and holdout5 (160 fault lines, 38 projects; round 4:
# 0.663, precision 0.964, 1/246 flagged; round 5, which never saw it: 0.706,
# 0.966, 2/246); both moved into the corpus in round 6.
#
# holdout6 (171 fault lines, 68 projects, 295 ordinary lines; three gatherers,
# none ran the classifier): round 5's classifier: family 0.725, precision
# 0.954, 2/295 flagged; round 6 (which never saw it): 0.737, 0.947, 2/295;
# round 7, after studying its misses (optimistic): 0.930, 0.994, 2/295. Moved
# into the corpus in round 7.
#
# holdout7 (88 fault lines, 31 projects, 191 ordinary lines; two gatherers,
# none ran the classifier; short of 150: unused public text ran out): round
# 6's classifier: family 0.705, precision 0.954, 0/191 flagged; round 7 (which
# never saw it): 0.705, 0.954, 0/191 (two lines gained, two lost); round 8's
# two-stage fallback (which never saw it): 0.705, 0.969, 0/191; round 9,
# after studying its misses (optimistic): 0.921, 0.988, 0/191. Moved into the
# corpus in round 9.
#
# holdout8 (185 fault lines, 66 projects, 298 ordinary lines; four gatherers,
# none ran the classifier; the first set above the 150 lines): round
# 8's classifier: family 0.660, precision 0.953, 0/298 flagged; round 9 (which
# never saw it): 0.649, 0.945, 0/298. A blind reader of its lines: 0.951.
# Round 10, after studying its misses (optimistic): 0.914 leave one set out.
# Moved into the corpus in round 10.
#
# holdout9 (197 fault lines, 77 projects, 350 ordinary lines; four more
# gatherers, none ran the classifier): round 8's classifier: family 0.675,
# precision 0.899, 0/350 flagged; round 9 (which never saw it): 0.675, 0.893,
# 0/350; round 10 (which never saw it: the family lexicon, threshold 0.55):
# 0.721, 0.899, 0/350. A blind reader of its lines: 0.944. Moved into the
# corpus in round 11.
#
# holdout10 (201 fault lines, 75 projects, 311 ordinary lines; four more
# gatherers, none ran the classifier): round 8's classifier: family 0.706,
# precision 0.966, 2/311 flagged; round 10 (which never saw it): 0.771, 0.951,
# 0/311; round 11 (which never saw it): 0.786, 0.952, 0/311. A blind reader of
# its lines: 0.975. Moved into the corpus in round 12.
#
# holdout11 (160 fault lines, 81 projects, 341 ordinary lines; four more
# gatherers, none ran the classifier; public text nearly used up): round 8's
# classifier: family 0.613, precision 0.867, 1/341 flagged; round 11 (which
# never saw it): 0.781, 0.926, 1/341; round 12 (which never saw it): 0.788,
# 0.933, 1/341. A blind reader of its lines: 0.913. Moved into the corpus in
# round 13.
#
# holdout12 (204 fault lines, 77 projects, 343 ordinary lines; four more
# gatherers, none ran the classifier; mostly less-used stacks: MLX servers,
# OpenVINO, MLC, llama.cpp forks, client SDKs): round 12's classifier: family
# 0.711, precision 0.948, 1/343 flagged; round 13 (which never saw it: the
# written lines, the wider ERRORISH): 0.755, 0.939, 1/343. A blind reader of
# its lines: 0.897. Moved into the corpus in round 14.
#
# holdout13 (186 fault lines, 73 projects, 334 ordinary lines; four more
# gatherers, none ran the classifier; most LLM-serving threads already used,
# so many lines from TensorFlow, CUDA/NCCL, the kernel, API gateways): round
# 13's classifier: family 0.876, precision 0.988, 1/334 flagged; round 14's
# patterns alone: 0.882; round 14 (which never saw it: a third batch of
# written lines, more ERRORISH words, counters at zero): 0.898, 0.988, 1/334.
# A blind reader of its lines: 0.973 (1.000 on the 164 it was sure of). Moved
# into the corpus in round 15.
#
# holdout14 (215 fault lines, 96 projects, 338 ordinary lines; four more
# gatherers, none ran the classifier; 4 in 5 LLM-serving threads already used,
# so many lines from the kernel, PyTorch training, apps and gateways in front
# of a server; no scheduler line): round 14's classifier: family 0.795,
# precision 0.924, 1/338 flagged; round 15 (which never saw it): 0.809, 0.931,
# 1/338. A blind reader of its lines: 0.949 (0.969 on the 162 it was sure of).
# Moved into the corpus in round 16.
#
# holdout15 (191 fault lines, 85 projects, 338 ordinary lines; four more
# gatherers, none ran the classifier; about 3 in 4 candidate threads already
# used, so half its lines come from outside LLM serving or from apps and
# gateways in front of a server; no scheduler or kv_cache_integrity line):
# round 15's classifier: family 0.780, precision 0.909, 1/338 flagged; round 16
# (which never saw it): 0.801, 0.916, 1/338. A blind reader of its lines: 0.937 (0.993 on
# the 149 it was sure of). Moved into the corpus in round 17.
#
# holdout16 (202 fault lines, 86 projects, 350 ordinary lines; four more
# gatherers, none ran the classifier; about 3 in 4 candidate threads already
# used: many lines from TensorFlow/Keras, PyTorch-XLA, JAX, Paddle, MXNet,
# libfabric, the kernel, and apps and clients in front of a server): round
# 16's classifier: family 0.822, precision 0.927, 2/350 flagged; round 17
# (which never saw it): 0.827, 0.928, 3/350. A blind reader of its lines:
# 0.946 (0.982 on the 165 it was sure of). Moved into the corpus in round 18.
#
# holdout17 (129 fault lines, 63 projects, 293 ordinary lines; four more
# gatherers, none ran the classifier; short of 150: the session's search
# budget ran out; many lines from TensorFlow, Paddle, CuPy, Caffe, Isaac
# Gym/Sim, Habana Gaudi, AWS Neuron, fairseq and gateways in front of a
# server): round 17's classifier: family 0.690, precision 0.927, 2/293
# flagged; round 18's patterns and words alone (which never saw it): 0.690,
# 0.918, 2/293; round 18 with identifiers split into words (word_view): 0.705,
# 0.919, 1/293. A blind reader of its lines:
# 0.961 (1.000 on the 84 it was sure of). Moved into the corpus in round 19.
#
# holdout18 (170 fault lines, 86 projects, 314 ordinary lines; four more
# gatherers with more look-ups each, none ran the classifier; about 4 in 5
# candidate threads already used: lines from research CUDA code, Stable
# Diffusion UIs, TensorFlow/CNTK/Paddle, mining and gaming boxes, training
# stacks, gateways and hosted APIs; no scheduler line): round 18's
# classifier: family 0.906, precision 0.969, 1/314 flagged; round 19 (which
# never saw it) the same: 0.906, 0.969, 1/314. 21 of its lines say what a
# training line says (the same text as the model sees it); on the other 149,
# 0.893. A blind reader of its lines: 0.982 (1.000 on the 130 it was sure of):
# an easier set than holdout17, whose lines the same reader got 0.961. Moved
# into the corpus in round 20.
#
# holdout19 (158 fault lines, 91 projects, 301 ordinary lines; four more
# gatherers, none ran the classifier; most candidate threads already used:
# lines from TensorFlow, JAX, Caffe, darknet, Thrust/RAPIDS, ComfyUI and
# diffusion repos, llama.cpp bindings, coding agents, clients and gateways;
# one scheduler line): round 19's classifier: family 0.892, precision 0.993,
# 3/301 flagged; round 20 (which never saw it): 0.899, 0.993, 3/301. 26 of its
# lines say what a training line says; on the other 132, 0.879. A blind reader
# of its lines (read twice, the second time with the labelled files moved
# away): 0.994 (1.000 on the 133 it was sure of; one unknown). Moved into the
# corpus in round 21.
#
# holdout20 (173 fault lines, 77 projects, 309 ordinary lines; four more
# gatherers, none ran the classifier; about 3 in 4 candidate threads already
# used: lines from TensorFlow, torch7, MXNet, hashcat, whisper.cpp, CuPy,
# KubeVirt, MinerU, apps, clients, proxies and hosted APIs; no scheduler
# line): round 20's classifier: family 0.798, precision 0.945, 0/309 flagged;
# round 21 (which never saw it): 0.803, 0.946, 0/309. 23 of its lines say what
# a training line says; on the other 150, 0.773. A blind reader of its lines
# (labelled files moved away while it read): 0.936 (0.985 on the 130 it was
# sure of; two unknowns): a harder set than holdout19 (0.994). Moved into the
# corpus in round 22.
#
# holdout21 (161 fault lines, 87 projects, 314 ordinary lines; four gatherers
# and two top-up gatherers, none ran the classifier; about 4 in 5 candidate
# threads already used: lines from TensorFlow, Caffe, Paddle, Keras, ComfyUI
# and diffusion trainers, fabric manager, OpenMPI, apps and clients; one
# gpu_hardware, one kv_cache_integrity and one speculative_decoding line):
# round 20's classifier: family 0.783, precision 0.913, 1/314 flagged; round 21
# (which never saw it): 0.801, 0.915, 1/314; round 22 (which never saw it):
# 0.801, 0.921, 1/314. 35 of its lines say what a training line says; on the
# other 126, 0.794. A blind reader of its lines (labelled files moved away
# while it read): 0.888 (0.975 on the 118 it was sure of; three TensorRT
# lines labelled config that the catalog and the corpus call model_loading).
# Moved into the corpus in round 23.
#
# holdout22 (175 fault lines, 71 projects, 321 ordinary lines; four gatherers,
# none ran the classifier; most candidate threads already used: lines from
# ComfyUI and diffusion trainers, TensorFlow, onnxruntime, JAX, CuPy, faiss,
# OpenAI / Azure OpenAI / Anthropic clients, ollama clients and gateways; no
# scheduler line): round 22's classifier: family 0.811, precision 0.953,
# 3/321 flagged; round 23 (which never saw it): 0.811, 0.947, 3/321. 35 of its
# lines say what a training line says (all 35 right); on the other 140, 0.764. A blind
# reader of its lines (labelled files moved away while it read): 0.983 (0.993
# on the 140 it was sure of): an easy set for a reader, and the classifier
# still leaves 24 of the lines the reader names unknown. Moved into the corpus
# in round 24.
#
# holdout23 (152 fault lines, 95 projects, 299 ordinary lines; four gatherers,
# none ran the classifier; about 4 in 5 candidate threads already used: lines
# from crypto miners, Blender Cycles, instant-ngp, PaddlePaddle, Keras,
# ComfyUI, hosted-API clients in Java, Go, JS and R; no kv_cache line, one
# scheduler line): round 23's classifier: family 0.796, precision 0.945,
# 0/299 flagged; round 24 (which never saw it): 0.803, 0.939, 0/299. 22 of
# its lines say what a training line says (21 right); on the other 130,
# 0.769. A blind reader of its lines (labelled files moved away while it
# read): 0.954 (1.000 on the 120 it was sure of). Moved into the corpus in
# round 25.
#
# holdout24 (155 fault lines, 88 projects, 328 ordinary lines; four gatherers
# and a top-up fifth, none ran the classifier; about 4 in 5 candidate threads
# already used: lines from ROCm builds, miners, TensorFlow/JAX/MXNet, Ascend,
# diffusion UIs, hosted-API clients and gateways; three scheduler and four
# kv_cache_integrity lines, several of them weak): round 24's classifier:
# family 0.794, precision 0.911, 2/328 flagged; round 25 (which never saw it):
# the same. 12 of its lines say what a training line says (all right); on the
# other 143, 0.776. A blind reader of its lines (labelled files moved away
# while it read): 0.910 (1.000 on the 117 it was sure of; the 14 it read
# otherwise are all lines it was unsure of). Moved into the corpus in round 26.
#
# holdout25 (166 fault lines, 107 projects, 333 ordinary lines; four gatherers
# and a planned top-up fifth, none ran the classifier; most candidate threads
# already used: lines from miners, amdgpu and Intel Xe kernels, JAX, CuPy,
# diffusion UIs, hosted-API clients and gateways in several languages; one
# scheduler line): round 25's classifier: family 0.747, precision 0.932,
# 1/333 flagged; round 26 (which never saw it): 0.753, 0.926, 0/333. 18 of its
# lines say what a training line says (all right); on the other 148, 0.770. A
# blind reader of its lines (labelled files moved away while it read): 0.982
# (1.000 on the 135 it was sure of): the classifier leaves 30 of the lines the
# reader names unknown and names 8 wrongly.
HOLDOUT_GATES: dict[str, dict[str, float]] = {
    "holdout25": {
        "family_accuracy": 0.73,
        "precision_when_answered": 0.90,
        "benign_flagged_share": 0.02,
    },
}


@pytest.mark.parametrize(
    "name",
    sorted(HOLDOUT_GATES)
    or [pytest.param(None, marks=pytest.mark.skip(reason="no independent set at present"))],
)
def test_independent_set_scored_as_shipped(name: str) -> None:
    gate, folder = HOLDOUT_GATES[name], REAL / name
    s = evaluate_corpus(folder, None, folds=0)
    assert s["lines_also_in_training_corpus"] == 0  # unseen text, or the figure means nothing
    assert s["error_lines"] >= gate.get("min_lines", 150) and s["projects"] >= 5
    assert s["family_accuracy"] >= gate["family_accuracy"], s["misses"]
    assert s["precision_when_answered"] >= gate["precision_when_answered"]
    assert s["benign_flagged_share"] <= gate["benign_flagged_share"]
    if (folder / "blind_reader.jsonl").is_file():  # every fault line read blind
        assert s["blind_reader"]["lines"] == s["error_lines"]


def test_blind_reader_figures_compare_the_reader_with_labels_and_the_classifier() -> None:
    """A blind reader (an engineer given each line's text alone) against the
    set's labels, and the classifier against the reader, on the lines read."""
    from types import SimpleNamespace

    from rca.bench.corpus import blind_reader_figures

    errors = [{"text": t, "family": "gpu_oom"} for t in "abcde"]
    got = [SimpleNamespace(family=f) for f in ("gpu_oom", None, "gpu_oom", "timeout", "gpu_oom")]
    reader = {
        "a": ("gpu_oom", "high"),  # both right
        "b": ("gpu_oom", "high"),  # the reader names it, the classifier does not
        "c": (None, "low"),  # the text alone does not tell; the classifier guessed right
        "d": ("network", "low"),  # both wrong
    }  # "e" was not read
    f = blind_reader_figures(errors, got, reader)
    assert f is not None and f["lines"] == 4
    assert f["reader_agreement"] == 0.5 and f["reader_unknown"] == 1
    assert f["reader_precision_when_answered"] == round(2 / 3, 4)
    assert (f["reader_high_confidence_lines"], f["reader_high_confidence_agreement"]) == (2, 1.0)
    assert f["classifier_accuracy"] == 0.5
    assert f["classifier_accuracy_where_reader_right"] == 0.5
    assert f["joint"] == {
        "reader_right_classifier_right": 1,
        "reader_right_classifier_unknown": 1,
        "reader_unknown_classifier_right": 1,
        "reader_wrong_classifier_wrong": 1,
    }
    assert blind_reader_figures(errors, got, {}) is None


def test_a_broken_corpus_folder_is_one_clear_error(tmp_path: Path) -> None:
    from graph.errors import InputError

    with pytest.raises(InputError, match="not a corpus folder"):
        evaluate_corpus(tmp_path, None, folds=0)
    (tmp_path / "benign_lines.txt").write_text("INFO ok\n")
    (tmp_path / "error_lines.jsonl").write_text('{"text": "x", "family": "gpu_oom"}\n')
    with pytest.raises(InputError, match="fault line 1 needs string fields"):
        evaluate_corpus(tmp_path, None, folds=0)
    line = '{"text": "x", "family": "gpu_oom", "project": "p"}\n'
    (tmp_path / "error_lines.jsonl").write_text(line)
    (tmp_path / "blind_reader.jsonl").write_text('{"text": "x"\n')
    with pytest.raises(InputError, match=r"blind_reader.jsonl:1: not a blind reader row"):
        evaluate_corpus(tmp_path, None, folds=0)
    (tmp_path / "error_lines.jsonl").write_text("not json\n")
    with pytest.raises(InputError, match="not one JSON object per line"):
        evaluate_corpus(tmp_path, None, folds=0)


# --- Cached fallback model ------------------------------------------------
_CACHE_SCRIPT = """
import json, sys
from graph.catalog import load_catalog
from ingest.classify import Normalizer
extra = sys.argv[2:]
ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered on device"
training = [(ecc, "CUDA_ERROR_ECC_UNCORRECTABLE")]
training += [(t, None) for t in extra]
norm = Normalizer(load_catalog(sys.argv[1]), training=training, cache=True)
lines = ["ERROR uncorrectable ECC error encountered in the frobnicator", "ERROR nothing failed"]
out = [(r.code, r.confidence) for r in norm.classify(lines)]
print(json.dumps({"source": norm.fallback_source, "out": out}))
"""


def _fresh_process(home: Path, *extra: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "RCA_HOME": str(home)}
    mini = Path(__file__).with_name("fixtures") / "mini_catalog.toml"
    root = Path(__file__).parents[1]
    cmd = [sys.executable, "-c", _CACHE_SCRIPT, str(mini), *extra]
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_family_lexicon_teaches_families_not_faults(tmp_path: Path) -> None:
    """The lexicon (phrases each family's lines say) is family-model training
    text: it covers every family, a family the catalog does not know is an
    error, it is part of the cached model's key, and the fault-vs-ordinary gate
    does not learn from it, so an ordinary line full of its words is not a
    fault."""
    from ingest.classify import default_normalizer, training_key
    from ingest.corpus import family_lexicon

    lex = family_lexicon()
    assert {f for _, f in lex} == set(FAMILIES) and len(lex) >= 22 * 40
    bad = tmp_path / "lexicon.toml"
    bad.write_text('[gpu_hardwre]\nphrases = ["ECC"]\n', encoding="utf-8")
    with pytest.raises(ValueError, match="gpu_hardwre"):
        family_lexicon(bad)
    cat = default_catalog()
    assert training_key(cat, ["x"], ["__none__"], lex) != training_key(
        cat, ["x"], ["__none__"], lex[:-1]
    )
    ordinary = (
        "INFO 11-30 10:00:00 [config.py:100] tokenizer_mode=auto, dtype=bfloat16, "
        "chat_template=None, speculative_config=None, enable_lora=False, preemption_mode=None"
    )
    assert default_normalizer().classify_line(ordinary).code is None


def test_simulated_first_sight_drops_what_was_written_from_a_set(tmp_path: Path) -> None:
    """Scored at simulated first sight, a set loses the catalog examples that
    say what its lines say and the patterns left without an example: a line
    that a pattern written from it answers in the shipped classifier is no
    longer answered by that pattern."""
    import json

    from ingest.classify import default_normalizer

    line = (
        "Unrecognized keys in `rope_scaling` for 'rope_type'='yarn': "
        "{'original_max_position_embeddings'}"
    )
    assert line in default_catalog()["ROPE_SCALING_CONFIG_INVALID"].examples
    rows = [
        {"text": t, "family": f, "code": c, "project": "p", "set": s}
        for t, f, c, s in (
            (line, "attention_position", "ROPE_SCALING_CONFIG_INVALID", "s1"),
            ("RuntimeError: CUDA error: out of memory", "gpu_oom", None, "s2"),
        )
    ]
    (tmp_path / "error_lines.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("", ".s1", ".s2"):
        (tmp_path / f"benign_lines{name}.txt").write_text("INFO Started server process [1]\n")
    res = evaluate_corpus(tmp_path, None, folds=2, first_sight=True, by_set=False)
    fs = res["simulated_first_sight"]
    assert set(fs) == {"pooled", "s1", "s2"} and fs["pooled"]["error_lines"] == 2
    assert fs["s1"]["patterns_dropped"] >= 1 and fs["s1"]["examples_dropped"] >= 1
    assert fs["s1"]["right_by_pattern"] == 0
    shipped = default_normalizer().classify_line(line)
    assert shipped.method == "pattern" and shipped.family == "attention_position"
    assert all(m["set"] in ("s1", "s2") for m in res["simulated_first_sight_misses"])


def test_written_lines_are_training_data_apart_from_every_real_line(tmp_path: Path) -> None:
    """The written lines (fault lines an assistant wrote from knowledge) cover
    every family with valid labels, a wrong label is an error, the fallback
    trains on them, and none says what a real corpus or held-out line says (by
    the text the model sees): no figure on real lines may count a line the
    writer happened to remember."""
    from ingest.classify import _strip_numbers, _training_set, model_text
    from ingest.corpus import synthetic_lines

    written = synthetic_lines()
    catalog = default_catalog()
    fams = {lab if lab in FAMILIES else catalog[lab].family for _, lab in written}
    assert fams == set(FAMILIES) and len(written) >= 22 * 60
    bad = tmp_path / "written.jsonl"
    bad.write_text(
        '{"text": "x", "family": "gpu_oom", "code": "GPU_XID_79", "project": "p"}\n',
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match="GPU_XID_79"):
        synthetic_lines(bad)
    texts, labels = _training_set(catalog, [], 0)
    taught = set(zip(texts, labels, strict=True))
    assert all((_strip_numbers(t), lab) in taught for t, lab in written)
    real: set[str] = set()
    for folder in [CORPUS_DIR, *sorted(REAL.glob("holdout*"))]:
        for errs, ben in corpus_sets(folder).values():
            real |= {model_text(e["text"]) for e in errs} | {model_text(b) for b in ben}
    assert not [t for t, _ in written if model_text(t) in real]


def test_fallback_is_cached_on_disk_and_rebuilt_when_its_inputs_change(tmp_path: Path) -> None:
    """A second process loads the fitted fallback from $RCA_HOME/cache and
    answers the same; a changed training input or a corrupt file is rebuilt."""
    home = tmp_path / "home"
    first = _fresh_process(home)
    assert first["source"] == "trained"
    cached = list((home / "cache").glob("fallback-*.pkl"))
    assert len(cached) == 1 and not list((home / "cache").glob(".tmp-*"))
    second = _fresh_process(home)
    assert second == {**first, "source": "cache"}
    changed = _fresh_process(home, "INFO 11-29 10:14:02 [core.py:1] an ordinary line")
    assert changed["source"] == "trained"
    assert not cached[0].exists()  # the stale model was replaced
    [current] = (home / "cache").glob("fallback-*.pkl")
    current.write_bytes(b"not a pickle")
    assert _fresh_process(home, "INFO 11-29 10:14:02 [core.py:1] an ordinary line")["source"] == (
        "trained"
    )


# --- Traceback code is not evidence ----------------------------------------
# vllm-project/vllm#7653 (a chained traceback as posted, cut where the thread's
# excerpt ends) and Blaizzy/mlx-vlm#463 (frames with Python 3.11 markers).
_CHAINED = """Traceback (most recent call last):
  File "/data/anaconda3/lib/python3.11/site-packages/starlette/middleware/base.py", line 159, in call_next
    message = await recv_stream.receive()
              ^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/data/anaconda3/lib/python3.11/site-packages/anyio/streams/memory.py", line 101, in receive
    raise EndOfStream
anyio.EndOfStream

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/data/anaconda3/lib/python3.11/site-packages/uvicorn/protocols/http/httptools_impl.py", line 419, in run_asgi
    result = await app(  # type: ignore[func-returns-value]
             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/data/anaconda3/lib/python3.11/site-packages/uvicorn/middleware/proxy_headers.py", line 84, in __call__
    return await self.app(scope, receive, send)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/data/anaconda3/lib/python3.11/site-packages/fastapi/applications.py", line 1054, in __call__
    await super().__call__(scope, receive, send)
  File "/Users/hermeschen/Repo/work/taiwan-license-plate-recognition/.venv/lib/python3.12/site-packages/mlx_vlm/tokenizer_utils.py", line 202, in add_token
    ).decode("utf-8")
      ^^^^^^^^^^^^^^^
UnicodeDecodeError: 'utf-8' codec can't decode byte 0xa7 in position 15: invalid start byte"""  # noqa: E501


def test_traceback_frames_and_source_lines_are_not_evidence() -> None:
    from ingest.classify import traceback_code_lines
    from ingest.logs import parse_log_lines

    lines = _CHAINED.splitlines()
    code = traceback_code_lines(lines)
    meaning = {0, 6, 7, 8, 9, 10, len(lines) - 1}  # structure and exception lines
    assert code == set(range(len(lines))) - meaning
    # behind a log prefix (vLLM's), as a log file, with a source line that says
    # "errors": only the exception line becomes a record
    prefix = "(EngineCore_DP0 pid=1394) ERROR 10-07 17:11:06 [core.py:1006] "
    log = [prefix + t for t in lines]
    log.insert(-4, prefix + "    text = self.tokenizer.decode(out, errors=errors)")
    assert traceback_code_lines(log) == {i + (i >= len(lines) - 4) for i in code} | {len(lines) - 4}
    res = parse_log_lines([(t + "\n").encode() for t in log], source="tb.log", year=2026)
    assert [r.attrs["line"] for r in res.records] == [len(log)]
    assert res.records[0].code == "DETOKENIZE_INVALID_UTF8"


def test_header_less_source_lines_never_reach_the_fallback() -> None:
    """A fragment without its Traceback header (``rca normalize`` of a paste)."""
    from ingest.classify import default_normalizer

    norm = default_normalizer()
    for line in (
        "    text = self.tokenizer.decode(out, errors=errors)",
        '    raise OSError(24, "Too many open files")',
        "[rank0]:     raise RuntimeError(f\"Error building extension '{name}'\")",
    ):
        assert norm.classify_line(line).code is None, line


def test_faults_without_an_error_word_reach_the_fallback() -> None:
    """ERRORISH, which decides whether a line no pattern knows is asked about at
    all, takes what faults say without an error word (round 13: 129 of the
    simulated-first-sight unknowns never reached the model), while the ordinary
    lines servers print by the million still never do (a first version's
    "temperature" sent every sampling-params line to the model)."""
    import re

    from ingest.classify import ERRORISH
    from ingest.corpus import benign_lines

    rx = re.compile(ERRORISH)
    for line in (
        "ggml_backend_cuda_graph_compute: disabling CUDA graphs due to GPU architecture",
        "start: couldn't bind HTTP server socket, hostname: /tmp/llamafile-1.sock",
        "amdgpu: [powerplay] GPU over temperature range detected on PCIe 0:0.0!",
        "The safetensors file is incomplete. Check the file size.",
        '[GIN] 2025/03/06 - 11:42:21 | 503 |   42.04ms |   127.0.0.1 | POST "/api/generate"',
        'INFO:     ::1:51556 - "POST /v1/chat/completions HTTP/1.1" 400 Bad Request',
        "Memory access fault by GPU node-1 (Agent handle: 0x55f8b54eec30) on address 0x7f2a",
        "KV cache pool leak detected!",
        'open("/dev/nvidiactl", O_RDWR)          = -1 EPERM (Operation not permitted)',
        "The node was low on resource: memory.",
        "kernel: UBSAN: array-index-out-of-bounds in nvidia-uvm/uvm_pmm_gpu.c:857:39",
        "OpenBLAS blas_thread_init: RLIMIT_NPROC 4096 current, 513046 max",
    ):
        assert rx.search(line), line
    assert not rx.search("INFO 06-08 19:03:45 [default_loader.py:262] Loading weights took 8 s")
    assert not [b for b in benign_lines(20000, seed=5) if rx.search(b)]
    ordinary = "SamplingParams(n=1, temperature=0.7, top_p=0.95, max_tokens=256)"
    assert not rx.search(ordinary)
