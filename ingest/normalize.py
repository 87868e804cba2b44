"""Text -> catalog code: the catalog's patterns compiled once and applied per line.

This is the reference (pure Python ``re``) classifier. It picks, for each line,
the code :func:`ingest.classify.pick_match` picks (a code's declared
``wins_over``, then specific over catch-all, cause over engine_crash wrapper,
longest span), and returns the named groups as extracted fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from graph.catalog import Catalog, Code, default_catalog

__all__ = ["Match", "LineClassifier", "default_classifier", "redact"]


@dataclass(frozen=True, slots=True)
class Match:
    code: Code
    fields: dict[str, Any] = field(default_factory=dict)
    span: tuple[int, int] = (0, 0)


class LineClassifier:
    """Applies every catalog pattern to a line; one compiled regex per pattern."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._rules: list[tuple[re.Pattern[str], Code]] = [
            (re.compile(p), code) for code in catalog for p in code.patterns
        ]

    def classify(self, line: str) -> Match | None:
        from ingest.classify import pick_match

        matched = [(m, code) for rx, code in self._rules if (m := rx.search(line)) is not None]
        if not matched:
            return None
        m, code = pick_match(matched)
        fields = {k: _coerce(v) for k, v in m.groupdict().items() if v is not None}
        return Match(code, fields, (m.start(), m.end()))


def _coerce(v: str) -> Any:
    if v.isdigit() and len(v) < 19:
        return int(v)
    return v


@cache
def default_classifier() -> LineClassifier:
    return LineClassifier(default_catalog())


# Prompts and completions are user data: engine log lines that echo them are
# cut down to their length before anything is stored.
_REDACTIONS = (
    re.compile(r"(?P<key>prompt|completion|text|output)(?P<sep>: ?|=)'(?P<val>(?:[^'\\]|\\.)*)'"),
    re.compile(r'(?P<key>prompt|completion|text|output)(?P<sep>: ?|=)"(?P<val>(?:[^"\\]|\\.)*)"'),
    re.compile(r"(?P<key>prompt_token_ids|output_token_ids)(?P<sep>: ?|=)\[(?P<val>[^\]]*)\]"),
)


def redact(line: str) -> str:
    """Replace quoted prompt/completion text and token-id lists with their length."""
    for rx in _REDACTIONS:
        line = rx.sub(lambda m: f"{m['key']}{m['sep']}<redacted {len(m['val'])} chars>", line)
    return line
