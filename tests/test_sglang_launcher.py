"""Launcher, client and backend end to end against tests/sglang_standin.py (a stand-in, not SGLang).

Every test checks that no process it started is left: the server's leader and the "scheduler"
child it spawns in the same process group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.arms import ARM_ORDER, BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO, load_arms
from parity.backends.base import Request
from parity.errors import ArmFailure, BackendUnavailableError, UsageError
from parity.fixtures import builtin_fixture
from parity.results import ArmResult, CaseResult, FixtureInfo
from parity.sglang import backend as sglang_backend
from parity.sglang import launcher, servers
from parity.verdict import judge_case

STANDIN = Path(__file__).resolve().parent / "sglang_standin.py"
REPO = STANDIN.parent.parent


# --- helpers ---------------------------------------------------------------------------------------------

def running(pid: int) -> bool:
    """True while `pid` runs; a zombie nobody reaped (PID 1 here may not) has stopped running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def pids_in_logs(run_dir: Path) -> list[int]:
    """Leader and scheduler pids of every stand-in launched into `run_dir`."""
    text = "".join(p.read_text() for p in run_dir.glob("sglang-*.log"))
    return [int(p) for p in re.findall(r"standin: (?:pid|scheduler pid) (\d+)", text)]


def assert_nothing_left(run_dir: Path) -> None:
    pids = pids_in_logs(run_dir)
    assert pids, "the stand-in never started"
    deadline = time.monotonic() + 2.0
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if running(p)] == []


@pytest.fixture(scope="module")
def processor():
    from parity.models.tiny import build_processor, build_tokenizer

    return build_processor(build_tokenizer())


def make_backend(run_dir: Path, processor, *standin_args: str, concurrent: bool = True,
                 ready_timeout: float = 30.0, **kwargs) -> sglang_backend.SglangBackend:
    return sglang_backend.create_sglang_backend(
        model="tiny-standin", max_new_tokens=6, run_dir=run_dir, concurrent=concurrent,
        ready_timeout=ready_timeout, launch_command=[sys.executable, str(STANDIN), *standin_args],
        processor=processor, stop_grace=5.0, ready_poll=0.05, **kwargs)


def run_four_arms(backend: sglang_backend.SglangBackend) -> tuple[CaseResult, dict[str, object]]:
    """What the experiment loop does: prepare, a session per mode, the arms then a text-only reuse
    request on the same server, close in `finally`."""
    fixture = builtin_fixture("rgb-stripes")
    arms = load_arms()
    results, follow_ups = [], {}
    backend.prepare(("eager", "bcg"))
    try:
        for mode in ("eager", "bcg"):
            with backend.session(mode) as session:
                for name in (n for n in ARM_ORDER if arms[n].mode == mode):
                    generation = session.generate(Request(fixture, "Describe the image."), arms[name].deepstack)
                    results.append(ArmResult(name, mode, arms[name].deepstack, generation.token_ids,
                                             generation.text, generation.token_logprobs, generation.top_logprobs,
                                             generation.deepstack_record))
                follow_ups[mode] = session.generate(Request(None, "Name a color."), "normal")
    finally:
        backend.close()
    case = CaseResult("rgb-stripes/p", FixtureInfo(fixture.name, fixture.sha256, fixture.size), "Describe the image.",
                      tuple(results))
    return judge_case(case, 0.25), follow_ups


# --- normal runs -------------------------------------------------------------------------------------------

def test_concurrent_run_reproduces_the_drop_with_two_launches(tmp_path: Path, processor) -> None:
    backend = make_backend(tmp_path, processor)
    case, follow_ups = run_four_arms(backend)

    assert case.verdict.code == "FAIL_DEEPSTACK_DROPPED", case.verdict.reason
    assert backend.launch_count == 2
    records = {arm.name: arm.deepstack_record for arm in case.arms}
    assert all(r is not None and r.calls == 1 and r.nonzero_rows > 0 for r in records.values())
    assert {records[n].replay for n in (BCG_NORMAL, BCG_ZERO)} == {True}
    assert {records[n].replay for n in (EAGER_NORMAL, EAGER_ZERO)} == {False}
    assert len({r.sha256 for r in records.values()}) == 1  # raw rows only: same input in both modes
    assert [records[n].action for n in ARM_ORDER] == ["normal", "zero", "normal", "zero"]
    assert all(f.deepstack_record is None and len(f.token_ids) == 6 for f in follow_ups.values())
    assert all(len(step) == 5 for arm in case.arms for step in arm.top_logprobs)

    assert backend.environment()["sglang"] == "0.5.23+standin"
    flags = backend.config()["sglang_servers"]
    differing = set(flags["eager"]) ^ set(flags["bcg"])
    assert differing == {"disabled", "breakable"}  # the servers differ only in the prefill backend
    assert "--enable-deterministic-inference" in flags["eager"] and "0.35" in flags["eager"]  # split 0.70
    assert {p.name for p in tmp_path.glob("*.log")} == {"sglang-eager.log", "sglang-bcg.log"}
    assert_nothing_left(tmp_path)


def test_upstream_fix_passes(tmp_path: Path, processor) -> None:
    case, _ = run_four_arms(make_backend(tmp_path, processor, "--standin-deepstack-replay"))
    assert case.verdict.code == "PASS", case.verdict.reason
    assert_nothing_left(tmp_path)


def test_sequential_sessions_launch_one_server_at_a_time(tmp_path: Path, processor) -> None:
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text", concurrent=False)
    backend.prepare(("eager", "bcg"))
    assert backend.launch_count == 0  # sequential: nothing starts before its session
    try:
        with backend.session("eager") as session:
            first = session.generate(Request(None, "Name a color."), "zero")
            eager_pid = session.server.pid
        assert not running(eager_pid)  # stopped before the next mode's server starts
        with backend.session("bcg") as session:
            assert session.generate(Request(None, "Name a color."), "normal").token_ids == first.token_ids
    finally:
        backend.close()
    assert backend.launch_count == 2
    assert backend.config()["sglang_servers"]["eager"][backend.config()["sglang_servers"]["eager"].index(
        "--mem-fraction-static") + 1] == "0.7"
    assert_nothing_left(tmp_path)


# --- failures are verdicts ---------------------------------------------------------------------------------

def test_readiness_timeout_is_an_arm_failure(tmp_path: Path, processor) -> None:
    backend = make_backend(tmp_path, processor, "--standin-never-ready", ready_timeout=0.5, concurrent=False)
    backend.prepare(("eager",))
    with pytest.raises(ArmFailure, match="not ready after 0.5 s") as caught:
        with backend.session("eager"):
            pass
    assert "standin: pid" in caught.value.log_tail
    backend.close()
    assert_nothing_left(tmp_path)


def test_exit_during_start_up_fails_only_that_mode(tmp_path: Path, processor) -> None:
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text", "--standin-exit-on-start", "7",
                           "--standin-fail-backend", "breakable")
    backend.prepare(("eager", "bcg"))
    try:
        with backend.session("eager") as session:  # the other mode is still served
            assert len(session.generate(Request(None, "Name a color."), "normal").token_ids) == 6
        with pytest.raises(ArmFailure, match="exited during start-up with code 7") as caught:
            with backend.session("bcg"):
                pass
        assert "simulated start-up failure" in caught.value.log_tail
    finally:
        backend.close()
    assert_nothing_left(tmp_path)


def test_crash_mid_run_fails_the_remaining_arms_and_reaps_the_group(tmp_path: Path, processor) -> None:
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text", "--standin-crash-after", "1",
                           concurrent=False)
    backend.prepare(("eager",))
    try:
        with backend.session("eager") as session:
            session.generate(Request(None, "Name a color."), "normal")
            with pytest.raises(ArmFailure, match="died mid-run with code 3") as caught:
                session.generate(Request(None, "Name a color."), "zero")
            assert "simulated fatal error" in caught.value.log_tail
            with pytest.raises(ArmFailure, match="exited with code 3"):
                session.generate(Request(None, "Name a color."), "normal")
    finally:
        backend.close()
    assert_nothing_left(tmp_path)  # the orphaned scheduler child included


def test_server_without_the_plugin_is_refused(tmp_path: Path, processor) -> None:
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text", "--standin-no-plugin", concurrent=False)
    with pytest.raises(ArmFailure, match="did not load parity's plugin"):
        with backend.session("eager"):
            pass
    backend.close()
    assert_nothing_left(tmp_path)


def group_members(pgid: int) -> list[int]:
    """Running processes whose process group is `pgid`, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            members.append(int(stat.parent.name))
    return members


def test_ctrl_c_during_start_up_leaves_nothing(tmp_path: Path, processor, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[launcher.ServerProcess] = []
    real_start = launcher.start_server

    def start_and_keep(spec: launcher.ServerSpec) -> launcher.ServerProcess:
        started.append(real_start(spec))
        return started[-1]

    def interrupted(*_args, **_kwargs):
        time.sleep(0.3)  # let the stand-ins spawn their scheduler children first
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "start_server", start_and_keep)
    monkeypatch.setattr(launcher, "wait_ready", interrupted)
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text")
    with pytest.raises(KeyboardInterrupt):
        try:
            backend.prepare(("eager", "bcg"))
        finally:
            backend.close()
    assert len(started) == 2
    assert [pid for server in started for pid in group_members(server.pid)] == []
    assert not any(running(server.pid) for server in started)


def test_ctrl_c_inside_a_session_leaves_nothing(tmp_path: Path, processor) -> None:
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text", concurrent=False)
    with pytest.raises(KeyboardInterrupt):
        try:
            with backend.session("eager"):
                raise KeyboardInterrupt
        finally:
            backend.close()
    assert_nothing_left(tmp_path)


def test_sigterm_to_parity_stops_its_servers(tmp_path: Path) -> None:
    script = (
        "import sys, time; from pathlib import Path; from parity.sglang import launcher\n"
        f"spec = launcher.ServerSpec('eager', (sys.executable, {str(STANDIN)!r}, '--standin-warmup', 'text',"
        f" '--model-path', 'm'), Path({str(tmp_path / 'sglang-eager.log')!r}))\n"
        "server = launcher.start_server(spec)\n"
        "print(launcher.wait_ready([server], 30, 0.05), flush=True)\n"
        "time.sleep(60)\n"
    )
    parity = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert parity.stdout.readline().strip() == "{}"  # the server is ready
    parity.send_signal(signal.SIGTERM)
    assert parity.wait(timeout=10) == 128 + signal.SIGTERM
    assert_nothing_left(tmp_path)


# --- options -------------------------------------------------------------------------------------------------

def test_user_args_are_split_and_reserved_flags_refused(tmp_path: Path, processor) -> None:
    assert servers.split_user_args(("--tp-size 2", "--dtype", "bfloat16")) == (
        "--tp-size", "2", "--dtype", "bfloat16")
    with pytest.raises(UsageError, match="--cuda-graph-backend-prefill"):
        servers.split_user_args(("--cuda-graph-backend-prefill=full",))
    backend = make_backend(tmp_path, processor, sglang_args=("--chunked-prefill-size 4096",))
    assert backend.config()["sglang_servers"]["bcg"][-2:] == ["--chunked-prefill-size", "4096"]


def test_placements_split_memory_on_one_gpu_and_gpus_when_enough() -> None:
    base = servers.SglangSettings(model="m", max_new_tokens=1, run_dir=Path("."), mem_fraction=0.8)
    modes = ("eager", "bcg")
    one = servers.placements(servers.SglangSettings(**{**base.__dict__, "concurrent": True}), modes)
    assert {p.mem_fraction for p in one.values()} == {0.4} and {p.gpus for p in one.values()} == {None}
    two = servers.placements(
        servers.SglangSettings(**{**base.__dict__, "concurrent": True, "gpus": (2, 3)}), modes)
    assert (two["eager"].gpus, two["bcg"].gpus, two["bcg"].mem_fraction) == ((2,), (3,), 0.8)
    seq = servers.placements(servers.SglangSettings(**{**base.__dict__, "gpus": (1,)}), modes)
    assert {(p.gpus, p.mem_fraction) for p in seq.values()} == {((1,), 0.8)}


def test_prefill_buckets_follow_sglang() -> None:
    buckets = servers.prefill_buckets(8192)
    assert buckets[:3] == (4, 8, 12) and 48 in buckets and 36 not in buckets and buckets[-1] == 8192
    assert servers.prefill_buckets(100)[-1] == 96


def test_missing_sglang_or_port_is_backend_unavailable(tmp_path: Path, processor,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_backend.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BackendUnavailableError, match="SGLang is not installed"):
        sglang_backend.create_sglang_backend(model="m", max_new_tokens=1, run_dir=tmp_path, processor=processor)
    with pytest.raises(BackendUnavailableError, match="cannot bind a port"):
        launcher.free_port("192.0.2.1")  # TEST-NET-1: not an address of this machine
