"""What every backend offers the experiment: sessions per execution mode that generate greedily."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from parity.fixtures import Fixture
from parity.results import TopLogprobs
from parity.tap import DeepStackRecord


@dataclass(frozen=True)
class Request:
    """One generation request: an image (None for text-only) and a user prompt."""

    fixture: Fixture | None
    prompt: str


@dataclass(frozen=True)
class Generation:
    """What one greedy generation produced; the experiment adds the arm's name, timing and errors."""

    token_ids: tuple[int, ...]
    text: str
    token_logprobs: tuple[float, ...]
    top_logprobs: TopLogprobs | None
    deepstack_record: DeepStackRecord | None


class Session(Protocol):
    """A loaded model (or running server) in one execution mode, reused for every request of a run.

    Requests are served one at a time, in the order given: the reuse scenario relies on it.
    """

    def generate(self, request: Request, deepstack: str) -> Generation:
        """Greedy generation with DeepStack `normal` (fingerprinted) or `zero` at the LM entry.

        Raises `ArmFailure` when the runtime fails; `UsageError` only for bad input.
        """
        ...


class Backend(Protocol):
    name: str

    def prepare(self, modes: Sequence[str]) -> None:
        """Called once with every mode the run needs, before the first session (may start work early)."""
        ...

    def session(self, mode: str) -> AbstractContextManager[Session]:
        """A session in `mode` ("eager" or "bcg"); leaving it releases what only it needed.

        Raises `ArmFailure` when the mode cannot be brought up (every arm of that mode then fails).
        """
        ...

    def bucket_of(self, num_tokens: int) -> int | None:
        """The prefill bucket a request of that many tokens replays in, when the backend knows."""
        ...

    def prompt_length(self, request: Request) -> int:
        """Number of prompt tokens the request expands to (image tokens included)."""
        ...

    def environment(self) -> Mapping[str, Any]:
        """Keys for the results' `environment` (versions, device, gpu)."""
        ...

    def config(self) -> Mapping[str, Any]:
        """Backend-specific keys for the results' `config`."""
        ...

    def close(self) -> None:
        """Release everything (models, servers); safe to call twice, also after a failure."""
        ...
