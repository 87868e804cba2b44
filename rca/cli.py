"""The `rca` command line: a thin layer over library functions.

Every command calls one library function and renders its typed result as a
table or as JSON. Errors from the library (:class:`graph.errors.RcaError`)
become one line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

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
) -> None:
    """Load the bundled example incident into the store and answer it."""
    from rca.demo import run_demo
    from rca.render import print_demo

    report = run_demo(db=db)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_demo(_console(), report)


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
        )
    t = report.totals()
    typer.echo(
        f"total: read {t['read']}, normalized {t['normalized']}, "
        f"quarantined {t['quarantined']} -> {store.path}"
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
    threshold: Annotated[float, typer.Option(help="Fallback confidence threshold.")] = 0.6,
    as_json: JsonOpt = False,
    show_misses: Annotated[bool, typer.Option(help="List the lines it got wrong.")] = False,
) -> None:
    """Family accuracy, false alarms and postmortem answers on a real labelled corpus."""
    from ingest.corpus import CORPUS_DIR
    from rca.bench.corpus import evaluate_corpus

    res = evaluate_corpus(corpus or CORPUS_DIR, crashlogs, folds=folds, threshold=threshold)
    _print_figures(res, as_json, {"per_family", "misses", "flagged_benign", "crashlog_answers"})
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


@bench_app.command("probes")
def bench_probes(
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    reps: Annotated[int, typer.Option(help="Repetitions per mode.")] = 9,
    as_json: JsonOpt = False,
) -> None:
    """Probe overhead on a fixed Llama-style decoder: each tier's time vs checks off."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:  # torch is an optional extra
        raise RcaError("rca bench probes needs torch: pip install -e '.[torch]'")
    from rca.bench.probes import run_probe_bench

    res = run_probe_bench(device=device, reps=reps)
    _print_figures(res, as_json)


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
