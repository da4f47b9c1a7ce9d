"""Per-case plots: a real PNG of the documented size, safe names, deltas that match the metric."""

from __future__ import annotations

import sys

import pytest
from PIL import Image

from parity.arms import BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO
from parity.judge.metrics import Tolerances, compare
from parity.reporting.plots import PLOT_SIZE_PX, comparable_pairs, plot_case, plot_filename, position_deltas
from parity.results import LayerError, Localization
from tests.helpers_runs import NORMAL_IDS, fixed_arms, four_arms, legacy_arms, make_arm, make_case, make_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _judged(arms, case_id="rgb-stripes/describe"):
    run = make_run([make_case(arms, case_id)])
    return run.cases[0], run


def test_png_has_signature_and_documented_size(tmp_path):
    arms = four_arms(NORMAL_IDS, logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5])
    case, run = _judged(arms)
    path = plot_case(case, tmp_path / "plots", run)
    assert path == tmp_path / "plots" / "rgb-stripes__describe.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == PLOT_SIZE_PX == (800, 400)


def test_case_without_comparable_pairs_still_plots(tmp_path):
    arms = [make_arm(EAGER_NORMAL, NORMAL_IDS, error="boom"), make_arm(BCG_NORMAL, NORMAL_IDS)]
    case, run = _judged(arms, "reuse/rgb-stripes/describe")
    assert comparable_pairs(case) == []
    path = plot_case(case, tmp_path, run)
    assert path.name == "reuse__rgb-stripes__describe.png"
    with Image.open(path) as image:
        assert image.size == PLOT_SIZE_PX


def test_no_pyplot_state_leaks(tmp_path):
    case, run = _judged(fixed_arms())
    plot_case(case, tmp_path, run)
    pyplot = sys.modules.get("matplotlib.pyplot")
    assert pyplot is None or pyplot.get_fignums() == []


def test_comparable_pairs_follow_design_order_and_skip_failed_arms():
    names = [(a.name, b.name) for _, a, b in comparable_pairs(_judged(fixed_arms())[0])]
    assert names == [(BCG_NORMAL, EAGER_NORMAL), (BCG_NORMAL, BCG_ZERO), (BCG_ZERO, EAGER_ZERO), (EAGER_ZERO, EAGER_NORMAL)]
    failed = [a for a in fixed_arms() if a.name != BCG_ZERO] + [make_arm(BCG_ZERO, (), error="x")]
    names = [(a.name, b.name) for _, a, b in comparable_pairs(_judged(failed)[0])]
    assert names == [(BCG_NORMAL, EAGER_NORMAL), (EAGER_ZERO, EAGER_NORMAL)]


def test_teacher_forced_deltas_cover_the_whole_reference_sequence():
    a = make_arm(BCG_NORMAL, (1, 2, 9, 9), logprobs=(-0.1, -0.5, -0.2, -3.0),
                 forced={EAGER_NORMAL: (-0.1, -0.2, -1.5, -0.1)})
    b = make_arm(EAGER_NORMAL, (1, 2, 3, 4), logprobs=(-0.1, -0.2, -1.0, -0.1))
    assert position_deltas(a, b) == pytest.approx((0.0, 0.0, 0.5, 0.0))


def test_a_failing_comparison_under_the_tolerance_is_drawn_on_top_and_labelled(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, **k: drawn.append(k) or real(self, *a, **k))
    case, run = _judged(legacy_arms())
    plot_case(case, tmp_path, run)
    lines = {k["label"]: k for k in drawn if k.get("label")}
    wrong = lines["bcg_normal vs bcg_zero_deepstack: expected differ, ✗"]
    right = lines["bcg_zero_deepstack vs eager_zero_deepstack"]
    # The drop's signature lies at zero, exactly where the control lies: it is drawn above it.
    assert wrong["linestyle"] == "--" and wrong["zorder"] > right["zorder"]


def test_position_deltas_stop_where_the_metric_stops():
    a = make_arm(BCG_NORMAL, (1, 2, 3, 4), logprobs=(-0.1, -0.5, -0.2, -3.0))
    b = make_arm(EAGER_NORMAL, (1, 2, 9, 4), logprobs=(-0.1, -0.2, -1.0, -0.1))
    deltas = position_deltas(a, b)
    assert deltas == pytest.approx((0.0, 0.3, 0.8))
    assert len(deltas) == 3  # position 3 (after the divergence) is left out: its 2.9 must not show
    assert max(deltas) == compare(a, b, Tolerances(0.25)).logprob_delta
    same = make_arm(EAGER_NORMAL, (1, 2, 3, 4), logprobs=(-0.1, -0.5, -0.2, -3.0))
    assert position_deltas(a, same) == (0.0, 0.0, 0.0, 0.0)
    assert position_deltas(a, make_arm(EAGER_NORMAL, ())) == ()


def test_plot_filename_is_flat_and_safe():
    assert plot_filename("rgb-stripes/describe") == "rgb-stripes__describe.png"
    assert plot_filename("reuse/rgb-stripes/describe") == "reuse__rgb-stripes__describe.png"
    assert plot_filename("../etc/pass wd") == "__etc__pass_wd.png"
    assert plot_filename("") == "case.png"
    assert "/" not in plot_filename("a/b/c/d") and plot_filename("a b") != plot_filename("a/b")


@pytest.mark.parametrize("case_of", ["four-arm failing", "stream failing", "localized"])
def test_the_legend_stays_inside_the_image(case_of):
    from dataclasses import replace

    from parity.reporting.plots import case_figure, localization_figure
    from tests.helpers_runs import legacy_arms, stream_case

    if case_of == "stream failing":  # five comparisons, one of them flagged: the longest legend
        case, run = _judged_case(stream_case(bcg_ids=[(7,) * 5] * 5))
        figure = case_figure(case, run)
    elif case_of == "four-arm failing":
        case, run = _judged(legacy_arms())
        figure = case_figure(case, run)
    else:
        case, run = _judged(legacy_arms())
        points = tuple(LayerError(i // 2, i // 2 if i % 2 else None, 10.0 ** (i - 6)) for i in range(8))
        case = replace(case, localization=Localization(arm="bcg_normal", reference="eager_normal", request=None,
                                                       threshold=1e-4, points=points, first=3))
        figure = localization_figure(case)
    figure.canvas.draw()
    (legend,) = figure.legends
    box, image = legend.get_window_extent(), figure.bbox
    assert image.x0 <= box.x0 and box.x1 <= image.x1 and image.y0 <= box.y0 and box.y1 <= image.y1, (box, image)
    axes = figure.axes[0].get_window_extent()
    assert box.y1 <= axes.y0  # below the axes: it covers no data
    assert (figure.get_figwidth() * figure.dpi, figure.get_figheight() * figure.dpi) == PLOT_SIZE_PX


def _judged_case(case):
    run = make_run([case])
    return run.cases[0], run
