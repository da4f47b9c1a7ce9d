"""Shape presets: a released Qwen3-VL checkpoint's dimensions with random weights, built on the device.

No checkpoint can be downloaded where parity is tested, and the tiny presets measure overheads only,
so `shape-qwen3-vl-8b` and `shape-qwen3-vl-30b-a3b` give Qwen3-VL-8B's and -30B-A3B's released
configs (parity/presets.py) to the real transformers classes, with the tiny presets' recipe
(parity/models/tiny.py: the same DeepStack channel, so zeroing DeepStack changes the answer) and
tokenizer. Their weights are drawn directly on the target device in the target dtype, from the
preset's seed: a 61 GB model never passes through host memory. Their `-scaled` variants are the
same recipe with every width and count divided by presets.SCALE, built by this same code: what the
CPU suite runs.

Hashing tens of GB of random weights would dominate a run, so a shape preset's identity is its
recipe: the config, the recipe's source, the seed, and the device type and dtype it was drawn in
(the same seed draws other numbers on another device or in another dtype).

Before anything is built, the memory the weights need is compared with what the device has free,
and a model that cannot fit is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from parity.errors import ModelUnavailableError
from parity.model_identity import PRESET, ModelIdentity
from parity.presets import PRESETS, SCALE, TinyPreset, gib
from parity.models.sizing import host_available
from parity.textfiles import readable_as_written

_RECIPE_SOURCES = ("tiny.py", "shapes.py", "../presets.py")


def experts_implementation(device: torch.device, tiny: bool) -> str:
    """How MoE experts run. `batched_mm` gathers a copy of each selected expert's weights per token:
    exact and alike in every batch shape, and small at the tiny presets' and any CPU run's size, but
    412 GB at 8192 tokens of Qwen3-VL-30B-A3B. A released size on a GPU runs `grouped_mm`: one kernel
    over every expert's rows, no data-dependent shape or host read (capturable), memory proportional
    to the tokens. (On a CPU, grouped_mm's fp32 results move by ~1e-4 with its operands' alignment,
    past the teacher-forcing floor: measured on shape-qwen3-vl-30b-a3b-scaled.)"""
    return "grouped_mm" if device.type == "cuda" and not tiny else "batched_mm"


def parameter_count(name: str) -> int:
    return PRESETS[name].shape.parameters()


def free_memory(device: torch.device) -> int | None:
    """Bytes free on the device now (a GPU's free memory; what this process may still take of the
    host's, `sizing.host_available`), or None."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available()  # the process's own limits (ulimit -v, its cgroup) included


def check_memory(name: str, device: torch.device, dtype: torch.dtype, named: str | None = None) -> None:
    """One line, before anything is built, when the device cannot hold the preset. `named`: how the
    command the user typed names it (`--model X` for a run, `NAME X` for `models save`)."""
    weights, needed = PRESETS[name].shape.memory(dtype.itemsize)
    free = free_memory(device)
    if free is None or free >= needed:
        return
    dtype_name = str(dtype).removeprefix("torch.")
    smaller = f"{name}-scaled" if f"{name}-scaled" in PRESETS else None
    half = PRESETS[name].shape.memory(2)[1]
    ways = ["run it on a larger device"]
    ways += [f"give --dtype bfloat16 (a run needs {gib(half)})"] if dtype.itemsize > 2 and half <= free else []
    ways += [f"run {smaller} (the same recipe / {SCALE})"] if smaller else []
    raise ModelUnavailableError(
        f"{named or f'--model {name}'} needs {gib(needed)} of {device.type} memory ({parameter_count(name) / 1e9:.2f} "
        f"B parameters in {dtype_name}: {gib(weights)}, and a workspace), and this {device.type} has {gib(free)} free: "
        + ", or ".join(ways))


def identity(name: str, seed: int, device: torch.device, dtype: torch.dtype) -> ModelIdentity:
    """The recipe that decides the weights (module docstring), hashed."""
    preset = PRESETS[name]
    digest = hashlib.sha256(json.dumps({"shape": asdict(preset.shape), "seed": seed, "device": device.type,
                                        "dtype": str(dtype)}, sort_keys=True).encode())
    here = Path(__file__).resolve().parent
    for source in _RECIPE_SOURCES:
        digest.update((here / source).read_bytes())
    return ModelIdentity(name, PRESET, seed, digest.hexdigest())


def build(preset: TinyPreset, device: torch.device, dtype: torch.dtype, named: str | None = None):
    """(model, processor): the preset's model drawn on `device` in `dtype`, a shape preset's after
    the memory check (`named`: as `check_memory`)."""
    from parity.models.tiny import build_model, build_processor, build_tokenizer

    if preset.shape is not None:  # a tiny preset saved as a folder fits anywhere
        check_memory(preset.name, device, dtype, named)
    tokenizer = build_tokenizer(preset)
    return build_model(preset, tokenizer, device=device, dtype=dtype), build_processor(tokenizer, preset)


def save(name: str, folder: Path, device: torch.device, dtype: torch.dtype, seed: int | None = None,
         deepstack_scale: float = 1.0) -> Path:
    """The preset as a checkpoint folder a user's `--model DIR` loads: config, safetensors shards,
    tokenizer and processor; `deepstack_scale` scales what its DeepStack mergers add."""
    preset = PRESETS[name]
    if seed is not None:
        preset = replace(preset, seed=seed)
    model, processor = build(preset, device, dtype, named=f"NAME {name}")
    if deepstack_scale != 1.0:
        from parity.models.tiny import scale_deepstack

        scale_deepstack(model, deepstack_scale)
    from transformers.utils import logging as hf_logging

    folder.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()  # parity's own line says what was written
    try:
        model.save_pretrained(folder, max_shard_size="5GB")
        processor.save_pretrained(folder)
    finally:
        hf_logging.enable_progress_bar()
    readable_as_written(folder)
    return folder
