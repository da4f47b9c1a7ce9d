"""Refresh bugs beyond DeepStack, planted in vLLM's own Model Runner V2 (test-only variants of
parity's DeepStack clear fix, design §6): what the freshness witness inside the engine must catch and
name whatever the answers do. Each is parity's fix plus the one bug, so the bug is the only input
that is not fresh.

- `deepstack-clear-mrope-stale`: `RopeState.prepare_positions` is skipped when a step schedules as
  many tokens as the step before it: the mRoPE positions buffer keeps the previous step's (every
  decode step after the first reads its predecessor's positions).
- `deepstack-clear-embeds-stale`: `EncoderRunner.get_inputs_embeds` computes the step's embeddings
  but leaves the buffer the graphs read as it is when the step is as long as the one before it.

Installed by the plugin with the fix (plugin.TARGETS), innermost: the fix and the tap wrap them.
"""

from __future__ import annotations

from typing import Any, Callable

from parity.engines.after_import import around

# The flag on every wrapper of the fix (deepstack_clear takes it from here): a planted one is the fix's too.
FIXED_FLAG = "__parity_fix__"

MROPE_STALE = "deepstack-clear-mrope-stale"
EMBEDS_STALE = "deepstack-clear-embeds-stale"
VARIANTS = (MROPE_STALE, EMBEDS_STALE)
# What each plant wraps: the model process must report it wrapped (backend.py), as the fix's own points.
POINTS = {MROPE_STALE: "RopeState.prepare_positions", EMBEDS_STALE: "EncoderRunner.get_inputs_embeds"}
_LAST = "_parity_planted_last"  # on the object refreshed: the token count of the step it refreshed last


def _repeats(holder: Any, tokens: int) -> bool:
    repeated = getattr(holder, _LAST, None) == tokens
    object.__setattr__(holder, _LAST, tokens)
    return repeated


def wrap_rope_positions(original: Callable, fix: Any) -> Callable:
    if fix.variant != MROPE_STALE:
        return original

    def prepare_positions(original, rope_state, idx_mapping, query_start_loc, *args, **kwargs):
        tokens = int(query_start_loc[idx_mapping.shape[0]])  # a sync; a test-only plant
        if _repeats(rope_state, tokens) and not fix.capturing():
            return None
        return original(rope_state, idx_mapping, query_start_loc, *args, **kwargs)

    return around(original, prepare_positions, FIXED_FLAG)


def wrap_inputs_embeds(original: Callable, fix: Any) -> Callable:
    if fix.variant != EMBEDS_STALE:
        return original

    def get_inputs_embeds(original, runner, input_ids, mm_embeds, is_mm_embed):
        if _repeats(runner, int(input_ids.shape[0])) and not fix.capturing():
            runner.model.embed_input_ids(input_ids, multimodal_embeddings=mm_embeds, is_multimodal=is_mm_embed)
            return runner.inputs_embeds
        return original(runner, input_ids, mm_embeds, is_mm_embed)

    return around(original, get_inputs_embeds, FIXED_FLAG)
