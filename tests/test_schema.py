from __future__ import annotations

import pyarrow as pa

from ingest import schema as S
from ingest.store import Store


def test_ddl_arrow_and_polars_schemas_agree(store: Store) -> None:
    with store.write() as con:
        for table in S.TABLES:
            cols = con.execute(
                "SELECT column_name, data_type, is_nullable FROM information_schema.columns"
                " WHERE table_name = ? ORDER BY ordinal_position",
                [table.name],
            ).fetchall()
            assert [c[0] for c in cols] == table.names
            arrow = S.arrow_schema(table)
            assert arrow.names == table.names
            for (name, dtype, nullable), col in zip(cols, table.columns, strict=True):
                assert dtype == col.duck, name
                assert (nullable == "YES") == col.nullable, name
                assert arrow.field(name).nullable == col.nullable
            # what DuckDB hands back as Arrow has the declared Arrow types
            got = con.sql(f"SELECT * FROM {table.name} LIMIT 0").to_arrow_table()
            for f in arrow:
                assert got.schema.field(f.name).type == f.type, f.name
            assert list(S.polars_schema(table)) == table.names


def test_event_ids_are_time_ordered_uuid7() -> None:
    a = S.new_event_id(1_700_000_000_000_000_000)
    b = S.new_event_id(1_700_000_000_001_000_000)
    assert a < b
    assert a[14] == "7" and a[19] in "89ab"
    assert len({S.new_event_id() for _ in range(1000)}) == 1000


def test_record_arrow_round_trip_keeps_every_value() -> None:
    rec = S.ErrorContext(
        code="GPU_XID_48",
        family="gpu_hardware",
        layer=1,
        severity="critical",
        source="t",
        trace_id="ab" * 16,
        gpu_uuid="GPU-1",
        xid=48,
        sm_error={"gpc": 3, "esr": [["0x1", "0x2"]]},
        kv_block=17,
        kv_hash="9f3a",
        confidence=0.5,
        attrs={"op": "lm_head", "n": [1, 2]},
    )
    tab = S.records_to_arrow([rec])
    assert isinstance(tab, pa.Table) and tab.num_rows == 1
    assert S.arrow_to_records(tab) == [rec]
