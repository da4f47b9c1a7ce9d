"""The experiment's design in one place (design §1, §3, §6): its arms and the order they run in, the
comparisons it judges, its scenarios and the requests of each sequence. Everything else reads
these; nothing here imports the rest of parity.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

# The canonical order of the experiment (design §1); reports and verdicts rely on these names.
EAGER_NORMAL = "eager_normal"
EAGER_ZERO = "eager_zero_deepstack"
BCG_NORMAL = "bcg_normal"
BCG_ZERO = "bcg_zero_deepstack"
ARM_ORDER = (EAGER_NORMAL, EAGER_ZERO, BCG_NORMAL, BCG_ZERO)
# The order arms run in within a case: each comparison's reference runs before the arm compared with it.
RUN_ORDER = (EAGER_NORMAL, EAGER_ZERO, BCG_ZERO, BCG_NORMAL)


# --- scenarios ---------------------------------------------------------------------------------------------

FOUR_ARM = "four-arm"
REUSE = "reuse"
STREAM = "stream"
SCENARIOS = (FOUR_ARM, REUSE, STREAM)
SEQUENCE_SCENARIOS = (REUSE, STREAM)
CASE_IMAGE = "case"  # a request with the case's own image
TWIN_IMAGE = "twin"  # a request with the twin of the case's image: same size and tokens, other pixels


@dataclass(frozen=True)
class RequestSpec:
    """One request of a sequence scenario: what the experiment sends and what a complete file holds."""

    label: str
    image: str | None  # CASE_IMAGE, TWIN_IMAGE, or None for a text-only request
    deepstack: str  # the DeepStack action at the LM entry, the same in both modes
    # Also answered eagerly with DeepStack zeroed (the `eager_zero_deepstack` power arm, in the eager
    # session only): the sequence's power (design §3 v3). The first request of every sequence.
    power: bool = False


# The requests of each sequence scenario, in the order a session serves them (design §6).
SEQUENCE_REQUESTS: Mapping[str, tuple[RequestSpec, ...]] = MappingProxyType({
    REUSE: (RequestSpec("primer (image)", CASE_IMAGE, "normal", power=True),
            RequestSpec("follow-up (text only)", None, "normal")),
    STREAM: (RequestSpec("image", CASE_IMAGE, "normal", power=True),
             RequestSpec("image, DeepStack zeroed", CASE_IMAGE, "zero"),
             RequestSpec("twin image (same size, other pixels)", TWIN_IMAGE, "normal"),
             RequestSpec("text only", None, "normal"),
             RequestSpec("image again", CASE_IMAGE, "normal")),
})


# --- comparisons ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """One comparison of the experiment, what a correct runtime gives, and what it tests."""

    a: str
    b: str  # the reference
    expect_match: bool
    meaning: str


POWER_CHECK = Check(EAGER_ZERO, EAGER_NORMAL, False, "power: DeepStack changes the eager answer")
FOUR_ARM_CHECKS = (
    Check(BCG_NORMAL, EAGER_NORMAL, True, "graph replay preserves semantics"),
    Check(BCG_NORMAL, BCG_ZERO, False, "graph replay sees DeepStack"),
    Check(BCG_ZERO, EAGER_ZERO, True, "control: graph and eager agree with DeepStack ablated"),
    POWER_CHECK,
)
FOUR_ARMS = (EAGER_NORMAL, EAGER_ZERO, BCG_NORMAL, BCG_ZERO)
# A sequence's first request (its image, DeepStack normal) is also run eagerly with DeepStack zeroed,
# in the eager session: the sequence's power (design §3 v3). No graph arm runs it, so the graph
# sequence is exactly the requests a server would see.
SEQUENCE_POWER_ARM = EAGER_ZERO
