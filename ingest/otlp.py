"""OTLP/JSON traces (an OpenTelemetry Collector file exporter's output) -> spans rows."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest import schema as S

__all__ = ["OtlpResult", "parse_otlp_json_lines", "parse_otlp_file", "KIND_NAMES", "STATUS_NAMES"]

KIND_NAMES = {
    0: "UNSPECIFIED",
    1: "INTERNAL",
    2: "SERVER",
    3: "CLIENT",
    4: "PRODUCER",
    5: "CONSUMER",
}
STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}
_HTTP_STATUS_KEYS = ("http.response.status_code", "http.status_code")


def _any_value(v: dict[str, Any]) -> Any:
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_any_value(x) for x in v["arrayValue"].get("values", [])]
    if "kvlistValue" in v:
        return _attrs(v["kvlistValue"].get("values", []))
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _attrs(kvs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        str(kv["key"]): _any_value(kv.get("value") or {})
        for kv in kvs
        if isinstance(kv, dict) and "key" in kv
    }


def _kind(v: Any) -> str:
    if isinstance(v, int):
        return KIND_NAMES.get(v, "UNSPECIFIED")
    s = str(v or "")
    return s.removeprefix("SPAN_KIND_") or "UNSPECIFIED"


def _status(v: Any) -> str:
    if isinstance(v, int):
        return STATUS_NAMES.get(v, "UNSET")
    return str(v or "UNSET").removeprefix("STATUS_CODE_")


@dataclass
class OtlpResult:
    spans: list[S.Span] = field(default_factory=list)
    quarantine: list[dict[str, Any]] = field(default_factory=list)


def _span(sp: dict[str, Any], service: Any, host: Any, resource: dict[str, Any]) -> S.Span:
    attrs = _attrs(sp.get("attributes", []))
    http = next((attrs[k] for k in _HTTP_STATUS_KEYS if k in attrs), None)
    status = sp.get("status", {}) or {}
    message = status.get("message")
    return S.Span(
        trace_id=_id(sp["traceId"], 32),
        span_id=_id(sp["spanId"], 16),
        parent_span_id=_id(sp["parentSpanId"], 16) if sp.get("parentSpanId") else None,
        name=str(sp.get("name", "")),
        kind=_kind(sp.get("kind")),
        start_ns=int(sp["startTimeUnixNano"]),
        end_ns=int(sp["endTimeUnixNano"]) if sp.get("endTimeUnixNano") else None,
        status_code=_status(status.get("code")),
        status_message=None if message is None else str(message),
        http_status=int(http) if http is not None else None,
        service_name=None if service is None else str(service),
        host=None if host is None else str(host),
        attributes=attrs,
        resource=resource,
    )


def _id(value: Any, width: int) -> str:
    text = str(value).lower()
    if len(text) != width or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"id {value!r} is not {width} hex digits")
    return text


def spans_from_request(
    doc: dict[str, Any], *, errors: list[tuple[str, dict[str, Any]]] | None = None
) -> list[S.Span]:
    """One ExportTraceServiceRequest (as JSON) -> spans.

    A malformed span is skipped and, when ``errors`` is given, appended to it as
    (reason, span) so the caller can quarantine it; without ``errors`` the first
    malformed span raises.
    """
    out: list[S.Span] = []
    for rs in doc.get("resourceSpans", []):
        resource = _attrs(rs.get("resource", {}).get("attributes", []))
        service = resource.get("service.name")
        host = resource.get("host.name")
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                try:
                    out.append(_span(sp, service, host, resource))
                except (KeyError, ValueError, TypeError, AttributeError) as exc:
                    if errors is None:
                        raise
                    errors.append((f"malformed span: {type(exc).__name__}: {exc}", sp))
    return out


def parse_otlp_json_lines(lines: Iterable[bytes], *, source: str) -> OtlpResult:
    res = OtlpResult()
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        errors: list[tuple[str, dict[str, Any]]] = []
        try:
            res.spans.extend(spans_from_request(json.loads(raw), errors=errors))
            for reason, sp in errors:
                res.quarantine.append(
                    S.quarantine_row(source, f"line {n}", reason, json.dumps(sp, default=str))
                )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            res.quarantine.append(
                S.quarantine_row(source, f"line {n}", f"not an OTLP/JSON trace export: {exc}", raw)
            )
    return res


def parse_otlp_file(path: str | Path) -> OtlpResult:
    p = Path(path)
    with open(p, "rb") as fh:
        return parse_otlp_json_lines(fh, source=str(p))
