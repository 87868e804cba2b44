"""Your own labels: a line the classifier could not name, taught once, is named
again (up to its numbers), kept redacted on this machine, and never leaks into
the benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from graph.catalog import default_catalog
from ingest.classify import Normalizer
from ingest.labels import labels_path, load_labels
from rca.cli import app

runner = CliRunner()
SHM = (
    "ERROR 11-29 10:00:01 [worker.py:99] Unable to initialize shared memory key "
    "'triton_python_backend_shm_region_{n}' to requested size, prompt: 'my secret question'"
)


def test_a_labelled_line_is_named_again_and_kept_redacted(tmp_path: Path) -> None:
    cat = default_catalog()
    log = tmp_path / "crash.log"
    log.write_text("INFO 11-29 10:00:00 started\n" + SHM.format(n=2) + "\n")
    assert Normalizer(cat).classify_line(SHM.format(n=7)).method != "label"

    res = runner.invoke(app, ["label", f"{log}:2", "--code", "DATALOADER_SHM_BUS_ERROR"])
    assert res.exit_code == 0, res.output
    stored = [json.loads(x) for x in labels_path().read_text().splitlines()]
    assert len(stored) == 1 and stored[0]["code"] == "DATALOADER_SHM_BUS_ERROR"
    assert stored[0]["family"] == "host_resource" and stored[0]["origin"] == f"{log}:2"
    assert "secret" not in stored[0]["text"] and "<redacted" in stored[0]["text"]

    # the same message with other numbers, from a fresh classifier
    got = Normalizer(cat).classify_line(SHM.format(n=7))
    assert (got.code, got.method, got.confidence) == ("DATALOADER_SHM_BUS_ERROR", "label", 1.0)
    assert Normalizer(cat).classify_line("ERROR something else went wrong: 7").code is None
    # benchmarks and cross-validation never see your labels
    assert Normalizer(cat, labels=()).classify_line(SHM.format(n=7)).method != "label"
    assert Normalizer(cat, training=[]).classify_line(SHM.format(n=7)).method != "label"

    # labelling it again relabels, removing forgets
    res = runner.invoke(app, ["label", "--text", SHM.format(n=9), "--code", "DISK_FULL"])
    assert res.exit_code == 0 and len(load_labels(cat).labels) == 1
    assert load_labels(cat).labels[0]["code"] == "DISK_FULL"
    assert runner.invoke(app, ["label", "--remove", "1"]).exit_code == 0
    assert load_labels(cat).labels == []


def test_bad_label_input_is_one_line_and_unusable_lines_are_kept(tmp_path: Path) -> None:
    cat = default_catalog()
    log = tmp_path / "a.log"
    log.write_text("ERROR one\n")
    for args in (
        ["label", f"{log}:1", "--code", "NOT_A_CODE"],
        ["label", f"{log}:5", "--code", "DISK_FULL"],
        ["label", f"{tmp_path}/missing.log:1", "--code", "DISK_FULL"],
        ["label", f"{log}:x", "--code", "DISK_FULL"],
        ["label", f"{log}:1"],
        ["label", f"{log}:1", "--text", "ERROR two", "--code", "DISK_FULL"],
        ["label", "--remove", "3"],
        ["label", "--code", "DISK_FULL"],  # which line?
    ):
        res = runner.invoke(app, args)
        assert res.exit_code != 0, args
        assert "Traceback" not in res.output and res.output.count("\n") <= 2, res.output

    path = labels_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('not json\n{"text": "ERROR x", "code": "GONE_CODE"}\n')
    found = load_labels(cat)
    assert found.labels == [] and found.skipped == 2
    res = runner.invoke(app, ["label", "--text", "ERROR two", "--code", "DISK_FULL"])
    assert res.exit_code == 0, res.output
    lines = path.read_text().splitlines()
    assert "not json" in lines and '{"text": "ERROR x", "code": "GONE_CODE"}' in lines
    listed = runner.invoke(app, ["label", "--list"])
    assert "1 labelled line(s)" in listed.output and "2 line(s)" in listed.output
