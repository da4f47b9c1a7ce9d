"""One report over several experiments (design §8): a matrix, then each experiment's sections.

Rows are experiments (model · engine · graph mode · GPU), columns are scenarios, each cell is the
verdict of that scenario's cases and links to its section. Sections of passing scenarios (and
passing cases inside failing ones) are folded in `<details>`; the whole report must fit a PR
comment (`MAX_COMMENT_CHARS`), so when it does not, arm texts go first, then the bodies of what
passed, and only then is the tail cut, with a note. Runs are judged before they get here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from parity import registry
from parity.judge.identity import difference_path, first_difference, identity, shown
from parity.reporting.ci_summary import MAX_COMMENT_CHARS, clip_text
from parity.reporting.report import case_markdown, environment_markdown
from parity.reporting.text import md_code, md_text
from parity.results import SCENARIOS, CaseResult, RunResult, Verdict
from parity.plan.sharding import describe as describe_shard
from parity.judge.verdict import ERROR, PASS, overall_verdict


@dataclass(frozen=True)
class Experiment:
    """One row: a judged run, how the matrix names it, and where its section is."""

    number: int
    label: str
    run: RunResult

    @property
    def anchor(self) -> str:
        return f"e{self.number}"

    def scenario_anchor(self, scenario: str) -> str:
        return f"e{self.number}-{scenario}"

    def cases(self, scenario: str) -> tuple[CaseResult, ...]:
        return tuple(c for c in self.run.cases if c.scenario == scenario)

    def verdict(self, scenario: str) -> Verdict | None:
        cases = self.cases(scenario)
        return overall_verdict(cases) if cases else None


def graph_mode(run: RunResult) -> str:
    """The graph path under test, as the engine names it."""
    config = run.config
    if config.get("graph_mode"):
        return str(config["graph_mode"])
    label = registry.of_run(config).graph_label(config)
    if label:
        return label
    parts = [f"{config['runner']} runner" if config.get("runner") else None,
             f"{config['graph_backend']} graph" if config.get("graph_backend") else None]
    return ", ".join(p for p in parts if p) or "graph mode not recorded"


def label_of(run: RunResult) -> str:
    engine, backend = str(run.config.get("backend", "?")), registry.of_run(run.config)
    version = run.environment.get(backend.package) if backend.package else None  # an engine's release
    gpu = run.environment.get("gpu") or run.environment.get("device") or "device not recorded"
    return " · ".join([str(run.config.get("model", "?")), f"{engine} {version}" if version else engine,
                       graph_mode(run), str(gpu)])


def experiments(runs: Sequence[RunResult]) -> list[Experiment]:
    """Rows in the given order; two rows that would read the same also name the field they differ in."""
    base = [label_of(r) for r in runs]
    labels = list(base)
    for i, run in enumerate(runs):
        twin = next((j for j, other in enumerate(base) if other == base[i] and j != i), None)
        if twin is None:
            continue
        field = first_difference(identity(run), identity(runs[twin]))
        # Files of one experiment never share a row (merge groups them), so a field differs; shown by
        # its deepest differing part, not by a whole plan.
        path, value, _ = difference_path(field, identity(run).get(field), identity(runs[twin]).get(field))
        labels[i] = f"{base[i]} · {path.split('.', 1)[-1]} {shown(value, 40)}"
    return [Experiment(i, label, run) for i, (label, run) in enumerate(zip(labels, runs), 1)]


def matrix_verdict(rows: Sequence[Experiment]) -> Verdict:
    """ERROR, then the first FAIL, then the first experiment that did not pass; PASS only when every
    experiment passed. Stricter than over cases (design §3), where a case without power may sit beside
    passing ones: each experiment is its own claim (another GPU, engine or model), and one that
    proved nothing is not made good by another that passed."""
    verdicts = [(row.label, row.run.verdict) for row in rows]
    for wanted in (lambda code: code == ERROR, lambda code: code.startswith("FAIL_"), lambda code: code != PASS):
        hit = next(((label, v) for label, v in verdicts if wanted(v.code)), None)
        if hit:
            return Verdict(hit[1].code, f"{hit[0]}: {hit[1].reason}")
    return Verdict(PASS, f"all {len(verdicts)} experiment(s) passed")


# --- markdown ----------------------------------------------------------------------------------------

def _icon(code: str) -> str:
    return "✅" if code == PASS else "❌"


def _scenarios(rows: Sequence[Experiment]) -> list[str]:
    present = {c.scenario for row in rows for c in row.run.cases}
    return [s for s in SCENARIOS if s in present]


def _table(rows: Sequence[Experiment], scenarios: Sequence[str]) -> list[str]:
    lines = ["| experiment | " + " | ".join(scenarios) + " | overall |",
             "|---" * (len(scenarios) + 2) + "|"]
    for row in rows:
        cells = []
        for scenario in scenarios:
            v = row.verdict(scenario)
            cells.append("—" if v is None else f"[{_icon(v.code)} `{v.code}`](#{row.scenario_anchor(scenario)})")
        overall = row.run.verdict.code
        lines.append(f"| [{row.number}. {md_text(row.label)}](#{row.anchor}) | " + " | ".join(cells)
                     + f" | {_icon(overall)} `{overall}` |")
    return lines


def _section(row: Experiment, scenarios: Sequence[str], texts: bool, bodies_of_passes: bool) -> str:
    run = row.run
    shard = describe_shard(run)
    lines = [f'<a name="{row.anchor}"></a>', "",
             f"### {row.number}. {md_text(row.label)}: {_icon(run.verdict.code)} `{run.verdict.code}`", "",
             md_text(run.verdict.reason), ""]
    if shard:
        lines += [f"_{shard}._", ""]
    for scenario in scenarios:
        cases = row.cases(scenario)
        if not cases:
            continue
        v = row.verdict(scenario)
        title = f"{scenario}: {_icon(v.code)} {v.code} ({len(cases)} case(s))"
        lines += [f'<a name="{row.scenario_anchor(scenario)}"></a>', ""]
        if v.code == PASS:
            body = (_cases(cases, run, texts, fold_passes=False) if bodies_of_passes
                    else "_Every case passed; see the experiment's report.md._\n")
            lines += [f"<details><summary>{title}</summary>", "", body, "</details>", ""]
        else:
            lines += [f"#### {title}", "", _cases(cases, run, texts, bodies_of_passes), ""]
    lines.append(environment_markdown(run))
    return "\n".join(lines)


def _cases(cases: Sequence[CaseResult], run: RunResult, texts: bool, bodies_of_passes: bool = True,
           fold_passes: bool = True) -> str:
    parts = []
    for case in cases:
        # No images: a PR comment cannot show the plots of the experiment's folder. One heading
        # level below the experiment's.
        case = dataclasses.replace(case, plot=None, localization_plot=None)
        body = case_markdown(case, run, with_texts=texts).replace("### `", "##### `", 1)
        if case.verdict.code != PASS or not fold_passes:
            parts.append(body)
        elif bodies_of_passes:
            parts.append(f"<details><summary>{md_code(case.id)}: ✅ PASS</summary>\n\n{body}\n</details>\n")
        else:
            parts.append(f"- {md_code(case.id)}: ✅ PASS")
    return "\n".join(parts)


def render_matrix(runs: Sequence[RunResult]) -> str:
    """The matrix report of judged runs, at most MAX_COMMENT_CHARS characters with the line end it is
    printed with."""
    limit = MAX_COMMENT_CHARS - 1
    rows = experiments(runs)
    scenarios = _scenarios(rows)
    verdict = matrix_verdict(rows)
    n_cases = sum(len(r.cases) for r in runs)
    head = [f"## parity matrix: {_icon(verdict.code)} `{verdict.code}`", "", md_text(verdict.reason), "",
            f"{len(rows)} experiment(s) · {n_cases} case(s) · each cell is the verdict of that scenario's cases "
            "(design §3) and links to its section; what passed is folded.", "", *_table(rows, scenarios), ""]
    note = ""
    for texts, bodies_of_passes, note in ((True, True, ""),
                                          (False, True, "_Arm texts were left out to fit a PR comment; see each "
                                                        "experiment's results.json._"),
                                          (False, False, "_Arm texts and the details of passing cases were left out "
                                                         "to fit a PR comment; see each experiment's report.md._")):
        text = "\n".join(head + [_section(r, scenarios, texts, bodies_of_passes) for r in rows] + [note])
        if len(text) <= limit:
            return text
    return clip_text(text, limit)


# --- terminal and JSON -------------------------------------------------------------------------------

def print_matrix(runs: Sequence[RunResult], console) -> None:
    from rich.markup import escape
    from rich.table import Table

    rows = experiments(runs)
    scenarios = _scenarios(rows)
    table = Table(title="parity matrix", title_justify="left")
    for column in ("experiment", *scenarios, "overall"):
        table.add_column(column)
    for row in rows:
        cells = [(row.verdict(s).code if row.verdict(s) else "—") for s in scenarios]
        table.add_row(escape(f"{row.number}. {row.label}"), *cells, row.run.verdict.code)
    console.print(table)
    verdict = matrix_verdict(rows)
    style = "green" if verdict.code == PASS else "red"
    console.print(f"[bold {style}]{verdict.code}[/]: {escape(verdict.reason)}", highlight=False)


def matrix_json(runs: Sequence[RunResult]) -> str:
    """The matrix as JSON: each experiment's label, verdict per scenario, and its recomputed results."""
    import json

    from parity.results import run_to_json

    rows = experiments(runs)
    verdict = matrix_verdict(rows)
    doc = {"verdict": {"code": verdict.code, "reason": verdict.reason},
           "experiments": [{"label": row.label,
                            "scenarios": {s: row.verdict(s).code for s in _scenarios([row])},
                            "results": run_to_json(row.run)} for row in rows]}
    return json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False)
