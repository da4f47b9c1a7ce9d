"""What every server engine does alike, tested once against both stand-ins (not the engines): the
pool's start-up failure, a crash mid-run, a tap that never fires, and teacher forcing under each
arm's own execution (`parity/engines/engine.py`, `parity/engines/pool.py`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from parity.engines.sglang.backend import create_sglang_backend
from parity.engines.vllm.backend import create_vllm_backend
from tests.engines.servers import SGLANG_STANDIN, VLLM_STANDIN, assert_nothing_left, standin_identity
from tests.engines.runs import MAX_NEW_TOKENS, run
from tests.engines.vllm_standin import ByteProcessor, model_config


@dataclass(frozen=True)
class Engine:
    name: str
    make: Callable[..., object]  # (run_dir, *stand-in flags, concurrent=) -> a backend
    drops: tuple[str, ...]  # stand-in flags for a graph that drops DeepStack


def _sglang(tiny_parts) -> Engine:
    processor, config = tiny_parts
    image_token = str(processor.tokenizer.convert_tokens_to_ids(processor.image_token))

    def make(run_dir: Path, *flags: str, concurrent: bool = True):
        return create_sglang_backend(
            model="tiny-standin", max_new_tokens=MAX_NEW_TOKENS, run_dir=run_dir, concurrent=concurrent,
            gpus=(0, 1) if concurrent else (), processor=processor, model_config=config, stop_grace=5.0,
            identity=standin_identity,
            ready_poll=0.05, ready_timeout=30.0,
            launch_command=[sys.executable, str(SGLANG_STANDIN), "--standin-image-token-id", image_token, *flags])

    return Engine("sglang", make, ())


def _vllm() -> Engine:
    def make(run_dir: Path, *flags: str, concurrent: bool = True):
        return create_vllm_backend(
            model="tiny-standin", max_new_tokens=MAX_NEW_TOKENS, run_dir=run_dir, concurrent=concurrent,
            gpus=(0, 1) if concurrent else (), processor=ByteProcessor(), model_config=model_config(),
            identity=standin_identity,
            stop_grace=5.0, ready_poll=0.05, ready_timeout=60.0,
            launch_command=[sys.executable, str(VLLM_STANDIN), *flags])

    return Engine("vllm", make, ("--standin-drop-deepstack",))


@pytest.fixture(params=["sglang", "vllm"])
def engine(request, tiny_parts) -> Engine:
    return _sglang(tiny_parts) if request.param == "sglang" else _vllm()


def test_teacher_forcing_scores_each_reference_under_the_arms_own_execution(tmp_path: Path, engine: Engine) -> None:
    result = run(engine.make(tmp_path, *engine.drops))
    arms = {arm.name: arm for arm in result.cases[0].arms}
    # bcg_normal is scored on both of its references and every arm on its own answer, so a
    # teacher-forced delta compares scores with scores.
    assert set(arms["bcg_normal"].forced) == {"eager_normal", "bcg_zero_deepstack", "bcg_normal"}
    assert set(arms["eager_normal"].forced) == {"eager_normal"}
    # A stand-in scores a token list with the function it generates with: an arm's own answer
    # scores as its own logprobs, and the dropped graph scores the zero arm's answer as that arm did.
    for arm in arms.values():
        assert arm.forced[arm.name] == pytest.approx(arm.token_logprobs, abs=1e-9)
    dropped = arms["bcg_normal"].forced["bcg_zero_deepstack"]
    assert dropped == pytest.approx(arms["bcg_zero_deepstack"].token_logprobs, abs=1e-9)
    assert len(arms["bcg_normal"].forced["eager_normal"]) == MAX_NEW_TOKENS and arms["bcg_normal"].forced_seconds > 0
    assert result.cases[0].comparison("bcg_normal", "bcg_zero_deepstack").tf_delta == pytest.approx(0.0, abs=1e-9)
    # A scoring request is another prefill of the arm: its tap records count in the arm's evidence.
    assert arms["bcg_normal"].evidence.tap_calls > arms["eager_zero_deepstack"].evidence.tap_calls
    assert_nothing_left(tmp_path)


def test_a_server_whose_tap_never_fires_is_an_error_with_its_log(tmp_path: Path, engine: Engine) -> None:
    result = run(engine.make(tmp_path, "--standin-no-plugin"))
    assert result.verdict.code == "ERROR" and "the tap never fired" in result.verdict.reason, result.verdict.reason
    error = next(a for a in result.cases[0].arms if a.name == "eager_normal").error
    assert "--- log tail ---" in error and "standin: pid" in error
    assert_nothing_left(tmp_path)


def test_a_server_that_dies_mid_run_fails_its_arms_and_nothing_is_left(tmp_path: Path, engine: Engine) -> None:
    result = run(engine.make(tmp_path, "--standin-crash-after", "3"))
    assert result.verdict.code == "ERROR" and "died mid-run" in result.verdict.reason, result.verdict.reason
    assert_nothing_left(tmp_path)  # the orphaned child included


def test_a_server_that_exits_at_start_fails_its_mode(tmp_path: Path, engine: Engine) -> None:
    result = run(engine.make(tmp_path, "--standin-exit-on-start", "1", concurrent=False))
    assert result.verdict.code == "ERROR" and "exited during start-up with code 1" in result.verdict.reason
    assert all(arm.failed for arm in result.cases[0].arms)
    assert_nothing_left(tmp_path)


def test_a_servers_serving_evidence_is_read_from_its_own_records() -> None:
    """design §10: each prefill the tap saw is a chunk after the cached rows, with its bucket when
    replayed and its DeepStack rows as image rows; a request's graph was ready only when every bucket
    it replayed was captured before the server's first request."""
    from types import SimpleNamespace

    from parity.engines.channel import TapEntry
    from parity.engines.engine import EngineBackend
    from parity.engines.evidence import TaggedRequest
    from parity.evidence import DeepStackRecord

    def prefill(raw: int, bucket: int | None, image_rows: int) -> TapEntry:
        record = DeepStackRecord((raw, 12), "float32", image_rows, 1.0, "ab", "normal") if image_rows else None
        return TapEntry("t", 7, "sglang::scheduler", True, bucket or raw, raw, bucket is not None, record)

    decode = TapEntry("t", 7, "sglang::scheduler", False, 1, 1, False, None)
    request = TaggedRequest(40, True, (prefill(8, 8, 3), prefill(8, 8, 8), prefill(8, None, 1), decode))
    server = SimpleNamespace(process=SimpleNamespace(name="bcg-prefix"))
    engine = SimpleNamespace(cached_tokens=lambda doc: doc["cached"], _captured={"bcg-prefix": frozenset({8, 16})},
                             prompts=SimpleNamespace(visual_token_ids=frozenset({9})))
    serving = EngineBackend.serving_evidence(engine, server, {"cached": 16}, request, [1] * 12 + [9] * 12 + [1] * 16)
    assert serving.image_span == (12, 24)  # the hit of 16 ended inside the image
    assert [(c.start, c.end, c.bucket, c.image_rows) for c in serving.chunks] == [
        (16, 24, 8, 3), (24, 32, 8, 8), (32, 40, None, 1)]
    assert serving.cached_tokens == 16 and serving.inconsistency() is None and serving.graph_ready is True
    engine._captured = {"bcg-prefix": frozenset({16})}  # bucket 8 was captured later, by a request
    assert EngineBackend.serving_evidence(engine, server, {"cached": 0}, request).graph_ready is False
    eager = TaggedRequest(24, True, (prefill(24, None, 8),))
    assert EngineBackend.serving_evidence(engine, server, {"cached": 0}, eager).graph_ready is None
