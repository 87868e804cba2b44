"""Where probes put what they capture: a sink with one method, ``emit``.

Probes never open DuckDB and never raise into the serving process: a sink
that fails counts the failure and logs it once in a while (rate-limited).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Protocol

from ingest import schema as S

__all__ = ["Sink", "SpoolSink", "MemorySink", "RateLimitedLog", "default_sink"]

log = logging.getLogger("rca.probes")


class Sink(Protocol):
    def emit(self, record: S.ErrorContext | S.Span) -> None: ...


class SpoolSink:
    """Append records to the spool (the default: one loader moves them to DuckDB)."""

    def __init__(self, spool_dir: str | Path | None = None, **writer_kw: Any) -> None:
        from ingest.paths import spool_dir_for
        from ingest.spool import SpoolWriter

        self.writer = SpoolWriter(spool_dir or spool_dir_for(), **writer_kw)

    def emit(self, record: S.ErrorContext | S.Span) -> None:
        self.writer.emit(record)  # never raises unless strict

    def emit_metric(self, row: dict[str, Any]) -> None:
        self.writer.emit_metric(row)

    def flush(self) -> None:
        self.writer.flush()


class MemorySink:
    """Keeps what it is given: for tests and notebooks."""

    def __init__(self) -> None:
        self.records: list[S.ErrorContext | S.Span] = []
        self.metrics: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def emit(self, record: S.ErrorContext | S.Span) -> None:
        with self._lock:
            self.records.append(record)

    def emit_metric(self, row: dict[str, Any]) -> None:
        with self._lock:
            self.metrics.append(row)

    def codes(self) -> list[str]:
        return [r.code for r in self.records if isinstance(r, S.ErrorContext)]

    def flush(self) -> None:
        pass


class RateLimitedLog:
    """At most one log line per code every ``interval_s``; the rest are counted and
    the count is reported with the next line that gets through."""

    def __init__(self, interval_s: float = 10.0, logger: logging.Logger = log) -> None:
        self.interval_s = interval_s
        self.logger = logger
        self._last: dict[str, float] = {}
        self.suppressed: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def warning(self, code: str, message: str) -> bool:
        """Log (returns True) or count as suppressed (returns False)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(code)
            if last is not None and now - last < self.interval_s:
                self.suppressed[code] += 1
                return False
            self._last[code] = now
            extra = self.suppressed.pop(code, 0)
        suffix = f" ({extra} similar suppressed)" if extra else ""
        self.logger.warning("%s: %s%s", code, message, suffix)
        return True


_default: SpoolSink | None = None


def default_sink() -> SpoolSink:
    """The process-wide spool sink (spool beside the default store, or $RCA_SPOOL)."""
    global _default
    if _default is None:
        _default = SpoolSink()
    return _default
