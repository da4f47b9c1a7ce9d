"""`parity run` from the CLI on the embedded models: the verdicts the harness must give.

The fixed runner must PASS and every buggy variant must FAIL in the right way, and no option may
turn a buggy runner into a PASS: the negative controls are what make a PASS mean something.
"""

import json

import pytest
import torch
from PIL import Image

from parity.results import SEQUENCE_SCENARIOS
from parity.trust.loader import load_results


@pytest.mark.parametrize("model, args, code, exit_code", [
    ("tiny-qwen3-vl", [], "PASS", 0),
    ("tiny-qwen3-vl-moe", [], "PASS", 0),
    ("tiny-qwen3-vl", ["--runner", "legacy"], "FAIL_DEEPSTACK_DROPPED", 1),
    ("tiny-qwen3-vl-moe", ["--runner", "legacy"], "FAIL_DEEPSTACK_DROPPED", 1),
    ("tiny-qwen3-vl", ["--runner", "no-clear", "--scenario", "reuse"], "FAIL_STALE_STATE", 1),
    ("tiny-qwen3-vl", ["--scenario", "all"], "PASS", 0),
    ("tiny-qwen3-vl-nodeepstack", [], "INCONCLUSIVE_NO_POWER", 3),
    # Without power a sequence proves nothing either: the legacy drop cannot pass through one.
    ("tiny-qwen3-vl-nodeepstack", ["--runner", "legacy", "--scenario", "all"], "INCONCLUSIVE_NO_POWER", 3),
    ("tiny-qwen3-vl-nodeepstack", ["--runner", "legacy", "--scenario", "reuse"], "INCONCLUSIVE_NO_POWER", 3),
    ("tiny-qwen3-vl", ["--runner", "legacy", "--scenario", "stream"], "FAIL_DEEPSTACK_DROPPED", 1),
    ("tiny-qwen3-vl", ["--arms", "eager_normal,eager_zero_deepstack"], "INCOMPLETE", 3),
    ("tiny-qwen3-vl", ["--buckets", "16"], "INCONCLUSIVE_NOT_REPLAYED", 3),
])
def test_verdicts_from_the_cli(parity_cli, tiny, tiny_moe, tiny_nodeepstack, model, args, code, exit_code):
    result, doc, out = parity_cli.run("--model", model, *args)
    assert result.exit_code == exit_code, result.output
    assert doc["verdict"]["code"] == code and code in result.output
    report = (out / "report.md").read_text()
    assert report.startswith("## parity: ") and f"`{code}`" in report.splitlines()[0]
    # The file on disk re-judges to the same verdict and exit code.
    verdict = parity_cli("verdict", str(out / "results.json"))
    assert verdict.exit_code == exit_code and code in verdict.output


OPTION_COMBINATIONS = [
    [], ["--buckets", "16"], ["--buckets", "40"], ["--buckets", "16,32"], ["--max-new-tokens", "1"],
    ["--scenario", "reuse"], ["--scenario", "stream"], ["--scenario", "all"], ["--repeat", "2"],
    ["--dtype", "bfloat16"], ["--fixture", "all"], ["--logprob-tol", "100"], ["--tie-margin", "100"],
    ["--model", "tiny-qwen3-vl-nodeepstack", "--scenario", "all"], ["--scenario", "all", "--repeat", "2"],
]


@pytest.mark.parametrize("runner, args", [("legacy", args) for args in OPTION_COMBINATIONS] + [
    # no-clear's stale rows are reached only by a sequence (four-arm never reuses a slot after absence).
    ("no-clear", args) for args in OPTION_COMBINATIONS if "--scenario" in args])
def test_a_known_buggy_runner_never_passes_where_its_bug_is_reached(parity_cli, runner, args):
    result, doc, _ = parity_cli.run("--runner", runner, "--max-new-tokens", "6", *args)
    assert result.exit_code != 0 and doc["verdict"]["code"] != "PASS", result.output


def test_a_primer_that_never_replays_never_passes(parity_cli):
    result, doc, _ = parity_cli.run("--runner", "no-clear", "--scenario", "reuse", "--buckets", "32")
    assert result.exit_code == 3 and doc["verdict"]["code"] == "INCONCLUSIVE_NOT_REPLAYED"
    assert "request 1 of 2 (primer (image))" in doc["verdict"]["reason"]
    assert "largest captured bucket: 32" in doc["verdict"]["reason"]


def test_results_file_and_report_contents(parity_cli):
    result, doc, out = parity_cli.run(device=None)  # --device auto: CUDA where there is one
    case = doc["cases"][0]
    assert doc["schema"] == "parity.results/2" and doc["config"]["max_new_tokens"] == 20
    assert doc["config"]["logprob_tol"] == 3e-5 and doc["config"]["logprob_tol_source"] == "auto"
    assert doc["config"]["logprob_mean_tol"] is None  # fp32: the max alone, tight
    assert doc["config"]["tie_margin"] == 0.1 and doc["config"]["deepstack_layers"] == 3
    assert doc["config"]["captured_buckets"] == [4, 8, 12, 16, 20, 24, 28, 32, 48] and doc["config"]["buckets"] == "auto"
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert doc["environment"]["device"] == auto and doc["environment"]["threads"] == 1
    assert doc["config"]["graph_backend"] == ("cuda" if auto == "cuda" else "emulated")
    timings = doc["timings"]  # where the time went: every phase this backend has, and the whole
    assert timings["server_start_s"] is None and 0 < timings["capture_s"] <= timings["bcg_s"]
    assert 0 < timings["load_s"] + timings["eager_s"] + timings["bcg_s"] <= timings["total_s"]
    assert case["id"] == "rgb-stripes/describe" and case["fixture"]["size"] == [128, 96]
    assert list(case["arms"]) == ["eager_normal", "eager_zero_deepstack", "bcg_normal", "bcg_zero_deepstack"]
    for name, arm in case["arms"].items():
        evidence = arm["evidence"]
        assert evidence["prefill_replayed"] is name.startswith("bcg") and evidence["tap_calls"] == 1
        assert evidence["buckets"] == ([48] if name.startswith("bcg") else []) and evidence["prompt_tokens"] == 39
        assert arm["deepstack_record"]["nonzero_rows"] > 0
        assert len(arm["top_logprobs"][0]) == 5 and len(arm["token_ids"]) == 20
    assert len({a["deepstack_record"]["sha256"] for a in case["arms"].values()}) == 1
    # Each arm was scored on the tokens of every reference it is compared against, and on its own.
    assert sorted(case["arms"]["bcg_normal"]["forced"]) == ["bcg_normal", "bcg_zero_deepstack", "eager_normal"]
    assert sorted(case["arms"]["eager_zero_deepstack"]["forced"]) == ["eager_normal", "eager_zero_deepstack"]
    assert list(case["arms"]["eager_normal"]["forced"]) == ["eager_normal"]
    assert all(c["tf_delta"] is not None for c in case["comparisons"])
    report = (out / "report.md").read_text()
    for needle in ("graph replay sees DeepStack", case["fixture"]["sha256"], "<details>", "Environment and config",
                   "prefill replayed: yes", "eager (no replay expected)", "Time: model load", "graph capture"):
        assert needle in report
    assert [c["a"] for c in case["comparisons"]] == ["bcg_normal", "bcg_normal", "bcg_zero_deepstack", "eager_zero_deepstack"]
    assert "prefill replayed: yes · 1/" in result.output  # the terminal shows the evidence too


def test_stream_and_reuse_cases_record_every_request(parity_cli):
    result, doc, out = parity_cli.run("--scenario", "all")
    assert [c["id"] for c in doc["cases"]] == ["rgb-stripes/describe"] + [
        f"{s}/rgb-stripes/describe" for s in SEQUENCE_SCENARIOS]
    reuse, stream = doc["cases"][1], doc["cases"][2]
    assert [r["label"] for r in reuse["requests"]] == ["primer (image)", "follow-up (text only)"]
    assert [r["fixture"] and r["fixture"]["name"] for r in stream["requests"]] == [
        "rgb-stripes", "rgb-stripes", "rgb-stripes-twin", None, "rgb-stripes"]
    assert list(stream["requests"][1]["arms"]) == ["eager_zero_deepstack", "bcg_zero_deepstack"]
    lengths = {r["label"]: r["arms"]["bcg_normal" if "zeroed" not in r["label"] else "bcg_zero_deepstack"]
               ["evidence"]["prompt_tokens"] for r in stream["requests"]}
    # Equal shapes back to back: the twin and the text-only request are as long as the image request.
    assert len(set(lengths.values())) == 1, lengths
    assert all(r["arms"]["bcg_normal" if "zeroed" not in r["label"] else "bcg_zero_deepstack"]["evidence"]
               ["prefill_replayed"] for r in stream["requests"])
    assert "5. bcg_normal" in (out / "report.md").read_text()
    from parity.arms import select_arms
    from parity.run.planning import RunSpec, planned_arm_runs
    from parity.results import SCENARIOS
    from parity.run_command import build_cases

    # The plan's size, said before a large run starts, is what the run then makes.
    spec = RunSpec("tiny-qwen3-vl", select_arms("all"), build_cases((), (), (), None), scenarios=SCENARIOS)
    planned = planned_arm_runs(spec)
    assert f"[{planned}/{planned}]" in result.output


def test_report_formats_and_no_bare_nan(parity_cli):
    _, _, out = parity_cli.run()
    for fmt, needle in (("markdown", "## parity:"), ("json", '"schema": "parity.results/2"'), ("table", "bcg_normal vs")):
        result = parity_cli("report", str(out / "results.json"), "--format", fmt)
        assert result.exit_code == 0 and needle in result.output and "NaN" not in result.output


@pytest.mark.parametrize("edit, code", [
    (lambda arms: arms["bcg_normal"].update(evidence=dict(arms["bcg_normal"]["evidence"], prefill_replayed=False,
                                                          replayed_calls=0, buckets=[], replay_check=None,
                                                          freshness=[]),
                                            deepstack_record=dict(arms["bcg_normal"]["deepstack_record"], replay=False)), 3),
    (lambda arms: arms["bcg_zero_deepstack"].update(evidence=None), 2),
    (lambda arms: arms.update(bcg_normal=arms["eager_normal"], bcg_zero_deepstack=arms["eager_zero_deepstack"]), 2),
    # eager answers relabelled bcg: not scored as the run scores every bcg arm (its own tokens, its references)
    (lambda arms: arms.update(bcg_normal=dict(arms["eager_normal"], mode="bcg"),
                              bcg_zero_deepstack=dict(arms["eager_zero_deepstack"], mode="bcg")), 2),
    (lambda arms: arms["bcg_normal"].update(mode="eager"), 2),
    (lambda arms: arms["eager_normal"]["token_logprobs"].__setitem__(3, float("nan")), 2),
    (lambda arms: arms["bcg_normal"]["evidence"].update(tap_calls=0), 2),  # its record says the tap fired
    (lambda arms: (arms["bcg_normal"]["evidence"].update(tap_calls=0), arms["bcg_normal"].update(deepstack_record=None)),
     4),  # a silent tap on an image request (rule 1b)
])
def test_verdict_refuses_to_pass_an_edited_file(parity_cli, tmp_path, edit, code):
    _, doc, _ = parity_cli.run()
    edit(doc["cases"][0]["arms"])
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(edited))
    assert result.exit_code == code and "Traceback" not in result.output, result.output


def test_verdict_recomputes_from_arms_alone(parity_cli, tmp_path):
    _, doc, out = parity_cli.run("--runner", "legacy")
    doc["verdict"] = {"code": "PASS", "reason": "forged"}
    doc["cases"][0]["verdict"] = {"code": "PASS", "reason": "forged"}
    doc["cases"][0]["comparisons"] = []
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(forged))
    assert result.exit_code == 1 and "FAIL_DEEPSTACK_DROPPED" in result.output
    recomputed = json.loads(parity_cli("verdict", str(forged), "--document").output)
    assert recomputed["verdict"]["code"] == "FAIL_DEEPSTACK_DROPPED" and len(recomputed["cases"][0]["comparisons"]) == 4
    verdicts = json.loads(parity_cli("verdict", str(forged), "--json").output)  # the verdicts, not the document
    assert verdicts["verdict"]["code"] == "FAIL_DEEPSTACK_DROPPED" and verdicts["exit_code"] == 1
    assert [c["code"] for c in verdicts["cases"]] == ["FAIL_DEEPSTACK_DROPPED"] and "comparisons" not in verdicts["cases"][0]
    # A tolerance large enough to hide every logprob difference cannot hide a token mismatch.
    doc["config"].update(logprob_tol=100.0, logprob_tol_source="user")
    forged.write_text(json.dumps(doc))
    assert parity_cli("verdict", str(forged)).exit_code == 1


def test_user_images_with_the_same_name_stay_two_cases(parity_cli, tmp_path):
    from parity.media.catalog import builtin_fixture

    for folder, name in (("a", "gradient-circle"), ("b", "checkerboard")):
        (tmp_path / folder).mkdir()
        builtin_fixture(name).image.save(tmp_path / folder / "mine.png")
    builtin_fixture("checkerboard").image.save(tmp_path / "rgb-stripes.png")
    result, doc, _ = parity_cli.run("--fixture", "rgb-stripes", "--image", str(tmp_path / "a" / "mine.png"),
                                    "--image", str(tmp_path / "b" / "mine.png"), "--image", str(tmp_path / "rgb-stripes.png"),
                                    "--prompt", "What is this?")
    assert result.exit_code == 0, result.output
    ids = [c["id"] for c in doc["cases"]]
    assert ids == ["rgb-stripes/prompt-1", "mine/prompt-1", "mine-2/prompt-1", "rgb-stripes-2/prompt-1"]
    assert doc["cases"][1]["fixture"]["sha256"] == builtin_fixture("gradient-circle").sha256
    assert doc["cases"][2]["fixture"]["sha256"] == builtin_fixture("checkerboard").sha256


def test_many_cases_share_one_model_and_one_preparation_per_request(parity_cli, tmp_path, monkeypatch):
    import parity.models as models
    from parity.models.qwen3_vl import Qwen3VLAdapter

    loads, prepares = [], []
    real_load, real_prepare = models.load_model, Qwen3VLAdapter.prepare
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    monkeypatch.setattr(Qwen3VLAdapter, "prepare", lambda self, *a: prepares.append(a) or real_prepare(self, *a))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# two prompts\nWhat colors?\n\nDescribe it.\n")
    junit = tmp_path / "junit.xml"
    result, doc, out = parity_cli.run("--fixture", "rgb-stripes", "--fixture", "checkerboard", "--prompts", str(prompts),
                                      "--junit", str(junit), "--repeat", "2")
    assert result.exit_code == 0, result.output
    assert [c["id"] for c in doc["cases"]] == ["rgb-stripes/prompt-1", "rgb-stripes/prompt-2",
                                               "checkerboard/prompt-1", "checkerboard/prompt-2"]
    assert len(loads) == 1 and len(prepares) == 4  # 4 requests x 4 arms x 2 repeats, prepared once each
    import xml.etree.ElementTree as ET

    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("tests") == "4" and len(suite.findall("testcase")) == 4
    assert "[16/16]" in result.output  # plain progress lines when not on a terminal
    assert all(len(a["repeats"]) == 1 for c in doc["cases"] for a in c["arms"].values())
    assert "self-delta" in (out / "report.md").read_text()


def test_repeat_on_a_nondeterministic_arm_is_inconclusive(parity_cli, monkeypatch):
    import dataclasses

    from parity.backends.transformers_backend import TransformersSession

    real = TransformersSession.answer
    calls = {"n": 0}

    def jittery(self, request, deepstack):
        answer = real(self, request, deepstack)
        calls["n"] += 1
        gen = answer.generation
        return dataclasses.replace(answer, generation=dataclasses.replace(
            # Every other run 3e-5 off: past the repeat floor (1e-5), within the teacher-forcing floor.
            gen, token_logprobs=tuple(lp + calls["n"] % 2 * 3e-5 for lp in gen.token_logprobs)))

    monkeypatch.setattr(TransformersSession, "answer", jittery)
    result, doc, _ = parity_cli.run("--repeat", "2")
    assert result.exit_code == 3 and doc["verdict"]["code"] == "INCONCLUSIVE_NONDETERMINISTIC"


def test_plot_is_written_and_linked(parity_cli, tmp_path):
    from parity.reporting.plots import PLOT_SIZE_PX

    out, summary = tmp_path / "plotted", tmp_path / "summary.md"
    result = parity_cli("run", "--device", "cpu", "--out", str(out), "--max-new-tokens", "4", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert result.exit_code == 0
    doc = json.loads((out / "results.json").read_text())
    plot = out / doc["cases"][0]["plot"]
    assert Image.open(plot).size == PLOT_SIZE_PX and f"]({plot.name})" in (out / "report.md").read_text()
    # A step summary cannot show the run folder's images: it links none.
    assert summary.read_text().startswith("## parity:") and "](" not in summary.read_text()


def test_compare_legacy_before_fixed_after(parity_cli):
    _, _, before = parity_cli.run("--runner", "legacy", name="before")
    _, _, after = parity_cli.run(name="after")
    result = parity_cli("compare", str(before / "results.json"), str(after / "results.json"))
    assert result.exit_code == 0
    assert "FAIL_DEEPSTACK_DROPPED" in result.output and "PASS" in result.output
    reverse = parity_cli("compare", str(after / "results.json"), str(before / "results.json"), "--format", "table")
    assert reverse.exit_code == 1


def test_step_summary_is_appended(parity_cli, tmp_path):
    summary = tmp_path / "summary.md"
    result = parity_cli("run", "--device", "cpu", "--out", str(tmp_path / "r"), "--no-plot", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert result.exit_code == 0 and summary.read_text().startswith("## parity:")


def test_report_stays_under_a_pr_comment_and_fences_hold(parity_cli):
    from dataclasses import replace

    from parity.reporting.report import render_markdown
    from parity.judge.verdict import judge_run

    _, _, out = parity_cli.run()
    run = load_results(out / "results.json")
    huge = tuple(replace(c, id=f"{c.id}-{i}", arms=tuple(replace(a, text="x" * 30_000) for a in c.arms))
                 for i, c in enumerate(run.cases * 3))
    markdown = render_markdown(judge_run(replace(run, cases=huge)))
    assert len(markdown) <= 65_536 and "## parity:" in markdown
    fence = "```\n## not a heading\n````"
    fenced = tuple(replace(c, arms=tuple(replace(a, text=fence) for a in c.arms)) for c in run.cases)
    markdown = render_markdown(judge_run(replace(run, cases=fenced)))
    assert "\n`````text\n" + fence + "\n`````\n" in markdown


def test_ctrl_c_keeps_every_finished_arm(parity_cli, tmp_path, monkeypatch):
    from parity.backends.transformers_backend import TransformersSession

    real = TransformersSession.answer
    calls = {"n": 0}

    def interrupted_on_the_third(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TransformersSession, "answer", interrupted_on_the_third)
    junit = tmp_path / "junit.xml"
    result, doc, out = parity_cli.run("--junit", str(junit))
    assert result.exit_code == 130 and "interrupted" in result.output
    assert doc["interrupted"] is True and doc["verdict"]["code"] == "INCOMPLETE"
    assert list(doc["cases"][0]["arms"]) == ["eager_normal", "eager_zero_deepstack"]
    assert "<testsuites" in junit.read_text() and "Interrupted" in (out / "report.md").read_text()
    assert not list(out.glob(".*.tmp"))


def test_thread_policy_one_for_presets_unless_the_user_says(parity_cli, tmp_path):
    import os
    import subprocess
    import sys

    import torch

    if (os.cpu_count() or 1) < 2:
        pytest.skip("--threads 2 needs two CPUs")
    try:
        _, doc, _ = parity_cli.run("--threads", "2", "--arms", "eager_normal")
        assert doc["environment"]["threads"] == 2
    finally:
        torch.set_num_threads(1)
    # A thread count set in the environment is the user's: parity leaves it (a fresh process reads it).
    out = tmp_path / "omp"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    subprocess.run([sys.executable, "-m", "parity", "run", "--device", "cpu", "--arms", "eager_normal", "--no-plot", "--out", str(out)],
                   env=env, capture_output=True, check=False, timeout=300)
    assert json.loads((out / "results.json").read_text())["environment"]["threads"] == 2
    _, doc, _ = parity_cli.run("--arms", "eager_normal", name="default")
    assert doc["environment"]["threads"] == 1
