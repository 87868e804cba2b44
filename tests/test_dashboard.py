"""The Streamlit dashboard: its data functions, each page in AppTest, one real browser."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("streamlit", reason="the dashboard needs the app extra")
pytest.importorskip("plotly", reason="the dashboard needs the app extra")

from streamlit.testing.v1 import AppTest  # noqa: E402

from graph.errors import NotFoundError  # noqa: E402
from rca import views  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOME = str(ROOT / "app" / "Home.py")
PROM = ROOT / "tests" / "fixtures" / "prometheus"
KV_TRACE = "000b019542c0d3a5fc78cb0dbcbaf7fb"  # Xid 48 -> KV block -> NaN logits -> 500
DEMO_FAILED = {
    "000b019542c0d3a5fc78cb0dbcbaf7fb": "500",
    "f59dae616a6ceac9f548385c3f004b69": "500",
    "7d603b615efbcac049e9008dc9c05b4c": "503",
}
CHROMIUM = os.environ.get("RCA_CHROMIUM", "/usr/bin/chromium")
BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo incident plus two real dcgm-exporter scrapes (metric samples)."""
    from ingest.pipeline import ingest_paths
    from ingest.store import Store
    from rca.demo import run_demo

    db = tmp_path_factory.mktemp("dash") / "rca.duckdb"
    old = os.environ.get("RCA_HOME")
    os.environ["RCA_HOME"] = str(db.parent)
    try:
        run_demo(db=db)
        ingest_paths(
            Store(db),
            [PROM / "dcgm_datadog_t4.txt", PROM / "dcgm_datadog_t4_scrape2.txt"],
            fmt="prometheus",
            host="gpu-node-07",
        )
    finally:
        if old is None:
            os.environ.pop("RCA_HOME", None)
        else:
            os.environ["RCA_HOME"] = old
    return db


@pytest.fixture
def app_db(demo_db: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RCA_DB", str(demo_db))
    return demo_db


def _page(page: str | None = None, **query: str) -> AppTest:
    at = AppTest.from_file(HOME, default_timeout=60)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    if page:
        at.switch_page(page)
        for k, v in query.items():
            at.query_params[k] = v
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _text(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.code]
    parts += [f"{m.label}={m.value}" for m in at.metric]
    parts += [str(s.value) for s in at.selectbox] + [t.value for t in at.title]
    parts += (
        [e.value for e in at.info] + [e.value for e in at.warning] + [e.value for e in at.error]
    )
    parts += [s.value for s in at.success]
    return "\n".join(str(p) for p in parts)


# -- library functions ------------------------------------------------------------------


def test_incidents_lists_each_failed_demo_request_with_its_top_cause(demo_db: Path) -> None:
    df = views.incidents(views.open_read_only(demo_db))
    assert dict(zip(df["trace_id"], df["status"], strict=True)) == DEMO_FAILED
    assert set(df["cause"]) == {"GPU_XID_48"} and set(df["family"]) == {"gpu_hardware"}
    kv = df[df["trace_id"] == KV_TRACE].iloc[0]
    assert kv["chain"] == "GPU_XID_48 -> KV_BLOCK_HASH_MISMATCH -> LOGITS_NAN -> HTTP_500"
    assert df["time"].is_monotonic_decreasing  # newest first
    counts = views.status_counts(df)
    assert dict(zip(counts["status"], counts["n"], strict=True)) == {"500": 2, "503": 1}
    # lazy ranking: only the first N are ranked; the status filter applies first
    lazy = views.incidents(views.open_read_only(demo_db), rank=1, statuses=["500"])
    assert list(lazy["status"]) == ["500", "500"] and list(lazy["cause"]) == ["GPU_XID_48", ""]


def test_trace_views_show_chain_evidence_spans_and_cli(demo_db: Path) -> None:
    from rca.query import diagnose_trace

    store = views.open_read_only(demo_db)
    diag = diagnose_trace(KV_TRACE, store=store)
    causes = views.causes_frame(diag)
    assert list(causes["code"][:2]) == ["GPU_XID_48", "KV_BLOCK_HASH_MISMATCH"]
    ev = views.evidence_frame(store, diag)
    assert {"GPU_XID_48", "KV_BLOCK_HASH_MISMATCH", "LOGITS_NAN"} <= set(ev["code"])
    assert 17 in set(ev["kv_block"].dropna().astype(int))  # the corrupted block
    # a log exception's evidence row says which frame raised it
    ecc = diagnose_trace("f59dae616a6ceac9f548385c3f004b69", store=store)
    raised = views.evidence_frame(store, ecc).set_index("code")["raised_at"].dropna()
    assert "vllm/model_executor/layers/sampler.py:309 in forward" in set(
        raised.loc[["CUDA_ERROR_ECC_UNCORRECTABLE"]]
    )
    spans = views.span_frame(store, KV_TRACE)
    assert list(spans["depth"]) == [0, 1] and set(spans["status"]) == {"ERROR"}
    dot = views.chain_dot(diag)
    assert '"GPU_XID_48" -> "KV_BLOCK_HASH_MISMATCH"' in dot and dot.startswith("digraph")
    assert views.cli_command(KV_TRACE, demo_db) == f"rca query --trace-id {KV_TRACE} --db {demo_db}"


def test_hardware_metric_and_evidence_views(demo_db: Path) -> None:
    store = views.open_read_only(demo_db)
    hw = views.hardware_frame(store)
    # the kernel log's Xid 48 and 63, then the Xids dcgm-exporter's counters report
    assert list(hw["xid"][:2]) == [48, 63] and hw["gpu"].iloc[0] == "gpu-node-07 GPU-1c0f5a3e"
    assert hw["time"].is_monotonic_increasing and 79 in set(hw["xid"])
    names = views.metric_catalog(store)
    assert "DCGM_FI_DEV_GPU_TEMP" in set(names["name"])
    temp = views.metric_frame(store, ["DCGM_FI_DEV_GPU_TEMP"])
    assert len(temp) == 2 and temp["time"].is_monotonic_increasing
    tl = views.evidence_timeline(store, by="layer", bucket_s=3600)
    assert tl["n"].sum() == views.store_summary(demo_db).records
    recs = views.records_frame(store, family="gpu_hardware")
    assert set(recs["family"]) == {"gpu_hardware"} and "GPU_XID_48" in set(recs["code"])
    assert views.auto_bucket_s(0, 7 * 3600 * 10**9) == 300  # 7 h -> 84 bars of 5 min
    assert views.auto_bucket_s(None, None) == 1
    series = set(views.metric_frame(store, ["DCGM_FI_DEV_GPU_UTIL"])["series"])
    assert series == {"DCGM_FI_DEV_GPU_UTIL GPU-20c56d28"}  # identity labels left out
    with pytest.raises(ValueError, match="cannot group by"):
        views.evidence_timeline(store, by="message; DROP TABLE spans")
    cat = views.catalog_frame()
    assert len(cat) >= 137 and cat["layer"].between(1, 7).all()


def test_a_missing_store_is_reported_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "rca.duckdb"
    summary = views.store_summary(missing)
    assert not summary.exists and "rca demo" in summary.message
    with pytest.raises(NotFoundError, match="rca demo"):
        views.open_read_only(missing)
    assert not missing.exists() and not missing.parent.exists()


# -- pages (AppTest) ---------------------------------------------------------------------


def test_home_page_summarizes_the_store(app_db: Path) -> None:
    at = _page()
    metrics = {m.label: m.value for m in at.metric}
    records = views.store_summary(app_db).records
    assert metrics["failed requests"] == "3" and metrics["evidence records"] == str(records)
    assert int(metrics["metric samples"].replace(",", "")) > 0
    assert "7d603b615efbcac049e9008dc9c05b4c" in _text(at)  # the newest failed request


def test_home_page_on_a_missing_store_says_run_rca_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RCA_DB", str(tmp_path / "none.duckdb"))
    at = _page()
    assert any("rca demo" in w.value for w in at.warning)
    assert not (tmp_path / "none.duckdb").exists()


def test_incidents_page_lists_failed_requests_and_counts(app_db: Path) -> None:
    at = _page("pages/1_Incidents.py")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics == {"failed requests": "3", "status 500": "2", "status 503": "1"}
    table = at.dataframe[0].value
    assert set(table["trace_id"]) == set(DEMO_FAILED)
    assert set(table["cause"]) == {"GPU_XID_48"}
    assert f"Trace?trace_id={KV_TRACE}" in set(table["open"])
    # filter by status
    at.sidebar.multiselect(key="inc_status").select("503").run()
    assert not at.exception
    assert set(at.dataframe[0].value["trace_id"]) == {"7d603b615efbcac049e9008dc9c05b4c"}


def test_trace_page_from_query_param_shows_causes_chain_evidence(app_db: Path) -> None:
    at = _page("pages/2_Trace.py", trace_id=KV_TRACE)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["symptom"] == "HTTP_500" and metrics["top cause"] == "GPU_XID_48"
    causes, evidence = at.dataframe[0].value, at.dataframe[1].value
    assert causes["chain"].iloc[0] == (
        "GPU_XID_48 -> KV_BLOCK_HASH_MISMATCH -> LOGITS_NAN -> HTTP_500"
    )
    assert {"KV_BLOCK_HASH_MISMATCH", "LOGITS_NAN"} <= set(evidence["code"])
    assert "WORKFLOW_XID_48" in at.success[0].value  # the recommended action
    assert f"rca query --trace-id {KV_TRACE} --db {app_db}" in _text(at)
    kinds = {getattr(e, "type", "") for e in at.main}
    assert at.get("graphviz_chart") and at.get("plotly_chart"), kinds


def test_trace_page_unknown_trace_is_one_clear_error(app_db: Path) -> None:
    at = _page("pages/2_Trace.py", trace_id="0" * 32)
    assert not at.exception
    assert any("not found" in e.value for e in at.error)


def test_gpu_page_shows_xid_events_and_metric_charts(app_db: Path) -> None:
    at = _page("pages/3_GPU_and_host.py")
    hw = at.dataframe[0].value
    assert list(hw["code"][:2]) == ["GPU_XID_48", "GPU_XID_63"]
    assert len(at.get("plotly_chart")) >= 2  # the Xid scatter and at least one metric


def test_evidence_page_records_quarantine_and_catalog(app_db: Path) -> None:
    at = _page("pages/4_Evidence.py")
    frames = [d.value for d in at.dataframe]
    records = next(f for f in frames if "event_id" in getattr(f, "columns", []))
    assert len(records) == views.store_summary(app_db).records
    assert "GPU_XID_48" in set(records["code"])
    catalog = next(f for f in frames if "recoverability" in getattr(f, "columns", []))
    assert len(catalog) >= 137
    quarantined = next(f for f in frames if "reason" in getattr(f, "columns", []))
    assert len(quarantined) >= 1 and quarantined["reason"].astype(bool).all()
    at.sidebar.selectbox(key="ev_family").select("kv_cache_integrity").run()
    assert not at.exception
    frames = [d.value for d in at.dataframe]
    records = next(f for f in frames if "event_id" in getattr(f, "columns", []))
    assert list(records["code"]) == ["KV_BLOCK_HASH_MISMATCH"]


def test_sm_verdicts_read_repeated_vs_scattered_sm_faults() -> None:
    import pandas as pd

    def fault(gpc: int, tpc: int, sm: int) -> dict:
        return {"kind": "sm_exception", "gpc": gpc, "tpc": tpc, "sm": sm}

    hw = pd.DataFrame(
        {
            "gpu": ["h GPU 0"] * 3 + ["h GPU 1"] * 2 + ["h GPU 2"],
            "sm_error": [fault(3, 1, 0)] * 3 + [fault(1, 0, 0), fault(2, 1, 1)] + [{}],
        }
    )
    v = views.sm_verdicts(hw).set_index("gpu")
    assert v.loc["h GPU 0", "verdict"] == "hardware" and v.loc["h GPU 0", "faults"] == 3
    assert v.loc["h GPU 1", "verdict"] == "application"
    assert "h GPU 2" not in v.index  # no SM registers, no verdict


def test_gpu_page_shows_the_sm_fault_verdict_of_a_real_xid13_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ingest.pipeline import ingest_paths
    from ingest.store import Store

    db = tmp_path / "sm.duckdb"
    log = ROOT / "tests/fixtures/real/crashlogs/07-xid13-out-of-range-then-xid43.log"
    ingest_paths(Store(db), [log])
    monkeypatch.setenv("RCA_DB", str(db))
    at = _page("pages/3_GPU_and_host.py")
    assert any("application" in i.value and "scattered" in i.value for i in at.info)
    sm = at.dataframe[0].value
    assert sm["exception"].str.contains("Out Of Range Address").any()
    assert any("No metric samples" in i.value for i in at.info)


# -- the command -------------------------------------------------------------------------


def test_dashboard_command_without_streamlit_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    from app import launch

    real = importlib.util.find_spec
    monkeypatch.setattr(
        launch.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "streamlit" else real(name, *a),
    )
    from typer.testing import CliRunner

    from rca.cli import app

    helptext = CliRunner().invoke(app, ["dashboard", "--help"]).output
    assert "--no-browser" in helptext and "--port" in helptext
    from graph.errors import RcaError

    with pytest.raises(RcaError, match="scripts/setup.sh app"):
        launch.run_dashboard(tmp_path / "x.duckdb", port=_free_port(), open_browser=False)


# -- a real browser ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_closes(port: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
        except OSError:
            return True
        time.sleep(0.2)
    return False


def _chromium() -> str | None:
    if Path(CHROMIUM).exists():
        return CHROMIUM
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def dashboard_server(demo_db: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    rca = Path(sys.executable).with_name("rca")
    proc = subprocess.Popen(
        [str(rca), "dashboard", "--db", str(demo_db), "--port", str(port), "--no-browser"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.fail("dashboard did not start: " + (tmp_path / "server.log").read_text())
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()  # SIGTERM to `rca dashboard` must stop streamlit too
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        stopped = _port_closes(port)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # never leave a server behind
        log.close()
    assert stopped, "streamlit kept running after `rca dashboard` got SIGTERM"
    out = (tmp_path / "server.log").read_text()
    assert f"rca dashboard: {url}" in out
    assert "Traceback" not in out, out


def test_real_browser_renders_incidents_and_trace_pages(
    dashboard_server: str, demo_db: Path, tmp_path: Path
) -> None:
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium: install it with `apt-get install -y chromium`")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the dev extra")
    shots = Path(os.environ.get("RCA_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=BROWSER_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(dashboard_server + "/Incidents", wait_until="domcontentloaded")
            page.get_by_text("rca query --trace-id").first.wait_for(timeout=45_000)
            page.get_by_text("status 503").first.wait_for(timeout=45_000)
            page.wait_for_timeout(1500)  # let the charts and the table paint
            page.screenshot(path=str(shots / "incidents.png"), full_page=True)
            text = page.inner_text("body")
            assert "Incidents" in text and "failed requests" in text
            assert "status 500" in text and "status 503" in text
            assert "7d603b615efbcac049e9008dc9c05b4c" in text  # newest, in the picker
            assert "Traceback" not in text and "Error" not in text.replace("ERROR", "")

            # the open dashboard never blocks a writer: ingest into its store now
            t0 = time.monotonic()
            rca = Path(sys.executable).with_name("rca")
            res = subprocess.run(
                [
                    str(rca),
                    "ingest",
                    str(PROM / "vllm_v0_6_opt125m_issue8819.txt"),
                    "--db",
                    str(demo_db),
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert res.returncode == 0, res.stderr
            assert time.monotonic() - t0 < 60

            page.set_viewport_size({"width": 1400, "height": 2600})  # the whole trace page
            page.goto(
                f"{dashboard_server}/Trace?trace_id={KV_TRACE}", wait_until="domcontentloaded"
            )
            page.get_by_text(f"trace {KV_TRACE}").first.wait_for(timeout=45_000)
            page.get_by_text("Span timeline").first.wait_for(timeout=45_000)
            page.wait_for_timeout(2500)
            page.screenshot(path=str(shots / "trace.png"), full_page=True)
            text = page.inner_text("body")
            assert "GPU_XID_48" in text and "HTTP_500" in text and "WORKFLOW_XID_48" in text
            assert f"rca query --trace-id {KV_TRACE}" in text
            svg = page.locator("svg").filter(has_text="KV_BLOCK_HASH_MISMATCH")
            assert svg.count() >= 1  # the chain graph rendered
        finally:
            browser.close()
    assert (shots / "incidents.png").stat().st_size > 10_000
    assert (shots / "trace.png").stat().st_size > 10_000
