"""Per-case plot: |Δ logprob| per generated position for each comparison, against the tolerance.

Each line stops at the step the metric stops at (design §2: the first divergent token, inclusive),
so a line's maximum is exactly that comparison's `logprob_delta`; later steps compare tokens chosen
after different prefixes and would only add noise. The divergent step is marked with an ×.

Rendering uses `matplotlib.figure.Figure` on an Agg canvas, never pyplot and never
`matplotlib.use()`: both are process-wide state, and a library must not switch its caller's backend
or leave figures open in pyplot's registry.
"""

from __future__ import annotations

import re
from pathlib import Path

from parity import metrics
from parity.metrics import DEFAULT_LOGPROB_TOL, first_divergence
from parity.results import ArmResult, CaseResult
from parity.verdict import comparable_pairs

FIG_SIZE_IN = (8.0, 4.0)
DPI = 100
# The PNG's pixel size is fixed (no tight bounding box), so reports can lay plots out blind.
PLOT_SIZE_PX = (int(FIG_SIZE_IN[0] * DPI), int(FIG_SIZE_IN[1] * DPI))  # (width, height) = (800, 400)
# Deltas are often exactly 0 and sometimes > 1: symlog shows both; linear below this threshold.
SYMLOG_LINTHRESH = 1e-2

_LINE_WIDTHS = (4.0, 2.8, 1.8, 1.0)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def plot_filename(case_id: str) -> str:
    """`reuse/rgb-stripes/describe` -> `reuse__rgb-stripes__describe.png`: one flat, portable name."""
    stem = "__".join(_UNSAFE.sub("_", part) for part in case_id.split("/"))
    # A leading dot would hide the file; an empty id would name it ".png".
    return (stem.lstrip(".") or "case") + ".png"


def position_deltas(a: ArmResult, b: ArmResult) -> tuple[float, ...]:
    """|Δ logprob| per position over the steps `logprob_delta` covers (empty when either arm has no steps)."""
    return metrics.position_deltas(a.token_logprobs, b.token_logprobs, first_divergence(a.token_ids, b.token_ids))


def plot_case(case: CaseResult, out_dir: str | Path, logprob_tol: float = DEFAULT_LOGPROB_TOL) -> Path:
    """Write the case's plot as `out_dir/plot_filename(case.id)` and return that path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIG_SIZE_IN, dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    pairs = comparable_pairs(case)
    # Later lines thinner: two comparisons with identical deltas (the DeepStack-dropped signature)
    # stay visible as a line inside a line instead of one hiding the other.
    for (a, b), width in zip(pairs, _LINE_WIDTHS):
        _draw_pair(axes, a, b, width)
    if not pairs:
        axes.text(0.5, 0.5, "no comparable arm pair (arms missing or failed)",
                  ha="center", va="center", transform=axes.transAxes)
    axes.axhline(logprob_tol, linestyle="--", color="gray", label=f"logprob_tol {logprob_tol:g}")
    axes.set_yscale("symlog", linthresh=SYMLOG_LINTHRESH)
    top = max([logprob_tol] + [max(position_deltas(a, b), default=0.0) for a, b in pairs])
    axes.set_ylim(bottom=0, top=max(top * 3, SYMLOG_LINTHRESH))  # headroom on a log-ish axis
    axes.set_xlabel("generated position")
    axes.set_ylabel("|Δ logprob|")
    verdict = case.verdict.code if case.verdict else "not judged"
    axes.set_title(f"{case.id} — {verdict}")
    # Below the axes, so the legend never covers the data it names.
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize="small", frameon=False)
    figure.subplots_adjust(bottom=0.28)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / plot_filename(case.id)
    # No "Software" entry: it names the matplotlib version, which would make identical plots differ.
    figure.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    return path


def _draw_pair(axes, a: ArmResult, b: ArmResult, width: float) -> None:
    deltas = position_deltas(a, b)
    (line,) = axes.plot(range(len(deltas)), deltas, marker=".", linewidth=width, label=f"{a.name} vs {b.name}")
    divergence = first_divergence(a.token_ids, b.token_ids)
    if divergence is not None and divergence < len(deltas):
        axes.plot([divergence], [deltas[divergence]], marker="x", markersize=10, color=line.get_color())
