"""The embedded model presets: what each is, without building it (no torch at import time).

`parity.models.tiny` builds them; this table is what `parity models` lists and what decides
whether `--model` names a preset or a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "tiny-qwen3-vl"
OMNI_THINKER = "qwen3_omni_moe_thinker"  # the config family of Qwen3-Omni's thinker


# A run's memory past the weights: a floor and a fraction that keep a refusal honest without
# claiming a bound (docs/gpu.md has what was measured).
WORKSPACE_FRACTION = 0.10
WORKSPACE_FLOOR = 2 * 2**30


def gib(count: int) -> str:
    """Bytes as parity states a memory figure (listings, refusals)."""
    return f"{count / 2**30:.1f} GiB"


# Families that inherit Qwen3-VL's DeepStack contract but whose released checkpoints ship an empty
# deepstack_visual_indexes: with none, there is nothing for DeepStack to prove (design §3, no power). parity
# has no adapter for their language models, so one that does add DeepStack is not runnable yet.
NO_DEEPSTACK_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
NO_DEEPSTACK_REASON = "this model adds no DeepStack (deepstack_visual_indexes is empty)"


def no_power_before_any_arm(name: str, model_type: str) -> str:
    """The reason of the INCONCLUSIVE_NO_POWER said before any arm (design §4c)."""
    return (f"{name!r} ({model_type}): {NO_DEEPSTACK_REASON}, so no arm could show what DeepStack does under "
            "graph replay; nothing ran")


@dataclass(frozen=True)
class ReleasedShape:
    """A released Qwen3-VL checkpoint's dimensions, as its config.json gives them, without its weights."""

    release: str  # the checkpoint these dimensions are read from
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_positions: int
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    vision_positions: int  # num_position_embeddings: the learned grid the positions interpolate
    deepstack_indexes: tuple[int, ...]  # the ViT blocks whose features become DeepStack
    patch: int = 16
    merge: int = 2
    temporal_patch: int = 2
    experts: int = 0  # 0: dense
    experts_per_token: int = 0
    moe_intermediate: int = 0

    def parameters(self) -> int:
        """The parameter count of transformers' Qwen3-VL(-MoE) at these dimensions, by its layout
        (tests/models/test_shapes.py holds it to the model built on the meta device)."""
        h, v, hd = self.hidden, self.vocab, self.head_dim
        attention = h * hd * (2 * self.heads + 2 * self.kv_heads) + 2 * hd + 2 * h  # q k v o, q/k norms, 2 norms
        if self.experts:
            mlp = self.experts * h + self.experts * 3 * h * self.moe_intermediate  # router, gate_up and down
        else:
            mlp = 3 * h * self.intermediate
        text = 2 * v * h + self.layers * (attention + mlp) + h  # embeddings, LM head, final norm
        vh, vi, merged = self.vision_hidden, self.vision_intermediate, self.vision_hidden * self.merge ** 2
        block = 4 * vh + 3 * vh * vh + 3 * vh + vh * vh + vh + 2 * vh * vi + vi + vh
        patches = 3 * self.temporal_patch * self.patch ** 2 * vh + vh + self.vision_positions * vh

        def merger(norm_width: int) -> int:
            return 2 * norm_width + merged * merged + merged + merged * h + h

        vision = patches + self.vision_depth * block + merger(vh) + len(self.deepstack_indexes) * merger(merged)
        return text + vision

    def memory(self, itemsize: int) -> tuple[int, int]:
        """(the weights' bytes at `itemsize` bytes a parameter, the bytes a run needs: the weights and
        a workspace for activations, a prompt's keys and values, the captured graphs and the slot)."""
        weights = self.parameters() * itemsize
        return weights, weights + max(WORKSPACE_FLOOR, int(weights * WORKSPACE_FRACTION))

    def scaled(self, factor: int) -> "ReleasedShape":
        """Every width and count divided by `factor`, keeping what the recipe and the code paths
        need: head_dim and mRoPE as released, at least 4 layers and 4 heads (the DeepStack channel
        takes half of them), 2 KV heads, 2 experts per token, DeepStack after the same relative
        ViT depths; the vocabulary as released (the LM head's real width)."""
        depth = max(len(self.deepstack_indexes) + 1, self.vision_depth // factor)
        indexes = tuple(sorted({min(depth - 1, max(1, i * depth // self.vision_depth)) for i in self.deepstack_indexes}))
        return ReleasedShape(
            release=f"{self.release}, every width and count / {factor}", hidden=self.hidden // factor,
            layers=max(4, self.layers // factor), heads=max(4, self.heads // factor),
            kv_heads=max(2, self.kv_heads // factor), head_dim=self.head_dim, intermediate=self.intermediate // factor,
            vocab=self.vocab, rope_theta=self.rope_theta, mrope_section=self.mrope_section,
            max_positions=self.max_positions, vision_depth=depth, vision_hidden=self.vision_hidden // factor,
            vision_intermediate=self.vision_intermediate // factor, vision_heads=max(1, self.vision_heads // factor),
            vision_positions=self.vision_positions, deepstack_indexes=indexes, patch=self.patch, merge=self.merge,
            temporal_patch=self.temporal_patch, experts=self.experts // factor if self.experts else 0,
            experts_per_token=max(2, self.experts_per_token // factor) if self.experts else 0,
            moe_intermediate=self.moe_intermediate // factor)


# The released configs (config.json of each checkpoint on the Hugging Face hub): 8.77 B and 31.1 B
# parameters. The vision tower is the same in both; only its output width follows the text model.
_VISION = dict(vision_depth=27, vision_hidden=1152, vision_intermediate=4304, vision_heads=16, vision_positions=2304,
               deepstack_indexes=(8, 16, 24))
QWEN3_VL_8B = ReleasedShape("Qwen/Qwen3-VL-8B-Instruct", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                            intermediate=12288, vocab=151936, rope_theta=5_000_000.0, mrope_section=(24, 20, 20),
                            max_positions=262144, **_VISION)
QWEN3_VL_30B_A3B = ReleasedShape("Qwen/Qwen3-VL-30B-A3B-Instruct", hidden=2048, layers=48, heads=32, kv_heads=4,
                                 head_dim=128, intermediate=6144, vocab=151936, rope_theta=5_000_000.0,
                                 mrope_section=(24, 20, 20), max_positions=262144, experts=128, experts_per_token=8,
                                 moe_intermediate=768, **_VISION)
SCALE = 16  # the scaled shape presets: the same recipe, every width and count / SCALE


@dataclass(frozen=True)
class TinyPreset:
    """One embedded model: which Qwen3-VL class and which knobs differ from the base recipe. A shape
    preset takes its dimensions from a released checkpoint instead (`shape`), and is built at that
    size on the target device in the target dtype (parity/models/shapes.py)."""

    name: str
    description: str
    moe: bool = False
    deepstack_layers: int = 3
    hidden_size: int = 64
    num_layers: int = 4
    seed: int = 0
    max_positions: int = 4096  # the context: no prompt, bucket or answer may pass it
    model_type: str = "qwen3_vl"  # the transformers family its config is (`qwen3_vl_moe` when moe)
    shape: ReleasedShape | None = None


def shape_preset(name: str, shape: ReleasedShape, description: str) -> TinyPreset:
    return TinyPreset(name, description, moe=shape.experts > 0, deepstack_layers=len(shape.deepstack_indexes),
                      hidden_size=shape.hidden, num_layers=shape.layers, max_positions=shape.max_positions,
                      model_type="qwen3_vl_moe" if shape.experts else "qwen3_vl", shape=shape)


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
        shape_preset("shape-qwen3-vl-8b", QWEN3_VL_8B,
                     "Qwen3-VL-8B-Instruct's shape (36 layers, hidden 4096), random weights built on the device"),
        shape_preset("shape-qwen3-vl-30b-a3b", QWEN3_VL_30B_A3B,
                     "Qwen3-VL-30B-A3B-Instruct's shape (48 layers, 128 experts, top-8), random weights built on "
                     "the device"),
        shape_preset("shape-qwen3-vl-8b-scaled", QWEN3_VL_8B.scaled(SCALE),
                     f"shape-qwen3-vl-8b's recipe with every width and count / {SCALE}: its code path on a CPU"),
        shape_preset("shape-qwen3-vl-30b-a3b-scaled", QWEN3_VL_30B_A3B.scaled(SCALE),
                     f"shape-qwen3-vl-30b-a3b's recipe with every width and count / {SCALE}: its code path on a CPU"),
    )
}


def misspelled_preset(name: str) -> str | None:
    """The preset `name` is close to, when `name` is neither a preset nor a folder nor an owner/name
    hub id (every Qwen3-VL checkpoint has an owner): said at once, not after a wait for the hub."""
    import difflib
    from pathlib import Path

    if name in PRESETS or "/" in name or Path(name).expanduser().exists():
        return None
    close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.75)
    return close[0] if close else None
