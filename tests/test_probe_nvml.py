"""The NVML probe against a scripted NVML (probes.fake_nvml), no GPU needed."""

from __future__ import annotations

import io
import json
import logging
import sys
import time
from pathlib import Path

import pytest

pynvml = pytest.importorskip("pynvml")  # nvidia-ml-py: import works without a driver

from graph.catalog import default_catalog  # noqa: E402
from ingest import schema as S  # noqa: E402
from ingest.spool import load_spool  # noqa: E402
from ingest.store import Store  # noqa: E402
from probes.fake_nvml import FakeNvml  # noqa: E402
from probes.nvml import NO_DRIVER, SOURCE, NvmlPoller, run_cli  # noqa: E402
from probes.sink import MemorySink, SpoolSink  # noqa: E402

UUID0 = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
UUID1 = "GPU-11111111-2222-3333-4444-555555555555"


def _poller(script: dict, **kw) -> tuple[NvmlPoller, MemorySink, FakeNvml]:
    fake = FakeNvml(script)
    sink = MemorySink()
    return NvmlPoller(sink, nvml=fake, **kw), sink, fake


def _codes(records) -> list[str]:
    return [r.code for r in records]


# ---------------------------------------------------------------- Xid events


def test_xid_48_event_becomes_one_gpu_xid_48_record_with_the_gpu():
    poller, sink, _ = _poller(
        {
            "devices": [{"uuid": UUID0}, {"uuid": UUID1}],
            "events": [{"device": 1, "type": "xid", "data": 48}],
        }
    )
    recs = poller.poll_once()
    assert _codes(recs) == ["GPU_XID_48"]
    rec = recs[0]
    assert rec.xid == 48
    assert rec.gpu_uuid == UUID1 and rec.gpu_index == 1
    assert rec.source == SOURCE and rec.layer == 1 and rec.severity == "critical"
    assert "gpuInstanceId" not in rec.attrs and "computeInstanceId" not in rec.attrs
    assert sink.codes() == ["GPU_XID_48"]
    # delivered once: later polls add nothing
    assert poller.poll_once() == [] and poller.poll_once() == []
    assert sink.codes() == ["GPU_XID_48"]


def test_unknown_xid_is_gpu_xid_other_and_mig_ids_go_in_attrs():
    assert "GPU_XID_77" not in default_catalog()
    poller, _, _ = _poller(
        {
            "devices": [{"uuid": UUID0}],
            "events": [{"type": "xid", "data": 77, "gpu_instance": 3, "compute_instance": 0}],
        }
    )
    (rec,) = poller.poll_once()
    assert rec.code == "GPU_XID_OTHER" and rec.xid == 77 and rec.gpu_uuid == UUID0
    assert rec.attrs["gpuInstanceId"] == 3 and rec.attrs["computeInstanceId"] == 0


def test_events_only_for_registered_types_and_repeats_collapse():
    # the device does not support SBE-storm events: it is never registered or delivered
    xid_dbe = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
    poller, _, fake = _poller(
        {
            "devices": [{"supported_events": xid_dbe}],
            "events": [
                {"type": "sbe_storm"},
                {"type": "xid", "data": 13},
                {"type": "xid", "data": 13},  # same Xid within xid_repeat_s: counted only
                {"type": "xid", "data": 31},
            ],
        }
    )
    recs = poller.poll_once()
    assert [(r.code, r.xid) for r in recs] == [("GPU_XID_13", 13), ("GPU_XID_31", 31)]
    values = poller.readings()[0]["values"]
    assert values["nvml_xid_events_total{xid=13}"] == 2
    assert fake.calls[("nvmlDeviceRegisterEvents", 0)] == 1


def test_dbe_event_after_xid_48_is_not_a_second_record():
    poller, _, _ = _poller(
        {"events": [{"type": "xid", "data": 48}, {"type": "dbe"}, {"type": "sbe"}]}
    )
    assert _codes(poller.poll_once()) == ["GPU_XID_48"]
    assert poller.readings()[0]["values"]["nvml_ecc_sbe_events_total"] == 1
    assert poller.poll_once() == []


# ---------------------------------------------------------------- transitions


def test_thermal_slowdown_appearing_on_poll_3_is_exactly_one_record():
    reasons = [0x1, 0x1, 0x40, 0x48, 0x40, 0x40, 0x40, 0x0, 0x0]
    poller, sink, _ = _poller(
        {"devices": [{"values": {"nvmlDeviceGetCurrentClocksEventReasons": reasons}}]}
    )
    per_poll = [_codes(poller.poll_once()) for _ in range(len(reasons))]
    assert per_poll[2] == ["GPU_HW_THERMAL_SLOWDOWN"]
    assert sum(len(c) for c in per_poll) == 1
    assert sink.codes() == ["GPU_HW_THERMAL_SLOWDOWN"]
    rec = sink.records[0]
    assert rec.attrs["reasons"] == "0x40" and rec.gpu_index == 0


def test_flapping_is_one_record_until_clear_for_rearm_s():
    flapping = [0x40, 0x0, 0x40, 0x0, 0x40, 0x0]
    script = {"devices": [{"values": {"nvmlDeviceGetCurrentClocksEventReasons": flapping}}]}
    poller, sink, _ = _poller(script, rearm_s=60.0)
    for _ in flapping:
        poller.poll_once()
    assert sink.codes() == ["GPU_HW_THERMAL_SLOWDOWN"]
    poller, sink, _ = _poller(script, rearm_s=0.0)
    for _ in flapping:
        poller.poll_once()
    assert sink.codes() == ["GPU_HW_THERMAL_SLOWDOWN"] * 3


def test_power_brake_through_the_deprecated_throttle_reasons_call():
    poller, sink, fake = _poller(
        {
            "devices": [
                {
                    "unsupported": {"nvmlDeviceGetCurrentClocksEventReasons"},
                    "values": {"nvmlDeviceGetCurrentClocksThrottleReasons": [0, 0x88, 0x88]},
                }
            ]
        }
    )
    for _ in range(3):
        poller.poll_once()
    assert sink.codes() == ["GPU_HW_POWER_BRAKE"]  # 0x8 alone is explained by 0x80
    assert fake.calls[("nvmlDeviceGetCurrentClocksEventReasons", 0)] == 1


def test_counters_rising_give_one_record_per_episode():
    unc = ("nvmlDeviceGetTotalEccErrors", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, 0)
    crc_flit = ("nvmlDeviceGetNvLinkErrorCounter", 1, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT)
    poller, sink, _ = _poller(
        {
            "devices": [
                {
                    "nvlink_links": 2,
                    "values": {
                        unc: [5, 5, 6, 6],  # baseline 5 at driver load: no record
                        "nvmlDeviceGetPcieReplayCounter": [100, 100, 130, 170, 220, 220],
                        crc_flit: [0, 0, 0, 4],
                        "nvmlDeviceGetRemappedRows": [(0, 0, 0, 0), (0, 1, 1, 0), (0, 1, 1, 1)],
                    },
                }
            ]
        }
    )
    for _ in range(6):
        poller.poll_once()
    by_code = {}
    for r in sink.records:
        by_code.setdefault(r.code, []).append(r)
    assert sorted(by_code) == [
        "GPU_XID_48",
        "GPU_XID_63",
        "GPU_XID_64",
        "NVLINK_CRC_ERRORS_RISING",
        "PCIE_REPLAY_RISING",
    ]
    assert all(len(v) == 1 for v in by_code.values())
    (ecc,) = by_code["GPU_XID_48"]
    assert ecc.xid is None and ecc.attrs["via"] == "ecc_volatile_uncorrected_counter"
    assert ecc.attrs["delta"] == 1
    (nvl,) = by_code["NVLINK_CRC_ERRORS_RISING"]
    assert nvl.attrs["link"] == 1 and nvl.attrs["counters"]["crc_flit"]["delta"] == 4
    assert by_code["PCIE_REPLAY_RISING"][0].attrs["delta"] == 30


def test_state_already_active_at_the_first_reading_is_recorded():
    poller, sink, _ = _poller(
        {"devices": [{"values": {"nvmlDeviceGetRetiredPagesPendingStatus": 1}}]}
    )
    poller.poll_once()
    poller.poll_once()
    assert sink.codes() == ["GPU_XID_63"]
    assert sink.records[0].attrs["via"] == "retired_pages_pending"


# ---------------------------------------------------------------- errors


def test_not_supported_is_asked_once_and_logged_at_most_once(caplog):
    poller, _, fake = _poller(
        {
            "devices": [
                {
                    "unsupported": {
                        "nvmlDeviceGetRemappedRows",
                        "nvmlDeviceGetTotalEccErrors",
                        "nvmlDeviceGetTemperatureV",
                    }
                }
            ]
        }
    )
    with caplog.at_level(logging.DEBUG, logger="rca.probes"):
        for _ in range(10):
            poller.poll_once()
    assert fake.calls[("nvmlDeviceGetRemappedRows", 0)] == 1
    assert fake.calls[("nvmlDeviceGetTotalEccErrors", 0)] == 2  # corrected + uncorrected
    assert fake.calls[("nvmlDeviceGetTemperatureV", 0)] == 1
    assert fake.calls[("nvmlDeviceGetTemperature", 0)] == 10  # the fallback works
    assert fake.calls[("nvmlDeviceGetPowerUsage", 0)] == 10
    assert len([r for r in caplog.records if "RemappedRows" in r.getMessage()]) <= 1
    dev = poller.readings()[0]
    assert "remapped_rows" in dev["unsupported"] and "temperature" in dev["supported"]
    assert dev["values"]["nvml_gpu_temp_c"] == 35
    assert poller.errors == 0


def test_gpu_is_lost_gives_one_record_and_the_device_is_left_alone():
    poller, sink, fake = _poller(
        {
            "devices": [
                {
                    "uuid": UUID0,
                    "values": {"nvmlDeviceGetPowerUsage": [70_000, 71_000, "GpuIsLost"]},
                },
                {"uuid": UUID1},
            ]
        }
    )
    assert poller.poll_once() == [] and poller.poll_once() == []
    recs = poller.poll_once()
    assert _codes(recs) == ["NVML_GPU_IS_LOST"]
    assert recs[0].gpu_uuid == UUID0 and recs[0].gpu_index == 0
    calls_after_loss = fake.device_calls(0)
    power1 = fake.calls[("nvmlDeviceGetPowerUsage", 1)]
    for _ in range(5):
        assert poller.poll_once() == []
    assert fake.device_calls(0) == calls_after_loss  # not polled again
    assert fake.calls[("nvmlDeviceGetPowerUsage", 1)] == power1 + 5  # the other GPU is
    assert sink.codes() == ["NVML_GPU_IS_LOST"]
    assert "lost: gpu0" in poller.status()
    assert poller.readings()[0]["values"]["nvml_gpu_up"] == 0


def test_gpu_lost_before_start_is_one_record():
    poller, sink, _ = _poller({"devices": [{"handle_error": "GpuIsLost"}, {}]})
    poller.poll_once()
    poller.poll_once()
    assert sink.codes() == ["NVML_GPU_IS_LOST"]
    assert sink.records[0].gpu_index == 0


@pytest.mark.parametrize("error", ["LibraryNotFound", "DriverNotLoaded"])
def test_no_driver_is_a_status_line_never_an_exception(error):
    poller, sink, _ = _poller({"init_error": error})
    line = poller.start()
    assert line.startswith(NO_DRIVER + " (") and "\n" not in line
    assert poller.status() == line
    assert poller.poll_once() == []
    poller.stop()
    assert sink.records == [] and sink.metrics == []
    out = io.StringIO()
    assert run_cli(once=True, nvml=FakeNvml({"init_error": error}), out=out) == 0
    assert out.getvalue().strip() == line
    out = io.StringIO()
    assert run_cli(once=False, nvml=FakeNvml({"init_error": error}), out=out, duration=0.1) == 0
    assert out.getvalue().strip() == line


def test_no_pynvml_module_is_the_same_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    poller = NvmlPoller(MemorySink())
    line = poller.start()
    assert line.startswith(NO_DRIVER) and "pynvml" in line
    poller.stop()


def test_driver_library_mismatch_is_a_record_and_a_status():
    poller, sink, _ = _poller({"init_error": "LibRmVersionMismatch"})
    line = poller.start()
    assert line.startswith("NVML unavailable") and poller.available is False
    assert sink.codes() == ["NVML_DRIVER_LIBRARY_MISMATCH"]


# ---------------------------------------------------------------- rows and store


def test_metric_rows_fit_the_metrics_table_and_are_written_on_change():
    poller, sink, _ = _poller(
        {
            "devices": [
                {
                    "uuid": UUID0,
                    "nvlink_links": 1,
                    "values": {"nvmlDeviceGetPowerUsage": [70_000, 250_500, 250_500]},
                }
            ]
        },
        heartbeat_s=3600,
    )
    poller.poll_once()
    first = list(sink.metrics)
    tab = S.records_to_arrow(first, S.METRICS)
    assert tab.num_rows == len(first) > 15
    names = set(tab.column("name").to_pylist())
    for name in (
        "nvml_gpu_temp_c",
        "nvml_power_w",
        "nvml_fb_used_bytes",
        "nvml_fb_total_bytes",
        "nvml_gpu_util_pct",
        "nvml_mem_util_pct",
        "nvml_ecc_corrected_volatile_total",
        "nvml_ecc_uncorrected_volatile_total",
        "nvml_remap_pending",
        "nvml_pcie_replay_total",
        "nvml_nvlink_errors_total",
        "nvml_clocks_event_reasons",
        "nvml_gpu_up",
    ):
        assert name in names, name
    for row in first:
        labels = json.loads(row["labels"])
        assert labels["gpu"] == "0" and labels["uuid"] == UUID0
        assert row["gpu_uuid"] == UUID0 and row["source"] == SOURCE
        assert isinstance(row["value"], float) and row["ts"] > 0
    nvl = [json.loads(r["labels"]) for r in first if r["name"] == "nvml_nvlink_errors_total"]
    assert {(x["link"], x["counter"]) for x in nvl} == {("0", "crc_flit"), ("0", "crc_data")}
    power = [r["value"] for r in first if r["name"] == "nvml_power_w"]
    assert power == [70.0]
    poller.poll_once()  # only the power changed
    assert [(r["name"], r["value"]) for r in sink.metrics[len(first) :]] == [
        ("nvml_power_w", 250.5)
    ]
    n = len(sink.metrics)
    poller.poll_once()  # nothing changed
    assert len(sink.metrics) == n
    poller.heartbeat_s = 0.0
    poller.poll_once()  # heartbeat: everything again
    assert len(sink.metrics) == n + len(first)


def test_records_and_metrics_load_through_the_real_spool(tmp_path: Path):
    spool = tmp_path / "spool"
    sink = SpoolSink(spool)
    fake = FakeNvml(
        {
            "devices": [
                {
                    "uuid": UUID0,
                    "values": {"nvmlDeviceGetCurrentClocksEventReasons": [0, 0x40]},
                }
            ],
            "events": [{"type": "xid", "data": 48}, {"type": "xid", "data": 77}],
        }
    )
    poller = NvmlPoller(sink, nvml=fake)
    recs = poller.poll_once() + poller.poll_once()
    poller.stop()  # flushes the sink
    assert _codes(recs) == ["GPU_XID_48", "GPU_XID_OTHER", "GPU_HW_THERMAL_SLOWDOWN"]
    store = Store(tmp_path / "db" / "rca.duckdb", lock_timeout=30)
    rep = load_spool(store, spool)
    assert rep.quarantined == 0
    assert rep.rows["error_context"] == 3
    assert rep.rows["metrics"] == poller.metrics_emitted > 0
    with store.read() as con:
        tab = con.sql("SELECT * FROM error_context ORDER BY event_id").to_arrow_table()
        metrics = con.sql(
            "SELECT name, value FROM metrics WHERE name = 'nvml_gpu_temp_c'"
        ).fetchall()
    got = {r.code: r for r in S.arrow_to_records(tab)}
    assert got["GPU_XID_48"].xid == 48 and got["GPU_XID_48"].gpu_uuid == UUID0
    assert got["GPU_XID_OTHER"].xid == 77
    assert got["GPU_HW_THERMAL_SLOWDOWN"].attrs["reasons"] == "0x40"
    assert metrics == [("nvml_gpu_temp_c", 35.0)]


# ---------------------------------------------------------------- threads, CLI, cost


def test_background_threads_deliver_events_and_stop_cleanly():
    poller, sink, fake = _poller({}, interval_s=0.02, event_timeout_ms=50)
    line = poller.start()
    assert line.startswith("nvml: 1 GPU(s)")
    fake.push_event(0, "xid", 79)
    deadline = time.monotonic() + 5
    while "GPU_XID_79" not in sink.codes() and time.monotonic() < deadline:
        time.sleep(0.01)
    poller.stop()
    assert sink.codes() == ["GPU_XID_79"]
    assert poller.polls >= 1
    assert fake.initialized == 0  # nvmlShutdown called
    assert fake.calls[("nvmlEventSetFree", None)] == 1
    assert poller.errors == 0


def test_run_cli_once_prints_a_table_or_json_lines():
    out = io.StringIO()
    fake = FakeNvml({"devices": [{"uuid": UUID0}], "events": [{"type": "xid", "data": 48}]})
    assert run_cli(once=True, nvml=fake, out=out) == 0
    text = out.getvalue()
    assert "nvml_gpu_temp_c" in text and UUID0 in text and "GPU_XID_48" in text
    out = io.StringIO()
    assert run_cli(once=True, nvml=FakeNvml(), out=out, as_json=True) == 0
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert lines and all("metric" in x or "record" in x for x in lines)
    S.records_to_arrow([x["metric"] for x in lines if "metric" in x], S.METRICS)


def test_run_cli_writes_the_spool_until_stopped(tmp_path: Path):
    out = io.StringIO()
    fake = FakeNvml({"events": [{"type": "xid", "data": 48}]})
    code = run_cli(
        once=False, interval=0.05, spool=tmp_path / "spool", nvml=fake, out=out, duration=0.3
    )
    assert code == 0
    assert "GPU_XID_48" in out.getvalue()
    store = Store(tmp_path / "rca.duckdb", lock_timeout=30)
    rep = load_spool(store, tmp_path / "spool")
    assert rep.rows["error_context"] == 1 and rep.rows["metrics"] > 0


def test_cpu_cost_per_poll_is_small():
    """60 polls of 8 GPUs with 18 NVLink links each against the fake: the probe's
    own work (and the fake's) must stay far below 1% of a core at 1 s."""
    devices = [{"nvlink_links": 18} for _ in range(8)]
    poller, _, _ = _poller({"devices": devices})
    poller.poll_once()  # init and first rows
    t0 = time.process_time()
    for _ in range(60):
        poller.poll_once()
    per_poll = (time.process_time() - t0) / 60
    print(f"nvml probe CPU per poll (8 GPUs, fake NVML): {per_poll * 1e3:.3f} ms")
    assert per_poll < 0.010  # 1% of one core at a 1 s interval


def test_stop_then_poll_again_reinitializes_without_duplicating_devices():
    poller, _, fake = _poller({"devices": [{}, {}]})
    poller.poll_once()
    poller.stop()
    assert fake.initialized == 0
    poller.poll_once()
    assert len(poller.devices) == 2 and fake.initialized == 1
    poller.stop()
