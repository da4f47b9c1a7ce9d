"""`parity audit` on small engine sources written here: what each rule concludes from the code it
reads, the exit codes, and the error when the engine is absent. The real packages' rows are tested
in their CI stages (tests/engines/test_sglang_audit.py, test_vllm_audit.py).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.audit.command import run_audit
from parity.audit.report import COVERED, DROPPED, EAGER, LEAKS, NOT_AN_INPUT, UNKNOWN
from parity.cli import cli

SGLANG_RUNNER = '''
class PrefillCudaGraphRunner:
    def __init__(self, model_runner):
        self._qwen_bcg_hc_sidechannel = is_qwen4_exp(model_runner.model_config.hf_config)
    def can_replay_locally(self, *, contains_mm_inputs=False):
        if contains_mm_inputs and self._qwen_bcg_hc_sidechannel:
            return False
        if self._is_full_backend and self._fa4_prefill and contains_mm_inputs:
            return False
        return True

def _build_layer_model_forward_kwargs(layer_model, forward_batch, pp_proxy_tensors):
    kwargs = {"input_embeds": forward_batch.input_embeds}
    BINDS
    return kwargs
'''
SGLANG_CONFIG = '''
multimodal_breakable_cuda_graph_supported_model_archs = ["ListedVLForConditionalGeneration"]

def is_qwen4_exp(config):
    return _hf_arch(config) in ("GatedVLForConditionalGeneration",)
'''
SGLANG_MODELS = {
    "qwen3_vl.py": '''
class Qwen3LLMModel(Qwen3Model):
    def __init__(self, config):
        self.layers = []
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, input_deepstack_embeds=None):
        return input_deepstack_embeds

class Qwen3VLForConditionalGeneration(nn.Module):
    def __init__(self, config, language_model_cls=Qwen3LLMModel):
        self.model = language_model_cls(config)
        self.num_deepstack_embeddings = len(config.vision_config.deepstack_visual_indexes)
        self.use_deepstack = {"image": True}

EntryClass = Qwen3VLForConditionalGeneration
''',
    "listed.py": '''
from sglang.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration

class ListedVLForConditionalGeneration(Qwen3VLForConditionalGeneration):
    pass

class GatedVLForConditionalGeneration(Qwen3VLForConditionalGeneration):
    pass

EntryClass = [ListedVLForConditionalGeneration, GatedVLForConditionalGeneration]
''',
    "wrapped.py": '''
from .qwen3_vl import Qwen3VLForConditionalGeneration

class Qwen3OmniMoeForConditionalGeneration(PreTrainedModel):
    def __init__(self, config):
        self.thinker = Qwen3VLForConditionalGeneration(config)
        self.forward = self.thinker.forward

EntryClass = Qwen3OmniMoeForConditionalGeneration
''',
    "countless.py": '''
from .qwen3_vl import Qwen3LLMModel

class CountlessVLForConditionalGeneration(nn.Module):
    def __init__(self, config):
        self.model = Qwen3LLMModel(config)
        self.use_deepstack = {"image": True}

EntryClass = CountlessVLForConditionalGeneration
''',
    "draft_mtp.py": '''
from .qwen3_vl import Qwen3LLMModel

class DraftForCausalLMMTP(nn.Module):
    def __init__(self, config):
        self.model = Qwen3LLMModel(config)
    def forward(self, input_ids, positions, forward_batch):
        return self.model(input_ids, positions, forward_batch, None)

EntryClass = DraftForCausalLMMTP
''',
    "vision_only.py": '''
class VisionOnlyForConditionalGeneration(nn.Module):
    def __init__(self, config):
        self.deepstack_visual_indexes = config.vision_config.deepstack_visual_indexes

EntryClass = VisionOnlyForConditionalGeneration
''',
    "plain.py": '''
class PlainForCausalLM(nn.Module):
    def forward(self, input_ids):
        return input_ids

EntryClass = PlainForCausalLM
''',
}

VLLM_MODELS = {
    "registry.py": '''
_MULTIMODAL_MODELS = {
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "OwnSetterForConditionalGeneration": ("own", "OwnSetterForConditionalGeneration"),
    "IgnoresForConditionalGeneration": ("own", "IgnoresForConditionalGeneration"),
    "OffForConditionalGeneration": ("own", "OffForConditionalGeneration"),
    "PerCallForConditionalGeneration": ("own", "PerCallForConditionalGeneration"),
    "PlainForCausalLM": ("own", "PlainForCausalLM"),
}
''',
    "qwen3_vl.py": '''
class Qwen3VLForConditionalGeneration(nn.Module):
    def __init__(self, config):
        self.use_deepstack = True
        self.deepstack_input_embeds = [torch.zeros(8, 4)]
    def _set_deepstack_input_embeds(self, embeds):
        self.deepstack_input_embeds[0].copy_(embeds[0])
    def _get_deepstack_input_embeds(self, n):
        return self.deepstack_input_embeds
    def _clear_deepstack_input_embeds(self, n):
        self.deepstack_input_embeds[0][:n].zero_()
    def forward(self, input_ids, positions, inputs_embeds=None):
        ds = self._get_deepstack_input_embeds(len(input_ids))
        out = self.language_model.model(input_ids, deepstack_input_embeds=ds)
        CLEARS
        return out
''',
    "own.py": '''
from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as Base

class OwnSetterForConditionalGeneration(Base):
    def _set_deepstack_input_embeds(self, embeds):
        self.deepstack_input_embeds[0].copy_(embeds[0])

class IgnoresForConditionalGeneration(Base):
    def forward(self, input_ids, positions, inputs_embeds=None):
        return self.language_model.model(input_ids)

class OffForConditionalGeneration(Base):
    def __init__(self, config):
        self.use_deepstack = False

class PerCallForConditionalGeneration(nn.Module):
    def forward(self, input_ids, positions):
        return self.model(input_ids, deepstack_input_embeds=self.deepstack_input_embeds)

class PlainForCausalLM(nn.Module):
    def forward(self, input_ids):
        return input_ids
''',
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return root


def sglang_tree(tmp_path: Path, binds: str = "") -> Path:
    files = {"srt/configs/model_config.py": SGLANG_CONFIG,
             "srt/model_executor/runner/prefill_cuda_graph_runner.py": SGLANG_RUNNER.replace("BINDS", binds or "pass")}
    files.update({f"srt/models/{name}": text for name, text in SGLANG_MODELS.items()})
    return write_tree(tmp_path / "sglang", files)


def vllm_tree(tmp_path: Path, clears: bool = True) -> Path:
    files = {f"model_executor/models/{name}": text.replace(
        "CLEARS", "self._clear_deepstack_input_embeds(len(input_ids))" if clears else "pass")
        for name, text in VLLM_MODELS.items()}
    return write_tree(tmp_path / "vllm", files)


def test_sglang_a_runner_that_binds_no_deepstack_drops_it_wherever_a_prefill_replays(tmp_path) -> None:
    report = run_audit("sglang", sglang_tree(tmp_path))
    assert report.outcomes("qwen3_vl") == {"breakable (default)": EAGER, "breakable (explicit)": DROPPED,
                                         "full (explicit)": DROPPED}
    # On the allowlist, it replays by default; gated by can_replay_locally, only full replays it.
    assert report.outcomes("listed", "ListedVLForConditionalGeneration")["breakable (default)"] == DROPPED
    assert report.outcomes("listed", "GatedVLForConditionalGeneration") == {
        "breakable (default)": EAGER, "breakable (explicit)": EAGER, "full (explicit)": DROPPED}
    assert report.exit_code == 1
    # The fix's slot is sized through what sets num_deepstack_embeddings: the model, or the sub-model a
    # wrapper serves through (Qwen3-Omni's thinker); a model that sets it nowhere is refused at capture.
    assert set(report.outcomes("qwen3_vl", with_fix=True).values()) == {EAGER, COVERED}
    assert report.outcomes("wrapped", with_fix=True)["full (explicit)"] == COVERED
    assert "on its thinker (Qwen3VLForConditionalGeneration" in report.row("wrapped").method
    assert report.outcomes("countless", with_fix=True)["full (explicit)"] == DROPPED
    assert "refuses it at capture" in report.row("countless").method
    # A draft head reuses a DeepStack body and never passes DeepStack to it: nothing to carry, said why.
    draft = report.row("draft_mtp")
    assert set(report.outcomes("draft_mtp", with_fix=True).values()) == {NOT_AN_INPUT}
    assert "never passed by DraftForCausalLMMTP" in draft.deepstack
    assert set(report.outcomes("vision_only").values()) == {NOT_AN_INPUT}
    assert report.row("plain") is None  # no DeepStack in its code: no row


def test_sglang_a_runner_that_binds_deepstack_covers_every_model(tmp_path) -> None:
    report = run_audit("sglang", sglang_tree(tmp_path, binds='kwargs["input_deepstack_embeds"] = None'))
    assert report.exit_code == 0 and not report.uncovered
    assert report.outcomes("wrapped")["breakable (explicit)"] == COVERED


def test_vllm_buffers_cleared_from_python_leak_under_whole_forward_graphs(tmp_path) -> None:
    report = run_audit("vllm", vllm_tree(tmp_path))
    assert report.outcomes("qwen3_vl", "Qwen3VLForConditionalGeneration") == {
        "NONE": EAGER, "PIECEWISE": COVERED, "FULL": LEAKS, "breakable": LEAKS}
    assert set(report.outcomes("qwen3_vl", with_fix=True).values()) == {EAGER, COVERED}
    # A setter of its own is not the one the fix wraps.
    assert report.outcomes("own", "OwnSetterForConditionalGeneration", with_fix=True)["FULL"] == LEAKS
    assert set(report.outcomes("own", "IgnoresForConditionalGeneration").values()) == {NOT_AN_INPUT}
    assert set(report.outcomes("own", "OffForConditionalGeneration").values()) == {NOT_AN_INPUT}
    assert report.outcomes("own", "PerCallForConditionalGeneration")["FULL"] == UNKNOWN
    assert report.exit_code == 1


def test_vllm_without_the_python_clear_even_piecewise_leaks(tmp_path) -> None:
    report = run_audit("vllm", vllm_tree(tmp_path, clears=False))
    assert report.outcomes("qwen3_vl", "Qwen3VLForConditionalGeneration")["PIECEWISE"] == LEAKS


@pytest.mark.parametrize("fmt", ["table", "markdown", "json"])
def test_the_command_prints_each_format_and_exits_with_the_verdict(tmp_path, fmt) -> None:
    source = sglang_tree(tmp_path)
    result = CliRunner().invoke(cli, ["audit", "--engine", "sglang", "--source", str(source), "--format", fmt])
    assert result.exit_code == 1, result.output
    assert "Qwen3VLForConditionalGeneration" in result.output
    if fmt == "json":
        assert json.loads(result.output)["exit_code"] == 1
    fixed = sglang_tree(tmp_path / "fixed", binds='kwargs["input_deepstack_embeds"] = None')
    result = CliRunner().invoke(cli, ["audit", "--engine", "sglang", "--source", str(fixed), "--format", fmt])
    assert result.exit_code == 0, result.output


def test_an_engine_that_is_not_installed_is_exit_2_with_where_to_get_it(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    result = CliRunner().invoke(cli, ["audit", "--engine", "vllm"])
    assert result.exit_code == 2
    assert "vllm is not installed" in result.output and "setup_vllm_env.sh" in result.output


def test_a_source_that_is_not_a_package_is_exit_2(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["audit", "--engine", "sglang", "--source", str(tmp_path)])
    assert result.exit_code == 2 and "not a Python package folder" in result.output
