"""SGLang 0.5.23 with the DeepStack replay slot of SGLang PR #33726, ported by parity's tests: what
the release that carries the fix will look like, for the audit and for real servers.

The port is our own, written from the PR's description and its unit tests (design §11; read with the
search tool): the model opts in (`supports_bcg_deepstack_replay` on Qwen3-VL, its MoE subclass
inheriting it), the runner registers an `input_deepstack_embeds` graph slot in its buffer registry
for a model that opts in, binds it as the body's `input_deepstack_embeds` at capture (after the
layer kwargs are built, so it overwrites what anyone bound there), and before every replay
`_refresh_deepstack_replay_slot` copies the live rows and zeroes the tail, zeroes the slot on
absence and raises on a tensor that does not fit; Qwen3-VL and its MoE join the breakable-graph
allowlist. `broken=True` leaves the refresh out (the slot stays as captured: the drop again), the
planted bug parity must catch in the engine's own slot.

`ported(site, out)` builds the patched package next to the installed one: every file hard-linked
(copied where links cannot be made), the three it changes rewritten. Put `out` first on a server's
PYTHONPATH to serve it; give `out/sglang` to `parity audit --source` to read it. Each edit asserts
its anchor, so a SGLang whose code moved fails here, naming the file.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

RUNNER = "srt/model_executor/runner/prefill_cuda_graph_runner.py"
MODEL = "srt/models/qwen3_vl.py"
CONFIG = "srt/configs/model_config.py"

_REFRESH = '''

def _refresh_deepstack_replay_slot(slot, deepstack_embeds):
    """Ported from SGLang PR #33726 by parity's tests: define the slot's rows for this replay."""
    if deepstack_embeds is None or deepstack_embeds.numel() == 0:
        slot.zero_()
        return
    problem = None
    if deepstack_embeds.dim() != 2 or deepstack_embeds.shape[1] != slot.shape[1]:
        problem = f"shape {tuple(deepstack_embeds.shape)}, slot {tuple(slot.shape)}"
    elif deepstack_embeds.dtype != slot.dtype or deepstack_embeds.device != slot.device:
        problem = f"{deepstack_embeds.dtype} on {deepstack_embeds.device}, slot {slot.dtype} on {slot.device}"
    elif deepstack_embeds.shape[0] > slot.shape[0]:
        problem = f"{deepstack_embeds.shape[0]} rows for {slot.shape[0]}"
    if problem is not None:
        raise RuntimeError(f"input_deepstack_embeds does not fit the replay slot: {problem}")
    rows = deepstack_embeds.shape[0]
    slot[:rows].copy_(deepstack_embeds)
    slot[rows:].zero_()
'''

_REGISTER = '''
        # Ported from SGLang PR #33726: the DeepStack replay slot, for a model that opts in.
        _model = self.model_runner.model
        _blocks = int(getattr(_model, "num_deepstack_embeddings", 0) or 0)
        if (self.is_multimodal and getattr(type(_model), "supports_bcg_deepstack_replay", False) and _blocks > 0
                and self.buffer_registry.has_slot("input_embeds")):
            from sglang.srt.model_executor.cuda_graph_buffer_registry import GraphSlot, PaddingPolicy

            _width = int(self.model_runner.model_config.hidden_size) * _blocks
            self.buffer_registry.register_slot(GraphSlot(
                name="input_deepstack_embeds", shape_fn=lambda _bs, _tokens: (_tokens, _width),
                dtype=self.model_runner.dtype, axis="tokens", padding_policy=PaddingPolicy.ZERO,
                copy_from_fb=False))
'''

_BIND = '''
                # Ported from SGLang PR #33726: the captured body reads the engine's own slot.
                if self.buffer_registry.has_slot("input_deepstack_embeds"):
                    kwargs["input_deepstack_embeds"] = self.buffer_registry.get_slot(
                        "input_deepstack_embeds").slice_for(1, num_tokens)'''

_REFRESH_CALL = '''
                if self.buffer_registry.has_slot("input_deepstack_embeds"):  # ported from SGLang PR #33726
                    _refresh_deepstack_replay_slot(
                        slot=self.buffer_registry.get_slot("input_deepstack_embeds").slice_for(1, static_num_tokens),
                        deepstack_embeds=layer_kwargs.get("input_deepstack_embeds"))'''


def _edit(path: Path, anchor: str, added: str, before: bool = False) -> None:
    text = path.read_text()
    assert text.count(anchor) == 1, f"{path}: the anchor of the PR #33726 port is not there once: {anchor!r}"
    path.unlink()  # a hard link: write a file of our own, never the installed one
    path.write_text(text.replace(anchor, added + anchor if before else anchor + added))


def installed_site() -> Path:
    """The folder the installed `sglang` package lives in (found, not imported)."""
    import importlib.util

    return Path(importlib.util.find_spec("sglang").submodule_search_locations[0]).parent


def ported(site: Path, out: Path, broken: bool = False) -> Path:
    """The installed `site/sglang` with PR #33726's mechanism, as `out/sglang`; returns `out`."""
    package = out / "sglang"
    try:
        shutil.copytree(site / "sglang", package, copy_function=os.link, ignore=shutil.ignore_patterns("__pycache__"))
    except OSError:  # another file system: copies
        shutil.rmtree(package, ignore_errors=True)
        shutil.copytree(site / "sglang", package, ignore=shutil.ignore_patterns("__pycache__"))
    _edit(package / MODEL, "class Qwen3VLForConditionalGeneration(nn.Module):\n",
          "    supports_bcg_deepstack_replay = True  # ported from SGLang PR #33726\n")
    _edit(package / CONFIG, "multimodal_breakable_cuda_graph_supported_model_archs = [\n",
          '    "Qwen3VLForConditionalGeneration",\n    "Qwen3VLMoeForConditionalGeneration",\n')
    runner = package / RUNNER
    _edit(runner, "\n\ndef _slice_output_rows(", _REFRESH, before=True)
    _edit(runner, "        self.attention_layers = self.model_runner.attention_layers\n", _REGISTER, before=True)
    _edit(runner, '''                kwargs = _build_layer_model_forward_kwargs(
                    self.layer_model, forward_batch, pp_proxy_tensors
                )''', _BIND)
    if not broken:
        _edit(runner, "                self._fill_input_embeds_slot(args, layer_kwargs, static_num_tokens)", _REFRESH_CALL)
    return out
