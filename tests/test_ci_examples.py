"""The CI examples run as written (examples/ci/): shards on one machine, then the merge and the gate.

The test reads the workflow files, runs every `run:` step of the GitHub Actions shard job (once per
shard) and merge job with bash, as the runner would, emulating only what belongs to GitHub: the
`${{ }}` expressions, the artifact upload and download, and `gh` (a stub that records the comment).
The GitLab file's script lines must be the very same lines, and its merge job runs on the same
shards with `curl` stubbed. Two things differ from a real CI run: the experiment (PARITY_RUN) is
the tiny preset on the CPU instead of the 8B model on SGLang, and only the first GPU kind of the
matrix is run (one CPU cannot be two GPU kinds: its shards would be duplicates, and the merge
refuses those).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from parity.results import SCENARIOS

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "ci"
TINY_RUN = "--model tiny-qwen3-vl --fixture rgb-stripes --scenario all --max-new-tokens 4 --no-plot"
PR_NUMBER = "42"
KNOWN_CONDITIONS = {"always()", "always() && github.event_name == 'pull_request'"}


def workflow() -> dict:
    return yaml.safe_load((EXAMPLES / "github-actions.yml").read_text())


def gitlab() -> dict:
    return yaml.safe_load((EXAMPLES / "gitlab-ci.yml").read_text())


def stubs(folder: Path) -> Path:
    """`parity` from this checkout, and recording stand-ins for the CI systems' own tools."""
    folder.mkdir(parents=True, exist_ok=True)
    scripts = {
        "parity": f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m parity "$@"\n',
        # gh pr comment N --repo R --body-file F: keep the arguments and the body it would post.
        "gh": '#!/bin/sh\necho "$@" >> "$STUB_LOG/gh.args"\nwhile [ $# -gt 0 ]; do\n'
              '  [ "$1" = --body-file ] && cp "$2" "$STUB_LOG/gh.body"\n  shift\ndone\n',
        "curl": '#!/bin/sh\necho "$@" >> "$STUB_LOG/curl.args"\nfor a in "$@"; do\n'
                '  case "$a" in body@*) cp "${a#body@}" "$STUB_LOG/curl.body";; esac\ndone\n',
    }
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


class GithubRunner:
    """Runs a job's steps as GitHub Actions would, on this machine."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp = tmp
        self.env = env
        self.artifacts = tmp / "artifacts"
        self.outputs: dict[str, dict[str, str]] = {}

    def expand(self, text: str, matrix: dict) -> str:
        values = {f"matrix.{k}": str(v) for k, v in matrix.items()}
        values.update({"github.token": "token", "github.event.pull_request.number": PR_NUMBER})
        values.update({f"steps.{step}.outputs.{k}": v for step, out in self.outputs.items() for k, v in out.items()})

        def value(match: re.Match) -> str:
            expression = match[1].strip()
            assert expression in values, f"the test does not know the expression {expression!r}"
            return values[expression]

        return re.sub(r"\$\{\{(.*?)\}\}", value, str(text))

    def run_job(self, job: dict, folder: Path, matrix: dict) -> int | None:
        """Every step in order; the last run step's exit code (None: no run step ran)."""
        folder.mkdir(parents=True)
        code = None
        for step in job["steps"]:
            assert step.get("if", "always()") in KNOWN_CONDITIONS, step.get("if")
            uses = step.get("uses", "")
            if uses.startswith("actions/upload-artifact"):
                name, path = (self.expand(step["with"][k], matrix) for k in ("name", "path"))
                if (folder / path).exists():
                    shutil.copytree(folder / path, self.artifacts / name)
            elif uses.startswith("actions/download-artifact"):
                target = folder / self.expand(step["with"]["path"], matrix)
                for artifact in sorted(self.artifacts.iterdir()):
                    if fnmatch.fnmatch(artifact.name, step["with"]["pattern"]):
                        shutil.copytree(artifact, target / artifact.name)
            elif "run" in step and step.get("id") != "install":  # parity is installed already
                code = self.run_step(step, folder, matrix)
        return code

    def run_step(self, step: dict, folder: Path, matrix: dict) -> int:
        output = folder / f".output-{step.get('id', 'step')}"
        output.touch()
        env = {**self.env, "GITHUB_OUTPUT": str(output),
               **{k: self.expand(v, matrix) for k, v in step.get("env", {}).items()}}
        script = self.expand(step["run"], matrix)
        assert step.get("shell") == "bash"
        # What `shell: bash` runs: bash --noprofile --norc -eo pipefail {0}
        result = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                                cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        if step.get("id"):
            self.outputs[step["id"]] = dict(line.split("=", 1) for line in output.read_text().splitlines() if line)
        self.log = getattr(self, "log", "") + result.stdout + result.stderr
        return result.returncode


@pytest.fixture(scope="module")
def github(tmp_path_factory):
    """The GitHub workflow's shard jobs (first GPU kind) and merge job, run; the runner and its paths."""
    tmp = tmp_path_factory.mktemp("ci")
    doc = workflow()
    env = {**os.environ, **{k: str(v) for k, v in doc["env"].items()}, "PARITY_RUN": TINY_RUN,
           "PATH": f"{stubs(tmp / 'bin')}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(tmp),
           "GITHUB_STEP_SUMMARY": str(tmp / "summary.md"), "GITHUB_REPOSITORY": "owner/repo"}
    env.pop("PYTHONPATH", None)
    runner = GithubRunner(tmp, env)
    matrix = doc["jobs"]["shard"]["strategy"]["matrix"]
    gpu = matrix["gpu"][0]
    for shard in matrix["shard"]:
        code = runner.run_job(doc["jobs"]["shard"], tmp / f"shard-{shard}", {"gpu": gpu, "shard": shard})
        assert code == 0, runner.log
    runner.gate = runner.run_job(doc["jobs"]["merge"], tmp / "merge", {})
    return runner


def test_the_two_examples_run_the_same_commands():
    gh, gl = workflow(), gitlab()
    steps = {s["name"]: s for job in gh["jobs"].values() for s in job["steps"] if "name" in s}
    assert steps["Run this shard of the experiment"]["run"].strip().splitlines() == gl["parity-shard"]["script"]
    assert steps["Merge the shards"]["run"].strip().splitlines()[0] == gl["parity-merge"]["script"][0]
    assert gh["env"]["PARITY_RUN"] == gl["variables"]["PARITY_RUN"]
    # The shard count the command line gives is the matrix's.
    assert int(gh["env"]["PARITY_SHARDS"]) == len(gh["jobs"]["shard"]["strategy"]["matrix"]["shard"])
    assert int(gl["variables"]["PARITY_SHARDS"]) == len(gl["parity-shard"]["parallel"]["matrix"][0]["SHARD"])


def test_github_shards_then_merge_pass_and_post_the_report(github):
    merged = github.tmp / "merge" / "parity-merged"
    report = (merged / "report.md").read_text()
    assert github.gate == 0, github.log  # the gate step: the tiny preset's fixed runner passes
    assert report.startswith("## parity matrix: ✅ `PASS`")
    folders = [p for p in merged.iterdir() if p.is_dir()]
    assert len(folders) == 1  # one experiment (one GPU kind), merged from its three shards
    doc = json.loads((folders[0] / "results.json").read_text())
    assert len(doc["cases"]) == len(SCENARIOS) and doc["config"]["shard"]["merged"] == [1, 2, 3]
    assert f'tests="{len(SCENARIOS)}"' in (merged / "junit.xml").read_text()
    assert report in (github.tmp / "summary.md").read_text()  # the job summary
    assert (github.tmp / "gh.args").read_text().split() == [
        "pr", "comment", PR_NUMBER, "--repo", "owner/repo", "--body-file", "parity-merged/report.md"]
    assert (github.tmp / "gh.body").read_text() == report  # the PR comment


def test_github_merge_gates_red_on_a_missing_shard(github, tmp_path):
    runner = GithubRunner(tmp_path, github.env)
    shutil.copytree(github.artifacts, runner.artifacts)
    shutil.rmtree(next(runner.artifacts.glob("*-shard-2")))  # a shard job that died before its upload
    code = runner.run_job(workflow()["jobs"]["merge"], tmp_path / "merge", {})
    assert code == 2 and "shard 2/3 is missing" in runner.log


def test_gitlab_merge_job_on_the_same_shards(github, tmp_path):
    gl = gitlab()
    job = tmp_path / "merge"
    job.mkdir()
    shard_path = gl["parity-shard"]["artifacts"]["paths"][0]
    for artifact in github.artifacts.glob("parity-*-shard-*"):  # `needs:` brings each shard's artifacts
        gpu, k = re.fullmatch(r"parity-(\w+)-shard-(\d+)", artifact.name).groups()
        shutil.copytree(artifact, job / shard_path.replace("$GPU", gpu).replace("$SHARD", k))
    env = {**github.env, "STUB_LOG": str(tmp_path), "CI_MERGE_REQUEST_IID": "7", "PARITY_BOT_TOKEN": "secret",
           "CI_API_V4_URL": "https://gitlab.example/api/v4", "CI_PROJECT_ID": "9"}
    env.pop("GITHUB_STEP_SUMMARY")
    # GitLab's bash runs the script lines as one script under `set -eo pipefail`.
    result = subprocess.run(["bash", "-eo", "pipefail", "-c", "\n".join(gl["parity-merge"]["script"])], cwd=job,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = (job / "parity-merged" / "report.md").read_text()
    assert (tmp_path / "curl.body").read_text() == report
    assert "https://gitlab.example/api/v4/projects/9/merge_requests/7/notes" in (tmp_path / "curl.args").read_text()
    assert (job / gl["parity-merge"]["artifacts"]["reports"]["junit"]).exists()
