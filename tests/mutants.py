"""Runner bugs planted to prove parity catches them: each must be caught, none may PASS.

They live beside the tests, not in the product: they are the kinds of mistakes a real prefill
graph runner makes (a copy skipped when shapes repeat, a refresh after the replay instead of
before, a runner that declines to replay, an eager path that replays, a replay that is slightly
off everywhere), written as small subclasses. `scripts/measure_noise.py` measures the effect of
each against the tolerances (docs/verdicts.md).
"""

from __future__ import annotations

from contextlib import contextmanager

from parity.backends.transformers_backend import LMExecutor, TransformersBackend, TransformersSession
from parity.runner.graph_runner import PrefillGraphRunner


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


class NudgesEveryReplay(PrefillGraphRunner):
    """Scales the replayed input embeddings by (1 + 1e-4): every logprob moves by about 1e-4 in
    fp32, every token stays the same. The kind of bug (a wrong scale, a lossy copy) that only a
    tolerance tied to the measured noise catches."""

    NUDGE = 1e-4

    def refresh_inputs(self, input_embeds, positions, num_tokens, bucket):
        super().refresh_inputs(input_embeds * (1 + self.NUDGE), positions, num_tokens, bucket)


class RecapturesIntoItsDeadPool(PrefillGraphRunner):
    """Recaptures every graph, when the DeepStack buffer grows, into the pool the destroyed graphs
    shared: the CUDA allocator assert that crashed `--scenario all` on the first H200."""

    def _drop_graphs(self):
        pool = self._pool
        super()._drop_graphs()
        self._pool = pool


class KeepsBorrowedOutputs(PrefillGraphRunner):
    """Hands out views of the graphs' static outputs instead of copies: the next replay of another
    graph sharing the pool may overwrite them (garbage on a GPU)."""

    @staticmethod
    def _copied_out(outputs, num_tokens):
        return tuple(output[:num_tokens] for output in outputs)


class NudgesEveryReplayInBf16(NudgesEveryReplay):
    """The same kind of bug, as large as bf16 can show: 1/64 of every input (one bf16 step is 1/128).
    The answers move less than bf16's tolerance, so only the replay check against eager on its own
    shape can see it (design §6)."""

    NUDGE = 2 ** -6


class ReplaysInTheLargestBucket(PrefillGraphRunner):
    """Pads every prompt up to the largest captured bucket instead of the smallest that fits."""

    def bucket_for(self, num_tokens):
        fits = super().bucket_for(num_tokens)
        return None if fits is None else self.buckets[-1]


class EagerPathReplays(TransformersBackend):
    """An eager session that secretly runs the prefill through the graph runner."""

    @contextmanager
    def session(self, mode):
        yield TransformersSession(LMExecutor(self.loaded.adapter, self.runner), self)


# Runner classes whose bug shows in answers (not only in the evidence), with the scenarios that reach it.
ANSWER_BUGS = {
    SkipsCopyWhenShapeRepeats: ("stream",),
    RefreshesAfterReplay: ("stream",),
    NudgesEveryReplay: ("four-arm",),
}
