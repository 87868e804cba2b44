"""Terminal rendering of typed results (rich). No analysis happens here."""

from __future__ import annotations

import datetime as _dt
from typing import TYPE_CHECKING

from rich.markup import escape

if TYPE_CHECKING:
    from rich.console import Console

    from rca.demo import DemoReport
    from rca.engine import Diagnosis

__all__ = ["chain_text", "print_diagnosis", "print_demo"]


def _ts(ns: int) -> str:
    return _dt.datetime.fromtimestamp(ns / 1e9, _dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def chain_text(chain: list[str], observed: list[str]) -> str:
    """`A -> B -> C`, with codes that have no evidence row in brackets (inferred)."""
    seen = set(observed)
    return " -> ".join(c if c in seen else f"[{c}]" for c in chain)


def print_diagnosis(
    console: Console, diag: Diagnosis, *, evidence: bool = True, top: int | None = None
) -> None:
    head = f"[bold]trace[/bold] {diag.trace_id}" if diag.trace_id else "[bold]postmortem[/bold]"
    console.print(
        f"{head}  [bold]symptom[/bold] {diag.symptom}  "
        f"[dim]({diag.evidence_rows} evidence rows considered)[/dim]"
    )
    if not diag.causes:
        console.print("  no candidate root cause: no evidence connects to the symptom")
        _print_unclassified(console, diag)
        return
    for c in diag.causes[:top]:
        style = "bold red" if c.rank == 1 else "bold"
        console.print(
            f"  [{style}]#{c.rank} {c.code}[/{style}]  {c.family}, layer {c.layer}, "
            f"score {c.score:.2f}"
        )
        console.print(f"     chain:  {escape(chain_text(c.chain, c.observed))}")
        if c.rank == 1:
            console.print(f"     action: {escape(c.action)}")
    if evidence and diag.evidence:
        top_cause = diag.causes[0]
        wanted = set(top_cause.evidence)
        console.print(f"  [bold]evidence for #1[/bold] ({len(wanted)} rows):")
        for r in sorted(diag.evidence, key=lambda r: r["ts"]):
            if r["event_id"] in wanted:
                msg = escape((r.get("message") or "").strip()[:120])
                where = (
                    f"{r['file']}:{r['line']}"
                    if r.get("file")
                    else f"{_ts(r['ts'])}  {r['source']}"
                )
                console.print(f"     {where}  {r['code']:<28} {msg}  [dim]{r['event_id']}[/dim]")
                if r.get("raised_at"):
                    pad = " " * len(where)
                    console.print(f"     {pad}  [dim]raised at {escape(str(r['raised_at']))}[/dim]")
    for note in diag.notes:
        console.print(f"  [bold]note[/bold]: {escape(note)}")
    shown = diag.causes[:top]
    if any(code not in set(c.observed) for c in shown for code in c.chain):
        console.print("  [dim]\\[CODE] = inferred link with no evidence row[/dim]")
    _print_unclassified(console, diag)


def _print_unclassified(console: Console, diag: Diagnosis, limit: int = 10) -> None:
    """Lines that read like faults but that no code names: not in the ranking,
    listed so that an error the classifier does not know is still seen."""
    if not diag.unclassified_count:
        return
    console.print(
        f"  [bold]could not name[/bold] {diag.unclassified_count} line(s) that read like "
        "faults (not evidence; the model's guess, below its threshold, in brackets):"
    )
    shown = diag.unclassified[:limit]
    for u in shown:
        hint = f"[{u['family_hint']}? {u['p']:.2f}]" if u.get("family_hint") else "[?]"
        text = escape(str(u.get("text", "")).strip()[:120])
        console.print(f"     {u['file']}:{u['line']}  {escape(hint):<28} {text}")
        if u.get("raised_at"):
            console.print(f"     [dim]{'':<28}   raised at {escape(str(u['raised_at']))}[/dim]")
    if diag.unclassified_count > len(shown):
        console.print(f"     [dim]... {diag.unclassified_count - len(shown)} more[/dim]")
    console.print("  [dim]teach one: rca label FILE:LINE --code CODE[/dim]")


def print_demo(console: Console, report: DemoReport) -> None:
    console.print(f"[bold]demo[/bold]: {escape(report.description)}")
    console.print(
        ", ".join(f"{k} {v}" for k, v in report.counts.items()) + f"  (store: {report.db})"
    )
    console.print(
        "requests by status: " + ", ".join(f"{k}: {v}" for k, v in sorted(report.requests.items()))
    )
    for inc in report.incidents:
        console.print()
        injected = report.expected.get(inc.trace_id or "")
        if injected:
            top = inc.causes[0].code if inc.causes else None
            mark = "[green]right[/green]" if top == injected else "[red]wrong[/red]"
            console.print(f"[bold]injected[/bold]: {injected}  (ranked first: {mark})")
        print_diagnosis(console, inc, evidence=False, top=3)
    console.print()
    console.print("[bold]next[/bold]:")
    for cmd in report.next_commands:
        console.print(f"  {cmd}")
