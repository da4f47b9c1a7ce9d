"""`parity run` from the CLI on the embedded models: the verdicts the harness must give.

The fixed runner must PASS and every buggy variant must FAIL in the right way: the negative
controls are what make a PASS mean something.
"""

import json

import pytest
from PIL import Image

from parity.results import load_results


@pytest.mark.parametrize("model, args, code, exit_code", [
    ("tiny-qwen3-vl", [], "PASS", 0),
    ("tiny-qwen3-vl-moe", [], "PASS", 0),
    ("tiny-qwen3-vl", ["--runner", "legacy"], "FAIL_DEEPSTACK_DROPPED", 1),
    ("tiny-qwen3-vl-moe", ["--runner", "legacy"], "FAIL_DEEPSTACK_DROPPED", 1),
    ("tiny-qwen3-vl", ["--runner", "no-clear", "--scenario", "reuse"], "FAIL_STALE_STATE", 1),
    ("tiny-qwen3-vl", ["--scenario", "reuse"], "PASS", 0),
    ("tiny-qwen3-vl-nodeepstack", [], "INCONCLUSIVE_NO_POWER", 3),
    ("tiny-qwen3-vl", ["--arms", "eager_normal,eager_zero_deepstack"], "INCOMPLETE", 3),
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


def test_results_file_and_report_contents(parity_cli):
    result, doc, out = parity_cli.run()
    case = doc["cases"][0]
    assert doc["schema"] == "parity.results/1" and doc["config"]["max_new_tokens"] == 20
    assert doc["environment"]["device"] == "cpu" and doc["environment"]["sglang"] is None
    assert case["id"] == "rgb-stripes/describe" and case["fixture"]["size"] == [128, 96]
    assert list(case["arms"]) == ["eager_normal", "eager_zero_deepstack", "bcg_normal", "bcg_zero_deepstack"]
    for name, arm in case["arms"].items():
        record = arm["deepstack_record"]
        assert record["nonzero_rows"] > 0 and record["replay"] is name.startswith("bcg")
        assert len(arm["top_logprobs"][0]) == 5 and len(arm["token_ids"]) == 20
    assert len({a["deepstack_record"]["sha256"] for a in case["arms"].values()}) == 1
    report = (out / "report.md").read_text()
    for needle in ("graph replay sees DeepStack", case["fixture"]["sha256"], "<details>", "Environment and config"):
        assert needle in report
    assert [c["a"] for c in case["comparisons"]] == ["bcg_normal", "bcg_normal", "bcg_zero_deepstack", "eager_zero_deepstack"]


def test_verdict_recomputes_from_arms_alone(parity_cli, tmp_path):
    _, doc, out = parity_cli.run("--runner", "legacy")
    doc["verdict"] = {"code": "PASS", "reason": "forged"}
    doc["cases"][0]["verdict"] = {"code": "PASS", "reason": "forged"}
    doc["cases"][0]["comparisons"] = []
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(forged))
    assert result.exit_code == 1 and "FAIL_DEEPSTACK_DROPPED" in result.output
    recomputed = json.loads(parity_cli("verdict", str(forged), "--json").output)
    assert recomputed["verdict"]["code"] == "FAIL_DEEPSTACK_DROPPED" and len(recomputed["cases"][0]["comparisons"]) == 4
    # A tolerance large enough to hide every logprob difference cannot hide a token mismatch.
    doc["config"]["logprob_tol"] = 100.0
    forged.write_text(json.dumps(doc))
    assert parity_cli("verdict", str(forged)).exit_code == 1


@pytest.mark.parametrize("fmt, needle", [("markdown", "## parity:"), ("json", '"schema": "parity.results/1"'), ("table", "bcg_normal vs")])
def test_report_formats(parity_cli, fmt, needle):
    _, _, out = parity_cli.run()
    result = parity_cli("report", str(out / "results.json"), "--format", fmt)
    assert result.exit_code == 0 and needle in result.output


def test_user_image_and_prompt(parity_cli, tmp_path):
    from parity.fixtures import builtin_fixture

    builtin_fixture("gradient-circle").image.save(tmp_path / "mine.png")
    result, doc, _ = parity_cli.run("--image", str(tmp_path / "mine.png"), "--prompt", "What is this?")
    assert result.exit_code == 0, result.output
    assert doc["cases"][0]["id"] == "mine/prompt-1" and doc["cases"][0]["prompt"] == "What is this?"
    assert doc["cases"][0]["fixture"]["sha256"] == builtin_fixture("gradient-circle").sha256


def test_two_fixtures_by_two_prompts_share_one_model(parity_cli, tmp_path, monkeypatch):
    import parity.models as models

    loads = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# two prompts\nWhat colors?\n\nDescribe it.\n")
    junit = tmp_path / "junit.xml"
    result, doc, out = parity_cli.run("--fixture", "rgb-stripes", "--fixture", "checkerboard", "--prompts", str(prompts),
                                      "--junit", str(junit))
    assert result.exit_code == 0, result.output
    assert [c["id"] for c in doc["cases"]] == ["rgb-stripes/prompt-1", "rgb-stripes/prompt-2",
                                               "checkerboard/prompt-1", "checkerboard/prompt-2"]
    assert len(loads) == 1
    import xml.etree.ElementTree as ET

    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("tests") == "4" and len(suite.findall("testcase")) == 4
    assert "[16/16]" in result.output  # plain progress lines when not on a terminal


def test_repeat_passes_on_a_deterministic_model(parity_cli):
    result, doc, out = parity_cli.run("--repeat", "2")
    assert result.exit_code == 0
    assert all(len(a["repeats"]) == 1 for a in doc["cases"][0]["arms"].values())
    assert "self-delta" in (out / "report.md").read_text()


def test_repeat_on_a_nondeterministic_arm_is_inconclusive(parity_cli, monkeypatch):
    import dataclasses

    from parity.backends.transformers_backend import TransformersSession

    real = TransformersSession.generate
    calls = {"n": 0}

    def jittery(self, request, deepstack):
        gen = real(self, request, deepstack)
        calls["n"] += 1
        return dataclasses.replace(gen, token_logprobs=tuple(lp + calls["n"] * 1e-3 for lp in gen.token_logprobs))

    monkeypatch.setattr(TransformersSession, "generate", jittery)
    result, doc, _ = parity_cli.run("--repeat", "2")
    assert result.exit_code == 3 and doc["verdict"]["code"] == "INCONCLUSIVE_NONDETERMINISTIC"


def test_plot_is_written_and_linked(parity_cli, tmp_path):
    from parity.reporting.plots import PLOT_SIZE_PX

    out = tmp_path / "plotted"
    result = parity_cli("run", "--out", str(out))
    assert result.exit_code == 0
    doc = json.loads((out / "results.json").read_text())
    plot = out / doc["cases"][0]["plot"]
    assert Image.open(plot).size == PLOT_SIZE_PX and f"]({plot.name})" in (out / "report.md").read_text()


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
    result = parity_cli("run", "--out", str(tmp_path / "r"), "--no-plot", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert result.exit_code == 0 and summary.read_text().startswith("## parity:")


def test_report_stays_under_a_pr_comment(parity_cli):
    from dataclasses import replace

    from parity.reporting.report import render_markdown
    from parity.verdict import judge_run

    _, _, out = parity_cli.run()
    run = load_results(out / "results.json")
    huge = tuple(replace(c, arms=tuple(replace(a, text="x" * 30_000) for a in c.arms)) for c in run.cases * 3)
    markdown = render_markdown(judge_run(replace(run, cases=huge)))
    assert len(markdown) <= 65_536 and "## parity:" in markdown
