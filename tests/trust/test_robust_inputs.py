"""Inputs that gave a traceback or an allocation without end (trust v7's classes 6 to 10): a fix record
the loader never read, a config that asks for more layers than its weights hold, a memory check that
trusted MemAvailable under a process limit, `models save` options and folders, and a checkpoint
folder holding a link to a kernel file. Each is one line and exit 2 now; each test failed before."""

from __future__ import annotations

import dataclasses
import json
import resource
import shutil

import pytest

from parity.models import sizing
from parity.reporting.report import render_markdown
from parity.results import dumps
from tests.helpers_runs import fixed_arms, make_case, make_run


def _one_line_error(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip() and not ln.startswith("Loading weights")]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), result.output[-2000:]
    return lines[0]


# --- fix records, read through the loader ------------------------------------------------------------

def _served(tmp_path, records, fix=None):
    run = make_run([make_case(fixed_arms())], backend="sglang")
    config = {**run.config, "sglang_fix_slots": {"bcg": records}, "sglang_fix": fix}
    path = tmp_path / "results.json"
    path.write_text(dumps(dataclasses.replace(run, config=config)))
    return str(path), dataclasses.replace(run, config=config)


@pytest.mark.parametrize("edit", [{"captures": "many"}, {"pid": "one"}, {"slot": ["a", 2]}, {"variant": None}])
def test_a_fix_record_that_is_not_one_is_refused_by_the_loader(parity_cli, tmp_path, edit):
    record = {"pid": 1, "variant": "deepstack-slot", "slot": [64, 96], "dtype": "float32", "note": "", **edit}
    path, _ = _served(tmp_path, [record], fix="deepstack-slot")
    for command in (("verdict", path), ("report", path)):
        assert "config.sglang_fix_slots.bcg[0]" in _one_line_error(parity_cli(*command))


def test_the_stood_aside_note_is_only_for_a_run_that_asked_for_the_fix(tmp_path):
    record = {"pid": 1, "variant": "deepstack-slot", "slot": None, "dtype": None, "note": "stood aside: the engine",
              "stood_aside": True, "captures": 2, "reads": 2}
    _, without = _served(tmp_path, [record], fix=None)
    _, asked = _served(tmp_path, [record], fix="deepstack-slot")
    assert "fix stood aside" not in render_markdown(without).split("<details>")[0]
    assert "parity's deepstack-slot fix stood aside: the engine" in render_markdown(asked)


# --- models save: its own options and folders, before anything is built ----------------------------------

@pytest.mark.parametrize("args, said", [
    (("--seed", str(2**64)), "--seed"), (("--seed", "-5"), "--seed"),
])
def test_models_save_refuses_a_seed_run_would_refuse(parity_cli, tmp_path, monkeypatch, args, said):
    monkeypatch.setattr("parity.models.shapes.build", lambda *a, **k: pytest.fail("built before the check"))
    result = parity_cli("models", "save", "tiny-qwen3-vl", str(tmp_path / "out"), *args)
    assert result.exit_code == 2 and said in result.output and not (tmp_path / "out").exists()


@pytest.mark.parametrize("folder", ["/proc/parity-save", "/sys/parity-save"])
def test_models_save_refuses_a_folder_it_cannot_write_before_building(parity_cli, monkeypatch, folder):
    monkeypatch.setattr("parity.models.shapes.build", lambda *a, **k: pytest.fail("built before the check"))
    line = _one_line_error(parity_cli("models", "save", "tiny-qwen3-vl", folder))
    assert line.startswith(f"Error: FOLDER {folder}: cannot be written")


# --- a checkpoint folder: its files and its size, before anything is allocated -----------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from click.testing import CliRunner

    from parity.cli import cli

    folder = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert CliRunner().invoke(cli, ["models", "save", "tiny-qwen3-vl", str(folder)]).exit_code == 0
    return folder


def test_a_checkpoint_folder_holding_a_link_to_a_kernel_file_is_one_line(parity_cli, saved, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    (folder / "notes.bin").symlink_to("/proc/kmsg")
    line = _one_line_error(parity_cli.run("--model", str(folder))[0])
    assert "notes.bin is a file whose read would block" in line


def test_a_config_that_asks_for_more_layers_than_its_weights_hold_is_refused_before_building(
        parity_cli, saved, tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 100_000
    (folder / "config.json").write_text(json.dumps(config))
    line = _one_line_error(parity_cli.run("--model", str(folder))[0])
    assert "config.json asks for 100000 decoder layers, but its weights hold 4" in line
    assert sizing.weights_on_disk(saved).decoder_layers == 4  # the negative control: the saved one is whole


def test_free_memory_honours_the_process_limit_and_the_cgroup(monkeypatch, tmp_path):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (3 * 2**30, resource.RLIM_INFINITY)
                        if which == resource.RLIMIT_AS else (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert sizing.host_available() < 3 * 2**30 < sizing._meminfo_available()
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("400\n")
    assert sizing._cgroup_left(tmp_path) == 600
    (tmp_path / "memory.max").write_text("max\n")
    assert sizing._cgroup_left(tmp_path) is None


def test_a_shape_preset_over_the_process_limit_is_refused_in_one_line(parity_cli, monkeypatch):
    monkeypatch.setattr(sizing, "_address_space_left", lambda: 2**30)  # as `ulimit -v` leaves it
    line = _one_line_error(parity_cli.run("--model", "shape-qwen3-vl-8b-scaled")[0])
    assert "this cpu has 1.0 GiB free" in line
