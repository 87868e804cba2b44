from __future__ import annotations

import duckdb
import pytest

from graph.errors import StoreError
from ingest import schema as S
from ingest.store import MIGRATIONS, Store


def _rec(**kw):
    base = dict(code="X", family="numerical", layer=6, severity="error", source="test")
    base.update(kw)
    return S.ErrorContext(**base)


def test_schema_version_is_stored_and_migrations_run_in_order(tmp_path) -> None:
    path = tmp_path / "s.duckdb"
    store = Store(path)
    store.insert_records([_rec()])
    assert store.schema_version_on_disk() == len(MIGRATIONS) == S.SCHEMA_VERSION

    applied = []

    def add_column(con: duckdb.DuckDBPyConnection) -> None:
        applied.append(2)
        con.execute("ALTER TABLE error_context ADD COLUMN IF NOT EXISTS model VARCHAR")

    newer = Store(path, migrations=(*MIGRATIONS, add_column))
    assert newer.counts()["error_context"] == 1  # read() migrates first
    assert applied == [2]
    assert newer.schema_version_on_disk() == len(MIGRATIONS) + 1
    with newer.read() as con:
        cols = [r[0] for r in con.execute("DESCRIBE error_context").fetchall()]
    assert "model" in cols
    # an older rca refuses a store written by a newer one, with a clear message
    with pytest.raises(StoreError, match="newer than this rca understands"), Store(path).write():
        pass


def test_failed_migration_rolls_back(tmp_path) -> None:
    path = tmp_path / "s.duckdb"
    Store(path).insert_records([_rec()])

    def broken(con: duckdb.DuckDBPyConnection) -> None:
        con.execute("CREATE TABLE half_done (x INT)")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError), Store(path, migrations=(*MIGRATIONS, broken)).write():
        pass
    assert Store(path).schema_version_on_disk() == len(MIGRATIONS)
    with Store(path).read() as con:
        tables = {r[0] for r in con.execute("SHOW TABLES").fetchall()}
    assert "half_done" not in tables


def test_reader_waits_for_writer_instead_of_failing(tmp_path) -> None:
    import subprocess
    import sys
    import time

    path = tmp_path / "s.duckdb"
    Store(path).insert_records([_rec()])

    code = (
        "import duckdb,sys,time\n"
        f"c=duckdb.connect({str(path)!r})\n"
        "print('held',flush=True)\n"
        "time.sleep(1.0)\n"
        "c.close()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    n = Store(path, lock_timeout=20).counts()["error_context"]
    waited = time.monotonic() - t0
    proc.wait()
    assert n == 1
    assert waited > 0.3  # it really waited for the writer's lock


def test_lock_timeout_gives_a_store_error_naming_the_file(tmp_path) -> None:
    import subprocess
    import sys

    path = tmp_path / "s.duckdb"
    Store(path).insert_records([_rec()])
    code = (
        "import duckdb,time\n"
        f"c=duckdb.connect({str(path)!r})\n"
        "print('held',flush=True)\n"
        "time.sleep(5)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(StoreError, match=str(path.name)):
            Store(path, lock_timeout=0.3).counts()
    finally:
        proc.kill()
        proc.wait()


def test_a_version_1_store_is_migrated_in_place_keeping_its_rows(tmp_path) -> None:
    path = tmp_path / "old.duckdb"
    old = Store(path, migrations=MIGRATIONS[:1])
    old.insert_records([_rec(message="from v1")])
    assert old.schema_version_on_disk() == 1
    with old.read() as con:
        assert "metrics" not in {r[0] for r in con.execute("SHOW TABLES").fetchall()}
    new = Store(path)
    assert new.counts()["metrics"] == 0
    assert new.schema_version_on_disk() == len(MIGRATIONS)
    with new.read() as con:
        assert con.execute("SELECT message FROM error_context").fetchall() == [("from v1",)]
