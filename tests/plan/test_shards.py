"""`parity run --shard K/N` and `parity merge` (design §8): shards of one run merge into that run.

The run is the tiny preset over two fixtures and every scenario (six cases), once whole and once in
three shards; the merge must give the same cases, comparisons and verdict. Each refusal of the merge
has its negative control: the file that does not belong is named, with the field, and exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.arms import select_arms
from parity.backends.protocol import Request
from parity.cli import cli
from parity.run.planning import CaseSpec, RunSpec, plan_cases
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import default_prompts
from parity.judge.identity import first_difference, identity
from parity.judge.metrics import NOISE_FLOOR
from parity.plan.entries import PlanEntry, text_sha256
from parity.plan.sharding import Shard, assignment, partition
from tests.helpers_runs import fixed_arms, make_case, make_run

RUN_ARGS = ("--fixture", "rgb-stripes", "--fixture", "quadrants", "--scenario", "all", "--max-new-tokens", "4",
            "--no-plot")
SHARDS = 3


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False, prog_name="parity")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny) -> dict[str, Path]:
    """The whole run and its three shards, each a results.json (read-only: tests copy before editing)."""
    root = tmp_path_factory.mktemp("shards")
    paths = {}
    for name, extra in [("whole", ())] + [(f"s{k}", ("--shard", f"{k}/{SHARDS}")) for k in range(1, SHARDS + 1)]:
        result = invoke("run", "--device", "cpu", "--out", str(root / name), *RUN_ARGS, *extra)
        assert result.exit_code == 0, result.output
        paths[name] = root / name / "results.json"
    return paths


def shard_files(runs) -> list[str]:
    return [str(runs[f"s{k}"]) for k in range(1, SHARDS + 1)]


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def edited(runs, tmp_path: Path, name: str, edit) -> str:
    doc = load(runs[name])
    edit(doc)
    path = tmp_path / f"{name}-edited.json"
    path.write_text(json.dumps(doc))
    return str(path)


# --- the partition -----------------------------------------------------------------------------------

def test_shards_partition_the_whole_run(runs):
    whole = [c["id"] for c in load(runs["whole"])["cases"]]
    seen = []
    for k in range(1, SHARDS + 1):
        doc = load(runs[f"s{k}"])
        assert doc["config"]["shard"]["index"] == k and doc["config"]["shard"]["count"] == SHARDS
        assert list(doc["config"]["shard"]["cases"]) == whole  # every shard knows the whole plan, in plan order
        ids = [c["id"] for c in doc["cases"]]
        assert ids and ids == [c for c, s in doc["config"]["shard"]["cases"].items() if s == k]
        seen += ids
    assert sorted(seen) == sorted(whole)  # each case in exactly one shard
    # Each shard captured what the whole run needs, so its runner is the unsharded run's.
    assert {json.dumps(load(runs[f"s{k}"])["config"]["captured_buckets"]) for k in (1, 2, 3)} == {
        json.dumps(load(runs["whole"])["config"]["captured_buckets"])}


def test_merge_gives_the_unsharded_run(runs, tmp_path):
    out = tmp_path / "merged"
    result = invoke("merge", *shard_files(runs), "--out", str(out), "--junit", str(out / "junit.xml"), "--no-plot")
    whole, merged = load(runs["whole"]), load(out / "results.json")
    assert result.exit_code == 0 and "PASS" in result.output
    assert [c["id"] for c in merged["cases"]] == [c["id"] for c in whole["cases"]]
    for a, b in zip(merged["cases"], whole["cases"]):
        assert a["verdict"]["code"] == b["verdict"]["code"]
        assert len(a["comparisons"]) == len(b["comparisons"])
        for ca, cb in zip(a["comparisons"], b["comparisons"]):
            assert (ca["a"], ca["b"], ca.get("request"), ca["token_match"], ca["match"]) == (
                cb["a"], cb["b"], cb.get("request"), cb["token_match"], cb["match"])
            assert abs(ca["logprob_delta"] - cb["logprob_delta"]) <= NOISE_FLOOR
    assert merged["verdict"] == whole["verdict"]
    assert merged["config"]["shard"] == {"count": 3, "cases": load(runs["s1"])["config"]["shard"]["cases"],
                                         "merged": [1, 2, 3], "missing": []}
    n = len(whole["cases"])
    assert f"Merged from shard(s) 1, 2, 3 of 3: {n} of {n} planned cases" in (out / "report.md").read_text()
    assert f'tests="{n}"' in (out / "junit.xml").read_text()
    again = invoke("verdict", str(out / "results.json"))  # the merged file re-judges to the same
    assert again.exit_code == 0 and again.output.strip().endswith(whole["verdict"]["reason"])


def test_merge_never_trusts_stored_verdicts(runs, tmp_path):
    def claim_failure(doc):
        for case in doc["cases"]:
            case["verdict"] = {"code": "FAIL_GRAPH_DIVERGES", "reason": "edited"}
        doc["verdict"] = {"code": "FAIL_GRAPH_DIVERGES", "reason": "edited"}

    files = [edited(runs, tmp_path, "s1", claim_failure)] + shard_files(runs)[1:]
    result = invoke("merge", *files, "--out", str(tmp_path / "m"), "--no-plot")
    assert result.exit_code == 0 and load(tmp_path / "m" / "results.json")["verdict"]["code"] == "PASS"


def test_a_shard_is_the_shards_verdict_and_says_so(runs):
    report = (runs["s2"].parent / "report.md").read_text()
    assert "Shard 2 of 3:" in report and f"of the run's {len(load(runs['whole'])['cases'])} planned cases" in report


# --- refusals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, companions", [
    ("model", "tiny-qwen3-vl-moe", {}),
    ("logprob_tol", 0.5, {"logprob_tol_source": "user"}), ("tie_margin", 0.2, {"tie_margin_source": "user"}),
    ("runner", "legacy", {}),
    ("graph_backend", "cuda", {}), ("max_new_tokens", 5, {}),
])
def test_merge_refuses_another_experiment(runs, tmp_path, field, value, companions):
    def edit(doc):
        doc["config"].update({field: value, **companions})
        if field == "model":  # the same weights under another name: the identity names the model too
            doc["config"]["model_identity"]["name"] = value

    other = edited(runs, tmp_path, "s2", edit)
    result = invoke("merge", str(runs["s1"]), other, str(runs["s3"]), "--out", str(tmp_path / "m"))
    assert result.exit_code == 2
    assert other in result.output and f"config.{field}" in result.output and "same experiment" in result.output
    assert not (tmp_path / "m" / "results.json").exists()


@pytest.mark.parametrize("field, value, message", [
    # An in-process run relabelled as SGLang's lacks what every SGLang run writes (v6).
    ("backend", "sglang", "config.sglang_args is missing: every sglang run writes it"),
    ("dtype", "bfloat16", "logprob_tol_source 'auto' gives 0.75 for dtype 'bfloat16'"),  # its records are float32 too
    ("scenarios", ["four-arm"], "config.plan"),  # the plan is scenario-major over config.scenarios
])
def test_a_shard_relabelled_as_another_experiment_is_refused_on_load(runs, tmp_path, field, value, message):
    other = edited(runs, tmp_path, "s2", lambda doc: doc["config"].__setitem__(field, value))
    result = invoke("merge", str(runs["s1"]), other, str(runs["s3"]), "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and other in result.output and message in result.output


def test_merge_refuses_another_gpu(runs, tmp_path):
    other = edited(runs, tmp_path, "s3", lambda doc: doc["environment"].__setitem__("gpu", "NVIDIA H200"))
    result = invoke("merge", *shard_files(runs)[:2], other, "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and "environment.gpu" in result.output and other in result.output


def test_merge_refuses_a_duplicate_shard(runs, tmp_path):
    copy = tmp_path / "copy-of-shard-2.json"
    shutil.copy(runs["s2"], copy)
    result = invoke("merge", *shard_files(runs), str(copy), "--out", str(tmp_path / "m"))
    assert result.exit_code == 2
    assert str(copy) in result.output and str(runs["s2"]) in result.output and "duplicate" in result.output


def test_merge_refuses_a_missing_shard(runs, tmp_path):
    result = invoke("merge", str(runs["s1"]), str(runs["s3"]), "--out", str(tmp_path / "m"))
    assert result.exit_code == 2
    assert "shard 2/3 is missing" in result.output and "config.shard.index" in result.output
    assert "--allow-missing 2" in result.output


def test_a_shard_missing_on_purpose_is_at_best_incomplete(runs, tmp_path):
    out = tmp_path / "m"
    result = invoke("merge", str(runs["s1"]), str(runs["s3"]), "--allow-missing", "2", "--out", str(out), "--no-plot")
    doc = load(out / "results.json")
    # Every case that was merged passed; the missing shard's cases were never judged.
    assert {c["verdict"]["code"] for c in doc["cases"]} == {"PASS"}
    assert result.exit_code == 3 and doc["verdict"]["code"] == "INCOMPLETE"
    assert "shard(s) 2 of 3 not merged" in doc["verdict"]["reason"]
    assert doc["config"]["shard"]["missing"] == [2]
    again = invoke("verdict", str(out / "results.json"))  # re-judging the file keeps it INCOMPLETE
    assert again.exit_code == 3 and "INCOMPLETE" in again.output.splitlines()[-1]


@pytest.mark.parametrize("allow, message", [("1", "shard 1/3 is in"), ("4", "the run has shards 1 to 3")])
def test_allow_missing_names_a_missing_shard(runs, tmp_path, allow, message):
    result = invoke("merge", *shard_files(runs), "--allow-missing", allow, "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and message in result.output


def test_a_shard_file_without_one_of_its_cases_is_incomplete_naming_it(runs, tmp_path):
    name = max((f"s{k}" for k in range(1, SHARDS + 1)), key=lambda n: len(load(runs[n])["cases"]))
    gone = load(runs[name])["cases"][-1]["id"]
    dropped = edited(runs, tmp_path, name, lambda doc: doc["cases"].pop())
    others = [str(runs[f"s{k}"]) for k in range(1, SHARDS + 1) if f"s{k}" != name]
    for command in (("merge", dropped, *others, "--out", str(tmp_path / "m"), "--no-plot"), ("verdict", dropped)):
        result = invoke(*command)
        assert result.exit_code == 3 and "INCOMPLETE" in result.output and gone in result.output, result.output


def test_a_merged_file_with_a_case_removed_is_incomplete(runs, tmp_path):
    out = tmp_path / "m"
    assert invoke("merge", *shard_files(runs), "--out", str(out), "--no-plot").exit_code == 0
    doc = load(out / "results.json")
    doc["cases"] = [c for c in doc["cases"] if not c["id"].startswith("stream/")]  # hide a failure, say
    (out / "results.json").write_text(json.dumps(doc))
    result = invoke("verdict", str(out / "results.json"))
    assert result.exit_code == 3 and "stream/" in result.output.splitlines()[-1]
    assert "planned case (config.plan) the file does not hold" in result.output


def test_a_case_of_another_shard_or_none_is_refused(runs, tmp_path):
    s1, s2 = load(runs["s1"]), load(runs["s2"])
    moved = edited(runs, tmp_path, "s1", lambda doc: doc["cases"].append(s2["cases"][0]))
    result = invoke("verdict", moved)
    assert result.exit_code == 2 and "which this file does not cover" in result.output
    invented = edited(runs, tmp_path, "s1", lambda doc: doc["cases"][0].update(id="made-up/prompt-1"))
    result = invoke("verdict", invented)
    assert result.exit_code == 2 and "not a case of config.plan" in result.output
    assert s1["config"]["plan"] == s2["config"]["plan"]  # every shard records the whole plan


# --- --shard -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["0/3", "4/3", "3", "a/b", "1/0"])
def test_shard_option_is_checked(tmp_path, spec):
    result = invoke("run", "--shard", spec, "--out", str(tmp_path / "r"))
    assert result.exit_code == 2 and "--shard" in result.output and not (tmp_path / "r").exists()


def test_more_shards_than_cases_is_a_usage_error(tmp_path):
    result = invoke("run", "--device", "cpu", "--shard", "2/2", "--out", str(tmp_path / "r"))  # one four-arm case
    assert result.exit_code == 2 and "plans only 1 case(s)" in result.output and not (tmp_path / "r").exists()


def test_partition_is_balanced_and_fills_every_shard():
    costs = [(f"c{i}", c) for i, c in enumerate([11, 5, 4] * 7)]
    for count in (1, 2, 3, 4, 7):
        shards = partition(costs, count)
        loads = [sum(c for i, c in costs if shards[i] == k) for k in range(1, count + 1)]
        assert all(loads) and max(loads) <= sum(loads) / count + 11  # within one case of the mean
    assert partition(costs, 3) == partition(list(costs), 3)  # a function of its input alone


class _Lengths:
    """Enough of a backend to plan cases: no model, prompt lengths from the text."""

    max_positions = None

    def prompt_length(self, request: Request) -> int:
        return len(request.prompt) + (64 if request.fixture is not None else 0)

    def bucket_of(self, tokens: int):
        return None


def _assigned(fixture_names):
    cases = tuple(CaseSpec(f, default_prompts(f)[0]) for f in map(builtin_fixture, fixture_names))
    spec = RunSpec(model="tiny-qwen3-vl", arms=select_arms("all"), cases=cases,
                   scenarios=("four-arm", "reuse", "stream"), shard=Shard(1, 3))
    plan = [PlanEntry(c.id, c.scenario, c.spec.fixture.sha256, text_sha256(c.spec.prompt.text), 1)
            for c in plan_cases(spec, _Lengths())]
    return assignment(plan, [a.name for a in spec.arms], 3)


def test_appending_a_fixture_moves_no_case():
    before = _assigned(["rgb-stripes", "quadrants", "bands"])
    after = _assigned(["rgb-stripes", "quadrants", "bands", "mosaic"])
    assert len(after) == len(before) + 3 and {k: after[k] for k in before} == before
    # The negative control: putting it first reshuffles (what "appended at the end" protects against).
    assert {k: v for k, v in _assigned(["mosaic", "rgb-stripes", "quadrants", "bands"]).items() if k in before} != before


def test_a_gpu_runs_cpu_threads_do_not_split_an_experiment():
    def on(device, threads):
        run = make_run([make_case(fixed_arms())])
        return dataclasses.replace(run, environment={**run.environment, "device": device, "threads": threads})

    assert first_difference(identity(on("cuda", 8)), identity(on("cuda", 64))) is None
    assert first_difference(identity(on("cpu", 1)), identity(on("cpu", 2))) == "environment.threads"


# --- every shard of a common plan (issue 21) ----------------------------------------------------------

@pytest.mark.parametrize("scenario, counts", [("four-arm", (2, 3, 4, 5, 6)), ("all", (2, 3, 4, 5, 6))])
def test_every_shard_rejudges_and_merges_back_to_the_unsharded_verdict(tmp_path, tiny, scenario, counts):
    """Genuine shards of `--fixture all`: each file is one `parity verdict` accepts, with the shard's own
    verdict, and the merge of all N is the unsharded run, case by case."""
    common = ("--fixture", "all", "--scenario", scenario, "--max-new-tokens", "2", "--no-plot")
    assert invoke("run", "--device", "cpu", "--out", str(tmp_path / "whole"), *common).exit_code == 0
    whole = load(tmp_path / "whole" / "results.json")
    for count in counts:
        files = []
        for k in range(1, count + 1):
            out = tmp_path / f"{count}-{k}"
            ran = invoke("run", "--device", "cpu", "--out", str(out), *common, "--shard", f"{k}/{count}")
            files.append(str(out / "results.json"))
            again = invoke("verdict", files[-1])
            assert again.exit_code == ran.exit_code == 0, again.output
            assert f"judged shard {k} of {count}" in again.output
        merged = tmp_path / f"merged-{count}"
        result = invoke("merge", *files, "--out", str(merged), "--no-plot")
        assert result.exit_code == 0, result.output
        doc = load(merged / "results.json")
        assert [(c["id"], c["verdict"]) for c in doc["cases"]] == [(c["id"], c["verdict"]) for c in whole["cases"]]
        assert doc["verdict"] == whole["verdict"]
