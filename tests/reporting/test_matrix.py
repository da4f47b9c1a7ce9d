"""The matrix report over several experiments (design §8): `parity report A B C`, `parity merge --matrix`.

Three real experiments on the tiny presets — the fixed runner (PASS), the legacy runner (the
DeepStack drop) and the model without DeepStack (no power) — over every scenario: each cell must be
that scenario's verdict, linked to its section, and the report must fit a PR comment.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.cli import cli
from parity.reporting.ci_summary import MAX_COMMENT_CHARS
from parity.reporting.matrix import experiments, render_matrix
from parity.reporting.report import render_full_markdown
from parity.results import SCENARIOS
from tests.helpers_runs import fixed_arms, legacy_arms, make_case, make_run, stream_case

EXPERIMENTS = {
    "fixed": (("--model", "tiny-qwen3-vl"), {"four-arm": "PASS", "reuse": "PASS", "stream": "PASS"}),
    "legacy": (("--model", "tiny-qwen3-vl", "--runner", "legacy"),
               {"four-arm": "FAIL_DEEPSTACK_DROPPED", "reuse": "FAIL_DEEPSTACK_DROPPED",
                "stream": "FAIL_DEEPSTACK_DROPPED"}),
    "nodeepstack": (("--model", "tiny-qwen3-vl-nodeepstack"),
                    {"four-arm": "INCONCLUSIVE_NO_POWER", "reuse": "INCONCLUSIVE_NO_POWER",
                     "stream": "INCONCLUSIVE_NO_POWER"}),
}
LABELS = {"fixed": "tiny-qwen3-vl · transformers · fixed runner, emulated graph · cpu",
          "legacy": "tiny-qwen3-vl · transformers · legacy runner, emulated graph · cpu",
          "nodeepstack": "tiny-qwen3-vl-nodeepstack · transformers · fixed runner, emulated graph · cpu"}


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False, prog_name="parity")


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny, tiny_nodeepstack) -> dict[str, str]:
    root = tmp_path_factory.mktemp("matrix")
    out = {}
    for name, (args, _) in EXPERIMENTS.items():
        result = invoke("run", "--device", "cpu", *args, "--scenario", "all", "--max-new-tokens", "4", "--no-plot",
                        "--out", str(root / name))
        assert result.exit_code in (0, 1, 3), result.output
        out[name] = str(root / name / "results.json")
    return out


def cells(markdown: str) -> dict[str, dict[str, tuple[str, str]]]:
    """The matrix table: row label -> scenario -> (verdict, link target)."""
    all_lines = markdown.splitlines()
    start = all_lines.index(next(ln for ln in all_lines if ln.startswith("| experiment |")))
    lines = []
    for line in all_lines[start:]:
        if not line.startswith("|"):
            break
        lines.append(line)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    table = {}
    for line in lines[2:]:
        row = [c.strip() for c in line.strip("|").split("|")]
        label = re.sub(r"^\[\d+\. (.*)\]\(#e\d+\)$", r"\1", row[0])
        table[label] = {}
        for scenario, cell in zip(header[1:-1], row[1:-1]):
            match = re.fullmatch(r"\[\S+ `(\w+)`\]\(#([\w-]+)\)", cell)
            table[label][scenario] = (match[1], match[2]) if match else (cell, None)
    return table


def test_matrix_report_of_three_experiments(files):
    result = invoke("report", *files.values())
    assert result.exit_code == 1  # the matrix verdict's code, as `verdict` and `merge` exit
    assert invoke("report", "--exit-zero", *files.values()).exit_code == 0  # rendering only
    markdown = result.output
    assert len(markdown) <= MAX_COMMENT_CHARS
    assert markdown.startswith("## parity matrix: ❌ `FAIL_DEEPSTACK_DROPPED`")  # the worst experiment's
    table = cells(markdown)
    assert list(table) == [LABELS[name] for name in EXPERIMENTS]
    for name, (_, expected) in EXPERIMENTS.items():
        for scenario, code in expected.items():
            verdict, target = table[LABELS[name]][scenario]
            assert verdict == code, (name, scenario)
            assert f'<a name="{target}"></a>' in markdown  # the link lands on its section
    # Passing sections are folded; a failing one is open, with its cases' reasons.
    assert "<details><summary>four-arm: ✅ PASS (1 case(s))</summary>" in markdown
    assert "#### four-arm: ❌ FAIL_DEEPSTACK_DROPPED (1 case(s))" in markdown
    assert "graph read deepstack rows \\[6, 7" in markdown  # the freshness witness's reason, escaped


def test_the_cells_are_each_files_own_verdicts(files):
    """Negative control on the table: every cell is what `parity verdict` says of that file's cases."""
    table = cells(invoke("report", *files.values()).output)
    for name, path in files.items():
        lines = invoke("verdict", path).output.splitlines()[:-1]
        per_case = dict(line.split(": ", 2)[:2] for line in lines)
        for case_id, code in per_case.items():
            scenario = case_id.split("/")[0] if case_id.split("/")[0] in SCENARIOS else "four-arm"
            assert table[LABELS[name]][scenario][0] == code


def test_merge_matrix_writes_each_experiment_and_exits_with_the_worst(files, tmp_path):
    out = tmp_path / "merged"
    result = invoke("merge", "--matrix", files["nodeepstack"], files["fixed"], "--out", str(out), "--no-plot",
                    "--junit", str(out / "junit.xml"))
    assert result.exit_code == 3  # no experiment failed, one has no power: not proven
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(folders) == 2 and folders[0].startswith("1-tiny-qwen3-vl-nodeepstack")
    for folder in folders:
        assert json.loads((out / folder / "results.json").read_text())["cases"]
        assert (out / folder / "report.md").read_text().startswith("## parity: ")
    assert (out / "report.md").read_text().startswith("## parity matrix: ❌ `INCONCLUSIVE_NO_POWER`")
    junit = (out / "junit.xml").read_text()
    assert junit.count("<testsuite ") == 2 and f'tests="{2 * len(SCENARIOS)}"' in junit.splitlines()[1]
    # Without --matrix, two experiments are refused, naming the field they differ in.
    refused = invoke("merge", files["nodeepstack"], files["fixed"], "--out", str(tmp_path / "no"))
    assert refused.exit_code == 2 and "config.model" in refused.output


def test_report_table_and_json_for_several_files(files):
    table = invoke("report", "--format", "table", *files.values())
    assert table.exit_code == 1 and "FAIL_DEEPSTACK_DROPPED" in table.output and "parity matrix" in table.output
    doc = json.loads(invoke("report", "--format", "json", *files.values()).output)
    assert [e["label"] for e in doc["experiments"]] == [LABELS[n] for n in EXPERIMENTS]
    assert doc["experiments"][1]["scenarios"]["stream"] == "FAIL_DEEPSTACK_DROPPED"


# --- size and labels, on synthetic runs ---------------------------------------------------------

def _long(run, chars: int):
    """The run with every arm's text `chars` long: what a verbose model does to a report."""
    def arm(a):
        return dataclasses.replace(a, text=("word " * chars)[:chars])

    cases = [dataclasses.replace(c, arms=tuple(map(arm, c.arms)),
                                 requests=tuple(dataclasses.replace(r, arms=tuple(map(arm, r.arms)))
                                                for r in c.requests)) for c in run.cases]
    return dataclasses.replace(run, cases=tuple(cases))


def _experiment(model: str, failing: int = -1, n: int = 40, **kwargs):
    cases = [make_case(legacy_arms() if i == failing else fixed_arms(), case_id=f"fixture-{i}/describe")
             for i in range(n)] + [stream_case()]
    return _long(make_run(cases, model=model, **kwargs), 4000)


def test_matrix_stays_under_a_pr_comment_by_folding_what_passed():
    runs = [_experiment("model-a"), _experiment("model-b", failing=7), _experiment("model-c")]
    assert sum(len(render_full_markdown(r)) for r in runs) > MAX_COMMENT_CHARS  # the reports, one after another
    markdown = render_matrix(runs)
    assert len(markdown) <= MAX_COMMENT_CHARS
    table = cells(markdown)
    assert [row["four-arm"][0] for row in table.values()] == ["PASS", "FAIL_DEEPSTACK_DROPPED", "PASS"]
    # What failed is shown whole; what passed is a line.
    assert "##### `fixture-7/describe`: `FAIL_DEEPSTACK_DROPPED`" in markdown
    assert "- `fixture-8/describe`: ✅ PASS" in markdown
    assert "details of passing cases were left out to fit a PR comment" in markdown


def test_rows_that_would_read_the_same_name_what_differs():
    rows = experiments([make_run([make_case(fixed_arms())], logprob_tol=0.25),
                        make_run([make_case(fixed_arms())], logprob_tol=0.5)])
    assert rows[0].label != rows[1].label and rows[1].label.endswith("logprob_tol 0.5")


def test_matrix_of_identical_experiments_is_a_duplicate_not_two_rows(files, tmp_path):
    copy = tmp_path / "again.json"
    copy.write_text(Path(files["fixed"]).read_text())
    result = invoke("report", files["fixed"], str(copy))
    assert result.exit_code == 2 and "duplicate" in result.output


def test_one_file_report_is_unchanged(files):
    result = invoke("report", files["fixed"])
    assert result.exit_code == 0 and result.output.startswith("## parity: ✅ `PASS`")
    assert "parity matrix" not in result.output


def test_merge_and_the_matrix_import_nothing_heavy(tmp_path):
    from parity.results import write_results
    from tests.test_imports import heavy_imports

    for name, tol in (("a", 0.25), ("b", 0.5)):
        write_results(make_run([make_case(fixed_arms())], logprob_tol=tol), tmp_path / f"{name}.json")
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    assert heavy_imports("report", a, b) == []
    assert heavy_imports("merge", "--matrix", a, b, "--no-plot", "--out", str(tmp_path / "m")) == []
    assert (tmp_path / "m" / "report.md").exists()
