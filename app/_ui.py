"""Layout glue shared by the dashboard pages: the store path, caches, the sidebar.

No analysis here: every number comes from :mod:`rca.views` (which reads
through :mod:`ingest.queries`). Caches are keyed by the store path and its
file's modification time, so a page shows new data as soon as a writer
commits, and ranking (the costly part) runs once per trace.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import streamlit as st

from ingest.paths import default_db_path
from rca import views
from rca.engine import Diagnosis

PAGES = {
    "home": "Home.py",
    "incidents": "pages/1_Incidents.py",
    "trace": "pages/2_Trace.py",
    "gpu": "pages/3_GPU_and_host.py",
    "evidence": "pages/4_Evidence.py",
}


def db_path() -> str:
    """The store this dashboard reads: ``$RCA_DB`` (set by `rca dashboard --db`)."""
    return str(default_db_path())


def _version(db: str) -> float:
    """Changes whenever a writer commits (the WAL file) or checkpoints (the DB file)."""
    out = 0.0
    for path in (db, db + ".wal"):
        with contextlib.suppress(FileNotFoundError):
            out = max(out, os.stat(path).st_mtime)
    return out


def setup(title: str) -> None:
    st.set_page_config(page_title=f"rca · {title}", page_icon="🩺", layout="wide")


def require_store() -> views.StoreSummary:
    """The store summary; stops the page with a clear message when it is missing or empty."""
    db = db_path()
    summary = summary_cached(db, _version(db))
    st.sidebar.caption(f"store: `{db}`")
    if not summary.exists or summary.empty:
        st.warning(summary.message)
        st.code("rca demo" + ("" if db == str(default_db_path()) else f" --db {db}"), "bash")
        st.stop()
    return summary


def store() -> Any:
    return views.open_read_only(db_path())


def version() -> float:
    return _version(db_path())


@st.cache_data(ttl=30, show_spinner=False)
def summary_cached(db: str, version: float) -> views.StoreSummary:
    return views.store_summary(db)


@st.cache_data(ttl=600, max_entries=20_000, show_spinner=False)
def top_cause_cached(db: str, version: float, trace_id: str) -> dict[str, Any]:
    return views.top_cause(views.open_read_only(db), trace_id)


@st.cache_data(ttl=600, max_entries=500, show_spinner=False)
def diagnosis_cached(
    db: str, version: float, trace_id: str, window_s: float, top: int
) -> Diagnosis:
    from rca.query import diagnose_trace

    return diagnose_trace(trace_id, store=views.open_read_only(db), window_s=window_s, top=top)


@st.cache_data(ttl=30, show_spinner=False)
def failed_cached(db: str, version: float) -> Any:
    return views.failed_traces(views.open_read_only(db))


def fmt_ts(ns: int | None) -> str:
    if ns is None:
        return "-"
    import datetime as dt

    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def time_window(summary: views.StoreSummary, key: str) -> tuple[Any, Any]:
    """A sidebar choice of the time window, relative to the newest data in the store."""
    import pandas as pd

    choices = {
        "all": None,
        "last 15 min": pd.Timedelta(minutes=15),
        "last hour": pd.Timedelta(hours=1),
        "last 6 hours": pd.Timedelta(hours=6),
        "last day": pd.Timedelta(days=1),
        "last week": pd.Timedelta(days=7),
    }
    pick = st.sidebar.selectbox(
        "time window (before the newest data)", list(choices), key=key, index=0
    )
    delta = choices[pick]
    if delta is None or summary.last_ts is None:
        return None, None
    end = pd.Timestamp(summary.last_ts, unit="ns", tz="UTC")
    return end - delta, end


def page_path(name: str) -> str:
    """A page's path relative to the main script (what st.page_link wants)."""
    return PAGES[name]


def here() -> Path:
    return Path(__file__).parent
