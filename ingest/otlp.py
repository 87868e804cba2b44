"""OTLP/JSON traces (an OpenTelemetry Collector file exporter's output) -> spans rows."""

from __future__ import annotations

import json
import time
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
    return {kv["key"]: _any_value(kv.get("value", {})) for kv in kvs if "key" in kv}


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


def spans_from_request(doc: dict[str, Any]) -> list[S.Span]:
    """One ExportTraceServiceRequest (as JSON) -> spans. Raises KeyError/ValueError."""
    out: list[S.Span] = []
    for rs in doc.get("resourceSpans", []):
        resource = _attrs(rs.get("resource", {}).get("attributes", []))
        service = resource.get("service.name")
        host = resource.get("host.name")
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                attrs = _attrs(sp.get("attributes", []))
                http = next((attrs[k] for k in _HTTP_STATUS_KEYS if k in attrs), None)
                status = sp.get("status", {}) or {}
                out.append(
                    S.Span(
                        trace_id=str(sp["traceId"]).lower(),
                        span_id=str(sp["spanId"]).lower(),
                        parent_span_id=(
                            str(sp.get("parentSpanId")).lower() if sp.get("parentSpanId") else None
                        ),
                        name=str(sp.get("name", "")),
                        kind=_kind(sp.get("kind")),
                        start_ns=int(sp["startTimeUnixNano"]),
                        end_ns=int(sp["endTimeUnixNano"]) if sp.get("endTimeUnixNano") else None,
                        status_code=_status(status.get("code")),
                        status_message=status.get("message"),
                        http_status=int(http) if http is not None else None,
                        service_name=service,
                        host=host,
                        attributes=attrs,
                        resource=resource,
                    )
                )
    return out


def parse_otlp_json_lines(lines: Iterable[bytes], *, source: str) -> OtlpResult:
    res = OtlpResult()
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            res.spans.extend(spans_from_request(json.loads(raw)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            now = time.time_ns()
            res.quarantine.append(
                {
                    "quarantine_id": S.new_event_id(now),
                    "ts": now,
                    "source": source,
                    "origin": f"line {n}",
                    "reason": f"not an OTLP/JSON trace export: {exc}",
                    "raw": raw[:65536].decode("utf-8", "replace"),
                }
            )
    return res


def parse_otlp_file(path: str | Path) -> OtlpResult:
    p = Path(path)
    with open(p, "rb") as fh:
        return parse_otlp_json_lines(fh, source=str(p))
