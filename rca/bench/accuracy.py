"""`rca bench accuracy`: how often the ranking names the injected root cause.

Incidents come from the fault-injection lab (``rca.lab.runner.generate_incidents``):
each one is a failed trace with a known injected catalog code, the evidence the
ranking sees for it (:class:`rca.query.Gathered`) and the lab's metric time
series as the wide frame RCAEval expects. The incidents are split by fault type
into a training half, on which the weights are calibrated
(:mod:`rca.calibrate`), and a held-out half, on which every method is scored:

* ``ours``: :func:`rca.engine.rank_root_causes` with the calibrated weights;
* ``ours_hand``: the same with the hand-set weights;
* ``earliest``, ``most_severe``, ``pagerank``: :mod:`rca.bench.baselines`;
* ``baro``, ``nsigma``, ``circa``: RCAEval's methods (:mod:`rca.bench.rcaeval_adapter`).

All are scored by ``RCAEval.benchmark.evaluation.Evaluator`` (AC@1, AC@3,
Avg@5 over catalog codes; its coarse "service" level is the code's family,
which gives the family-level AC@1).
"""

from __future__ import annotations

import inspect
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graph.catalog import Catalog, default_catalog
from graph.errors import RcaError
from rca.bench.baselines import BASELINES
from rca.bench.rcaeval_adapter import (
    RCAEVAL_METHODS,
    RCAEVAL_SLOW,
    RCAEVAL_TIMEOUT_S,
    MethodOutcome,
    load_method,
    require_rcaeval,
    run_rcaeval,
)
from rca.engine import Weights

if TYPE_CHECKING:
    import pandas

    from rca.query import Gathered

__all__ = [
    "METHODS",
    "Incident",
    "MethodOutcome",
    "accuracy_report",
    "frame_from_series",
    "generate_lab_incidents",
    "print_accuracy",
    "run_accuracy_bench",
    "run_method",
    "score",
    "stratified_split",
]

#: Every method, in the order the table prints them.
METHODS = ("ours", "ours_hand", *BASELINES, *RCAEVAL_METHODS)
#: Progress callback: (stage, done, total).
Progress = Callable[[str, int, int], None]
LAB_MISSING = (
    "the fault-injection lab is missing (rca/lab/runner.py with generate_incidents); "
    "`rca bench accuracy` needs it to make incidents"
)


@dataclass
class Incident:
    """One labelled failure: what each method sees, and the injected truth."""

    incident_id: str
    fault: str  # fault type name
    family: str  # injected family (catalog family)
    code: str  # injected ground-truth catalog code
    gathered: Gathered  # what the ranking sees for the failed trace
    frame: pandas.DataFrame | None = None  # `time` (unix s) + `<component>_<signal>` columns
    inject_time: float | None = None  # unix seconds
    column_codes: dict[str, str] = field(default_factory=dict)  # column -> catalog code


def frame_from_series(
    series: Sequence[dict[str, Any]], *, drop: Sequence[str] = ("ts", "step")
) -> pandas.DataFrame:
    """The lab's per-step samples (``engine.series``) as RCAEval's wide frame.

    ``ts`` (ns) becomes ``time`` (unix seconds); ``step`` and non-numeric
    values are dropped; every other key is a ``<component>_<signal>`` column.
    """
    import pandas as pd

    df = pd.DataFrame(list(series))
    if "ts" not in df:
        raise RcaError("lab series samples need a 'ts' (ns) key")
    time_s = df["ts"].astype("float64") / 1e9
    df = df.drop(columns=[c for c in drop if c in df]).select_dtypes(include="number")
    df.insert(0, "time", time_s)
    return df.sort_values("time", kind="stable").reset_index(drop=True)


def stratified_split(
    incidents: Sequence[Incident], train_frac: float = 0.5, seed: int = 0
) -> tuple[list[Incident], list[Incident]]:
    """Split each fault type's incidents into train and held-out, seeded.

    A fault type with two or more incidents has at least one on each side.
    """
    if not 0.0 < train_frac < 1.0:
        raise RcaError(f"--split must be between 0 and 1 (exclusive), not {train_frac}")
    by: dict[str, list[Incident]] = defaultdict(list)
    for inc in incidents:
        by[inc.fault].append(inc)
    rng = random.Random(seed)
    train: list[Incident] = []
    test: list[Incident] = []
    for fault in sorted(by):
        group = sorted(by[fault], key=lambda i: i.incident_id)
        rng.shuffle(group)
        k = round(len(group) * train_frac)
        if len(group) >= 2:
            k = min(max(k, 1), len(group) - 1)
        train += group[:k]
        test += group[k:]
    return train, test


def run_method(
    name: str,
    inc: Incident,
    *,
    weights: Weights | None = None,
    catalog: Catalog | None = None,
    rcaeval: dict[str, Callable[..., Any]] | None = None,
    timeout_s: float | None = None,
) -> MethodOutcome:
    """One method's ranked codes for one incident; a crash is a failure, not an error."""
    from rca.query import rank_gathered

    cat = catalog or default_catalog()
    try:
        if name in ("ours", "ours_hand"):
            w = weights if name == "ours" else Weights()
            _, causes = rank_gathered(inc.gathered, catalog=cat, weights=w, top=sys.maxsize)
            return MethodOutcome([c.code for c in causes], n_candidates=len(causes))
        if name in BASELINES:
            ranks = BASELINES[name](inc.gathered, cat)
            return MethodOutcome(ranks, n_candidates=len(ranks))
        if name in RCAEVAL_METHODS:
            fn = (rcaeval or {}).get(name)
            return run_rcaeval(
                name,
                inc.frame,
                inc.inject_time,
                inc.column_codes,
                method=fn,
                timeout_s=timeout_s if name in RCAEVAL_SLOW else None,
            )
    except Exception as exc:
        return MethodOutcome([], failed=True, why=f"{type(exc).__name__}: {exc}")
    raise RcaError(f"unknown method {name!r}; one of: {', '.join(METHODS)}")


def _family(code: str, cat: Catalog) -> str:
    c = cat.get(code)
    return c.family if c else "?"


def score(
    outcomes: Sequence[MethodOutcome],
    answers: Sequence[str],
    catalog: Catalog | None = None,
) -> dict[str, Any]:
    """AC@1, AC@3, Avg@5 (RCAEval's Evaluator), family-level AC@1 and failures."""
    from RCAEval.benchmark.evaluation import Evaluator
    from RCAEval.classes.graph import Node

    cat = catalog or default_catalog()
    ev = Evaluator(max_k=5)
    for out, ans in zip(outcomes, answers, strict=True):
        ev.add_case(
            [Node(_family(c, cat), c) for c in out.ranks],
            Node(_family(ans, cat), ans),
            n_candidates=out.n_candidates,
        )
    n = ev.num
    return {
        "ac1": round(ev.accuracy(1), 4) if n else 0.0,
        "ac3": round(ev.accuracy(3), 4) if n else 0.0,
        "avg5": round(ev.average(5), 4) if n else 0.0,
        "family_ac1": round(ev.accuracy_service(1), 4) if n else 0.0,
        "failures": sum(1 for o in outcomes if o.failed),
        "n": n,
    }


def accuracy_report(
    incidents: Sequence[Incident],
    *,
    split: float = 0.5,
    seed: int = 0,
    start: Weights | None = None,
    methods: Sequence[str] = METHODS,
    progress: Progress | None = None,
    catalog: Catalog | None = None,
    rcaeval_timeout_s: float | None = RCAEVAL_TIMEOUT_S,
) -> dict[str, Any]:
    """Calibrate on the training split, score every method on the held-out split.

    CIRCA (the RCAEval method whose run time can blow up) gets
    ``rcaeval_timeout_s`` per incident in a forked process (None: no limit, in
    this process); past it the incident is one of its failures.
    """
    from rca.calibrate import calibrate

    cat = catalog or default_catalog()
    if not incidents:
        raise RcaError("no incidents to score")
    unknown = sorted({m for m in methods} - set(METHODS))
    if unknown:
        raise RcaError(f"unknown method(s) {', '.join(unknown)}; one of: {', '.join(METHODS)}")
    train, test = stratified_split(incidents, split, seed)
    if not test:
        raise RcaError("the held-out split is empty: use more incidents or a smaller --split")
    if progress:
        progress("calibrating", 0, 1)
    cal = calibrate(train, start=start, seed=seed, catalog=cat)
    if progress:
        progress("calibrating", 1, 1)
    rcaeval = {m: load_method(m) for m in methods if m in RCAEVAL_METHODS}
    outcomes: dict[str, list[MethodOutcome]] = {m: [] for m in methods}
    seconds = dict.fromkeys(methods, 0.0)
    total = len(test) * len(methods)
    done = 0
    for inc in test:
        for m in methods:
            t0 = time.perf_counter()
            outcomes[m].append(
                run_method(
                    m,
                    inc,
                    weights=cal.weights,
                    catalog=cat,
                    rcaeval=rcaeval,
                    timeout_s=rcaeval_timeout_s,
                )
            )
            seconds[m] += time.perf_counter() - t0
            done += 1
            if progress:
                progress("ranking", done, total)
    answers = [inc.code for inc in test]
    figures = {m: score(outcomes[m], answers, cat) for m in methods}
    for m in methods:
        figures[m]["seconds"] = round(seconds[m], 2)
    families = sorted({inc.family for inc in test})
    per_family: dict[str, Any] = {}
    for fam in families:
        idx = [i for i, inc in enumerate(test) if inc.family == fam]
        row: dict[str, Any] = {"n": len(idx)}
        for m in methods:
            s = score([outcomes[m][i] for i in idx], [answers[i] for i in idx], cat)
            row[m] = {"ac1": s["ac1"], "ac3": s["ac3"]}
        per_family[fam] = row
    baselines = {m: figures[m] for m in methods if m not in ("ours", "ours_hand")}
    best = max(baselines, key=lambda m: (baselines[m]["ac1"], baselines[m]["ac3"]), default=None)
    failures = {
        m: [
            {"incident": test[i].incident_id, "why": o.why}
            for i, o in enumerate(outcomes[m])
            if o.failed
        ][:5]
        for m in methods
    }
    misses = [
        {
            "incident": inc.incident_id,
            "fault": inc.fault,
            "want": inc.code,
            "got": outcomes["ours"][i].ranks[:3],
            "in_evidence": any(e.code == inc.code for e in inc.gathered.evidence),
        }
        for i, inc in enumerate(test)
        if "ours" in outcomes and inc.code not in outcomes["ours"][i].ranks[:1]
    ]
    return {
        "ours": figures.get("ours", {}),
        "ours_hand": figures.get("ours_hand", {}),
        "baselines": baselines,
        "best_baseline": best,
        "per_family": per_family,
        "incidents": len(incidents),
        "fault_types": len({inc.fault for inc in incidents}),
        "train": len(train),
        "held_out": len(test),
        "seed": seed,
        "split": split,
        "weights": cal.weights.to_dict(),
        "calibration": cal.to_dict(),
        "failure_examples": {m: f for m, f in failures.items() if f},
        "misses": misses,
    }


def generate_lab_incidents(n: int, seed: int, progress: Progress | None = None) -> list[Incident]:
    """Incidents from the lab's scenario runner; one clear error when the lab is missing."""
    try:
        from rca.lab.runner import generate_incidents
    except ModuleNotFoundError as exc:
        if exc.name in ("rca.lab", "rca.lab.runner"):
            raise RcaError(LAB_MISSING) from None
        raise RcaError(
            f"the fault-injection lab needs {exc.name}: pip install -e '.[torch,bench]'"
        ) from None
    except ImportError:
        raise RcaError(LAB_MISSING) from None
    kwargs: dict[str, Any] = {}
    if progress is not None and "progress" in inspect.signature(generate_incidents).parameters:
        kwargs["progress"] = lambda done, total: progress("incidents", done, total)
    return list(generate_incidents(n, seed, **kwargs))


def run_accuracy_bench(
    n: int = 300,
    seed: int = 0,
    split: float = 0.5,
    progress: Progress | None = None,
    rcaeval_timeout_s: float | None = RCAEVAL_TIMEOUT_S,
) -> dict[str, Any]:
    """Generate ``n`` lab incidents, calibrate on a split, score every method on the rest."""
    if n < 2:
        raise RcaError(f"--incidents must be at least 2, not {n}")
    require_rcaeval()
    incidents = generate_lab_incidents(n, seed, progress)
    res = accuracy_report(
        incidents,
        split=split,
        seed=seed,
        progress=progress,
        rcaeval_timeout_s=rcaeval_timeout_s,
    )
    # scenarios whose fault failed no request (nothing to rank) or that crashed
    from rca.lab.runner import generate_incidents

    dropped = list(getattr(generate_incidents, "last_dropped", []))
    res["scenarios"] = n
    res["dropped"] = dict(Counter(d.split(":")[0] for d in dropped))
    res["dropped_errors"] = [d for d in dropped if ": error: " in d][:10]
    return res


def print_accuracy(console: Any, res: dict[str, Any]) -> None:
    """The held-out figures as rich tables: methods, then per family."""
    from rich.table import Table

    cal = res["calibration"]
    t = Table(
        title=(
            f"root-cause accuracy on {res['held_out']} held-out incidents "
            f"({res['incidents']} generated over {res['fault_types']} fault types, "
            f"{res['train']} for calibration; weights: {cal['source']})"
        )
    )
    for col in ("method", "AC@1", "AC@3", "Avg@5", "family AC@1", "failures", "seconds"):
        t.add_column(col, justify="left" if col == "method" else "right")
    rows = {"ours": res["ours"], "ours_hand": res["ours_hand"], **res["baselines"]}
    for name, f in rows.items():
        if not f:
            continue
        label = {"ours": "ours (calibrated)", "ours_hand": "ours (hand-set)"}.get(name, name)
        t.add_row(
            label,
            f"{f['ac1']:.3f}",
            f"{f['ac3']:.3f}",
            f"{f['avg5']:.3f}",
            f"{f['family_ac1']:.3f}",
            str(f["failures"]),
            f"{f.get('seconds', 0.0):.1f}",
        )
    console.print(t)
    if res.get("dropped"):
        console.print(
            f"{sum(res['dropped'].values())} of {res.get('scenarios')} scenarios gave no "
            f"incident (their fault failed no request, or the run crashed): {res['dropped']}"
        )
    best = res.get("best_baseline")
    ft = Table(title=f"per family: ours vs the best baseline ({best})")
    for col in ("family", "n", "ours AC@1", "ours AC@3", f"{best} AC@1", f"{best} AC@3"):
        ft.add_column(col, justify="left" if col == "family" else "right", overflow="fold")
    for fam, row in res["per_family"].items():
        ours = row.get("ours", {})
        base = row.get(best, {}) if best else {}
        ft.add_row(
            fam,
            str(row["n"]),
            f"{ours.get('ac1', 0):.3f}",
            f"{ours.get('ac3', 0):.3f}",
            f"{base.get('ac1', 0):.3f}",
            f"{base.get('ac3', 0):.3f}",
        )
    console.print(ft)
    for m, fails in res.get("failure_examples", {}).items():
        n_failed = rows.get(m, {}).get("failures", len(fails))
        console.print(f"{m} failed on {n_failed} incident(s), e.g. {fails[0]['why']}")
