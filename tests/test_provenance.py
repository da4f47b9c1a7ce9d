"""Trust v4 (design §4b): every file records its plan and its code, merges prove what they merged,
one-field edits never launder a verdict, and a CI gate is never green on a run that did not pass.

Each test is a negative control: an edit, a mixed merge or a bad input that a careless or careful
user could produce, and the refusal (exit 2) or the honest verdict it must get instead of a PASS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.cli import cli

ARGS = ("--fixture", "rgb-stripes", "--fixture", "quadrants", "--max-new-tokens", "4", "--no-plot")


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False, prog_name="parity", env=env)


def load(path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny) -> dict[str, Path]:
    """Two shards of a two-fixture four-arm run, and the same run with another prompt, seed or dtype."""
    root = tmp_path_factory.mktemp("provenance")
    variants = {
        "s1": ("--shard", "1/2"), "s2": ("--shard", "2/2"),
        "s2-prompt": ("--shard", "2/2", "--prompt", "Describe the image."),
        "s2-seed": ("--shard", "2/2", "--seed", "7"),
    }
    paths = {}
    for name, extra in variants.items():
        result = invoke("run", "--device", "cpu", "--out", str(root / name), *ARGS, *extra)
        assert result.exit_code in (0, 3), result.output
        paths[name] = root / name / "results.json"
    return paths


def edited(path: Path, tmp_path: Path, edit, name: str = "edited.json") -> str:
    doc = load(path)
    edit(doc)
    out = tmp_path / name
    out.write_text(json.dumps(doc))
    return str(out)


# --- merges prove what they merged ---------------------------------------------------------------------

def test_shards_of_other_prompts_do_not_merge(shards, tmp_path):
    result = invoke("merge", str(shards["s1"]), str(shards["s2-prompt"]), "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and "config.plan" in result.output
    # The first differing case and field are named, not two long prefixes of the plan.
    assert "config.plan[0] (" in result.output and "not shards of the same experiment" in result.output


def test_shards_of_another_seed_do_not_merge(shards, tmp_path):
    result = invoke("merge", str(shards["s1"]), str(shards["s2-seed"]), "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and "shards of two models" in result.output, result.output
    assert "tiny-qwen3-vl (preset, seed 7, weights sha256" in result.output


def test_a_seed_relabelled_away_is_caught_by_the_fingerprint(tmp_path, tiny):
    """Three shards of one image's three scenarios: each computes DeepStack for the same image and
    prompt. A shard from another seed, its seed and model identity edited to match, still disagrees
    there; its seed alone edited contradicts its own identity."""
    common = ("--fixture", "rgb-stripes", "--scenario", "all", "--max-new-tokens", "3", "--no-plot")
    paths = {}
    for name, extra in (("1", ("--shard", "1/3")), ("2", ("--shard", "2/3")), ("3", ("--shard", "3/3")),
                        ("2-seed", ("--shard", "2/3", "--seed", "7"))):
        assert invoke("run", "--device", "cpu", "--out", str(tmp_path / name), *common, *extra).exit_code in (0, 3)
        paths[name] = tmp_path / name / "results.json"
    seed, identity = (load(paths["1"])["config"][k] for k in ("preset_seed", "model_identity"))
    seed_only = edited(paths["2-seed"], tmp_path, lambda d: d["config"].update(preset_seed=seed))
    result = invoke("verdict", seed_only)
    assert result.exit_code == 2 and "model_identity.seed is 7, but config.preset_seed is 0" in result.output
    relabelled = edited(paths["2-seed"], tmp_path, lambda d: d["config"].update(preset_seed=seed, model_identity=identity))
    result = invoke("merge", str(paths["1"]), relabelled, str(paths["3"]), "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and "the shards disagree" in result.output
    assert "for the same image and prompt" in result.output
    good = invoke("merge", str(paths["1"]), str(paths["2"]), str(paths["3"]), "--out", str(tmp_path / "ok"), "--no-plot")
    assert good.exit_code == 0, good.output  # the negative control: one seed merges


def test_a_shard_relabelled_bf16_is_refused(shards, tmp_path):
    def bf16(doc):
        doc["config"].update(dtype="bfloat16", logprob_tol=0.75, logprob_mean_tol=0.05, tie_margin=0.75)

    result = invoke("merge", str(shards["s1"]), edited(shards["s2"], tmp_path, bf16), "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and "deepstack_record.dtype is 'float32', but config.dtype is 'bfloat16'" in result.output


def test_shards_of_other_code_merge_only_when_told_and_the_report_says_so(shards, tmp_path):
    other = edited(shards["s2"], tmp_path, lambda d: d["environment"].update(parity_source="0.1.0+0000000000000000"))
    result = invoke("merge", str(shards["s1"]), other, "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and "environment.parity_source" in result.output and "--allow-mixed-code" in result.output
    out = tmp_path / "mixed"
    result = invoke("merge", str(shards["s1"]), other, "--out", str(out), "--allow-mixed-code", "--no-plot")
    assert result.exit_code == 0, result.output
    assert "--allow-mixed-code" in (out / "report.md").read_text()
    assert invoke("verdict", str(out / "results.json")).exit_code == 0


def test_merge_refuses_an_out_that_holds_an_input(shards, tmp_path):
    result = invoke("merge", str(shards["s1"]), str(shards["s2"]), "--out", str(shards["s2"].parent))
    assert result.exit_code == 2 and "holds the input" in result.output
    assert load(shards["s2"])["config"]["shard"]["index"] == 2  # untouched


def test_a_merged_file_without_its_shard_record_is_incomplete(shards, tmp_path):
    out = tmp_path / "m"
    assert invoke("merge", str(shards["s1"]), "--allow-missing", "2", "--out", str(out), "--no-plot").exit_code == 3
    no_record = edited(out / "results.json", tmp_path, lambda d: d["config"].pop("shard"))
    result = invoke("verdict", no_record)
    assert result.exit_code == 3 and "planned case (config.plan) the file does not hold" in result.output

    def plan_without_shard_2(doc):
        kept = {c["id"] for c in doc["cases"]}
        doc["config"]["plan"] = [e for e in doc["config"]["plan"] if e["id"] in kept]
        doc["config"]["shard"].update(merged=[1, 2], missing=[])

    result = invoke("verdict", edited(out / "results.json", tmp_path, plan_without_shard_2, "p.json"))
    assert result.exit_code == 2 and "config.shard" in result.output


def test_junit_of_an_incomplete_merge_is_not_green(shards, tmp_path):
    junit = tmp_path / "j.xml"
    result = invoke("merge", str(shards["s1"]), "--allow-missing", "2", "--out", str(tmp_path / "m"), "--no-plot",
                    "--junit", str(junit))
    assert result.exit_code == 3
    root = ET.parse(junit).getroot()
    assert int(root.get("failures")) + int(root.get("errors")) >= 1
    run_case = [t for t in root.iter("testcase") if t.get("name") == "run verdict"]
    assert run_case and run_case[0].find("failure").get("type") == "INCOMPLETE"


def test_verdict_of_a_shard_says_which(shards):
    result = invoke("verdict", str(shards["s2"]))
    assert "judged shard 2 of 2" in result.output


# --- one-field edits ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory, tiny) -> Path:
    out = tmp_path_factory.mktemp("legacy") / "run"
    assert invoke("run", "--device", "cpu", "--out", str(out), "--runner", "legacy", "--max-new-tokens", "4", "--no-plot").exit_code == 1
    return out / "results.json"


def test_schema_v1_relabel_is_refused(legacy_run, tmp_path):
    result = invoke("verdict", edited(legacy_run, tmp_path, lambda d: d.update(schema="parity.results/1")))
    assert result.exit_code == 2 and "parity.results/2 field" in result.output


def test_an_auto_tolerance_raised_by_hand_is_refused(legacy_run, tmp_path):
    result = invoke("verdict", edited(legacy_run, tmp_path, lambda d: d["config"].update(logprob_tol=1e-3)))
    assert result.exit_code == 2 and "logprob_tol_source 'auto' gives" in result.output


def test_a_deleted_teacher_forced_score_is_refused(legacy_run, tmp_path):
    result = invoke("verdict", edited(legacy_run, tmp_path,
                                      lambda d: d["cases"][0]["arms"]["eager_zero_deepstack"]["forced"].pop("eager_normal")))
    assert result.exit_code == 2 and "forced lacks eager_normal" in result.output


def test_a_builtin_fixture_name_over_other_pixels_is_refused(legacy_run, tmp_path):
    def renamed(doc):
        doc["cases"][0]["fixture"]["name"] = "checkerboard"

    result = invoke("verdict", edited(legacy_run, tmp_path, renamed))
    assert result.exit_code == 2 and "named 'checkerboard', the built-in fixture" in result.output


def test_deleted_repeats_are_refused(tmp_path, tiny):
    out = tmp_path / "rep"
    assert invoke("run", "--device", "cpu", "--out", str(out), "--repeat", "2", "--max-new-tokens", "3", "--no-plot").exit_code == 0

    def no_repeats(doc):
        for arm in doc["cases"][0]["arms"].values():
            arm.pop("repeats")

    result = invoke("verdict", edited(out / "results.json", tmp_path, no_repeats))
    assert result.exit_code == 2 and "config.repeat 2" in result.output


# --- bad input --------------------------------------------------------------------------------------

@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_anywhere_are_refused(legacy_run, tmp_path, literal):
    text = legacy_run.read_text().replace('"python": "', f'"odd": {literal}, "python": "', 1)
    path = tmp_path / "nan.json"
    path.write_text(text)
    for command in (("verdict", str(path)), ("report", "--format", "json", str(path)),
                    ("merge", str(path), "--out", str(tmp_path / "m"))):
        result = invoke(*command)
        assert result.exit_code == 2 and "environment.odd" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused_not_read(device, tmp_path):
    if not Path(device).exists():
        pytest.skip(f"{device} is absent")
    assert invoke("verdict", device).exit_code == 2
    result = invoke("run", "--prompts", device, "--out", str(tmp_path / "r"))
    assert result.exit_code == 2 and "is a device" in result.output


def test_the_matrix_report_write_is_guarded(shards, legacy_run, tmp_path):
    out = tmp_path / "m"
    (out / "report.md").mkdir(parents=True)
    result = invoke("merge", str(shards["s1"]), str(shards["s2"]), str(legacy_run), "--matrix", "--out", str(out),
                    "--no-plot")
    assert result.exit_code == 2 and result.output.startswith("Error:") and "report.md" in result.output


def test_report_exits_with_the_verdict(legacy_run):
    assert invoke("report", str(legacy_run)).exit_code == 1
    assert invoke("report", "--exit-zero", str(legacy_run)).exit_code == 0


def test_a_matrix_label_cannot_inject_markdown(shards, legacy_run, tmp_path):
    label = "x\n## injected | [link](http://e)"
    injected = edited(legacy_run, tmp_path, lambda d: (d["config"].update(model=label),
                                                       d["config"]["model_identity"].update(name=label, kind="checkpoint",
                                                                                            seed=None)))
    result = invoke("report", str(shards["s1"]), str(shards["s2"]), injected)
    lines = result.output.splitlines()
    assert not any("## injected" in line and "\\#\\# injected" not in line and "`" not in line for line in lines)
    rows = [line for line in lines if line.startswith("| [2.")]
    assert rows and "\\[link\\](http://e)" in rows[0] and "\\|" in rows[0]  # escaped: no link, no cell break


def test_the_same_file_twice_names_what_it_has(legacy_run):
    result = invoke("report", str(legacy_run), str(legacy_run))
    assert result.exit_code == 2 and "the whole (unsharded) run is also in" in result.output
    assert "config.shard" not in result.output  # the file has no such field


def test_an_arm_whose_own_score_is_null_is_judged_without_a_traceback(legacy_run, tmp_path):
    """null: the backend could not score exactly those tokens. Then no teacher-forced delta exists."""
    result = invoke("verdict", edited(legacy_run, tmp_path,
                                      lambda d: d["cases"][0]["arms"]["eager_normal"]["forced"].update(eager_normal=None)))
    assert result.exit_code == 1 and "Traceback" not in result.output


def test_a_file_without_a_plan_is_refused_saying_why(legacy_run, tmp_path):
    result = invoke("verdict", edited(legacy_run, tmp_path, lambda d: d["config"].pop("plan")))
    assert result.exit_code == 2 and "config.plan is missing" in result.output


def test_merge_refuses_to_write_what_the_loader_would_not_read(shards, tmp_path, monkeypatch):
    import parity.merge

    monkeypatch.setattr(parity.merge, "MAX_FILE_BYTES", 10_000)  # the cap, as small as a test makes it
    result = invoke("merge", str(shards["s1"]), str(shards["s2"]), "--out", str(tmp_path / "m"), "--no-plot")
    assert result.exit_code == 2 and "larger than the" in result.output and "reads back" in result.output
    assert not (tmp_path / "m" / "results.json").exists()


def test_an_arm_whose_own_results_break_a_rule_fails_in_the_run_and_in_its_file(tmp_path, tiny, monkeypatch):
    """Issue 21: a backend whose teacher-forced scores come from another path than its generation
    (a server scoring prompt + answer in another bucket): the run fails that arm with the loader's
    words instead of judging it, and `parity verdict` of the file says the same."""
    import dataclasses

    from parity.backends.transformers_backend import TransformersSession

    real = TransformersSession.score

    def other_path(self, answer, force=()):
        generation = real(self, answer, force)
        if answer.generation.evidence.prefill_replayed:  # the bcg arms' own scores, 0.2 off
            generation = dataclasses.replace(generation, self_forced=tuple(lp - 0.2 for lp in generation.self_forced))
        return generation

    monkeypatch.setattr(TransformersSession, "score", other_path)
    out = tmp_path / "run"
    result = invoke("run", "--device", "cpu", "--out", str(out), "--max-new-tokens", "3", "--no-plot")
    assert result.exit_code == 4 and "parity's check of its own results" in result.output
    assert "teacher forcing of identical tokens gives the same scores" in result.output
    written = load(out / "results.json")["verdict"]
    again = invoke("verdict", str(out / "results.json"))
    assert written["code"] == "ERROR" and again.exit_code == 4
    assert again.output.splitlines()[-1] == f"{written['code']}: {written['reason']}"


def test_shards_of_two_checkpoints_under_one_path_do_not_merge(tmp_path):
    """Issue 34: `--model DIR` names one checkpoint on one machine and another elsewhere. Nothing in a
    four-arm plan repeats an image and prompt across shards, so only the model's identity (the
    checkpoint's content hash) can tell; the merge names both models. Negative control: the shards of
    one checkpoint merge."""
    import shutil

    from parity.models import load_model

    folder = tmp_path / "checkpoint"

    def save(seed: int) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        loaded = load_model("tiny-qwen3-vl", device="cpu", dtype="float32", seed=seed)
        loaded.adapter.model.save_pretrained(folder)
        loaded.adapter.processor.save_pretrained(folder)

    common = ("--model", str(folder), "--fixture", "all", "--max-new-tokens", "3", "--no-plot", "--buckets", "48")
    save(0)
    for k in (1, 2, 3):
        assert invoke("run", "--device", "cpu", "--out", str(tmp_path / f"a{k}"), *common, "--shard", f"{k}/3").exit_code in (0, 1, 3)
    save(1)
    for k in (2, 3):
        assert invoke("run", "--device", "cpu", "--out", str(tmp_path / f"b{k}"), *common, "--shard", f"{k}/3").exit_code in (0, 1, 3)
    one = invoke("merge", *(str(tmp_path / f"a{k}" / "results.json") for k in (1, 2, 3)), "--out", str(tmp_path / "ok"))
    assert one.exit_code in (0, 1, 3) and "Error" not in one.output, one.output
    mixed = invoke("merge", str(tmp_path / "a1" / "results.json"), *(str(tmp_path / f"b{k}" / "results.json")
                                                                     for k in (2, 3)), "--out", str(tmp_path / "m"))
    assert mixed.exit_code == 2 and "shards of two models" in mixed.output, mixed.output
    assert mixed.output.count(f"{folder} (checkpoint, files sha256") == 2
    assert not (tmp_path / "m" / "results.json").exists()


# --- trust v6: identity as evidence --------------------------------------------------------------------

def _as_checkpoint(doc: dict, path: str, sha256: str) -> None:
    doc["config"]["model"] = path
    doc["config"]["preset_seed"] = None
    doc["config"]["model_identity"] = {"name": path, "kind": "checkpoint", "seed": None, "sha256": sha256}


def test_one_checkpoint_at_two_paths_is_one_model(legacy_run):
    from parity.judge.identity import first_difference, identity
    from parity.trust.loader import run_from_json

    one, two, other = load(legacy_run), load(legacy_run), load(legacy_run)
    _as_checkpoint(one, "/ci-a/qwen3-vl", "1" * 64)
    _as_checkpoint(two, "/ci-b/checkout/qwen3-vl", "1" * 64)
    _as_checkpoint(other, "/ci-a/qwen3-vl", "2" * 64)
    runs = [run_from_json(doc, name) for doc, name in ((one, "one"), (two, "two"), (other, "other"))]
    assert first_difference(identity(runs[0]), identity(runs[1])) is None
    assert first_difference(identity(runs[0]), identity(runs[2])) == "config.model_identity"  # negative control


def test_a_merge_refusal_cannot_drive_the_terminal(legacy_run, tmp_path):
    """A model name is a string from a file: an ANSI sequence in it (clear the screen, paint a green
    PASS) is shown escaped in the refusal, never sent to the terminal."""
    evil = "m\x1b[2J\x1b[32mPASS\x1b[0m"
    first = edited(legacy_run, tmp_path, lambda d: _as_checkpoint(d, evil, "1" * 64), "a.json")
    second = edited(legacy_run, tmp_path, lambda d: _as_checkpoint(d, evil, "2" * 64), "b.json")
    result = invoke("merge", first, second, "--out", str(tmp_path / "m"))
    assert result.exit_code == 2 and "shards of two models" in result.output
    assert "\x1b" not in result.output and "\\x1b[2J" in result.output


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="the known preset builds are x86_64's")
def test_a_preset_identity_that_is_not_its_known_build_is_refused(legacy_run, tmp_path):
    from parity.model_identity import KNOWN_BUILDS
    from parity.models import preset_identity

    assert preset_identity("tiny-qwen3-vl").sha256 == KNOWN_BUILDS[("tiny-qwen3-vl", 0, "x86_64")]
    result = invoke("verdict", edited(legacy_run, tmp_path, lambda d: d["config"]["model_identity"].update(
        sha256="3" * 64)))
    assert result.exit_code == 2 and "tiny-qwen3-vl seed 0 builds weights 7e8c9f35fa87" in result.output


def _hash_in_a_subprocess(folder: Path, cache: Path) -> subprocess.CompletedProcess:
    code = ("import sys; from pathlib import Path; from parity.model_identity import checkpoint_sha256; "
            "print(checkpoint_sha256(Path(sys.argv[1]), Path(sys.argv[2])))")
    return subprocess.run([sys.executable, "-c", code, str(folder), str(cache)], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("kind", ["fifo", "device", "loop", "folder"])
def test_the_hash_cache_is_read_as_a_user_file(tmp_path, kind):
    """A FIFO there hung `parity run --model DIR` for ever, /dev/zero ran until MemoryError: now the
    cache is refused with a warning and every file is hashed, as without one (no hang: a timeout)."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    plain = _hash_in_a_subprocess(folder, tmp_path / "plain.json")
    cache = tmp_path / "cache.json"
    {"fifo": lambda: os.mkfifo(cache), "device": lambda: os.symlink("/dev/zero", cache),
     "loop": lambda: os.symlink(cache, cache), "folder": lambda: cache.mkdir()}[kind]()
    refused = _hash_in_a_subprocess(folder, cache)
    assert plain.returncode == 0 and refused.returncode == 0, refused.stderr
    assert refused.stdout == plain.stdout and "checkpoint hash cache" in refused.stderr, refused.stderr


def test_a_swap_of_the_same_size_and_mtime_is_hashed_again(tmp_path):
    from parity.model_identity import checkpoint_sha256

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(b"weights-a")
    stamp = os.stat(weights)
    before = checkpoint_sha256(folder, tmp_path / "cache.json")
    swapped = tmp_path / "swap"
    swapped.write_bytes(b"weights-b")  # the same size
    os.replace(swapped, weights)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # and the same modification time
    assert checkpoint_sha256(folder, tmp_path / "cache.json") != before


def test_no_output_of_a_merge_overwrites_another_or_an_input(shards, legacy_run, tmp_path):
    """`merge --matrix --junit` naming an experiment folder's own results.json or report.md, or the
    matrix report, would overwrite what the merge writes: refused before anything is written."""
    from parity.merge import experiment_folder
    from parity.trust.loader import load_results

    out = tmp_path / "m"
    folder = out / experiment_folder(1, load_results(shards["s1"]))
    for target in (folder / "results.json", folder / "report.md", out / "report.md"):
        result = invoke("merge", "--matrix", str(shards["s1"]), str(shards["s2"]), str(legacy_run), "--out", str(out),
                        "--junit", str(target))
        assert result.exit_code == 2 and "--junit" in result.output and "writes" in result.output, result.output
        assert not out.exists()
    result = invoke("merge", str(shards["s1"]), str(shards["s2"]), "--out", str(out), "--junit", str(shards["s1"]))
    assert result.exit_code == 2 and "is the input" in result.output


def test_no_output_of_a_run_overwrites_an_input(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "report.md").write_text("Describe the image.\n")  # a prompts file where the run writes its report
    result = invoke("run", "--device", "cpu", "--out", str(out), "--prompts", str(out / "report.md"))
    assert result.exit_code == 2 and "is the input" in result.output and "--out" in result.output, result.output
    assert (out / "report.md").read_text() == "Describe the image.\n" and not (out / "results.json").exists()
