"""Shared fixtures: every embedded model is built once per test run (session scope).

The suite means the CPU: models load there and runs say `--device cpu`, so a GPU host runs the
same tests (the emulated graph, the CPU noise floors). A test of `--device auto` asserts what auto
resolves to on the machine at hand; the tests that need CUDA are marked `gpu` (tests/gpu/).
"""

from __future__ import annotations

import os

# Tests never reach a model hub; set before huggingface_hub is imported, which reads it once.
os.environ["HF_HUB_OFFLINE"] = "1"

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from parity.backends.options import PRESET_THREADS
from parity.cli import cli
from parity.models import LoadedModel, load_model

# The thread policy `parity run` applies to the embedded presets, for tests that call the library.
torch.set_num_threads(PRESET_THREADS)


@pytest.fixture(scope="session", autouse=True)
def every_run_rejudges_the_same():
    """Every run the suite makes, through the CLI or the library, is written and read back, and
    `parity verdict` of its file must say exactly what the run said (design §4b: the run applies
    every rule of the loader to itself)."""
    import parity.run.experiment
    from parity.results import dumps
    from parity.trust.loader import run_from_json
    from parity.judge.verdict import judge_run

    real = parity.run.experiment._run_result

    def checked(*args, **kwargs):
        run = real(*args, **kwargs)
        if "plan" not in run.config:  # stopped before the prompts were measured: nothing is written
            return run
        again = judge_run(run_from_json(json.loads(dumps(run)), "<the run's own file>"))
        held = [c for c in again.cases if not c.absent]
        assert [(c.id, c.verdict) for c in held] == [(c.id, c.verdict) for c in run.cases]
        assert again.verdict == run.verdict and len(held) == len(again.cases)
        return run

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parity.run.experiment, "_run_result", checked)
        yield


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny-qwen3-vl", device="cpu")


@pytest.fixture(scope="session")
def tiny_moe() -> LoadedModel:
    return load_model("tiny-qwen3-vl-moe", device="cpu")


@pytest.fixture(scope="session")
def tiny_omni() -> LoadedModel:
    return load_model("tiny-qwen3-omni", device="cpu")


@pytest.fixture(scope="session")
def tiny_nodeepstack() -> LoadedModel:
    return load_model("tiny-qwen3-vl-nodeepstack", device="cpu")


class Cli:
    """Runs `parity ...` in-process and reads back the run folder it wrote."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.runner = CliRunner()

    def __call__(self, *args: str, env: dict | None = None):
        return self.runner.invoke(cli, list(args), env=env, catch_exceptions=False, prog_name="parity")

    def run(self, *args: str, name: str = "run", device: str | None = "cpu"):
        """`parity run ARGS` on `device` (None: the option left out, `auto`)."""
        out = self.tmp_path / name
        on = ("--device", device) if device is not None and "--device" not in args else ()
        result = self("run", "--out", str(out), "--no-plot", *on, *args)
        doc = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
        return result, doc, out


@pytest.fixture
def parity_cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path)


# Real runs of the tiny preset that the loader must read back as written, and whose edits `parity
# verdict` must refuse. Each is made on first use, once per test session, and shared read-only.
REAL_RUNS = {
    "default": ("--scenario", "all"),
    "all": ("--scenario", "all", "--fixture", "all"),
    "bfloat16": ("--scenario", "all", "--dtype", "bfloat16"),
    "repeat": ("--scenario", "all", "--repeat", "2"),
    "legacy": ("--scenario", "all", "--runner", "legacy"),
    "no-clear": ("--scenario", "all", "--runner", "no-clear"),
    "video": ("--scenario", "all", "--video", "all"),
    "chunk-1000": ("--scenario", "chunked", "--chunk-size", "1000"),  # INCONCLUSIVE_NOT_REPLAYED: one chunk
    "chunk-20": ("--scenario", "chunked", "--chunk-size", "20"),  # INCONCLUSIVE_NOT_REPLAYED: the image in one chunk
    # FAIL_GRAPH_DIVERGES through the replay check alone: the encoder graph keyed by patch count
    "layout-keyed": ("--scenario", "layout", "--runner", "layout-keyed", "--dtype", "bfloat16"),
}
REAL_RUN_TOKENS = "8"


class RealRuns:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, tuple[Path, int]] = {}

    def __call__(self, name: str) -> tuple[Path, dict, int]:
        """(results file, its document, the run's exit code); the document is a fresh copy to edit."""
        if name not in self.made:
            out = self.root / name
            result = CliRunner().invoke(cli, ["run", "--out", str(out), "--no-plot", "--device", "cpu", "--max-new-tokens",
                                              REAL_RUN_TOKENS, *REAL_RUNS[name]], catch_exceptions=False)
            self.made[name] = (out / "results.json", result.exit_code)
        path, code = self.made[name]
        return path, json.loads(path.read_text()), code


@pytest.fixture(scope="session")
def real_run(tmp_path_factory, tiny) -> RealRuns:
    return RealRuns(tmp_path_factory.mktemp("real-runs"))
