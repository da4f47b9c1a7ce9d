"""Runner bugs parity was never shown before: each must be caught, none may PASS.

The variants live here, not in the product: they are the kinds of mistakes a real prefill graph
runner makes (a copy skipped when shapes repeat, a refresh after the replay instead of before, a
runner that declines to replay, an eager path that replays), written as small subclasses.
"""

from contextlib import contextmanager

import pytest

from parity.arms import select_arms
from parity.backends.transformers_backend import LMExecutor, TransformersBackend, TransformersSession
from parity.experiment import CaseSpec, RunSpec, run_experiment
from parity.fixtures import builtin_fixture, default_prompts
from parity.graph_runner import PrefillGraphRunner
from parity.results import SCENARIOS


class SkipsCopyWhenShapeRepeats(PrefillGraphRunner):
    """Skips the DeepStack copy when a request has the same bucket and length as the last one."""

    _last = None

    def refresh_deepstack(self, deepstack, num_tokens, bucket):
        if self._last == (bucket, num_tokens):
            return
        self._last = (bucket, num_tokens)
        super().refresh_deepstack(deepstack, num_tokens, bucket)


class RefreshesAfterReplay(PrefillGraphRunner):
    """Copies the live DeepStack into the slot after the replay: each request sees the last one's."""

    _pending = None

    def refresh_deepstack(self, deepstack, num_tokens, bucket):
        self._pending = (deepstack, num_tokens, bucket)

    def replay(self, *args, **kwargs):
        outputs = super().replay(*args, **kwargs)
        super().refresh_deepstack(*self._pending)
        return outputs


class NeverReplays(PrefillGraphRunner):
    def can_replay(self, num_tokens):
        return False


class ReplaysOnlyTheFirstPrefill(PrefillGraphRunner):
    _replays = 0

    def can_replay(self, num_tokens):
        return self._replays == 0 and super().can_replay(num_tokens)

    def replay(self, *args, **kwargs):
        self._replays += 1
        return super().replay(*args, **kwargs)


class EagerArmsReplay(TransformersBackend):
    """A backend whose eager path runs the captured graph too: its eager arms are no reference."""

    @contextmanager
    def session(self, mode):
        yield TransformersSession(LMExecutor(self.loaded.adapter, self.runner), self)


def _run(loaded, runner_class=PrefillGraphRunner, backend_class=TransformersBackend, scenarios=("four-arm",),
         fixture="rgb-stripes", max_new_tokens=8, repeat=1):
    fx = builtin_fixture(fixture)
    spec = RunSpec(model=loaded.name, arms=select_arms("all"), cases=(CaseSpec(fx, default_prompts(fx)[0]),),
                   scenarios=scenarios, max_new_tokens=max_new_tokens, repeat=repeat)
    return run_experiment(spec, backend_class(loaded, max_new_tokens=max_new_tokens, runner_class=runner_class))


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
@pytest.mark.parametrize("runner_class", [SkipsCopyWhenShapeRepeats, RefreshesAfterReplay])
def test_state_bugs_are_caught_by_scenario_all(request, preset, runner_class):
    run = _run(request.getfixturevalue(preset), runner_class, scenarios=SCENARIOS)
    verdicts = {case.scenario: case.verdict.code for case in run.cases}
    assert verdicts["stream"] == "FAIL_STALE_STATE", verdicts
    assert run.verdict.code.startswith("FAIL_")
    # The correct runner passes the very same plan: the failure is the bug's, not the plan's.
    assert _run(request.getfixturevalue(preset), scenarios=SCENARIOS).verdict.code == "PASS"


@pytest.mark.parametrize("runner_class, backend_class, repeat", [
    (NeverReplays, TransformersBackend, 1),
    (ReplaysOnlyTheFirstPrefill, TransformersBackend, 1),
    (ReplaysOnlyTheFirstPrefill, TransformersBackend, 2),  # the repeat of the replayed arm runs eager
    (PrefillGraphRunner, EagerArmsReplay, 1),
])
@pytest.mark.parametrize("scenarios", [("four-arm",), SCENARIOS])
def test_a_path_that_did_not_run_as_labelled_never_passes(tiny, runner_class, backend_class, repeat, scenarios):
    run = _run(tiny, runner_class, backend_class, scenarios=scenarios, repeat=repeat)
    assert run.verdict.code == "INCONCLUSIVE_NOT_REPLAYED", run.verdict
