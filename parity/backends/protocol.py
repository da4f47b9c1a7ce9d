"""What every backend offers the experiment: sessions per execution mode that generate greedily."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

from parity.design import Serving
from parity.evidence import DeepStackRecord, Evidence
from parity.media.fixtures import Fixture
from parity.results import TopLogprobs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Request:
    """One generation request: an image (None for text-only), a user prompt, and the serving
    features it goes through (a family scenario's; none by default)."""

    fixture: Fixture | None
    prompt: str
    serving: Serving = Serving()


@dataclass(frozen=True)
class Generation:
    """What one greedy generation produced, and how it was executed; the experiment adds the arm."""

    token_ids: tuple[int, ...]
    text: str
    token_logprobs: tuple[float, ...]
    top_logprobs: TopLogprobs | None
    deepstack_record: DeepStackRecord | None
    evidence: Evidence | None
    # forced[i][j]: this execution's logprob of force[i][j], teacher-forced after force[i][:j];
    # forced[i] is None where the backend could not score exactly those tokens (no tf_delta then).
    forced: tuple[tuple[float, ...] | None, ...] = ()
    forced_seconds: float = 0.0
    # This execution's own tokens scored the way `forced` is, where that path differs from the
    # generation's (SGLang scores with a prefill, generates with decode steps): then a teacher-
    # forced delta compares scores with scores, not a prefill's logprobs with a decode's.
    self_forced: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Answer:
    """One generation request as it was served, before any scoring: what `Session.score` needs to
    score it later (the backend's own `state`), and the generation itself (no `forced` yet)."""

    generation: Generation
    state: Any = None


class Session(Protocol):
    """A loaded model (or running server) in one execution mode, reused for every request of a run.

    Requests are served one at a time, in the order given: the sequence scenarios rely on it. A
    generation and its teacher-forced scoring are two calls, so a sequence can be served back to
    back and scored after it (no request of parity's falls between two of a sequence's requests).
    """

    def answer(self, request: Request, deepstack: str) -> Answer:
        """Greedy generation with DeepStack `normal` (fingerprinted) or `zero` at the LM entry: one
        request to the runtime, nothing else. Raises `ArmFailure` when the runtime fails;
        `UsageError` only for bad input."""
        ...

    def score(self, answer: Answer, force: Sequence[Sequence[int]] = ()) -> Generation:
        """The answer's generation with its teacher-forced scores: each token list in `force`, and
        the answer's own tokens, scored under the same execution (mode and tap) of the same request.
        Raises `ArmFailure` when the runtime fails."""
        ...


@runtime_checkable
class SharesForwards(Protocol):
    """A session that can submit requests at once, for them to share a prefill forward (the batch
    scenario, design §10); a session without it serves them one at a time."""

    def answer_together(self, requests: Sequence[tuple[Request, str]]) -> tuple[Answer, ...]:
        """`answer` for each (request, DeepStack action), all submitted at once: in graph mode their
        prefills share a forward where the engine can; the eager reference serves each alone. Raises
        `ArmFailure` when the runtime fails (every request of the batch then failed)."""
        ...


class Generates:
    """`generate`: answer and score at once, for a request that nothing must follow first."""

    def generate(self, request: Request, deepstack: str, force: Sequence[Sequence[int]] = ()) -> Generation:
        return self.score(self.answer(request, deepstack), force)


class Backend(Protocol):
    name: str

    def prompt_length(self, request: Request) -> int:
        """Number of prompt tokens the request expands to (image tokens included).

        Raises `UsageError` when the model's processor refuses the request (e.g. an image's shape).
        """
        ...

    @property
    def max_positions(self) -> int | None:
        """The model's context length (prompt + generated tokens), when known."""
        ...

    def bucket_of(self, num_tokens: int) -> int | None:
        """The prefill bucket a request of that many tokens replays in, when the backend knows."""
        ...

    def prepare(self, modes: Sequence[str], prompt_lengths: Sequence[int],
                serving: Sequence[Serving] = ()) -> None:
        """Called once, before the first session, with every mode the run needs, the prompt length
        of every request it will replay (so only the buckets those need are captured), and the
        serving features its requests use (so their graphs are captured before any request too)."""
        ...

    def session(self, mode: str) -> AbstractContextManager[Session]:
        """A session in `mode` ("eager" or "bcg"); leaving it releases what only it needed.

        Raises `ArmFailure` when the mode cannot be brought up (every arm of that mode then fails).
        """
        ...

    def environment(self) -> Mapping[str, Any]:
        """Keys for the results' `environment` (versions, device, gpu, threads)."""
        ...

    def config(self) -> Mapping[str, Any]:
        """Backend keys for the results' `config`; must include `dtype` and `deepstack_layers`."""
        ...

    def timings(self) -> Mapping[str, float | None]:
        """The phases of a run only the backend sees, in seconds (`results.Timings`): `capture_s`
        for graphs captured in-process, `server_start_s` for servers started until ready."""
        ...

    def close(self) -> None:
        """Release everything (models, servers); safe to call twice, also after a failure."""
        ...


# --- probing a prefill per layer (design §7), for the backends that can ---------------------------------

@dataclass(frozen=True)
class Probed:
    """One prefill's hidden state at every probe point, real rows only."""

    points: tuple[tuple[int, int | None], ...]  # (decoder layer, DeepStack block added there or None)
    hidden: "torch.Tensor"  # [T, P, H]


@runtime_checkable
class CanLocalize(Protocol):
    """A backend that can probe a prefill per layer (optional: the SGLang backend cannot)."""

    def probe(self, mode: str, target: Request, deepstack: str,
              prefix: Sequence[tuple[Request, str]] = (), together: Sequence[tuple[Request, str]] = ()) -> Probed:
        """`target`'s prefill in `mode` with DeepStack `deepstack` at the LM entry; in `bcg`, by the
        probe graph of the runner under test, after replaying `prefix` ((request, deepstack), ...);
        submitted with `together` (itself among them) where its scenario batches it."""
        ...
