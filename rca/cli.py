"""The `rca` command line: a thin layer over library functions.

Every command calls one library function and renders its typed result as a
table or as JSON. Errors from the library (:class:`graph.errors.RcaError`)
become one line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from graph.errors import RcaError

app = typer.Typer(
    help="Root-cause analysis for LLM serving: from GPU Xid to HTTP 500, with evidence.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks that print figures.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
probe_app = typer.Typer(help="Run a probe on this machine.", no_args_is_help=True)
app.add_typer(probe_app, name="probe")
lab_app = typer.Typer(
    help="The fault-injection lab (a small serving stack on CPU).", no_args_is_help=True
)
app.add_typer(lab_app, name="lab")

DbOpt = Annotated[
    Path | None,
    typer.Option("--db", help="DuckDB store (default: $RCA_DB or ~/.local/share/rca/rca.duckdb)"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def _console():  # type: ignore[no-untyped-def]
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


@app.command()
def query(
    trace_id: Annotated[str, typer.Option("--trace-id", "-t", help="W3C trace id (32 hex).")],
    db: DbOpt = None,
    as_json: JsonOpt = False,
    window: Annotated[float, typer.Option(help="Seconds of context before the symptom.")] = 300.0,
    top: Annotated[int, typer.Option(help="How many causes to show.")] = 5,
) -> None:
    """Rank the root causes of one failed request, with chains and evidence."""
    from rca.query import diagnose_trace
    from rca.render import print_diagnosis

    diag = diagnose_trace(trace_id, db=db, window_s=window, top=top)
    if as_json:
        typer.echo(diag.to_json())
    else:
        print_diagnosis(_console(), diag)


@app.command()
def codes(
    layer: Annotated[int | None, typer.Option(help="Only this layer (1-7).")] = None,
    family: Annotated[str | None, typer.Option(help="Only this family.")] = None,
    as_json: JsonOpt = False,
    catalog: Annotated[
        Path | None, typer.Option(help="Validate and list another catalog file.")
    ] = None,
) -> None:
    """List the error-code catalog (validated on load)."""
    from graph.catalog import FAMILIES, LAYER_NAMES, load_catalog

    if layer is not None and layer not in LAYER_NAMES:
        raise RcaError(f"--layer must be 1..7, not {layer}")
    if family is not None and family not in FAMILIES:
        raise RcaError(f"unknown family {family!r}; one of: {', '.join(FAMILIES)}")
    cat = load_catalog(catalog)
    sel = cat.select(layer=layer, family=family)
    if as_json:
        typer.echo(json.dumps([c.to_dict() for c in sel], indent=2))
        return
    from rich.table import Table

    t = Table(title=f"{len(sel)} of {len(cat)} codes", show_lines=False)
    for col in ("id", "code", "layer", "family", "stage", "recoverability", "causes"):
        t.add_column(col)
    for c in sel:
        t.add_row(
            str(c.id),
            c.name,
            str(c.layer),
            c.family,
            str(c.stage),
            str(c.recoverability),
            ", ".join(e.code for e in c.causes),
        )
    _console().print(t)


@app.command()
def load(
    db: DbOpt = None,
    spool: Annotated[
        Path | None, typer.Option(help="Spool folder (default beside the DB).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Move finished spool segments into the store (idempotent)."""
    from ingest.paths import default_db_path, spool_dir_for
    from ingest.spool import load_spool
    from ingest.store import Store

    store = Store(db or default_db_path())
    rep = load_spool(store, spool or spool_dir_for(store.path))
    out = {
        "segments": rep.segments,
        "rows": rep.rows,
        "quarantined": rep.quarantined,
        "deleted_segments": rep.deleted,
        "db": str(store.path),
    }
    if as_json:
        typer.echo(json.dumps(out))
    else:
        typer.echo(
            f"loaded {rep.total_rows} rows ({rep.rows['error_context']} records, "
            f"{rep.rows['spans']} spans) from {rep.segments} segment(s) into {store.path}; "
            f"quarantined {rep.quarantined}"
        )


@app.command()
def traces(
    db: DbOpt = None,
    limit: Annotated[int, typer.Option(help="How many.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """List recent failed requests (server spans with an HTTP error), newest first."""
    from ingest.queries import recent_traces
    from rca.query import open_store

    with open_store(db).read() as con:
        rows = recent_traces(con, limit=limit)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    if not rows:
        typer.echo("no failed requests in the store")
    for r in rows:
        typer.echo(
            f"{r['trace_id']}  {r['http_status'] or r['status_code']}  {r['name']}  "
            f"host={r['host']}"
        )


@app.command()
def demo(
    db: DbOpt = None,
    as_json: JsonOpt = False,
    quick: Annotated[bool, typer.Option("--quick", help="Three replicas instead of six.")] = False,
    seed: Annotated[int | None, typer.Option("--seed", help="Repeatable run.")] = None,
    example: Annotated[
        str | None,
        typer.Option("--example", help="Load a bundled example instead of the lab (xid48_ecc)."),
    ] = None,
) -> None:
    """Run the fault-injection lab with injected faults and answer every incident."""
    from rca.demo import run_demo, run_lab_demo
    from rca.render import print_demo

    if example is not None:
        report = run_demo(db=db, name=example)
    else:
        try:
            import probes.fake_nvml  # noqa: F401
            import rca.lab.runner  # noqa: F401  (torch, uvicorn, nvidia-ml-py)
        except ModuleNotFoundError as exc:
            raise RcaError(
                f"the lab needs {exc.name}: run `bash scripts/setup.sh` (the lab extra), "
                "or `rca demo --example xid48_ecc` for the bundled example"
            ) from None
        report = run_lab_demo(db=db, quick=quick, seed=seed, progress=_demo_progress(as_json))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_demo(_console(), report)


def _demo_progress(quiet: bool) -> Any:
    """A progress line on stderr while the lab runs (only on a terminal)."""
    if quiet or not sys.stderr.isatty():
        return None
    from rich.console import Console

    err = Console(stderr=True)

    def show(done: int, total: int, name: str) -> None:
        if done < total:
            err.print(f"[dim]lab replica {done + 1}/{total}: injecting {name}...[/dim]")

    return show


@app.command()
def normalize(
    files: Annotated[list[Path] | None, typer.Argument(help="Files (stdin when none).")] = None,
    no_model: Annotated[
        bool, typer.Option("--no-model", help="Patterns only, no learned fallback.")
    ] = False,
) -> None:
    """Print one JSON object per input line: its code, family, layer, fields."""
    from rca.normalize_cmd import normalize_streams

    normalize_streams(files or [], sys.stdout, fallback=not no_model)


@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Log, OTLP/JSON or Prometheus files.")],
    db: DbOpt = None,
    fmt: Annotated[
        str, typer.Option("--format", help="auto | log | otlp-json | prometheus")
    ] = "auto",
    host: Annotated[str | None, typer.Option(help="Host name for lines that carry none.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Normalize files into the store (streamed, idempotent), printing counts."""
    from ingest.paths import default_db_path
    from ingest.pipeline import ingest_paths
    from ingest.store import Store

    store = Store(db or default_db_path())
    with _progress(not as_json) as progress:
        report = ingest_paths(store, [str(p) for p in paths], fmt=fmt, host=host, progress=progress)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "db": str(store.path),
                    "files": [f.to_dict() for f in report.files],
                    **report.totals(),
                }
            )
        )
        return
    for f in report.files:
        if f.skipped:
            typer.echo(f"{f.path}: already ingested, nothing added")
            continue
        typer.echo(
            f"{f.path} [{f.format}]: read {f.read}, normalized {f.normalized} "
            f"(records {f.records}, spans {f.spans}, metric samples {f.metrics}), "
            f"quarantined {f.quarantined}"
            + (f", read like faults but unnamed {f.unclassified}" if f.unclassified else "")
        )
    t = report.totals()
    typer.echo(
        f"total: read {t['read']}, normalized {t['normalized']}, "
        f"quarantined {t['quarantined']} -> {store.path}"
    )
    if t["unclassified"]:
        typer.echo(
            f"{t['unclassified']} line(s) read like faults but no code names them (not stored;"
            " `rca diagnose FILE` lists them)"
        )


@app.command()
def collect(
    port: Annotated[int, typer.Option(help="TCP port (OTLP/HTTP's default is 4318).")] = 4318,
    host: Annotated[str, typer.Option(help="Address to bind (localhost by default).")] = (
        "127.0.0.1"
    ),
    db: DbOpt = None,
    spool: Annotated[
        Path | None, typer.Option(help="Spool folder (default beside the DB).")
    ] = None,
    max_body_bytes: Annotated[int, typer.Option(help="Largest accepted request body.")] = 16 << 20,
) -> None:
    """Receive OTLP/HTTP traces and logs (protobuf or JSON) into the spool until Ctrl-C."""
    from ingest.collect import main as collect_main
    from ingest.paths import default_db_path, spool_dir_for

    target = spool or spool_dir_for(db or default_db_path())
    code = collect_main(
        [
            "--host",
            host,
            "--port",
            str(port),
            "--spool",
            str(target),
            "--max-body-bytes",
            str(max_body_bytes),
        ]
    )
    raise typer.Exit(code)


@app.command()
def repro(
    event_id: Annotated[str, typer.Argument(help="The failed check's event id.")],
    db: DbOpt = None,
    out: Annotated[Path | None, typer.Option(help="Script path (default repro_<id>.py).")] = None,
) -> None:
    """Write a standalone script that rebuilds a failed op check's input and re-runs it."""
    from rca.repro import write_repro

    path = write_repro(event_id, db=db, out=out)
    typer.echo(f"wrote {path}: run it with `python {path}` (exit 1 = the failure reproduces)")


@probe_app.command("nvml")
def probe_nvml(
    once: Annotated[
        bool, typer.Option("--once", help="One poll, printed; nothing written.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between polls.")] = 1.0,
    db: DbOpt = None,
    spool: Annotated[
        Path | None, typer.Option(help="Spool folder (default beside the DB).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Poll NVML (Xid events, ECC, row remaps, throttling, PCIe/NVLink errors) until Ctrl-C."""
    from probes.nvml import run_cli

    raise typer.Exit(run_cli(once=once, interval=interval, db=db, spool=spool, as_json=as_json))


@lab_app.command("serve")
def lab_serve(
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="Where engine.log, kern.log and the spool go."),
    ] = None,
    spec_k: Annotated[int, typer.Option(help="Speculative tokens per step (0: off).")] = 0,
) -> None:
    """Serve the lab engine over HTTP (OpenAI-style /v1/completions, /metrics, /health)."""
    import socket

    from rca.lab.engine import LabEngine
    from rca.lab.model import LabConfig
    from rca.lab.server import serve

    where = run_dir or Path("lab-run")
    engine = LabEngine(LabConfig(spec_k=spec_k), where, host=socket.gethostname())
    if not engine.loaded:
        raise RcaError(f"the lab engine failed to load: {engine.load_error}")
    typer.echo(f"lab: serving on http://{host}:{port} (logs and spool in {where})")
    serve(engine, host=host, port=port)


@app.command()
def dashboard(
    db: DbOpt = None,
    port: Annotated[int, typer.Option(help="TCP port on 127.0.0.1.")] = 8501,
    no_browser: Annotated[
        bool, typer.Option("--no-browser", help="Do not open a browser tab.")
    ] = False,
) -> None:
    """Start the Streamlit dashboard (read-only) on localhost and print its URL."""
    from app.launch import run_dashboard

    raise typer.Exit(run_dashboard(db, port=port, open_browser=not no_browser, echo=typer.echo))


@app.command()
def diagnose(
    paths: Annotated[list[Path], typer.Argument(help="Crash logs or a bundle of files.")],
    db: Annotated[
        Path | None, typer.Option("--db", help="Keep the evidence in this store (default: temp).")
    ] = None,
    fmt: Annotated[
        str, typer.Option("--format", help="auto | log | otlp-json | prometheus")
    ] = "auto",
    top: Annotated[int, typer.Option(help="How many causes to show.")] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Postmortem: rank the root causes shown by files with no trace id."""
    from rca.diagnose import diagnose_paths, diagnosis_dict
    from rca.render import print_diagnosis

    diag, _ = diagnose_paths([str(p) for p in paths], db=db, fmt=fmt, top=top)
    if as_json:
        typer.echo(json.dumps(diagnosis_dict(diag), indent=2))
    else:
        print_diagnosis(_console(), diag)


@app.command()
def label(
    where: Annotated[
        str | None, typer.Argument(help="FILE:LINE of the line to label (as diagnose lists it).")
    ] = None,
    code: Annotated[str | None, typer.Option(help="The catalog code it is (`rca codes`).")] = None,
    text: Annotated[str | None, typer.Option(help="The line itself, instead of FILE:LINE.")] = None,
    list_: Annotated[bool, typer.Option("--list", help="Show your labelled lines.")] = False,
    remove: Annotated[int | None, typer.Option(help="Drop label N (from --list).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Teach the classifier a line it could not name (kept in $RCA_HOME/labels.jsonl)."""
    from graph.catalog import default_catalog
    from ingest.labels import add_label, labels_path, line_of, load_labels, remove_label

    cat = default_catalog()
    if list_ or (where is None and text is None and remove is None and code is None):
        found = load_labels(cat)
        if as_json:
            typer.echo(json.dumps({"path": str(labels_path()), **found.__dict__}))
            return
        typer.echo(f"{len(found.labels)} labelled line(s) in {labels_path()}")
        for n, lab in enumerate(found.labels, 1):
            typer.echo(f"{n:>4}  {lab['code']:<32} {lab['text'][:100]}")
        if found.skipped:
            typer.echo(f"{found.skipped} line(s) of that file unusable (kept as they are)")
        return
    if remove is not None:
        gone = remove_label(cat, remove)
        typer.echo(json.dumps(gone) if as_json else f"removed: {gone['code']} {gone['text'][:100]}")
        return
    if code is None:
        raise RcaError("--code is required to label a line (`rca codes` lists them)")
    if (where is None) == (text is None):
        raise RcaError("give the line to label: FILE:LINE or --text (one of them)")
    line, origin = line_of(where) if where is not None else (str(text), None)
    lab = add_label(cat, line, code, origin=origin)
    if as_json:
        typer.echo(json.dumps(lab))
    else:
        typer.echo(f"labelled {lab['code']} ({lab['family']}): {lab['text'][:100]}")


def _progress(enabled: bool):  # type: ignore[no-untyped-def]
    """A rich progress bar on a terminal (stderr), else nothing."""
    import contextlib

    if not (enabled and sys.stderr.isatty()):
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    @contextlib.contextmanager
    def bar():  # type: ignore[no-untyped-def]
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            transient=True,
        ) as prog:
            task = prog.add_task("ingesting", total=None)

            def update(done: int, total: int) -> None:
                prog.update(task, completed=done, total=total)

            yield update

    return bar()


def _print_figures(res: dict, as_json: bool, skip: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """A benchmark's figures: one JSON object, or `name: value` lines."""
    if as_json:
        typer.echo(json.dumps(res))
        return
    width = max(len(k) for k in res)
    for k, v in res.items():
        if k not in skip:
            typer.echo(f"{k:>{width}}: {v}")


@bench_app.command("query")
def bench_query(
    rows: Annotated[int, typer.Option(help="Records to fill the store with.")] = 10_000_000,
    queries: Annotated[int, typer.Option(help="In-process queries to time.")] = 200,
    db: Annotated[Path | None, typer.Option(help="Store to fill (default: a temp file).")] = None,
    keep: Annotated[bool, typer.Option(help="Keep the filled store.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Fill a store with N realistic records, then time `rca query`."""
    from rca.bench.query import run_query_bench

    res = run_query_bench(rows=rows, queries=queries, db=db, keep=keep, progress=not as_json)
    _print_figures(res, as_json)


@bench_app.command("ingest")
def bench_ingest(
    lines: Annotated[int, typer.Option(help="Mixed server lines to build.")] = 1_000_000,
    load_rows: Annotated[int, typer.Option(help="Records to load.")] = 1_000_000,
    drain3_lines: Annotated[int, typer.Option(help="Lines to time Drain3 on.")] = 200_000,
    as_json: JsonOpt = False,
) -> None:
    """Normalize and load figures, beside Drain3 and a raw DuckDB Arrow insert."""
    from rca.bench.ingest import run_ingest_bench

    res = run_ingest_bench(
        lines=lines, load_rows=load_rows, drain3_lines=drain3_lines, progress=not as_json
    )
    _print_figures(res, as_json)


@bench_app.command("corpus")
def bench_corpus(
    corpus: Annotated[
        Path | None, typer.Option(help="Corpus folder (default: the shipped one).")
    ] = None,
    crashlogs: Annotated[Path, typer.Option(help="Crash logs with expected.json.")] = Path(
        "tests/fixtures/real/crashlogs"
    ),
    folds: Annotated[
        int, typer.Option(help="Cross-validation folds; 0 scores a held-out corpus as shipped.")
    ] = 5,
    threshold: Annotated[
        float | None,
        typer.Option(help="Fallback confidence threshold (default: the classifier's, 0.55)."),
    ] = None,
    as_json: JsonOpt = False,
    show_misses: Annotated[bool, typer.Option(help="List the lines it got wrong.")] = False,
    first_sight: Annotated[
        bool,
        typer.Option(
            help="Also score each set as if never seen: without its lines, the catalog "
            "examples that say what they say and the patterns written from them (~1 min)."
        ),
    ] = False,
) -> None:
    """Family accuracy, false alarms and postmortem answers on a real labelled corpus."""
    from ingest.corpus import CORPUS_DIR
    from rca.bench.corpus import evaluate_corpus

    res = evaluate_corpus(
        corpus or CORPUS_DIR, crashlogs, folds=folds, threshold=threshold, first_sight=first_sight
    )
    _print_figures(
        res,
        as_json,
        {
            "per_family",
            "misses",
            "flagged_benign",
            "crashlog_answers",
            "leave_one_set_out_misses",
            "leave_one_set_out_flagged",
            "simulated_first_sight_misses",
        },
    )
    if as_json:
        return
    for fam, c in res["per_family"].items():
        typer.echo(f"  {fam:<24} {dict(c)}")
    for name, a in res.get("crashlog_answers", {}).items():
        typer.echo(f"  {'ok ' if a['top1'] else 'MISS'} {name}: want {a['want']}, got {a['got']}")
    if show_misses:
        for m in res["misses"]:
            typer.echo(f"  miss want={m['want']} got={m['got']}: {m['text']}")
        for m in res["flagged_benign"]:
            typer.echo(f"  false alarm {m['code']}: {m['text']}")
        for m in res.get("leave_one_set_out_misses", []):
            typer.echo(f"  left-out {m['set']} miss want={m['want']} got={m['got']}: {m['text']}")
        for m in res.get("leave_one_set_out_flagged", []):
            typer.echo(f"  left-out false alarm {m['code']}: {m['text']}")
        for m in res.get("simulated_first_sight_misses", []):
            typer.echo(
                f"  first-sight {m['set']} miss want={m['want']} got={m['got']}: {m['text']}"
            )


@bench_app.command("probes")
def bench_probes(
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    reps: Annotated[int, typer.Option(help="Repetitions per mode.")] = 9,
    size: Annotated[
        str, typer.Option(help="small (4 layers, fp32) or 1b (Llama-3.2-1B's stack, bf16).")
    ] = "small",
    as_json: JsonOpt = False,
) -> None:
    """Probe overhead on a fixed Llama-style decoder: each tier's time vs checks off."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:  # torch is an optional extra
        raise RcaError("rca bench probes needs torch: pip install -e '.[torch]'")
    from rca.bench.probes import SHAPES, run_probe_bench

    if size not in SHAPES:
        raise RcaError(f"--size must be one of {', '.join(SHAPES)}, not {size!r}")
    res = run_probe_bench(device=device, reps=reps, size=size)
    _print_figures(res, as_json)


@bench_app.command("accuracy")
def bench_accuracy(
    incidents: Annotated[int, typer.Option(help="Lab incidents to generate.")] = 300,
    seed: Annotated[int, typer.Option(help="Seed for the scenarios and the split.")] = 0,
    split: Annotated[
        float, typer.Option(help="Fraction of incidents (per fault type) used for calibration.")
    ] = 0.5,
    timeout: Annotated[
        float, typer.Option(help="Seconds CIRCA may take per incident (0: no limit).")
    ] = 30.0,
    save_weights: Annotated[
        Path | None, typer.Option(help="Write the calibrated weights to this TOML/JSON file.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """AC@1/AC@3/Avg@5 of the ranking vs baselines (incl. RCAEval's) on lab incidents."""
    import contextlib

    from rca.bench.accuracy import print_accuracy, run_accuracy_bench

    with contextlib.ExitStack() as stack:
        progress = None
        if not as_json and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress

            prog = stack.enter_context(
                Progress(
                    "[progress.description]{task.description}",
                    BarColumn(),
                    MofNCompleteColumn(),
                    transient=True,
                    console=Console(stderr=True),
                )
            )
            tasks: dict[str, int] = {}

            def progress(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    tasks[stage] = prog.add_task(stage, total=total)
                prog.update(tasks[stage], completed=done, total=total)

        res = run_accuracy_bench(
            incidents, seed, split, progress=progress, rcaeval_timeout_s=timeout or None
        )
    if save_weights is not None:
        from rca.engine import Weights

        cal = res["calibration"]
        Weights.from_dict(res["weights"]).save(
            save_weights,
            comment=(
                f"rca bench accuracy --incidents {incidents} --seed {seed} --split {split}: "
                f"{cal['source']} on {cal['train']} training incidents, "
                f"held-out AC@1 {res['ours'].get('ac1')}"
            ),
        )
    if as_json:
        typer.echo(json.dumps(res))
    else:
        print_accuracy(_console(), res)


def main() -> None:
    try:
        app()
    except RcaError as exc:
        print(f"rca: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("rca: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
