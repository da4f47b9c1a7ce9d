"""An embedded preset saved as a checkpoint folder, for engines that load weights themselves.

A server (SGLang) cannot build parity's presets in code: it loads a folder. The preset is built
once, saved with `save_pretrained` (model in float32, processor and tokenizer) and kept in a
cache folder keyed on everything that decides its weights: the preset's name and seed, the source
of the recipe, and the transformers version. Later runs reuse the folder; a changed recipe gets a
new one. Writes go to a temporary folder renamed into place, so a half-written checkpoint is never
served, and two runs racing both end with the same folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from parity.presets import PRESETS
from parity.textfiles import readable_as_written

_RECIPE = ("tiny.py", "tiny_omni.py", "../presets.py", "preset_checkpoint.py")  # the sources that decide a saved preset, beside this file
# The layout written: released MoE checkpoints store fused experts as [experts, in, out] (SGLang's
# loader transposes them on load); transformers 5 keeps [experts, out, in] in memory and saves that.
_FORMAT = "released-expert-layout-1"
_FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
# Fields released MoE configs carry that transformers neither needs nor writes, and engines read.
# transformers' Qwen3-VL-MoE and Qwen3-Omni routers always renormalize the routed top-k weights;
# vLLM's Qwen3-MoE layers read that from `norm_topk_prob` and fail to build without it
# (`_released_config_fields`).
_MOE_TEXT_FIELDS = {"norm_topk_prob": True}
# Qwen3-Omni is released, and served by both engines, as the whole model: the thinker's config nested
# in `thinker_config` and its weights under `thinker.`; no talker (docs/engines/sglang-cpu.md).
OMNI_THINKER = "Qwen3OmniMoeThinkerForConditionalGeneration"
OMNI_WHOLE = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
              "enable_audio_output": False}


def cache_root() -> Path:
    return Path(os.environ.get("PARITY_CACHE_DIR") or Path.home() / ".cache" / "parity")


def _key(name: str, seed: int) -> str:
    import transformers

    digest = hashlib.sha256(f"{name}|{seed}|{transformers.__version__}|{_FORMAT}".encode())
    here = Path(__file__).resolve().parent
    for source in _RECIPE:
        digest.update((here / source).read_bytes())
    return digest.hexdigest()[:16]


def saved_preset(name: str, seed: int | None = None, root: Path | None = None) -> Path:
    """The checkpoint folder of preset `name` (built from `seed`, default its own), saved if missing."""
    from parity.models import _built_preset

    preset = PRESETS[name]
    seed = preset.seed if seed is None else seed
    folder = (root or cache_root()) / "checkpoints" / f"{name}-seed{seed}-{_key(name, seed)}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    model, processor = _built_preset(name, seed)  # built in float32
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a few kB of weights: no progress bar in parity's output
        try:
            model.save_pretrained(staging)
            processor.save_pretrained(staging)
            _released_expert_layout(staging)
            _released_config_fields(staging)
            _whole_omni_model(staging)
            readable_as_written(staging)
        finally:
            hf_logging.enable_progress_bar()
        try:
            os.rename(staging, folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
            # Another run saved it first; the two are built from the same recipe and seed.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _released_expert_layout(folder: Path) -> None:
    """Rewrite fused MoE expert tensors `[E, out, in]` as released checkpoints hold them, `[E, in, out]`."""
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        fused = [k for k in tensors if k.endswith(_FUSED_EXPERTS)]
        if fused:
            for key in fused:
                tensors[key] = tensors[key].transpose(-1, -2).contiguous()
            save_file(tensors, path, metadata={"format": "pt"})


def _released_config_fields(folder: Path) -> None:
    """Add what released configs carry and engines read, wherever `config.json` nests the config it
    belongs to: `_MOE_TEXT_FIELDS` to a text config that routes tokens, and to a Qwen3-Omni vision
    config the square image its absolute position table covers."""
    import json
    import math

    path = folder / "config.json"
    config = json.loads(path.read_text())

    def add(node) -> None:
        if not isinstance(node, dict):
            return
        if "num_experts_per_tok" in node:
            for key, value in _MOE_TEXT_FIELDS.items():
                node.setdefault(key, value)
        if node.get("model_type") == "qwen3_omni_moe_vision_encoder":
            # vLLM builds the table from image_size // patch_size per side; transformers from
            # num_position_embeddings (a square); the released config has both, and says it is used.
            side = math.isqrt(node["num_position_embeddings"])
            node.setdefault("image_size", side * node["patch_size"])
            node.setdefault("apply_vit_abs_pos_embed", True)
        for child in node.values():
            add(child)

    before = json.dumps(config, sort_keys=True)
    add(config)
    if json.dumps(config, sort_keys=True) != before:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _whole_omni_model(folder: Path) -> None:
    """A Qwen3-Omni thinker saved alone, rewritten as the whole model the engines serve."""
    import json

    from safetensors.torch import load_file, save_file

    path = folder / "config.json"
    thinker = json.loads(path.read_text())
    if thinker.get("architectures") != [OMNI_THINKER]:
        return
    whole = {**OMNI_WHOLE, "thinker_config": thinker, "transformers_version": thinker.get("transformers_version")}
    path.write_text(json.dumps(whole, indent=2, sort_keys=True) + "\n")
    for shard in folder.glob("*.safetensors"):
        save_file({f"thinker.{k}": v for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        doc = json.loads(index.read_text())
        doc["weight_map"] = {f"thinker.{k}": v for k, v in doc["weight_map"].items()}
        index.write_text(json.dumps(doc, indent=2) + "\n")
