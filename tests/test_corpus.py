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
    assert len(errors) >= 490 and len({e["project"] for e in errors}) >= 65
    assert len({e["family"] for e in errors}) >= 20
    assert len(benign) >= 670
    # round 3 widened the corpus beyond the big engines (kernel AER, ROCm, Ascend,
    # Mooncake/NIXL, Dynamo, envoy, TEI, Triton python backend...)
    assert len({e["project"] for e in errors if e.get("round") == 3}) >= 40


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
    # measured 0.95 (5-fold) on the lines of rounds 1-2; many corpus lines are
    # also catalog examples, so this mostly guards the patterns and the model
    # against regressions. Round 3 added harder text from projects the first
    # rounds never saw (measured 0.74-0.76, precision 0.96; 0.89 over all
    # lines; the previous classifier got 0.49 / 0.87 on them before round 3).
    rounds = scores["by_round"]
    assert rounds["1-2"]["family_accuracy"] >= 0.93, scores["misses"]
    assert rounds["3"]["family_accuracy"] >= 0.70, scores["misses"]
    assert rounds["3"]["precision_when_answered"] >= 0.93, scores["misses"]
    assert scores["family_accuracy"] >= 0.86, scores["misses"]


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
# answers, 0/406 ordinary lines flagged; after the third round, which did not
# look at it: 0.667 on 225 lines, 92.0%). Its misses are not used to tune: this
# gate only keeps the figure from falling.
HOLDOUT2 = REAL / "holdout2"


HOLDOUT3 = REAL / "holdout3"


def test_independent_holdout3_scored_as_shipped() -> None:
    """A third set, gathered during the third classifier round by someone who
    never ran the classifier, scored once after it: 0.605 family accuracy on
    243 fault lines from 63 projects, 85.5% precision when it answers, 1/384
    ordinary lines flagged."""
    s = evaluate_corpus(HOLDOUT3, None, folds=0)
    assert s["error_lines"] >= 150 and s["projects"] >= 5
    assert s["family_accuracy"] >= 0.58
    assert s["precision_when_answered"] >= 0.83
    assert s["benign_flagged_share"] <= 0.03


def test_independent_holdout2_scored_as_shipped() -> None:
    s = evaluate_corpus(HOLDOUT2, None, folds=0)
    assert s["error_lines"] >= 150 and s["projects"] >= 5
    assert s["family_accuracy"] >= 0.62
    assert s["precision_when_answered"] >= 0.90
    assert s["benign_flagged_share"] <= 0.03


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
