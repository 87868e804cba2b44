"""Whose process an Xid names: the trace's own pids are the host's, or none.

NVRM prints the host's pid; a process in a container's pid namespace sees its
own number from ``os.getpid()``. Comparing the two would make every Xid
13/31/43/94 of the serving process look like another process's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ingest import schema as S

INIT = "pid:[4026531836]"


def _fake_proc(root: Path, *, own_ns: str | None, init_ns: str | None, nspid: str | None) -> None:
    """A /proc with the links and the status line :func:`ingest.schema.own_pid` reads."""
    if own_ns is not None:
        (root / "self" / "ns").mkdir(parents=True)
        (root / "self" / "ns" / "pid").symlink_to(own_ns)
    if init_ns is not None:
        (root / "1" / "ns").mkdir(parents=True)
        (root / "1" / "ns" / "pid").symlink_to(init_ns)
    if nspid is not None:
        (root / "self").mkdir(exist_ok=True)
        (root / "self" / "status").write_text(f"Name:\tpython\nNSpid:\t{nspid}\nPPid:\t1\n")


@pytest.mark.parametrize(
    ("own_ns", "init_ns", "nspid", "want"),
    [
        (INIT, INIT, None, "getpid"),  # on the host
        ("pid:[4026532711]", "pid:[4026532711]", "7", None),  # a container's own /proc
        ("pid:[4026532711]", INIT, "48213\t7", 48213),  # the host's /proc mounted in
        ("pid:[4026532711]", None, None, None),  # /proc/1 unreadable
        (None, None, None, "getpid"),  # no procfs: no pid namespaces
    ],
)
def test_own_pid_is_the_hosts_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_ns, init_ns, nspid, want
) -> None:
    _fake_proc(tmp_path, own_ns=own_ns, init_ns=init_ns, nspid=nspid)
    monkeypatch.setattr(S, "_PROC", str(tmp_path))
    monkeypatch.setattr(S, "_own", None)
    expected = os.getpid() if want == "getpid" else want
    assert S.own_pid() == expected
    rec = S.ErrorContext(code="X", family="numerical", layer=6, severity="error", source="t")
    assert rec.pid == expected  # the record's default


def _store_with_xid(
    db: Path, *, probe_pid: int | None, xid_pid: int, log_pid: int | None, span_pid: int | None
):
    from graph.catalog import load_catalog
    from ingest.store import Store

    cat = load_catalog()
    tid, t0 = "ab" * 16, 1_795_000_000 * 10**9
    recs = [
        S.ErrorContext.from_catalog(
            cat["CUDA_ERROR_ILLEGAL_ADDRESS"],
            source="probe:ops",
            ts=t0,
            host="n1",
            pid=probe_pid,
            trace_id=tid,
        ),
        S.ErrorContext.from_catalog(
            cat["GPU_XID_13"], source="log:kern.log", ts=t0 - 10**8, host="n1", xid=13, pid=xid_pid
        ),
    ]
    if log_pid is not None:  # the engine's own line, in its namespace's numbers
        recs.append(
            S.ErrorContext.from_catalog(
                cat["ENGINE_DEAD"],
                source="log:engine.log",
                ts=t0 + 10**6,
                host="n1",
                pid=log_pid,
                trace_id=tid,
            )
        )
    store = Store(db)
    store.insert_records(recs)
    resource: dict[str, object] = {"service.name": "vllm", "process.pid": 7}
    if span_pid is not None:  # stamped by our span exporter in the serving process
        resource[S.HOST_PID_KEY] = span_pid
    span = S.Span(
        trace_id=tid,
        span_id="34" * 8,
        name="POST /v1/completions",
        kind="SERVER",
        start_ns=t0 - 10**9,
        end_ns=t0 + 10**8,
        status_code="ERROR",
        http_status=500,
        host="n1",
        resource=resource,
    )
    store.insert_spans([span])
    return store, tid


@pytest.mark.parametrize(
    ("probe_pid", "xid_pid", "log_pid", "span_pid", "scope"),
    [
        (4242, 4242, None, None, "host"),  # the driver names the trace's own process
        (4242, 5151, None, None, "other_process"),  # another process's fault: contained
        (None, 5151, 7, None, "host"),  # in a container: no host pid, no verdict
        (4242, 4242, 7, None, "host"),  # a log line's namespace pid is not compared
        (None, 5151, None, 4242, "other_process"),  # the span's exporter knew its host pid
        (None, 4242, None, 4242, "host"),
    ],
)
def test_xid_scope_uses_only_host_pids(
    tmp_path: Path, probe_pid, xid_pid, log_pid, span_pid, scope
) -> None:
    from rca.query import gather_evidence

    store, tid = _store_with_xid(
        tmp_path / "p.duckdb",
        probe_pid=probe_pid,
        xid_pid=xid_pid,
        log_pid=log_pid,
        span_pid=span_pid,
    )
    got = {e.code: e.scope for e in gather_evidence(tid, store).evidence}
    assert got["GPU_XID_13"] == scope
