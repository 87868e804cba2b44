"""`rca bench query`: fill a store with N realistic records, then time `rca query`."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from graph.catalog import Catalog, default_catalog
from ingest import schema as S
from ingest.bulk import bulk_writer
from ingest.store import Store

__all__ = ["fill_store", "run_query_bench"]

T0_NS = 1_795_000_000 * 1_000_000_000  # 2026-11-19
DAY_NS = 86_400 * 1_000_000_000


def _hex_ids(rng: np.random.Generator, n: int, nbytes: int) -> pa.Array:
    import polars as pl

    buf = rng.bytes(nbytes * n)
    arr = pa.FixedSizeBinaryArray.from_buffers(pa.binary(nbytes), n, [None, pa.py_buffer(buf)])
    return pl.Series(arr.cast(pa.binary())).bin.encode("hex").to_arrow().cast(pa.string())


def _uuid_ids(hexes: pa.Array) -> pa.Array:
    import polars as pl

    s = pl.Series(hexes)
    return (
        (
            s.str.slice(0, 8)
            + "-"
            + s.str.slice(8, 4)
            + "-7"
            + s.str.slice(13, 3)
            + "-8"
            + s.str.slice(17, 3)
            + "-"
            + s.str.slice(20, 12)
        )
        .to_arrow()
        .cast(pa.string())
    )


def _code_table(catalog: Catalog) -> tuple[list[Any], np.ndarray]:
    """Codes weighted as a fleet sees them: warnings and capacity events dominate."""
    codes = list(catalog)
    w = np.array(
        [
            {"info": 8.0, "warning": 6.0, "error": 2.0, "critical": 0.5}[str(c.severity)]
            * (3.0 if c.layer >= 5 else 1.0)
            for c in codes
        ]
    )
    return codes, w / w.sum()


def fill_store(
    store: Store,
    rows: int,
    *,
    seed: int = 7,
    hosts: int = 64,
    gpus_per_host: int = 8,
    batch: int = 1_000_000,
    progress: Any = None,
    catalog: Catalog | None = None,
) -> list[str]:
    """Append ``rows`` realistic records (and one server span per trace).

    Records come in time order over 24 h; ~3.5 records per trace on average,
    10% host-level (no trace: kernel, NVML, metrics). Returns the ids of the
    traces that carry records, for sampling queries.
    """
    catalog = catalog or default_catalog()
    rng = np.random.default_rng(seed)
    codes, probs = _code_table(catalog)
    names = pa.array([c.name for c in codes])
    fams = pa.array([c.family for c in codes])
    layers = pa.array([c.layer for c in codes], pa.int8())
    sev = pa.array([str(c.severity) for c in codes])
    stages = pa.array([str(c.stage) for c in codes])
    recov = pa.array([str(c.recoverability) for c in codes])
    msgs = pa.array([(c.examples[0] if c.examples else c.summary)[:300] for c in codes])
    host_names = pa.array([f"gpu-node-{i:03d}" for i in range(hosts)])
    gpu_uuids = _uuid_ids(_hex_ids(rng, hosts * gpus_per_host, 16))
    gpu_uuids = pa.array(["GPU-" + u for u in gpu_uuids.to_pylist()])
    sample_traces: list[str] = []
    done = 0
    with bulk_writer(store) as con:
        while done < rows:
            n = min(batch, rows - done)
            ts = T0_NS + (np.arange(done, done + n, dtype=np.int64) * (DAY_NS // max(rows, 1)))
            ts += rng.integers(0, 1_000_000, n)
            code_idx = pa.array(rng.choice(len(codes), n, p=probs))
            n_traces = max(1, n // 4)
            trace_pool = _hex_ids(rng, n_traces, 16)
            # consecutive records share a trace (a request's evidence arrives together),
            # and a trace runs on one host and GPU
            tr_idx = np.minimum(np.arange(n) // 4 + rng.integers(-1, 2, n), n_traces - 1)
            tr_idx = np.maximum(tr_idx, 0)
            trace_host = rng.integers(0, hosts, n_traces)
            trace_gpu = rng.integers(0, gpus_per_host, n_traces)
            has_trace = rng.random(n) >= 0.10
            host_idx = np.where(has_trace, trace_host[tr_idx], rng.integers(0, hosts, n))
            gpu_local = np.where(has_trace, trace_gpu[tr_idx], rng.integers(0, gpus_per_host, n))
            trace = pa.array(trace_pool).take(pa.array(tr_idx))
            trace = pa.compute.if_else(pa.array(has_trace), trace, pa.scalar(None, pa.string()))
            span_ids = _hex_ids(rng, n, 8)
            req = pa.compute.binary_join_element_wise("cmpl-", trace, "")
            table = pa.table(
                {
                    "event_id": _uuid_ids(_hex_ids(rng, n, 16)),
                    "ts": pa.array(ts),
                    "trace_id": trace,
                    "span_id": pa.compute.if_else(
                        pa.array(has_trace), span_ids, pa.scalar(None, pa.string())
                    ),
                    "request_id": req,
                    "host": host_names.take(pa.array(host_idx)),
                    "pid": pa.array(rng.integers(1000, 400000, n).astype(np.int32)),
                    "gpu_uuid": gpu_uuids.take(pa.array(host_idx * gpus_per_host + gpu_local)),
                    "gpu_index": pa.array(gpu_local.astype(np.int32)),
                    "source": pa.array(np.where(has_trace, "probe:ops", "log:kern.log")),
                    "code": names.take(code_idx),
                    "layer": layers.take(code_idx),
                    "stage": stages.take(code_idx),
                    "family": fams.take(code_idx),
                    "severity": sev.take(code_idx),
                    "recoverability": recov.take(code_idx),
                    "xid": pa.nulls(n, pa.int32()),
                    "sm_error": pa.nulls(n, pa.string()),
                    "kv_block": pa.nulls(n, pa.int64()),
                    "kv_hash": pa.nulls(n, pa.string()),
                    "confidence": pa.array(np.ones(n, np.float32)),
                    "message": msgs.take(code_idx),
                    "attrs": pa.nulls(n, pa.string()),
                    "raw": pa.nulls(n, pa.string()),
                }
            )
            Store.insert_arrow(con, S.ERROR_CONTEXT, table)
            # one server span per trace that has records
            used = np.unique(tr_idx[has_trace])
            t_used = pa.array(trace_pool).take(pa.array(used))
            first = np.searchsorted(tr_idx, used)  # tr_idx is nearly sorted
            first = np.minimum(first, n - 1)
            start = ts[first] - 500_000_000
            status = rng.choice(
                [200, 500, 503, 504, 429, 400], len(used), p=[0.5, 0.25, 0.1, 0.07, 0.05, 0.03]
            )
            spans = pa.table(
                {
                    "trace_id": t_used,
                    "span_id": _hex_ids(rng, len(used), 8),
                    "parent_span_id": pa.nulls(len(used), pa.string()),
                    "name": pa.array(["POST /v1/chat/completions"] * len(used)),
                    "kind": pa.array(["SERVER"] * len(used)),
                    "start_ns": pa.array(start),
                    "end_ns": pa.array(start + 2_000_000_000),
                    "status_code": pa.array(np.where(status >= 500, "ERROR", "UNSET")),
                    "status_message": pa.nulls(len(used), pa.string()),
                    "http_status": pa.array(status.astype(np.int32)),
                    "service_name": pa.array(["vllm"] * len(used)),
                    "host": host_names.take(pa.array(host_idx[first])),
                    "attributes": pa.nulls(len(used), pa.string()),
                    "resource": pa.nulls(len(used), pa.string()),
                }
            )
            Store.insert_arrow(con, S.SPANS, spans)
            picks = rng.choice(len(used), min(len(used), 64), replace=False)
            sample_traces += t_used.take(pa.array(picks)).to_pylist()
            done += n
            if progress:
                progress(done, rows)
    return sample_traces


def _rca_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("rca")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "rca.cli"]


def run_query_bench(
    *,
    rows: int = 10_000_000,
    queries: int = 200,
    db: str | Path | None = None,
    keep: bool = False,
    progress: bool = True,
    seed: int = 7,
    cli_runs: int = 5,
) -> dict[str, Any]:
    from rca.query import diagnose_trace

    tmpdir = None
    if db is None:
        tmpdir = tempfile.mkdtemp(prefix="rca-bench-")
        db = Path(tmpdir) / "bench.duckdb"
    db = Path(db)
    store = Store(db)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None)
    try:
        t0 = time.perf_counter()
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.perf_counter()
            if now - last[0] > 2 or done == total:
                last[0] = now
                say(f"  filled {done:,}/{total:,} records ({done / (now - t0):,.0f} rows/s)")

        say(f"filling {db} with {rows:,} records ...")
        traces = fill_store(store, rows, seed=seed, progress=report)
        fill_s = time.perf_counter() - t0
        rng = np.random.default_rng(seed + 1)
        picks = [traces[i] for i in rng.integers(0, len(traces), queries)]
        say(f"timing {queries} in-process queries ...")
        times = []
        for tid in picks:
            q0 = time.perf_counter()
            diagnose_trace(tid, store=store)
            times.append((time.perf_counter() - q0) * 1000)
        say(f"timing {cli_runs} CLI runs ...")
        walls = []
        env = dict(os.environ, RCA_SPOOL=str(db.parent / "bench-spool"))
        for tid in picks[:cli_runs]:
            w0 = time.perf_counter()
            proc = subprocess.run(
                [*_rca_cmd(), "query", "--trace-id", tid, "--db", str(db), "--json"],
                capture_output=True,
                text=True,
                env=env,
            )
            walls.append(time.perf_counter() - w0)
            if proc.returncode != 0:
                raise RuntimeError(f"rca query failed: {proc.stderr.strip()}")
        return {
            "rows": rows,
            "query_p50_ms": round(float(np.percentile(times, 50)), 2),
            "query_p99_ms": round(float(np.percentile(times, 99)), 2),
            "cli_wall_s": round(statistics.median(walls), 3),
            "fill_s": round(fill_s, 1),
            "db_mb": round(db.stat().st_size / 1e6, 1),
        }
    finally:
        if tmpdir and not keep:
            shutil.rmtree(tmpdir, ignore_errors=True)
