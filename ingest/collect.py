"""A small OTLP/HTTP receiver: traces and logs in, spool records out.

OpenTelemetry SDK exporters (``OTLPSpanExporter``, ``OTLPLogExporter``) and
vLLM's ``--otlp-traces-endpoint`` POST to ``/v1/traces`` and ``/v1/logs``.
This receiver accepts both OTLP/HTTP encodings (``application/x-protobuf`` and
``application/json``), optionally ``gzip``/``deflate`` compressed, and writes
through :class:`ingest.spool.SpoolWriter`; it never opens DuckDB, so it can run
next to the serving process while ``rca load`` moves the spool into the store.

* Each span becomes an :class:`ingest.schema.Span` row (via
  :func:`ingest.otlp.spans_from_request`). Protobuf ``bytes`` ids, which the
  protobuf JSON mapping renders as base64, are turned into the lowercase hex
  that OTLP/JSON uses, so both encodings give identical rows.
* Each log record whose text (string body, else ``exception.type: message``,
  else ``exception.stacktrace``) matches a catalog pattern becomes an
  :class:`ingest.schema.ErrorContext` (redacted with
  :func:`ingest.normalize.redact`). Records that match nothing are counted,
  not stored: logs may hold user data.
* A payload that cannot be decoded is answered 400 and counted; only its
  reason (never its bytes) is kept, in a bounded in-memory list shown by
  :meth:`OtlpReceiver.stats`. Spans or log records that are individually
  malformed are dropped and reported as an OTLP *partial success*.

Responses follow the OTLP/HTTP spec: 200 with an (empty or partial-success)
``Export*ServiceResponse`` in the request's encoding; 400 undecodable; 404
other paths; 405 other methods on the signal paths; 411 no length; 413 body
(compressed or not) over ``max_body_bytes``; 415 unknown content type or
encoding; 503 while shutting down. Error bodies are a ``google.rpc.Status``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow as pa
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from ingest import schema as S
from ingest.logs import _REQ as _REQUEST_ID
from ingest.normalize import LineClassifier, default_classifier, redact
from ingest.otlp import _any_value, _attrs, spans_from_request
from ingest.spool import SpoolWriter

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "Reply",
    "OtlpReceiver",
    "OtlpHttpServer",
    "make_server",
    "main",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
TRACES_PATH = "/v1/traces"
LOGS_PATH = "/v1/logs"
_PROTOBUF_TYPES = frozenset({"application/x-protobuf", "application/protobuf"})
_JSON_TYPES = frozenset({"application/json"})
_SEVERITY_ERROR = 17  # OTLP SeverityNumber: ERROR=17..20, FATAL=21..24
_MAX_TEXT = 64 * 1024  # classify and keep at most this much of one log record
_MAX_REASON = 300
_INT64_MAX = (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
_ROW_ERRORS = (KeyError, ValueError, TypeError, AttributeError, RecursionError)
# gRPC status codes for the google.rpc.Status error body
_GRPC_CODE = {400: 3, 404: 5, 405: 12, 411: 3, 413: 8, 415: 3, 500: 13, 503: 14}


class _Rejected(Exception):
    """The whole payload is refused with an HTTP status."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes = b""
    content_type: str = "application/x-protobuf"
    close: bool = False


# ---------------------------------------------------------------------------
# decoding helpers


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def _decompress(data: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding`` (gzip, deflate, identity), never beyond ``limit`` bytes."""
    codings = [c.strip().lower() for c in (encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding in ("identity", "none"):
            continue
        if coding in ("gzip", "x-gzip"):
            data = _inflate(data, 16 + zlib.MAX_WBITS, limit, multi_member=True)
        elif coding == "deflate":
            try:
                data = _inflate(data, zlib.MAX_WBITS, limit)
            except zlib.error:  # some clients send raw deflate without the zlib header
                data = _inflate(data, -zlib.MAX_WBITS, limit)
        else:
            raise _Rejected(415, f"unsupported Content-Encoding {coding!r}")
    return data


def _inflate(data: bytes, wbits: int, limit: int, *, multi_member: bool = False) -> bytes:
    out = bytearray()
    while True:
        d = zlib.decompressobj(wbits)
        out += d.decompress(data, limit + 1 - len(out))
        if len(out) > limit or d.unconsumed_tail:
            raise _Rejected(413, f"decompressed body exceeds {limit} bytes")
        if not d.eof:
            raise zlib.error("truncated compressed stream")
        data = d.unused_data
        if not (multi_member and data.strip(b"\0")):
            return bytes(out)


def _b64len(nbytes: int) -> int:
    return 4 * ((nbytes + 2) // 3)


def _hex_id(value: Any, nbytes: int, *, b64: bool) -> str | None:
    """An OTLP trace/span id -> lowercase hex; None if absent or all zero.

    ``b64`` says the id came from protobuf (bytes, rendered base64 by the JSON
    mapping). OTLP/JSON ids are hex; a base64 id of the right length is
    accepted there too (the lengths never collide: 32/16 hex vs 24/12 base64).
    Raises ValueError for an id of the wrong shape.
    """
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"id is not a string: {value!r}"[:_MAX_REASON])
    try:
        if not b64 and len(value) == 2 * nbytes:
            raw = bytes.fromhex(value)
        elif len(value) == _b64len(nbytes) or b64:
            raw = base64.b64decode(value, validate=True)
        else:
            raise ValueError
    except (ValueError, binascii.Error):
        raise ValueError(f"malformed {nbytes}-byte id {value[:64]!r}") from None
    if len(raw) != nbytes:
        raise ValueError(f"id is {len(raw)} bytes, expected {nbytes}")
    return raw.hex() if any(raw) else None


def _severity_number(v: Any) -> int:
    if isinstance(v, bool):
        return 0
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        if v.lstrip("-").isdigit():
            return int(v)
        name = v.removeprefix("SEVERITY_NUMBER_")
        base = {"TRACE": 1, "DEBUG": 5, "INFO": 9, "WARN": 13, "ERROR": 17, "FATAL": 21}
        stem = name.rstrip("234")
        if stem in base:
            return base[stem] + (int(name[len(stem) :]) - 1 if name != stem else 0)
    return 0


_SEVERITY_TEXT = {
    "TRACE": 1,
    "DEBUG": 5,
    "INFO": 9,
    "NOTICE": 10,
    "WARN": 13,
    "WARNING": 13,
    "ERROR": 17,
    "ERR": 17,
    "CRITICAL": 21,
    "FATAL": 21,
    "ALERT": 22,
    "EMERGENCY": 23,
}


def _nanos(v: Any) -> int:
    try:
        n = int(v or 0)
    except (TypeError, ValueError):
        return 0
    return n if 0 < n <= _INT64_MAX else 0


def _list(obj: dict[str, Any], key: str, what: str) -> list[dict[str, Any]]:
    items = obj.get(key, [])
    if items is None:
        return []
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise _Rejected(400, f"{what}.{key} is not a list of objects")
    return items


def _text_of(body: Any) -> str | None:
    """A log body as text: a string, or the message field of a structured body."""
    if isinstance(body, str):
        return body
    if isinstance(body, dict):
        for key in ("message", "msg", "body"):
            if isinstance(body.get(key), str):
                return body[key]
    return None


def _status_pb(code: int, message: str) -> bytes:
    """``google.rpc.Status{code, message}`` in protobuf wire format."""

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            b, n = n & 0x7F, n >> 7
            out.append(b | (0x80 if n else 0))
            if not n:
                return bytes(out)

    msg = message.encode("utf-8", "replace")
    return b"\x08" + varint(code) + b"\x12" + varint(len(msg)) + msg


def _is_loopback(addr: str | None) -> bool:
    if not addr:
        return False
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


# ---------------------------------------------------------------------------
# the receiver (transport independent)


_COUNTERS = (
    "http_requests",
    "export_requests",
    "trace_requests",
    "log_requests",
    "bytes_received",
    "bytes_decoded",
    "spans_received",
    "spans_stored",
    "spans_rejected",
    "log_records_received",
    "log_records_matched",
    "log_records_unmatched",
    "log_records_unmatched_error",
    "log_records_no_text",
    "log_records_rejected",
    "payloads_rejected",
    "payloads_too_large",
    "unsupported_media",
    "not_found",
    "method_not_allowed",
    "internal_errors",
    "unavailable",
)


@dataclass
class _Outcome:
    stored: int = 0
    rejected: int = 0
    reasons: list[str] = field(default_factory=list)

    def reject(self, reason: str) -> None:
        self.rejected += 1
        if len(self.reasons) < 3:
            self.reasons.append(reason[:_MAX_REASON])


class OtlpReceiver:
    """Turns OTLP export requests into spool records; thread-safe.

    ``handle(path, body, ...)`` is the whole protocol minus the socket; the
    HTTP server below only reads the request and writes the reply.
    """

    def __init__(
        self,
        spool_dir: str | Path | None = None,
        *,
        writer: SpoolWriter | None = None,
        classifier: LineClassifier | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        keep_rejections: int = 32,
        local_host: str | None = None,
    ) -> None:
        if writer is None:
            if spool_dir is None:
                from ingest.paths import spool_dir_for

                spool_dir = spool_dir_for()
            writer = SpoolWriter(spool_dir)
            self._owns_writer = True
        else:
            self._owns_writer = False
        self.writer = writer
        self.classifier = classifier or default_classifier()
        self.max_body_bytes = int(max_body_bytes)
        #: host recorded for senders on loopback whose resource has no host.name
        self.local_host = local_host or os.uname().nodename
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._by_status: dict[int, int] = {}
        self._rejections: deque[dict[str, Any]] = deque(maxlen=keep_rejections)

    # counters -------------------------------------------------------------
    def _add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counts[k] += v

    def count_status(self, status: int) -> None:
        with self._lock:
            self._by_status[status] = self._by_status.get(status, 0) + 1

    def note_rejection(self, path: str, status: int, reason: str, **extra: Any) -> None:
        counter = {
            400: "payloads_rejected",
            411: "payloads_rejected",
            413: "payloads_too_large",
            415: "unsupported_media",
            404: "not_found",
            405: "method_not_allowed",
            500: "internal_errors",
            503: "unavailable",
        }.get(status)
        with self._lock:
            if counter:
                self._counts[counter] += 1
            if status in (400, 411, 413, 415, 500, 503):
                self._rejections.append(
                    {
                        "ts": time.time_ns(),
                        "path": path[:200],
                        "status": status,
                        "reason": reason[:_MAX_REASON],
                        **extra,
                    }
                )

    def stats(self) -> dict[str, Any]:
        """Every counter, replies by HTTP status, and the last rejected payloads' reasons."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["responses"] = {str(k): v for k, v in sorted(self._by_status.items())}
            out["recent_rejections"] = list(self._rejections)
            out["in_flight"] = self._inflight
        out["spool_write_errors"] = self.writer.errors
        return out

    # protocol -------------------------------------------------------------
    def handle(
        self,
        path: str,
        body: bytes,
        *,
        content_type: str | None,
        content_encoding: str | None = None,
        peer: str | None = None,
    ) -> Reply:
        """One POST: decode, store, and build the reply. Never raises."""
        path = path.split("?", 1)[0]
        media = _media_type(content_type)
        as_json = media in _JSON_TYPES
        if path not in (TRACES_PATH, LOGS_PATH):
            return self._error(path, 404, f"no OTLP endpoint at {path}", as_json)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._inflight += 1
        if closed:
            return self._error(path, 503, "receiver is shutting down", as_json)
        try:
            self._add(export_requests=1, bytes_received=len(body))
            if media not in _PROTOBUF_TYPES and not as_json:
                raise _Rejected(415, f"unsupported Content-Type {content_type!r}")
            if len(body) > self.max_body_bytes:
                raise _Rejected(413, f"body exceeds {self.max_body_bytes} bytes")
            try:
                data = _decompress(body, content_encoding, self.max_body_bytes)
            except zlib.error as exc:
                raise _Rejected(400, f"bad {content_encoding} stream: {exc}") from None
            self._add(bytes_decoded=len(data))
            host = self.local_host if _is_loopback(peer) else None
            spool_errors = self.writer.errors
            if path == TRACES_PATH:
                doc = self._decode(data, as_json, ExportTraceServiceRequest)
                out = self._ingest_traces(doc, b64=not as_json, default_host=host)
                self._add(trace_requests=1)
                resp: Any = ExportTraceServiceResponse()
                if out.rejected:
                    resp.partial_success.rejected_spans = out.rejected
            else:
                doc = self._decode(data, as_json, ExportLogsServiceRequest)
                out = self._ingest_logs(doc, b64=not as_json, default_host=host)
                self._add(log_requests=1)
                resp = ExportLogsServiceResponse()
                if out.rejected:
                    resp.partial_success.rejected_log_records = out.rejected
            if self.writer.errors > spool_errors:
                # could not persist: 503 is retryable, so the exporter sends it again
                raise _Rejected(503, f"cannot write to the spool {self.writer.dir}")
            if out.rejected:
                resp.partial_success.error_message = "; ".join(out.reasons)
            if as_json:
                payload = json.dumps(json_format.MessageToDict(resp)).encode()
                return Reply(200, payload, "application/json")
            return Reply(200, resp.SerializeToString(), "application/x-protobuf")
        except _Rejected as exc:
            return self._error(path, exc.status, exc.reason, as_json, bytes=len(body))
        except Exception as exc:  # never let a payload take the receiver down
            log.exception("OTLP receiver: unexpected error on %s", path)
            return self._error(path, 500, f"internal error: {type(exc).__name__}", as_json)
        finally:
            with self._lock:
                self._inflight -= 1
                if self._inflight == 0:
                    self._idle.notify_all()

    def _error(self, path: str, status: int, reason: str, as_json: bool, **extra: Any) -> Reply:
        self.note_rejection(path, status, reason, **extra)
        code = _GRPC_CODE.get(status, 2)
        if as_json:
            body = json.dumps({"code": code, "message": reason}).encode()
            return Reply(status, body, "application/json", close=status == 413)
        pb = _status_pb(code, reason)
        return Reply(status, pb, "application/x-protobuf", close=status == 413)

    @staticmethod
    def _decode(data: bytes, as_json: bool, msg_type: Any) -> dict[str, Any]:
        if as_json:
            try:
                doc = json.loads(data) if data.strip() else {}
            except (ValueError, RecursionError) as exc:
                raise _Rejected(400, f"invalid JSON: {exc}") from None
            if not isinstance(doc, dict):
                raise _Rejected(400, "OTLP/JSON request is not an object")
            return doc
        msg = msg_type()
        try:
            msg.ParseFromString(data)
        except (DecodeError, RecursionError, ValueError) as exc:
            raise _Rejected(400, f"invalid protobuf {msg_type.__name__}: {exc}") from None
        if data and not msg.ListFields():
            # protobuf skips unknown fields, so some random bytes "parse" as nothing
            raise _Rejected(400, f"payload holds no {msg_type.__name__} fields")
        try:
            return json_format.MessageToDict(msg, use_integers_for_enums=True)
        except (ValueError, RecursionError) as exc:
            raise _Rejected(400, f"cannot convert {msg_type.__name__}: {exc}") from None

    # traces ---------------------------------------------------------------
    def _ingest_traces(
        self, doc: dict[str, Any], *, b64: bool, default_host: str | None
    ) -> _Outcome:
        # Validate the structure first so a malformed payload stores nothing.
        batches = []
        for rs in _list(doc, "resourceSpans", "request"):
            resource = rs.get("resource") or {}
            if not isinstance(resource, dict):
                raise _Rejected(400, "resourceSpans.resource is not an object")
            spans = [
                sp
                for ss in _list(rs, "scopeSpans", "resourceSpans")
                for sp in _list(ss, "spans", "scopeSpans")
            ]
            batches.append((resource, spans))
        out = _Outcome()
        received = 0
        for resource, spans in batches:
            for sp in spans:
                received += 1
                try:
                    span = _one_span(sp, resource, b64=b64)
                    if span.host is None:
                        span.host = default_host
                    row = _checked(span.to_row(), S.SPANS)
                except _ROW_ERRORS as exc:
                    out.reject(f"span {str(sp.get('name', ''))[:80]!r}: {_why(exc)}")
                    continue
                self.writer.write_row("s", row)
                out.stored += 1
        self._add(spans_received=received, spans_stored=out.stored, spans_rejected=out.rejected)
        return out

    # logs -----------------------------------------------------------------
    def _ingest_logs(self, doc: dict[str, Any], *, b64: bool, default_host: str | None) -> _Outcome:
        batches = []
        for rl in _list(doc, "resourceLogs", "request"):
            resource = rl.get("resource") or {}
            if not isinstance(resource, dict):
                raise _Rejected(400, "resourceLogs.resource is not an object")
            for sl in _list(rl, "scopeLogs", "resourceLogs"):
                scope = sl.get("scope") or {}
                scope_name = scope.get("name") if isinstance(scope, dict) else None
                batches.append((resource, scope_name, _list(sl, "logRecords", "scopeLogs")))
        out = _Outcome()
        c = dict.fromkeys(("received", "matched", "unmatched", "unmatched_error", "no_text"), 0)
        for resource, scope_name, records in batches:
            try:
                res_attrs = _attrs(resource.get("attributes") or [])
            except _ROW_ERRORS as exc:
                for _ in records:
                    c["received"] += 1
                    out.reject(f"resource attributes: {_why(exc)}")
                continue
            for lr in records:
                c["received"] += 1
                try:
                    rec, sev, has_text = self._one_log(lr, res_attrs, scope_name, b64, default_host)
                    row = _checked(rec.to_row(), S.ERROR_CONTEXT) if rec is not None else None
                except _ROW_ERRORS as exc:
                    out.reject(f"log record: {_why(exc)}")
                    continue
                if row is not None:
                    self.writer.write_row("e", row)
                    out.stored += 1
                    c["matched"] += 1
                    continue
                c["unmatched"] += 1
                c["unmatched_error"] += sev >= _SEVERITY_ERROR
                c["no_text"] += not has_text
        self._add(
            log_records_received=c["received"],
            log_records_matched=c["matched"],
            log_records_unmatched=c["unmatched"],
            log_records_unmatched_error=c["unmatched_error"],
            log_records_no_text=c["no_text"],
            log_records_rejected=out.rejected,
        )
        return out

    def _one_log(
        self,
        lr: dict[str, Any],
        res_attrs: dict[str, Any],
        scope_name: Any,
        b64: bool,
        default_host: str | None,
    ) -> tuple[S.ErrorContext | None, int, bool]:
        sev_text = lr.get("severityText")
        sev = _severity_number(lr.get("severityNumber"))
        if sev == 0 and isinstance(sev_text, str):
            sev = _SEVERITY_TEXT.get(sev_text.strip().upper(), 0)
        attrs = _attrs(lr.get("attributes") or [])
        body = lr.get("body")
        body_v = _any_value(body) if isinstance(body, dict) and "bytesValue" not in body else None
        candidates: list[tuple[str, str]] = []
        if (t := _text_of(body_v)) is not None:
            candidates.append(("body", t))
        etype, emsg = attrs.get("exception.type"), attrs.get("exception.message")
        if isinstance(etype, str) or isinstance(emsg, str):
            candidates.append(("exception", f"{etype or ''}: {emsg or ''}".strip(": ")))
        if isinstance(st := attrs.get("exception.stacktrace"), str):
            candidates.append(("stacktrace", st))
        if not candidates:
            return None, sev, False
        for where, text in candidates:
            text = text[:_MAX_TEXT]
            match = self.classifier.classify(text)
            if match is None:
                continue
            try:
                trace_id = _hex_id(lr.get("traceId"), 16, b64=b64)
            except ValueError:
                trace_id = None
            try:
                span_id = _hex_id(lr.get("spanId"), 8, b64=b64)
            except ValueError:
                span_id = None
            ts = _nanos(lr.get("timeUnixNano")) or _nanos(lr.get("observedTimeUnixNano"))
            ts = ts or time.time_ns()
            host = res_attrs.get("host.name")
            host = str(host) if host is not None else default_host
            service = res_attrs.get("service.name")
            pid = res_attrs.get("process.pid")
            fields = dict(match.fields)
            # the line that matched, for the message; the whole (bounded) text as raw
            start = text.rfind("\n", 0, match.span[0]) + 1
            end = text.find("\n", match.span[1])
            line = redact(text[start : end if end >= 0 else len(text)])
            redacted = redact(text)
            rid = fields.get("request_id") or ((r := _REQUEST_ID.search(text)) and r["rid"])
            xid = fields.get("xid")
            fpid = fields.get("pid")
            rec = S.ErrorContext.from_catalog(
                match.code,
                source="otlp:logs",
                ts=ts,
                event_id=_event_id(host, service, ts, trace_id, span_id, redacted),
                trace_id=trace_id,
                span_id=span_id,
                request_id=str(rid) if rid else None,
                host=host,
                pid=next((p for p in (_small_int(fpid), _small_int(pid)) if p is not None), None),
                xid=_small_int(xid),
                confidence=1.0,
                message=line[:512],
                attrs={
                    "severity_text": str(sev_text) if sev_text else None,
                    "severity_number": sev,
                    "service": service,
                    "scope": scope_name if isinstance(scope_name, str) else None,
                    "matched_on": where,
                    "fields": fields,
                },
                raw=redacted,
            )
            return rec, sev, True
        return None, sev, True

    # lifecycle ------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Refuse new exports, wait for those in flight, and flush the spool segment."""
        with self._lock:
            self._closed = True
            deadline = time.monotonic() + timeout
            while self._inflight and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()

    close = shutdown


_INT_RANGE = {
    pa.int8(): 1 << 7,
    pa.int16(): 1 << 15,
    pa.int32(): 1 << 31,
    pa.int64(): 1 << 63,
}


def _checked(row: dict[str, Any], table: S.Table) -> dict[str, Any]:
    """The row if every value fits its column, else TypeError (the loader would
    quarantine it; refusing here tells the sender, as a partial success)."""
    for col in table.columns:
        v = row.get(col.name)
        if v is None:
            if not col.nullable:
                raise TypeError(f"{col.name} is missing")
            continue
        if pa.types.is_string(col.arrow):
            ok = isinstance(v, str)
        elif pa.types.is_integer(col.arrow):
            bound = _INT_RANGE[col.arrow]
            ok = isinstance(v, int) and not isinstance(v, bool) and -bound <= v < bound
        elif pa.types.is_floating(col.arrow):
            ok = isinstance(v, int | float) and not isinstance(v, bool)
        else:
            ok = True
        if not ok:
            raise TypeError(f"{col.name} does not fit {col.duck}: {v!r}"[:_MAX_REASON])
    return row


def _why(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return f"{type(exc).__name__}: {exc}"[:_MAX_REASON]


def _small_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    return v if isinstance(v, int) and 0 <= v <= _INT32_MAX else None


def _one_span(sp: dict[str, Any], resource: dict[str, Any], *, b64: bool) -> S.Span:
    sp = dict(sp)
    trace_id = _hex_id(sp.get("traceId"), 16, b64=b64)
    span_id = _hex_id(sp.get("spanId"), 8, b64=b64)
    if trace_id is None or span_id is None:
        raise ValueError("missing or all-zero traceId/spanId")
    sp["traceId"], sp["spanId"] = trace_id, span_id
    sp["parentSpanId"] = _hex_id(sp.get("parentSpanId"), 8, b64=b64)
    (span,) = spans_from_request(
        {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": [sp]}]}]}
    )
    if not 0 < span.start_ns <= _INT64_MAX:
        raise ValueError(f"startTimeUnixNano out of range: {span.start_ns}")
    if span.end_ns is not None and not 0 <= span.end_ns <= _INT64_MAX:
        raise ValueError(f"endTimeUnixNano out of range: {span.end_ns}")
    if span.http_status is not None and not 0 <= span.http_status <= _INT32_MAX:
        span.http_status = None  # the attribute is still in span.attributes
    return span


def _event_id(
    host: str | None, service: Any, ts: int, trace_id: str | None, span_id: str | None, text: str
) -> str:
    """Deterministic: an exporter's retry of the same record gets the same id."""
    key = f"otlp\0{host}\0{service}\0{ts}\0{trace_id}\0{span_id}\0{text}"
    h = hashlib.blake2b(key.encode("utf-8", "replace"), digest_size=16).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# ---------------------------------------------------------------------------
# HTTP transport


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: exporters reuse their connection
    server_version = "rca-otlp"
    sys_version = ""
    server: OtlpHttpServer

    def setup(self) -> None:
        self.timeout = self.server.request_timeout
        super().setup()
        self.server._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server._track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, reply: Reply) -> None:
        self.server.receiver.count_status(reply.status)
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        if reply.close:
            self.send_header("Connection", "close")
            self.close_connection = True
        if reply.status == 405:
            self.send_header("Allow", "POST")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)

    def _plain(self, status: int, reason: str, *, close: bool = False) -> None:
        self.server.receiver.note_rejection(self.path, status, reason)
        self._send(Reply(status, reason.encode(), "text/plain; charset=utf-8", close))

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        rcv = self.server.receiver
        rcv._add(http_requests=1)
        if self.path.split("?", 1)[0] not in (TRACES_PATH, LOGS_PATH):
            self._refuse(404)
            return
        try:
            body = self._read_body()
            if body is None:
                return
            reply = rcv.handle(
                self.path,
                body,
                content_type=self.headers.get("Content-Type"),
                content_encoding=self.headers.get("Content-Encoding"),
                peer=self.client_address[0] if self.client_address else None,
            )
            self._send(reply)
        except OSError:  # the client went away (reset, timeout)
            self.close_connection = True
        except Exception:
            log.exception("OTLP receiver: unexpected error")
            self.close_connection = True
            with contextlib.suppress(Exception):
                self._plain(500, "internal error", close=True)

    def _other(self) -> None:
        self.server.receiver._add(http_requests=1)
        in_api = self.path.split("?", 1)[0] in (TRACES_PATH, LOGS_PATH)
        self._refuse(405 if in_api else 404)

    do_GET = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _other  # noqa: N815

    def _refuse(self, status: int) -> None:
        path = self.path.split("?", 1)[0][:200]
        reason = (
            f"{self.command} not allowed on {path}; use POST"
            if status == 405
            else f"no OTLP endpoint at {path}"
        )
        try:
            complete = self._drain()
            self._plain(status, reason, close=not complete)
        except OSError:
            self.close_connection = True

    def _drain(self, most: int = 1 << 20) -> bool:
        """Read and drop a small request body; False if it was not read whole."""
        if self.headers.get("Transfer-Encoding"):
            return False
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return False
        if n < 0 or n > most:
            return False
        return len(self.rfile.read(n)) == n if n else True

    def _read_body(self) -> bytes | None:
        limit = self.server.receiver.max_body_bytes
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        if te and te != "identity":
            if te.split(",")[-1].strip() != "chunked":
                self._plain(400, f"unsupported Transfer-Encoding {te[:40]!r}", close=True)
                return None
            return self._read_chunked(limit)
        cl = self.headers.get("Content-Length")
        if cl is None:
            self._plain(411, "Content-Length required", close=True)
            return None
        try:
            n = int(cl)
            if n < 0:
                raise ValueError
        except ValueError:
            self._plain(400, f"bad Content-Length {cl[:40]!r}", close=True)
            return None
        if n > limit:
            self._too_large(n, limit, drain=n)
            return None
        body = self.rfile.read(n)
        if len(body) < n:  # client went away mid-body
            self.close_connection = True
            return None
        return body

    def _too_large(self, n: int, limit: int, *, drain: int) -> None:
        # Read (and drop) a moderate excess so the client sees the 413 rather
        # than a reset while it is still sending; then close the connection.
        with contextlib.suppress(OSError, ValueError):
            if drain <= limit + 4 * 1024 * 1024:
                left = drain
                while left > 0:
                    chunk = self.rfile.read(min(left, 65536))
                    if not chunk:
                        break
                    left -= len(chunk)
        rcv = self.server.receiver
        rcv._add(export_requests=1, bytes_received=n)
        rcv.note_rejection(self.path, 413, f"body of {n} bytes exceeds {limit}")
        as_json = _media_type(self.headers.get("Content-Type")) in _JSON_TYPES
        msg = f"body exceeds {limit} bytes"
        if as_json:
            reply = Reply(
                413, json.dumps({"code": 8, "message": msg}).encode(), "application/json", True
            )
        else:
            reply = Reply(413, _status_pb(8, msg), "application/x-protobuf", True)
        self._send(reply)

    def _read_chunked(self, limit: int) -> bytes | None:
        out = bytearray()
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size < 0:
                    raise ValueError
            except ValueError:
                self._plain(400, "malformed chunked body", close=True)
                return None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return bytes(out)
            if len(out) + size > limit:
                self._too_large(len(out) + size, limit, drain=0)
                return None
            chunk = self.rfile.read(size)
            if len(chunk) < size:
                self.close_connection = True
                return None
            out += chunk
            self.rfile.readline(8)  # CRLF after the chunk


class OtlpHttpServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` bound to one :class:`OtlpReceiver`."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        receiver: OtlpReceiver,
        *,
        request_timeout: float = 30.0,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.receiver = receiver
        self.request_timeout = request_timeout
        self.thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._serving = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopped = False
        super().__init__(address, _Handler)

    @property
    def endpoint(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}"

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._serving.set()
        super().serve_forever(poll_interval)

    def stats(self) -> dict[str, Any]:
        return self.receiver.stats()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets or times out is routine; anything else is logged."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("OTLP receiver: connection from %s: %s", client_address, exc)
            return
        log.error("OTLP receiver: error serving %s", client_address, exc_info=exc)
        self.receiver._add(internal_errors=1)

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._conns_lock:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)

    def shutdown(self, timeout: float = 5.0) -> None:  # type: ignore[override]
        """Stop accepting, finish exports in flight, flush the spool, close connections.

        Idempotent; a second caller returns once the first has finished.
        """
        with self._stop_lock:
            if self._stopped:
                return
            if self._serving.is_set():
                super().shutdown()  # blocks until serve_forever returns
            self.server_close()
            self.receiver.shutdown(timeout)
            with self._conns_lock:
                conns = list(self._conns)
            for conn in conns:  # idle keep-alive connections
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            if self.thread is not None and self.thread is not threading.current_thread():
                self.thread.join(timeout)
            self._stopped = True


def make_server(
    host: str = "127.0.0.1",
    port: int = 4318,
    spool_dir: str | Path | None = None,
    *,
    writer: SpoolWriter | None = None,
    classifier: LineClassifier | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_timeout: float = 30.0,
    start: bool = True,
) -> tuple[OtlpHttpServer, threading.Thread | None]:
    """Bind an OTLP/HTTP receiver (localhost by default; port 0 picks a free one).

    With ``start`` it serves from a daemon thread, returned second; otherwise
    the caller runs ``server.serve_forever()``. ``server.shutdown()`` stops it
    and flushes the spool; ``server.stats()`` gives the counters.
    """
    receiver = OtlpReceiver(
        spool_dir, writer=writer, classifier=classifier, max_body_bytes=max_body_bytes
    )
    server = OtlpHttpServer((host, port), receiver, request_timeout=request_timeout)
    if not start:
        return server, None
    thread = threading.Thread(
        target=server.serve_forever, args=(0.1,), name="otlp-receiver", daemon=True
    )
    server.thread = thread
    thread.start()
    server._serving.wait(5)
    return server, thread


def main(argv: list[str] | None = None) -> int:
    """``python -m ingest.collect [--host H] [--port P] [--spool DIR]``: serve until Ctrl-C."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(
        prog="python -m ingest.collect", description="OTLP/HTTP receiver writing to the spool"
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=4318)
    ap.add_argument("--spool", default=None, help="spool folder (default: beside the store)")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    args = ap.parse_args(argv)
    server, _ = make_server(
        args.host, args.port, args.spool, max_body_bytes=args.max_body_bytes, start=False
    )
    print(
        f"OTLP/HTTP receiver on {server.endpoint} -> spool {server.receiver.writer.dir}", flush=True
    )

    def stop(*_: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        print(json.dumps(server.stats(), default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
