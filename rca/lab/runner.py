"""Run lab scenarios: a workload against the lab server with injected faults,
everything captured through the real probes, spool and ingest into a store.

A scenario is one engine lifetime on one simulated host (``lab-<id>``): the
lab server (ASGI app in-process, the engine stepped from the same event loop
so runs are repeatable), a mixed workload of ordinary requests, the requests
a fault needs, background noise (benign preemptions from a tight KV pool, an
unrelated client sending bad parameters, a healthy GPU's readings) and one
primary fault, sometimes a second concurrent one. After the run the spool is
loaded, the engine and kernel logs and the metric scrapes are ingested, and the
trace of the first request the primary fault hit is the incident.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import secrets
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest.paths import spool_dir_for
from ingest.store import Store

__all__ = [
    "Scenario",
    "RunOutcome",
    "run_scenario",
    "make_scenarios",
    "generate_incidents",
    "PROMPTS",
]

PROMPTS = (
    "Summarize the incident report in two sentences.",
    "Translate to French: the cache is warm.",
    "Write a haiku about GPUs.",
    "What is the capital of Australia?",
    "List three prime numbers.",
    "Explain paged attention briefly.",
    "def fib(n):",
    "The quick brown fox",
    '{"tool": "search", "query": "weather in Oslo"}',
    "Once upon a time in a datacenter",
)


#: Background noise on a healthy replica, in the kernel's own words: a corrected
#: PCIe error, a row marked for remapping, a contained ECC error in another
#: process's channel. Each lands in kern.log at a random tick of the run.
NOISE_KERNEL_LINES = (
    "pcieport 0000:00:03.1: AER: Corrected error received: 0000:3b:00.0",
    "nvidia 0000:3b:00.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)",
    "NVRM: Xid (PCI:0000:3b:00): 63, pid='<unknown>', name=<unknown>, Row Remapper: New row "
    "(0x00000000003f7d20) Marked for Remap",
    "NVRM: Xid (PCI:0000:3b:00): 94, pid=4123, name=python3, Contained: CE User Channel (0x9). "
    "RST: No, D-RST: No",
)


@dataclass
class Scenario:
    scenario_id: str
    host: str
    primary: str  # fault type name
    secondary: str | None = None
    seed: int = 0
    n_requests: int = 10
    at_step: int = 20
    noise_bad_client: bool = False
    tight_pool: bool = False
    #: (tick, line) kernel noise lines written during the run
    noise_kernel: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class RequestLog:
    index: int
    trace_id: str
    path: str
    at: int
    status: int | None = None
    request_id: str | None = None
    victim_of: str | None = None
    body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunOutcome:
    scenario: Scenario
    code: str
    family: str
    requests: list[RequestLog]
    incident_trace: str | None
    inject_ns: int | None
    series: list[dict[str, Any]]
    series_codes: dict[str, str]
    statuses: Counter
    secondary_code: str | None = None
    seconds: float = 0.0
    drive_seconds: float = 0.0

    def status_counts(self) -> dict[int, int]:
        return dict(self.statuses)


# ---------------------------------------------------------------------------
# a sink that puts the simulated host on everything the probes emit
# ---------------------------------------------------------------------------
class HostSink:
    """Wrap a sink: records, spans and metric rows carry the lab's host name."""

    def __init__(self, inner: Any, host: str) -> None:
        self.inner = inner
        self.host = host

    def emit(self, record: Any) -> None:
        if dataclasses.is_dataclass(record) and hasattr(record, "host"):
            record = dataclasses.replace(record, host=self.host)
        self.inner.emit(record)

    def emit_metric(self, row: dict[str, Any]) -> None:
        row = dict(row)
        row["host"] = self.host
        self.inner.emit_metric(row)

    def flush(self) -> None:
        f = getattr(self.inner, "flush", None)
        if f:
            f()


# ---------------------------------------------------------------------------
# scenarios
# ---------------------------------------------------------------------------
def make_scenarios(
    n: int, seed: int, *, types: list[str] | None = None, two_fault_share: float = 0.2
) -> list[Scenario]:
    """``n`` scenarios cycling over the fault types (shuffled per round), each
    with its own host, seed, injection step and background noise; about
    ``two_fault_share`` of them carry a second, concurrent request-level fault."""
    from rca.lab.faults import NOISE_FAULTS, fault_types

    rng = random.Random(seed)
    names = list(types or fault_types())
    out: list[Scenario] = []
    order: list[str] = []
    for i in range(n):
        if not order:
            order = names[:]
            rng.shuffle(order)
        primary = order.pop()
        secondary = None
        if rng.random() < two_fault_share:
            choices = [f for f in NOISE_FAULTS if f != primary]
            secondary = rng.choice(choices) if choices else None
        out.append(
            Scenario(
                scenario_id=f"{seed}-{i:04d}",
                host=f"lab-{seed}-{i:04d}",
                primary=primary,
                secondary=secondary,
                seed=rng.randrange(1 << 30),
                n_requests=rng.randint(6, 12),
                at_step=rng.randint(12, 40),
                noise_bad_client=rng.random() < 0.35,
                tight_pool=rng.random() < 0.5,
                noise_kernel=[
                    (rng.randrange(0, 60), rng.choice(NOISE_KERNEL_LINES))
                    for _ in range(rng.choice((0, 0, 1, 1, 2)))
                ],
            )
        )
    return out


# ---------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------
def _base_config(sc: Scenario, faults: list[Any]) -> Any:
    from rca.lab.model import LabConfig

    # the lab checks every module's output (the numerical tier), so a fault is
    # caught at the op where it starts, not only at the logits
    overrides: dict[str, Any] = {"seed": sc.seed % 1000, "checker_tiers": "numerical"}
    if sc.tight_pool:
        overrides["num_blocks"] = 40  # benign preemptions under load
    for f in faults:
        overrides.update(f.config())
    fields = {f.name for f in dataclasses.fields(LabConfig)}
    known = {k: v for k, v in overrides.items() if k in fields}
    return LabConfig(**known), {k: v for k, v in overrides.items() if k not in fields}


def _workload(sc: Scenario, faults: list[Any], rng: random.Random) -> list[dict[str, Any]]:
    reqs: list[dict[str, Any]] = []
    horizon = sc.at_step + 25
    for _ in range(sc.n_requests):
        body: dict[str, Any] = {
            "prompt": rng.choice(PROMPTS) * rng.randint(1, 3),
            "max_tokens": rng.randint(8, 24),
            "temperature": rng.choice([0.0, 0.0, 0.7]),
            "seed": rng.randrange(1 << 16),
        }
        reqs.append({"at": rng.randrange(0, horizon), "body": body})
    if sc.noise_bad_client:  # an unrelated client with a bad parameter
        reqs.append(
            {
                "at": rng.randrange(0, horizon),
                "body": {"prompt": "ping", "max_tokens": 0},
            }
        )
    for f in faults:
        for r in f.workload():
            r = dict(r)
            body = dict(r["body"])
            if body.get("lora_path") == "@adapter":
                body["lora_path"] = getattr(f, "adapter_path", "")
            r["body"] = body
            if r.pop("victim", False):
                r["victim_of"] = f.name
            if not r.pop("traffic", False):
                r["fault"] = f.name
            reqs.append(r)
    reqs.sort(key=lambda r: r["at"])
    return reqs


async def _drive(
    engine: Any,
    app: Any,
    reqs: list[dict[str, Any]],
    faults: list[Any],
    *,
    tick_s: float,
    max_s: float,
    scrape: Callable[[], None],
    scrape_s: float = 0.15,
    tail_samples: int = 15,
    kernel_noise: list[tuple[int, str]] = (),  # type: ignore[assignment]
) -> list[RequestLog]:
    """Send the workload through the ASGI app (arrivals in ticks of ``tick_s``)
    while the engine steps on its own thread, as a server does."""
    from rca.lab.server import LabClient

    logs: list[RequestLog] = []
    tasks: list[asyncio.Task] = []
    by_fault = {f.name: f for f in faults}
    client = LabClient(app, drive=False)  # the engine steps on its own thread

    async def send(log: RequestLog, body: dict[str, Any]) -> None:
        tp = f"00-{log.trace_id}-{secrets.token_hex(8)}-01"
        headers = [(b"content-type", b"application/json"), (b"traceparent", tp.encode())]
        try:
            status, data = await client.arequest(
                "POST", log.path, json.dumps(body).encode(), headers
            )
        except Exception:  # the app raised before answering: the server sends a 500
            status, data = 500, None
        log.status = status
        if isinstance(data, dict) and isinstance(data.get("id"), str):
            log.request_id = data["id"]

    pending = list(reqs)
    noise = sorted(kernel_noise)
    t_end = time.monotonic() + max_s
    next_scrape = 0.0
    it = 0
    while time.monotonic() < t_end:
        while pending and pending[0]["at"] <= it:
            r = pending.pop(0)
            body = dict(r["body"])
            if body.get("lora_path") == "@adapter":
                owner = next((f for f in faults if hasattr(f, "adapter_path")), None)
                body["lora_path"] = getattr(owner, "adapter_path", "")
            log = RequestLog(
                index=len(logs),
                trace_id=secrets.token_hex(16),
                path=r.get("path", "/v1/completions"),
                at=it,
                victim_of=r.get("victim_of"),
                body={k: v for k, v in body.items() if k != "prompt"},
            )
            logs.append(log)
            tasks.append(asyncio.create_task(send(log, body)))
            if r.get("fault") in by_fault:  # the fault's own request: injected now
                by_fault[r["fault"]].mark()
        for f in faults:
            if not f.armed and it >= f.at_step:
                f.armed = True
        while noise and noise[0][0] <= it:
            engine.kernel_log(noise.pop(0)[1])
        if time.monotonic() >= next_scrape:  # the lab's compressed scrape interval
            scrape()
            next_scrape = time.monotonic() + scrape_s
        await asyncio.sleep(tick_s)
        it += 1
        if not pending and all(t.done() for t in tasks):
            break
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(tail_samples):  # keep observing a little after the last answer
        engine.sample()
        await asyncio.sleep(tick_s)
    scrape()
    return logs


def _driver_boot_lines(engine: Any) -> None:
    """What the NVIDIA driver prints for each GPU when it loads: the PCI bus id
    to UUID line that lets kern.log's Xid lines name their GPU."""
    for dev in engine.nvml.script.get("devices", []):
        bus = str(dev.get("pci_bus_id", "00000000:3B:00.0"))
        dom, b, rest = bus.split(":")
        engine.kernel_log(
            f"NVRM: GPU at PCI:{dom[-4:]}:{b.lower()}:{rest.lower()}: {dev.get('uuid', '')}"
        )


def _pick_incident(logs: list[RequestLog], primary: Any, engine: Any) -> RequestLog | None:
    """The trace the primary fault hit: a request built as its victim, else the
    first request in its ``victims`` (by request id) that failed, else the
    first failure with the fault's status after the injection."""
    failed = [lg for lg in logs if lg.status is not None and lg.status >= 400]
    for lg in failed:
        if lg.victim_of == primary.name and lg.status == primary.status:
            return lg
    by_trace = {lg.trace_id: lg for lg in logs}
    for tid in primary.victims:
        lg = by_trace.get(tid)
        if lg is not None and lg.status is not None and lg.status >= 400:
            return lg
    for lg in failed:
        if lg.victim_of == primary.name:
            return lg
    for lg in failed:
        if lg.status == primary.status and lg.victim_of is None and lg.path == "/v1/completions":
            return lg
    return None


def run_scenario(
    sc: Scenario,
    store: Store,
    work_dir: Path,
    *,
    tick_s: float = 0.004,
    max_s: float = 20.0,
) -> RunOutcome:
    """Run one scenario into ``store``; see the module docstring."""
    import torch

    from ingest.pipeline import ingest_paths
    from ingest.prometheus import ThresholdTracker, parse_exposition
    from ingest.spool import SpoolWriter, load_spool
    from probes.sink import SpoolSink
    from rca.lab.engine import LabEngine
    from rca.lab.faults import make_fault
    from rca.lab.server import build_app

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rng = random.Random(sc.seed)
    primary = make_fault(sc.primary, random.Random(rng.randrange(1 << 30)), sc.at_step)
    faults = [primary]
    if sc.secondary:
        faults.append(
            make_fault(sc.secondary, random.Random(rng.randrange(1 << 30)), sc.at_step + 3)
        )
    config, _unknown = _base_config(sc, faults)
    run_dir = work_dir / sc.scenario_id
    spool = spool_dir_for(store.path)
    inner = SpoolSink(spool)
    sink = HostSink(inner, sc.host)
    script: dict[str, Any] = {}
    for f in faults:
        script.update(getattr(f, "nvml_script", dict)())
    engine = LabEngine(
        config, run_dir, host=sc.host, faults=faults, sink=sink, fake_nvml_script=script or None
    )
    _driver_boot_lines(engine)
    app = build_app(engine)
    reqs = _workload(sc, faults, rng)
    tracker = ThresholdTracker()
    scrape_writer = SpoolWriter(spool)

    def scrape() -> None:
        res = parse_exposition(
            engine.metrics_text(), source=f"http://{sc.host}:8000/metrics", host=sc.host
        )
        for row in res.samples:
            scrape_writer.emit_metric(row)
        for rec in tracker.feed(res):
            scrape_writer.emit(dataclasses.replace(rec, host=sc.host))

    # the probes' own log lines (rate-limited warnings) go to the replica's
    # folder, as a server's would go to its log, not to the caller's terminal
    plog = logging.getLogger("rca.probes")
    handler = logging.FileHandler(run_dir / "probes.log", encoding="utf-8")
    saved = (plog.propagate, plog.level)
    plog.addHandler(handler)
    plog.propagate = False
    plog.setLevel(logging.INFO)
    engine.start()
    try:
        logs = asyncio.run(
            _drive(
                engine,
                app,
                reqs,
                faults,
                tick_s=tick_s,
                max_s=max_s,
                scrape=scrape,
                kernel_noise=list(sc.noise_kernel),
            )
        )
    finally:
        engine.stop()
        plog.removeHandler(handler)
        handler.close()
        plog.propagate, plog.level = saved
        scrape_writer.close()
        inner.writer.close()
        engine.close()
    t_drive = time.perf_counter() - t0
    load_spool(store, spool)
    logs_in = [p for p in (run_dir / "engine.log", run_dir / "kern.log") if p.exists()]
    if logs_in:
        ingest_paths(store, logs_in, host=sc.host)
    inc = _pick_incident(logs, primary, engine)
    statuses = Counter(lg.status for lg in logs if lg.status is not None)
    return RunOutcome(
        scenario=sc,
        code=primary.code,
        family=primary.family(),
        requests=logs,
        incident_trace=inc.trace_id if inc else None,
        inject_ns=primary.inject_ns,
        series=list(engine.series),
        series_codes=dict(engine.series_codes),
        statuses=statuses,
        secondary_code=faults[1].code if len(faults) > 1 else None,
        seconds=time.perf_counter() - t0,
        drive_seconds=t_drive,
    )


# ---------------------------------------------------------------------------
# incidents for the accuracy benchmark
# ---------------------------------------------------------------------------
def _incident(sc: Scenario, base: Path, keep: bool) -> Any:
    """Run one scenario in its own store; an Incident, or the fault's name when
    the fault failed no request (then there is nothing to rank)."""
    from rca.bench.accuracy import Incident, frame_from_series
    from rca.query import gather_evidence

    d = base / sc.scenario_id
    d.mkdir(parents=True, exist_ok=True)
    try:
        store = Store(d / "lab.duckdb")
        res = run_scenario(sc, store, d)
        if res.incident_trace is None:
            return sc.primary
        return Incident(
            incident_id=sc.scenario_id,
            fault=sc.primary,
            family=res.family,
            code=res.code,
            gathered=gather_evidence(res.incident_trace, store),
            frame=frame_from_series(res.series) if res.series else None,
            inject_time=res.inject_ns / 1e9 if res.inject_ns else None,
            column_codes=dict(res.series_codes),
        )
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)
    logging.getLogger("rca.probes").setLevel(logging.ERROR)


def generate_incidents(
    n: int,
    seed: int,
    *,
    progress: Callable[[int, int], None] | None = None,
    types: list[str] | None = None,
    keep_dir: Path | None = None,
    jobs: int | None = None,
) -> list[Any]:
    """Run ``n`` scenarios, one store each, and return one
    :class:`rca.bench.accuracy.Incident` per scenario whose fault hit a request
    (a scenario whose fault failed nobody is dropped; the fault names are in
    ``generate_incidents.last_dropped``). Scenarios mostly wait (deadlines,
    stalls), so ``jobs`` worker processes (default 3) run them side by side;
    each scenario's outcome does not depend on the others."""
    scenarios = make_scenarios(n, seed, types=types)
    jobs = 3 if jobs is None else max(1, jobs)
    keep = keep_dir is not None
    base = Path(tempfile.mkdtemp(prefix="rca-lab-")) if keep_dir is None else keep_dir
    results: dict[str, Any] = {}
    try:
        if jobs == 1:
            for i, sc in enumerate(scenarios):
                try:
                    results[sc.scenario_id] = _incident(sc, base, keep)
                except Exception as exc:  # one broken scenario must not sink the run
                    results[sc.scenario_id] = f"{sc.primary}: error: {exc!r}"
                if progress is not None:
                    progress(i + 1, len(scenarios))
        else:
            import concurrent.futures as cf
            import multiprocessing as mp

            ctx = mp.get_context("spawn")  # torch and threads: never fork
            with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init) as pool:
                futs = {pool.submit(_incident, sc, base, keep): sc for sc in scenarios}
                for done, fut in enumerate(cf.as_completed(futs), 1):
                    sc = futs[fut]
                    try:
                        results[sc.scenario_id] = fut.result()
                    except Exception as exc:  # one broken scenario must not sink the run
                        results[sc.scenario_id] = f"{sc.primary}: error: {exc!r}"
                    if progress is not None:
                        progress(done, len(scenarios))
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    out = [results[sc.scenario_id] for sc in scenarios]
    generate_incidents.last_dropped = [r for r in out if isinstance(r, str)]  # type: ignore[attr-defined]
    return [r for r in out if not isinstance(r, str)]
