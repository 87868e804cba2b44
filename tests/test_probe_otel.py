from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode

from graph.errors import NotFoundError
from ingest import schema as S
from ingest.spool import load_spool
from ingest.store import Store
from probes.otel import (
    RcaAsgiMiddleware,
    SpoolSpanExporter,
    TraceIds,
    current_context,
    exception_type_name,
    install,
    record_from_code,
    stamp,
)
from probes.sink import MemorySink, SpoolSink

ROOT = Path(__file__).resolve().parents[1]
MINI_CATALOG = Path(__file__).with_name("fixtures") / "mini_catalog.toml"

TRACE = 0x000102030405060708090A0B0C0D0E0F  # leading zeros: ids must be zero-padded
TRACE_HEX = "000102030405060708090a0b0c0d0e0f"
T0 = 1_700_000_000_000_000_000


class FixedIds(IdGenerator):
    def __init__(self, span_ids: list[int]) -> None:
        self.span_ids = list(span_ids)

    def generate_span_id(self) -> int:
        return self.span_ids.pop(0)

    def generate_trace_id(self) -> int:
        return TRACE


def _provider(sink: Any, **kw: Any) -> TracerProvider:
    tp = TracerProvider(
        resource=Resource({"service.name": "vllm-api", "host.name": "gpu-node-7"}), **kw
    )
    tp.add_span_processor(SimpleSpanProcessor(SpoolSpanExporter(sink)))
    return tp


def _rows(store: Store, sql: str) -> list[dict[str, Any]]:
    with store.read() as con:
        return con.sql(sql).to_arrow_table().to_pylist()


# --- exporter -> spool -> store ---------------------------------------------------
def test_sdk_spans_reach_the_store_with_exact_ids_links_and_fields(
    tmp_path: Path, store: Store, mini_catalog
) -> None:
    spool = tmp_path / "spool"
    sink = SpoolSink(spool, strict=True)
    tp = _provider(sink, id_generator=FixedIds([0xA1, 0x0A0000000000000B, 0xFFFFFFFFFFFFFFF0]))
    tracer = tp.get_tracer("test")

    root = tracer.start_span(
        "POST /v1/completions",
        kind=SpanKind.SERVER,
        start_time=T0,
        attributes={
            "http.request.method": "POST",
            "http.route": "/v1/completions",
            "http.response.status_code": 503,
        },
    )
    root.set_status(Status(StatusCode.ERROR, "engine dead"))
    child = tracer.start_span(
        "engine.generate",
        context=trace.set_span_in_context(root),
        kind=SpanKind.CLIENT,
        start_time=T0 + 1_000,
        attributes={"http.status_code": 200, "gen_ai.response.finish_reasons": ("stop", "length")},
    )
    child.set_status(Status(StatusCode.OK))
    with trace.use_span(child, end_on_exit=False):
        sink.emit(record_from_code("GPU_XID_48", "probe:test", catalog=mini_catalog))
        leaf = tracer.start_span("sample", start_time=T0 + 2_000)
        leaf.end(end_time=T0 + 3_000)
    child.end(end_time=T0 + 4_000)
    root.end(end_time=T0 + 5_000)
    tp.shutdown()  # flushes the sink through exporter.shutdown

    rep = load_spool(store, spool)
    assert rep.rows == {"error_context": 1, "spans": 3, "metrics": 0}
    assert rep.quarantined == 0
    got = _rows(store, "SELECT * FROM spans ORDER BY start_ns")
    resource = {"service.name": "vllm-api", "host.name": "gpu-node-7"}
    if S.own_pid() is not None:  # the exporting process's pid as NVRM prints it
        resource[S.HOST_PID_KEY] = S.own_pid()
    common = {"service_name": "vllm-api", "host": "gpu-node-7", "trace_id": TRACE_HEX}
    expected = [
        {
            **common,
            "span_id": "00000000000000a1",
            "parent_span_id": None,
            "name": "POST /v1/completions",
            "kind": "SERVER",
            "start_ns": T0,
            "end_ns": T0 + 5_000,
            "status_code": "ERROR",
            "status_message": "engine dead",
            "http_status": 503,
            "attributes": {
                "http.request.method": "POST",
                "http.response.status_code": 503,
                "http.route": "/v1/completions",
            },
        },
        {
            **common,
            "span_id": "0a0000000000000b",
            "parent_span_id": "00000000000000a1",
            "name": "engine.generate",
            "kind": "CLIENT",
            "start_ns": T0 + 1_000,
            "end_ns": T0 + 4_000,
            "status_code": "OK",
            "status_message": None,
            "http_status": 200,
            "attributes": {
                "gen_ai.response.finish_reasons": ["stop", "length"],
                "http.status_code": 200,
            },
        },
        {
            **common,
            "span_id": "fffffffffffffff0",
            "parent_span_id": "0a0000000000000b",
            "name": "sample",
            "kind": "INTERNAL",
            "start_ns": T0 + 2_000,
            "end_ns": T0 + 3_000,
            "status_code": "UNSET",
            "status_message": None,
            "http_status": None,
            "attributes": {},
        },
    ]
    for row in got:
        row["attributes"] = json.loads(row["attributes"])
        assert json.loads(row.pop("resource")) == resource
    assert got == expected

    # the probe record stamped inside the client span joins it in the store
    joined = _rows(
        store,
        "SELECT e.code, s.name, s.kind FROM error_context e JOIN spans s USING (trace_id, span_id)",
    )
    assert joined == [{"code": "GPU_XID_48", "name": "engine.generate", "kind": "CLIENT"}]


# --- stamp / current_context / record_from_code -------------------------------------
def _record(**kw: Any) -> S.ErrorContext:
    return S.ErrorContext(
        code="GPU_XID_48", family="gpu_hardware", layer=1, severity="critical", source="t", **kw
    )


def test_stamp_takes_the_current_span_ids_inside_and_none_outside(mini_catalog) -> None:
    tracer = _provider(MemorySink()).get_tracer("test")
    assert current_context() is None
    assert stamp(_record()).trace_id is None
    with tracer.start_as_current_span("work") as sp:
        ctx = sp.get_span_context()
        tid, sid = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
        assert current_context() == TraceIds(tid, sid)
        rec = stamp(_record())
        assert (rec.trace_id, rec.span_id) == (tid, sid)
        # ids a probe already knows are kept
        other = stamp(_record(trace_id="ab" * 16))
        assert (other.trace_id, other.span_id) == ("ab" * 16, None)
        same_trace = stamp(_record(trace_id=tid))
        assert same_trace.span_id == sid
        built = record_from_code(
            "KV_BLOCK_HASH_MISMATCH", "probe:kv", catalog=mini_catalog, request_id="cmpl-1"
        )
        code = mini_catalog["KV_BLOCK_HASH_MISMATCH"]
        assert (built.code, built.family, built.layer, built.severity, built.stage) == (
            code.name,
            code.family,
            code.layer,
            code.severity,
            code.stage,
        )
        assert (built.trace_id, built.span_id, built.request_id) == (tid, sid, "cmpl-1")
        explicit = record_from_code(
            "GPU_XID_48", "probe:nvml", catalog=mini_catalog, trace_id="cd" * 16
        )
        assert (explicit.trace_id, explicit.span_id) == ("cd" * 16, None)
    assert current_context() is None
    outside = record_from_code("GPU_XID_48", "probe:nvml", catalog=mini_catalog)
    assert (outside.trace_id, outside.span_id) == (None, None)
    with pytest.raises(NotFoundError):
        record_from_code("NO_SUCH_CODE", "probe:x", catalog=mini_catalog)


# --- ASGI middleware ------------------------------------------------------------
class Boom(RuntimeError):
    pass


SEEN: dict[str, Any] = {}


async def tiny_app(scope: dict, receive: Any, send: Any) -> None:
    """A hand-written ASGI app: routes by path, leaves a route template like a router."""
    if scope["type"] == "lifespan":
        SEEN["lifespan"] = True
        return
    await receive()
    SEEN["ids"] = current_context()
    path = scope["path"]
    if path.startswith("/v1/models/"):
        scope["route"] = "/v1/models/{model}"
    if path == "/boom":
        raise Boom("CUDA error: an illegal memory access was encountered")
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            await asyncio.sleep(0.002)
            await send({"type": "http.response.body", "body": b"tok%d" % i, "more_body": True})
        SEEN["before_last_chunk_ns"] = time.time_ns()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    status = {"/busy": 503, "/missing": 404}.get(path, 200)
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(
    app: Any, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> list[dict]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "https",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"prompt=secret",
        "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
        "server": ("10.0.0.5", 8000),
        "client": ("10.0.0.9", 51000),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    async def request() -> None:
        try:
            await app(scope, receive, send)
        finally:
            SEEN["after"] = current_context()  # same task: the span must be detached

    asyncio.run(request())
    return sent


@pytest.fixture
def served():
    SEEN.clear()
    sink = MemorySink()
    tp = _provider(sink)
    app = RcaAsgiMiddleware(tiny_app, tracer_provider=tp)

    def spans() -> list[S.Span]:
        return [r for r in sink.records if isinstance(r, S.Span)]

    return app, spans


def test_middleware_records_a_200_with_route_and_the_handler_sees_its_span(served) -> None:
    app, spans = served
    sent = _call(app, "/v1/models/llama", method="GET")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200
    (sp,) = spans()
    assert (sp.name, sp.kind, sp.status_code, sp.http_status) == (
        "GET /v1/models/{model}",
        "SERVER",
        "UNSET",
        200,
    )
    assert sp.parent_span_id is None
    assert sp.attributes == {
        "http.request.method": "GET",
        "url.path": "/v1/models/llama",
        "url.scheme": "https",
        "http.route": "/v1/models/{model}",
        "http.response.status_code": 200,
        "network.protocol.version": "1.1",
        "server.address": "10.0.0.5",
        "server.port": 8000,
    }
    assert (sp.service_name, sp.host) == ("vllm-api", "gpu-node-7")
    assert SEEN["ids"] == TraceIds(sp.trace_id, sp.span_id)
    assert SEEN["after"] is None


def test_middleware_records_an_app_exception_as_500_and_reraises_it(served) -> None:
    app, spans = served
    with pytest.raises(Boom, match="illegal memory access"):
        _call(app, "/boom", method="POST")
    (sp,) = spans()
    qualified = f"{Boom.__module__}.{Boom.__qualname__}"
    assert qualified.endswith("test_probe_otel.Boom")
    assert (sp.name, sp.status_code, sp.http_status) == ("POST", "ERROR", 500)
    assert sp.attributes["error.type"] == qualified
    assert sp.status_message.startswith(qualified + ": CUDA error")
    assert exception_type_name(ValueError("x")) == "ValueError"
    assert SEEN["after"] is None


def test_middleware_records_a_returned_503_as_error_and_a_404_as_unset(served) -> None:
    app, spans = served
    assert _call(app, "/busy")[0]["status"] == 503
    assert _call(app, "/missing")[0]["status"] == 404
    busy, missing = spans()
    assert (busy.name, busy.status_code, busy.http_status) == ("GET", "ERROR", 503)
    assert busy.attributes["error.type"] == "503"
    assert (missing.status_code, missing.http_status) == ("UNSET", 404)
    assert "error.type" not in missing.attributes


def test_middleware_continues_an_incoming_traceparent(served) -> None:
    app, spans = served
    tid, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    _call(app, "/ok", headers={"traceparent": f"00-{tid}-{parent}-01"})
    _call(app, "/ok", headers={"traceparent": f"00-{'0' * 32}-{parent}-01"})  # invalid
    cont, fresh = spans()
    assert (cont.trace_id, cont.parent_span_id) == (tid, parent)
    assert cont.span_id != parent
    assert fresh.trace_id != "0" * 32 and fresh.parent_span_id is None


def test_middleware_handles_streaming_and_unknown_methods_and_passes_lifespan(served) -> None:
    app, spans = served
    sent = _call(app, "/stream")
    assert [m.get("body") for m in sent[1:]] == [b"tok0", b"tok1", b"tok2", b""]
    _call(app, "/ok", method="BREW")
    stream, brew = spans()
    assert (stream.http_status, stream.status_code) == (200, "UNSET")
    assert stream.end_ns >= SEEN["before_last_chunk_ns"]  # ended after the body, not at start
    assert brew.name == "HTTP"
    assert brew.attributes["http.request.method"] == "_OTHER"
    assert brew.attributes["http.request.method_original"] == "BREW"

    async def lifespan() -> None:
        await app({"type": "lifespan"}, None, None)

    asyncio.run(lifespan())
    assert SEEN["lifespan"] is True
    assert len(spans()) == 2


class _BrokenSpan(trace.NonRecordingSpan):
    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value: Any) -> None:
        raise RuntimeError("otel broke")

    def end(self, end_time: int | None = None) -> None:
        raise RuntimeError("otel broke")


class _BrokenTracer:
    def __init__(self, fail_start: bool) -> None:
        self.fail_start = fail_start

    def start_span(self, *a: Any, **kw: Any) -> trace.Span:
        if self.fail_start:
            raise RuntimeError("otel broke")
        return _BrokenSpan(trace.INVALID_SPAN_CONTEXT)


class _BrokenProvider:
    def __init__(self, fail_start: bool) -> None:
        self.fail_start = fail_start

    def get_tracer(self, *a: Any, **kw: Any) -> _BrokenTracer:
        return _BrokenTracer(self.fail_start)


@pytest.mark.parametrize("fail_start", [True, False])
def test_middleware_never_breaks_the_app_when_otel_fails(fail_start: bool) -> None:
    calls: list[str] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        calls.append(scope["path"])
        await tiny_app(scope, receive, send)

    mw = RcaAsgiMiddleware(app, tracer_provider=_BrokenProvider(fail_start))
    sent = _call(mw, "/ok")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    with pytest.raises(Boom):  # the app's own exception, not OTel's
        _call(mw, "/boom")
    assert calls == ["/ok", "/boom"]
    assert mw.errors >= 2


def test_middleware_overhead_is_small() -> None:
    sink = MemorySink()
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(SpoolSpanExporter(sink)))
    mw = RcaAsgiMiddleware(tiny_app, tracer_provider=tp)
    n = 2000

    async def run(app: Any) -> float:
        async def receive() -> dict:
            return {"type": "http.request", "body": b""}

        async def send(message: dict) -> None:
            pass

        hdrs = [(b"host", b"x"), (b"user-agent", b"bench"), (b"content-type", b"application/json")]
        t = time.perf_counter()
        for _ in range(n):
            scope = {"type": "http", "method": "POST", "path": "/ok", "headers": hdrs}
            await app(scope, receive, send)
        return (time.perf_counter() - t) / n

    bare = min(asyncio.run(run(tiny_app)) for _ in range(3))
    wrapped = min(asyncio.run(run(mw)) for _ in range(3))
    tp.shutdown()
    assert 0 < len(sink.records) <= 3 * n  # a full batch queue drops spans, by design
    # a span per request costs tens of microseconds; a token takes milliseconds
    assert wrapped - bare < 250e-6, f"overhead {1e6 * (wrapped - bare):.0f} us/request"


# --- failures and setup ----------------------------------------------------------
def _finished_span() -> Any:
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    with tp.get_tracer("t").start_as_current_span("x"):
        pass
    (sp,) = mem.get_finished_spans()
    return sp


class RaisingSink:
    def __init__(self) -> None:
        self.flushed = 0

    def emit(self, record: Any) -> None:
        raise OSError("disk full")

    def flush(self) -> None:
        self.flushed += 1


def test_a_failing_sink_makes_export_return_failure_without_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sp = _finished_span()
    sink = RaisingSink()
    exp = SpoolSpanExporter(sink)
    with caplog.at_level(logging.WARNING, logger="rca.probes.otel"):
        assert exp.export([sp]) is SpanExportResult.FAILURE
        assert exp.export([sp]) is SpanExportResult.FAILURE
    assert (exp.errors, exp.exported) == (2, 0)
    assert len([r for r in caplog.records if "disk full" in r.getMessage()]) == 1  # rate-limited

    # a spool writer that cannot write counts the failure instead of raising
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    spool_exp = SpoolSpanExporter(SpoolSink(blocked / "spool"))
    assert spool_exp.export([sp]) is SpanExportResult.FAILURE
    assert spool_exp.errors == 1

    ok = MemorySink()
    good = SpoolSpanExporter(ok)
    assert good.export([sp]) is SpanExportResult.SUCCESS
    assert good.force_flush() is True
    exp.shutdown()
    assert sink.flushed == 1
    assert exp.export([sp]) is SpanExportResult.FAILURE  # after shutdown


def test_install_builds_a_provider_that_exports_with_service_and_host() -> None:
    sink = MemorySink()
    tp = install(
        "vllm-api",
        sink,
        set_global=False,
        resource_attributes={"deployment.environment": "test"},
    )
    assert trace.get_tracer_provider() is not tp
    with tp.get_tracer("t").start_as_current_span("x", kind=SpanKind.SERVER):
        pass
    tp.force_flush()
    (sp,) = sink.records
    assert isinstance(sp, S.Span)
    assert (sp.service_name, sp.host, sp.kind) == ("vllm-api", os.uname().nodename, "SERVER")
    assert sp.resource["deployment.environment"] == "test"
    assert sp.resource["process.pid"] == os.getpid()
    # the host's pid, for comparing with NVRM's (absent in a container's pid namespace)
    assert sp.resource.get(S.HOST_PID_KEY) == S.own_pid()
    tp.shutdown()


GLOBAL_INSTALL = """
import sys
sys.path.insert(0, {root!r})
from opentelemetry import trace
from probes.otel import install, record_from_code
from probes.sink import default_sink

tp = install("svc-global")
assert install("ignored") is tp and trace.get_tracer_provider() is tp
with trace.get_tracer("t").start_as_current_span("handle") as sp:
    default_sink().emit(record_from_code("GPU_XID_48", "probe:test"))
    print(trace.format_trace_id(sp.get_span_context().trace_id))
# no explicit shutdown: the provider's exit hook exports and flushes the spool
"""


def test_install_globally_spools_spans_at_exit_and_records_join(
    tmp_path: Path, store: Store
) -> None:
    spool = tmp_path / "spool"
    env = {**os.environ, "RCA_SPOOL": str(spool), "RCA_CATALOG": str(MINI_CATALOG)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(GLOBAL_INSTALL).format(root=str(ROOT))],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    tid = proc.stdout.strip()
    rep = load_spool(store, spool)
    assert rep.rows["spans"] == 1 and rep.rows["error_context"] == 1
    joined = _rows(
        store,
        "SELECT s.trace_id, s.name, s.service_name, e.code "
        "FROM spans s JOIN error_context e USING (trace_id, span_id)",
    )
    assert joined == [
        {"trace_id": tid, "name": "handle", "service_name": "svc-global", "code": "GPU_XID_48"}
    ]
