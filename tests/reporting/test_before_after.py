"""Before/after: legacy (DeepStack dropped) vs fixed, pairing, mismatch notes, rendering."""

from __future__ import annotations

import io
from dataclasses import replace

from rich.console import Console

from parity.arms import BCG_NORMAL, BCG_ZERO, EAGER_NORMAL
from parity.reporting.before_after import compare_runs, render_markdown, render_table
from parity.results import FixtureInfo, Verdict
from parity.judge.verdict import exit_code, judge_run
from tests.helpers_runs import fixed_arms, legacy_arms, make_arm, make_case, make_run


def _compare(before, after):
    """As `parity compare` does: each file judged where it is loaded, then paired."""
    return compare_runs(judge_run(before), judge_run(after))


def _legacy_and_fixed():
    return make_run([make_case(legacy_arms())]), make_run([make_case(fixed_arms())])


def test_deepstack_dropped_to_pass():
    before, after = _legacy_and_fixed()
    ba = _compare(before, after)
    assert (ba.before_verdict.code, ba.after_verdict.code) == ("FAIL_DEEPSTACK_DROPPED", "PASS")
    assert exit_code(ba.after_verdict) == 0
    assert ba.notes == () and ba.comparable  # negative control: same experiment, nothing to warn about
    assert [(r.label, r.expect_match) for r in ba.rows] == [
        ("bcg_normal vs eager_normal", True), ("bcg_normal vs bcg_zero_deepstack", False),
        ("bcg_zero_deepstack vs eager_zero_deepstack", True), ("eager_zero_deepstack vs eager_normal", False)]
    sees = ba.rows[1]
    assert sees.before.match and not sees.after.match
    assert [(c.case_id, c.before.code, c.after.code) for c in ba.cases] == [
        ("rgb-stripes/describe", "FAIL_DEEPSTACK_DROPPED", "PASS")]


def test_reverse_direction_is_a_regression():
    before, after = _legacy_and_fixed()
    ba = _compare(after, before)
    assert (ba.before_verdict.code, ba.after_verdict.code) == ("PASS", "FAIL_DEEPSTACK_DROPPED")
    assert exit_code(ba.after_verdict) == 1


def test_stored_verdicts_are_recomputed():
    before, after = _legacy_and_fixed()
    forged = replace(after, verdict=Verdict("FAIL_GRAPH_DIVERGES", "forged"),
                     cases=tuple(replace(c, comparisons=(), verdict=None) for c in after.cases))
    ba = _compare(before, forged)
    assert ba.after_verdict.code == "PASS"
    assert all(r.after is not None for r in ba.rows)


def test_markdown_table_and_verdict_row():
    md = render_markdown(_compare(*_legacy_and_fixed()))
    assert "| case | comparison | expected | before fix | after fix |" in md
    assert ("| rgb-stripes/describe | bcg_normal vs bcg_zero_deepstack | differ | "
            "(19, True, 0.000) ✗ | (1, False, tf 1.900) |") in md
    assert ("| rgb-stripes/describe | bcg_normal vs eager_normal | match | "
            "(1, False, tf 1.900) ✗ | (19, True, 0.000) |") in md
    assert "before: FAIL_DEEPSTACK_DROPPED → after: PASS" in md
    assert "WARNING" not in md


def test_mismatches_are_reported():
    before = make_run([make_case(legacy_arms()), make_case(legacy_arms(), "checkerboard/describe")])
    other_fixture = FixtureInfo("rgb-stripes", "0" * 64, (64, 64))
    after = make_run([make_case(fixed_arms(), prompt="What is shown?", fixture=other_fixture),
                      make_case(fixed_arms(), "gradient-circle/describe")],
                     model="Qwen/Qwen3-VL-8B-Instruct", logprob_tol=0.5)
    ba = _compare(before, after)
    text = "\n".join(ba.notes)
    assert "different model: before 'tiny-qwen3-vl', after 'Qwen/Qwen3-VL-8B-Instruct'" in text
    assert "different logprob_tol: before 0.25, after 0.5" in text
    assert "case rgb-stripes/describe: different fixture" in text
    assert "case rgb-stripes/describe: different prompt" in text
    assert "case checkerboard/describe is only in the before file" in text
    assert "case gradient-circle/describe is only in the after file" in text
    assert not ba.comparable
    # Cases only on one side still get rows, with the missing side shown as "—".
    assert [c.case_id for c in ba.cases] == ["rgb-stripes/describe", "checkerboard/describe", "gradient-circle/describe"]
    only_after = [r for r in ba.rows if r.case_id == "gradient-circle/describe"]
    assert len(only_after) == 4 and all(r.before is None and r.after is not None for r in only_after)
    md = render_markdown(ba)
    assert "> [!WARNING]" in md and "> - different model" in md
    assert "| gradient-circle/describe | bcg_normal vs eager_normal | match | — | (19, True, 0.000) |" in md


def test_failed_arm_shows_as_missing_cell():
    arms = [a for a in fixed_arms() if a.name != BCG_ZERO] + [make_arm(BCG_ZERO, (), error="boom")]
    ba = _compare(make_run([make_case(legacy_arms())]), make_run([make_case(arms)]))
    assert ba.after_verdict.code == "ERROR"
    by_label = {r.label: r for r in ba.rows}
    assert by_label[f"{BCG_NORMAL} vs {BCG_ZERO}"].after is None
    assert by_label[f"{BCG_NORMAL} vs {EAGER_NORMAL}"].after is not None


def test_pipe_in_case_id_does_not_break_the_table():
    ba = _compare(make_run([make_case(legacy_arms(), "a|b/describe")]),
                      make_run([make_case(fixed_arms(), "a|b/describe")]))
    row = next(line for line in render_markdown(ba).splitlines() if line.startswith("| a"))
    assert row.startswith("| a\\|b/describe |") and row.count(" | ") == 4


def test_rich_table_renders():
    ba = _compare(make_run([make_case(legacy_arms(), "rgb[x]/describe")]),
                      make_run([make_case(fixed_arms(), "rgb[x]/describe")], model="other"))
    out = io.StringIO()
    render_table(ba, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "rgb[x]/describe" in text  # brackets survive: not parsed as rich markup
    assert "before: FAIL_DEEPSTACK_DROPPED → after: PASS" in text
    assert "WARNING: different model" in text
