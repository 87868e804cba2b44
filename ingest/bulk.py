"""Bulk loading: large appends with the secondary indexes rebuilt once at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import duckdb

from ingest.store import Store

__all__ = ["bulk_writer"]


@contextlib.contextmanager
def bulk_writer(store: Store) -> Iterator[duckdb.DuckDBPyConnection]:
    """A write connection for appends of millions of rows.

    Maintaining an ART index row by row costs about half the insert speed;
    building it once afterwards takes about a second per few million rows.
    Readers wait (see :class:`ingest.store.Store`) while this runs.
    """
    with store.writer_lock(), store.write() as con:
        store.drop_indexes(con)
        try:
            yield con
        finally:
            store.create_indexes(con)
            con.execute("CHECKPOINT")
