"""Incidents: failed requests with their top root cause, filterable, counts by status."""

from __future__ import annotations

import streamlit as st

from app import _ui
from rca import views

_ui.setup("incidents")
st.title("Incidents")
summary = _ui.require_store()
db, version = summary.path, _ui.version()

since, until = _ui.time_window(summary, key="inc_window")
failed = views.failed_traces(_ui.store(), since=since, until=until)
statuses = sorted(failed["status"].unique().tolist())
pick_status = st.sidebar.multiselect("status", statuses, default=[], key="inc_status")
rank_n = int(
    st.sidebar.number_input(
        "rank the newest N",
        min_value=0,
        max_value=5000,
        value=100,
        step=50,
        key="inc_rank",
        help="Ranking costs ~10-30 ms a trace (cached); older rows keep empty cause columns.",
    )
)

if failed.empty:
    st.info("No failed requests (HTTP >= 400 or ERROR spans) in this time window.")
    st.stop()

with st.spinner("ranking root causes..."):
    df = views.incidents(
        _ui.store(),
        since=since,
        until=until,
        statuses=pick_status or None,
        rank=rank_n,
        ranker=lambda tid: _ui.top_cause_cached(db, version, tid),
    )
families = sorted(f for f in df["family"].unique().tolist() if f)
pick_family = st.sidebar.multiselect("top-cause family", families, default=[], key="inc_family")
if pick_family:
    df = df[df["family"].isin(pick_family)].reset_index(drop=True)

counts = views.status_counts(df)
cols = st.columns(max(1, min(len(counts) + 1, 8)))
cols[0].metric("failed requests", f"{len(df):,}")
for col, (_, row) in zip(cols[1:], counts.iterrows(), strict=False):
    col.metric(f"status {row['status']}", f"{int(row['n']):,}")

if not df.empty and df["family"].astype(bool).any():
    by_family = df[df["family"] != ""].groupby("family").size().rename("requests")
    st.bar_chart(by_family, horizontal=True, height=min(60 + 28 * len(by_family), 400))

df = df.assign(open=[f"Trace?trace_id={t}" for t in df["trace_id"]])
st.dataframe(
    df[
        [
            "open",
            "trace_id",
            "time",
            "status",
            "cause",
            "chain",
            "family",
            "layer",
            "score",
            "name",
            "host",
            "duration_ms",
            "records",
        ]
    ],
    hide_index=True,
    width="stretch",
    column_config={
        "open": st.column_config.LinkColumn("open", display_text="open ↗", width="small"),
        "time": st.column_config.DatetimeColumn("time (UTC)", format="YYYY-MM-DD HH:mm:ss.SSS"),
        "score": st.column_config.NumberColumn(format="%.2f"),
        "chain": st.column_config.TextColumn(width="large"),
        "duration_ms": st.column_config.NumberColumn("ms", format="%.0f"),
    },
)

pick = st.selectbox("open a trace", df["trace_id"].tolist(), index=0, key="inc_pick")
if pick:
    st.page_link(
        _ui.page_path("trace"),
        label=f"diagnose {pick}",
        icon=":material/troubleshoot:",
        query_params={"trace_id": pick},
    )
    st.code(views.cli_command(pick, db), "bash")
