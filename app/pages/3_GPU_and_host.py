"""GPU & host: metric time series (NVML, DCGM, vLLM samples), Xid events and SM errors."""

from __future__ import annotations

import plotly.express as px
import streamlit as st

from app import _ui
from rca import views

_ui.setup("GPU & host")
st.title("GPU & host")
summary = _ui.require_store()
since, until = _ui.time_window(summary, key="gpu_window")
store = _ui.store()

st.subheader("Xid events and SM errors")
hw = views.hardware_frame(store, since=since, until=until)
if hw.empty:
    st.caption("no records with an Xid number or SM error registers in this window")
else:
    hw = hw.assign(xid_label=[f"Xid {int(x)}" if x == x else "SM" for x in hw["xid"]])
    fig = px.scatter(
        hw,
        x="time",
        y="gpu",
        color="xid_label",
        symbol="code",
        hover_data=["code", "gpc", "tpc", "sm", "exception", "host"],
    )
    fig.update_traces(marker={"size": 12})
    fig.update_layout(height=160 + 40 * hw["gpu"].nunique(), margin={"t": 10, "b": 10})
    st.plotly_chart(fig, width="stretch")
    verdicts = views.sm_verdicts(hw)
    for _, v in verdicts.iterrows():
        box = st.error if v["verdict"] == "hardware" else st.info
        box(f"{v['gpu']}: SM faults point at the **{v['verdict']}** ({v['why']}).")
    sm = hw[hw["gpc"].notna() | hw["exception"].notna()]
    if not sm.empty:
        st.markdown(
            f"**SM errors** ({len(sm)}): the same GPC/TPC/SM repeating points at the hardware, "
            "faults scattered across SMs point at the application."
        )
        st.dataframe(
            sm[["time", "gpu", "code", "gpc", "tpc", "sm", "exception", "message"]],
            hide_index=True,
            width="stretch",
        )
    st.dataframe(hw[["time", "gpu", "code", "xid", "message"]], hide_index=True, width="stretch")

st.subheader("Metrics")
names = views.metric_catalog(store)
if names.empty:
    st.info(
        "No metric samples in this store. Load NVML/DCGM/vLLM samples with "
        "`rca ingest scrape.txt --format prometheus` or `rca probe nvml`."
    )
    st.stop()

preferred = [
    n
    for n in names["name"]
    if any(k in n for k in ("DCGM_FI_DEV_GPU_UTIL", "XID", "ECC", "gpu_cache_usage", "nvml"))
]
chosen = st.multiselect(
    "metrics", names["name"].tolist(), default=(preferred or names["name"].tolist())[:3]
)
if not chosen:
    st.stop()
samples = views.metric_frame(store, chosen, since=since, until=until)
if samples.empty:
    st.caption("no samples of these metrics in this window")
for name in chosen:
    part = samples[samples["name"] == name]
    if part.empty:
        continue
    fig = px.line(part, x="time", y="value", color="series", markers=len(part) < 200)
    for t in hw["time"].head(50) if not hw.empty else []:
        fig.add_vline(x=t, line_dash="dot", line_color="#c0392b", opacity=0.5)
    fig.update_layout(
        title=name,
        height=340,
        margin={"t": 40, "b": 10},
        legend={"font": {"size": 10}, "orientation": "h", "yanchor": "top", "y": -0.25},
    )
    st.plotly_chart(fig, width="stretch")
st.caption("Red dotted lines: Xid events in the same window.")
with st.expander("all metric names"):
    st.dataframe(names, hide_index=True, width="stretch")
