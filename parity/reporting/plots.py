"""Per-case plot: teacher-forced |Δ logprob| per position for every comparison, against the tolerance.

Where arm `a` was scored on its reference's tokens (`forced`), the line covers the reference's whole
sequence: a divergence after the first token stays visible, and a comparison that failed shows
where. Without forced scores (a /1 file) the line stops where the metric stops, at the first
divergent token, inclusive. Comparisons whose outcome is not what a correct runtime gives are
drawn in red and say so in the legend, so a FAIL never hides under the tolerance line.

Rendering uses `matplotlib.figure.Figure` on an Agg canvas, never pyplot and never
`matplotlib.use()`: both are process-wide state, and a library must not switch its caller's backend
or leave figures open in pyplot's registry. matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable

from parity.judge import metrics
from parity.judge.metrics import first_divergence
from parity.reporting.text import visible
from parity.results import ArmResult, CaseResult, RunResult
from parity.judge.verdict import checks_for, comparable_pairs

FIG_SIZE_IN = (8.0, 4.0)
DPI = 100
# The PNG's pixel size is fixed (no tight bounding box), so reports can lay plots out blind; the
# constrained layout shrinks the axes instead, so the legend below them stays inside the image.
PLOT_SIZE_PX = (int(FIG_SIZE_IN[0] * DPI), int(FIG_SIZE_IN[1] * DPI))  # (width, height) = (800, 400)
# Deltas are often exactly 0 and sometimes > 1: symlog shows both; linear below this threshold.
SYMLOG_LINTHRESH = 1e-3

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def plot_filename(case_id: str, suffix: str = "") -> str:
    """`reuse/rgb-stripes/describe` -> `reuse__rgb-stripes__describe.png`: one flat, portable name."""
    stem = "__".join(_UNSAFE.sub("_", part) for part in case_id.split("/"))
    # A leading dot would hide the file; an empty id would name it ".png".
    return (stem.lstrip(".") or "case") + suffix + ".png"


def position_deltas(a: ArmResult, b: ArmResult) -> tuple[float, ...]:
    """Teacher-forced |Δ logprob| over b's whole sequence when scored, else the metric's steps."""
    forced = metrics.forced_deltas(a, b)
    if forced is not None:
        return forced
    return metrics.position_deltas(a.token_logprobs, b.token_logprobs, first_divergence(a.token_ids, b.token_ids))


def new_axes():
    """A figure of the documented size on an Agg canvas, and its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIG_SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def title_text(text: str) -> str:
    """A case id as a title shows it: one line, and a `$` is a dollar, not the start of mathtext."""
    return visible(text).replace("$", r"\$")


def add_legend(figure, axes) -> None:
    """Below the axes, so the legend never covers the data it names: two columns where they fit the
    image's width, else one."""
    handles, labels = axes.get_legend_handles_labels()
    if not handles:
        return
    renderer = figure.canvas.get_renderer()
    for ncols in (2, 1):
        legend = figure.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize="small",
                               frameon=False)
        if ncols == 1 or legend.get_window_extent(renderer).width <= figure.bbox.width:
            return
        legend.remove()


def save(figure, out_dir: str | Path, filename: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    # No "Software" entry: it names the matplotlib version, which would make identical plots differ.
    figure.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    return path


def plot_case(case: CaseResult, out_dir: str | Path, run: RunResult) -> Path:
    """Write the case's plot as `out_dir/plot_filename(case.id)` and return that path."""
    return save(case_figure(case, run), out_dir, plot_filename(case.id))


def case_figure(case: CaseResult, run: RunResult):
    from matplotlib.ticker import MaxNLocator

    tol = run.logprob_tol
    figure, axes = new_axes()
    expected = {(g.request, c.a, c.b): c.expect_match for g, c in checks_for(case)}
    outcome = {(c.request, c.a, c.b): c.match for c in case.comparisons}
    pairs = comparable_pairs(case)
    top = tol
    for index, (request, a, b) in enumerate(pairs):
        key = (request, a.name, b.name)
        wrong = key in outcome and outcome[key] != expected.get(key)
        deltas = position_deltas(a, b)
        top = max([top, *deltas])
        label = f"{a.name} vs {b.name}" + ("" if request is None else f" (request {request + 1})")
        if wrong:
            label += f": expected {'match' if expected[key] else 'differ'}, ✗"
        # A comparison that is not what a correct runtime gives is drawn dashed, thick and on top, so
        # it stays visible also where it lies on another line or at zero (the DeepStack drop).
        style = {"linestyle": "--", "linewidth": 2.6, "zorder": 4} if wrong else {"linewidth": 1.4, "zorder": 2}
        (line,) = axes.plot(range(len(deltas)), deltas, marker=".", label=label, color=f"C{index}", **style)
        divergence = first_divergence(a.token_ids, b.token_ids)
        if divergence is not None and divergence < len(deltas):
            axes.plot([divergence], [deltas[divergence]], marker="x", markersize=10, color=line.get_color(),
                      zorder=5)
    if not pairs:
        axes.text(0.5, 0.5, "no comparable arm pair (arms missing or failed)",
                  ha="center", va="center", transform=axes.transAxes)
    axes.axhline(tol, linestyle="--", color="gray", label=f"logprob_tol {tol:g}")
    axes.set_yscale("symlog", linthresh=SYMLOG_LINTHRESH)
    # Below zero a little, so a line of exact zeros is drawn above the axis, not on it.
    axes.set_ylim(bottom=-SYMLOG_LINTHRESH / 2, top=max(top * 3, SYMLOG_LINTHRESH))
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("reference position (× first divergent token)")
    axes.set_ylabel("teacher-forced |Δ logprob|")
    verdict = case.verdict.code if case.verdict else "not judged"
    axes.set_title(f"{title_text(case.id)} — {verdict}")
    add_legend(figure, axes)
    return figure


def plot_localization(case: CaseResult, out_dir: str | Path) -> Path:
    """Write the case's per-layer plot, `plot_filename(case.id, "-layers")`: the relative error of
    the replayed prefill at every probe point, log scale, against the localization threshold."""
    return save(localization_figure(case), out_dir, plot_filename(case.id, "-layers"))


def localization_figure(case: CaseResult):
    loc = case.localization
    figure, axes = new_axes()
    errors = [p.rel_error for p in loc.points]
    # A log axis has no 0 (an exactly equal point, common in fp32): draw it a decade under the rest.
    floor = min([e for e in errors if e > 0] + [loc.threshold]) / 10
    shown = [max(e, floor) for e in errors]
    positions = range(len(errors))
    request = "" if loc.request is None else f" (request {loc.request + 1})"
    axes.plot(positions, shown, marker="o", color="tab:blue", label=f"{loc.arm} vs {loc.reference}{request}")
    over = [i for i in positions if errors[i] > loc.threshold]
    if over:
        axes.plot(over, [shown[i] for i in over], linestyle="none", marker="o", color="tab:red",
                  label="above the threshold")
    if loc.first is not None:
        axes.plot([loc.first], [shown[loc.first]], linestyle="none", marker="x", markersize=12, color="tab:red",
                  label=f"first divergent: {loc.first_point.label}")
    if any(e == 0 for e in errors):
        axes.plot([], [], linestyle="none", label=f"exactly 0 drawn at {floor:.1g}")
    axes.axhline(loc.threshold, linestyle="--", color="gray", label=f"threshold {loc.threshold:g}")
    axes.set_yscale("log")
    labels = [p.label for p in loc.points]
    # A real checkpoint has dozens of layers: name every DeepStack add and enough layers to count by.
    step = max(1, len(labels) // 16)
    axes.set_xticks(list(positions))
    axes.set_xticklabels([text if (p.deepstack_block is not None or p.layer % step == 0) else ""
                          for text, p in zip(labels, loc.points)], fontsize="x-small")
    axes.set_xlabel("probe point (L = after decoder layer, +DS = after the DeepStack add)")
    axes.set_ylabel("relative error")
    verdict = case.verdict.code if case.verdict else "not judged"
    axes.set_title(f"{title_text(case.id)} — {verdict}: ‖h_bcg − h_eager‖ / ‖h_eager‖ per layer",
                   fontsize="medium")
    add_legend(figure, axes)
    return figure


def with_plots(run: RunResult, folder: Path, warn: Callable[[str], object]) -> RunResult:
    """The run with each case's plots drawn into `folder` and named in it; a plot that cannot be drawn
    is a warning (a plot is a view: results.json is already written)."""
    cases = []
    for case in run.cases:
        try:
            case = dataclasses.replace(case, plot=plot_case(case, folder, run).name)
            if case.localization is not None:
                case = dataclasses.replace(case, localization_plot=plot_localization(case, folder).name)
        except (OSError, ValueError, RuntimeError) as err:
            warn(f"no plot for {case.id} ({err.__class__.__name__}: {err})")
        cases.append(case)
    return dataclasses.replace(run, cases=tuple(cases))
