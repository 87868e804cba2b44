"""The OTLP/HTTP receiver, driven by the real OpenTelemetry exporters."""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from graph.catalog import default_catalog
from ingest.collect import OtlpHttpServer, OtlpReceiver, make_server
from ingest.spool import load_spool
from ingest.store import Store

ROOT = Path(__file__).resolve().parents[1]
PB = "application/x-protobuf"
JSON = "application/json"

# Ids chosen so that their base64 form has '+', '/' and padding, and some
# start with zero bytes: a hex/base64 mix-up or a lost leading zero shows.
TRACE_IDS = [0x00F067AA0BA902B7FBFFBFFFFEFF3E3F, 0xFBEFBEFB00000000000000000000FF01]
SPAN_IDS = [0x00000000000000FF, 0xFBFFBFFFFEFF3E3F, 0x0BA902B700F067AA, 0x3E3F3E3F3E3F3E3F]


class FixedIds(IdGenerator):
    def __init__(self) -> None:
        self.traces = iter(TRACE_IDS)
        self.spans = iter(SPAN_IDS)

    def generate_trace_id(self) -> int:
        return next(self.traces)

    def generate_span_id(self) -> int:
        return next(self.spans)


# ---------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., OtlpHttpServer]]:
    servers: list[OtlpHttpServer] = []

    def start(**kw: Any) -> OtlpHttpServer:
        kw.setdefault("spool_dir", tmp_path / f"spool{len(servers)}")
        server, thread = make_server(port=0, **kw)
        assert thread is not None and thread.is_alive()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.shutdown()


def load(server: OtlpHttpServer, tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    """Flush the receiver's spool and load it into a fresh store: the rows per table."""
    server.receiver.writer.flush()
    store = Store(tmp_path / "db" / f"{os.urandom(4).hex()}.duckdb", lock_timeout=30)
    rep = load_spool(store, server.receiver.writer.dir)
    assert rep.quarantined == 0
    out = {}
    with store.read() as con:
        for table in ("spans", "error_context"):
            cur = con.execute(f"SELECT * FROM {table}")
            names = [d[0] for d in cur.description]
            out[table] = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    return out


def post(
    server: OtlpHttpServer,
    path: str,
    body: bytes,
    content_type: str | None = PB,
    *,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, str]:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        hdrs = dict(headers or {})
        if content_type:
            hdrs["Content-Type"] = content_type
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type", "")
    finally:
        conn.close()


def tracer_provider(server: OtlpHttpServer, **exporter_kw: Any):
    provider = TracerProvider(
        resource=Resource.create({"service.name": "vllm", "host.name": "gpu-node-7"}),
        id_generator=FixedIds(),
    )
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    exporter = OTLPSpanExporter(endpoint=server.endpoint + "/v1/traces", **exporter_kw)
    # one batch, sent by force_flush: a single export request with every span
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    return provider, memory


def emit_request_spans(provider: TracerProvider) -> None:
    tracer = provider.get_tracer("test.collect")
    with tracer.start_as_current_span("POST /v1/completions", kind=SpanKind.SERVER) as root:
        root.set_attribute("http.request.method", "POST")
        root.set_attribute("http.route", "/v1/completions")
        root.set_attribute("http.response.status_code", 500)
        root.set_status(Status(StatusCode.ERROR))
        with tracer.start_as_current_span("llm_request") as mid:
            mid.set_attribute("gen_ai.request.model", "meta-llama/Llama-3-8B")
            mid.set_attribute("gen_ai.usage.input_tokens", 1234)
            mid.set_attribute("gen_ai.request.temperature", 0.25)
            mid.set_attribute("gen_ai.request.stream", True)
            mid.set_attribute("gen_ai.response.finish_reasons", ["stop", "length"])
            with tracer.start_as_current_span("kv_transfer", kind=SpanKind.CLIENT) as leaf:
                leaf.set_status(Status(StatusCode.ERROR, "CUDA error: illegal memory access"))
    with tracer.start_as_current_span("GET /health", kind=SpanKind.SERVER) as ok:
        ok.set_attribute("http.response.status_code", 200)
        ok.set_status(Status(StatusCode.OK))


def expected_rows(memory: InMemorySpanExporter) -> list[dict[str, Any]]:
    rows = []
    for sp in memory.get_finished_spans():
        ctx = sp.get_span_context()
        rows.append(
            {
                "trace_id": f"{ctx.trace_id:032x}",
                "span_id": f"{ctx.span_id:016x}",
                "parent_span_id": f"{sp.parent.span_id:016x}" if sp.parent else None,
                "name": sp.name,
                "kind": sp.kind.name,
                "start_ns": sp.start_time,
                "end_ns": sp.end_time,
                "status_code": sp.status.status_code.name,
                "status_message": sp.status.description,
                "http_status": sp.attributes.get("http.response.status_code"),
                "service_name": "vllm",
                "host": "gpu-node-7",
                "attributes": {  # the SDK keeps sequences as tuples
                    k: list(v) if isinstance(v, tuple) else v for k, v in sp.attributes.items()
                },
            }
        )
    return sorted(rows, key=lambda r: r["span_id"])


def stored_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        r = dict(r)
        r["attributes"] = json.loads(r["attributes"])
        r.pop("resource")
        out.append(r)
    return sorted(out, key=lambda r: r["span_id"])


# ---------------------------------------------------------------------------
# traces


def test_real_exporter_spans_arrive_with_exact_ids_and_fields(serve, tmp_path: Path) -> None:
    server = serve()
    provider, memory = tracer_provider(server)
    emit_request_spans(provider)
    assert provider.force_flush(10_000)
    expected = expected_rows(memory)
    assert len(expected) == 4
    # the fixed ids really were used (so the tricky bytes were on the wire)
    assert {r["trace_id"] for r in expected} == {f"{t:032x}" for t in TRACE_IDS}
    assert {r["span_id"] for r in expected} == {f"{s:016x}" for s in SPAN_IDS}

    got = stored_rows(load(server, tmp_path)["spans"])
    assert got == expected
    by_name = {r["name"]: r for r in got}
    root = by_name["POST /v1/completions"]
    assert root["trace_id"] == "00f067aa0ba902b7fbffbffffeff3e3f"  # leading zero byte kept
    assert root["parent_span_id"] is None and root["kind"] == "SERVER"
    assert root["http_status"] == 500 and root["status_code"] == "ERROR"
    assert by_name["llm_request"]["parent_span_id"] == root["span_id"]
    assert by_name["kv_transfer"]["parent_span_id"] == by_name["llm_request"]["span_id"]
    assert by_name["kv_transfer"]["kind"] == "CLIENT"
    assert by_name["kv_transfer"]["status_message"] == "CUDA error: illegal memory access"
    assert by_name["GET /health"]["status_code"] == "OK"
    assert by_name["GET /health"]["trace_id"] == f"{TRACE_IDS[1]:032x}"

    st = server.stats()
    assert st["trace_requests"] == 1 and st["responses"] == {"200": 1}
    assert st["spans_received"] == st["spans_stored"] == 4 and st["spans_rejected"] == 0
    provider.shutdown()


@pytest.mark.parametrize("compression", [Compression.Gzip, Compression.Deflate])
def test_compressed_exports_decode_to_the_same_rows(serve, tmp_path, compression) -> None:
    server = serve()
    provider, memory = tracer_provider(server, compression=compression)
    emit_request_spans(provider)
    assert provider.force_flush(10_000)
    assert stored_rows(load(server, tmp_path)["spans"]) == expected_rows(memory)
    st = server.stats()
    assert st["spans_stored"] == 4
    assert st["bytes_received"] != st["bytes_decoded"]  # it really was compressed
    provider.shutdown()


def _json_request(trace_hex: str, span_hex: str, parent_hex: str | None) -> dict[str, Any]:
    span: dict[str, Any] = {
        "traceId": trace_hex,
        "spanId": span_hex,
        "name": "POST /v1/chat/completions",
        "kind": 2,
        "startTimeUnixNano": "1700000000000000001",
        "endTimeUnixNano": "1700000000250000000",
        "attributes": [
            {"key": "http.response.status_code", "value": {"intValue": "503"}},
            {"key": "gen_ai.request.model", "value": {"stringValue": "m"}},
            {"key": "ratio", "value": {"doubleValue": 0.5}},
        ],
        "status": {"code": 2, "message": "engine dead"},
    }
    if parent_hex:
        span["parentSpanId"] = parent_hex
    return {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "api"}}]
                },
                "scopeSpans": [{"scope": {"name": "hand"}, "spans": [span]}],
            }
        ]
    }


def test_gzip_with_several_members_is_read_whole(serve, tmp_path: Path) -> None:
    server = serve()
    data = json.dumps(_json_request("ab" * 16, "cd" * 8, None)).encode()
    body = gzip.compress(data[:40]) + gzip.compress(data[40:])
    assert post(server, "/v1/traces", body, JSON, headers={"Content-Encoding": "gzip"})[0] == 200
    assert [r["span_id"] for r in load(server, tmp_path)["spans"]] == ["cd" * 8]


def test_otlp_json_and_protobuf_give_identical_rows(serve, tmp_path: Path) -> None:
    server = serve()
    trace_hex, span_hex, parent_hex = f"{TRACE_IDS[0]:032x}", f"{SPAN_IDS[1]:016x}", "00" * 7 + "ff"
    doc = _json_request(trace_hex.upper(), span_hex, parent_hex)  # hex case is not significant
    status, body, ctype = post(server, "/v1/traces", json.dumps(doc).encode(), JSON)
    assert (status, ctype) == (200, JSON)
    assert json.loads(body) == {}

    # the same span as protobuf: bytes ids, enum kind/status, int64 values
    pb = ExportTraceServiceRequest()
    rs = pb.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "api"
    sp = rs.scope_spans.add().spans.add()
    sp.trace_id, sp.span_id = bytes.fromhex(trace_hex), bytes.fromhex(span_hex)
    sp.parent_span_id = bytes.fromhex(parent_hex)
    sp.name, sp.kind = "POST /v1/chat/completions", 2
    sp.start_time_unix_nano, sp.end_time_unix_nano = 1700000000000000001, 1700000000250000000
    for key, field, value in (
        ("http.response.status_code", "int_value", 503),
        ("gen_ai.request.model", "string_value", "m"),
        ("ratio", "double_value", 0.5),
    ):
        a = sp.attributes.add()
        a.key = key
        setattr(a.value, field, value)
    sp.status.code, sp.status.message = 2, "engine dead"
    status, body, ctype = post(server, "/v1/traces", pb.SerializeToString(), PB)
    assert (status, ctype, body) == (200, PB, b"")
    ExportTraceServiceResponse().ParseFromString(body)

    rows = load(server, tmp_path)["spans"]
    assert len(rows) == 2
    assert rows[0] == rows[1]
    row = rows[0]
    assert (row["trace_id"], row["span_id"], row["parent_span_id"]) == (
        trace_hex,
        span_hex,
        parent_hex,
    )
    assert row["kind"] == "SERVER" and row["status_code"] == "ERROR"
    assert row["http_status"] == 503 and row["start_ns"] == 1700000000000000001
    assert row["service_name"] == "api"
    # no host.name in the resource, sender on loopback: the receiver's own host
    assert row["host"] == server.receiver.local_host


def test_bad_spans_are_dropped_and_reported_as_partial_success(serve, tmp_path: Path) -> None:
    server = serve()
    doc = _json_request(f"{TRACE_IDS[0]:032x}", f"{SPAN_IDS[0]:016x}", None)
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    good = spans[0]
    spans.append({**good, "traceId": "not-hex", "name": "bad id"})
    spans.append({**good, "spanId": "00" * 8, "name": "zero id"})
    spans.append({k: v for k, v in good.items() if k != "startTimeUnixNano"} | {"name": "no t"})
    status, body, _ = post(server, "/v1/traces", json.dumps(doc).encode(), JSON)
    assert status == 200
    partial = json.loads(body)["partialSuccess"]
    assert int(partial["rejectedSpans"]) == 3
    assert "bad id" in partial["errorMessage"]
    rows = load(server, tmp_path)["spans"]
    assert [r["name"] for r in rows] == [good["name"]]
    st = server.stats()
    assert (st["spans_received"], st["spans_stored"], st["spans_rejected"]) == (4, 1, 3)


def test_chunked_request_body_is_accepted(serve, tmp_path: Path) -> None:
    server = serve()
    data = json.dumps(_json_request("ab" * 16, "cd" * 8, None)).encode()
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    chunks = [data[i : i + 50] for i in range(0, len(data), 50)]
    conn.request(
        "POST", "/v1/traces", body=iter(chunks), headers={"Content-Type": JSON}, encode_chunked=True
    )
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    conn.close()
    assert [r["trace_id"] for r in load(server, tmp_path)["spans"]] == ["ab" * 16]


# ---------------------------------------------------------------------------
# logs

CUDA_LINE = "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_real_log_exporter_cuda_error_becomes_evidence_info_does_not(serve, tmp_path) -> None:
    server = serve()
    tracing = TracerProvider(id_generator=FixedIds())
    logs = LoggerProvider(
        resource=Resource.create(
            {"service.name": "vllm", "host.name": "gpu-node-7", "process.pid": 4242}
        )
    )
    logs.add_log_record_processor(
        SimpleLogRecordProcessor(OTLPLogExporter(endpoint=server.endpoint + "/v1/logs"))
    )
    logger = logs.get_logger("vllm.engine")
    with tracing.get_tracer("t").start_as_current_span("llm_request") as span:
        ctx = set_span_in_context(span)
        logger.emit(
            body=CUDA_LINE,
            severity_number=SeverityNumber.ERROR,
            severity_text="ERROR",
            context=ctx,
        )
        logger.emit(
            body="Avg prompt throughput: 12.5 tokens/s, Running: 3 reqs",
            severity_number=SeverityNumber.INFO,
            severity_text="INFO",
            context=ctx,
        )
        logger.emit(  # an error that is no catalog code: counted, not kept
            body="request failed for prompt='my secret prompt'",
            severity_number=SeverityNumber.ERROR,
            severity_text="ERROR",
            context=ctx,
        )
    logger.emit(  # no span; the evidence is in the exception attributes, not the body
        body="Engine core failed",
        severity_number=SeverityNumber.FATAL,
        severity_text="CRITICAL",
        attributes={
            "exception.type": "torch.OutOfMemoryError",
            "exception.message": "CUDA out of memory. Tried to allocate 2.00 GiB",
        },
    )
    assert logs.force_flush(10_000)
    trace_hex, span_hex = f"{TRACE_IDS[0]:032x}", f"{SPAN_IDS[0]:016x}"
    assert f"{span.get_span_context().trace_id:032x}" == trace_hex

    rows = {r["code"]: r for r in load(server, tmp_path)["error_context"]}
    assert set(rows) == {"CUDA_ERROR_ILLEGAL_ADDRESS", "TORCH_CUDA_OOM"}
    cuda = rows["CUDA_ERROR_ILLEGAL_ADDRESS"]
    code = default_catalog()["CUDA_ERROR_ILLEGAL_ADDRESS"]
    assert (cuda["trace_id"], cuda["span_id"]) == (trace_hex, span_hex)
    assert cuda["host"] == "gpu-node-7" and cuda["pid"] == 4242
    assert cuda["source"] == "otlp:logs"
    assert (cuda["layer"], cuda["family"], cuda["severity"]) == (
        code.layer,
        code.family,
        str(code.severity),
    )
    assert cuda["message"] == cuda["raw"] == CUDA_LINE
    attrs = json.loads(cuda["attrs"])
    assert attrs["severity_text"] == "ERROR" and attrs["severity_number"] == 17
    assert attrs["service"] == "vllm" and attrs["scope"] == "vllm.engine"
    oom = rows["TORCH_CUDA_OOM"]
    assert oom["trace_id"] is None  # emitted outside the span context
    assert json.loads(oom["attrs"])["matched_on"] == "exception"
    assert "CUDA out of memory" in oom["raw"]

    st = server.stats()
    assert st["log_requests"] == 4  # SimpleLogRecordProcessor: one export per record
    assert (st["log_records_received"], st["log_records_matched"]) == (4, 2)
    assert (st["log_records_unmatched"], st["log_records_unmatched_error"]) == (2, 1)
    server.shutdown()
    leftovers = b"".join(p.read_bytes() for p in server.receiver.writer.dir.iterdir())
    assert b"my secret prompt" not in leftovers
    logs.shutdown()


def test_json_logs_ids_redaction_and_bad_ids(serve, tmp_path: Path) -> None:
    server = serve()
    line = f"{CUDA_LINE} while serving cmpl-abc12345 prompt='tell me a secret'"
    doc = {
        "resourceLogs": [
            {
                "resource": {"attributes": [{"key": "host.name", "value": {"stringValue": "h1"}}]},
                "scopeLogs": [
                    {
                        "logRecords": [
                            {
                                "timeUnixNano": "1700000000000000000",
                                "severityText": "ERROR",
                                "body": {"stringValue": f"Traceback:\n  foo\n{line}\n"},
                                "traceId": "0af7651916cd43dd8448eb211c80319c",
                                "spanId": "b7ad6b7169203331",
                            },
                            {  # malformed ids: the evidence is kept without them
                                "observedTimeUnixNano": "1700000000000000005",
                                "body": {"stringValue": CUDA_LINE},
                                "traceId": "zz",
                                "spanId": base64.b64encode(b"12345678").decode(),
                            },
                        ]
                    }
                ],
            }
        ]
    }
    status, body, _ = post(server, "/v1/logs", json.dumps(doc).encode(), JSON)
    assert status == 200 and json.loads(body) == {}
    rows = sorted(load(server, tmp_path)["error_context"], key=lambda r: r["ts"])
    assert [r["code"] for r in rows] == ["CUDA_ERROR_ILLEGAL_ADDRESS"] * 2
    first, second = rows
    assert first["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert first["span_id"] == "b7ad6b7169203331"
    assert first["ts"] == 1700000000000000000 and first["host"] == "h1"
    assert first["request_id"] == "cmpl-abc12345"
    assert "tell me a secret" not in first["raw"] and "<redacted 16 chars>" in first["raw"]
    assert first["message"].startswith(CUDA_LINE) and "\n" not in first["message"]
    assert "tell me a secret" not in first["message"]
    assert json.loads(first["attrs"])["severity_number"] == 17  # from the severity text
    assert second["trace_id"] is None
    assert second["span_id"] == b"12345678".hex()  # base64 tolerated in OTLP/JSON
    assert second["ts"] == 1700000000000000005


# ---------------------------------------------------------------------------
# refusals


def _status(body: bytes, ctype: str) -> tuple[int, str]:
    if ctype.startswith(JSON):
        d = json.loads(body)
        return d["code"], d["message"]
    st = status_pb2.Status()
    st.ParseFromString(body)
    return st.code, st.message


def test_garbage_gets_400_and_the_receiver_keeps_serving(serve, tmp_path: Path) -> None:
    server = serve()
    bad = [
        ("/v1/traces", b"\xff\xfe this is not protobuf", PB, {}),
        ("/v1/logs", b"plain text?", PB, {}),  # parses as protobuf: unknown fields only
        ("/v1/logs", b"{not json", JSON, {}),
        ("/v1/traces", b"[1, 2, 3]", JSON, {}),
        ("/v1/traces", b'{"resourceSpans": {"a": 1}}', JSON, {}),
        ("/v1/traces", b"\x1f\x8b\x08\x00garbage", PB, {"Content-Encoding": "gzip"}),
    ]
    for path, body, ctype, headers in bad:
        status, rbody, rtype = post(server, path, body, ctype, headers=headers)
        assert status == 400, (body, rbody)
        code, message = _status(rbody, rtype)
        assert code == 3 and message
    st = server.stats()
    assert st["payloads_rejected"] == len(bad) and st["internal_errors"] == 0
    reasons = [r["reason"] for r in st["recent_rejections"]]
    assert len(reasons) == len(bad) and "invalid JSON" in reasons[2]

    data = json.dumps(_json_request("ab" * 16, "cd" * 8, None)).encode()
    assert post(server, "/v1/traces", data, JSON)[0] == 200
    assert len(load(server, tmp_path)["spans"]) == 1


def test_wrong_path_method_and_media_type(serve) -> None:
    server = serve()
    assert post(server, "/v1/metrics", b"", PB)[0] == 404
    assert post(server, "/", b"x", JSON)[0] == 404
    assert post(server, "/v1/traces", b"", None, method="GET")[0] == 405
    assert post(server, "/v1/traces", b"{}", "text/plain")[0] == 415
    assert post(server, "/v1/traces", b"{}", None)[0] == 415
    assert post(server, "/v1/traces", b"{}", JSON, headers={"Content-Encoding": "br"})[0] == 415
    assert post(server, "/v1/traces", b"{}", "application/json; charset=utf-8")[0] == 200
    assert post(server, "/v1/logs", b"", PB)[0] == 200  # an empty export is valid
    st = server.stats()
    assert (st["not_found"], st["method_not_allowed"], st["unsupported_media"]) == (2, 1, 3)
    assert st["responses"] == {"200": 2, "404": 2, "405": 1, "415": 3}


def test_oversized_bodies_get_413(serve, tmp_path: Path) -> None:
    server = serve(max_body_bytes=2048)
    status, body, ctype = post(server, "/v1/traces", b"\0" * 8192, PB)
    assert status == 413 and _status(body, ctype)[0] == 8
    # small on the wire, too large once inflated
    bomb = gzip.compress(json.dumps({"resourceSpans": [], "pad": "x" * 100_000}).encode())
    assert len(bomb) < 2048
    assert post(server, "/v1/traces", bomb, JSON, headers={"Content-Encoding": "gzip"})[0] == 413
    st = server.stats()
    assert st["payloads_too_large"] == 2
    data = json.dumps(_json_request("ab" * 16, "cd" * 8, None)).encode()
    assert post(server, "/v1/traces", data, JSON)[0] == 200


def _raw_exchange(server: OtlpHttpServer, data: bytes) -> bytes:
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_malformed_http_is_refused_and_the_server_keeps_serving(serve) -> None:
    server = serve(max_body_bytes=4096)
    cases: dict[bytes, bytes | None] = {
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n": b" 400 ",
        b"POST /v1/traces HTTP/1.1\r\nContent-Type: application/json\r\n\r\n": b" 411 ",
        b"POST /v1/traces HTTP/1.1\r\nContent-Length: -5\r\n\r\n": b" 400 ",
        b"POST /v1/traces HTTP/1.1\r\nContent-Length: abc\r\n\r\n": b" 400 ",
        b"POST /v1/traces HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n": b" 400 ",
        b"POST /v1/traces HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/json\r\n\r\nffff\r\n": b" 413 ",
        b"POST /v1/traces HTTP/1.1\r\nContent-Length: 100\r\n\r\nshort": None,  # gone
        b"POST /v1/traces HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n": b" 431 ",
    }
    for request, expect in cases.items():
        answer = _raw_exchange(server, request)
        if expect is None:  # the client went away mid-body: no answer, no crash
            assert answer == b""
            continue
        assert expect in answer.split(b"\r\n", 1)[0] + b" ", (request[:60], answer[:200])
    st = server.stats()
    assert st["internal_errors"] == 0
    data = json.dumps(_json_request("ab" * 16, "cd" * 8, None)).encode()
    assert post(server, "/v1/traces", data, JSON)[0] == 200


def test_fuzzed_payloads_never_crash_the_receiver(tmp_path: Path) -> None:
    rcv = OtlpReceiver(tmp_path / "spool")
    rng = random.Random(20240607)
    pb = ExportTraceServiceRequest()
    json_format.ParseDict(
        {
            "resourceSpans": [
                {
                    "resource": {"attributes": [{"key": "a", "value": {"intValue": "1"}}]},
                    "scopeSpans": [
                        {
                            "spans": [
                                {
                                    "traceId": base64.b64encode(b"\x01" * 16).decode(),
                                    "spanId": base64.b64encode(b"\x02" * 8).decode(),
                                    "name": "n",
                                    "startTimeUnixNano": "5",
                                }
                            ]
                        }
                    ],
                }
            ]
        },
        pb,
    )
    seed = pb.SerializeToString()
    seed_json = _json_request("ab" * 16, "cd" * 8, "ef" * 8)
    statuses: set[int] = set()

    def mutate(value: Any, depth: int = 0) -> Any:
        if isinstance(value, dict):
            return {k: mutate(v, depth + 1) for k, v in value.items() if rng.random() > 0.05}
        if isinstance(value, list):
            return [mutate(v, depth + 1) for v in value]
        r = rng.random()
        if r < 0.15:
            return rng.choice([None, 1.5, -1, 2**70, "", "x" * 40, [], {}, True, "ff" * 16])
        return value

    for i in range(400):
        raw = bytearray(seed)
        for _ in range(rng.randint(1, 6)):
            op = rng.random()
            pos = rng.randrange(len(raw) + 1)
            if op < 0.4 and raw:
                raw[min(pos, len(raw) - 1)] = rng.randrange(256)
            elif op < 0.7:
                raw[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            else:
                del raw[pos : pos + rng.randint(1, 8)]
        for path in ("/v1/traces", "/v1/logs"):
            reply = rcv.handle(path, bytes(raw), content_type=PB)
            statuses.add(reply.status)
            assert reply.status in (200, 400), (i, reply)
        doc = json.dumps(mutate(seed_json)).encode()
        reply = rcv.handle("/v1/traces", doc, content_type=JSON)
        assert reply.status in (200, 400), (i, reply)
        statuses.add(reply.status)
    st = rcv.stats()
    assert st["internal_errors"] == 0 and statuses == {200, 400}
    assert len(st["recent_rejections"]) == 32  # bounded
    rcv.shutdown()
    store = Store(tmp_path / "fuzz.duckdb")
    rep = load_spool(store, tmp_path / "spool")  # all that was accepted fits the store
    assert rep.quarantined == 0
    assert store.counts()["spans"] == st["spans_stored"]


def test_shutdown_flushes_the_spool_and_is_idempotent(serve, tmp_path: Path) -> None:
    server = serve()
    data = json.dumps(_json_request("ab" * 16, "cd" * 8, None)).encode()
    # keep a connection open across shutdown, like an exporter's session
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("POST", "/v1/traces", body=data, headers={"Content-Type": JSON})
    assert conn.getresponse().read() == b"{}"
    spool = server.receiver.writer.dir
    assert [p.suffix for p in spool.iterdir()] == [".open"]
    server.shutdown()
    server.shutdown()
    assert [p.suffix for p in spool.iterdir()] == [".seg"]
    with pytest.raises(OSError):
        post(server, "/v1/traces", data, JSON)
    # the idle keep-alive connection was closed too
    with pytest.raises((OSError, http.client.HTTPException)):
        conn.request("POST", "/v1/traces", body=data, headers={"Content-Type": JSON})
        conn.getresponse().read()
    conn.close()
    # after shutdown the receiver itself refuses (503), it does not write
    assert server.receiver.handle("/v1/traces", data, content_type=JSON).status == 503


def test_module_runs_as_a_command_and_stops_on_sigterm(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ingest.collect", "--port", "0", "--spool", str(spool)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert "OTLP/HTTP receiver on http://127.0.0.1:" in first, proc.stderr
        port = int(first.split("127.0.0.1:")[1].split()[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        data = json.dumps(_json_request("ab" * 16, "cd" * 8, None)).encode()
        conn.request(
            "POST",
            "/v1/traces",
            body=zlib.compress(data),
            headers={"Content-Type": JSON, "Content-Encoding": "deflate"},
        )
        assert conn.getresponse().status == 200
        conn.close()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["spans_stored"] == 1
    assert [p.suffix for p in spool.iterdir()] == [".seg"]
