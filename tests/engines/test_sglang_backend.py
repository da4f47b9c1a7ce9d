"""The SGLang backend driven by the experiment, against tests/sglang_standin.py (a stand-in, not SGLang).

What a run on a real server must give, shown with the stand-in: the drop and the fix, evidence
from the hook per LM entry, a bcg server that does not replay, a tap that never fires, a bcg
server that dies in its warm-up, teacher forcing, the sequence scenarios over two launches, and
one-GPU `--concurrent` starts in the order and with the memory settings SGLang 0.5.23 needs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parity.design import CORE_SCENARIOS as SCENARIOS  # what the stand-in servers serve
from parity.results import REUSE, STREAM, write_results
from parity.trust.loader import load_results
from parity.judge.verdict import judge_run
from tests.engines.servers import assert_nothing_left
from tests.engines.runs import four_arms, make_backend, run


# --- the drop, the fix, and the evidence ------------------------------------------------------------------

def test_the_drop_fails_with_evidence_from_the_hook(tmp_path: Path, tiny_parts) -> None:
    backend = make_backend(tmp_path, tiny_parts)
    result = run(backend)
    assert result.verdict.code == "FAIL_DEEPSTACK_DROPPED", result.verdict.reason
    arms = four_arms(result)
    for name, arm in arms.items():
        bcg = name.startswith("bcg")
        evidence = arm.evidence
        assert evidence.prefill_replayed is bcg and evidence.tap_calls >= 1, (name, evidence)
        assert evidence.inconsistency() is None
        assert (evidence.replayed_calls > 0) is bcg and bool(evidence.buckets) is bcg
        assert evidence.lm_calls > evidence.tap_calls  # decode steps are entries, without DeepStack
        assert evidence.prompt_tokens > 0 and evidence.max_bucket == 8192
        assert arm.deepstack_record.nonzero_rows > 0 and arm.deepstack_record.replay is bcg
    # Raw rows only are fingerprinted: eager and padded graph prefills hash the same input.
    assert len({arm.deepstack_record.sha256 for arm in arms.values()}) == 1
    assert result.config["deepstack_layers"] == 3 and result.config["dtype"] == "bfloat16"  # the config names none
    assert backend.launch_count == 2
    processes = result.config["sglang_tap_processes"]
    assert set(processes) == {"eager", "bcg"} and all(p[0].startswith("pid ") for p in processes.values())
    assert_nothing_left(tmp_path)


def test_the_fix_passes_and_the_file_rejudges_the_same(tmp_path: Path, tiny_parts) -> None:
    result = run(make_backend(tmp_path, tiny_parts, "--standin-deepstack-replay"))
    assert result.verdict.code == "PASS", result.verdict.reason
    write_results(result, tmp_path / "results.json")
    assert judge_run(load_results(tmp_path / "results.json")).verdict.code == "PASS"
    assert_nothing_left(tmp_path)


def test_a_bcg_server_that_never_replays_is_not_replayed(tmp_path: Path, tiny_parts) -> None:
    result = run(make_backend(tmp_path, tiny_parts, "--standin-no-replay"))
    assert result.verdict.code == "INCONCLUSIVE_NOT_REPLAYED", result.verdict.reason
    # Every prompt fits a captured bucket (up to 8192): the hint points at SGLang's own log lines.
    assert "Disable prefill CUDA graph because" in result.verdict.reason
    assert "--cuda-graph-max-bs-prefill" not in result.verdict.reason
    assert four_arms(result)["bcg_normal"].evidence.replayed_calls == 0
    assert_nothing_left(tmp_path)


def test_a_prompt_over_the_largest_bucket_is_not_replayed(tmp_path: Path, tiny_parts) -> None:
    # Every spelling of the bucket flags is parsed alike (test_sglang_launcher.py); the stand-in
    # reads this one with argparse, as SGLang does.
    backend = make_backend(tmp_path, tiny_parts, sglang_args=("--cuda-graph-max-bs-prefill=16",))
    assert backend.bucket_of(16) == 16 and backend.bucket_of(17) is None
    result = run(backend)
    assert result.verdict.code == "INCONCLUSIVE_NOT_REPLAYED", result.verdict.reason
    evidence = four_arms(result)["bcg_normal"].evidence
    assert evidence.max_bucket == 16 and evidence.prefill_replayed is False
    assert "largest captured bucket: 16" in result.verdict.reason and f"at least {evidence.prompt_tokens}" in result.verdict.reason
    assert_nothing_left(tmp_path)


# --- ERROR ----------------------------------------------------------------------------------------------------

def test_an_image_prefill_without_deepstack_rows_is_an_error(tmp_path: Path, tiny_parts) -> None:
    # The hook fires (text requests are recorded) but never sees DeepStack on an image prefill.
    result = run(make_backend(tmp_path, tiny_parts, "--standin-no-deepstack-key"))
    assert result.verdict.code == "ERROR", result.verdict.reason
    assert "never fired on the prefill of the request" in result.verdict.reason
    error = four_arms(result)["bcg_normal"].error
    assert "--- log tail ---" in error and "standin: pid" in error
    assert_nothing_left(tmp_path)


def test_a_bcg_server_dying_in_its_image_warm_up_is_an_error_naming_its_start_up(tmp_path: Path, tiny_parts) -> None:
    result = run(make_backend(tmp_path, tiny_parts, "--standin-replay-image-fault"))
    assert result.verdict.code == "ERROR", result.verdict.reason
    arms = four_arms(result)
    assert arms["eager_normal"].error is None and arms["eager_zero_deepstack"].error is None
    error = arms["bcg_normal"].error
    assert error.startswith("bcg server: exited during start-up with code 1")
    assert "multimodal BCG replay fault" in error and "illegal memory access" in error
    assert_nothing_left(tmp_path)


def test_a_bcg_server_that_only_times_out_gets_no_crash_hint(tmp_path: Path, tiny_parts) -> None:
    # parity stops a server that is not ready in time before its exit code is read: a timeout is
    # not the warm-up fault, and must not be reported as one.
    result = run(make_backend(tmp_path, tiny_parts, "--standin-never-ready", ready_timeout=2.0))
    assert result.verdict.code == "ERROR", result.verdict.reason
    error = four_arms(result)["bcg_normal"].error
    assert error.startswith("bcg server: not ready after 2 s") and "BCG replay fault" not in error
    assert_nothing_left(tmp_path)


# --- sequence scenarios over two launches -----------------------------------------------------------------

def test_all_scenarios_take_two_launches_and_pass_with_the_fix(tmp_path: Path, tiny_parts) -> None:
    backend = make_backend(tmp_path, tiny_parts, "--standin-deepstack-replay")
    result = run(backend, scenarios=SCENARIOS)
    assert [c.verdict.code for c in result.cases] == ["PASS"] * 4, [c.verdict for c in result.cases]
    assert backend.launch_count == 2
    stream = next(c for c in result.cases if c.scenario == STREAM)
    text_only = next(r for r in stream.requests if r.fixture is None)
    # A text-only request in a bcg sequence shows whether it replayed, without any tap call.
    bcg = next(a for a in text_only.arms if a.mode == "bcg")
    assert bcg.evidence.prefill_replayed is True and bcg.evidence.tap_calls == 0 and bcg.deepstack_record is None
    twin = next(r for r in stream.requests if r.label.startswith("twin"))
    first = stream.requests[0]
    assert twin.arms[0].deepstack_record.sha256 != first.arms[0].deepstack_record.sha256
    assert_nothing_left(tmp_path)


def test_stream_and_reuse_catch_the_drop(tmp_path: Path, tiny_parts) -> None:
    result = run(make_backend(tmp_path, tiny_parts), scenarios=(REUSE, STREAM))
    # The drop shows on each sequence's first request, where no state can be stale yet: named as the drop.
    assert {c.verdict.code for c in result.cases} == {"FAIL_DEEPSTACK_DROPPED"}
    assert_nothing_left(tmp_path)


# --- --concurrent ---------------------------------------------------------------------------------------------

def _log_times(run_dir: Path, mode: str) -> tuple[float, float]:
    text = (run_dir / f"sglang-{mode}.log").read_text()
    started = float(re.search(r"started at ([\d.]+)", text).group(1))
    ready = float(re.search(r"ready to roll! at ([\d.]+)", text).group(1))
    return started, ready


def _fraction(run_dir: Path, mode: str) -> float:
    first_line = (run_dir / f"sglang-{mode}.log").read_text().splitlines()[0].split()
    return float(first_line[first_line.index("--mem-fraction-static") + 1])


def test_one_gpu_concurrent_starts_one_after_the_other_with_fractions_of_free_memory(tmp_path: Path,
                                                                                     tiny_parts) -> None:
    asked = []

    def memory(gpus, count):  # 80 of 140 GiB free once the eager server holds its share
        asked.append((gpus, count))
        return 80 * 1024.0, 140 * 1024.0

    backend = make_backend(tmp_path, tiny_parts, "--standin-deepstack-replay", "--standin-startup-delay", "0.3",
                           gpus=(), gpu_memory_reader=memory)
    result = run(backend)
    assert result.verdict.code == "PASS", result.verdict.reason
    eager_started, eager_ready = _log_times(tmp_path, "eager")
    bcg_started, _ = _log_times(tmp_path, "bcg")
    assert bcg_started >= eager_ready > eager_started  # the second measures after the first took its share
    assert _fraction(tmp_path, "eager") == 0.35  # half of 0.70 of the GPU
    assert _fraction(tmp_path, "bcg") == pytest.approx(0.35 * 140 / 80, abs=1e-3)  # 0.35 of the total
    assert asked == [(None, 1)] and result.config["sglang_start_order"] == [["eager"], ["bcg"]]
    assert backend.launch_count == 2
    assert_nothing_left(tmp_path)


def test_concurrent_on_own_gpus_starts_both_at_once_with_the_full_fraction(tmp_path: Path, tiny_parts) -> None:
    backend = make_backend(tmp_path, tiny_parts, "--standin-startup-delay", "0.5", gpus=(2, 3),
                           gpu_memory_reader=lambda *_: pytest.fail("no memory reading for separate GPUs"))
    run(backend)
    eager_started, eager_ready = _log_times(tmp_path, "eager")
    bcg_started, _ = _log_times(tmp_path, "bcg")
    assert bcg_started < eager_ready  # overlapping start-ups
    assert _fraction(tmp_path, "eager") == _fraction(tmp_path, "bcg") == 0.7
    assert backend.config()["sglang_gpus"] == {"eager": [2], "bcg": [3]}
    assert_nothing_left(tmp_path)


def test_too_little_free_memory_for_the_second_server_fails_its_mode(tmp_path: Path, tiny_parts) -> None:
    backend = make_backend(tmp_path, tiny_parts, gpus=(), gpu_memory_reader=lambda *_: (30 * 1024.0, 140 * 1024.0))
    result = run(backend)
    arms = four_arms(result)
    assert result.verdict.code == "ERROR" and arms["eager_normal"].error is None
    assert "cannot give it 0.35 of the GPU" in arms["bcg_normal"].error
    assert_nothing_left(tmp_path)
