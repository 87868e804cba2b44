from __future__ import annotations

import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from graph.catalog import FAMILIES, LAYER_NAMES, load_catalog, parse_catalog
from graph.errors import CatalogError

GOOD = """
version = 1
[[code]]
name = "A_CODE"
id = 1001
layer = 1
stage = "decode"
trigger = "hardware_driver"
recoverability = "transient"
family = "gpu_hardware"
severity = "error"
summary = "s"
action = "a"
grounding = "g"
patterns = ['Xid \\(PCI:(?P<pci>[0-9a-f:]+)\\): 48,']
examples = ["NVRM: Xid (PCI:0000:19:00): 48, pid=1"]
causes = [{ code = "B_CODE", strength = 0.5 }]

[[code]]
name = "B_CODE"
id = 7500
layer = 7
stage = "transport"
trigger = "engine"
recoverability = "transient"
family = "engine_crash"
severity = "error"
summary = "s"
action = "a"
grounding = "g"
detectors = ["otel:http.response.status_code=500"]
"""


def _parse(text: str):
    return parse_catalog(tomllib.loads(text), "test.toml")


def _problems(text: str) -> list[str]:
    with pytest.raises(CatalogError) as exc:
        _parse(text)
    assert "test.toml" in str(exc.value)
    return exc.value.problems


def test_good_catalog_parses() -> None:
    cat = _parse(GOOD)
    assert [c.name for c in cat] == ["A_CODE", "B_CODE"]
    assert cat["A_CODE"].causes[0].code == "B_CODE"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('name = "B_CODE"', 'name = "A_CODE"', "duplicate name A_CODE"),
        ("id = 7500", "id = 1001\nlayer_x = 1", "unknown field(s) layer_x"),
        ("id = 7500", "id = 6500", "id // 1000 == layer 7"),
        ('stage = "transport"', 'stage = "warmup"', "stage 'warmup' is not one of"),
        ('trigger = "engine"', 'trigger = "cosmic_ray"', "trigger 'cosmic_ray'"),
        (
            'recoverability = "transient"\nfamily = "engine_crash"',
            'recoverability = "maybe"\nfamily = "engine_crash"',
            "recoverability 'maybe'",
        ),
        ('family = "engine_crash"', 'family = "gremlins"', "unknown family 'gremlins'"),
        (
            'severity = "error"\nsummary = "s"\naction = "a"\ngrounding = "g"\ndetectors',
            'severity = "loud"\nsummary = "s"\naction = "a"\ngrounding = "g"\ndetectors',
            "severity 'loud'",
        ),
        (
            'code = "B_CODE", strength = 0.5',
            'code = "NOPE", strength = 0.5',
            "edge to unknown code NOPE",
        ),
        (
            'code = "B_CODE", strength = 0.5',
            'code = "B_CODE", strength = 1.5',
            "strength 1.5, not in (0, 1]",
        ),
        ('code = "B_CODE", strength = 0.5', 'code = "A_CODE", strength = 0.5', "edge to itself"),
        ("layer = 1", "layer = 9", "layer 9 is not one of 1..7"),
        ('detectors = ["otel:http.response.status_code=500"]', "", "at least one pattern"),
        ("48, pid=1", "49, pid=1", "matches none of its examples"),
        ("(?P<pci>", "(?<=x)(?P<pci>", "look-around"),
        ("[0-9a-f:]+)", "[0-9a-f:+)", "does not compile"),
        (
            'summary = "s"\naction = "a"\ngrounding = "g"\npatterns',
            'summary = "s"\ngrounding = "g"\npatterns',
            "missing field(s) action",
        ),
    ],
)
def test_each_validation_error_is_reported(old: str, new: str, message: str) -> None:
    assert old in GOOD
    problems = _problems(GOOD.replace(old, new, 1))
    assert any(message in p for p in problems), problems


def test_several_problems_are_reported_together() -> None:
    text = GOOD.replace('family = "engine_crash"', 'family = "x"').replace("0.5", "2.0")
    assert len(_problems(text)) == 2


def test_unreadable_and_invalid_toml_files(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[code]\nname=")
    with pytest.raises(CatalogError, match="not valid TOML"):
        load_catalog(bad)


# ---- the shipped catalog -----------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    return load_catalog(check_patterns=True)


def test_shipped_catalog_is_complete(shipped) -> None:
    assert len(shipped) >= 137
    layers = Counter(c.layer for c in shipped)
    assert set(layers) == set(LAYER_NAMES)
    assert all(n >= 8 for n in layers.values()), layers
    assert set(c.family for c in shipped) == set(FAMILIES)


def test_every_code_is_produced_by_a_pattern_or_detector(shipped) -> None:
    for code in shipped:
        assert code.patterns or code.detectors, code.name
        for pat in code.patterns:
            assert any(re.search(pat, ex) for ex in code.examples), (code.name, pat)


def test_shipped_patterns_are_specific(shipped) -> None:
    """An example line of one code is not claimed by an unrelated code's pattern."""
    from ingest.normalize import LineClassifier

    clf = LineClassifier(shipped)
    wrong = []
    for code in shipped:
        for ex in code.examples:
            m = clf.classify(ex)
            if m is None or m.code.name != code.name:
                wrong.append((code.name, m.code.name if m else None, ex[:80]))
    # a few lines legitimately carry two codes (e.g. an access log 500 after an
    # engine error on the same line); everything else must round-trip
    assert len(wrong) <= len(shipped) // 20, wrong


def test_patterns_compile_in_polars_rust_regex(shipped) -> None:
    import polars as pl

    s = pl.Series([ex for c in shipped for ex in c.examples])
    for code in shipped:
        for pat in code.patterns:
            assert s.str.contains(pat).any(), (code.name, pat)


def test_ordinary_info_lines_match_no_code(shipped) -> None:
    from ingest.normalize import LineClassifier

    clf = LineClassifier(shipped)
    benign = [
        "INFO 05-12 10:01:02 metrics.py:351] Avg prompt throughput: 512.3 tokens/s, Avg "
        "generation throughput: 87.1 tokens/s, Running: 12 reqs, Swapped: 0 reqs, Pending: 0 "
        "reqs, GPU KV cache usage: 43.2%, CPU KV cache usage: 0.0%.",
        'INFO:     10.0.0.5:51234 - "POST /v1/completions HTTP/1.1" 200 OK',
        "INFO 11-29 10:13:31 api_server.py:712] vLLM API server version 0.6.3.post1",
        "Nov 29 09:58:42 gpu-node-07 kernel: [  602.004112] NVRM: GPU at PCI:0000:19:00: "
        "GPU-1c0f5a3e-7d2b-4e7a-9b1e-0a2c3d4e5f60",
        "Nov 29 10:01:17 gpu-node-07 kernel: [  756.402211] IPv6: ADDRCONF(NETDEV_CHANGE): "
        "veth3f2a1c9: link becomes ready",
        "2024-05-01T12:00:00.000Z INFO text_generation_router: router/src/main.rs:300: Connected",
    ]
    assert [clf.classify(line) for line in benign] == [None] * len(benign)


def test_catch_all_codes_lose_to_specific_ones(shipped) -> None:
    """GPU_XID_OTHER only wins when no specific Xid code matches; NVLink-class
    Xids land in interconnect even when the PCI id is masked."""
    from ingest.normalize import LineClassifier

    clf = LineClassifier(shipped)
    xid77 = "NVRM: Xid (PCI:0000:3b:00): 77, pid=2113, name=python3, Channel 0x00000018"
    assert clf.classify(xid77).code.name == "GPU_XID_OTHER"
    xid48 = (
        "NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable "
        "double bit error (DBE) has been detected on GPU in the framebuffer at physAddr "
        "0x7fffa8860 partition 7, subpartition 1."
    )
    assert clf.classify(xid48).code.name == "GPU_XID_48"
    masked = "NVRM: Xid (PCI:...): 136, link training failed"
    assert clf.classify(masked).code.family == "interconnect"


def test_a_wrapper_line_yields_the_cause_it_quotes(shipped) -> None:
    """engine_crash wrappers ("Exception in worker ... while processing method
    init_device: <cause>") lose to the cause's code on the same line, in both
    classifiers."""
    from ingest.classify import Normalizer
    from ingest.normalize import LineClassifier

    line = (
        "(VllmWorkerProcess pid=13359) ERROR 08-02 18:15:15 multiproc_worker_utils.py:226] "
        "Exception in worker VllmWorkerProcess while processing method init_device: Cannot "
        "re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use "
        "the 'spawn' start method"
    )
    assert LineClassifier(shipped).classify(line).code.name == "CUDA_FORK_REINIT"
    assert Normalizer(shipped, fallback=False).classify_line(line).code == "CUDA_FORK_REINIT"
    wrapper_only = line.split(": Cannot")[0]
    assert LineClassifier(shipped).classify(wrapper_only).code.family == "engine_crash"
