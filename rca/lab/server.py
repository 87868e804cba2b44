"""The lab's HTTP API: a plain ASGI app (no framework) in front of a
:class:`rca.lab.engine.LabEngine`, wrapped in :class:`probes.otel.RcaAsgiMiddleware`.

Routes (vLLM's OpenAI server): ``POST /v1/completions``, ``GET /health``,
``GET|POST /health/checker_status``, ``POST /v1/load_lora_adapter``,
``GET /metrics``. Each response also writes uvicorn's access line to the
engine log (vLLM's API server shares its stdout with the engine). The server
span carries ``gen_ai.response.id`` = the request id, and the span's trace id
goes into the :class:`LabRequest` so the probes attribute batch rows to it.

:func:`serve` runs the app with uvicorn; :class:`LabClient` calls it in-process
(asyncio, no sockets) for tests and the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

from rca.lab.engine import LabEngine, LabRequest, LabResult

__all__ = ["LabApp", "build_app", "serve", "LabClient", "MAX_BODY_BYTES"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MAX_BODY_BYTES = 1 << 20
_ROUTES = {
    "/v1/completions": ("POST",),
    "/health": ("GET", "HEAD"),
    "/health/checker_status": ("GET", "POST", "PUT"),
    "/v1/load_lora_adapter": ("POST",),
    "/metrics": ("GET",),
}


class _BodyTooLarge(Exception):
    pass


def _err(status: int, message: str, etype: str | None = None) -> tuple[int, dict[str, Any]]:
    types = {
        400: "BadRequestError",
        404: "NotFoundError",
        405: "MethodNotAllowed",
        413: "RequestEntityTooLarge",
        429: "TooManyRequestsError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
        504: "TimeoutError",
    }
    return status, {
        "error": {"message": message, "type": etype or types.get(status, "Error"), "code": status}
    }


class LabApp:
    """The bare ASGI app (see :func:`build_app` for the instrumented one)."""

    def __init__(self, engine: LabEngine, *, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    self.engine.stop()  # flush the spool before uvicorn exits
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope.get("type") != "http":
            return
        path = scope.get("path") or "/"
        method = str(scope.get("method") or "GET").upper()
        if path in _ROUTES:
            scope["route"] = path
        try:
            status, body, ctype = await self._dispatch(path, method, scope, receive)
        except _BodyTooLarge:
            status, payload = _err(413, f"Request body exceeds {self.max_body_bytes} bytes")
            body, ctype = json.dumps(payload).encode(), "application/json"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", ctype.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        client = scope.get("client") or ("127.0.0.1", 0)
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        self.engine.log_raw(
            f'INFO:     {client[0]}:{client[1]} - "{method} {path} HTTP/'
            f'{scope.get("http_version", "1.1")}" {status} {phrase}'
        )

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        for k, v in scope.get("headers") or ():
            if k.lower() == b"content-length":
                try:
                    if int(v) > self.max_body_bytes:
                        raise _BodyTooLarge
                except ValueError:
                    pass
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg.get("type") == "http.disconnect":
                break
            part = msg.get("body", b"")
            size += len(part)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(part)
            if not msg.get("more_body"):
                break
        return b"".join(chunks)

    async def _dispatch(
        self, path: str, method: str, scope: Scope, receive: Receive
    ) -> tuple[int, bytes, str]:
        eng = self.engine
        allowed = _ROUTES.get(path)
        if allowed is None:
            return 404, json.dumps({"detail": "Not Found"}).encode(), "application/json"
        if method not in allowed:
            return 405, json.dumps({"detail": "Method Not Allowed"}).encode(), "application/json"
        if path == "/health":
            ok = eng.loaded and not eng.dead
            return (200 if ok else 503), b"", "application/json"
        if path == "/metrics":
            return 200, eng.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8"
        body = await self._body(scope, receive) if method in ("POST", "PUT") else b""
        if path == "/health/checker_status":
            from probes.ops import handle_checker_status

            if eng.checker is None:
                status, payload = _err(503, "The engine is not loaded")
            else:
                status, payload = handle_checker_status(eng.checker, method, body or None)
            return status, json.dumps(payload).encode(), "application/json"
        if path == "/v1/load_lora_adapter":
            status, payload = self._load_lora(body)
            if status == 200:
                return 200, payload["message"].encode(), "text/plain; charset=utf-8"
            return status, json.dumps(payload).encode(), "application/json"
        status, payload = await self._complete(body)
        return status, json.dumps(payload).encode(), "application/json"

    def _load_lora(self, body: bytes) -> tuple[int, dict[str, Any]]:
        from rca.lab.lora import LoraLoadError

        try:
            data = json.loads(body or b"{}")
        except ValueError as exc:
            return _err(400, f"Invalid JSON: {exc}")
        if not isinstance(data, dict):
            return _err(400, "body must be a JSON object")
        name, path = data.get("lora_name"), data.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            return _err(400, "Both 'lora_name' and 'lora_path' must be provided.")
        try:
            self.engine.load_lora(name, path)
        except LoraLoadError as exc:
            return _err(400, str(exc))
        except Exception as exc:  # an OS or I/O failure while loading
            return _err(500, f"{type(exc).__name__}: {exc}")
        return 200, {"message": f"Success: LoRA adapter '{name}' added successfully."}

    async def _complete(self, body: bytes) -> tuple[int, dict[str, Any]]:
        from opentelemetry import trace

        eng = self.engine
        span = trace.get_current_span()
        ctx = span.get_span_context()
        trace_id = f"{ctx.trace_id:032x}" if ctx.is_valid else None
        rid = eng.new_request_id()
        span.set_attribute("gen_ai.response.id", rid)
        span.set_attribute("gen_ai.system", "vllm")
        try:
            data = json.loads(body or b"")
        except ValueError as exc:
            return _err(400, f"Invalid JSON body: {exc}")
        if not isinstance(data, dict):
            return _err(400, "The request body must be a JSON object")
        try:
            req = self._request(data, rid, trace_id)
        except (TypeError, ValueError) as exc:
            return _err(400, str(exc))
        span.set_attribute(
            "gen_ai.request.model", str(data.get("model") or eng.config.served_model_name)
        )
        span.set_attribute("gen_ai.request.max_tokens", req.max_tokens)
        fut = eng.submit(req)
        res: LabResult = await asyncio.wrap_future(fut)
        if res.status != 200:
            return _err(res.status, res.message or "", res.error_type)
        span.set_attribute("gen_ai.usage.input_tokens", res.usage.get("prompt_tokens", 0))
        span.set_attribute("gen_ai.usage.output_tokens", res.usage.get("completion_tokens", 0))
        span.set_attribute("gen_ai.response.finish_reasons", [res.finish_reason or ""])
        return 200, {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.lora or eng.config.served_model_name,
            "choices": [
                {"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason}
            ],
            "usage": res.usage,
        }

    def _request(self, data: dict[str, Any], rid: str, trace_id: str | None) -> LabRequest:
        def num(key: str, default: float) -> float:
            v = data.get(key, default)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"'{key}' must be a number, got {json.dumps(v)[:40]}")
            return float(v)

        def integer(key: str, default: int | None) -> int | None:
            v = data.get(key, default)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"'{key}' must be an integer, got {json.dumps(v)[:40]}")
            return v

        prompt = data.get("prompt", "")
        ids: list[int] | None = None
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids, prompt = list(prompt), ""
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif not isinstance(prompt, str):
            raise TypeError("'prompt' must be a string or a list of token ids")
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise TypeError("'model' must be a string")
        lora = model if model and model != self.engine.config.served_model_name else None
        timeout = data.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float))
        ):
            raise TypeError("'timeout' must be a number")
        max_tokens = integer("max_tokens", 16)
        priority = integer("priority", 0)
        return LabRequest(
            prompt=prompt,
            max_tokens=16 if max_tokens is None else max_tokens,
            temperature=num("temperature", 0.0),
            top_p=num("top_p", 1.0),
            seed=integer("seed", None),
            lora=lora,
            timeout_s=float(timeout) if timeout is not None else None,
            request_id=rid,
            trace_id=trace_id,
            prompt_token_ids=ids,
            priority=priority or 0,
        )


def build_app(engine: LabEngine, *, max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """The ASGI app wrapped in the OTel middleware with the engine's provider."""
    from probes.otel import RcaAsgiMiddleware

    return RcaAsgiMiddleware(LabApp(engine, max_body_bytes=max_body_bytes), engine.tracer_provider)


def serve(engine: LabEngine, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the engine's loop and the app with uvicorn until interrupted."""
    import uvicorn

    engine.start()
    try:
        uvicorn.run(build_app(engine), host=host, port=port, log_level="warning", access_log=False)
    finally:
        engine.stop()


class LabClient:
    """Calls an ASGI app in-process: ``status, body = client.post(path, json)``.

    When the app serves a :class:`LabEngine` whose background loop is not
    running, the client steps the engine itself while a request is in flight
    (same event loop, so a run is repeatable); ``drive=False`` leaves the
    stepping to someone else.
    """

    def __init__(self, app: Any, *, drive: bool = True) -> None:
        self.app = app
        inner = app
        while not isinstance(inner, LabApp) and hasattr(inner, "app"):
            inner = inner.app
        self.engine: LabEngine | None = inner.engine if isinstance(inner, LabApp) else None
        self.drive = drive

    async def _call(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        eng = self.engine
        if not self.drive or eng is None:
            await self.app(scope, receive, send)
            return
        task = asyncio.ensure_future(self.app(scope, receive, send))
        for _ in range(4):  # let the app read the body and submit first
            await asyncio.sleep(0)
        while not task.done():
            if not eng.running and eng.scheduler.has_work():
                eng.step()
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.001)
        await task

    async def arequest(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> tuple[int, Any]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": headers or [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        sent = False
        out: dict[str, Any] = {"status": None, "body": b""}

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.sleep(3600)
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(msg: MutableMapping[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                out["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                out["body"] += msg.get("body", b"")

        await self._call(scope, receive, send)
        raw = out["body"]
        try:
            parsed: Any = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        return int(out["status"]), parsed

    def request(
        self, method: str, path: str, payload: Any = None, *, raw: bytes | None = None
    ) -> tuple[int, Any]:
        body = (
            raw
            if raw is not None
            else (json.dumps(payload).encode() if payload is not None else b"")
        )
        return asyncio.run(self.arequest(method, path, body))

    def post(self, path: str, payload: Any = None, *, raw: bytes | None = None) -> tuple[int, Any]:
        return self.request("POST", path, payload, raw=raw)

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def complete(self, **body: Any) -> tuple[int, Any]:
        return self.post("/v1/completions", body)

    async def acomplete(self, **body: Any) -> tuple[int, Any]:
        return await self.arequest("POST", "/v1/completions", json.dumps(body).encode())
