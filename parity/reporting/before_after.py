"""Before/after a fix: two results files side by side, comparison by comparison.

Both runs come judged from their arms (the command re-judges each file as it loads it, as `parity
verdict` does: stored comparisons and verdicts are ignored), then are paired by case id and comparison. What makes the two files not comparable
as-is (another model, another fixture image, another prompt, another tolerance, a case missing on
one side) is collected as notes that every renderer shows prominently: a "before" and "after" of
different experiments prove nothing about the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from parity.results import CaseResult, Comparison, RunResult, Verdict
from parity.judge.metrics import tuple_text
from parity.reporting.report import check_label
from parity.reporting.text import visible
from parity.judge.verdict import ERROR, PASS, Check, Group, checks_for, judged

# Config keys whose difference changes what the comparisons mean. logprob_tol changes `match`;
# max_new_tokens and dtype change the arms' answers themselves.
COMPARED_CONFIG = ("model", "backend", "dtype", "max_new_tokens", "logprob_tol")
MISSING = "—"


@dataclass(frozen=True)
class Row:
    """One comparison of one case, before and after; None where it could not be computed there."""

    case_id: str
    label: str  # `bcg_normal vs eager_normal`, with its request in a sequence
    expect_match: bool
    before: Comparison | None
    after: Comparison | None


@dataclass(frozen=True)
class CaseChange:
    case_id: str
    before: Verdict | None  # None: the case is absent from that file
    after: Verdict | None


@dataclass(frozen=True)
class BeforeAfter:
    rows: tuple[Row, ...]
    cases: tuple[CaseChange, ...]
    before_verdict: Verdict
    after_verdict: Verdict
    notes: tuple[str, ...]  # why the two files may not be comparable; empty when they are
    before_tol: float = 0.25
    after_tol: float = 0.25

    @property
    def comparable(self) -> bool:
        return not self.notes


def compare_runs(before: RunResult, after: RunResult) -> BeforeAfter:
    before, after = judged(before), judged(after)
    b_cases = {c.id: c for c in before.cases}
    a_cases = {c.id: c for c in after.cases}
    # Before's order first (the reader knows that file), then cases only the after file has.
    ids = [c.id for c in before.cases] + [c.id for c in after.cases if c.id not in b_cases]
    rows = tuple(row for cid in ids for row in _rows(cid, b_cases.get(cid), a_cases.get(cid)))
    changes = tuple(CaseChange(cid, _verdict(b_cases.get(cid)), _verdict(a_cases.get(cid))) for cid in ids)
    notes = _config_notes(before, after) + _case_notes(ids, b_cases, a_cases)
    return BeforeAfter(rows, changes, before.verdict, after.verdict, notes, before.logprob_tol, after.logprob_tol)


def _verdict(case: CaseResult | None) -> Verdict | None:
    return None if case is None else case.verdict


def _rows(case_id: str, before: CaseResult | None, after: CaseResult | None) -> list[Row]:
    return [Row(case_id, check_label(g, c), c.expect_match, _comparison(before, g, c), _comparison(after, g, c))
            for g, c in checks_for(after or before)]


def _comparison(case: CaseResult | None, group: Group, check: Check) -> Comparison | None:
    return None if case is None else case.comparison(check.a, check.b, group.request)


def _config_notes(before: RunResult, after: RunResult) -> tuple[str, ...]:
    notes = []
    for key in COMPARED_CONFIG:
        b, a = _config_value(before, key), _config_value(after, key)
        if b != a:
            notes.append(f"different {key}: before {b!r}, after {a!r}")
    return tuple(notes)


def _config_value(run: RunResult, key: str) -> Any:
    # The tolerance is validated as a number; compare it as one so 0.25 and 0.250 agree.
    return run.logprob_tol if key == "logprob_tol" else run.config.get(key)


def _case_notes(ids: list[str], before: dict[str, CaseResult], after: dict[str, CaseResult]) -> tuple[str, ...]:
    notes = []
    for cid in ids:
        b, a = before.get(cid), after.get(cid)
        if b is None or a is None:
            notes.append(f"case {cid} is only in the {'after' if b is None else 'before'} file")
            continue
        if b.fixture != a.fixture:
            notes.append(f"case {cid}: different fixture: before {_fixture_text(b)}, after {_fixture_text(a)}")
        if b.prompt != a.prompt:
            notes.append(f"case {cid}: different prompt: before {b.prompt!r}, after {a.prompt!r}")
        if b.scenario != a.scenario:
            notes.append(f"case {cid}: different scenario: before {b.scenario}, after {a.scenario}")
    return tuple(notes)


def _fixture_text(case: CaseResult) -> str:
    return "none" if case.fixture is None else f"{case.fixture.name} ({case.fixture.sha256[:12]})"


# --- rendering -----------------------------------------------------------------------------------

def cell(comparison: Comparison | None, expect_match: bool, tol: float) -> str:
    """`(15, True, 0.071)`, with a ✗ when the result is not what a correct runtime gives."""
    if comparison is None:
        return MISSING
    return tuple_text(comparison, tol) + ("" if comparison.match == expect_match else " ✗")


def _expected(expect_match: bool) -> str:
    return "match" if expect_match else "differ"


def _code(verdict: Verdict | None) -> str:
    return "absent" if verdict is None else verdict.code


def _md_escape(text: str) -> str:
    # A pipe would end the table cell; a newline (shown as `\n` by visible) would end the row.
    return visible(text).replace("\\", "\\\\").replace("|", "\\|")


def render_markdown(ba: BeforeAfter) -> str:
    lines = ["| case | comparison | expected | before fix | after fix |", "|---|---|---|---|---|"]
    lines += [f"| {_md_escape(r.case_id)} | {r.label} | {_expected(r.expect_match)} | "
              f"{cell(r.before, r.expect_match, ba.before_tol)} | {cell(r.after, r.expect_match, ba.after_tol)} |" for r in ba.rows]
    lines += ["", f"**Verdict — before: {ba.before_verdict.code} → after: {ba.after_verdict.code}**", ""]
    # Right under the verdict, before any detail: a reader must not take the arrow at face value.
    lines += _markdown_notes(ba.notes)
    if len(ba.cases) > 1:
        lines += [f"- {_md_escape(c.case_id)}: {_code(c.before)} → {_code(c.after)}" for c in ba.cases] + [""]
    lines += [f"after: {_md_escape(ba.after_verdict.reason)}", "",
              "✗ marks a comparison whose result is not what a correct runtime gives; "
              f"{MISSING} marks one that could not be computed (arm missing or failed)."]
    return "\n".join(lines) + "\n"


def _markdown_notes(notes: tuple[str, ...]) -> list[str]:
    if not notes:
        return []
    # GitHub renders "[!WARNING]" as a warning box; elsewhere it is still a bold quoted block.
    return (["> [!WARNING]", "> **These two files are not the same experiment; "
             "the before/after difference may not be the fix's doing:**"]
            + [f"> - {_md_escape(note)}" for note in notes] + [""])


def render_table(ba: BeforeAfter, console: Console) -> None:
    table = Table(title="parity: before / after")
    for name in ("case", "comparison", "expected", "before fix", "after fix"):
        table.add_column(name)
    for r in ba.rows:
        # Text, not str: rich would read brackets in a case id as markup.
        table.add_row(Text(visible(r.case_id)), r.label, _expected(r.expect_match),
                      _styled(r.before, r.expect_match, ba.before_tol), _styled(r.after, r.expect_match, ba.after_tol))
    console.print(table)
    console.print(Text.assemble("before: ", _verdict_text(ba.before_verdict), " → after: ",
                                _verdict_text(ba.after_verdict)))
    if len(ba.cases) > 1:
        for c in ba.cases:
            console.print(Text(visible(f"  {c.case_id}: {_code(c.before)} → {_code(c.after)}")))
    for note in ba.notes:
        console.print(Text(visible(f"WARNING: {note}"), style="bold yellow"))


def _styled(comparison: Comparison | None, expect_match: bool, tol: float) -> Text:
    if comparison is None:
        return Text(MISSING, style="dim")
    return Text(cell(comparison, expect_match, tol), style="green" if comparison.match == expect_match else "red")


def _verdict_text(verdict: Verdict) -> Text:
    if verdict.code == PASS:
        return Text(verdict.code, style="bold green")
    # Same classes as the overall verdict (design §3): broken or wrong is red, unproven is yellow.
    failed = verdict.code == ERROR or verdict.code.startswith("FAIL_")
    return Text(verdict.code, style="bold red" if failed else "bold yellow")
