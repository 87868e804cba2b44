"""The spool: append-only segment files that probes write without opening DuckDB.

Layout: ``<spool>/<host>-<pid>-<start_ns>-<seq>.open`` while a writer appends,
renamed to ``.seg`` when rotated (by size or age) or closed. Each record is one
line, ``<crc32 8 hex> <json>\\n``, written with a single ``write(2)`` on an
``O_APPEND`` descriptor. A writer holds an exclusive ``flock`` on its open
segment, so the loader can tell a live writer from a dead one (the kernel drops
the lock when a process dies, SIGKILL included).

Guarantees:

* a process killed mid-write leaves at most one incomplete line at the end of
  its own segment; every earlier line is intact and is loaded;
* the incomplete tail of a dead writer's segment goes to ``quarantine`` with
  the reason, never into ``error_context``;
* loading is idempotent: the byte offset loaded so far is kept per segment in
  ``spool_ledger`` and committed in the same transaction as the rows.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from graph.errors import SpoolError
from ingest import schema as S
from ingest.store import Store

__all__ = ["SpoolWriter", "LoadReport", "load_spool", "encode_line", "decode_line"]

_KIND_TABLE = {"e": S.ERROR_CONTEXT, "s": S.SPANS, "m": S.METRICS}


def encode_line(kind: str, row: dict[str, Any]) -> bytes:
    body = json.dumps({"t": kind, "r": row}, separators=(",", ":"), default=str).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def decode_line(line: bytes) -> tuple[str, dict[str, Any]]:
    """Parse one complete line; raises ValueError with the reason."""
    if len(line) < 10 or line[8:9] != b" ":
        raise ValueError("malformed spool line: no checksum prefix")
    body = line[9:].rstrip(b"\n")
    try:
        expected = int(line[:8], 16)
    except ValueError as exc:
        raise ValueError("malformed spool line: bad checksum field") from exc
    if zlib.crc32(body) != expected:
        raise ValueError("checksum mismatch (corrupted record)")
    obj = json.loads(body)
    if (
        not isinstance(obj, dict)
        or obj.get("t") not in _KIND_TABLE
        or not isinstance(obj.get("r"), dict)
    ):
        raise ValueError("unknown record kind")
    return obj["t"], obj["r"]


class SpoolWriter:
    """Append records to the spool from any process; thread-safe and fork-aware.

    ``emit`` never raises into the caller unless ``strict``: a probe must not
    take the serving process down because a disk is full.
    """

    def __init__(
        self,
        spool_dir: str | Path,
        *,
        max_bytes: int = 8 * 1024 * 1024,
        max_age_s: float = 5.0,
        strict: bool = False,
    ) -> None:
        self.dir = Path(spool_dir).expanduser()
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.strict = strict
        self.errors = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._path: Path | None = None
        self._pid = -1
        self._seq = 0
        self._opened = 0.0
        self._size = 0
        self._host = os.uname().nodename.replace("-", "_")
        atexit.register(self.close)

    # public API -------------------------------------------------------------
    def emit(self, record: S.ErrorContext | S.Span) -> None:
        kind = "s" if isinstance(record, S.Span) else "e"
        self.write_row(kind, record.to_row())

    def emit_metric(self, row: dict[str, Any]) -> None:
        """A metric sample as a row of ``ingest.schema.METRICS``."""
        self.write_row("m", row)

    def write_row(self, kind: str, row: dict[str, Any]) -> None:
        line = encode_line(kind, row)
        with self._lock:
            try:
                self._ensure_open(len(line))
                assert self._fd is not None
                os.write(self._fd, line)
                self._size += len(line)
            except OSError as exc:
                self.errors += 1
                if self.strict:
                    raise SpoolError(f"cannot write to spool {self.dir}: {exc}") from exc

    def flush(self) -> None:
        """Finish the current segment so a loader takes it whole."""
        with self._lock:
            self._finish()

    def close(self) -> None:
        self.flush()

    @property
    def current_path(self) -> Path | None:
        return self._path

    # internals --------------------------------------------------------------
    def _ensure_open(self, incoming: int) -> None:
        if self._fd is not None and self._pid != os.getpid():
            # forked child: the parent's segment and lock are not ours
            os.close(self._fd)
            self._fd = None
            self._path = None
        if self._fd is not None and (
            self._size + incoming > self.max_bytes
            or time.monotonic() - self._opened > self.max_age_s
        ):
            self._finish()
        if self._fd is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._pid = os.getpid()
            self._seq += 1
            name = f"{self._host}-{self._pid}-{time.time_ns()}-{self._seq:06d}.open"
            path = self.dir / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._fd, self._path = fd, path
            self._opened = time.monotonic()
            self._size = 0

    def _finish(self) -> None:
        if self._fd is None or self._pid != os.getpid():
            return
        assert self._path is not None
        try:
            os.rename(self._path, self._path.with_suffix(".seg"))
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            self._path = None


@dataclass
class LoadReport:
    segments: int = 0
    rows: dict[str, int] = field(
        default_factory=lambda: {"error_context": 0, "spans": 0, "metrics": 0}
    )
    quarantined: int = 0
    deleted: int = 0
    skipped_busy: bool = False

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


@dataclass
class _Chunk:
    stem: str
    path: Path
    start: int
    end: int
    finished: bool  # no writer will append again
    rows: dict[str, list[dict[str, Any]]]
    bad: list[tuple[int, str, bytes]]  # (offset, reason, raw)


def _segments(spool: Path) -> list[Path]:
    if not spool.is_dir():
        return []
    segs = [p for p in spool.iterdir() if p.suffix in (".seg", ".open")]
    return sorted(segs, key=lambda p: p.name)


@contextlib.contextmanager
def _writer_state(path: Path) -> Iterator[bool | None]:
    """Yield True if the segment is finished (sealed, or its writer is dead),
    False if a live writer holds it, None if it vanished."""
    if path.suffix == ".seg":
        yield True
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        # dead writer: keep its lock while we read so nobody else does the same
        yield True
    finally:
        os.close(fd)


def _read_chunk(path: Path, start: int, finished: bool) -> _Chunk:
    stem = path.stem
    rows: dict[str, list[dict[str, Any]]] = {"e": [], "s": [], "m": []}
    bad: list[tuple[int, str, bytes]] = []
    with open(path, "rb") as fh:
        fh.seek(start)
        data = fh.read()
    end = start
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        line = data[pos : nl + 1]
        try:
            kind, row = decode_line(line)
            rows[kind].append(row)
        except ValueError as exc:
            bad.append((start + pos, str(exc), line))
        pos = nl + 1
    end = start + pos
    if finished and pos < len(data):
        bad.append((end, "torn write: incomplete record at end of segment", data[pos:]))
        end = start + len(data)
    return _Chunk(stem, path, start, end, finished, rows, bad)


def _quarantine_rows(chunk: _Chunk) -> list[dict[str, Any]]:
    return [
        S.quarantine_row(f"spool:{chunk.path.name}", f"byte {off}", reason, raw)
        for off, reason, raw in chunk.bad
    ]


def _to_arrow(kind: str, rows: list[dict[str, Any]], chunk: _Chunk) -> pa.Table:
    table = _KIND_TABLE[kind]
    try:
        return S.records_to_arrow(rows, table)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, KeyError):
        good = []
        for row in rows:
            try:
                S.records_to_arrow([row], table)
                good.append(row)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, KeyError) as exc:
                chunk.bad.append(
                    (
                        -1,
                        f"record does not fit {table.name}: {exc}",
                        json.dumps(row, default=str).encode(),
                    )
                )
        return S.records_to_arrow(good, table)


def load_spool(
    store: Store,
    spool_dir: str | Path,
    *,
    blocking: bool = True,
    batch_rows: int = 50_000,
    keep_ledger_s: float = 86_400.0,
) -> LoadReport:
    """Move every complete record from the spool into the store, idempotently.

    Each batch (at most ``batch_rows`` rows) is one transaction that also
    advances the per-segment offsets; the DB file is released between
    batches so readers in other processes get their turn.
    """
    spool = Path(spool_dir).expanduser()
    report = LoadReport()
    segs = _segments(spool)
    if not segs:
        return report
    with store.writer_lock(blocking=blocking) as got:
        if not got:
            report.skipped_busy = True
            return report
        with store.write() as con:
            offsets = Store.spool_offsets(con)
        pending: list[_Chunk] = []
        pending_rows = 0
        to_delete: list[Path] = []

        def flush() -> None:
            nonlocal pending, pending_rows
            if not pending:
                return
            with store.write() as con:
                con.execute("BEGIN TRANSACTION")
                try:
                    for chunk in pending:
                        n = 0
                        for kind, rows in chunk.rows.items():
                            if rows:
                                data = _to_arrow(kind, rows, chunk)
                                n += Store.insert_arrow(con, _KIND_TABLE[kind], data)
                                report.rows[_KIND_TABLE[kind].name] += data.num_rows
                        q = _quarantine_rows(chunk)
                        if q:
                            Store.insert_arrow(
                                con, S.QUARANTINE, S.records_to_arrow(q, S.QUARANTINE)
                            )
                            report.quarantined += len(q)
                        Store.set_spool_offset(con, chunk.stem, chunk.end, n, chunk.finished)
                    Store.forget_spool_segments(con, time.time_ns() - int(keep_ledger_s * 1e9))
                    con.execute("COMMIT")
                except Exception:
                    con.execute("ROLLBACK")
                    raise
            report.segments += len(pending)
            pending, pending_rows = [], 0

        for path in segs:
            with _writer_state(path) as finished:
                if finished is None:
                    continue
                start, _ = offsets.get(path.stem, (0, False))
                size = path.stat().st_size if path.exists() else 0
                if start < size or (finished and start == 0 and size == 0):
                    chunk = _read_chunk(path, start, bool(finished))
                    if chunk.end > start or chunk.bad or finished:
                        pending.append(chunk)
                        pending_rows += sum(len(r) for r in chunk.rows.values())
                if finished:
                    to_delete.append(path)
                if pending_rows >= batch_rows:
                    flush()
        flush()
        for path in to_delete:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                report.deleted += 1
    return report
