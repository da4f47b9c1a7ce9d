"""Rendering a `RunResult`: the PR-ready markdown report, the terminal table, and JSON."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from parity.reporting.ci_summary import MAX_COMMENT_CHARS, clip_text
from parity.results import CaseResult, RunResult, run_to_json
from parity.verdict import PASS, REPEAT_TOL, checks_for, self_delta

FORMATS = ("markdown", "json", "table")
_ARM_TEXT_LIMIT = 4000  # per arm in report.md; the whole report must fit a PR comment


def _ok(expect_match: bool, match: bool) -> bool:
    return expect_match == match


def _expectation(expect_match: bool) -> str:
    return "match" if expect_match else "differ"


def _rows(case: CaseResult):
    """(check, comparison or None) for every check of the case's scenario, in design order."""
    return [(check, case.comparison(check.a, check.b)) for check in checks_for(case.scenario)]


# --- markdown ----------------------------------------------------------------------------------

def render_markdown(run: RunResult) -> str:
    parts = [_md_header(run)]
    for case in run.cases:
        parts.append(_md_case(case, run))
    parts.append(_md_environment(run))
    text = "\n".join(parts)
    if len(text) > MAX_COMMENT_CHARS:  # drop arm texts wholesale rather than exceed a PR comment
        parts = [_md_header(run)] + [_md_case(c, run, with_texts=False) for c in run.cases] + [_md_environment(run)]
        text = "\n".join(parts) + "\n_Arm texts were left out to fit a PR comment; see results.json._\n"
    return clip_text(text, MAX_COMMENT_CHARS)


def _md_header(run: RunResult) -> str:
    icon = "✅" if run.verdict.code == PASS else "❌"
    return (
        f"## parity: {icon} `{run.verdict.code}`\n\n{run.verdict.reason}\n\n"
        f"Model `{run.config.get('model')}` · backend `{run.config.get('backend')}` · "
        f"{len(run.cases)} case(s) · tuples are `(divergence char, token match, logprob delta)`, "
        f"match = token match and delta ≤ {run.logprob_tol:g}\n"
    )


def _md_case(case: CaseResult, run: RunResult, with_texts: bool = True) -> str:
    lines = [
        f"### `{case.id}`: `{case.verdict.code}`\n",
        f"{case.verdict.reason}\n",
        f"Fixture `{case.fixture.name}` {case.fixture.size[0]}×{case.fixture.size[1]}, "
        f"sha256 `{case.fixture.sha256}` · prompt: {case.prompt!r}\n",
    ]
    if case.primer:
        lines.append(f"Ran first on the same model/server: {case.primer}\n")
    lines += ["| # | comparison | tuple | expected | ok |", "|---|---|---|---|---|"]
    for i, (check, comp) in enumerate(_rows(case), 1):
        tup = f"`{comp.tuple_text}`" if comp else "—"
        ok = "—" if comp is None else ("✅" if _ok(check.expect_match, comp.match) else "❌")
        lines.append(f"| {i} | `{check.a}` vs `{check.b}` ({check.meaning}) | {tup} | {_expectation(check.expect_match)} | {ok} |")
    lines.append("")
    if any(a.repeats for a in case.arms):
        lines += ["| arm | repeats | self-delta | tolerance | reproduces |", "|---|---|---|---|---|"]
        for arm in case.arms:
            same, worst = self_delta(arm)
            lines.append(f"| `{arm.name}` | {len(arm.repeats) + 1} | {worst:.3g} | {REPEAT_TOL:g} | {'✅' if same else '❌'} |")
        lines.append("")
    records = [(a.name, a.deepstack_record) for a in case.arms if a.deepstack_record]
    if records:
        lines += ["| arm | DeepStack seen at LM entry | non-zero rows | L2 norm | sha256 | handed on | replay |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in records:
            lines.append(f"| `{name}` | {list(r.shape)} {r.dtype} | {r.nonzero_rows} | {r.l2_norm:.4g} | "
                         f"`{r.sha256[:16]}…` | {r.action} | {'—' if r.replay is None else r.replay} |")
        lines.append("")
    if case.plot:
        lines.append(f"![|Δ logprob| per position]({case.plot})\n")
    if with_texts:
        for arm in case.arms:
            body = f"error: {arm.error}" if arm.error else clip_text(arm.text, _ARM_TEXT_LIMIT)
            lines.append(f"<details><summary><code>{arm.name}</code> ({len(arm.token_ids)} tokens, "
                         f"{arm.seconds:.2f} s)</summary>\n\n```text\n{body}\n```\n</details>\n")
    return "\n".join(lines)


def _md_environment(run: RunResult) -> str:
    env = " · ".join(f"{k} `{v}`" for k, v in run.environment.items())
    config = " · ".join(f"{k} `{v}`" for k, v in run.config.items())
    return f"<details><summary>Environment and config</summary>\n\n{env}\n\n{config}\n</details>\n"


# --- terminal ----------------------------------------------------------------------------------

def print_table(run: RunResult, console: Console) -> None:
    for case in run.cases:
        table = Table(title=f"{case.id}  ·  {case.verdict.code}", title_justify="left")
        for column in ("#", "comparison", "(div char, token match, Δ logprob)", "expected", "ok"):
            table.add_column(column)
        for i, (check, comp) in enumerate(_rows(case), 1):
            ok = "—" if comp is None else ("[green]yes[/]" if _ok(check.expect_match, comp.match) else "[red]NO[/]")
            table.add_row(str(i), f"{check.a} vs {check.b}", comp.tuple_text if comp else "not run",
                          _expectation(check.expect_match), ok)
        console.print(table)
        for arm in case.arms:
            if arm.error:
                console.print(f"[red]{arm.name} failed:[/] {escape(arm.error)}", highlight=False)
    style = "green" if run.verdict.code == PASS else "red"
    console.print(f"[bold {style}]{run.verdict.code}[/]: {escape(run.verdict.reason)}", highlight=False)


def render_json(run: RunResult) -> str:
    return json.dumps(run_to_json(run), indent=2, ensure_ascii=False)
