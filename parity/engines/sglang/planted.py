"""A refresh bug beyond DeepStack, planted in SGLang 0.5.23's own prefill runner (a test-only
variant of parity's fix, design §6): what the freshness witness inside the engine must catch and
name whatever the answers do.

`deepstack-slot-mrope-stale` leaves the `mrope_positions` slot out of the registry's fill
(`fill_from`'s `skip_slots`) when the prefill graph runner loads a batch in the bucket it loaded
last: the slot then holds the previous batch's positions. It is parity's DeepStack slot fix plus the
one bug, so that the bug is the only input that is not fresh. Its hooks are registered before any
other of parity's (plugin.py), so that they are the innermost wrappers of SGLang's own code.

No such plant exists for `input_embeds` on 0.5.23: the embedding routine (`prepare_mm_inputs`)
writes every row of the batch's bucket into the slot itself, so leaving out the runner's fill or the
registry's reset of the padded tail changes nothing (both measured, docs/engines/sglang-cpu.md).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

MROPE_STALE = "deepstack-slot-mrope-stale"
VARIANTS = (MROPE_STALE,)
TARGETS = {  # tests/engines/test_sglang_contract.py checks each exists in the released wheel
    "load_batch": "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.load_batch",
    "fill_from": "sglang.srt.model_executor.cuda_graph_buffer_registry.CudaGraphBufferRegistry.fill_from",
}
_LOADING: contextvars.ContextVar[Any] = contextvars.ContextVar("parity_planted_loading", default=None)


@dataclass
class SkippedFill:
    """AROUND hooks: the prefill graph runner's batch load, and the registry fill inside it."""

    variant: str
    last: dict[int, int] = field(default_factory=dict)  # per runner: the bucket it loaded last

    def around_load_batch(self, original, runner, *args, **kwargs):
        token = _LOADING.set(runner)
        try:
            return original(runner, *args, **kwargs)
        finally:
            _LOADING.reset(token)

    def around_fill_from(self, original, registry, forward_batch, *args, **kwargs):
        runner = _LOADING.get()
        if runner is not None and registry is runner.buffer_registry:  # not the eager path's, not decode's
            bucket = int(kwargs["padded_num_tokens"])
            repeated, self.last[id(runner)] = self.last.get(id(runner)) == bucket, bucket
            if repeated and registry.has_slot("mrope_positions"):
                kwargs["skip_slots"] = frozenset(kwargs.get("skip_slots", frozenset())) | {"mrope_positions"}
        return original(registry, forward_batch, *args, **kwargs)

    def register(self) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(TARGETS["load_batch"], self.around_load_batch, HookType.AROUND)
        HookRegistry.register(TARGETS["fill_from"], self.around_fill_from, HookType.AROUND)
