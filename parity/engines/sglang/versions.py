"""The SGLang releases parity supports, and what parity relies on that differs between them: one
table, as vLLM's (parity/engines/vllm/versions.py), so that following a release is one row here,
the version pinned by scripts/setup_sglang_env.sh and its tests (README, "Following a new engine
release").

The row that matters most is the one that will come: SGLang PR #33726 gives the prefill graph runner
its own DeepStack replay slot (an `input_deepstack_embeds` slot in its buffer registry, refreshed by
`_refresh_deepstack_replay_slot` before every replay, for models that set
`supports_bcg_deepstack_replay`). A release that ships it says `own_deepstack_slot=True`: the
released engine is then expected to PASS where 0.5.23 FAILs (the real-server tests read this row),
and parity's own slot fix stands aside there (deepstack_slot.py), as it does wherever it finds the
engine's slot at capture, whatever the row says. Light: no SGLang, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Release:
    """What one SGLang release has where parity reaches into it."""

    version: str
    # Its prefill graph runner carries DeepStack into the captured body itself (PR #33726's slot).
    own_deepstack_slot: bool
    # `--sglang-fix deepstack-slot` was validated on real servers of this release (released
    # FAIL_DEEPSTACK_DROPPED, fixed PASS on every scenario SGLang reaches): only then does it bind.
    fix_validated: bool


RELEASES: tuple[Release, ...] = (
    Release("0.5.23", own_deepstack_slot=False, fix_validated=True),
)
SUPPORTED: Mapping[str, Release] = {r.version: r for r in RELEASES}
NEWEST = RELEASES[-1]


def release(version: str | None) -> Release | None:
    """The supported release of that version, or None (not installed, or a release parity does not know)."""
    return SUPPORTED.get(version or "")


def fix_accepted() -> tuple[str, ...]:
    """The releases `--sglang-fix` may be asked on: validated there, or standing aside for the engine's slot."""
    return tuple(r.version for r in RELEASES if r.fix_validated or r.own_deepstack_slot)
