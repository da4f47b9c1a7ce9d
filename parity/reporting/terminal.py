"""The run as a terminal shows it: one table per case, the evidence per arm, the verdict.

Readable at 80 columns: columns fold rather than cut a verdict's tuple into an ellipsis, and every
string from outside parity (case ids, errors) goes through `terminal()`, so it shows as text and
never as rich markup or a control sequence.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from parity.judge.metrics import tuple_text
from parity.reporting.report import (
    absent_note, arm_evidence_text, arms_with_labels, check_label, held, localization_sentence, not_localized_note,
    placement, rows, run_notes,
)
from parity.reporting.text import terminal
from parity.results import CaseResult, RunResult
from parity.judge.verdict import PASS


def print_table(run: RunResult, console: Console) -> None:
    for case in held(run):
        console.print(_case_table(case, run.logprob_tol))
        for label, arm in arms_with_labels(case):
            if arm.error:
                error = terminal(arm.error, keep="\n")  # a server's log tail keeps its lines
                console.print(f"[red]{terminal(label)} failed:[/] {error}", highlight=False)
            else:
                console.print(f"  {terminal(label)}: {terminal(arm_evidence_text(arm))}", highlight=False)
        if case.localization is not None:
            console.print(f"  {terminal(localization_sentence(case))}", highlight=False)
        elif not_localized_note(case, run):
            console.print(f"  {terminal(not_localized_note(case, run))}", highlight=False)
    for note in [*run_notes(run), *filter(None, [absent_note(run)])]:
        console.print(f"[yellow]note:[/] {terminal(note)}", highlight=False)
    console.print(f"ran on: {terminal(placement(run))}", highlight=False)
    style = "green" if run.verdict.code == PASS else "red"
    console.print(f"[bold {style}]{run.verdict.code}[/]: {terminal(run.verdict.reason)}", highlight=False)


def _case_table(case: CaseResult, tol: float) -> Table:
    table = Table(title=f"{terminal(case.id)}  ·  {case.verdict.code}", title_justify="left")
    table.add_column("#")
    table.add_column("comparison", overflow="fold", ratio=3)
    table.add_column("(div char, token match, Δ logprob)", overflow="fold", ratio=2)
    table.add_column("expected", overflow="fold")
    table.add_column("ok")
    for i, (group, check, comp) in enumerate(rows(case), 1):
        ok = "—" if comp is None else ("[green]yes[/]" if check.expect_match == comp.match else "[red]NO[/]")
        table.add_row(str(i), terminal(check_label(group, check)),
                      terminal(tuple_text(comp, tol)) if comp else "not run",
                      "match" if check.expect_match else "differ", ok)
    return table
