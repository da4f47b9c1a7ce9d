"""scripts/gpu_check.py's planning, archive and stop, without running its steps: the one call a lent
GPU gives must fit its budget, return only what a reader needs, and keep what a cut step did."""

from __future__ import annotations

import importlib.util
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses resolve their module by name
_spec.loader.exec_module(gpu_check)


def default_slots(device: str, tmp_path: Path, scale: float = 1.0):
    plan = gpu_check.steps(device, tmp_path / "work", tmp_path / "scratch")
    return gpu_check.schedule(plan, device, {s.name for s in plan if s.default}, scale)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_default_call_fits_its_budget_in_order_of_value(device, tmp_path):
    slots = default_slots(device, tmp_path)
    assert gpu_check.overruns(slots, gpu_check.BUDGET_S) == []
    assert max(s.end_s for s in slots) <= gpu_check.BUDGET_S - gpu_check.RESERVE_S
    names = [s.step.name for s in slots]
    # What decides a verdict comes first; a checkpoint of 16 GiB is never part of the default call.
    assert names[:3] == ["defaults", "scenario-all", "pytest-gpu"]
    assert names.index("matrix") < names.index("shapes") < names.index("shape-runs")
    assert "shape-checkpoint" not in names and "noise" not in names
    foreground = [s for s in slots if not s.step.background]
    assert all(a.end_s == b.start_s for a, b in zip(foreground, foreground[1:]))  # back to back, no overlap
    assert all(s.step.measured for s in slots)  # each limit says where it comes from


def test_a_plan_past_its_budget_names_the_steps_that_overrun(tmp_path):
    problems = gpu_check.overruns(default_slots("cuda", tmp_path, scale=1.5), gpu_check.BUDGET_S)
    assert problems and any("shape-runs" in p for p in problems) and not any(p.startswith("defaults") for p in problems)


def _file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.truncate(size)  # sparse: a "16 GiB" checkpoint costs nothing here
    return path


def test_the_archive_packs_results_and_reports_never_weights(tmp_path):
    work = tmp_path / "work"
    small = _file(work / "defaults/device/results.json", 20_000)
    _file(work / "defaults/device/report.md", 4_000)
    _file(work / "shape-checkpoint/shape-qwen3-vl-8b/model-00001.safetensors", 16 * 2**30)
    _file(work / "scenario-all/big/results.json", gpu_check.ARCHIVE_FILE_CAP + 1)
    _file(work / "logs/defaults-0.log", 1_000)
    packed, left_out = gpu_check.archive_plan(work, ["defaults", "scenario-all"])
    assert packed == [work / "defaults/device/report.md", small]
    why = {path: reason for path, _, reason in left_out}
    assert "not a results file" in why["shape-checkpoint/shape-qwen3-vl-8b/model-00001.safetensors"]
    assert "MiB a packed file may have" in why["scenario-all/big/results.json"]
    assert not any("logs" in path for path in why)  # the logs travel in log.txt

    target = tmp_path / "out" / "runs.tar.gz"
    target.parent.mkdir()
    assert gpu_check.pack(work, ["defaults"], target) == left_out
    with tarfile.open(target) as tar:
        assert sorted(tar.getnames()) == ["gpu-check/defaults/device/report.md", "gpu-check/defaults/device/results.json"]
    assert target.stat().st_size < gpu_check.ARCHIVE_RETURN_CAP and not list(target.parent.glob("*.partial"))


def test_the_archive_stops_at_its_cap_keeping_the_earlier_steps(tmp_path):
    work = tmp_path / "work"
    first = _file(work / "scenario-all/a/results.json", 600)
    _file(work / "defaults/device/results.json", 600)
    packed, left_out = gpu_check.archive_plan(work, ["scenario-all", "defaults"], cap=1000)
    assert packed == [first] and left_out == [("defaults/device/results.json", 600, "the archive's 0.000953674 MiB were full")]


def _python(label: str, body: str) -> gpu_check.Command:
    return gpu_check.Command(label, (sys.executable, "-c", textwrap.dedent(body)))


def _stops(marker) -> gpu_check.Command:
    """A command that, stopped as Ctrl-C stops it, writes what finished (as parity run does) and exits 130."""
    return _python("writes what finished on Ctrl-C", f"""
        import time
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            open({str(marker)!r}, "w").write("{{}}")
            raise SystemExit(130)
    """)


def test_a_step_at_its_limit_is_stopped_first_and_killed_only_after_the_grace(tmp_path):
    marker = tmp_path / "partial.json"
    stops = _stops(marker)
    deaf = _python("ignores Ctrl-C", """
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        time.sleep(60)
    """)
    step = gpu_check.Step("cut", 3, 3, "two commands past their limit", (stops, deaf), "a test")
    result = gpu_check.run_step(step, 3.0, tmp_path / "logs")
    assert [o.status for o in result.outcomes] == ["stopped", "killed"]
    assert result.outcomes[0].exit_code == 130 and marker.exists()
    assert result.status == "cut" and result.seconds < 10


def test_pytest_stopped_at_its_limit_leaves_its_summary(tmp_path):
    tests = tmp_path / "test_slow.py"
    tests.write_text("import time\n\n" + "".join(f"def test_quick_{i}():\n    pass\n\n" for i in range(3))
                     + "def test_slow():\n    time.sleep(60)\n")
    step = gpu_check.Step("suite", 9, 9, "pytest past its limit",
                          (gpu_check.Command("pytest", (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                        "-p", "no:xdist", str(tests))),), "a test")
    outcome = gpu_check.run_step(step, 9.0, tmp_path / "logs").outcomes[0]
    assert outcome.status == "stopped"
    assert gpu_check._pytest_line(outcome.tail).startswith("3 passed")


def test_a_command_started_with_ctrl_c_ignored_is_still_stopped_not_killed(tmp_path):
    """A shell without job control starts a background job with SIGINT ignored; the step's stop
    must still reach the command as Ctrl-C."""
    import signal

    marker = tmp_path / "partial.json"
    stops = _stops(marker)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        outcome = gpu_check.run_step(gpu_check.Step("cut", 3, 3, "", (stops,), "a test"), 3.0, tmp_path / "logs")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert outcome.outcomes[0].status == "stopped" and marker.exists()


def test_the_summary_is_one_page_of_every_step_beside_the_cpu_reference(tmp_path):
    """What a reader gets back from a call: at most 8 small files, every step's outcome, where it ran,
    its verdicts per scenario, and the CPU reference's figures beside them."""
    from parity.results import write_results
    from tests.helpers_runs import fixed_arms, make_case, make_run

    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    run = make_run([make_case(fixed_arms())])
    for folder in ("defaults/device", "scenario-all/tiny-qwen3-vl-float32"):
        (work / folder).mkdir(parents=True)
        write_results(run, work / folder / "results.json")
    results = [gpu_check.StepResult("defaults", "the user's command", 45, [gpu_check.Outcome("parity run", 0, 9.0, "ok")]),
               gpu_check.StepResult("scenario-all", "all", 150, [gpu_check.Outcome("a", None, 150.0, "stopped")]),
               gpu_check.StepResult("shapes", "shapes", 80, [gpu_check.Outcome("shapes")])]
    reference = {"measured": "a CPU", "figures": {"defaults": {"verdicts": {"PASS": 2}, "timings": {"load_s": 3.5}}},
                 "scenario_all": {"tiny-qwen3-vl-float32": {"cases": {"four-arm FAIL_STALE_STATE": 1}}}}
    gpu_check._write(out, work, "a header", results, reference)
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(gpu_check.OUT_FILES) and len(files) <= 8
    assert all((out / f).stat().st_size < 16 * 2**20 for f in files)
    summary = (out / "summary.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in summary.splitlines() if line.startswith("| ")}
    assert "pass" in rows["defaults"] and "PASS ×1" in rows["defaults"] and "emulated graph · cpu" in rows["defaults"]
    assert "PASS ×2 · 3.5 / — / — / —" in rows["defaults"]  # the CPU reference beside it
    assert "cut (a: stopped)" in rows["scenario-all"] and "not reached" in rows["shapes"]
    assert "| tiny-qwen3-vl-float32 | PASS | PASS 1 (cpu: FAIL_STALE_STATE 1) |" in summary
    assert "Graph: emulated graph · cpu." in summary
