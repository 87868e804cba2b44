"""Dashboard home: what the store holds and where to look next."""

from __future__ import annotations

import streamlit as st

from app import _ui

_ui.setup("home")
st.title("Root-cause analysis for LLM serving")
st.caption(
    "From GPU Xid to HTTP 500, with evidence. Every table here is what `rca` prints "
    "in a terminal; the dashboard only reads the store."
)
summary = _ui.require_store()
failed = _ui.failed_cached(summary.path, _ui.version())

cols = st.columns(5)
cols[0].metric("failed requests", f"{len(failed):,}")
cols[1].metric("evidence records", f"{summary.records:,}")
cols[2].metric("spans", f"{summary.spans:,}")
cols[3].metric("metric samples", f"{summary.metrics:,}")
cols[4].metric("quarantined inputs", f"{summary.quarantine:,}")
st.write(
    f"Data from **{_ui.fmt_ts(summary.first_ts)}** to **{_ui.fmt_ts(summary.last_ts)}** "
    f"in `{summary.path}`."
)

st.subheader("Where to look")
st.page_link(
    _ui.page_path("incidents"),
    label="Incidents: failed requests and their top cause",
    icon=":material/list_alt:",
)
st.page_link(
    _ui.page_path("trace"),
    label="Trace: ranked causes, chain, evidence, spans",
    icon=":material/account_tree:",
)
st.page_link(
    _ui.page_path("gpu"),
    label="GPU & host: metrics, Xid events, SM errors",
    icon=":material/memory:",
)
st.page_link(
    _ui.page_path("evidence"),
    label="Evidence: records, quarantine, catalog",
    icon=":material/search:",
)

if len(failed):
    newest = failed.iloc[0]
    st.subheader("Newest failed request")
    st.write(f"`{newest['trace_id']}`: status {newest['status']}, {newest['name']}")
    st.page_link(
        _ui.page_path("trace"),
        label=f"open trace {newest['trace_id']}",
        icon=":material/troubleshoot:",
        query_params={"trace_id": newest["trace_id"]},
    )
