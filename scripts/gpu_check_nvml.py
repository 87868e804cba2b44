#!/usr/bin/env python3
"""Check the NVML probe on a real GPU: what it sees, what it costs.

    PYTHONPATH=. python3 scripts/gpu_check_nvml.py [--seconds 20] [--out report.json]

1. one synchronous poll (events drained without waiting): devices, supported and
   unsupported readings, the latest values;
2. the probe's own threads at a 1 s interval for ``--seconds``: process CPU time
   (resource.getrusage, all threads) and RSS per poll, against the budget (under
   1% of one core, under 100 MB);
3. a few polls through a timing wrapper: microseconds per NVML function;
4. the records and a few metric rows.

``--fake`` runs the same steps on probes.fake_nvml (a dry run without a GPU).

Exit status: 0 when NVML initialized, 2 when it could not (the probe's one-line
status is printed, e.g. "no NVIDIA driver: NVML unavailable (...)"), 3 with
``--strict`` when the budget was exceeded. Needs only pynvml (nvidia-ml-py),
pyarrow and this repository: no DuckDB, no store (a MemorySink collects).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from probes.nvml import NvmlPoller, _handle_key  # noqa: E402
from probes.sink import MemorySink  # noqa: E402

CPU_BUDGET = 0.01  # share of one core
RSS_BUDGET_MB = 100.0


def _rss_mb() -> float:
    """Current resident set (Linux /proc), else the peak from getrusage."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return _maxrss_mb()


def _maxrss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform == "darwin" else kb / 1024


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _Timed:
    """pynvml with every nvml* function timed (perf_counter per call)."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self.times: dict[str, list[float]] = defaultdict(list)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if not (name.startswith("nvml") and callable(value) and not isinstance(value, type)):
            return value
        times = self.times[name]

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return value(*args, **kw)
            finally:
                times.append(time.perf_counter() - t0)

        return timed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="threaded run length")
    ap.add_argument("--interval", type=float, default=1.0, help="poll interval (s)")
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    ap.add_argument("--strict", action="store_true", help="exit 3 when over budget")
    ap.add_argument("--fake", action="store_true", help="dry run on probes.fake_nvml")
    args = ap.parse_args(argv)
    nvml_arg: Any = None
    if args.fake:
        from probes.fake_nvml import FakeNvml

        script = {
            "devices": [{"nvlink_links": 2}],
            "events": [{"type": "xid", "data": 48}],
        }
        nvml_arg = FakeNvml(script)
    report: dict[str, Any] = {"python": sys.version.split()[0]}
    rss_start = _rss_mb()

    # 1. one synchronous poll ------------------------------------------------
    sink = MemorySink()
    poller = NvmlPoller(sink, nvml=nvml_arg, interval_s=args.interval)
    t0 = time.perf_counter()
    first = poller.poll_once()
    first_wall = time.perf_counter() - t0
    line = poller.status()
    print(line)
    report["status"] = line
    if not poller.available:
        report["available"] = False
        _write(args.out, report)
        return 2
    report["available"] = True
    nv = poller._nvml
    report["pynvml"] = getattr(nv, "__file__", None)
    print(f"first poll (init included): {first_wall * 1e3:.1f} ms, {len(first)} record(s)")
    devices = poller.readings()
    for dev in devices:
        print(
            f"GPU {dev['index']}: {dev['name']} {dev['uuid']} {dev['pci_bus_id']} "
            f"events=0x{dev['events']:x} lost={dev['lost']}"
        )
        print(f"  supported:   {', '.join(dev['supported'])}")
        print(f"  unsupported: {', '.join(dev['unsupported']) or '-'}")
        for key, value in dev["values"].items():
            print(f"    {key:<52} {value}")
    # a real event's data.device must map back to the handle the poller keeps
    same = [
        _handle_key(nv.nvmlDeviceGetHandleByIndex(d.index)) == _handle_key(d.handle)
        for d in poller.devices
        if d.handle is not None
    ]
    print(f"device handle keys stable across lookups: {all(same)}")
    report["handle_keys_stable"] = all(same)
    report["devices"] = devices
    poller.stop()

    # 2. threaded run: CPU and RSS per poll ----------------------------------
    sink = MemorySink()
    poller = NvmlPoller(sink, nvml=nvml_arg, interval_s=args.interval)
    cpu0, rss0 = _cpu_s(), _rss_mb()
    wall0 = time.monotonic()
    print(poller.start())
    time.sleep(args.seconds)
    polls = poller.polls
    poller.stop()
    wall = time.monotonic() - wall0
    cpu = _cpu_s() - cpu0
    rss1 = _rss_mb()
    per_poll_ms = cpu / max(polls, 1) * 1e3
    core_share = cpu / wall
    threaded = {
        "seconds": round(wall, 2),
        "polls": polls,
        "process_cpu_s": round(cpu, 4),
        "cpu_per_poll_ms": round(per_poll_ms, 3),
        "poll_thread_cpu_per_poll_ms": round(poller.poll_cpu_s / max(polls, 1) * 1e3, 3),
        "core_share_pct": round(core_share * 100, 4),
        "rss_mb_start_of_script": round(rss_start, 1),
        "rss_mb_before": round(rss0, 1),
        "rss_mb_after": round(rss1, 1),
        "maxrss_mb": round(_maxrss_mb(), 1),
        "records": poller.records_emitted,
        "metric_rows": poller.metrics_emitted,
        "metric_rows_per_poll": round(poller.metrics_emitted / max(polls, 1), 2),
        "errors": poller.errors,
    }
    within = core_share < CPU_BUDGET and _maxrss_mb() < RSS_BUDGET_MB
    threaded["within_budget"] = within
    report["threaded"] = threaded
    print(
        f"threaded {wall:.1f} s at {args.interval:g} s: {polls} polls, "
        f"process CPU {per_poll_ms:.3f} ms/poll ({core_share * 100:.4f}% of a core), "
        f"poll thread {threaded['poll_thread_cpu_per_poll_ms']} ms/poll, "
        f"RSS {rss1:.1f} MB (max {_maxrss_mb():.1f}), "
        f"{threaded['metric_rows_per_poll']} metric rows/poll, errors {poller.errors}: "
        f"{'within' if within else 'OVER'} budget"
    )

    # 3. NVML functions timed ------------------------------------------------
    if nvml_arg is None:
        import pynvml as nvml_arg

    timed = _Timed(nvml_arg)
    tp = NvmlPoller(MemorySink(), nvml=timed, interval_s=args.interval)
    for _ in range(5):
        tp.poll_once()
    tp.stop()
    per_fn = {
        name: {"calls": len(ts), "mean_us": round(sum(ts) / len(ts) * 1e6, 1)}
        for name, ts in sorted(timed.times.items())
        if ts
    }
    report["nvml_functions"] = per_fn
    print("NVML functions (5 polls + init):")
    for name, v in per_fn.items():
        print(f"  {name:<46} {v['calls']:>5} calls {v['mean_us']:>10.1f} us")

    # 4. records and metric rows ---------------------------------------------
    recs = [r.to_row() for r in sink.records]
    report["records"] = recs
    report["metric_rows_sample"] = sink.metrics[:12]
    print(f"records ({len(recs)}):")
    for r in recs:
        print(f"  {r['code']} gpu{r['gpu_index']} xid={r['xid']} {r['message']}")
    print("metric rows (first 8):")
    for row in sink.metrics[:8]:
        print("  " + json.dumps(row, sort_keys=True))
    _write(args.out, report)
    return 3 if args.strict and not within else 0


def _write(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
