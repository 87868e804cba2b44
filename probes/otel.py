"""OpenTelemetry inside the serving process: spans into the spool, trace ids onto records.

* :class:`SpoolSpanExporter` writes finished SDK spans as :class:`ingest.schema.Span`
  rows to a sink (the spool by default), so spans and error records meet in the
  store by ``trace_id``/``span_id``.
* :func:`stamp`, :func:`current_context` and :func:`record_from_code` put the
  current span's ids on an :class:`ingest.schema.ErrorContext`.
* :class:`RcaAsgiMiddleware` is a plain ASGI middleware (no framework needed) that
  opens one ``SERVER`` span per HTTP request, following the HTTP server span
  conventions, and continues an incoming W3C ``traceparent``.
* :func:`install` registers a ``TracerProvider`` with a ``BatchSpanProcessor``
  around :class:`SpoolSpanExporter` in one call.

Nothing here raises into the serving process: an OTel or sink failure is counted
and logged, rate-limited, and the request or export carries on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

from ingest import schema as S
from probes.sink import RateLimitedLog, Sink, default_sink

__all__ = [
    "SpoolSpanExporter",
    "to_span",
    "TraceIds",
    "current_context",
    "stamp",
    "record_from_code",
    "RcaAsgiMiddleware",
    "exception_type_name",
    "route_of",
    "install",
]

log = logging.getLogger("rca.probes.otel")

_HTTP_STATUS_KEYS = ("http.response.status_code", "http.status_code")
_HOST = os.uname().nodename if hasattr(os, "uname") else "localhost"  # as ErrorContext


# ---------------------------------------------------------------------------
# SDK span -> ingest.schema.Span
# ---------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """An OTel attribute value as JSON-friendly Python (sequences become lists)."""
    if isinstance(value, str | bool | int | float) or value is None:
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, Sequence):
        return [_plain(v) for v in value]
    return str(value)


def _plain_dict(attrs: Mapping[str, Any] | None) -> dict[str, Any]:
    return {str(k): _plain(v) for k, v in attrs.items()} if attrs else {}


def _http_status(attrs: Mapping[str, Any]) -> int | None:
    for key in _HTTP_STATUS_KEYS:
        value = attrs.get(key)
        if value is None or isinstance(value, bool):
            continue
        try:
            return int(value)
        except (TypeError, ValueError):
            continue
    return None


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def to_span(span: ReadableSpan) -> S.Span:
    """One finished SDK span as the store's span row (its resource gains
    :data:`ingest.schema.HOST_PID_KEY`, the process's pid as the kernel driver prints it, for
    telling the trace's own Xids from another process's)."""
    ctx = span.get_span_context()
    if ctx is None or not ctx.is_valid:
        raise ValueError("span has no valid span context")
    parent = span.parent
    attrs = _plain_dict(span.attributes)
    resource = _plain_dict(span.resource.attributes if span.resource is not None else None)
    host_pid = S.own_pid()  # exported in the serving process: its pid as NVRM prints it
    if host_pid is not None:
        resource.setdefault(S.HOST_PID_KEY, host_pid)
    status = span.status
    start = span.start_time
    if start is None:
        raise ValueError("span was never started")
    return S.Span(
        trace_id=trace.format_trace_id(ctx.trace_id),
        span_id=trace.format_span_id(ctx.span_id),
        parent_span_id=(
            trace.format_span_id(parent.span_id) if parent is not None and parent.span_id else None
        ),
        name=span.name,
        kind=span.kind.name,
        start_ns=int(start),
        end_ns=None if span.end_time is None else int(span.end_time),
        status_code=status.status_code.name,
        status_message=status.description or None,
        http_status=_http_status(attrs),
        service_name=_str_or_none(resource.get("service.name")),
        host=_str_or_none(resource.get("host.name")),
        attributes=attrs,
        resource=resource,
    )


def _writer_errors(sink: Any) -> int | None:
    """A SpoolSink's writer counts its own failed writes instead of raising."""
    errors = getattr(getattr(sink, "writer", None), "errors", None)
    return errors if isinstance(errors, int) else None


class SpoolSpanExporter(SpanExporter):
    """An OTel SDK exporter that writes spans as ``spans`` rows to a probe sink.

    ``export`` never raises: a span that cannot be converted is dropped and
    counted (``dropped``); a sink failure (an exception, or a spool writer that
    counted a failed write) is counted (``errors``), logged rate-limited and
    answered with ``FAILURE``. ``shutdown``/``force_flush`` flush the sink.
    """

    def __init__(self, sink: Sink | None = None, *, log_interval_s: float = 10.0) -> None:
        self._sink = sink
        self.exported = 0
        self.dropped = 0
        self.errors = 0
        self._log = RateLimitedLog(log_interval_s, log)
        self._lock = threading.Lock()
        self._shutdown = False

    @property
    def sink(self) -> Sink:
        """The sink (the process-wide spool sink unless one was given), resolved on first use."""
        if self._sink is None:
            self._sink = default_sink()
        return self._sink

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        try:
            sink = self.sink
            before = _writer_errors(sink)
            rows: list[S.Span] = []
            for sp in spans:
                try:
                    rows.append(to_span(sp))
                except Exception as exc:  # one bad span must not lose the batch
                    with self._lock:
                        self.dropped += 1
                    self._log.warning("otel.span", f"span dropped: {type(exc).__name__}: {exc}")
            for row in rows:
                sink.emit(row)
            after = _writer_errors(sink)
            if before is not None and after is not None and after > before:
                raise OSError(f"spool writer failed {after - before} write(s)")
        except Exception as exc:  # an exporter must never raise
            with self._lock:
                self.errors += 1
            self._log.warning(
                "otel.export", f"{len(spans)} span(s) not exported: {type(exc).__name__}: {exc}"
            )
            return SpanExportResult.FAILURE
        with self._lock:
            self.exported += len(rows)
        return SpanExportResult.SUCCESS

    def _flush_sink(self) -> bool:
        flush = getattr(self._sink, "flush", None)
        if flush is None:
            return True
        try:
            flush()
        except Exception as exc:
            with self._lock:
                self.errors += 1
            self._log.warning("otel.flush", f"sink flush failed: {type(exc).__name__}: {exc}")
            return False
        return True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._flush_sink()

    def shutdown(self) -> None:
        self._flush_sink()
        self._shutdown = True


# ---------------------------------------------------------------------------
# trace ids onto records
# ---------------------------------------------------------------------------
class TraceIds(NamedTuple):
    trace_id: str  # 32 lowercase hex
    span_id: str  # 16 lowercase hex


def current_context() -> TraceIds | None:
    """The current span's ids as hex, or None when there is no valid span context."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return TraceIds(trace.format_trace_id(ctx.trace_id), trace.format_span_id(ctx.span_id))


def stamp(record: S.ErrorContext) -> S.ErrorContext:
    """Fill the record's missing ``trace_id``/``span_id`` from the current span.

    Ids already on the record are kept (a probe may know the request's trace
    better than the thread it runs on); ``span_id`` is filled only when the
    record's trace is the current one. Returns the record. Never raises.
    """
    try:
        ids = current_context()
        if ids is None:
            return record
        if record.trace_id is None:
            record.trace_id = ids.trace_id
            if record.span_id is None:
                record.span_id = ids.span_id
        elif record.span_id is None and record.trace_id == ids.trace_id:
            record.span_id = ids.span_id
    except Exception as exc:
        _stamp_log.warning("otel.stamp", f"{type(exc).__name__}: {exc}")
    return record


_stamp_log = RateLimitedLog(10.0, log)


def record_from_code(
    code_name: str, source: str, *, catalog: Any = None, **fields: Any
) -> S.ErrorContext:
    """An ErrorContext for catalog code ``code_name`` (family, layer, severity, stage,
    recoverability from the catalog), stamped with the current span's ids.

    ``fields`` are ErrorContext fields (``request_id``, ``gpu_uuid``, ``attrs``...);
    an explicit ``trace_id``/``span_id`` wins over the current span. ``catalog``
    defaults to :func:`graph.catalog.default_catalog`. An unknown code raises
    :class:`graph.errors.NotFoundError` (a probe bug, found on first use).
    """
    if catalog is None:
        from graph.catalog import default_catalog

        catalog = default_catalog()
    code = catalog.get(code_name)
    if code is None:
        from graph.errors import NotFoundError

        raise NotFoundError(f"unknown catalog code {code_name!r} (catalog {catalog.path})")
    return stamp(S.ErrorContext.from_catalog(code, source=source, **fields))


# ---------------------------------------------------------------------------
# ASGI middleware
# ---------------------------------------------------------------------------
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_KNOWN_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)


class _AsgiHeaderGetter(Getter[Iterable[tuple[bytes, bytes]]]):
    """Reads propagation headers straight from ASGI's ``[(name, value), ...]`` (bytes)."""

    def get(self, carrier: Iterable[tuple[bytes, bytes]], key: str) -> list[str] | None:
        want = key.lower().encode("latin-1")
        values = [v.decode("latin-1") for k, v in carrier if k.lower() == want]
        return values or None

    def keys(self, carrier: Iterable[tuple[bytes, bytes]]) -> list[str]:
        return [k.decode("latin-1") for k, _ in carrier]


_GETTER = _AsgiHeaderGetter()


def exception_type_name(exc: BaseException) -> str:
    """The exception's fully qualified type (``pkg.mod.Class``; builtins bare)."""
    cls = type(exc)
    mod = getattr(cls, "__module__", None)
    if not mod or mod in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{mod}.{cls.__qualname__}"


def route_of(scope: Mapping[str, Any]) -> str | None:
    """The low-cardinality route a framework left in the scope, if any.

    FastAPI (and Starlette routers that set it) put the matched route object in
    ``scope["route"]`` (its ``path`` is the template, e.g. ``/items/{item_id}``);
    a plain string there is taken as is.
    """
    route = scope.get("route")
    if route is None:
        return None
    if isinstance(route, str):
        return route or None
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else None


class RcaAsgiMiddleware:
    """One ``SERVER`` span per HTTP request, around any ASGI app.

    * name ``{method} {route}`` when the app's router leaves a route template in
      the scope (or ``route_resolver(scope)`` returns one), else ``{method}`` (the
      raw path never goes in the name: it is unbounded); unknown methods are
      ``_OTHER`` and name the span ``HTTP``;
    * attributes ``http.request.method``, ``url.path``, ``url.scheme``,
      ``http.response.status_code`` (from ``http.response.start``, so streaming
      responses work), ``http.route``, ``network.protocol.version``,
      ``server.address``/``server.port``; never the query string or headers;
    * 5xx: status ERROR and ``error.type`` = the status code as a string; an
      exception from the app: status ERROR, ``error.type`` = its fully qualified
      type, the exception recorded on the span, then re-raised (status 500 is
      recorded when no response had started: the server sends one);
    * an incoming W3C ``traceparent`` (any propagator configured in
      ``opentelemetry.propagate``) is continued, and the span is current while
      the app runs, so :func:`stamp` inside handlers gets its ids.

    Non-HTTP scopes (lifespan, websocket) pass through untouched. Any OTel
    failure is counted in ``errors``, logged rate-limited, and the request goes on.
    """

    def __init__(
        self,
        app: ASGIApp,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        route_resolver: Callable[[Scope], str | None] | None = None,
    ) -> None:
        self.app = app
        self.route_resolver = route_resolver
        self.errors = 0
        self._log = RateLimitedLog(10.0, log)
        try:
            self._tracer: trace.Tracer | None = trace.get_tracer(
                __name__, tracer_provider=tracer_provider
            )
        except Exception as exc:
            self._tracer = None
            self._failed("init", exc)

    def _failed(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._log.warning(f"otel.asgi.{where}", f"{type(exc).__name__}: {exc}")

    def _start(self, scope: Scope) -> tuple[trace.Span, object]:
        assert self._tracer is not None
        raw_method = str(scope.get("method") or "GET")
        method = raw_method.upper()
        attrs: dict[str, Any] = {
            "url.path": scope.get("path") or "/",
            "url.scheme": scope.get("scheme") or "http",
        }
        if method in _KNOWN_METHODS:
            attrs["http.request.method"] = method
            if raw_method != method:
                attrs["http.request.method_original"] = raw_method
        else:
            attrs["http.request.method"] = "_OTHER"
            attrs["http.request.method_original"] = raw_method
            method = "HTTP"
        version = scope.get("http_version")
        if version:
            attrs["network.protocol.version"] = str(version)
        server = scope.get("server")
        if server and server[0]:
            attrs["server.address"] = str(server[0])
            if server[1] is not None:
                attrs["server.port"] = int(server[1])
        parent = propagate.extract(scope.get("headers") or (), getter=_GETTER)
        span = self._tracer.start_span(
            method, context=parent, kind=SpanKind.SERVER, attributes=attrs
        )
        try:
            token = otel_context.attach(trace.set_span_in_context(span, parent))
        except BaseException:
            span.end()
            raise
        return span, token

    def _finish(
        self,
        span: trace.Span,
        scope: Scope,
        status: int | None,
        exc: BaseException | None,
    ) -> None:
        try:
            if not span.is_recording():
                span.end()
                return
            try:
                route = self.route_resolver(scope) if self.route_resolver else route_of(scope)
            except Exception as err:
                route = None
                self._failed("route", err)
            if route:
                span.set_attribute("http.route", route)
                method = str(scope.get("method") or "GET").upper()
                span.update_name(f"{method if method in _KNOWN_METHODS else 'HTTP'} {route}")
            if exc is not None:
                if status is None and isinstance(exc, Exception):
                    status = 500  # what the server answers for an app that raised
                    span.set_attribute("http.response.status_code", status)
                error_type = exception_type_name(exc)
                span.record_exception(exc, escaped=True)
                span.set_attribute("error.type", error_type)
                span.set_status(Status(StatusCode.ERROR, f"{error_type}: {exc}"[:512]))
            elif status is not None and status >= 500:
                span.set_attribute("error.type", str(status))
                span.set_status(Status(StatusCode.ERROR))
            span.end()
        except Exception as err:
            self._failed("end", err)
            with contextlib.suppress(Exception):
                span.end()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or self._tracer is None:
            await self.app(scope, receive, send)
            return
        try:
            span, token = self._start(scope)
        except Exception as exc:
            self._failed("start", exc)
            await self.app(scope, receive, send)
            return

        status: int | None = None

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message.get("type") == "http.response.start":
                try:
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                except Exception as exc:
                    self._failed("status", exc)
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException as exc:
            self._finish(span, scope, status, exc)
            raise
        else:
            self._finish(span, scope, status, None)
        finally:
            try:
                otel_context.detach(token)  # type: ignore[arg-type]
            except Exception as exc:
                self._failed("detach", exc)


# ---------------------------------------------------------------------------
# one-call setup
# ---------------------------------------------------------------------------
_INSTALLED: weakref.WeakSet[TracerProvider] = weakref.WeakSet()
_install_lock = threading.Lock()


def install(
    service_name: str,
    sink: Sink | None = None,
    *,
    set_global: bool = True,
    resource_attributes: Mapping[str, Any] | None = None,
) -> TracerProvider:
    """Send this process's spans to the spool: a ``BatchSpanProcessor`` around a
    :class:`SpoolSpanExporter` on a ``TracerProvider``; returns the provider.

    The resource carries ``service.name`` (= ``service_name``), ``host.name`` (the
    same node name records carry, so host evidence joins) and ``process.pid``,
    plus ``resource_attributes`` and ``OTEL_RESOURCE_ATTRIBUTES``.

    With ``set_global`` (the default) the provider becomes the global one. If an
    SDK provider is already global (the serving framework set up tracing), the
    processor is added to it instead, so its spans reach the spool too, and its
    resource stands. Calling again returns the same provider without adding a
    second exporter. ``set_global=False`` builds a private provider.
    """
    attrs: dict[str, Any] = {"host.name": _HOST, "process.pid": os.getpid()}
    attrs.update(resource_attributes or {})
    attrs["service.name"] = service_name
    with _install_lock:
        if set_global:
            current = trace.get_tracer_provider()
            if isinstance(current, TracerProvider):
                if current not in _INSTALLED:
                    current.add_span_processor(BatchSpanProcessor(SpoolSpanExporter(sink)))
                    _INSTALLED.add(current)
                return current
        provider = TracerProvider(resource=Resource.create(attrs))
        provider.add_span_processor(BatchSpanProcessor(SpoolSpanExporter(sink)))
        if set_global:
            trace.set_tracer_provider(provider)
            if trace.get_tracer_provider() is not provider:
                log.warning(
                    "a non-SDK global TracerProvider is already set; spans from global "
                    "tracers will not reach the spool (use the returned provider)"
                )
            _INSTALLED.add(provider)
        return provider
