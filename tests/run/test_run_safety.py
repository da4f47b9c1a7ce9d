"""Nothing lost: a signal, a second signal, a stop while plotting or a failing disk never costs the
evidence that finished, never shows a traceback, and files get the user's umask."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat

import pytest

import parity.run_command
from parity.backends.transformers_backend import TransformersSession
from parity.textfiles import write_atomically

FAST = ("--max-new-tokens", "3")


def _stop_on_call(monkeypatch, n: int, stop) -> None:
    """The n-th generation calls `stop()` first (a signal to this process, or a raise)."""
    real = TransformersSession.answer
    calls = {"n": 0}

    def generate(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            stop()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TransformersSession, "answer", generate)


def _kill_self(signum: int):
    return lambda: os.kill(os.getpid(), signum)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_sigterm_writes_what_finished_and_exits_143(parity_cli, tmp_path, monkeypatch, umask_022):
    handler_before = signal.getsignal(signal.SIGTERM)
    _stop_on_call(monkeypatch, 3, _kill_self(signal.SIGTERM))
    junit = tmp_path / "junit.xml"
    result, doc, out = parity_cli.run("--junit", str(junit), *FAST)
    assert result.exit_code == 143, result.output
    assert "Traceback" not in result.output and "2 arm(s) that finished are in" in result.output
    assert doc["interrupted"] is True and doc["verdict"]["code"] == "INCOMPLETE"
    assert list(doc["cases"][0]["arms"]) == ["eager_normal", "eager_zero_deepstack"]
    assert "Interrupted" in (out / "report.md").read_text() and "<testsuites" in junit.read_text()
    assert "INCOMPLETE" in result.output  # the verdict of what finished is shown, too
    assert not list(out.glob(".*.tmp"))
    # The user's umask, not mkstemp's 0600.
    assert {_mode(p) for p in (out / "results.json", out / "report.md", junit)} == {0o644}
    assert signal.getsignal(signal.SIGTERM) is handler_before  # parity's handler is gone after the run


def test_a_second_ctrl_c_does_not_lose_the_interrupted_write(parity_cli, tmp_path, monkeypatch):
    def first_ctrl_c():
        raise KeyboardInterrupt

    _stop_on_call(monkeypatch, 3, first_ctrl_c)
    real_render = parity.run_command.render_markdown

    def render_then_ctrl_c_again(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the interrupted run is written
        return real_render(*args, **kwargs)

    monkeypatch.setattr(parity.run_command, "render_markdown", render_then_ctrl_c_again)
    junit = tmp_path / "junit.xml"
    result, doc, out = parity_cli.run("--junit", str(junit), *FAST)
    assert result.exit_code == 130, result.output
    assert doc["interrupted"] is True and len(doc["cases"][0]["arms"]) == 2
    assert (out / "report.md").exists() and junit.exists() and "marked interrupted" in result.output


def test_ctrl_c_while_plotting_keeps_results_report_and_junit(parity_cli, tmp_path, monkeypatch):
    import parity.reporting.plots

    def ctrl_c(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(parity.reporting.plots, "plot_case", ctrl_c)
    out, junit = tmp_path / "plotted", tmp_path / "junit.xml"
    result = parity_cli("run", "--device", "cpu", "--out", str(out), "--junit", str(junit), *FAST)
    assert result.exit_code == 130 and "interrupted while plotting" in result.output, result.output
    doc = json.loads((out / "results.json").read_text())
    assert not doc.get("interrupted") and doc["verdict"]["code"] == "PASS" and doc["cases"][0].get("plot") is None
    report = (out / "report.md").read_text()
    assert "PASS" in report.splitlines()[0] and "](" not in report  # no link to a plot that is not there
    assert "<testsuites" in junit.read_text()


@pytest.mark.parametrize("when", ["loading", "first arm"])
def test_interrupt_before_anything_finished_writes_nothing(parity_cli, tmp_path, monkeypatch, when):
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    if when == "loading":
        monkeypatch.setattr(parity.run_command, "create_backend", ctrl_c)
    else:
        _stop_on_call(monkeypatch, 1, ctrl_c)
    junit = tmp_path / "junit.xml"
    result, doc, out = parity_cli.run("--junit", str(junit), *FAST)
    assert result.exit_code == 130 and "nothing had finished; nothing written" in result.output, result.output
    assert doc is None and not out.exists() and not junit.exists()


def test_interrupt_while_a_server_starts_says_only_its_logs_were_written(parity_cli, monkeypatch):
    def server_logs_then_ctrl_c(options, max_new_tokens, run_dir):
        run_dir.mkdir(parents=True)
        (run_dir / "eager.log").write_text("starting\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(parity.run_command, "create_backend", server_logs_then_ctrl_c)
    result, doc, out = parity_cli.run(*FAST)
    assert result.exit_code == 130 and doc is None and [p.name for p in out.iterdir()] == ["eager.log"]
    assert "nothing had finished; no results written" in result.output and "only the servers' logs" in result.output


@pytest.mark.parametrize("target, option", [("results.json", "--out"), ("report.md", "--out"),
                                            ("junit.xml", "--junit")])
def test_a_full_disk_is_one_error_line_after_the_verdict(parity_cli, tmp_path, monkeypatch, target, option):
    real = parity.run_command.write_atomically

    def disk_full(path, text):
        if path.name == target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, text)

    monkeypatch.setattr(parity.run_command, "write_atomically", disk_full)
    result, _, out = parity_cli.run("--junit", str(tmp_path / "junit.xml"), *FAST)
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and option in errors[0] and "No space left on device" in errors[0] and target in errors[0]
    assert result.output.index("PASS: ") < result.output.index("Error:")  # the verdict is shown first
    assert not list(out.glob(".*.tmp"))


def test_an_out_folder_removed_mid_run_is_written_again(parity_cli, tmp_path, monkeypatch):
    import shutil

    out = tmp_path / "gone"
    out.mkdir()
    _stop_on_call(monkeypatch, 2, lambda: shutil.rmtree(out))
    result = parity_cli("run", "--device", "cpu", "--out", str(out), "--no-plot", *FAST)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "results.json").read_text())["verdict"]["code"] == "PASS" and (out / "report.md").exists()


def test_a_read_only_out_folder_mid_run_is_an_error_line(parity_cli, tmp_path, monkeypatch):
    def read_only(*args):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(parity.run_command, "write_atomically", read_only)
    result, _, out = parity_cli.run(*FAST)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"Error: --out {out}: cannot write {out / 'results.json'} (Permission denied)" in result.output


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_follow_the_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        write_atomically(tmp_path / "f.json", "{}\n")
        write_atomically(tmp_path / "f.json", "{}\n")  # replacing keeps it too
    finally:
        os.umask(previous)
    assert _mode(tmp_path / "f.json") == mode and [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_deferred_stops_finish_the_block_then_stop():
    from parity.run.interrupts import Terminated, deferred_stops

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN where the suite was started in the background
    done = []
    with pytest.raises(Terminated):
        with deferred_stops():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("finished")
    assert done == ["finished"]
    with deferred_stops(reraise=False) as noted:
        os.kill(os.getpid(), signal.SIGINT)
    assert noted == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is before  # the handler that was there is back


def test_localize_write_failure_and_ctrl_c_leave_the_file_as_it_was(parity_cli, monkeypatch):
    import parity.localize_command

    _, _, out = parity_cli.run("--runner", "legacy", *FAST)
    results = out / "results.json"
    before = results.read_bytes()

    def disk_full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(parity.localize_command, "write_results", disk_full)
        result = parity_cli("localize", str(results), "--write")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "cannot write beside" in result.output and "No space left on device" in result.output

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(parity.localize_command, "localize_run", ctrl_c)
    result = parity_cli("localize", str(results), "--write")
    assert result.exit_code == 130 and "interrupted" in result.output and "Traceback" not in result.output
    assert results.read_bytes() == before


# --- a stop at every phase, once or twice 10 ms apart (issue 21) ---------------------------------------

def _signal(signum: int, again: int | None):
    """Send `signum` to this process; with `again`, that signal 10 ms later (a second Ctrl-C, a CI
    runner's SIGTERM after its SIGINT). Both are held until the second is sent, so the second lands
    while parity unwinds from the first, however fast that is (in a test, never after the run)."""
    import time

    def stop():
        held = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            os.kill(os.getpid(), signum)
            if again is not None:
                time.sleep(0.01)
                os.kill(os.getpid(), again)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)

    return stop


def _phase(monkeypatch, phase: str, stop) -> None:
    import parity.reporting.plots

    if phase == "arms":
        _stop_on_call(monkeypatch, 3, stop)
        return
    module, name = {"load": (parity.run_command, "create_backend"), "tables": (parity.run_command, "print_table"),
                    "writes": (parity.run_command, "report_files"),
                    "plots": (parity.reporting.plots, "plot_case")}[phase]
    real = getattr(module, name)
    fired = {"n": 0}

    def stopping(*args, **kwargs):
        fired["n"] += 1
        if fired["n"] == 1:
            stop()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, stopping)


# What each phase keeps: nothing before an arm finished, the finished arms, or the whole run.
KEPT = {"load": None, "arms": "INCOMPLETE", "tables": "PASS", "writes": "PASS", "plots": "PASS"}


@pytest.mark.parametrize("phase", list(KEPT))
@pytest.mark.parametrize("signum, again", [(signal.SIGTERM, None), (signal.SIGINT, signal.SIGTERM)])
def test_a_stop_at_every_phase_keeps_what_finished_with_the_first_signals_code(parity_cli, tmp_path, monkeypatch,
                                                                            phase, signum, again):
    _phase(monkeypatch, phase, _signal(signum, again))
    out = tmp_path / "run"
    result = parity_cli("run", "--device", "cpu", "--out", str(out), "--junit", str(tmp_path / "j.xml"), *FAST)
    assert result.exit_code == 128 + signum, result.output
    assert "Traceback" not in result.output and "interrupted" in result.output
    assert not list(tmp_path.rglob(".*.tmp"))
    if KEPT[phase] is None:
        assert not (out / "results.json").exists()
        return
    doc = json.loads((out / "results.json").read_text())
    assert doc["verdict"]["code"] == KEPT[phase] and (out / "report.md").exists() and (tmp_path / "j.xml").exists()
    assert parity_cli("verdict", str(out / "results.json")).exit_code == (0 if KEPT[phase] == "PASS" else 3)


@pytest.mark.parametrize("signum, again", [(signal.SIGTERM, None), (signal.SIGINT, signal.SIGTERM)])
def test_a_stop_during_a_merge_leaves_no_temporary_file(parity_cli, tmp_path, monkeypatch, signum, again):
    import parity.merge

    _, _, out = parity_cli.run(*FAST, "--shard", "1/1")
    real, stop = parity.merge.write_atomically, _signal(signum, again)

    def write_then_stop(path, text):
        stop()
        real(path, text)

    monkeypatch.setattr(parity.merge, "write_atomically", write_then_stop)
    merged = tmp_path / "merged"
    result = parity_cli("merge", str(out / "results.json"), "--out", str(merged), "--no-plot")
    assert result.exit_code == 128 + signum and "Traceback" not in result.output
    assert not list(merged.rglob(".*.tmp")) and json.loads((merged / "results.json").read_text())["cases"]


def test_a_real_process_stopped_twice_10_ms_apart_keeps_the_run_and_the_first_code(tmp_path, tiny):
    """The installed command in its own process: SIGINT once arms are running, SIGTERM 10 ms later."""
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "parity", "run", "--device", "cpu", "--scenario", "all", "--fixture", "all",
                                "--max-new-tokens", "3", "--no-plot", "--out", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        for line in process.stdout:
            if "[5/" in line:  # a few arms have run
                break
        process.send_signal(signal.SIGINT)
        time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        output = line + process.stdout.read()
        assert process.wait(timeout=120) == 130, output
    finally:
        process.kill()
    doc = json.loads((out / "results.json").read_text())
    assert doc["interrupted"] is True and doc["verdict"]["code"] == "INCOMPLETE" and "Traceback" not in output
