"""The embedded Qwen3-Omni thinker (`tiny-qwen3-omni`): images and video with DeepStack through every
arm and scenario, audio through its audio tower (exactly as transformers computes it), and a case
whose only media is audio judged INCONCLUSIVE_NO_POWER before any arm."""

from __future__ import annotations

import json
import wave

import numpy as np
import pytest
import torch

from parity.design import SCENARIOS
from parity.media.audio import RATE, audio_clip
from parity.media.catalog import builtin_fixture

PROMPT = "What do you hear?"


@pytest.mark.parametrize("fixture_name", [None, "rgb-stripes", "video-colour-cycle"])
def test_audio_rows_come_from_the_audio_tower_exactly_as_transformers_computes_them(tiny_omni, fixture_name):
    adapter = tiny_omni.adapter
    fixture = builtin_fixture(fixture_name) if fixture_name else None
    clip = audio_clip("audio-tone")
    prepared = adapter.prepare(fixture, PROMPT, audio=clip)
    assert int((prepared.input_ids == adapter.config.audio_token_id).sum()) > 0
    with torch.no_grad():
        reference = adapter.model(**adapter.processor_inputs(fixture, PROMPT, clip)).logits[0]
        mine = adapter.lm_head(adapter.body(prepared.input_embeds, prepared.positions, prepared.deepstack)[0])
    assert torch.allclose(mine, reference, atol=1e-5, rtol=0)
    # Audio adds no DeepStack: only the image or video rows carry it.
    if fixture is None:
        assert prepared.deepstack is None
    else:
        assert torch.equal(prepared.deepstack.abs().sum(dim=1) > 0, prepared.input_ids == prepared.visual_token)


def test_omni_passes_fixed_and_fails_legacy_on_images_and_video(parity_cli):
    args = ("--model", "tiny-qwen3-omni", "--fixture", "all", "--video", "all", "--scenario", "all",
            "--max-new-tokens", "2")
    fixed, doc, _ = parity_cli.run(*args)
    assert fixed.exit_code == 0 and doc["verdict"]["code"] == "PASS", fixed.output
    assert len(doc["cases"]) == 10 * len(SCENARIOS) and {c["fixture"].get("frames", 0) for c in doc["cases"]} == {0, 4, 5}
    legacy, doc, _ = parity_cli.run("--model", "tiny-qwen3-omni", "--video", "video-moving-square",
                                    "--fixture", "mosaic", "--runner", "legacy", "--max-new-tokens", "2", name="legacy")
    assert legacy.exit_code == 1 and doc["verdict"]["code"] == "FAIL_DEEPSTACK_DROPPED", legacy.output
    assert {c["verdict"]["code"] for c in doc["cases"]} == {"FAIL_DEEPSTACK_DROPPED"}


@pytest.mark.parametrize("backend", ["transformers", "sglang", "vllm"])
def test_audio_only_is_inconclusive_no_power_before_any_arm(parity_cli, tmp_path, backend):
    """On a server backend too, and no server starts."""
    out = tmp_path / "out"
    result = parity_cli("run", "--backend", backend, "--device", "cpu", "--model", "tiny-qwen3-omni",
                        "--audio", "audio-tone", "--out", str(out))
    assert result.exit_code == 3, result.output
    assert result.output.startswith("INCONCLUSIVE_NO_POWER: 1 audio-only case(s), audio-tone")
    assert "audio adds no DeepStack" in result.output and "nothing ran" in result.output
    doc = json.loads((out / "results.json").read_text())  # written all the same, for CI (design §4c)
    assert doc["cases"] == [] and doc["config"]["cause"] == "audio" and doc["config"]["backend"] == backend
    assert parity_cli("verdict", str(out / "results.json")).exit_code == 3


@pytest.mark.parametrize("args, message", [
    (("--audio", "audio-tone"), "tiny-qwen3-vl takes no audio"),
    (("--backend", "sglang", "--audio", "audio-tone"), "tiny-qwen3-vl takes no audio"),
    (("--model", "tiny-qwen3-omni", "--audio", "audio-tone", "--fixture", "rgb-stripes"), "run them apart"),
    (("--model", "tiny-qwen3-omni", "--audio", "nope.wav"), "no such file, and not a built-in clip"),
])
def test_audio_usage_errors(parity_cli, tmp_path, args, message):
    result = parity_cli("run", "--device", "cpu", *args, "--out", str(tmp_path / "out"))
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_wav_file_is_mixed_to_mono_and_resampled_to_the_model_rate(tmp_path):
    path = tmp_path / "beep.wav"
    left = (np.sin(np.arange(8000) / 8000 * 2 * np.pi * 440) * 16000).astype(np.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(2), out.setsampwidth(2), out.setframerate(8000)
        out.writeframes(np.stack([left, np.zeros_like(left)], axis=1).tobytes())
    clip = audio_clip(str(path))
    assert clip.name == "beep" and len(clip.samples) == RATE and clip.seconds == 1.0
    assert abs(float(np.abs(clip.samples).max()) - 0.5 * 16000 / 32768) < 1e-3  # the mono mix halves one channel
    (tmp_path / "bad.wav").write_bytes(b"RIFF....WAVE")
    with pytest.raises(Exception, match="not a PCM WAV file"):
        audio_clip(str(tmp_path / "bad.wav"))


def test_parity_models_lists_the_omni_thinker(parity_cli):
    result = parity_cli("models")
    assert "tiny-qwen3-omni" in result.output and "audio" in result.output


def test_moe_checkpoints_are_saved_in_the_released_expert_layout(tmp_path):
    """SGLang's loader transposes fused experts from the released [experts, in, out]; transformers 5
    holds [experts, out, in]: the saved preset must be the released one (docs/engines/sglang-cpu.md)."""
    from safetensors.torch import load_file

    from parity.models import load_model
    from parity.models.preset_checkpoint import saved_preset

    folder = saved_preset("tiny-qwen3-vl-moe", root=tmp_path)
    saved = {k: v for path in folder.glob("*.safetensors") for k, v in load_file(path).items()}
    model = dict(load_model("tiny-qwen3-vl-moe", device="cpu").adapter.model.named_parameters())
    fused = [k for k in saved if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused
    for key in fused:
        assert torch.equal(saved[key], model[key].transpose(-1, -2)), key
    dense = [k for k in saved if k not in fused and k in model]
    assert dense and all(torch.equal(saved[k], model[k]) for k in dense)
    # transformers' router always renormalizes the routed weights; vLLM builds its layers from the field.
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert text["norm_topk_prob"] is True
    dense_text = json.loads((saved_preset("tiny-qwen3-vl", root=tmp_path) / "config.json").read_text())["text_config"]
    assert "norm_topk_prob" not in dense_text  # a dense model routes nothing


def test_omni_is_saved_as_the_whole_model_the_engines_serve(tmp_path):
    """Both engines serve Qwen3-Omni as released: the thinker's config under `thinker_config`, its
    weights under `thinker.`, no talker; parity reads the facts it needs from the nested config."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from parity.engines.prompts import CheckpointFacts
    from parity.models import load_model
    from parity.models.preset_checkpoint import saved_preset

    folder = saved_preset("tiny-qwen3-omni", root=tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert config["enable_audio_output"] is False and "talker_config" not in config
    assert config["thinker_config"]["architectures"] == ["Qwen3OmniMoeThinkerForConditionalGeneration"]
    assert config["thinker_config"]["text_config"]["norm_topk_prob"] is True
    # vLLM sizes the vision tower's position table from image_size // patch_size per side
    vision = config["thinker_config"]["vision_config"]
    assert (vision["image_size"] // vision["patch_size"]) ** 2 == vision["num_position_embeddings"]
    assert vision["apply_vit_abs_pos_embed"] is True
    saved = {k: v for path in folder.glob("*.safetensors") for k, v in load_file(path).items()}
    load_model("tiny-qwen3-omni", device="cpu").adapter.model.save_pretrained(tmp_path / "thinker")
    alone = {k: v for path in (tmp_path / "thinker").glob("*.safetensors") for k, v in load_file(path).items()}
    assert saved.keys() == {f"thinker.{k}" for k in alone}
    fused = ("experts.gate_up_proj", "experts.down_proj")
    for name, value in alone.items():
        expected = value.transpose(-1, -2) if name.endswith(fused) else value
        assert torch.equal(saved[f"thinker.{name}"], expected), name
    facts = CheckpointFacts.of(AutoConfig.from_pretrained(folder))
    assert facts.deepstack_layers == len(config["thinker_config"]["vision_config"]["deepstack_visual_indexes"]) > 0


def test_a_whole_omni_checkpoint_runs_in_process_as_its_thinker(tmp_path):
    """A released Qwen3-Omni (here the preset saved as the engines serve it) loads in-process as its
    thinker, without a talker, holding exactly the preset's weights."""
    from parity.models import load_model
    from parity.models.preset_checkpoint import OMNI_THINKER, saved_preset

    whole = load_model(str(saved_preset("tiny-qwen3-omni", root=tmp_path)), device="cpu", dtype="float32")
    preset = load_model("tiny-qwen3-omni", device="cpu", dtype="float32")
    assert type(whole.adapter.model).__name__ == OMNI_THINKER and whole.adapter.takes_audio
    loaded, built = whole.adapter.model.state_dict(), preset.adapter.model.state_dict()
    assert loaded.keys() == built.keys()
    assert all(torch.equal(loaded[k], built[k]) for k in built)
