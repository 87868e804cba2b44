"""Semantic rules on a finished request's output (the fourth layer of the
operator checks): a JSON schema on the text or on a tool call's arguments, a
finish reason in an allowed set, an empty completion. A rule sees a
:class:`RequestOutput` and returns :class:`Violation` s; :meth:`probes.ops.Checker.end_request`
runs the rules and turns each violation into a record. Plain Python (no torch):
a server can run them without the operator checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "RequestOutput",
    "Violation",
    "Rule",
    "DEFAULT_FINISH_REASONS",
    "FinishReasonRule",
    "JsonSchemaRule",
    "ToolCallSchemaRule",
    "EmptyCompletionRule",
    "validate_json_schema",
]


@dataclass(slots=True)
class RequestOutput:
    """What a finished request produced, as a rule sees it.

    ``response_format`` follows the OpenAI shape (``{"type": "json_schema",
    "json_schema": {"schema": {...}}}`` or ``{"type": "json_object"}``);
    ``tools`` are the request's tool definitions (``{"type": "function",
    "function": {"name", "parameters"}}``); ``tool_calls`` what the model
    produced (``{"function": {"name", "arguments": "<json>"}}``).
    """

    trace_id: str | None = None
    request_id: str | None = None
    text: str | None = None
    finish_reason: str | None = None
    tool_calls: Sequence[Mapping[str, Any]] | None = None
    response_format: Mapping[str, Any] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Violation:
    code: str
    message: str
    attrs: dict[str, Any] = field(default_factory=dict)


class Rule(Protocol):
    name: str

    def __call__(self, out: RequestOutput) -> Violation | Iterable[Violation] | None: ...


#: OpenAI-compatible finish reasons (``function_call`` is the legacy one).
DEFAULT_FINISH_REASONS = frozenset(
    {"stop", "length", "tool_calls", "content_filter", "function_call"}
)


class FinishReasonRule:
    """finish_reason outside the allowed set -> INVALID_FINISH_REASON."""

    name = "finish_reason"

    def __init__(self, allowed: Iterable[str] = DEFAULT_FINISH_REASONS) -> None:
        self.allowed = frozenset(allowed)

    def __call__(self, out: RequestOutput) -> Violation | None:
        fr = out.finish_reason
        if fr is None or fr in self.allowed:
            return None
        shown = fr if re.fullmatch(r"[A-Za-z_]{1,32}", fr) else "<non-standard>"
        return Violation(
            "INVALID_FINISH_REASON",
            f"finish_reason {shown!r} not in {sorted(self.allowed)}",
            {"finish_reason": shown},
        )


class JsonSchemaRule:
    """The output text must be JSON (and match the schema) when the request asked
    for JSON (``response_format``) or when a schema is given here ->
    OUTPUT_SCHEMA_VIOLATION."""

    name = "json_schema"

    def __init__(self, schema: Mapping[str, Any] | None = None, *, max_errors: int = 5) -> None:
        self.schema = schema
        self.max_errors = max_errors

    def __call__(self, out: RequestOutput) -> Violation | None:
        schema, wants_json = self.schema, self.schema is not None
        rf = out.response_format or {}
        if rf.get("type") == "json_schema":
            js = rf.get("json_schema") or {}
            schema, wants_json = js.get("schema", schema), True
        elif rf.get("type") == "json_object":
            wants_json = True
        if not wants_json or out.text is None:
            return None
        return _validate_text(out.text, schema, "$", self.max_errors, {"target": "content"})


class ToolCallSchemaRule:
    """Every tool call must name a declared tool and carry JSON arguments that
    match its ``parameters`` schema -> OUTPUT_SCHEMA_VIOLATION."""

    name = "tool_call_schema"

    def __init__(self, *, max_errors: int = 5) -> None:
        self.max_errors = max_errors

    def __call__(self, out: RequestOutput) -> list[Violation]:
        if not out.tool_calls:
            return []
        declared: dict[str, Any] = {}
        for t in out.tools or ():
            fn = t.get("function", t)
            if isinstance(fn, Mapping) and "name" in fn:
                declared[str(fn["name"])] = fn.get("parameters")
        found = []
        for i, call in enumerate(out.tool_calls):
            fn = call.get("function", call)
            name = fn.get("name") if isinstance(fn, Mapping) else None
            where = {"target": "tool_call", "index": i}
            if declared and name not in declared:
                found.append(
                    Violation(
                        "OUTPUT_SCHEMA_VIOLATION",
                        f"tool call {i}: undeclared tool",
                        {**where, "declared": sorted(declared)[:16]},
                    )
                )
                continue
            where["tool"] = name
            args = fn.get("arguments") if isinstance(fn, Mapping) else None
            v = _validate_text(
                args if isinstance(args, str) else json.dumps(args),
                declared.get(name) if name else None,
                "$",
                self.max_errors,
                where,
            )
            if v is not None:
                found.append(v)
        return found


class EmptyCompletionRule:
    """Finished with empty or whitespace-only content and no tool call ->
    EMPTY_COMPLETION."""

    name = "empty_completion"

    def __call__(self, out: RequestOutput) -> Violation | None:
        if out.text is None or out.tool_calls or out.text.strip():
            return None
        return Violation(
            "EMPTY_COMPLETION",
            f"empty completion (finish_reason {out.finish_reason!r})",
            {"finish_reason": out.finish_reason},
        )


def _validate_text(
    text: str, schema: Any, path: str, max_errors: int, where: dict[str, Any]
) -> Violation | None:
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        pos = getattr(exc, "pos", None)
        return Violation(
            "OUTPUT_SCHEMA_VIOLATION",
            f"{where['target']}: not valid JSON ({getattr(exc, 'msg', 'not a string')}"
            f"{f' at char {pos}' if pos is not None else ''})",
            {**where, "error": "parse", "chars": len(text or "")},
        )
    if not isinstance(schema, Mapping):
        return None
    errors = validate_json_schema(doc, schema, path=path, limit=max_errors)
    if not errors:
        return None
    return Violation(
        "OUTPUT_SCHEMA_VIOLATION",
        f"{where['target']}: {errors[0]}"
        + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""),
        {**where, "error": "schema", "violations": errors},
    )


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (
        isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _type_name(v: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _JSON_TYPES[name](v):
            return name
    return type(v).__name__


def validate_json_schema(
    doc: Any, schema: Mapping[str, Any], *, path: str = "$", limit: int = 5
) -> list[str]:
    """Violations of a JSON Schema subset, as ``path: reason`` (never the values).

    Covers type, enum, const, properties, required, additionalProperties, items,
    min/maxItems, min/maxLength, pattern, minimum/maximum (and exclusive), anyOf,
    oneOf, allOf and local ``$ref`` (``#/$defs/...``, ``#/definitions/...``);
    other keywords are ignored.
    """
    errors: list[str] = []
    _validate(doc, schema, path, errors, limit, schema, 0)
    return errors[:limit]


def _validate(
    v: Any, s: Any, path: str, errors: list[str], limit: int, root: Any, depth: int
) -> None:
    if len(errors) >= limit or not isinstance(s, Mapping) or depth > 64:
        return
    ref = s.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        if isinstance(target, Mapping):
            _validate(v, target, path, errors, limit, root, depth + 1)
        return
    t = s.get("type")
    if t is not None:
        types = [t] if isinstance(t, str) else list(t)
        if not any(_JSON_TYPES.get(x, lambda _: True)(v) for x in types):
            errors.append(f"{path}: expected {'|'.join(types)}, got {_type_name(v)}")
            return
    if "enum" in s and v not in s["enum"]:
        errors.append(f"{path}: not one of the {len(s['enum'])} allowed values")
    if "const" in s and v != s["const"]:
        errors.append(f"{path}: not the required constant")
    if isinstance(v, dict):
        props = s.get("properties") or {}
        for req in s.get("required") or ():
            if req not in v:
                errors.append(f"{path}: missing required property {req!r}")
        extra = s.get("additionalProperties", True)
        for k, val in v.items():
            sub = f"{path}.{k}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)) else f"{path}[?]"
            if k in props:
                _validate(val, props[k], sub, errors, limit, root, depth + 1)
            elif extra is False:
                errors.append(f"{path}: unexpected property {sub.rsplit('.', 1)[-1]!r}")
            elif isinstance(extra, Mapping):
                _validate(val, extra, sub, errors, limit, root, depth + 1)
    if isinstance(v, list):
        items = s.get("items")
        if isinstance(items, Mapping):
            for i, val in enumerate(v):
                _validate(val, items, f"{path}[{i}]", errors, limit, root, depth + 1)
        if "minItems" in s and len(v) < s["minItems"]:
            errors.append(f"{path}: {len(v)} items < minItems {s['minItems']}")
        if "maxItems" in s and len(v) > s["maxItems"]:
            errors.append(f"{path}: {len(v)} items > maxItems {s['maxItems']}")
    if isinstance(v, str):
        if "minLength" in s and len(v) < s["minLength"]:
            errors.append(f"{path}: length {len(v)} < minLength {s['minLength']}")
        if "maxLength" in s and len(v) > s["maxLength"]:
            errors.append(f"{path}: length {len(v)} > maxLength {s['maxLength']}")
        pat = s.get("pattern")
        if isinstance(pat, str):
            try:
                if re.search(pat, v) is None:
                    errors.append(f"{path}: does not match the pattern")
            except re.error:
                pass
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        for key, bad in (
            ("minimum", lambda a, b: a < b),
            ("maximum", lambda a, b: a > b),
            ("exclusiveMinimum", lambda a, b: a <= b),
            ("exclusiveMaximum", lambda a, b: a >= b),
        ):
            bound = s.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bad(v, bound):
                errors.append(f"{path}: violates {key} {bound}")
    for key in ("allOf", "anyOf", "oneOf"):
        subs = s.get(key)
        if not isinstance(subs, list):
            continue
        results = []
        for sub in subs:
            errs: list[str] = []
            _validate(v, sub, path, errs, limit, root, depth + 1)
            results.append(errs)
        ok = sum(1 for e in results if not e)
        if key == "allOf":
            for e in results:
                errors.extend(e)
        elif key == "anyOf" and ok == 0:
            errors.append(f"{path}: matches none of anyOf ({len(subs)})")
        elif key == "oneOf" and ok != 1:
            errors.append(f"{path}: matches {ok} of oneOf ({len(subs)}), expected exactly 1")
