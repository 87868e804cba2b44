"""Start the dashboard: `streamlit run app/Home.py`, headless, on localhost.

Used by `rca dashboard`; the store path reaches the pages as ``$RCA_DB``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from graph.errors import RcaError
from ingest.paths import default_db_path

__all__ = ["HOME", "INSTALL_HINT", "dashboard_command", "run_dashboard"]

HOME = Path(__file__).with_name("Home.py")
INSTALL_HINT = "run `bash scripts/setup.sh app` (or `pip install -e '.[app]'`)"


def dashboard_command(port: int, address: str = "127.0.0.1") -> list[str]:
    """The `streamlit run` command line (headless, no telemetry, no file watcher)."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(HOME),
        "--server.headless=true",
        f"--server.address={address}",
        f"--server.port={port}",
        "--server.fileWatcherType=none",
        "--browser.gatherUsageStats=false",
        "--global.developmentMode=false",
        "--theme.base=light",
        "--client.toolbarMode=viewer",
    ]


def _port_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _open_when_up(url: str, address: str, port: int, timeout: float = 60.0) -> None:
    import webbrowser

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((address, port), 0.5):
            webbrowser.open(url)
            return
        time.sleep(0.3)


def run_dashboard(
    db: str | Path | None = None,
    *,
    port: int = 8501,
    address: str = "127.0.0.1",
    open_browser: bool = True,
    echo=print,  # type: ignore[no-untyped-def]
) -> int:
    """Run the dashboard in the foreground until Ctrl-C; returns the exit status."""
    if importlib.util.find_spec("streamlit") is None or importlib.util.find_spec("plotly") is None:
        raise RcaError(f"the dashboard needs streamlit and plotly: {INSTALL_HINT}")
    if not 0 < port < 65536:
        raise RcaError(f"--port must be 1..65535, not {port}")
    if not _port_free(address, port):
        raise RcaError(f"port {port} on {address} is in use: pass --port N")
    path = (Path(db).expanduser() if db is not None else default_db_path()).resolve()
    url = f"http://{address}:{port}"
    echo(f"rca dashboard: {url}  (store: {path}; Ctrl-C to stop)")
    if not path.exists():
        echo(f"note: no store at {path} yet: run `rca demo` first")
    env = {**os.environ, "RCA_DB": str(path), "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    if open_browser:
        threading.Thread(target=_open_when_up, args=(url, address, port), daemon=True).start()
    proc = subprocess.Popen(dashboard_command(port, address), env=env)
    # SIGTERM/SIGHUP to `rca dashboard` stop the server too (no orphaned streamlit)
    handled = (signal.SIGTERM, signal.SIGHUP)
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {sig: signal.signal(sig, _raise_stop) for sig in handled}
    try:
        return proc.wait()
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class _Stop(Exception):
    """A termination signal arrived: stop the server and return."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signum)
