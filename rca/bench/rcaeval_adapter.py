"""Run the RCAEval benchmark's own methods (BARO, NSigma, CIRCA) on a lab frame.

``rcaeval`` 1.8.1 is an optional dependency (the ``bench`` extra). Its methods
take a wide metric frame (a ``time`` column in unix seconds plus one
``<component>_<signal>`` column per series) and the inject time, and return
``{"ranks": [column, ...]}``. A method wrapped in RCAEval's ``@rca`` decorator
does not raise when it crashes: it prints ``<name> failed (...); returning the
unranked column order`` on stderr and returns the columns as they come. That is
no answer, so it counts as a failure here, as does any exception.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graph.errors import RcaError

__all__ = [
    "DATASET",
    "FALLBACK_RE",
    "RCAEVAL_METHODS",
    "RCAEVAL_SLOW",
    "RCAEVAL_TIMEOUT_S",
    "MethodOutcome",
    "load_method",
    "require_rcaeval",
    "run_rcaeval",
    "columns_to_codes",
    "independent_columns",
    "prepare_frame",
    "safe_names",
]

#: The methods compared, by the name the benchmark prints.
RCAEVAL_METHODS = ("baro", "nsigma", "circa")
#: Default limit on one method's run on one incident (CIRCA's PC step can take
#: minutes on a few dozen correlated series); past it the incident is a failure.
RCAEVAL_TIMEOUT_S = 30.0
#: Methods whose run time can blow up (they get the time limit; a forked
#: process each). BARO and NSigma are one pass over the columns: in-process.
RCAEVAL_SLOW = frozenset({"circa"})
#: Methods that need linearly independent series (PC with Fisher-z tests).
NEEDS_INDEPENDENT = frozenset({"circa"})
#: Passed as ``dataset``: any non-None value makes ``preprocess`` drop the
#: ``time`` column (with None, time itself is ranked as a metric).
DATASET = "rca-lab"
FALLBACK_RE = re.compile(r"failed \(.*?\); returning the unranked column order")
_INSTALL = "pip install -e '.[bench]'"


@dataclass
class MethodOutcome:
    """One method's answer for one incident: catalog codes, best first."""

    ranks: list[str]
    failed: bool = False
    why: str = ""
    n_candidates: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def require_rcaeval() -> None:
    """Raise a one-line RcaError when rcaeval or pandas is not installed."""
    import importlib.util

    for mod in ("pandas", "RCAEval"):
        if importlib.util.find_spec(mod) is None:
            raise RcaError(f"the accuracy benchmark needs rcaeval==1.8.1 and pandas: {_INSTALL}")


def load_method(name: str) -> Callable[..., dict[str, Any]]:
    """The RCAEval function for ``name``, imported from its own submodule."""
    require_rcaeval()
    if name == "baro":
        from RCAEval.e2e.baro import baro

        return baro
    if name == "nsigma":
        from RCAEval.e2e import nsigma

        return nsigma
    if name == "circa":
        from RCAEval.e2e.circa import circa

        return circa
    raise RcaError(f"unknown RCAEval method {name!r}; one of: {', '.join(RCAEVAL_METHODS)}")


def columns_to_codes(columns: list[str], column_codes: dict[str, str]) -> list[str]:
    """Ranked metric columns as ranked catalog codes (unmapped dropped, first kept)."""
    out: list[str] = []
    for col in columns:
        code = column_codes.get(col)
        if code and code not in out:
            out.append(code)
    return out


def safe_names(columns: list[str]) -> dict[str, str]:
    """Original column -> a name CIRCA can use (exactly one ``_``, entity then metric).

    CIRCA's RHT head splits each name on ``_`` and keeps parts 0 and 1 only, so
    ``kv_cache_usage`` would be lost and ``nan`` (no ``_``) would crash it.
    """
    out: dict[str, str] = {}
    used: set[str] = set()
    for col in columns:
        comp, _, sig = str(col).partition("_")
        comp = comp.replace("-", "") or "c"
        sig = sig.replace("_", "-") or "value"
        name = f"{comp}_{sig}"
        i = 1
        while name in used:
            name = f"{comp}{i}_{sig}"
            i += 1
        used.add(name)
        out[col] = name
    return out


def prepare_frame(
    frame: Any, inject_time: float, *, independent: bool = False
) -> tuple[Any, float, dict[str, str]]:
    """The frame as RCAEval expects it: numeric, finite, 1 s samples, safe names.

    RCAEval's data are sampled every second and CIRCA resamples to 1 s over the
    120 s before the inject time, so a frame sampled faster than that (the lab
    steps in milliseconds) is re-timed to one sample per second, keeping the
    order of samples and which side of the inject time each falls on. An
    infinite value becomes a large finite one of the same sign (it is the
    anomaly, not a gap); gaps are filled forward, then with 0. With
    ``independent`` only linearly independent series are kept (in column
    order): CIRCA's PC step (Fisher-z tests) stops on a singular correlation
    matrix, which exact copies such as ``kv_usage`` and ``kv_free_blocks`` make.
    Returns (frame, inject time, safe name -> original column).
    """
    import numpy as np

    df = frame.select_dtypes(include="number").copy()
    df = df.sort_values("time", kind="stable").reset_index(drop=True)
    t = df["time"].to_numpy(dtype=float)
    if len(t) > 1 and float(np.median(np.diff(t))) < 1.0:
        t0 = float(np.floor(t[0]))
        after = int(np.searchsorted(t, inject_time, side="left"))  # first sample at/after
        df["time"] = t0 + np.arange(len(t), dtype=float)
        inject_time = t0 + after - (0.5 if after > 0 else 0.0)
    cols = [c for c in df.columns if c != "time"]
    for c in cols:
        v = df[c].to_numpy(dtype=float)
        bad = np.isinf(v)
        if bad.any():
            finite = np.abs(v[np.isfinite(v)])
            big = 10.0 * (float(finite.max()) if finite.size else 1.0) + 1.0
            df[c] = np.where(bad, np.sign(v) * big, v)
    df[cols] = df[cols].ffill().fillna(0.0)
    if independent:
        cols = independent_columns(df, cols)
        df = df[["time", *cols]]
    names = safe_names(cols)
    df = df.rename(columns=names)
    return df, float(inject_time), {v: k for k, v in names.items()}


def independent_columns(df: Any, cols: list[str]) -> list[str]:
    """``cols`` minus constants and series that are linear combinations of earlier ones."""
    import numpy as np

    kept: list[str] = []
    basis = np.zeros((len(df), 0))
    for c in cols:
        v = df[c].to_numpy(dtype=float)
        sd = v.std()
        if not np.isfinite(sd) or sd == 0.0:
            continue
        trial = np.column_stack([basis, (v - v.mean()) / sd])
        if np.linalg.matrix_rank(trial, tol=1e-8 * max(trial.shape)) == trial.shape[1]:
            basis = trial
            kept.append(c)
    return kept


def _call(
    fn: Callable[..., dict[str, Any]], df: Any, t_inj: float, seed: int
) -> tuple[list[str], str, str]:
    """Run the method quietly: (ranked columns, captured stderr, error or "")."""
    import numpy as np

    err, out = io.StringIO(), io.StringIO()
    state = np.random.get_state()
    try:
        np.random.seed(seed)  # CIRCA picks a random SLI node
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            res = fn(df, inject_time=t_inj, dataset=DATASET)
        return [str(c) for c in (res or {}).get("ranks") or []], err.getvalue(), ""
    except Exception as exc:  # a crash of the method is its failure, not ours
        return [], err.getvalue(), f"{type(exc).__name__}: {exc}"
    finally:
        np.random.set_state(state)


def _call_forked(
    fn: Callable[..., dict[str, Any]], df: Any, t_inj: float, seed: int, timeout_s: float
) -> tuple[list[str], str, str]:
    """:func:`_call` in a forked child, killed after ``timeout_s`` (PC can take minutes)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send(_call(fn, df, t_inj, seed))
        finally:
            send.close()

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    try:
        if recv.poll(timeout_s):
            return recv.recv()
        return [], "", f"timed out after {timeout_s:g} s"
    except EOFError:
        return [], "", f"the method's process died (exit {proc.exitcode})"
    finally:
        recv.close()
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def run_rcaeval(
    name: str,
    frame: Any,
    inject_time: float | None,
    column_codes: dict[str, str],
    *,
    method: Callable[..., dict[str, Any]] | None = None,
    seed: int = 0,
    timeout_s: float | None = None,
) -> MethodOutcome:
    """Run one RCAEval method on one incident's frame; never raises for its crash.

    With ``timeout_s`` the method runs in a forked process that is killed
    when the time is up (counted as a failure).
    """
    if frame is None or inject_time is None or "time" not in getattr(frame, "columns", ()):
        return MethodOutcome([], failed=True, why="no metric frame or inject time")
    fn = method or load_method(name)
    try:
        df, t_inj, back = prepare_frame(
            frame, float(inject_time), independent=name in NEEDS_INDEPENDENT
        )
    except Exception as exc:
        return MethodOutcome([], failed=True, why=f"bad frame: {type(exc).__name__}: {exc}")
    before = int((df["time"] < t_inj).sum())
    if before < 2 or len(df) - before < 1:
        why = (
            f"{before} sample(s) before the inject time and {len(df) - before} from it: "
            "RCAEval needs both windows"
        )
        return MethodOutcome([], failed=True, why=why)
    if timeout_s and timeout_s > 0:
        ranked, err, crash = _call_forked(fn, df, t_inj, seed, timeout_s)
    else:
        ranked, err, crash = _call(fn, df, t_inj, seed)
    if crash:
        return MethodOutcome([], failed=True, why=crash)
    m = FALLBACK_RE.search(err)
    if m or "returning the unranked column order" in err:
        why = m.group(0) if m else err.strip().splitlines()[-1]
        return MethodOutcome([], failed=True, why=why)
    ranks = [back.get(c, c) for c in ranked]
    n_cols = sum(1 for c in frame.columns if c != "time")
    codes = columns_to_codes(ranks, column_codes)
    if not codes:
        why = (
            f"no ranked series maps to a code ({len(ranked)} ranked; "
            f"{before} sample(s) before the inject time, {len(df) - before} from it: "
            "RCAEval drops a series constant within either window)"
        )
        return MethodOutcome([], failed=True, why=why)
    n_codes = len({column_codes[c] for c in frame.columns if c in column_codes})
    return MethodOutcome(codes, n_candidates=n_codes or None, extra={"columns": n_cols})
