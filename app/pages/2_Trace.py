"""Trace: the ranked root causes of one failed request, their chains and evidence."""

from __future__ import annotations

import streamlit as st

from app import _ui
from graph.errors import RcaError
from rca import views

_ui.setup("trace")
st.title("Trace")
summary = _ui.require_store()
db, version = summary.path, _ui.version()

failed = _ui.failed_cached(db, version)
options = failed["trace_id"].tolist()
status_of = dict(zip(options, failed["status"], strict=True))
from_url = (st.query_params.get("trace_id") or "").strip().lower()

left, right = st.columns([2, 3])
picked = left.selectbox(
    "failed request",
    options,
    index=options.index(from_url) if from_url in options else (0 if options else None),
    format_func=lambda t: f"{t}  ({status_of.get(t, '?')})",
    key="trace_pick",
)
typed = right.text_input(
    "or type a trace id", value=from_url if from_url not in options else "", key="trace_typed"
)
window_s = st.sidebar.number_input("context window before the symptom (s)", 10, 86_400, 300)
top = st.sidebar.slider("causes to rank", 1, 10, 5)

trace_id = (typed or picked or "").strip().lower()
if not trace_id:
    st.info("No failed request in the store: type a trace id.")
    st.stop()
if st.query_params.get("trace_id") != trace_id:
    st.query_params["trace_id"] = trace_id

try:
    diag = _ui.diagnosis_cached(db, version, trace_id, float(window_s), int(top))
except RcaError as exc:
    st.error(str(exc))
    st.stop()

st.subheader(f"trace {trace_id}")
c1, c2, c3, c4 = st.columns(4)
c1.metric("symptom", diag.symptom or "-")
c2.metric("top cause", diag.causes[0].code if diag.causes else "-")
c3.metric("family", diag.causes[0].family if diag.causes else "-")
c4.metric("evidence rows considered", f"{diag.evidence_rows:,}")

ev = None
if not diag.causes:
    st.warning("No candidate root cause: no evidence connects to the symptom.")
else:
    best = diag.causes[0]
    st.markdown(f"**Recommended action** (for {best.code}, layer {best.layer}):")
    st.success(best.action)
    st.markdown("**Ranked causes** (`[CODE]` = inferred link with no evidence row)")
    st.dataframe(
        views.causes_frame(diag),
        hide_index=True,
        width="stretch",
        column_config={
            "score": st.column_config.ProgressColumn(min_value=0, max_value=1),
            "chain": st.column_config.TextColumn(width="large"),
        },
    )
    st.markdown("**Chains from root cause to symptom** (red: #1; dashed: inferred)")
    st.graphviz_chart(views.chain_dot(diag, top=3), width="stretch")

    rank = st.selectbox(
        "evidence of cause",
        [c.rank for c in diag.causes],
        format_func=lambda r: f"#{r} {diag.causes[r - 1].code}",
        key="trace_rank",
    )
    ev = views.evidence_frame(_ui.store(), diag, rank=rank)
    if ev["raised_at"].isna().all():  # no log exception among them
        ev = ev.drop(columns="raised_at")
    st.markdown(f"**Evidence rows** ({len(ev)})")
    st.dataframe(
        ev,
        hide_index=True,
        width="stretch",
        column_config={
            "time": st.column_config.DatetimeColumn("time (UTC)", format="HH:mm:ss.SSS"),
            "message": st.column_config.TextColumn(width="large"),
            "raised_at": st.column_config.TextColumn("raised at", width="medium"),
        },
    )

for note in diag.notes:
    st.info(note)

spans = views.span_frame(_ui.store(), trace_id)
st.markdown(f"**Span timeline** ({len(spans)} spans)")
if spans.empty:
    st.caption("no spans for this trace (records only)")
else:
    import pandas as pd
    import plotly.express as px

    spans = spans.assign(
        label=[("  " * d) + n for d, n in zip(spans["depth"], spans["name"], strict=True)],
        end_shown=spans["end"].where(
            spans["end"] > spans["start"], spans["start"] + pd.Timedelta("1ms")
        ),
    )
    fig = px.timeline(
        spans,
        x_start="start",
        x_end="end_shown",
        y="label",
        color="status",
        hover_data=["duration_ms", "http_status", "kind", "service", "span_id"],
        color_discrete_map={"ERROR": "#c0392b", "OK": "#27ae60", "UNSET": "#95a5a6"},
    )
    # evidence inside the request's time span as markers on their own row: the trace's
    # own records and the shown cause's evidence (e.g. the Xid line, which has no trace id)
    marks = views.records_frame(_ui.store(), trace_id=trace_id, limit=200)
    if ev is not None and not ev.empty:
        marks = pd.concat([marks[ev.columns.intersection(marks.columns)], ev])
    marks = marks.drop_duplicates("event_id").sort_values("time")
    lo, hi = spans["start"].min(), spans["end_shown"].max()
    marks = marks[(marks["time"] >= lo) & (marks["time"] <= hi)]
    if not marks.empty:
        fig.add_scatter(
            x=marks["time"],
            y=["evidence"] * len(marks),
            mode="markers+text",
            text=marks["code"],
            textposition=(["top center", "bottom center"] * len(marks))[: len(marks)],
            textfont={"size": 10},
            marker={"symbol": "x", "size": 11, "color": "#222222"},
            hovertext=marks["message"],
            name="evidence",
        )
    fig.update_yaxes(autorange="reversed", title=None)
    fig.update_layout(height=170 + 32 * len(spans), margin={"l": 10, "r": 10, "t": 10, "b": 10})
    st.plotly_chart(fig, width="stretch")

st.markdown("**The same answer in a terminal**")
st.code(
    views.cli_command(trace_id, db) + "\n" + views.cli_command(trace_id, db) + " --json", "bash"
)
