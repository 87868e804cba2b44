"""`rca bench ingest`: normalize and load figures beside Drain3 and a raw DuckDB insert.

Everything runs in one process on the same data, so the ratios hold on a
shared, noisy machine even when the absolute figures move.
"""

from __future__ import annotations

import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from graph.catalog import default_catalog
from ingest import schema as S
from ingest.classify import Normalizer
from ingest.corpus import benign_lines
from ingest.store import Store

__all__ = ["make_lines", "run_ingest_bench", "drain3_miner"]

DRAIN3_MASKING = (  # the masking of Drain3's own example drain3.ini
    (r"((?<=[^A-Za-z0-9])|^)(([0-9a-f]{2,}:){3,}([0-9a-f]{2,}))((?=[^A-Za-z0-9])|$)", "ID"),
    (r"((?<=[^A-Za-z0-9])|^)(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})((?=[^A-Za-z0-9])|$)", "IP"),
    (r"((?<=[^A-Za-z0-9])|^)([0-9a-f]{6,} ?){3,}((?=[^A-Za-z0-9])|$)", "SEQ"),
    (r"((?<=[^A-Za-z0-9])|^)([0-9A-F]{4} ?){4,}((?=[^A-Za-z0-9])|$)", "SEQ"),
    (r"((?<=[^A-Za-z0-9])|^)(0x[a-f0-9A-F]+)((?=[^A-Za-z0-9])|$)", "HEX"),
    (r"((?<=[^A-Za-z0-9])|^)([\-\+]?\d+)((?=[^A-Za-z0-9])|$)", "NUM"),
    (r"(?<=executed cmd )(\".+?\")", "CMD"),
)


def make_lines(n: int, *, fault_share: float = 0.03, seed: int = 11) -> list[str]:
    """``n`` server lines: ordinary INFO/metrics/access lines plus real fault lines
    (the catalog's examples) at ``fault_share``."""
    rng = random.Random(seed)
    faults = [ex for code in default_catalog() for ex in code.examples]
    n_fault = int(n * fault_share)
    lines = benign_lines(n - n_fault, seed=seed) + [rng.choice(faults) for _ in range(n_fault)]
    rng.shuffle(lines)
    return lines


def drain3_miner():  # type: ignore[no-untyped-def]
    try:
        from drain3 import TemplateMiner
    except ImportError as exc:
        from graph.errors import RcaError

        raise RcaError("rca bench ingest compares with Drain3: pip install -e '.[bench]'") from exc
    from drain3.masking import MaskingInstruction
    from drain3.template_miner_config import TemplateMinerConfig

    cfg = TemplateMinerConfig()
    cfg.masking_instructions = [MaskingInstruction(p, m) for p, m in DRAIN3_MASKING]
    cfg.profiling_enabled = False
    return TemplateMiner(config=cfg)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _records_table(norm: Normalizer, lines: list[str], rows: int) -> pa.Table:
    """The matched lines as ErrorContext rows, repeated to ``rows`` rows."""
    batch = norm.classify_batch(lines[:200_000])
    now = time.time_ns()
    base = [
        S.ErrorContext.from_catalog(
            code,
            source="log:bench.log",
            ts=now + i,
            host="gpu-node-00",
            confidence=conf,
            message=lines[i][:512],
            raw=lines[i],
            attrs={"line": i, "fields": fields},
        ).to_row()
        for i, (code, conf, fields, _) in batch.matches.items()
    ]
    one = S.records_to_arrow(base)
    reps = -(-rows // max(one.num_rows, 1))
    tab = pa.concat_tables([one] * reps).slice(0, rows)
    ids = pa.array([f"{i:08x}-0000-7000-8000-{i:012x}" for i in range(rows)])
    ts = pa.array(np.arange(rows, dtype=np.int64) + now)
    return tab.set_column(0, "event_id", ids).set_column(1, "ts", ts)


def run_ingest_bench(
    *,
    lines: int = 1_000_000,
    load_rows: int = 1_000_000,
    drain3_lines: int = 200_000,
    progress: bool = True,
) -> dict[str, Any]:
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None)
    say(f"building {lines:,} lines ...")
    data = make_lines(lines)
    t0 = time.perf_counter()
    norm = Normalizer(default_catalog(), labels=())
    norm.classify_batch(data[:1000])  # trains the fallback model once
    init_s = time.perf_counter() - t0

    say("normalize ...")
    t0 = time.perf_counter()
    found = 0
    for i in range(0, len(data), 50_000):
        found += len(norm.classify_batch(data[i : i + 50_000]).matches)
    norm_rate = len(data) / (time.perf_counter() - t0)

    m = min(drain3_lines, len(data))
    say(f"Drain3 on {m:,} of the same lines ...")
    miner = drain3_miner()
    t0 = time.perf_counter()
    for line in data[:m]:
        miner.add_log_message(line)
    drain_rate = m / (time.perf_counter() - t0)

    say(f"load {load_rows:,} records ...")
    table = _records_table(norm, data, load_rows)
    tmp = Path(tempfile.mkdtemp(prefix="rca-bench-ingest-"))
    try:
        store = Store(tmp / "store.duckdb")
        store.counts()  # create
        step = 100_000
        t0 = time.perf_counter()
        for i in range(0, table.num_rows, step):
            with store.writer_lock(), store.write() as con:
                con.execute("BEGIN TRANSACTION")
                Store.insert_arrow(con, S.ERROR_CONTEXT, table.slice(i, step))
                Store.mark_source_loaded(
                    con, "bench", "bench", i + step, lines_done=i + step, complete=False
                )
                con.execute("COMMIT")
        load_rate = table.num_rows / (time.perf_counter() - t0)

        raw = duckdb.connect(str(tmp / "raw.duckdb"))
        raw.execute(S.create_table_sql(S.ERROR_CONTEXT)[0])
        t0 = time.perf_counter()
        for i in range(0, table.num_rows, step):
            chunk = table.slice(i, step)  # noqa: F841  (read by DuckDB's replacement scan)
            raw.execute("INSERT INTO error_context SELECT * FROM chunk")
        raw_rate = table.num_rows / (time.perf_counter() - t0)
        raw.close()

        say("end to end: rca ingest of a log file ...")
        from ingest.pipeline import ingest_paths

        log = tmp / "bench.log"
        log.write_text("\n".join(data) + "\n")
        t0 = time.perf_counter()
        rep = ingest_paths(Store(tmp / "ingest.duckdb"), [log], normalizer=norm)
        ingest_rate = rep.files[0].read / (time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "lines": len(data),
        "fault_lines_found": found,
        "normalize_lines_per_s": round(norm_rate),
        "drain3_lines_per_s": round(drain_rate),
        "ratio_vs_drain3": round(norm_rate / drain_rate, 1),
        "load_rows_per_s": round(load_rate),
        "raw_duckdb_rows_per_s": round(raw_rate),
        "load_vs_raw": round(load_rate / raw_rate, 2),
        "ingest_file_lines_per_s": round(ingest_rate),
        "normalizer_init_s": round(init_s, 2),
        "peak_rss_mb": round(_peak_rss_mb()),
    }
