from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).with_name("fixtures")
MINI_CATALOG = FIXTURES / "mini_catalog.toml"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own RCA_HOME: nothing touches the user's store."""
    home = tmp_path / "rca-home"
    monkeypatch.setenv("RCA_HOME", str(home))
    monkeypatch.delenv("RCA_DB", raising=False)
    monkeypatch.delenv("RCA_SPOOL", raising=False)
    monkeypatch.delenv("RCA_CATALOG", raising=False)
    return home


@pytest.fixture
def mini_catalog():
    from graph.catalog import load_catalog

    return load_catalog(MINI_CATALOG)


@pytest.fixture
def store(tmp_path: Path):
    from ingest.store import Store

    return Store(tmp_path / "db" / "rca.duckdb", lock_timeout=30)
