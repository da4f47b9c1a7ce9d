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

_RECIPE = ("tiny.py", "tiny_omni.py", "../presets.py")  # the sources that decide a preset's weights, beside this file
# The layout written: released MoE checkpoints store fused experts as [experts, in, out] (SGLang's
# loader transposes them on load); transformers 5 keeps [experts, out, in] in memory and saves that.
_FORMAT = "released-expert-layout-1"
_FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


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
