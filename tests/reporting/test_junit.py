"""JUnit output: schema attributes, one testcase per case, outcome per verdict, escaping."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from parity.arms import BCG_NORMAL, EAGER_ZERO
from parity.reporting.junit import junit_xml, write_junit
from parity.results import Verdict
from parity.judge.verdict import NotJudged, judge_run
from tests.helpers_runs import NORMAL_IDS, ZERO_IDS, fixed_arms, four_arms, legacy_arms, make_arm, make_case, make_run


def _mixed_run():
    errored = [a for a in fixed_arms() if a.name != BCG_NORMAL] + [make_arm(BCG_NORMAL, (), error="server died")]
    incomplete = [a for a in fixed_arms() if a.name != EAGER_ZERO]
    return make_run([
        make_case(fixed_arms(), "rgb-stripes/describe"),
        make_case(legacy_arms(), "checkerboard/describe"),
        make_case(errored, "gradient-circle/describe"),
        make_case(incomplete, "rgb-stripes/count"),
    ], model="Qwen/Qwen3-VL-8B-Instruct")


def _parse(run):
    root = ET.fromstring(junit_xml(judge_run(run)))
    return root, root.find("testsuite"), {tc.get("name"): tc for tc in root.iter("testcase")}


def test_schema_attributes_and_counts():
    root, suite, cases = _parse(_mixed_run())
    assert root.tag == "testsuites"
    for attr in ("name", "tests", "failures", "errors", "skipped", "time", "timestamp"):
        assert suite.get(attr) is not None, attr
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("4", "2", "1", "0")
    assert root.get("tests") == "4" and root.get("failures") == "2"
    assert suite.get("timestamp") == "2025-01-02T03:04:05"
    assert list(cases) == ["rgb-stripes/describe", "checkerboard/describe", "gradient-circle/describe", "rgb-stripes/count"]
    for tc in cases.values():
        assert tc.get("classname") == "parity.Qwen_Qwen3-VL-8B-Instruct"
        assert tc.find("system-out") is not None
    # time = sum of arm seconds (1.0 each): four arms, three for the incomplete case.
    assert cases["rgb-stripes/describe"].get("time") == "4.000"
    assert cases["rgb-stripes/count"].get("time") == "3.000"


def test_outcome_per_verdict():
    _, _, cases = _parse(_mixed_run())
    passed = cases["rgb-stripes/describe"]
    assert passed.find("failure") is None and passed.find("error") is None  # negative control
    failure = cases["checkerboard/describe"].find("failure")
    assert failure is not None and failure.get("type") == "FAIL_DEEPSTACK_DROPPED"
    assert failure.get("message").startswith("FAIL_DEEPSTACK_DROPPED: bcg_normal vs bcg_zero_deepstack")
    error = cases["gradient-circle/describe"].find("error")
    assert error is not None and error.get("type") == "ERROR" and "server died" in error.get("message")
    assert cases["gradient-circle/describe"].find("failure") is None
    # INCOMPLETE must fail the report, never be skipped (a skipped test is green in CI reporters).
    incomplete = cases["rgb-stripes/count"]
    assert incomplete.find("skipped") is None
    assert incomplete.find("failure").get("type") == "INCOMPLETE"


def test_inconclusive_is_a_failure():
    no_power = four_arms(NORMAL_IDS, bcg_zero=NORMAL_IDS, eager_zero=NORMAL_IDS)
    _, suite, cases = _parse(make_run([make_case(no_power)]))
    assert cases["rgb-stripes/describe"].find("failure").get("type") == "INCONCLUSIVE_NO_POWER"
    assert suite.get("failures") == "1"


def test_system_out_lists_comparison_tuples():
    _, _, cases = _parse(make_run([make_case(legacy_arms())]))
    out = cases["rgb-stripes/describe"].find("system-out").text
    assert "bcg_normal vs eager_normal (1, False, tf 1.900)" in out  # the delta that measures a flip
    assert "bcg_normal vs bcg_zero_deepstack (19, True, 0.000) match=True expected differ [UNEXPECTED]" in out


def test_stored_verdicts_are_judged_again_and_an_unjudged_run_is_refused():
    run = make_run([make_case(legacy_arms())])
    with pytest.raises(NotJudged):  # a renderer shows verdicts; it never makes them up
        junit_xml(replace(run, verdict=None))
    forged = replace(run, cases=(replace(run.cases[0], verdict=Verdict("PASS", "forged")),),
                     verdict=Verdict("PASS", "forged"))
    _, suite, _ = _parse(forged)  # judged where loaded: the forged PASS is gone
    assert suite.get("failures") == "1"


def test_special_characters_are_escaped_and_invalid_ones_dropped(tmp_path):
    nasty = 'bad <tag> & "quote" \x1b[31mred\x1b[0m \x00'
    arms = [a for a in fixed_arms() if a.name != BCG_NORMAL] + [make_arm(BCG_NORMAL, (), error=nasty)]
    path = write_junit(judge_run(make_run([make_case(arms, 'a&b/<p>"q"')])), tmp_path / "junit.xml")
    raw = path.read_text(encoding="utf-8")
    assert "\x1b" not in raw and "\x00" not in raw
    assert "&lt;tag&gt; &amp; " in raw
    tc = ET.parse(path).getroot().find("testsuite/testcase")  # parses, so the document is well-formed
    assert tc.get("name") == 'a&b/<p>"q"'
    assert 'bad <tag> & "quote" [31mred[0m' in tc.find("error").get("message")


def test_empty_model_name_still_gives_a_classname():
    run = make_run([make_case(four_arms(bcg_normal=ZERO_IDS))], model="///")
    _, _, cases = _parse(run)
    assert cases["rgb-stripes/describe"].get("classname") == "parity.model"
