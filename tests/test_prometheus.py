"""ingest.prometheus: exposition parsing (real captures) and threshold rules."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graph.catalog import default_catalog
from graph.errors import CatalogError
from ingest import schema as S
from ingest.prometheus import (
    DEFAULT_RULES,
    MAX_LINE,
    PromParseResult,
    Rule,
    RuleKind,
    ThresholdTracker,
    family_of,
    is_dcgm_blank,
    parse_exposition,
    parse_exposition_file,
)

FIX = Path(__file__).with_name("fixtures") / "prometheus"
T4_UUID = "GPU-20c56d28-0da5-6d26-a36a-e7af1ce2586e"
T4_LABELS = (
    'gpu="0",UUID="GPU-20c56d28-0da5-6d26-a36a-e7af1ce2586e",device="nvidia0",'
    'modelName="Tesla T4",Hostname="424773df46e0",DCGM_FI_DRIVER_VERSION="460.106.00",'
    'DCGM_FI_PROCESS_NAME="/usr/bin/dcgm-exporter"'
)


def parse(name: str, ts_ns: int = 1_000, **kw) -> PromParseResult:
    return parse_exposition_file(FIX / name, ts_ns=ts_ns, **kw)


def by_name(res: PromParseResult, name: str) -> list[dict]:
    return [s for s in res.samples if s["name"] == name]


def accounted(res: PromParseResult) -> bool:
    return res.lines == len(res.samples) + res.metadata + len(res.quarantine)


def dcgm(name: str, value: object, labels: str = T4_LABELS) -> str:
    return f"{name}{{{labels}}} {value}\n"


# --------------------------------------------------------------------------- fixtures


def test_dcgm_capture_parses_to_exact_rows():
    res = parse("dcgm_datadog_t4.txt", source="dcgm.prom")
    assert (res.lines, len(res.samples), res.metadata, res.quarantine) == (116, 38, 78, [])
    assert res.samples[0] == {
        "ts": 1_000,
        "host": "424773df46e0",
        "gpu_uuid": T4_UUID,
        "name": "DCGM_FI_DEV_SM_CLOCK",
        "labels": json.dumps(
            {
                "DCGM_FI_DRIVER_VERSION": "460.106.00",
                "DCGM_FI_PROCESS_NAME": "/usr/bin/dcgm-exporter",
                "Hostname": "424773df46e0",
                "UUID": T4_UUID,
                "device": "nvidia0",
                "gpu": "0",
                "modelName": "Tesla T4",
            },
            sort_keys=True,
        ),
        "value": 300.0,
        "source": "dcgm.prom",
    }
    assert list(res.samples[0]) == S.METRICS.names
    assert by_name(res, "DCGM_FI_DEV_POWER_USAGE")[0]["value"] == 8.969
    assert by_name(res, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")[0]["value"] == 128996013.0
    throttle = by_name(res, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")[0]
    assert (throttle["host"], throttle["gpu_uuid"], throttle["value"]) == (
        "551bdf382151",
        "GPU-9ef1b6d0-3643-5dd7-b823-c0ec20dcf2d5",
        1.0,
    )
    fan = by_name(res, "DCGM_FI_DEV_FAN_SPEED")[0]
    assert (fan["labels"], fan["host"], fan["gpu_uuid"]) == ("{}", None, None)
    dram = by_name(res, "DCGM_FI_PROF_DRAM_ACTIVE")[0]
    assert json.loads(dram["labels"])["pod"] == "ray-1111111" and dram["value"] == 3e-06
    assert res.types["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"] == "counter"
    assert res.helps["DCGM_FI_DEV_SLOWDOWN_TEMP"] == ""  # HELP without text is valid
    assert res.helps["DCGM_FI_DEV_SM_CLOCK"] == "SM clock frequency (in MHz)."


def test_rows_and_quarantine_fit_the_store_schemas():
    res = parse("dcgm_exporter_readme_k8s.txt", source="readme")
    metrics = S.records_to_arrow(res.samples, S.METRICS)
    assert metrics.num_rows == 2
    quarantine = S.records_to_arrow(res.quarantine, S.QUARANTINE)
    assert quarantine.column("origin").to_pylist() == ["line 7", "line 10", "line 11"]
    assert all(set(q) == set(S.QUARANTINE.names) for q in res.quarantine)


def test_host_argument_overrides_labels_and_instance_port_is_dropped():
    res = parse("dcgm_datadog_t4.txt", host="node-a")
    assert {s["host"] for s in res.samples} == {"node-a"}
    res = parse_exposition(
        'up{instance="10.0.0.7:9400"} 1\nup{instance="[fd00::7]:9400"} 1\n'
        'up{instance="gpu-node-3"} 1\nup{hostname="h2",instance="x:1"} 1\n',
        source="s",
    )
    assert [s["host"] for s in res.samples] == ["10.0.0.7", "fd00::7", "gpu-node-3", "h2"]


def test_gpu_uuid_from_each_label_spelling():
    res = parse_exposition(
        'a{UUID="GPU-1"} 1\na{uuid="GPU-2"} 1\nnv_gpu_utilization{gpu_uuid="GPU-3"} 0.5\na 1\n',
        source="s",
    )
    assert [s["gpu_uuid"] for s in res.samples] == ["GPU-1", "GPU-2", "GPU-3", None]


def test_vllm_v1_capture_keeps_created_and_engine_labels():
    res = parse("vllm_v0_10_glm45_issue617.txt")
    assert accounted(res) and res.quarantine == []
    assert [s["name"] for s in res.samples] == [
        "vllm:gpu_prefix_cache_queries_created",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_created",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
    ]
    kv = by_name(res, "vllm:kv_cache_usage_perc")[0]
    assert kv["value"] == 9.75010481363281e-06
    assert kv["labels"] == '{"engine": "0", "model_name": "zai-org/GLM-4.5"}'
    assert by_name(res, "vllm:gpu_prefix_cache_hits_created")[0]["value"] == 1.7537953269353123e09
    assert family_of("vllm:prefix_cache_queries_total", res.types) == (
        "vllm:prefix_cache_queries_total",
        "counter",
    )


def test_histogram_buckets_sum_and_count():
    res = parse("vllm_v0_6_opt125m_issue8819.txt")
    assert accounted(res) and res.quarantine == []
    buckets = by_name(res, "vllm:request_params_n_bucket")
    assert [json.loads(b["labels"])["le"] for b in buckets] == [
        "1.0",
        "2.0",
        "5.0",
        "10.0",
        "20.0",
        "+Inf",
    ]
    assert [b["value"] for b in buckets] == [1.0] * 6
    assert by_name(res, "vllm:request_params_n_sum")[0]["value"] == 1.0
    assert family_of("vllm:request_params_n_bucket", res.types) == (
        "vllm:request_params_n",
        "histogram",
    )
    assert family_of("vllm:request_params_n_count", res.types)[1] == "histogram"
    # the excerpt starts mid-family: best_of has no TYPE, its samples are kept untyped
    assert family_of("vllm:request_params_best_of_bucket", res.types)[1] is None
    assert len(by_name(res, "vllm:request_params_best_of_bucket")) == 5
    ttft = parse("vllm_v0_4_bloom560m_ibm_pr18.txt")
    values = [b["value"] for b in by_name(ttft, "vllm:time_to_first_token_seconds_bucket")]
    assert values == [0.0, 0.0, 0.0, 112.0, 211.0, 211.0, 213.0]


def test_histogram_and_summary_label_checks_quarantine_bad_samples():
    res = parse_exposition(
        "# TYPE h histogram\n"
        'h_bucket{le="0.5"} 1\n'
        "h_bucket 2\n"
        'h_bucket{le="x"} 3\n'
        "h_sum 4\n"
        "# TYPE s summary\n"
        's{quantile="0.9"} 5\n'
        's{quantile="p90"} 6\n'
        "s_count 7\n",
        source="s",
    )
    assert [s["value"] for s in res.samples] == [1.0, 4.0, 5.0, 7.0]
    assert [(q["origin"], q["reason"]) for q in res.quarantine] == [
        ("line 3", "histogram bucket without le label"),
        ("line 4", "bad le value 'x'"),
        ("line 8", "bad quantile value 'p90'"),
    ]


def test_triton_summaries_and_failure_reasons():
    res = parse("triton_kura_metrics.txt")
    assert (res.lines, len(res.samples), res.quarantine) == (139, 101, [])
    q = by_name(res, "nv_inference_queue_summary_us")
    assert [(json.loads(s["labels"])["quantile"], s["value"]) for s in q[:5]] == [
        ("0.5", 473.0),
        ("0.9", 473.0),
        ("0.95", 473.0),
        ("0.99", 473.0),
        ("0.999", 473.0),
    ]
    assert family_of("nv_inference_queue_summary_us_sum", res.types) == (
        "nv_inference_queue_summary_us",
        "summary",
    )
    reasons = {
        json.loads(s["labels"])["reason"] for s in by_name(res, "nv_inference_request_failure")
    }
    assert reasons == {"OTHER", "BACKEND", "CANCELED", "REJECTED"}
    t4 = parse("triton_t4_scrape1.txt")
    energy = by_name(t4, "nv_energy_consumption")[0]
    assert (energy["gpu_uuid"], energy["value"]) == (
        "GPU-8331ed5e-e44e-72c7-fba5-ed5d48487989",
        10918.654,
    )
    assert t4.types["nv_energy_consumption"] == "counter"


def test_tgi_captures_label_values_with_braces_and_quotes():
    res = parse("tgi_names_vllm_tgis_ibm_pr18.txt")
    assert accounted(res) and res.quarantine == []
    first = by_name(res, "tgi_batch_inference_duration_bucket")[0]
    assert json.loads(first["labels"]) == {"le": "0.001", "method": "{'method': 'prefill'}"}
    gke = parse("tgi_gke_tutorial.txt")
    assert [(s["name"], s["labels"], s["value"]) for s in gke.samples] == [
        ("tgi_request_count", "{}", 1.0),
        ("tgi_batch_inference_count", '{"method": "decode"}', 292.0),
        ("tgi_batch_inference_count", '{"method": "prefill"}', 1.0),
    ]


def test_openmetrics_eof_nan_inf_created_and_total():
    res = parse("openmetrics_roundtrip.txt")
    assert res.openmetrics and accounted(res) and res.quarantine == []
    nan = by_name(res, "prometheus_local_storage_indexing_batch_duration_milliseconds")
    assert len(nan) == 3 and all(math.isnan(s["value"]) for s in nan)
    inf = [s for s in by_name(res, "foo_bucket") if json.loads(s["labels"])["le"] == "+Inf"]
    assert inf[0]["value"] == 17.0
    assert by_name(res, "foo_created")[0]["value"] == 1.520430000123e09
    assert family_of("process_cpu_seconds_total", res.types) == ("process_cpu_seconds", "counter")
    assert family_of("foo_created", res.types) == ("foo", "histogram")
    after = parse_exposition("# TYPE a counter\na_total 1\n# EOF\na_total 2\n\n", source="s")
    assert [s["value"] for s in after.samples] == [1.0]
    assert [(q["origin"], q["reason"]) for q in after.quarantine] == [
        ("line 4", "content after # EOF")
    ]
    assert after.metadata == 3 and accounted(after)


def test_escaped_label_values_and_help():
    res = parse("openmetrics_escaping.txt")
    assert [json.loads(s["labels"])["foo"] for s in res.samples] == ['b"a\nr', "b\\a\\z"]
    assert res.samples[0]["labels"] == '{"foo": "b\\"a\\nr"}'
    assert res.helps["a"] == "he\n\\l\\tp"  # \n and \\ unescaped; unknown \t kept


def test_special_float_values():
    res = parse_exposition(
        "a NaN\nb +Inf\nc -Inf\nd 1.5e3\ne -0\nf 0x10\ng 1_000\nh ١\n", source="s"
    )
    got = {s["name"]: s["value"] for s in res.samples}
    assert math.isnan(got["a"]) and got["b"] == math.inf and got["c"] == -math.inf
    assert got["d"] == 1500.0 and got["e"] == 0.0
    assert [q["reason"] for q in res.quarantine] == [
        "bad float value '0x10'",
        "bad float value '1_000'",
        "bad float value '١'",
    ]


def test_sample_timestamps_ms_in_text_format_seconds_in_openmetrics():
    text = parse_exposition(
        "a 1 1700000000123\nb 2 -5\nc 3\nd 4 1e3\ne 5 12x\n", source="s", ts_ns=7
    )
    ts = {s["name"]: s["ts"] for s in text.samples}
    assert ts == {"a": 1_700_000_000_123_000_000, "b": -5_000_000, "c": 7, "d": 1_000_000_000}
    assert [q["reason"] for q in text.quarantine] == ["bad timestamp '12x'"]
    om = parse_exposition("a_total 1 1700000000.5\nb 2\n# EOF\n", source="s", ts_ns=7)
    assert [s["ts"] for s in om.samples] == [1_700_000_000_500_000_000, 7]


def test_default_timestamp_is_now():
    before = time.time_ns()
    res = parse_exposition("a 1\n", source="s")
    assert before <= res.samples[0]["ts"] <= time.time_ns()


# --------------------------------------------------------------------------- DCGM blanks


def test_dcgm_blank_sentinel_is_quarantined_not_a_sample():
    res = parse("dcgm_exporter_readme_k8s.txt")
    assert [(s["name"], s["value"], s["gpu_uuid"]) for s in res.samples] == [
        ("DCGM_FI_DEV_SM_CLOCK", 139.0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"),
        ("DCGM_FI_DEV_MEM_CLOCK", 405.0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"),
    ]
    assert json.loads(res.samples[0]["labels"]) == {
        "UUID": "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52",
        "container": "",
        "gpu": "0",
        "namespace": "",
        "pod": "",
    }
    blank = res.quarantine[1]
    assert blank["reason"] == "DCGM blank sentinel 9223372036854775794 (not a reading)"
    assert blank["raw"].startswith("DCGM_FI_DEV_MEMORY_TEMP{") and blank["origin"] == "line 10"
    # the README's "..." elision lines are not exposition either
    assert [q["reason"] for q in (res.quarantine[0], res.quarantine[2])] == [
        "malformed metric name"
    ] * 2


@pytest.mark.parametrize(
    ("name", "value", "blank"),
    [
        ("DCGM_FI_DEV_MEMORY_TEMP", 9223372036854775794, True),
        ("DCGM_FI_DEV_GPU_TEMP", 9223372036854775792, True),
        ("DCGM_FI_DEV_POWER_USAGE", 140737488355328, True),
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 2147483632, True),
        ("dcgm_gpu_temp", 9.2e18, True),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 9.19e18, False),
        ("DCGM_FI_DEV_GPU_TEMP", 45, False),
        ("nv_gpu_memory_total_bytes", 9.3e18, False),
    ],
)
def test_dcgm_blank_values(name, value, blank):
    assert is_dcgm_blank(name, float(value)) is blank
    res = parse_exposition(f"{name} {value}\n", source="s")
    assert (len(res.quarantine), len(res.samples)) == ((1, 0) if blank else (0, 1))


# --------------------------------------------------------------------------- malformed input


def test_malformed_lines_are_quarantined_with_reasons_and_the_rest_kept():
    big = "x" * (MAX_LINE + 10)
    lines = [
        "# TYPE good gauge",
        "good 1",
        "no_value",
        "bad_float 1.2.3",
        'unterminated{a="b} 1',
        'unclosed{a="b" 1',
        "\x00\x01\x02 garbage \x7f",
        f'huge{{a="{big}"}} 1',
        "good 2",
        'dup{a="1",a="2"} 1',
        "# TYPE t hologram",
        "# TYPE broken",
        "# HELP",
        "# TYPE good gauge",
        "good 3",
    ]
    res = parse_exposition("\n".join(lines) + "\n", source="f.prom")
    assert [s["value"] for s in res.samples] == [1.0, 2.0, 3.0]
    assert [(q["origin"], q["reason"]) for q in res.quarantine] == [
        ("line 3", "missing value"),
        ("line 4", "bad float value '1.2.3'"),
        ("line 5", "unterminated label value"),
        ("line 6", "unterminated label set"),
        ("line 7", "malformed metric name"),
        ("line 8", f"line longer than 1 MiB ({len(lines[7])} bytes)"),
        ("line 10", "duplicate label name 'a'"),
        ("line 11", "unknown metric type 'hologram'"),
        ("line 12", "malformed TYPE line"),
        ("line 13", "malformed HELP line"),
        ("line 14", "duplicate TYPE for good"),
    ]
    assert res.lines == 15 and accounted(res)
    assert all(len(q["raw"]) <= 65536 for q in res.quarantine)
    assert res.quarantine[2]["raw"] == 'unterminated{a="b} 1'


def test_invalid_utf8_and_overlong_lines_in_bytes_and_chunk_streams():
    payload = b"a 1\n\xff\xfe\x00binary\nb 2\n" + b"c" * (MAX_LINE + 1) + b" 3\nd 4\n"
    whole = parse_exposition(payload, source="s", ts_ns=1)
    chunks = [payload[i : i + 4093] for i in range(0, len(payload), 4093)]
    streamed = parse_exposition(iter(chunks), source="s", ts_ns=1)
    as_lines = parse_exposition(payload.splitlines(keepends=True), source="s", ts_ns=1)
    for res in (whole, streamed, as_lines):
        assert [s["name"] for s in res.samples] == ["a", "b", "d"]
        assert [(q["origin"], q["reason"]) for q in res.quarantine] == [
            ("line 2", "invalid UTF-8"),
            ("line 4", f"line longer than 1 MiB ({MAX_LINE + 3} bytes)"),
        ]
        assert res.lines == 5
    assert whole.quarantine[0]["raw"] == "\ufffd\ufffd\x00binary"


def test_text_lines_and_lone_surrogates():
    lines = ["a 1\n", 'b{x="\ud800"} 2\n', "c 3\n"]
    for res in (
        parse_exposition(lines, source="s"),  # e.g. a file opened in text mode
        parse_exposition("".join(lines), source="s"),
    ):
        assert [s["name"] for s in res.samples] == ["a", "c"]
        assert res.quarantine[0]["reason"].startswith("invalid UTF-8")
        S.records_to_arrow(res.quarantine, S.QUARANTINE)  # raw is storable


def test_exposition_without_commas_between_labels_is_quarantined():
    res = parse("dcgm_gpu_monitoring_tools_readme.txt")
    assert res.samples == [] and accounted(res)
    reasons = [q["reason"] for q in res.quarantine]
    assert sum(r.startswith("expected ',' between labels") for r in reasons) == 3


def test_exemplars_are_kept_apart_and_bad_ones_quarantined():
    res = parse_exposition(
        'a_total 1 # {trace_id="abc"} 0.5 1700000000\n'
        "b_total 2 # not an exemplar\n"
        'c_bucket{le="1"} 3 # {trace_id="x"} 1\n',
        source="s",
    )
    assert [s["name"] for s in res.samples] == ["a_total", "c_bucket"]
    assert res.exemplars[0]["exemplar"] == {"trace_id": "abc"} and res.exemplars[0]["value"] == 0.5
    assert res.quarantine[0]["reason"].startswith("malformed exemplar")


def test_blank_lines_comments_crlf_and_indentation():
    res = parse_exposition("\r\n# just a comment\r\n   # HELP a the a\r\n\ta 1\r\n\n", source="s")
    assert [s["value"] for s in res.samples] == [1.0]
    assert res.helps == {"a": "the a"} and res.metadata == 4 and accounted(res)


# --------------------------------------------------------------------------- speed


def _dcgm_scrape(gpus: int = 8, metrics: int = 40) -> str:
    labels = (
        'gpu="{i}",UUID="GPU-1c0f5a3e-7d2b-4e7a-9b1e-0a2c3d4e5f6{i}",pci_bus_id="00000000:{i}9:00.0",'
        'device="nvidia{i}",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-07",'
        'DCGM_FI_DRIVER_VERSION="570.158.01",container="server",namespace="llm",pod="vllm-0"'
    )
    out = []
    for m in range(metrics):
        out += [f"# HELP DCGM_FI_DEV_F{m} Field {m} (in units).", f"# TYPE DCGM_FI_DEV_F{m} gauge"]
        out += [f"DCGM_FI_DEV_F{m}{{{labels.format(i=i)}}} {m * 10 + i}.25" for i in range(gpus)]
    return "\n".join(out) + "\n"


def test_dcgm_scrape_of_8_gpus_by_40_metrics_parses_in_well_under_10ms():
    data = _dcgm_scrape().encode()
    parse_exposition(data, source="warm")
    best = math.inf
    for _ in range(7):
        t0 = time.perf_counter()
        res = parse_exposition(data, source="bench", ts_ns=1)
        best = min(best, time.perf_counter() - t0)
    assert len(res.samples) == 320 and res.quarantine == []
    assert len({s["gpu_uuid"] for s in res.samples}) == 8
    assert best < 0.010, f"{best * 1000:.2f} ms"


# --------------------------------------------------------------------------- properties


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_any_text_never_raises_and_every_line_is_accounted(text):
    res = parse_exposition(text, source="fuzz", ts_ns=1)
    parts = text.split("\n")
    if parts and not parts[-1]:
        parts.pop()
    assert res.lines == len(parts)
    assert accounted(res)


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=64), max_size=12))
def test_any_byte_chunks_never_raise_and_match_the_joined_bytes(chunks):
    streamed = parse_exposition(iter(chunks), source="fuzz", ts_ns=1)
    whole = parse_exposition(b"".join(chunks), source="fuzz", ts_ns=1)
    assert accounted(streamed) and accounted(whole)
    assert streamed.lines == whole.lines
    assert [s["name"] for s in streamed.samples] == [s["name"] for s in whole.samples]


_label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True)
_values = st.floats(allow_nan=False, width=64) | st.integers(-(10**12), 10**12).map(float)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@settings(max_examples=200)
@given(
    name=st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True),
    labels=st.dictionaries(_label_names, st.text(max_size=12), max_size=5),
    value=_values,
)
def test_rendered_samples_round_trip(name, labels, value):
    block = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    res = parse_exposition(f"{name}{{{block}}} {value!r}\n", source="p", ts_ns=1)
    if is_dcgm_blank(name, value):
        assert len(res.quarantine) == 1
        return
    assert res.quarantine == [] and len(res.samples) == 1
    row = res.samples[0]
    assert row["name"] == name and row["value"] == value
    assert json.loads(row["labels"]) == labels


# --------------------------------------------------------------------------- rules


def feed_text(tracker: ThresholdTracker, text: str, ts: int, source: str = "scrape"):
    return tracker.feed(parse_exposition(text, source=source, ts_ns=ts))


def codes(events) -> list[str]:
    return [e.code for e in events]


def test_every_rule_code_is_in_the_catalog():
    cat = default_catalog()
    for rule in DEFAULT_RULES:
        if "{" in rule.code:
            assert rule.fallback is not None
        else:
            assert rule.code in cat, rule.name
    ThresholdTracker()  # validates too


def test_a_rule_naming_an_unknown_code_is_refused():
    with pytest.raises(CatalogError, match="NOT_A_CODE"):
        ThresholdTracker([Rule("x", ("m",), RuleKind.INCREASE, "NOT_A_CODE")])


def test_dcgm_fixture_pair_fires_exactly_the_expected_rules():
    tracker = ThresholdTracker()
    assert tracker.feed(parse("dcgm_datadog_t4.txt", ts_ns=1_000)) == []
    events = tracker.feed(parse("dcgm_datadog_t4_scrape2.txt", ts_ns=2_000))
    assert sorted(codes(events)) == [
        "GPU_HW_THERMAL_SLOWDOWN",
        "GPU_XID_64",
        "GPU_XID_79",
        "PCIE_REPLAY_RISING",
    ]
    xid = next(e for e in events if e.code == "GPU_XID_79")
    cat = default_catalog()["GPU_XID_79"]
    assert (xid.layer, xid.family, xid.severity) == (cat.layer, cat.family, cat.severity)
    assert (xid.xid, xid.ts, xid.host, xid.gpu_uuid, xid.gpu_index, xid.pid) == (
        79,
        2_000,
        "424773df46e0",
        T4_UUID,
        0,
        None,
    )
    assert xid.source.startswith("metric:") and xid.source.endswith("dcgm_datadog_t4_scrape2.txt")
    assert xid.attrs["metric"] == "DCGM_FI_DEV_XID_ERRORS"
    assert (xid.attrs["value"], xid.attrs["previous"]) == (79.0, 0.0)
    assert xid.attrs["labels"]["UUID"] == T4_UUID
    thermal = next(e for e in events if e.code == "GPU_HW_THERMAL_SLOWDOWN")
    assert thermal.gpu_uuid == "GPU-9ef1b6d0-3643-5dd7-b823-c0ec20dcf2d5"
    assert S.records_to_arrow(events).num_rows == 4  # they fit the store


def test_event_ids_are_deterministic():
    def run():
        t = ThresholdTracker()
        t.feed(parse("dcgm_datadog_t4.txt", ts_ns=1_000))
        return sorted(e.event_id for e in t.feed(parse("dcgm_datadog_t4_scrape2.txt", ts_ns=2_000)))

    assert run() == run()


def test_vllm_and_triton_fixture_pairs():
    tracker = ThresholdTracker()
    assert tracker.feed(parse("vllm_v0_10_glm45_issue617.txt", ts_ns=1)) == []
    assert codes(tracker.feed(parse("vllm_v0_10_glm45_issue617_scrape2.txt", ts_ns=2))) == [
        "KV_CACHE_NO_FREE_BLOCKS"
    ]
    assert tracker.feed(parse("triton_kura_metrics.txt", ts_ns=1)) == []
    events = tracker.feed(parse("triton_kura_metrics_scrape2.txt", ts_ns=2))
    assert codes(events) == ["REQUEST_QUEUE_FULL", "SCHEDULER_QUEUE_BACKLOG"]
    assert events[0].attrs["labels"]["reason"] == "REJECTED"
    # two real consecutive Triton scrapes: counters rise, nothing is wrong
    assert tracker.feed(parse("triton_t4_scrape1.txt", ts_ns=1)) == []
    assert tracker.feed(parse("triton_t4_scrape2.txt", ts_ns=2)) == []


def test_first_scrape_fires_only_absolute_rules():
    tracker = ThresholdTracker()
    events = feed_text(
        tracker,
        'vllm:num_preemptions_total{engine="0"} 500\n'
        'vllm:corrupted_requests_total{engine="0"} 9\n'
        'vllm:num_requests_waiting{engine="0"} 900\n'
        + dcgm("DCGM_FI_DEV_XID_ERRORS", 79)
        + dcgm("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 1000)
        + 'vllm:kv_cache_usage_perc{engine="0"} 0.995\n'
        + dcgm("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", 0xC0)
        + dcgm("DCGM_FI_DEV_ROW_REMAP_PENDING", 1),
        1,
    )
    assert sorted(codes(events)) == [
        "GPU_HW_POWER_BRAKE",
        "GPU_HW_THERMAL_SLOWDOWN",
        "GPU_XID_63",
        "KV_CACHE_NO_FREE_BLOCKS",
    ]


def test_state_rules_fire_on_entry_only():
    tracker = ThresholdTracker()
    kv = 'vllm:gpu_cache_usage_perc{model_name="m"} {}\n'
    seq = [0.5, 0.99, 0.999, 0.98, 1.0]
    fired = [codes(feed_text(tracker, kv.replace("{}", str(v)), i)) for i, v in enumerate(seq)]
    assert fired == [[], ["KV_CACHE_NO_FREE_BLOCKS"], [], [], ["KV_CACHE_NO_FREE_BLOCKS"]]
    remap = [
        codes(feed_text(tracker, dcgm("DCGM_FI_DEV_ROW_REMAP_PENDING", v), 10 + i))
        for i, v in enumerate([1, 1, 0, 1])
    ]
    assert remap == [["GPU_XID_63"], [], [], ["GPU_XID_63"]]


def test_counter_increase_and_reset():
    tracker = ThresholdTracker()
    metric = 'vllm:num_preemptions_total{engine="0",model_name="m"} {}\n'
    fired = [
        codes(feed_text(tracker, metric.replace("{}", v), i))
        for i, v in enumerate(["5", "5", "7", "2", "2", "3", "NaN", "4"])
    ]
    assert fired == [
        [],
        [],
        ["SCHEDULER_PREEMPTION"],
        [],  # reset: a drop is not an increase
        [],
        ["SCHEDULER_PREEMPTION"],
        [],  # NaN ignored
        ["SCHEDULER_PREEMPTION"],
    ]


@pytest.mark.parametrize(
    "metric",
    [
        'vllm:num_requests_waiting{engine="0"}',
        "tgi_queue_size",
        'nv_inference_pending_request_count{model="m",version="1"}',
    ],
)
def test_queue_backlog_needs_threshold_and_growth(metric):
    tracker = ThresholdTracker()
    fired = [
        codes(feed_text(tracker, f"{metric} {v}\n", i))
        for i, v in enumerate([500, 600, 550, 80, 99, 101, 100])
    ]
    assert fired == [[], ["SCHEDULER_QUEUE_BACKLOG"], [], [], [], ["SCHEDULER_QUEUE_BACKLOG"], []]


def test_nan_logits_counter():
    tracker = ThresholdTracker()
    feed_text(tracker, 'vllm:corrupted_requests_total{engine="0"} 0\n', 1)
    events = feed_text(tracker, 'vllm:corrupted_requests_total{engine="0"} 2\n', 2)
    assert codes(events) == ["LOGITS_NAN"] and events[0].attrs["previous"] == 0.0


def test_last_xid_gauge_changes():
    tracker = ThresholdTracker()
    seq = [0, 13, 13, 0, 31, 77]
    fired = [
        [(e.code, e.xid) for e in feed_text(tracker, dcgm("DCGM_FI_DEV_XID_ERRORS", v), i)]
        for i, v in enumerate(seq)
    ]
    # Xid 77 has no code of its own: it becomes the catalog's generic GPU_XID_OTHER
    assert fired == [
        [],
        [("GPU_XID_13", 13)],
        [],
        [],
        [("GPU_XID_31", 31)],
        [("GPU_XID_OTHER", 77)],
    ]
    assert tracker.unmapped == []


def test_xid_fallback_code_is_data():
    rule = Rule(
        "xid",
        ("DCGM_FI_DEV_XID_ERRORS",),
        RuleKind.CHANGED_NONZERO,
        "GPU_XID_{xid}",
        xid="value",
        fallback="GPU_XID_43",
    )
    tracker = ThresholdTracker([rule])
    feed_text(tracker, dcgm("DCGM_FI_DEV_XID_ERRORS", 0), 1)
    events = feed_text(tracker, dcgm("DCGM_FI_DEV_XID_ERRORS", 77), 2)
    assert [(e.code, e.xid) for e in events] == [("GPU_XID_43", 77)]


def test_exporter_xid_window_counter_by_label():
    tracker = ThresholdTracker()
    lbl = T4_LABELS + ',window_size_in_ms="300000",xid="{}"'
    first = dcgm("DCGM_EXP_XID_ERRORS_COUNT", 2, lbl.format(13)) + dcgm("DCGM_FI_DEV_GPU_TEMP", 40)
    assert feed_text(tracker, first, 1) == []  # an existing count: no previous value
    second = (
        dcgm("DCGM_EXP_XID_ERRORS_COUNT", 3, lbl.format(13))
        + dcgm("DCGM_EXP_XID_ERRORS_COUNT", 1, lbl.format(48))  # a new series: counts from 0
        + dcgm("DCGM_FI_DEV_GPU_TEMP", 41)
    )
    events = feed_text(tracker, second, 2)
    assert sorted((e.code, e.xid) for e in events) == [("GPU_XID_13", 13), ("GPU_XID_48", 48)]
    third = dcgm("DCGM_EXP_XID_ERRORS_COUNT", 1, lbl.format(13))  # window slid: not an increase
    assert feed_text(tracker, third, 3) == []


def test_ecc_dbe_pcie_replay_and_nvlink_crc_counters():
    tracker = ThresholdTracker()
    names = [
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L3",
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",  # no rule
    ]
    feed_text(tracker, "".join(dcgm(n, 4) for n in names), 1)
    events = feed_text(tracker, "".join(dcgm(n, 6) for n in names), 2)
    assert [(e.code, e.xid) for e in events] == [
        ("GPU_XID_48", 48),
        ("PCIE_REPLAY_RISING", None),
        ("NVLINK_CRC_ERRORS_RISING", None),
        ("NVLINK_CRC_ERRORS_RISING", None),
    ]


def test_clock_event_reason_bits():
    tracker = ThresholdTracker()
    seq = [0x1, 0x40, 0x48, 0xC8, 0x4, 0x80]
    fired = [
        sorted(codes(feed_text(tracker, dcgm("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", v), i)))
        for i, v in enumerate(seq)
    ]
    assert fired == [
        [],
        ["GPU_HW_THERMAL_SLOWDOWN"],
        [],
        ["GPU_HW_POWER_BRAKE"],
        [],
        ["GPU_HW_POWER_BRAKE"],
    ]


def test_server_failure_counters_by_label():
    tracker = ThresholdTracker()
    first = (
        'tgi_request_failure{err="validation"} 4\n'
        'nv_inference_request_failure{model="m",reason="REJECTED",version="1"} 0\n'
        'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 0\n'
    )
    assert feed_text(tracker, first, 1) == []
    second = (
        'tgi_request_failure{err="validation"} 5\n'
        'tgi_request_failure{err="overloaded"} 2\n'  # TGI creates the series on first use
        'tgi_request_failure{err="generation"} 1\n'
        'nv_inference_request_failure{model="m",reason="REJECTED",version="1"} 1\n'
        'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 9\n'
    )
    assert codes(feed_text(tracker, second, 2)) == [
        "TGI_TOTAL_TOKENS_EXCEEDED",
        "REQUEST_QUEUE_FULL",
        "REQUEST_QUEUE_FULL",
    ]


def test_new_series_on_a_first_scrape_does_not_count_from_zero():
    tracker = ThresholdTracker()
    assert feed_text(tracker, 'tgi_request_failure{err="overloaded"} 2\n', 1) == []


def test_spec_decode_acceptance_ratio():
    tracker = ThresholdTracker()
    pair = (
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} {d}\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} {a}\n'
    )
    steps = [(1000, 600), (2000, 650), (2050, 650), (3050, 1150), (100, 0), (1100, 50)]
    fired = []
    for i, (d, a) in enumerate(steps):
        events = feed_text(tracker, pair.replace("{d}", str(d)).replace("{a}", str(a)), i)
        fired.append([(e.code, round(e.attrs["value"], 3)) for e in events])
        if events:
            assert events[0].attrs["denominator_delta"] == 1000.0
            assert "= 0.05 over 1000" in events[0].message
    assert fired == [
        [],
        [("SPEC_DECODE_ACCEPTANCE_COLLAPSE", 0.05)],
        [],  # 50 drafts: too few to judge
        [],  # 0.5 accepted: healthy
        [],  # counter reset
        [("SPEC_DECODE_ACCEPTANCE_COLLAPSE", 0.05)],
    ]


def test_series_are_kept_apart_by_labels_and_host():
    tracker = ThresholdTracker()
    text = (
        'vllm:num_preemptions_total{engine="0"} {a}\nvllm:num_preemptions_total{engine="1"} {b}\n'
    )
    feed_text(tracker, text.replace("{a}", "1").replace("{b}", "9"), 1)
    events = feed_text(tracker, text.replace("{a}", "2").replace("{b}", "3"), 2)
    assert [e.attrs["labels"]["engine"] for e in events] == ["0"]
    other = ThresholdTracker()
    other.feed(parse_exposition("vllm:num_preemptions_total 5\n", source="s", host="a"))
    assert (
        other.feed(parse_exposition("vllm:num_preemptions_total 6\n", source="s", host="b")) == []
    )
