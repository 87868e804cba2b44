"""Where the embedded store and the spool live by default.

* ``RCA_HOME`` (default ``$XDG_DATA_HOME/rca``, i.e. ``~/.local/share/rca``) holds both;
* ``RCA_DB`` overrides the DuckDB file (default ``$RCA_HOME/rca.duckdb``);
* ``RCA_SPOOL`` overrides the spool folder (default: ``spool/`` beside the DB file).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["rca_home", "default_db_path", "spool_dir_for"]


def rca_home() -> Path:
    if env := os.environ.get("RCA_HOME"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base).expanduser() / "rca"


def default_db_path() -> Path:
    if env := os.environ.get("RCA_DB"):
        return Path(env).expanduser()
    return rca_home() / "rca.duckdb"


def spool_dir_for(db_path: Path | str | None = None) -> Path:
    if env := os.environ.get("RCA_SPOOL"):
        return Path(env).expanduser()
    db = Path(db_path) if db_path is not None else default_db_path()
    return db.expanduser().parent / "spool"
