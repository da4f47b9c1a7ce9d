"""Typed errors of the library; the CLI turns each into a one-line message and an exit code."""

from __future__ import annotations


class ParityError(Exception):
    """Base of every error parity reports to a user instead of a traceback."""

    exit_code = 2


class UsageError(ParityError):
    """Bad input from the user: an unknown name, an unreadable file, an invalid option value."""


class ResultsFileError(UsageError):
    """A results file that is missing, not JSON, or not valid `parity.results/1`."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class ModelUnavailableError(UsageError):
    """A checkpoint that cannot be loaded (not cached offline, not a Qwen3-VL, missing files)."""


class NothingToProve(ParityError):
    """A model that adds no DeepStack: INCONCLUSIVE_NO_POWER, found before any arm runs (exit 3)."""

    exit_code = 3
    verdict = "INCONCLUSIVE_NO_POWER"

    def __init__(self, message: str, cause: str = "model") -> None:
        super().__init__(message)
        self.cause = cause  # what it rests on: the model's config, or "audio" (the clips carry no DeepStack)
        self.written: str | None = None  # where its results were written, once they are (`parity run`)


class LocalizationError(UsageError):
    """A case that cannot be localized here: no probe on this backend, a prefill that did not replay,
    a forward that failed."""


class BackendUnavailableError(UsageError):
    """A backend whose requirements are missing here (SGLang not installed, no GPU, port in use)."""


class ArmFailure(Exception):
    """A backend failed while running one arm (a server died, a forward raised).

    Not a usage error: the experiment records it as that arm's `error`, the other arms are still
    run and reported, and the verdict becomes ERROR (exit 4).
    """

    def __init__(self, message: str, log_tail: str | None = None) -> None:
        super().__init__(message)
        self.log_tail = log_tail
