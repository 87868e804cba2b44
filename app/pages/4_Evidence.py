"""Evidence browser: records over time, the records themselves, quarantine, catalog."""

from __future__ import annotations

import plotly.express as px
import streamlit as st

from app import _ui
from graph.catalog import FAMILIES, LAYER_NAMES
from ingest.queries import EVIDENCE_GROUPS
from rca import views

_ui.setup("evidence")
st.title("Evidence")
summary = _ui.require_store()
since, until = _ui.time_window(summary, key="ev_window")
store = _ui.store()

family = st.sidebar.selectbox("family", ["(any)", *FAMILIES], key="ev_family")
layer = st.sidebar.selectbox(
    "layer",
    ["(any)", *LAYER_NAMES],
    format_func=lambda x: x if x == "(any)" else f"{x} {LAYER_NAMES[x]}",
    key="ev_layer",
)
code = st.sidebar.text_input("code (exact)", key="ev_code").strip().upper() or None
filters = {
    "code": code,
    "family": None if family == "(any)" else family,
    "layer": None if layer == "(any)" else int(layer),
    "since": since,
    "until": until,
}

over_time, records, quarantine, catalog = st.tabs(
    ["Over time", "Records", f"Quarantine ({summary.quarantine:,})", "Catalog"]
)

with over_time:
    c1, c2 = st.columns(2)
    by = c1.selectbox("group by", list(EVIDENCE_GROUPS), index=1, key="ev_by")
    auto = views.auto_bucket_s(
        summary.first_ts if since is None else since, summary.last_ts if until is None else until
    )
    bucket = (
        c2.selectbox(
            "bucket",
            [0, 1, 10, 60, 300, 3600, 86_400],
            index=0,
            key="ev_bucket",
            format_func=lambda s: f"auto ({auto} s)" if s == 0 else f"{s} s",
        )
        or auto
    )
    tl = views.evidence_timeline(store, by=by, bucket_s=bucket, **filters)
    if tl.empty:
        st.caption("no records match")
    else:
        fig = px.bar(tl, x="time", y="n", color="key", labels={"key": by, "n": "records"})
        fig.update_layout(height=380, margin={"t": 10, "b": 10}, bargap=0.1)
        st.plotly_chart(fig, width="stretch")
        totals = tl.groupby("key")["n"].sum().sort_values(ascending=False).rename("records")
        st.dataframe(totals, width="stretch")

with records:
    limit = st.number_input("rows", 10, 100_000, 1000, step=100, key="ev_limit")
    rec = views.records_frame(store, limit=int(limit), **filters)
    st.caption(f"{len(rec):,} newest records matching the filters")
    st.dataframe(
        rec,
        hide_index=True,
        width="stretch",
        column_config={
            "time": st.column_config.DatetimeColumn("time (UTC)", format="YYYY-MM-DD HH:mm:ss.SSS"),
            "message": st.column_config.TextColumn(width="large"),
        },
    )

with quarantine:
    st.caption(
        "Input that could not be read (invalid UTF-8, binary data, over-long lines, "
        "absurd timestamps, malformed JSON or exposition lines, torn spool records), kept raw."
    )
    qs = views.quarantine_summary(store)
    if qs.empty:
        st.info("Nothing quarantined: every input line was read.")
    else:
        st.dataframe(qs, hide_index=True, width="stretch")
        st.dataframe(views.quarantine_frame(store), hide_index=True, width="stretch")

with catalog:
    cat = views.catalog_frame()
    search = st.text_input("search codes, summaries and actions", key="ev_cat_search")
    sel = cat
    if filters["family"]:
        sel = sel[sel["family"] == filters["family"]]
    if filters["layer"]:
        sel = sel[sel["layer"] == filters["layer"]]
    if search:
        hay = (sel["code"] + " " + sel["summary"] + " " + sel["action"]).str.lower()
        sel = sel[hay.str.contains(search.lower(), regex=False)]
    c1, c2, c3 = st.columns(3)
    c1.metric("codes", f"{len(sel)} of {len(cat)}")
    c2.metric("families", sel["family"].nunique())
    c3.metric("layers", sel["layer"].nunique())
    st.dataframe(sel, hide_index=True, width="stretch")
