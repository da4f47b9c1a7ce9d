"""Server life against tests/sglang_standin.py (a stand-in, not SGLang): start, ready, stop, crash,
Ctrl-C and SIGTERM, and the options that shape the servers. Verdicts are in test_sglang_backend.py.

Every test checks that no process it started is left: the server's leader and the "scheduler"
child it spawns in the same process group.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.backends.protocol import Request
from parity.design import Serving
from parity.errors import ArmFailure, BackendUnavailableError, UsageError
from parity.engines.sglang import backend as sglang_backend
from parity.engines import gpus, launcher
from parity.engines.sglang import servers
from tests.engines.servers import REPO, SGLANG_STANDIN, assert_nothing_left, running, standin_identity

STANDIN = SGLANG_STANDIN


# --- helpers ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def processor():
    from parity.models.tiny import build_processor, build_tokenizer

    return build_processor(build_tokenizer())


def make_backend(run_dir: Path, processor, *standin_args: str, concurrent: bool = False,
                 ready_timeout: float = 30.0, **kwargs) -> sglang_backend.SglangBackend:
    from parity.models.tiny import build_config
    from parity.presets import PRESETS

    return sglang_backend.create_sglang_backend(
        model="tiny-standin", max_new_tokens=6, run_dir=run_dir, concurrent=concurrent,
        ready_timeout=ready_timeout, launch_command=[sys.executable, str(STANDIN), *standin_args],
        processor=processor, model_config=build_config(PRESETS["tiny-qwen3-vl"], processor.tokenizer),
        stop_grace=5.0, ready_poll=0.05, identity=standin_identity, **kwargs)


def test_sequential_sessions_launch_one_server_at_a_time(tmp_path: Path, processor) -> None:
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text")
    backend.prepare(("eager", "bcg"))
    assert backend.launch_count == 0  # sequential: nothing starts before its session
    try:
        with backend.session("eager") as session:
            first = session.generate(Request(None, "Name a color."), "zero")
            eager_pid = session.process.pid
        assert not running(eager_pid)  # stopped before the next mode's server starts
        with backend.session("bcg") as session:
            again = session.generate(Request(None, "Name a color."), "normal")
    finally:
        backend.close()
    assert again.token_ids == first.token_ids and len(first.token_ids) == 6
    assert first.evidence.prefill_replayed is False and again.evidence.prefill_replayed is True
    assert first.deepstack_record is None and first.evidence.tap_calls == 0  # text only: no DeepStack rows
    assert backend.launch_count == 2
    flags = backend.config()["sglang_servers"]
    assert flags["eager"][flags["eager"].index("--mem-fraction-static") + 1] == "0.7"
    assert set(flags["eager"]) ^ set(flags["bcg"]) == {"disabled", "breakable"}  # the only difference
    assert {p.name for p in tmp_path.glob("*.log")} == {"sglang-eager.log", "sglang-bcg.log"}
    assert_nothing_left(tmp_path)


# --- failures are verdicts ---------------------------------------------------------------------------------

def test_each_serving_profile_has_its_own_server_one_per_mode_at_a_time(tmp_path: Path, processor) -> None:
    """design §10: a server's flags hold for its life, so a chunked or prefix-cache request goes to a
    server started for it; the mode's other server is stopped first, and an ablated request on the
    prefix-cache server runs on an emptied cache and leaves it empty."""
    chunked, prefix = Serving(chunked=True, recorded=True), Serving(prefix_cache=True, recorded=True)
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text")
    backend.prepare(("eager",), serving=[prefix, Serving(), chunked])
    try:
        with backend.session("eager") as session:
            first = session.process.pid  # the session starts with the profile served first: the default
            plain = session.generate(Request(None, "Name a color."), "normal")
            assert plain.evidence.serving is None  # only a family request records its serving path
            parts = session.generate(Request(None, "Name a color.", chunked), "normal")
            assert not running(first) and session.process.pid != first
            serving = parts.evidence.serving
            assert serving.cached_tokens == 0 and serving.chunks[0].start == 0 and serving.inconsistency() is None
            session.generate(Request(None, "Name a color.", prefix), "normal")
            flushes = lambda: (tmp_path / "sglang-eager-prefix.log").read_text().count("admin /flush_cache")
            assert flushes() == 0  # a normal request keeps and fills the cache
            session.generate(Request(None, "Name a color.", prefix), "zero")
            assert flushes() == 4  # before and after the generation, and its scoring
            last = session.process.pid
        assert not running(last)
    finally:
        backend.close()
    servers_run = backend.config()["sglang_servers"]
    assert set(servers_run) == {"eager", "eager-chunked", "eager-prefix"} and backend.launch_count == 3
    assert "--disable-radix-cache" in servers_run["eager"] and "--chunked-prefill-size" not in servers_run["eager"]
    chunk = servers_run["eager-chunked"]
    assert chunk[chunk.index("--chunked-prefill-size") + 1] == "8" and "--disable-radix-cache" in chunk
    prefix_flags = servers_run["eager-prefix"]
    assert "--disable-radix-cache" not in prefix_flags and prefix_flags[prefix_flags.index("--page-size") + 1] == "8"
    assert_nothing_left(tmp_path)


def test_readiness_timeout_is_an_arm_failure(tmp_path: Path, processor) -> None:
    # Long enough for a loaded machine to start the stand-in and log its pid before the timeout.
    backend = make_backend(tmp_path, processor, "--standin-never-ready", ready_timeout=4)
    backend.prepare(("eager",))
    with pytest.raises(ArmFailure, match="not ready after 4 s") as caught:
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
    # The tap probe, then one request: its generation and the scoring of its own answer.
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text", "--standin-crash-after", "3")
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


def test_a_server_whose_hook_never_fires_is_refused_at_start(tmp_path: Path, processor) -> None:
    # Proof comes from the hook firing on a probe request in the model's process, not a marker.
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text", "--standin-no-plugin")
    with pytest.raises(ArmFailure, match="the tap never fired") as caught:
        with backend.session("eager"):
            pass
    assert "standin: pid" in caught.value.log_tail
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
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text", concurrent=True, gpus=(0, 1))
    with pytest.raises(KeyboardInterrupt):
        try:
            backend.prepare(("eager", "bcg"))
        finally:
            backend.close()
    assert len(started) == 2
    assert [pid for server in started for pid in group_members(server.pid)] == []
    assert not any(running(server.pid) for server in started)


def test_ctrl_c_inside_a_session_leaves_nothing(tmp_path: Path, processor) -> None:
    backend = make_backend(tmp_path, processor, "--standin-warmup", "text")
    with pytest.raises(KeyboardInterrupt):
        try:
            with backend.session("eager"):
                raise KeyboardInterrupt
        finally:
            backend.close()
    assert_nothing_left(tmp_path)


def test_sigterm_to_parity_stops_its_servers(tmp_path: Path) -> None:
    script = (
        "import sys, time; from pathlib import Path; from parity.engines import launcher\n"
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


def plan(**kwargs) -> servers.LaunchPlan:
    return servers.plan_launch(servers.SglangSettings(model="m", max_new_tokens=1, run_dir=Path("."),
                                                      mem_fraction=0.8, **kwargs))


def test_concurrent_plans_stagger_shared_gpus_and_split_own_ones() -> None:
    shared = plan(concurrent=True)
    assert shared.stages == (("eager",), ("bcg",))
    assert shared.placements["eager"] == servers.Placement(None, 0.4)
    assert shared.placements["bcg"].share == 0.4  # its fraction is worked out from free memory at its start
    own = plan(concurrent=True, gpus=(2, 3))
    assert own.stages == (("eager", "bcg"),)
    assert (own.placements["eager"].gpus, own.placements["bcg"].gpus, own.placements["bcg"].mem_fraction) == (
        (2,), (3,), 0.8)
    tp2 = plan(concurrent=True, gpus=(0, 1), sglang_args=("--tp-size", "2"))
    assert tp2.stages == (("eager",), ("bcg",)) and tp2.placements["bcg"].gpus == (0, 1)
    seq = plan(gpus=(1,))
    assert {(p.gpus, p.mem_fraction, p.share) for p in seq.placements.values()} == {((1,), 0.8, None)}


@pytest.mark.parametrize("kwargs, message", [
    ({"concurrent": True, "gpus": (0, 1, 2), "sglang_args": ("--tp-size", "2")}, "give 2 GPU"),
    ({"gpus": (0,), "sglang_args": ("--tp-size=2",)}, "needs 2 GPUs"),
    ({"concurrent": True, "gpus": (1, 1)}, "lists a GPU twice"),
])
def test_impossible_gpu_combinations_are_refused_up_front(kwargs, message) -> None:
    with pytest.raises(UsageError, match=message):
        plan(**kwargs)


def test_fraction_for_a_share_of_the_total_follows_free_memory() -> None:
    assert servers.fraction_for_share(0.35, (70.0, 140.0)) == pytest.approx(0.7)
    assert servers.fraction_for_share(0.35, None) == pytest.approx(0.35 / 0.65)  # errs towards less


@pytest.mark.parametrize("args, largest, count", [
    ((), 8192, 58),
    (("--cuda-graph-max-bs-prefill", "1000"), 960, 37),
    (("--cuda-graph-max-bs-prefill=512",), 512, 30),
    (("--cuda-graph-bs-prefill", "64", "16", "32", "--tp-size", "1"), 64, 3),
    (("--cuda-graph-bs-prefill=48",), 48, 1),
    (("--chunked-prefill-size", "4096"), 4096, 50),
    (("--max-total-tokens", "300"), 288, 23),
])
def test_prefill_buckets_follow_sglang(args, largest, count) -> None:
    facts = servers.ServerFacts.parse(args)
    assert facts.max_bucket == largest and len(facts.prefill_buckets) == count
    assert facts.bucket_of(largest) == largest and facts.bucket_of(largest + 1) is None


def test_bucket_of_honours_the_replay_length_limit_and_bad_values_are_usage_errors() -> None:
    facts = servers.ServerFacts.parse(("--cuda-graph-max-seq-len-prefill", "100"))
    assert facts.bucket_of(97) == 112 and facts.bucket_of(101) is None
    with pytest.raises(UsageError, match="needs one integer"):
        servers.ServerFacts.parse(("--cuda-graph-max-bs-prefill", "lots"))


def test_missing_sglang_or_port_is_backend_unavailable(tmp_path: Path, processor,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BackendUnavailableError, match="SGLang is not installed"):
        sglang_backend.create_sglang_backend(model="m", max_new_tokens=1, run_dir=tmp_path, processor=processor)
    with pytest.raises(BackendUnavailableError, match="cannot bind a port"):
        launcher.free_port("192.0.2.1")  # TEST-NET-1: not an address of this machine


def test_gpu_memory_reads_the_tightest_of_a_servers_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "nvidia_smi", lambda *_: "0, 1000, 2000\n1, 500, 2000\n")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus.gpu_memory((0, 1), 2) == (500.0, 2000.0)
    assert gpus.gpu_memory(None, 1) == (1000.0, 2000.0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # nvidia-smi ignores it; parity maps it
    assert gpus.gpu_memory(None, 1) == (500.0, 2000.0)
    assert gpus.gpu_memory((7,), 1) is None
    monkeypatch.setattr(gpus, "nvidia_smi", lambda *_: "")
    assert gpus.gpu_memory(None, 1) is None


def test_what_was_left_running_is_what_this_process_started_not_a_neighbour_s(tmp_path: Path) -> None:
    """The real-server tests check the servers they started, by process group: a server of the same
    engine that another job runs on the machine is none of theirs (issue 54)."""
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        spec = launcher.ServerSpec("bcg", (sys.executable, "-c", "import time; time.sleep(60)"), tmp_path / "bcg.log")
        server = launcher.start_server(spec)
        assert server.pid in launcher.groups_left_running() and neighbour.pid not in launcher.groups_left_running()
        server.stop(grace=2.0)
        assert server.pid not in launcher.groups_left_running()
    finally:
        neighbour.kill()
        neighbour.wait()
