"""The report a reviewer reads: report.md always fits a PR comment and names every distinct outcome,
report-full.md holds everything, the first line says where the graph ran, a flip's delta is the one
that measures it, one divergence has one place, counts say what they count, a user's image is not
a fixture, and a verdict found before any arm still reaches CI."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import xml.etree.ElementTree as ET

import pytest

from parity.arms import BCG_NORMAL, EAGER_NORMAL
from parity.evidence import Departure
from parity.judge.metrics import tuple_text
from parity.reporting.junit import junit_xml
from parity.reporting.report import (
    FULL_REPORT, REPORT, REPORT_BUDGET, case_markdown, localization_sentence, media_text, outcome_groups, placement,
    render_full_markdown, render_markdown, report_files,
)
from parity.results import FixtureInfo, LayerError, Localization, RunResult, Verdict
from parity.judge.verdict import judge_run
from tests.helpers_runs import ZERO_IDS, fixed_arms, legacy_arms, make_arm, make_case, make_run, stream_case


def _verbose(run: RunResult, chars: int = 3000) -> RunResult:
    """Every arm's text `chars` long: what a verbose model does to a report."""
    def arm(a):
        return dataclasses.replace(a, text=("word " * chars)[:chars])

    cases = [dataclasses.replace(c, arms=tuple(map(arm, c.arms)),
                                 requests=tuple(dataclasses.replace(r, arms=tuple(map(arm, r.arms))) for r in c.requests))
             for c in run.cases]
    return dataclasses.replace(run, cases=tuple(cases))


def _sweep(failing: int = 12, passing: int = 30) -> RunResult:
    """A sweep like `--fixture all --scenario all --runner legacy`: many cases of few outcomes."""
    cases = [make_case(legacy_arms(), case_id=f"fail-{i}/describe") for i in range(failing)]
    cases += [make_case(fixed_arms(), case_id=f"pass-{i}/describe") for i in range(passing)]
    cases += [stream_case(bcg_ids=[(7, 7, 7, 7, 7)] + [tuple(range(i * 10 + 1, i * 10 + 6)) for i in range(1, 5)],
                          case_id=f"stream/s-{i}/describe") for i in range(6)]
    return _verbose(make_run(cases))


# --- one screen, nothing lost -----------------------------------------------------------------------

def test_a_large_report_fits_its_budget_groups_outcomes_and_the_full_report_holds_everything():
    run = _sweep()
    files = report_files(run)
    full, fitted = files[FULL_REPORT], files[REPORT]
    assert len(full) > REPORT_BUDGET >= len(fitted)  # the full report would not fit a PR comment
    for case in run.cases:  # every case named in both, expanded only in the full one
        assert f"`{case.id}`" in fitted and f"### `{case.id}`: `{case.verdict.code}`" in full
    first_screen = fitted[:1500]
    assert FULL_REPORT in first_screen and "fitted to a PR comment" in first_screen
    groups = outcome_groups(run.cases)
    assert [(g.scenario, g.code, len(g.cases)) for g in groups] == [
        ("four-arm", "FAIL_DEEPSTACK_DROPPED", 12), ("stream", groups[1].code, 6), ("four-arm", "PASS", 30)]
    # Each group that did not pass shows its first case once, in full; a PASS is one line.
    expanded = re.findall(r"^#### `([^`]+)`", fitted, re.M)
    assert expanded == ["fail-0/describe", "stream/s-0/describe"]
    assert re.search(r"^- `pass-7/describe`: bcg_normal vs eager_normal .*sees DeepStack$", fitted, re.M)
    # The seed's four comparisons of the failing group's first case are there, with its evidence.
    assert "| 2 | `bcg_normal vs bcg_zero_deepstack`" in fitted and "LM entries replayed" in fitted


def test_a_report_that_fits_is_the_full_report():
    run = make_run([make_case(legacy_arms()), make_case(fixed_arms(), case_id="bands/describe")])
    files = report_files(run)
    assert files[REPORT] == files[FULL_REPORT] == render_markdown(run) and "fitted" not in files[REPORT]


def test_what_still_does_not_fit_is_named_on_the_first_screen():
    run = _sweep()
    fitted = render_markdown(run, budget=9000)
    assert len(fitted) <= 9000
    note = fitted[:2500]
    assert "left out here: arm texts and all but the first 10 cases of a group" in note
    # What did not pass stays: the first failing group whole, the next as its list, and the passing
    # group, last, is named.
    assert "#### `fail-0/describe`" in fitted and "`stream/s-5/describe`" in fitted
    assert "listed without their first case in full: stream FAIL_GRAPH_DIVERGES ×6" in note
    assert "did not fit at all: four-arm PASS ×30" in note and "`pass-0/describe`" not in fitted


# --- where it ran ------------------------------------------------------------------------------------

def test_the_first_line_says_where_the_graph_ran():
    run = make_run([make_case(fixed_arms())])
    first = render_markdown(run).splitlines()[0]
    assert first == "## parity: ✅ `PASS` · emulated graph · cpu · float32 · runner fixed · transformers"
    props = {p.get("name"): p.get("value") for p in ET.fromstring(junit_xml(run).split("\n", 1)[1]).iter("property")}
    assert props["ran_on"] == placement(run) and props["runner"] == "fixed"
    on_gpu = dataclasses.replace(make_run([make_case(fixed_arms())], backend="sglang"),
                                 environment={"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"})
    on_gpu = dataclasses.replace(on_gpu, config={**on_gpu.config, "sglang_graph_backend": "cuda"})
    assert placement(on_gpu).startswith("CUDA graphs · cuda (NVIDIA H100 80GB HBM3) · float32 · sglang")


# --- numbers that mean what they seem ------------------------------------------------------------------

def test_a_flips_delta_is_the_teacher_forced_one_and_otherwise_says_what_it_compares():
    forced = [a if a.name != BCG_NORMAL else make_arm(BCG_NORMAL, ZERO_IDS, forced={EAGER_NORMAL: [-2.0] * 5})
              for a in legacy_arms()]
    scored = make_run([make_case(forced)]).cases[0].comparison(BCG_NORMAL, EAGER_NORMAL)
    assert not scored.token_match and re.fullmatch(r"\(\d+, False, tf [0-9.]+\)", tuple_text(scored, 0.25))
    unscored = dataclasses.replace(scored, tf_delta=None)
    assert tuple_text(unscored, 0.25).endswith("across unlike tokens)")
    assert "tf" not in tuple_text(make_run([make_case(fixed_arms())]).cases[0].comparison(BCG_NORMAL, EAGER_NORMAL),
                                  0.25)


def test_a_departure_in_the_encoder_is_where_the_localization_says_the_divergence_starts():
    run = make_run([make_case(legacy_arms())])
    case = run.cases[0]
    loc = Localization(BCG_NORMAL, EAGER_NORMAL, None, 0.1, (LayerError(0, None, 0.3), LayerError(1, None, 0.4)), 0)
    assert localization_sentence(dataclasses.replace(case, localization=loc)).startswith(
        "first divergent layer: 0, before any DeepStack add")
    arm = case.arm(BCG_NORMAL)
    check = dataclasses.replace(arm.evidence.replay_check, departure=Departure(0, "encoder", "encoder", 0, 0.45, 0.0))
    departed = dataclasses.replace(arm, evidence=dataclasses.replace(arm.evidence, replay_check=check))
    case = dataclasses.replace(case, localization=loc,
                               arms=tuple(departed if a.name == BCG_NORMAL else a for a in case.arms))
    sentence = localization_sentence(case)
    assert sentence.startswith("first divergent: the vision encoder's output, before decoder layer 0")
    assert "before any DeepStack add" not in sentence and "every layer from 0 inherits it" in sentence


def test_lm_entry_counts_say_what_they_count():
    md = render_markdown(make_run([make_case(fixed_arms())]))
    assert re.search(r"\d+/\d+ LM entries replayed \(generation steps and \d teacher-forced scoring\(s\); buckets",
                     md)


def test_a_users_image_is_named_as_given_with_what_the_model_saw_and_is_not_a_fixture():
    case = make_run([make_case(fixed_arms())]).cases[0]
    assert media_text(case).startswith("fixture `rgb-stripes` 128×96")
    photo = dataclasses.replace(case, fixture=FixtureInfo("photo", "ab" * 32, (2000, 1500)))
    text = media_text(photo)
    assert text.startswith("user image `photo`, 2000×1500 as given; the model saw ") and "image token(s)" in text
    # A user's file named like a built-in, with other pixels, is still the user's.
    impostor = dataclasses.replace(case, fixture=FixtureInfo("rgb-stripes", "cd" * 32, (128, 96)))
    assert media_text(impostor).startswith("user image `rgb-stripes`")
    assert "fixture `photo`" not in case_markdown(photo, make_run([make_case(fixed_arms())]))


# --- a verdict before any arm reaches CI --------------------------------------------------------------

def test_a_verdict_before_any_arm_writes_results_reports_junit_and_the_step_summary(parity_cli, tmp_path):
    summary, junit = tmp_path / "summary.md", tmp_path / "q.xml"
    result = parity_cli("run", "--model", "tiny-qwen3.5", "--out", str(tmp_path / "run"), "--junit", str(junit),
                        env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert result.exit_code == 3 and "INCONCLUSIVE_NO_POWER" in result.output
    for name in ("results.json", REPORT, FULL_REPORT):
        assert (tmp_path / "run" / name).is_file(), name
    assert summary.read_text().startswith("## parity: ❌ `INCONCLUSIVE_NO_POWER` · no arm ran")
    failure = ET.parse(junit).getroot().find(".//failure")
    assert failure is not None and failure.get("type") == "INCONCLUSIVE_NO_POWER"
    verdict = parity_cli("verdict", str(tmp_path / "run" / "results.json"))
    assert verdict.exit_code == 3 and "adds no DeepStack" in verdict.output


def _before_run_file(tmp_path, name: str = "before.json", **edits) -> str:
    doc = {"schema": "parity.results/2", "created": "2026-12-06T00:00:00+00:00", "environment": {"device": "cpu"},
           "config": {"model": "tiny-qwen3.5", "backend": "transformers", "dtype": "auto", "scenarios": ["four-arm"],
                      "max_new_tokens": 20, "cause": "model"},
           "verdict": None, "before_run": {"code": "INCONCLUSIVE_NO_POWER", "reason": "stored"}, "cases": []}
    for key, value in edits.items():
        if key == "config":
            doc["config"].update(value)
        else:
            doc[key] = value
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_loader_recomputes_a_presets_verdict_before_any_arm(parity_cli, tmp_path):
    shown = parity_cli("verdict", _before_run_file(tmp_path))
    assert shown.exit_code == 3 and "adds no DeepStack" in shown.output and "stored" not in shown.output
    full = parity_cli("report", "--full", _before_run_file(tmp_path))
    assert full.exit_code == 3 and full.output.startswith("## parity: ❌ `INCONCLUSIVE_NO_POWER` · no arm ran")
    refused = {  # each forged onto a file that can only say INCONCLUSIVE: refused, never judged
        "a preset with DeepStack": {"config": {"model": "tiny-qwen3-vl"}},
        "a PASS": {"before_run": {"code": "PASS", "reason": "forged"}},
        "a case": {"cases": [{"id": "x"}]},
        "a measured field": {"config": {"logprob_tol": 100.0}},
    }
    for what, edits in refused.items():
        result = parity_cli("verdict", _before_run_file(tmp_path, **edits))
        assert result.exit_code == 2 and "not valid" in result.output, what


def test_merge_counts_a_shard_judged_before_any_arm_as_present(parity_cli, tmp_path):
    shards = [_before_run_file(tmp_path, f"s{k}.json", config={"shard_asked": f"{k}/2"}) for k in (1, 2)]
    merged = parity_cli("merge", *shards, "--out", str(tmp_path / "merged"))
    assert merged.exit_code == 3 and (tmp_path / "merged" / "results.json").is_file()
    other = _before_run_file(tmp_path, "other.json", config={"model": "Qwen/Qwen3.5-9B"})
    mixed = parity_cli("merge", shards[0], other, "--out", str(tmp_path / "mixed"))
    assert mixed.exit_code == 2 and "not a shard of" in mixed.output


# --- help that helps ------------------------------------------------------------------------------------

def test_a_misspelled_preset_is_suggested_at_once(parity_cli, tmp_path):
    result = parity_cli("run", "--model", "tiny-qwen3vl", "--out", str(tmp_path / "r"))
    assert result.exit_code == 2 and "did you mean tiny-qwen3-vl?" in result.output
    assert not (tmp_path / "r").exists()
    saved = parity_cli("models", "save", "tiny-qwen3vl", str(tmp_path / "f"))
    assert saved.exit_code == 2 and saved.output.startswith("Error: NAME tiny-qwen3vl: not an embedded preset; did you")


def test_models_gives_a_shape_presets_memory_in_both_dtypes_and_the_one_a_run_here_uses(parity_cli):
    listing = parity_cli("models").output
    line = next(ln for ln in listing.splitlines() if ln.startswith("shape-qwen3-vl-8b "))
    assert re.search(r"a run needs [\d.]+ GiB in float32, [\d.]+ GiB in bfloat16 \([\d.]+ GiB here\)", line)
    assert re.search(r"is in (float32|bfloat16)$", listing.splitlines()[0])


@pytest.mark.skipif(os.name != "posix", reason="file modes")
def test_a_saved_preset_is_readable_by_a_server_running_as_another_user(parity_cli, tmp_path):
    old = os.umask(0o022)
    try:
        assert parity_cli("models", "save", "tiny-qwen3-vl", str(tmp_path / "ckpt")).exit_code == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ckpt").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_judged_before_any_arm_is_never_a_pass():
    run = judge_run(RunResult("t", {}, {"model": "m", "backend": "transformers"}, (),
                              before_run=Verdict("INCONCLUSIVE_NO_POWER", "r")))
    assert run.verdict.code == "INCONCLUSIVE_NO_POWER" and render_full_markdown(run).startswith("## parity: ❌")
