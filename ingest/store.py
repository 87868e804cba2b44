"""The embedded DuckDB store: connections, migrations and writes.

Concurrency model (DuckDB allows one read-write process *or* many read-only
processes on a file): every connection is short-lived. Writers (the spool
loader, ``rca ingest``) serialize on an advisory ``flock`` beside the DB and
hold the DuckDB file only for one bounded batch at a time; readers open
read-only and, when the file is held by a writer, retry with backoff until
``lock_timeout`` (default 60 s, env ``RCA_LOCK_TIMEOUT``). A reader therefore
never sees a lock error while a load runs; it waits at most one batch.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from graph.errors import StoreError
from ingest import schema as S

__all__ = ["Store", "MIGRATIONS", "Migration"]

Migration = Callable[[duckdb.DuckDBPyConnection], None]


def _migration_1(con: duckdb.DuckDBPyConnection) -> None:
    for table in (S.ERROR_CONTEXT, S.SPANS, S.QUARANTINE):
        for stmt in S.create_table_sql(table):
            con.execute(stmt)
    con.execute(
        "CREATE TABLE IF NOT EXISTS spool_ledger ("
        " segment VARCHAR PRIMARY KEY, offset_bytes BIGINT NOT NULL,"
        " rows BIGINT NOT NULL, finished BOOLEAN NOT NULL, updated_ns BIGINT NOT NULL)"
    )
    con.execute(
        "CREATE TABLE IF NOT EXISTS ingest_ledger ("
        " source_key VARCHAR PRIMARY KEY, path VARCHAR, rows BIGINT, loaded_ns BIGINT)"
    )


def _migration_2(con: duckdb.DuckDBPyConnection) -> None:
    """Metric samples (Prometheus scrapes, NVML readings)."""
    for stmt in S.create_table_sql(S.METRICS):
        con.execute(stmt)


def _migration_3(con: duckdb.DuckDBPyConnection) -> None:
    """Per-file ingest progress, so an interrupted ingest resumes without duplicates."""
    con.execute("ALTER TABLE ingest_ledger ADD COLUMN IF NOT EXISTS lines_done BIGINT DEFAULT 0")
    con.execute("ALTER TABLE ingest_ledger ADD COLUMN IF NOT EXISTS complete BOOLEAN DEFAULT TRUE")


#: Numbered migrations: index i brings a store from version i to i+1.
MIGRATIONS: tuple[Migration, ...] = (_migration_1, _migration_2, _migration_3)
assert len(MIGRATIONS) == S.SCHEMA_VERSION

_LOCK_MARKERS = ("Could not set lock", "Conflicting lock")


def _is_lock_error(exc: Exception) -> bool:
    return isinstance(exc, duckdb.Error) and any(m in str(exc) for m in _LOCK_MARKERS)


class Store:
    """A DuckDB file plus the rules for touching it safely from many processes."""

    def __init__(
        self,
        path: str | Path,
        *,
        lock_timeout: float | None = None,
        migrations: Sequence[Migration] = MIGRATIONS,
    ) -> None:
        self.path = Path(path).expanduser()
        env_timeout = os.environ.get("RCA_LOCK_TIMEOUT")
        self.lock_timeout = lock_timeout if lock_timeout is not None else float(env_timeout or 60.0)
        self.migrations = tuple(migrations)
        self._ready = False

    # -- connections -------------------------------------------------------
    @property
    def _waiting_flag(self) -> Path:
        return self.path.with_name(self.path.name + ".writer-waiting")

    def writer_waiting(self) -> bool:
        """True while a writer in some process is queuing for the DuckDB file."""
        try:
            return time.time() - self._waiting_flag.stat().st_mtime < 30.0
        except FileNotFoundError:
            return False

    def _connect(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        deadline = time.monotonic() + self.lock_timeout
        delay = 0.005
        flagged = False
        try:
            while True:
                try:
                    return duckdb.connect(str(self.path), read_only=read_only)
                except duckdb.Error as exc:
                    if not _is_lock_error(exc) or time.monotonic() > deadline:
                        raise StoreError(f"cannot open store {self.path}: {exc}") from exc
                if not read_only:
                    # ask readers (see _SharedReader) to let go of the file
                    self._waiting_flag.touch()
                    flagged = True
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.1)
        finally:
            if flagged:
                with contextlib.suppress(FileNotFoundError):
                    self._waiting_flag.unlink()

    @contextlib.contextmanager
    def writer_lock(self, *, blocking: bool = True) -> Iterator[bool]:
        """Serialize writers across processes (an advisory lock, not DuckDB's)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".writer.lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def write(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-write connection, schema migrated; hold it for one batch only."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        reader = _shared_reader(self)
        with reader.exclusive():  # this process's readers let go of the file first
            con = self._connect(read_only=False)
            try:
                self._migrate(con)
                yield con
            finally:
                con.close()

    @contextlib.contextmanager
    def read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only cursor; creates or migrates the store first if needed.

        Cursors come from one read-only DuckDB instance per process and file
        (opening an instance costs ~15 ms), which is closed after a short idle
        time or as soon as a writer in any process queues for the file.
        """
        if not self.path.exists():
            with self.writer_lock(), self.write():
                pass
        reader = _shared_reader(self)
        cur = reader.acquire(self)
        try:
            if not self._ready:
                version = _read_version(cur)
                if version != len(self.migrations):
                    reader.release(cur)
                    cur = None
                    with self.writer_lock(), self.write():
                        pass  # migrates, or raises for a newer store
                    cur = reader.acquire(self)
                self._ready = True
            yield cur
        finally:
            if cur is not None:
                reader.release(cur)

    # -- schema ------------------------------------------------------------
    def schema_version_on_disk(self) -> int:
        if not self.path.exists():
            return 0
        reader = _shared_reader(self)
        cur = reader.acquire(self)
        try:
            return _read_version(cur)
        finally:
            reader.release(cur)

    def _migrate(self, con: duckdb.DuckDBPyConnection) -> None:
        con.execute("CREATE TABLE IF NOT EXISTS rca_meta (key VARCHAR PRIMARY KEY, value VARCHAR)")
        version = _read_version(con)
        target = len(self.migrations)
        if version > target:
            raise StoreError(
                f"store {self.path} has schema version {version}, newer than this "
                f"rca understands ({target}); upgrade rca"
            )
        for v in range(version, target):
            con.execute("BEGIN TRANSACTION")
            try:
                self.migrations[v](con)
                con.execute(
                    "INSERT OR REPLACE INTO rca_meta VALUES ('schema_version', ?)", [str(v + 1)]
                )
                con.execute("COMMIT")
            except Exception:
                con.execute("ROLLBACK")
                raise

    # -- writes ------------------------------------------------------------
    @staticmethod
    def insert_arrow(con: duckdb.DuckDBPyConnection, table: S.Table, data: pa.Table) -> int:
        """Append an Arrow table whose columns match ``table`` (cast if needed)."""
        if data.num_rows == 0:
            return 0
        data = data.select(table.names).cast(S.arrow_schema(table))
        con.register("_rca_batch", data)
        try:
            con.execute(
                f"INSERT INTO {table.name} BY NAME SELECT * FROM _rca_batch"  # noqa: S608
            )
        finally:
            con.unregister("_rca_batch")
        return data.num_rows

    def insert_records(self, records: list[Any], *, table: S.Table = S.ERROR_CONTEXT) -> int:
        """Convenience: write records (dataclasses or row dicts) in one transaction."""
        data = S.records_to_arrow(records, table)
        with self.writer_lock(), self.write() as con:
            return self.insert_arrow(con, table, data)

    def insert_spans(self, spans: list[Any]) -> int:
        return self.insert_records(spans, table=S.SPANS)

    # -- ledgers -------------------------------------------------------------
    @staticmethod
    def spool_offsets(con: duckdb.DuckDBPyConnection) -> dict[str, tuple[int, bool]]:
        rows = con.execute("SELECT segment, offset_bytes, finished FROM spool_ledger").fetchall()
        return {seg: (off, fin) for seg, off, fin in rows}

    @staticmethod
    def set_spool_offset(
        con: duckdb.DuckDBPyConnection, segment: str, offset: int, rows: int, finished: bool
    ) -> None:
        con.execute(
            "INSERT INTO spool_ledger VALUES (?, ?, ?, ?, ?) ON CONFLICT (segment) DO UPDATE SET"
            " offset_bytes = excluded.offset_bytes, rows = spool_ledger.rows + excluded.rows,"
            " finished = excluded.finished, updated_ns = excluded.updated_ns",
            [segment, offset, rows, finished, time.time_ns()],
        )

    @staticmethod
    def forget_spool_segments(con: duckdb.DuckDBPyConnection, older_than_ns: int) -> None:
        con.execute("DELETE FROM spool_ledger WHERE finished AND updated_ns < ?", [older_than_ns])

    @staticmethod
    def source_loaded(con: duckdb.DuckDBPyConnection, key: str) -> bool:
        """True once a source (file content, example) was ingested completely."""
        return Store.source_progress(con, key)[0]

    @staticmethod
    def source_progress(con: duckdb.DuckDBPyConnection, key: str) -> tuple[bool, int]:
        """(complete, last line committed) for a source; (False, 0) if never seen."""
        rows = con.execute(
            "SELECT complete, lines_done FROM ingest_ledger WHERE source_key = ?", [key]
        ).fetchall()
        return (bool(rows[0][0]), int(rows[0][1] or 0)) if rows else (False, 0)

    @staticmethod
    def mark_source_loaded(
        con: duckdb.DuckDBPyConnection,
        key: str,
        path: str,
        rows: int,
        *,
        lines_done: int = 0,
        complete: bool = True,
    ) -> None:
        con.execute(
            "INSERT INTO ingest_ledger (source_key, path, rows, loaded_ns, lines_done, complete)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (source_key) DO UPDATE SET"
            " rows = excluded.rows, loaded_ns = excluded.loaded_ns,"
            " lines_done = excluded.lines_done, complete = excluded.complete",
            [key, path, rows, time.time_ns(), lines_done, complete],
        )

    # -- housekeeping --------------------------------------------------------
    def counts(self) -> dict[str, int]:
        with self.read() as con:
            return {
                t.name: con.execute(f"SELECT count(*) FROM {t.name}").fetchall()[0][0]  # noqa: S608
                for t in S.TABLES
            }

    def create_indexes(self, con: duckdb.DuckDBPyConnection) -> None:
        for table in S.TABLES:
            for stmt in S.create_table_sql(table)[1:]:
                con.execute(stmt)

    def drop_indexes(self, con: duckdb.DuckDBPyConnection) -> None:
        for table in S.TABLES:
            for idx_name, _ in table.indexes:
                con.execute(f"DROP INDEX IF EXISTS {idx_name}")


def _read_version(con: duckdb.DuckDBPyConnection) -> int:
    try:
        rows = con.execute("SELECT value FROM rca_meta WHERE key = 'schema_version'").fetchall()
    except duckdb.CatalogException:
        return 0
    return int(rows[0][0]) if rows else 0


class _SharedReader:
    """One read-only DuckDB instance per (process, file), shared through cursors.

    DuckDB lets either one read-write process or any number of read-only ones
    hold a file. Keeping an instance open makes repeated queries cheap but
    would starve writers in other processes, so the instance is closed when
    idle for ``idle_s``, when older than ``max_age_s``, and, whenever no
    cursor is in use, as soon as a writer has flagged that it is waiting.
    """

    def __init__(self, store: Store, *, idle_s: float = 0.5, max_age_s: float = 5.0) -> None:
        self.store = store
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self._cond = threading.Condition()
        self._db: duckdb.DuckDBPyConnection | None = None
        self._users = 0
        self._opened = 0.0
        self._timer: threading.Timer | None = None
        self._exclusive = 0

    def acquire(self, store: Store | None = None) -> duckdb.DuckDBPyConnection:
        """A cursor on the shared instance, opened with ``store``'s lock timeout."""
        store = store or self.store
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            if (
                self._db is not None
                and self._users == 0
                and (
                    time.monotonic() - self._opened > self.max_age_s or self.store.writer_waiting()
                )
            ):
                self._close()
            if self._db is None:
                if self.store.writer_waiting():
                    self._wait_for_writer()
                self._db = store._connect(read_only=True)
                self._opened = time.monotonic()
            self._users += 1
            try:
                return self._db.cursor()
            except Exception:
                self._users -= 1
                raise

    def release(self, cur: duckdb.DuckDBPyConnection) -> None:
        with contextlib.suppress(duckdb.Error):
            cur.close()
        with self._cond:
            self._users -= 1
            if self._users == 0:
                if self.store.writer_waiting():
                    self._close()
                else:
                    self._arm_timer()
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Close this process's read instance and hold new readers off."""
        with self._cond:
            self._exclusive += 1
            while self._users:
                self._cond.wait()
            self._close()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive -= 1
                self._cond.notify_all()

    def _wait_for_writer(self) -> None:
        deadline = time.monotonic() + 2.0
        while self.store.writer_waiting() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(self.idle_s, self._idle_close)
        self._timer.daemon = True
        self._timer.start()

    def _idle_close(self) -> None:
        with self._cond:
            if self._users == 0:
                self._close()

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._db is not None:
            with contextlib.suppress(duckdb.Error):
                self._db.close()
            self._db = None


_READERS: dict[Path, _SharedReader] = {}
_READERS_LOCK = threading.Lock()


@atexit.register
def _close_readers() -> None:
    """Close shared instances before the interpreter tears threads down: a daemon
    timer thread killed inside DuckDB's C++ close aborts the process."""
    with _READERS_LOCK:
        readers = list(_READERS.values())
    for reader in readers:
        with reader._cond:
            reader._close()


def _shared_reader(store: Store) -> _SharedReader:
    key = store.path.resolve()
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is None or os.getpid() != getattr(reader, "_pid", os.getpid()):
            reader = _READERS[key] = _SharedReader(store)
            reader._pid = os.getpid()  # type: ignore[attr-defined]
        return reader
