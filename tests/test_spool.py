from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ingest import schema as S
from ingest.spool import SpoolWriter, decode_line, encode_line, load_spool
from ingest.store import Store

ROOT = Path(__file__).resolve().parents[1]


def _rec(i: int, **kw) -> S.ErrorContext:
    base = dict(
        code="LOGITS_NAN",
        family="numerical",
        layer=6,
        severity="error",
        source="probe:ops",
        trace_id=f"{i:032x}",
        span_id=f"{i:016x}",
        request_id=f"cmpl-{i}",
        gpu_uuid="GPU-0",
        gpu_index=0,
        stage="decode",
        recoverability="state_pollution",
        xid=None,
        sm_error={"gpc": 1, "tpc": 2, "sm": 0, "esr": [["0x504648", "0x114000e"]]},
        kv_block=i,
        kv_hash=f"{i:016x}",
        confidence=0.75,
        message=f"nan in lm_head row {i}",
        attrs={"module": "lm_head", "stats": {"min": -1.5, "max": 2.25, "nan": 3}},
    )
    base.update(kw)
    return S.ErrorContext(**base)


def _all_records(store: Store) -> list[S.ErrorContext]:
    with store.read() as con:
        tab = con.sql("SELECT * FROM error_context ORDER BY event_id").to_arrow_table()
    return S.arrow_to_records(tab)


def test_record_survives_spool_and_store_with_the_same_values(tmp_path: Path, store: Store):
    spool = tmp_path / "spool"
    w = SpoolWriter(spool, strict=True)
    recs = [_rec(i) for i in range(50)]
    recs.append(_rec(99, message="unicode ✓ \u2028 line sep", attrs=None, sm_error=None))
    for r in recs:
        w.emit(r)
    w.emit(
        S.Span(
            trace_id="ab" * 16,
            span_id="cd" * 8,
            name="POST /v1/completions",
            start_ns=1,
            end_ns=2,
            kind="SERVER",
            http_status=500,
            attributes={"http.route": "/v1/completions"},
        )
    )
    w.close()
    rep = load_spool(store, spool)
    assert rep.rows == {"error_context": 51, "spans": 1, "metrics": 0}
    assert rep.quarantined == 0
    got = _all_records(store)
    assert sorted(got, key=lambda r: r.event_id) == sorted(recs, key=lambda r: r.event_id)


def test_loading_twice_adds_nothing_and_open_segments_load_incrementally(tmp_path, store):
    spool = tmp_path / "spool"
    w = SpoolWriter(spool, max_age_s=3600)
    for i in range(10):
        w.emit(_rec(i))
    # the writer is alive and its segment is still open: complete lines load anyway
    assert load_spool(store, spool).rows["error_context"] == 10
    assert load_spool(store, spool).rows["error_context"] == 0
    for i in range(10, 15):
        w.emit(_rec(i))
    assert load_spool(store, spool).rows["error_context"] == 5
    w.close()
    rep = load_spool(store, spool)
    assert rep.rows["error_context"] == 0 and rep.deleted == 1
    assert store.counts()["error_context"] == 15
    assert not list(spool.iterdir())


def test_rotation_by_size_and_age(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    w = SpoolWriter(spool, max_bytes=2000, max_age_s=3600)
    for i in range(20):
        w.emit(_rec(i))
    sealed = list(spool.glob("*.seg"))
    assert len(sealed) >= 3 and all(p.stat().st_size <= 2000 for p in sealed)
    w2 = SpoolWriter(spool / "b", max_age_s=0.05)
    w2.emit(_rec(1))
    time.sleep(0.1)
    w2.emit(_rec(2))
    assert len(list((spool / "b").glob("*.seg"))) == 1
    w.close()
    w2.close()


def test_corrupted_lines_are_quarantined_with_the_reason(tmp_path: Path, store: Store) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    good = encode_line("e", _rec(1).to_row())
    flipped = bytearray(encode_line("e", _rec(2).to_row()))
    flipped[40] ^= 0x01
    wrong_type = encode_line("e", {**_rec(3).to_row(), "layer": "not-a-number"})
    (spool / "h-1-1-000001.seg").write_bytes(
        good + bytes(flipped) + b"garbage without checksum\n" + wrong_type + good[:30]
    )
    rep = load_spool(store, spool)
    assert rep.rows["error_context"] == 1
    assert rep.quarantined == 4
    with store.read() as con:
        reasons = sorted(r[0] for r in con.execute("SELECT reason FROM quarantine").fetchall())
    assert any("checksum mismatch" in r for r in reasons)
    assert any("no checksum prefix" in r for r in reasons)
    assert any("does not fit error_context" in r for r in reasons)
    assert any("torn write" in r for r in reasons)


def test_decode_rejects_unknown_kinds() -> None:
    import pytest

    line = encode_line("e", {"a": 1})
    assert decode_line(line) == ("e", {"a": 1})
    bad = encode_line("x", {"a": 1})
    with pytest.raises(ValueError, match="unknown record kind"):
        decode_line(bad)


WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from ingest import schema as S
    from ingest.spool import SpoolWriter
    w = SpoolWriter({spool!r}, max_bytes=400_000, max_age_s=3600)
    big = "x" * 20_000
    i = 0
    while True:
        r = S.ErrorContext(code="LOGITS_NAN", family="numerical", layer=6, severity="error",
                           source="probe:ops", message=f"rec {{i}}", raw=big)
        w.emit(r)
        print(r.event_id, flush=True)  # printed only once the write returned
        i += 1
    """
)


def test_sigkill_mid_stream_loses_no_finished_record_and_stores_no_half_record(
    tmp_path: Path, store: Store
) -> None:
    spool = tmp_path / "spool"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(root=str(ROOT), spool=str(spool))],
        stdout=subprocess.PIPE,
        text=True,
    )
    finished: list[str] = []
    assert proc.stdout is not None
    while len(finished) < 150:
        finished.append(proc.stdout.readline().strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished += [ln.strip() for ln in proc.stdout.read().splitlines() if ln.strip()]
    # simulate the kill landing inside a write(2): a half record at the end of the
    # dead writer's open segment
    open_segs = sorted(spool.glob("*.open"))
    assert open_segs, "the killed writer left its open segment"
    with open(open_segs[-1], "ab") as fh:
        fh.write(encode_line("e", _rec(7).to_row())[:100])
    rep = load_spool(store, spool)
    stored = {r.event_id for r in _all_records(store)}
    assert set(finished) <= stored  # nothing that was written is lost
    assert all(r.message.startswith("rec ") for r in _all_records(store))
    assert rep.quarantined >= 1
    with store.read() as con:
        torn = con.execute(
            "SELECT count(*) FROM quarantine WHERE reason LIKE 'torn write%'"
        ).fetchone()[0]
    assert torn >= 1
    assert not list(spool.iterdir())  # dead writer's segment consumed


LOADER = textwrap.dedent(
    """
    import sys, json
    sys.path.insert(0, {root!r})
    from ingest.store import Store
    from ingest.spool import load_spool
    rep = load_spool(Store({db!r}, lock_timeout=60), {spool!r}, batch_rows=2000)
    print(json.dumps(rep.rows))
    """
)
READER = textwrap.dedent(
    """
    import sys, json, time
    sys.path.insert(0, {root!r})
    from ingest.store import Store
    from ingest import queries
    s = Store({db!r}, lock_timeout=60)
    counts = []
    t_end = time.time() + 2.5
    while time.time() < t_end or len(counts) < 20:
        with s.read() as con:
            counts.append(con.execute("SELECT count(*) FROM error_context").fetchone()[0])
            queries.fetch_trace(con, "{tid}")
    print(json.dumps(counts))
    """
)


def test_load_and_query_in_two_processes_both_succeed(tmp_path: Path, store: Store) -> None:
    spool = tmp_path / "spool"
    for seg in range(30):
        w = SpoolWriter(spool)
        for i in range(1500):
            w.emit(_rec(seg * 10_000 + i, attrs=None))
        w.close()
    store.counts()  # create the store
    fmt = dict(root=str(ROOT), db=str(store.path), spool=str(spool), tid=f"{5:032x}")
    reader = subprocess.Popen(
        [sys.executable, "-c", READER.format(**fmt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.3)
    loader = subprocess.run(
        [sys.executable, "-c", LOADER.format(**fmt)], capture_output=True, text=True, timeout=300
    )
    out, err = reader.communicate(timeout=300)
    assert loader.returncode == 0, loader.stderr
    assert reader.returncode == 0, err
    assert json.loads(loader.stdout)["error_context"] == 45_000
    counts = json.loads(out)
    assert counts == sorted(counts)  # readers see whole batches, never a rollback
    assert store.counts()["error_context"] == 45_000
