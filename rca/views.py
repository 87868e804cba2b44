"""Tables for the dashboard (`app/`) and the notebooks (`notebooks/`).

Every function here reads through :class:`ingest.store.Store`'s shared
read-only connection and returns a pandas DataFrame, a string or a small
dataclass; the pages only lay them out. Nothing here writes to the store:
:func:`open_read_only` refuses a missing store instead of creating it and does
not load the spool. pandas is imported inside the functions (an optional
dependency of the ``app`` extra), so importing this module stays cheap.

Times come back as timezone-aware UTC ``datetime64`` columns named ``time``
(or ``start``/``end`` for spans); the raw nanosecond columns are kept as
``ts``/``start_ns``/``end_ns``.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graph.errors import NotFoundError
from ingest import queries
from ingest.paths import default_db_path, rca_home
from ingest.store import Store
from ingest.tracebacks import raised_at

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

    from graph.catalog import Catalog
    from rca.engine import Diagnosis

__all__ = [
    "StoreSummary",
    "store_summary",
    "open_read_only",
    "failed_traces",
    "incidents",
    "status_counts",
    "top_cause",
    "causes_frame",
    "evidence_frame",
    "span_frame",
    "chain_dot",
    "cli_command",
    "metric_catalog",
    "metric_frame",
    "hardware_frame",
    "sm_verdicts",
    "evidence_timeline",
    "auto_bucket_s",
    "records_frame",
    "quarantine_frame",
    "quarantine_summary",
    "catalog_frame",
    "EMPTY_HINT",
]

#: What to tell someone whose store is missing or empty.
EMPTY_HINT = "run `rca demo` first (or `rca ingest FILE...`) to fill it"


@dataclass(frozen=True)
class StoreSummary:
    """What a store holds, without creating or migrating it."""

    path: str
    exists: bool
    records: int = 0
    spans: int = 0
    metrics: int = 0
    quarantine: int = 0
    first_ts: int | None = None
    last_ts: int | None = None

    @property
    def empty(self) -> bool:
        return not (self.records or self.spans or self.metrics or self.quarantine)

    @property
    def message(self) -> str:
        """One line for people: where the store is and what it holds."""
        if not self.exists:
            return f"no store at {self.path}: {EMPTY_HINT}"
        if self.empty:
            return f"the store at {self.path} is empty: {EMPTY_HINT}"
        return (
            f"{self.path}: {self.records:,} records, {self.spans:,} spans, "
            f"{self.metrics:,} metric samples, {self.quarantine:,} quarantined inputs"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _path(db: str | Path | None) -> Path:
    return Path(db).expanduser() if db is not None else default_db_path()


def store_summary(db: str | Path | None = None) -> StoreSummary:
    """Row counts of the store at ``db`` (default location if None); a missing file
    gives ``exists=False`` and is not created."""
    path = _path(db)
    if not path.exists():
        return StoreSummary(str(path), False)
    with Store(path).read() as con:
        c = queries.table_counts(con)
    return StoreSummary(
        str(path),
        True,
        records=c["error_context"],
        spans=c["spans"],
        metrics=c["metrics"],
        quarantine=c["quarantine"],
        first_ts=c["first_ts"],
        last_ts=c["last_ts"],
    )


def open_read_only(db: str | Path | None = None) -> Store:
    """The store at ``db`` for reading; :class:`NotFoundError` if the file is missing.

    Unlike :func:`rca.query.open_store` it does not load the spool (a write):
    the dashboard never blocks a writer.
    """
    path = _path(db)
    if not path.exists():
        raise NotFoundError(f"no store at {path}: {EMPTY_HINT}")
    return Store(path)


# -- helpers -------------------------------------------------------------------------


def _frame(tab: pa.Table) -> pd.DataFrame:
    return tab.to_pandas()


def _add_time(df: pd.DataFrame, src: str, dst: str) -> pd.DataFrame:
    import pandas as pd

    df[dst] = pd.to_datetime(df[src], unit="ns", utc=True)
    return df


def _ns(t: Any) -> int | None:
    """A datetime, pandas Timestamp or ns integer as ns since the epoch (None stays None)."""
    if t is None:
        return None
    if isinstance(t, int):
        return t
    import pandas as pd

    ts = pd.Timestamp(t)
    if ts.tzinfo is None:
        ts = ts.tz_localize("UTC")
    return int(ts.value)


def _status(http_status: Any, error_spans: Any) -> str:
    try:
        if http_status is not None and int(http_status) > 0:
            return str(int(http_status))
    except (TypeError, ValueError):
        pass
    return "ERROR" if error_spans else "?"


# -- incidents -------------------------------------------------------------------------


def failed_traces(
    store: Store,
    *,
    since: Any = None,
    until: Any = None,
    limit: int = 5000,
) -> pd.DataFrame:
    """Failed requests (HTTP >= 400 or an ERROR span), newest first, unranked (cheap).

    Columns: ``trace_id, time, status, http_status, name, host, service,
    duration_ms, spans, error_spans, records, start_ns``.
    """
    with store.read() as con:
        df = _frame(
            queries.failed_trace_table(con, t_start=_ns(since), t_end=_ns(until), limit=limit)
        )
    _add_time(df, "start_ns", "time")
    df["status"] = [
        _status(h, e) for h, e in zip(df["http_status"], df["error_spans"], strict=True)
    ]
    df["duration_ms"] = (df["end_ns"] - df["start_ns"]) / 1e6
    cols = [
        "trace_id",
        "time",
        "status",
        "http_status",
        "name",
        "host",
        "service",
        "duration_ms",
        "spans",
        "error_spans",
        "records",
        "start_ns",
    ]
    return df[cols].reset_index(drop=True)


def top_cause(store: Store, trace_id: str, *, window_s: float | None = None) -> dict[str, Any]:
    """The #1 root cause of one trace as a flat dict (``cause, family, layer, score,
    chain, symptom``); empty strings when nothing connects to the symptom."""
    from rca.query import DEFAULT_WINDOW_S, diagnose_trace
    from rca.render import chain_text

    diag = diagnose_trace(trace_id, store=store, window_s=window_s or DEFAULT_WINDOW_S, top=1)
    if not diag.causes:
        return {
            "cause": "",
            "family": "",
            "layer": None,
            "score": None,
            "chain": "",
            "symptom": diag.symptom or "",
        }
    c = diag.causes[0]
    return {
        "cause": c.code,
        "family": c.family,
        "layer": c.layer,
        "score": round(c.score, 3),
        "chain": chain_text(c.chain, c.observed),
        "symptom": diag.symptom or "",
    }


def incidents(
    store: Store,
    *,
    since: Any = None,
    until: Any = None,
    statuses: list[str] | None = None,
    families: list[str] | None = None,
    rank: int = 100,
    limit: int = 5000,
    ranker: Any = None,
) -> pd.DataFrame:
    """:func:`failed_traces` with the top root cause of the newest ``rank`` of them.

    Ranking is the costly part (~10-30 ms a trace), so only the first ``rank``
    rows (after the status filter) are ranked; the others keep empty cause
    columns. ``ranker(trace_id) -> dict`` replaces :func:`top_cause` (the
    dashboard passes a cached one). ``families`` keeps the ranked rows whose top
    cause is in one of these families.
    """
    df = failed_traces(store, since=since, until=until, limit=limit)
    if statuses:
        df = df[df["status"].isin([str(s) for s in statuses])].reset_index(drop=True)
    rank_fn = ranker or (lambda tid: top_cause(store, tid))
    tops = [rank_fn(tid) for tid in df["trace_id"].head(max(0, rank))]
    blank = {"cause": "", "family": "", "layer": None, "score": None, "chain": "", "symptom": ""}
    tops += [blank] * (len(df) - len(tops))
    for key in ("cause", "family", "layer", "score", "chain"):
        df[key] = [t[key] for t in tops]
    if families:
        df = df[df["family"].isin(families)].reset_index(drop=True)
    front = ["trace_id", "time", "status", "cause", "family", "layer", "chain", "score"]
    return df[front + [c for c in df.columns if c not in front]]


def status_counts(df: pd.DataFrame) -> pd.DataFrame:
    """Failed requests per status of an incidents/failed-traces frame (``status, n``)."""
    if df.empty:
        import pandas as pd

        return pd.DataFrame({"status": [], "n": []})
    out = df.groupby("status").size().reset_index(name="n")
    return out.sort_values("status").reset_index(drop=True)


# -- one trace -------------------------------------------------------------------------


def causes_frame(diag: Diagnosis) -> pd.DataFrame:
    """The ranked causes: ``rank, code, family, layer, score, chain, observed,
    evidence_rows, action`` (``chain`` with inferred links in brackets)."""
    import pandas as pd

    from rca.render import chain_text

    return pd.DataFrame(
        [
            {
                "rank": c.rank,
                "code": c.code,
                "family": c.family,
                "layer": c.layer,
                "score": round(c.score, 3),
                "chain": chain_text(c.chain, c.observed),
                "observed": len(c.observed),
                "evidence_rows": len(c.evidence),
                "action": c.action,
            }
            for c in diag.causes
        ],
        columns=[
            "rank",
            "code",
            "family",
            "layer",
            "score",
            "chain",
            "observed",
            "evidence_rows",
            "action",
        ],
    )


_EVIDENCE_COLS = [
    "time",
    "source",
    "code",
    "layer",
    "gpu_index",
    "kv_block",
    "xid",
    "raised_at",
    "message",
    "gpu_uuid",
    "host",
    "trace_id",
    "event_id",
]


def evidence_frame(store: Store, diag: Diagnosis, *, rank: int = 1) -> pd.DataFrame:
    """The evidence rows of cause ``rank`` (full records, time order): ``time, source,
    code, layer, gpu_index, kv_block, xid, raised_at, message, gpu_uuid, host,
    trace_id, event_id`` (``raised_at``: the frame that raised a log exception)."""
    cause = next((c for c in diag.causes if c.rank == rank), None)
    ids = list(cause.evidence) if cause else []
    with store.read() as con:
        df = _frame(queries.fetch_events(con, ids))
    _add_time(df, "ts", "time")
    df["raised_at"] = [raised_at(a) for a in df["attrs"]]
    return df[_EVIDENCE_COLS].reset_index(drop=True)


def span_frame(store: Store, trace_id: str) -> pd.DataFrame:
    """A trace's spans for a timeline: ``name, start, end, duration_ms, status,
    http_status, kind, service, span_id, parent_span_id, depth``."""
    with store.read() as con:
        df = _frame(queries.trace_spans(con, trace_id.strip().lower()))
    df["end_ns"] = df["end_ns"].fillna(df["start_ns"]).astype("int64")
    _add_time(df, "start_ns", "start")
    _add_time(df, "end_ns", "end")
    df["duration_ms"] = (df["end_ns"] - df["start_ns"]) / 1e6
    df["status"] = df["status_code"].fillna("UNSET")
    parents = dict(zip(df["span_id"], df["parent_span_id"], strict=True))

    def depth(sid: str) -> int:
        d, seen = 0, {sid}
        while (p := parents.get(sid)) and p in parents and p not in seen:
            d, sid = d + 1, p
            seen.add(p)
        return d

    df["depth"] = [depth(s) for s in df["span_id"]]
    df = df.rename(columns={"service_name": "service"})
    cols = [
        "name",
        "start",
        "end",
        "duration_ms",
        "status",
        "http_status",
        "kind",
        "service",
        "span_id",
        "parent_span_id",
        "depth",
        "start_ns",
        "end_ns",
    ]
    return df[cols].reset_index(drop=True)


def chain_dot(diag: Diagnosis, *, top: int = 3) -> str:
    """Graphviz DOT of the top causes' chains from root to symptom: observed codes
    filled, inferred links dashed, the #1 chain in bold red."""

    def q(s: str) -> str:
        return '"' + s.replace('"', r"\"") + '"'

    lines = [
        "digraph chain {",
        "  rankdir=LR;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11];',
    ]
    nodes: dict[str, bool] = {}
    edges: dict[tuple[str, str], tuple[int, bool]] = {}
    for c in diag.causes[:top]:
        obs = set(c.observed)
        for code in c.chain:
            nodes[code] = nodes.get(code, False) or code in obs
        for a, b in zip(c.chain, c.chain[1:], strict=False):
            best = edges.get((a, b), (c.rank, a in obs and b in obs))
            edges[(a, b)] = (min(best[0], c.rank), best[1])
    for code, seen in nodes.items():
        color = "#fde2e1" if seen else "#f2f2f2"
        extra = "" if seen else ', fontcolor="#666666", label=' + q(f"[{code}]")
        if code == diag.symptom:
            color = "#ffd27f"
        lines.append(f"  {q(code)} [fillcolor={q(color)}{extra}];")
    for (a, b), (rank, observed) in edges.items():
        attrs = ['color="#c0392b"', "penwidth=2"] if rank == 1 else ['color="#888888"']
        if not observed:
            attrs.append("style=dashed")
        lines.append(f"  {q(a)} -> {q(b)} [{', '.join(attrs)}];")
    lines.append("}")
    return "\n".join(lines)


def cli_command(trace_id: str, db: str | Path | None = None) -> str:
    """The `rca query` command line that prints the same answer in a terminal."""
    cmd = f"rca query --trace-id {shlex.quote(trace_id)}"
    if db is not None and _path(db) != rca_home() / "rca.duckdb":
        cmd += f" --db {shlex.quote(str(db))}"
    return cmd


# -- GPU & host ------------------------------------------------------------------------


def metric_catalog(store: Store) -> pd.DataFrame:
    """Metric names with ``samples, hosts, gpus, first, last``."""
    with store.read() as con:
        df = _frame(queries.metric_names(con))
    _add_time(df, "first_ts", "first")
    _add_time(df, "last_ts", "last")
    return df[["name", "samples", "hosts", "gpus", "first", "last"]]


#: Labels that name the series' source rather than tell series apart in a legend.
_IDENTITY_LABELS = frozenset(
    {
        "UUID",
        "uuid",
        "Hostname",
        "hostname",
        "gpu",
        "device",
        "modelName",
        "model_name",
        "pci_bus_id",
        "DCGM_FI_DRIVER_VERSION",
        "DCGM_FI_PROCESS_NAME",
        "instance",
        "job",
        "container",
        "namespace",
        "pod",
        "server",
    }
)


def auto_bucket_s(first: Any, last: Any, *, buckets: int = 120) -> int:
    """A round bucket width (s) that splits [first, last] (ns, datetimes or None) into
    at most ~``buckets`` bars."""
    span = max(1.0, ((_ns(last) or 0) - (_ns(first) or 0)) / 1e9)
    for width in (1, 5, 10, 30, 60, 300, 600, 1800, 3600, 6 * 3600, 86_400, 7 * 86_400):
        if span / width <= buckets:
            return width
    return 30 * 86_400


def metric_frame(
    store: Store,
    names: list[str],
    *,
    since: Any = None,
    until: Any = None,
    host: str | None = None,
    gpu_uuid: str | None = None,
) -> pd.DataFrame:
    """Samples of these metrics: ``time, name, series, value, host, gpu_uuid, labels``;
    ``series`` names one line of a chart (metric name plus host/GPU/labels)."""
    with store.read() as con:
        df = _frame(
            queries.metric_samples(
                con,
                list(names),
                t_start=_ns(since),
                t_end=_ns(until),
                host=host,
                gpu_uuid=gpu_uuid,
            )
        )
    _add_time(df, "ts", "time")

    def series(row: Any) -> str:
        parts = [row["name"]]
        if row["gpu_uuid"]:
            parts.append(str(row["gpu_uuid"])[:12])
        elif row["host"]:
            parts.append(str(row["host"]))
        try:
            labels = json.loads(row["labels"] or "{}")
        except ValueError:
            labels = {}
        extra = {k: v for k, v in labels.items() if k not in _IDENTITY_LABELS}
        if "gpu" in labels and not row["gpu_uuid"]:
            parts.append(f"gpu{labels['gpu']}")
        if extra:
            parts.append(",".join(f"{k}={v}" for k, v in sorted(extra.items()))[:60])
        return " ".join(parts)

    df["series"] = [series(r) for _, r in df.iterrows()] if len(df) else []
    return df[["time", "name", "series", "value", "host", "gpu_uuid", "labels", "ts"]]


def hardware_frame(store: Store, *, since: Any = None, until: Any = None) -> pd.DataFrame:
    """Xid events and SM errors in time order: ``time, gpu, code, xid, gpc, tpc, sm,
    exception, message, host, gpu_uuid, event_id, sm_error`` (SM fields from the
    driver's ``sm_error`` JSON where the line carried them; ``sm_error`` as a dict)."""
    with store.read() as con:
        df = _frame(queries.hardware_events(con, t_start=_ns(since), t_end=_ns(until)))
    _add_time(df, "ts", "time")
    sm = []
    for raw in df["sm_error"]:
        try:
            d = json.loads(raw) if raw else {}
        except ValueError:
            d = {}
        sm.append(d if isinstance(d, dict) else {})
    for key in ("gpc", "tpc", "sm", "exception"):
        df[key] = [d.get(key) for d in sm]
    df["gpu"] = [
        _gpu_label(h, u, i)
        for h, u, i in zip(df["host"], df["gpu_uuid"], df["gpu_index"], strict=True)
    ]
    df["sm_error"] = sm
    cols = ["time", "gpu", "code", "xid", "gpc", "tpc", "sm", "exception", "message"]
    return df[cols + ["host", "gpu_uuid", "event_id", "sm_error"]].reset_index(drop=True)


def sm_verdicts(hw: pd.DataFrame) -> pd.DataFrame:
    """NVIDIA's reading of the SM faults of a :func:`hardware_frame`, per GPU:
    ``gpu, verdict, faults, locations, why`` (``hardware`` when one GPC/TPC/SM
    repeats, ``application`` when faults are scattered across SMs)."""
    import pandas as pd

    from ingest.xid import sm_fault_verdict

    rows = []
    for gpu, part in hw.groupby("gpu", sort=True):
        errs = [d for d in part["sm_error"] if d]
        if errs:
            v = sm_fault_verdict(errs)
            rows.append(
                {"gpu": gpu, **{k: v[k] for k in ("verdict", "faults", "locations", "why")}}
            )
    return pd.DataFrame(rows, columns=["gpu", "verdict", "faults", "locations", "why"])


def _gpu_label(host: Any, uuid: Any, index: Any) -> str:
    """``host GPU-1c0f5a3e`` (the UUID's first group), or ``host GPU 0`` without a UUID."""
    if isinstance(uuid, str) and uuid:
        gpu = uuid[:12]
    elif index is not None and index == index:  # not NaN
        gpu = f"GPU {int(index)}"
    else:
        gpu = "GPU ?"
    return f"{host} {gpu}" if isinstance(host, str) and host else gpu


# -- evidence browser ------------------------------------------------------------------


def evidence_timeline(
    store: Store,
    *,
    by: str = "family",
    bucket_s: int = 60,
    code: str | None = None,
    family: str | None = None,
    layer: int | None = None,
    since: Any = None,
    until: Any = None,
) -> pd.DataFrame:
    """Record counts per time bucket: ``time, key, n`` (``key`` = the ``by`` column)."""
    with store.read() as con:
        df = _frame(
            queries.evidence_counts(
                con,
                by=by,
                bucket_s=bucket_s,
                code=code,
                family=family,
                layer=layer,
                t_start=_ns(since),
                t_end=_ns(until),
            )
        )
    _add_time(df, "bucket_ts", "time")
    return df[["time", "key", "n"]]


def records_frame(
    store: Store,
    *,
    code: str | None = None,
    family: str | None = None,
    layer: int | None = None,
    trace_id: str | None = None,
    since: Any = None,
    until: Any = None,
    limit: int = 1000,
) -> pd.DataFrame:
    """The newest records matching the filters (``trace_id``: that trace's own), ``time``
    first."""
    with store.read() as con:
        df = _frame(
            queries.records_page(
                con,
                code=code,
                family=family,
                layer=layer,
                trace_id=trace_id,
                t_start=_ns(since),
                t_end=_ns(until),
                limit=limit,
            )
        )
    _add_time(df, "ts", "time")
    return df[["time"] + [c for c in df.columns if c not in ("time", "ts")]]


def quarantine_frame(store: Store, *, limit: int = 1000) -> pd.DataFrame:
    """Quarantined inputs, newest first: ``time, source, origin, reason, raw``."""
    with store.read() as con:
        df = _frame(queries.quarantine_page(con, limit=limit))
    _add_time(df, "ts", "time")
    return df[["time", "source", "origin", "reason", "raw"]]


def quarantine_summary(store: Store) -> pd.DataFrame:
    """Quarantined inputs per ``reason, source``: ``n``."""
    with store.read() as con:
        return _frame(queries.quarantine_reasons(con))


def catalog_frame(catalog: Catalog | None = None) -> pd.DataFrame:
    """The error-code catalog: ``id, code, layer, layer_name, family, stage, trigger,
    recoverability, severity, summary, action, causes``."""
    import pandas as pd

    from graph.catalog import LAYER_NAMES, default_catalog

    cat = catalog or default_catalog()
    rows = [
        {
            "id": c.id,
            "code": c.name,
            "layer": c.layer,
            "layer_name": LAYER_NAMES[c.layer],
            "family": c.family,
            "stage": str(c.stage),
            "trigger": str(c.trigger),
            "recoverability": str(c.recoverability),
            "severity": str(c.severity),
            "summary": c.summary,
            "action": c.action,
            "causes": ", ".join(e.code for e in c.causes),
        }
        for c in cat.select()
    ]
    return pd.DataFrame(rows).sort_values(["layer", "id"]).reset_index(drop=True)
