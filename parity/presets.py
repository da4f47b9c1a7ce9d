"""The embedded model presets: what each is, without building it (no torch at import time).

`parity.models.tiny` builds them; this table is what `parity models` lists and what decides
whether `--model` names a preset or a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "tiny-qwen3-vl"
OMNI_THINKER = "qwen3_omni_moe_thinker"  # the config family of Qwen3-Omni's thinker


@dataclass(frozen=True)
class TinyPreset:
    """One embedded model: which Qwen3-VL class and which knobs differ from the base recipe."""

    name: str
    description: str
    moe: bool = False
    deepstack_layers: int = 3
    hidden_size: int = 64
    num_layers: int = 4
    seed: int = 0
    max_positions: int = 4096  # the context: no prompt, bucket or answer may pass it
    model_type: str = "qwen3_vl"  # the transformers family its config is (`qwen3_vl_moe` when moe)


# The recipe works for any seed (tests/models/test_presets.py checks several); 0 is just the default.
PRESETS: dict[str, TinyPreset] = {
    p.name: p
    for p in (
        TinyPreset("tiny-qwen3-vl", "dense Qwen3-VL, DeepStack added after 3 decoder layers"),
        TinyPreset("tiny-qwen3-vl-moe", "Qwen3-VL-MoE (4 experts, top-2), DeepStack after 3 layers", moe=True),
        TinyPreset(
            "tiny-qwen3-vl-nodeepstack",
            "dense Qwen3-VL with deepstack_visual_indexes=[]: the negative control for power",
            deepstack_layers=0,
        ),
        TinyPreset(
            "tiny-qwen3.5",
            "shaped like a Qwen3.5 checkpoint, deepstack_visual_indexes=[]: INCONCLUSIVE_NO_POWER before any arm",
            deepstack_layers=0, model_type="qwen3_5",
        ),
        TinyPreset(
            "tiny-qwen3-omni",
            "Qwen3-Omni's MoE thinker (images, video and audio; 4 experts, top-2), DeepStack after 3 layers",
            moe=True, model_type=OMNI_THINKER,
        ),
        TinyPreset(
            "mid-qwen3-vl",
            "hidden 1024, 8 layers: a mid-size dense preset for GPU timings (slow on CPU)",
            hidden_size=1024,
            num_layers=8,
        ),
    )
}
