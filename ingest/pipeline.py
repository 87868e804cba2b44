"""`rca ingest`: detect each file's format, stream it, normalize, load, idempotently."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from graph.errors import InputError
from ingest import schema as S
from ingest.classify import Normalizer, default_normalizer
from ingest.logs import (
    UNCLASSIFIED_KEEP,
    LogParseResult,
    file_year,
    iter_bounded_lines,
    iter_log_batches,
)
from ingest.otlp import parse_otlp_json_lines
from ingest.store import Store

__all__ = ["FORMATS", "FileReport", "IngestReport", "detect_format", "file_key", "ingest_paths"]

FORMATS = ("auto", "log", "otlp-json", "prometheus")
_PEEK = 64 * 1024


def _open(path: Path) -> BinaryIO:
    fh = open(path, "rb")  # noqa: SIM115
    if fh.read(2) == b"\x1f\x8b":
        fh.seek(0)
        return gzip.open(fh)  # type: ignore[return-value]
    fh.seek(0)
    return fh


def detect_format(path: Path) -> str:
    """Guess a file's format from its first 64 KiB."""
    with _open(path) as fh:
        head = fh.read(_PEEK)
    text = head.decode("utf-8", "replace").lstrip()
    if text.startswith("{") and (
        '"resourceSpans"' in text[:4096] or '"resourceLogs"' in text[:4096]
    ):
        return "otlp-json"
    lines = [ln for ln in text.splitlines()[:50] if ln.strip()]
    if (
        lines
        and sum(1 for ln in lines if ln.startswith(("# HELP ", "# TYPE "))) >= 1
        and all(ln.startswith("#") or _looks_like_sample(ln) for ln in lines[:20])
    ):
        return "prometheus"
    return "log"


def _looks_like_sample(line: str) -> bool:
    name = line.split("{", 1)[0].split(" ", 1)[0]
    return bool(name) and all(c.isalnum() or c in "_:" for c in name)


def file_key(path: Path) -> str:
    """Content hash: the same bytes ingested twice (under any name) add nothing."""
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return "file:" + h.hexdigest()


@dataclass
class FileReport:
    path: str
    format: str
    read: int = 0  # lines (or payloads) read
    normalized: int = 0  # evidence rows (records + spans + metric samples) stored
    records: int = 0
    spans: int = 0
    metrics: int = 0
    quarantined: int = 0
    no_timestamp: int = 0
    unclassified: int = 0  # lines that read like faults but no code names (not stored)
    skipped: bool = False  # already ingested
    key: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class IngestReport:
    files: list[FileReport] = field(default_factory=list)
    records: list[S.ErrorContext] = field(default_factory=list)  # kept when keep_records
    tracebacks: list[dict[str, Any]] = field(default_factory=list)
    #: with keep_records: the first lines per file that read like faults but
    #: that no code names (file, line, redacted text, the model's family hint)
    unclassified: list[dict[str, Any]] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        keys = ("read", "normalized", "records", "spans", "metrics", "quarantined", "unclassified")
        return {k: sum(getattr(f, k) for f in self.files) for k in keys}


def ingest_paths(
    store: Store,
    paths: list[str | Path],
    *,
    fmt: str = "auto",
    host: str | None = None,
    normalizer: Normalizer | None = None,
    progress: Callable[[int, int], None] | None = None,
    keep_records: bool = False,
    reparse_skipped: bool = False,
    batch_size: int = 50_000,
) -> IngestReport:
    """Ingest files (logs, OTLP/JSON traces, Prometheus text) into the store.

    Each file is streamed in batches (memory bounded by the batch), each batch
    committed in its own short transaction, and the file's content hash is
    recorded last: ingesting the same content again adds nothing.
    """
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    files = [Path(p).expanduser() for p in paths]
    for p in files:
        if not p.is_file():
            raise InputError(f"{p}: no such file")
    report = IngestReport()
    total = sum(p.stat().st_size for p in files)
    done_bytes = 0
    norm = normalizer or default_normalizer()
    tracker = None  # one across the files: consecutive scrapes give increase events
    for path in files:
        kind = detect_format(path) if fmt == "auto" else fmt
        fr = FileReport(str(path), kind, key=file_key(path))
        report.files.append(fr)
        with store.writer_lock(), store.write() as con:
            complete, resume_after = Store.source_progress(con, fr.key)
        fr.skipped = complete
        target = None if complete else store
        if kind == "log" and (target is not None or (reparse_skipped and keep_records)):
            # a skipped file is parsed again only when the caller needs its records
            with _open(path) as fh:
                counted = _CountingReader(fh)
                base = done_bytes
                _ingest_log(
                    target,
                    counted,
                    path,
                    fr,
                    report,
                    norm,
                    host=host,
                    keep=keep_records,
                    batch_size=batch_size,
                    resume_after=resume_after,
                    progress=lambda b, base=base: progress and progress(base + b, total),
                )
        elif target is not None:
            with _open(path) as fh:
                if kind == "otlp-json":
                    _ingest_otlp(store, _CountingReader(fh), path, fr)
                elif kind == "prometheus":
                    if tracker is None:
                        from ingest.prometheus import ThresholdTracker

                        tracker = ThresholdTracker()
                    _ingest_prometheus(store, _CountingReader(fh), path, fr, host, tracker)
        done_bytes += path.stat().st_size
        if target is not None:
            with store.writer_lock(), store.write() as con:
                Store.mark_source_loaded(
                    con, fr.key, str(path), fr.normalized, lines_done=fr.read, complete=True
                )
        if progress:
            progress(done_bytes, total)
    return report


class _CountingReader(io.RawIOBase):
    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.count += len(data)
        return data

    def readable(self) -> bool:
        return True


def _write_batch(
    store: Store,
    records: list[S.ErrorContext] = (),  # type: ignore[assignment]
    *,
    progress: tuple[str, str, int, int] | None = None,
    **tables: list[Any],
) -> None:
    """One short transaction: rows, plus the file's progress in the ledger."""
    with store.writer_lock(), store.write() as con:
        con.execute("BEGIN TRANSACTION")
        try:
            if records:
                Store.insert_arrow(con, S.ERROR_CONTEXT, S.records_to_arrow(records))
            for name, rows in tables.items():
                table = {"spans": S.SPANS, "metrics": S.METRICS, "quarantine": S.QUARANTINE}[name]
                if rows:
                    Store.insert_arrow(con, table, S.records_to_arrow(rows, table))
            if progress is not None:
                key, path, rows, lines_done = progress
                Store.mark_source_loaded(
                    con, key, path, rows, lines_done=lines_done, complete=False
                )
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise


def _line_of(origin: str) -> int:
    return int(origin.split()[-1]) if origin.startswith("line ") else 0


def _ingest_log(
    store: Store | None,
    fh: _CountingReader,
    path: Path,
    fr: FileReport,
    report: IngestReport,
    norm: Normalizer,
    *,
    host: str | None,
    keep: bool,
    batch_size: int,
    resume_after: int = 0,
    progress: Callable[[int], Any] = lambda b: None,
) -> None:
    """Stream one log file; with a store, commit batch by batch (resumable)."""
    batches: Iterator[LogParseResult] = iter_log_batches(
        iter_bounded_lines(fh),
        source=str(path),
        host=host,
        year=file_year(path),
        base_ns=os.stat(path).st_mtime_ns,
        normalizer=norm,
        batch_size=batch_size,
    )
    shown_lines = 0  # of this file's unclassified lines, kept in the report
    for res in batches:
        for rec in res.records:  # deterministic ids from the content, not the path
            rec.event_id = _content_event_id(fr.key, rec.attrs["line"] if rec.attrs else 0)
        fr.read += res.lines
        fr.records += len(res.records)
        fr.normalized += len(res.records)
        fr.quarantined += len(res.quarantine)
        fr.no_timestamp += res.no_timestamp
        fr.unclassified += res.unclassified
        if keep:
            report.records += res.records
            report.tracebacks += [{**t, "file": str(path)} for t in res.tracebacks]
            shown = res.unclassified_lines[: UNCLASSIFIED_KEEP - shown_lines]
            report.unclassified += shown
            shown_lines += len(shown)
        if store is not None:
            # an interrupted earlier run committed lines <= resume_after already
            new = [r for r in res.records if (r.attrs or {}).get("line", 0) > resume_after]
            quarantine = [q for q in res.quarantine if _line_of(q["origin"]) > resume_after]
            _write_batch(
                store,
                new,
                quarantine=quarantine,
                progress=(fr.key, str(path), fr.normalized, res.last_line),
            )
        progress(fh.count)


def _content_event_id(key: str, line: int) -> str:
    h = hashlib.blake2b(f"{key}\0{line}".encode(), digest_size=16).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _ingest_otlp(store: Store, fh: _CountingReader, path: Path, fr: FileReport) -> None:
    batch: list[bytes] = []

    def flush() -> None:
        res = parse_otlp_json_lines(batch, source=str(path))
        _write_batch(store, spans=res.spans, quarantine=res.quarantine)
        fr.spans += len(res.spans)
        fr.normalized += len(res.spans)
        fr.quarantined += len(res.quarantine)
        batch.clear()

    for line, too_long in iter_bounded_lines(fh, max_len=64 << 20):
        fr.read += 1
        if too_long:
            _write_batch(
                store,
                quarantine=[
                    S.quarantine_row(
                        str(path), f"line {fr.read}", "OTLP/JSON line longer than 64 MiB", line
                    )
                ],
            )
            fr.quarantined += 1
            continue
        batch.append(line)
        if len(batch) >= 1000:
            flush()
    flush()


def _ingest_prometheus(
    store: Store, fh: _CountingReader, path: Path, fr: FileReport, host: str | None, tracker: Any
) -> None:
    from ingest.prometheus import parse_exposition

    res = parse_exposition(fh.read(), source=str(path), host=host, ts_ns=os.stat(path).st_mtime_ns)
    events = tracker.feed(res.samples)
    _write_batch(store, events, metrics=res.samples, quarantine=res.quarantine)
    fr.read += res.lines
    fr.metrics += len(res.samples)
    fr.records += len(events)
    fr.normalized += len(res.samples) + len(events)
    fr.quarantined += len(res.quarantine)


def report_json(report: IngestReport) -> str:
    return json.dumps({"files": [f.to_dict() for f in report.files], **report.totals()})
