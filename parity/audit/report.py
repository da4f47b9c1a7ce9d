"""What `parity audit` finds in an installed engine, and how it is shown (design §11).

One row per model class the engine serves whose code mentions DeepStack. Each graph mode of the
engine gets a cell: whether a prefill that carries DeepStack replays a graph there, and what becomes
of DeepStack when it does — under the engine as installed and with parity's fix in place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# What happens to DeepStack in one graph mode.
EAGER = "eager"  # a prefill carrying DeepStack does not replay a graph here: nothing to cover
COVERED = "covered"  # it replays, and the graph reads this request's rows and nothing else
CARRIED_ENGINE = "carried (engine)"  # it replays, and the engine's own mechanism carries DeepStack (named in why)
DROPPED = "dropped"  # it replays, and the graph never reads DeepStack: dropped silently
LEAKS = "leaks"  # it replays, and rows an earlier step left are not cleared: stale rows read
UNKNOWN = "not analysed"  # it replays, and DeepStack reaches the body in a way the audit does not know
NOT_AN_INPUT = "n/a"  # DeepStack never reaches the language model, in this mode or eagerly: nothing to carry
UNCOVERED = (DROPPED, LEAKS, UNKNOWN)

EXIT_COVERED, EXIT_UNCOVERED = 0, 1  # 2: the engine is not installed (a usage error)


@dataclass(frozen=True)
class ModeCell:
    mode: str
    engine: str  # the outcome with the engine as installed
    fixed: str  # the outcome with parity's fix in place
    why: str

    def outcome(self, with_fix: bool) -> str:
        return self.fixed if with_fix else self.engine


@dataclass(frozen=True)
class AuditRow:
    module: str  # the engine's model module, relative to its models folder (`qwen3_vl`)
    model_class: str
    architectures: tuple[str, ...]  # the architecture names that serve this class
    deepstack: str  # how the class consumes DeepStack, in the engine's own names
    side_input: bool  # DeepStack reaches the language model as a per-request input (what a graph must carry)
    buffers: str  # where the engine keeps it between steps, and who clears it
    modes: tuple[ModeCell, ...]
    method: str  # what parity's fix relies on to cover this class, and whether the class has it

    def uncovered(self, with_fix: bool) -> tuple[ModeCell, ...]:
        return tuple(c for c in self.modes if c.outcome(with_fix) in UNCOVERED)


@dataclass(frozen=True)
class AuditReport:
    engine: str
    version: str
    source: str  # the package folder that was read
    modes: tuple[str, ...]
    rows: tuple[AuditRow, ...]
    facts: tuple[str, ...]  # the engine-wide facts the cells rest on, each with its file and function
    with_fix: bool = False  # judged with parity's fix in place

    @property
    def uncovered(self) -> tuple[AuditRow, ...]:
        return tuple(r for r in self.rows if r.uncovered(self.with_fix))

    @property
    def exit_code(self) -> int:
        return EXIT_UNCOVERED if self.uncovered else EXIT_COVERED

    def row(self, module: str, model_class: str | None = None) -> AuditRow | None:
        return next((r for r in self.rows if r.module == module and model_class in (None, r.model_class)), None)

    def outcomes(self, module: str, model_class: str | None = None, with_fix: bool = False) -> dict[str, str]:
        """Graph mode -> outcome for one model class (the module's first when not named)."""
        row = self.row(module, model_class)
        if row is None:
            raise KeyError(f"no row for {module} {model_class or ''}: {[r.module for r in self.rows]}")
        return {c.mode: c.outcome(with_fix) for c in row.modes}

    @property
    def summary(self) -> str:
        judged = "with parity's fix" if self.with_fix else "as installed"
        if not self.uncovered:
            return f"{self.engine} {self.version} ({judged}): every DeepStack model's graph modes are covered"
        names = ", ".join(f"{r.module}.{r.model_class}" for r in self.uncovered)
        return (f"{self.engine} {self.version} ({judged}): {len(self.uncovered)} DeepStack model(s) replay a "
                f"graph that drops or leaks DeepStack: {names}")


def cell_text(cell: ModeCell) -> str:
    return cell.engine if cell.engine == cell.fixed else f"{cell.engine} → {cell.fixed} with fix"


def to_json(report: AuditReport) -> str:
    data = asdict(report)
    data.update(exit_code=report.exit_code, summary=report.summary)
    return json.dumps(data, indent=2)


def to_markdown(report: AuditReport) -> str:
    header = ["module", "class", "DeepStack", *report.modes, "parity's fix relies on"]
    lines = [f"# DeepStack audit: {report.engine} {report.version}", "", f"Read from `{report.source}`.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in report.rows:
        cells = [f"`{row.module}`", f"`{row.model_class}`", row.deepstack, *(cell_text(c) for c in row.modes),
                 row.method]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", f"**{report.summary}** (exit {report.exit_code}).", "", "Why each cell says what it says:", ""]
    lines += [f"- {fact}" for fact in report.facts]
    reasons = sorted({f"{c.mode}: {c.why}" for r in report.uncovered for c in r.uncovered(report.with_fix)})
    if reasons:
        lines += ["", "Uncovered:", ""] + [f"- {reason}" for reason in reasons]
    carried = carried_reasons(report)
    if carried:
        lines += ["", "Carried by the engine itself:", ""] + [f"- {reason}" for reason in carried]
    return "\n".join(lines) + "\n"


def carried_reasons(report: AuditReport) -> list[str]:
    """Why each cell the engine carries itself is carried: the engine's function, named."""
    return sorted({f"{r.model_class}, {c.mode}: {c.why}" for r in report.rows for c in r.modes
                   if c.outcome(report.with_fix) == CARRIED_ENGINE})


def render_table(report: AuditReport, console) -> None:
    from rich.table import Table

    table = Table(title=f"DeepStack audit: {report.engine} {report.version}", show_lines=False)
    for column in ("module", "class", "DeepStack", *report.modes, "parity's fix relies on"):
        table.add_column(column, overflow="fold")
    colours = {COVERED: "green", CARRIED_ENGINE: "green", EAGER: "dim", NOT_AN_INPUT: "dim", DROPPED: "red", LEAKS: "red", UNKNOWN: "yellow"}
    for row in report.rows:
        cells = [f"[{colours[c.outcome(report.with_fix)]}]{cell_text(c)}[/]" for c in row.modes]
        table.add_row(row.module, row.model_class, row.deepstack, *cells, row.method)
    console.print(table)
    for line in (*report.facts, *carried_reasons(report)):
        console.print(f"- {line}", highlight=False, markup=False)
    colour = "red" if report.uncovered else "green"
    console.print(f"[{colour}]{report.summary}[/]", highlight=False)
