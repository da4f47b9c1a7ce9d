"""Shape presets (issue 45): Qwen3-VL-8B's and -30B-A3B's released dimensions with random weights,
and their `-scaled` variants, which run the same code here on the CPU.

The full sizes are never built here (35 and 124 GB in float32): their configs are, and counted on the
meta device; the scaled ones run the four arms, through the preset and through a saved checkpoint
folder, as a user's `--model DIR` would.
"""

from __future__ import annotations

import json

import pytest
import torch

from parity.models import load_model, shapes
from parity.models.tiny import build_config, build_tokenizer, model_class
from parity.presets import PRESETS, QWEN3_VL_8B, QWEN3_VL_30B_A3B, SCALE

SHAPES = ("shape-qwen3-vl-8b", "shape-qwen3-vl-30b-a3b", "shape-qwen3-vl-8b-scaled", "shape-qwen3-vl-30b-a3b-scaled")
SCALED = SHAPES[2:]


def config_of(name: str):
    return build_config(PRESETS[name], build_tokenizer(PRESETS[name]))


def test_the_full_shapes_are_the_released_configs() -> None:
    """Qwen3-VL-8B-Instruct's and Qwen3-VL-30B-A3B-Instruct's config.json, field by field."""
    eight, thirty = config_of("shape-qwen3-vl-8b"), config_of("shape-qwen3-vl-30b-a3b")
    for config, hidden, layers, kv, intermediate in ((eight, 4096, 36, 8, 12288), (thirty, 2048, 48, 4, 6144)):
        text, vision = config.text_config, config.vision_config
        assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
                text.head_dim, text.intermediate_size, text.vocab_size) == (hidden, layers, 32, kv, 128, intermediate,
                                                                             151936)
        assert text.max_position_embeddings == 262144 and text.rope_parameters["rope_theta"] == 5_000_000.0
        assert text.rope_parameters["mrope_section"] == [24, 20, 20] and text.rope_parameters["mrope_interleaved"]
        assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.patch_size,
                vision.spatial_merge_size, vision.temporal_patch_size, vision.num_position_embeddings,
                vision.out_hidden_size) == (27, 1152, 4304, 16, 16, 2, 2, 2304, hidden)
        assert list(vision.deepstack_visual_indexes) == [8, 16, 24] and not config.tie_word_embeddings
    moe = thirty.text_config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.decoder_sparse_step) == (128, 8, 768, 1)
    assert type(eight).__name__ == "Qwen3VLConfig" and type(thirty).__name__ == "Qwen3VLMoeConfig"


@pytest.mark.parametrize("name", SHAPES)
def test_the_parameter_count_is_the_built_model_s(name) -> None:
    """`parity models` counts by formula (no torch); the real class on the meta device agrees."""
    with torch.device("meta"):
        model = model_class(PRESETS[name])._from_config(config_of(name), dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].shape.parameters()


def test_the_released_sizes_are_what_the_releases_say() -> None:
    assert round(QWEN3_VL_8B.parameters() / 1e9, 2) == 8.77  # the model card's 8.77 B
    assert round(QWEN3_VL_30B_A3B.parameters() / 1e9, 1) == 31.1
    weights, needed = QWEN3_VL_8B.memory(2)
    assert weights == QWEN3_VL_8B.parameters() * 2 and needed > weights


def test_scaling_keeps_what_the_recipe_needs() -> None:
    scaled = QWEN3_VL_30B_A3B.scaled(SCALE)
    assert (scaled.hidden, scaled.intermediate, scaled.moe_intermediate) == (2048 // SCALE, 6144 // SCALE, 768 // SCALE)
    assert (scaled.head_dim, scaled.mrope_section, scaled.vocab) == (128, (24, 20, 20), 151936)
    assert scaled.layers >= 4 and scaled.heads >= 4 and scaled.kv_heads >= 2 and scaled.experts_per_token >= 2
    assert len(scaled.deepstack_indexes) == 3 and max(scaled.deepstack_indexes) < scaled.vision_depth


@pytest.mark.parametrize("name", SCALED)
def test_a_scaled_shape_passes_the_four_arms_and_fails_the_legacy_runner(parity_cli, name) -> None:
    # A mixture of experts in fp32 can flip one router near-tie between the padded and the exact
    # prefill: one decode step moves by up to 3.6e-4 on an AVX2 EPYC (docs/verdicts.md, Tolerances),
    # past fp32's 3e-5, while the replay equals eager on its own shape. DeepStack's drop moves 0.18.
    tol = ("--logprob-tol", "1e-3") if PRESETS[name].shape.experts else ()
    fixed, doc, _ = parity_cli.run("--model", name, *tol, name="fixed")
    assert fixed.exit_code == 0 and doc["verdict"]["code"] == "PASS", fixed.output
    legacy, bad, _ = parity_cli.run("--model", name, *tol, "--runner", "legacy", name="legacy")
    assert legacy.exit_code == 1 and bad["verdict"]["code"] == "FAIL_DEEPSTACK_DROPPED", legacy.output
    identity = doc["config"]["model_identity"]
    assert identity["kind"] == "preset" and identity["name"] == name
    assert "recipe sha256" in (parity_cli.tmp_path / "fixed" / "report.md").read_text()


def test_a_shape_preset_is_identified_by_its_recipe_not_by_hashing_its_weights(monkeypatch) -> None:
    cpu = torch.device("cpu")
    one = shapes.identity("shape-qwen3-vl-8b-scaled", 0, cpu, torch.float32)
    assert one == shapes.identity("shape-qwen3-vl-8b-scaled", 0, cpu, torch.float32)
    others = {shapes.identity("shape-qwen3-vl-8b-scaled", 1, cpu, torch.float32),
              shapes.identity("shape-qwen3-vl-8b-scaled", 0, cpu, torch.bfloat16),
              shapes.identity("shape-qwen3-vl-30b-a3b-scaled", 0, cpu, torch.float32)}
    assert one not in others and len(others) == 3
    monkeypatch.setattr("parity.models.weights_sha256", lambda *a: pytest.fail("a shape preset's weights were hashed"))
    loaded = load_model("shape-qwen3-vl-30b-a3b-scaled", device="cpu")
    assert loaded.identity == shapes.identity("shape-qwen3-vl-30b-a3b-scaled", 0, cpu, torch.float32)
    assert loaded.adapter.model.config.text_config._experts_implementation == "batched_mm"  # grouped_mm: GPUs only


def test_a_shape_that_does_not_fit_is_refused_in_one_line_before_anything_is_built(parity_cli, monkeypatch) -> None:
    monkeypatch.setattr(shapes, "free_memory", lambda device: 24 * 2**30)
    monkeypatch.setattr("parity.models.tiny.build_model", lambda *a, **k: pytest.fail("built before the check"))
    monkeypatch.setattr("parity.models.tiny.build_tokenizer", lambda *a, **k: pytest.fail("built before the check"))
    result, doc, out = parity_cli.run("--model", "shape-qwen3-vl-8b")
    assert result.exit_code == 2 and doc is None, result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line == ("Error: --model shape-qwen3-vl-8b needs 35.9 GiB of cpu memory (8.77 B parameters in float32: "
                    "32.7 GiB, and a workspace), and this cpu has 24.0 GiB free: run it on a larger device, or give "
                    "--dtype bfloat16 (a run needs 18.3 GiB), or run "
                    f"shape-qwen3-vl-8b-scaled (the same recipe / {SCALE})")
    # The negative control: the scaled variant fits the same 24 GiB, and is built.
    monkeypatch.undo()
    monkeypatch.setattr(shapes, "free_memory", lambda device: 24 * 2**30)
    shapes.check_memory("shape-qwen3-vl-8b-scaled", torch.device("cpu"), torch.float32)


def test_a_saved_shape_runs_as_a_user_s_checkpoint_folder(parity_cli, tmp_path) -> None:
    folder = tmp_path / "checkpoint"
    saved = parity_cli("models", "save", "shape-qwen3-vl-8b-scaled", str(folder), "--device", "cpu")
    assert saved.exit_code == 0 and f"run it with `parity run --model {folder}`" in saved.output, saved.output
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= {
        p.name for p in folder.iterdir()}
    assert json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"] == 151936
    result, doc, _ = parity_cli.run("--model", str(folder))
    assert result.exit_code == 0 and doc["verdict"]["code"] == "PASS", result.output
    assert doc["config"]["model_identity"]["kind"] == "checkpoint"
    again = parity_cli("models", "save", "shape-qwen3-vl-8b-scaled", str(folder), "--device", "cpu")
    assert again.exit_code == 2 and "is not empty" in again.output  # nothing is overwritten


def test_parity_models_lists_the_shapes_with_their_parameters_and_memory(parity_cli) -> None:
    listed = {line.split()[0]: line for line in parity_cli("models").output.splitlines()}
    assert "8.77 B params; a run needs 35.9 GiB in float32, 18.3 GiB in bfloat16" in listed["shape-qwen3-vl-8b"]
    assert "31.07 B params; a run needs 127.3 GiB in float32, 63.7 GiB in bfloat16" in listed["shape-qwen3-vl-30b-a3b"]
    assert set(SHAPES) <= set(listed) and "params" not in listed["tiny-qwen3-vl"]


def test_any_preset_saves_and_an_unknown_one_is_refused(parity_cli, tmp_path) -> None:
    saved = parity_cli("models", "save", "tiny-qwen3-vl", str(tmp_path / "tiny"), "--device", "cpu")
    assert saved.exit_code == 0 and (tmp_path / "tiny" / "model.safetensors").is_file(), saved.output
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["model_type"] == "qwen3_vl"
    unknown = parity_cli("models", "save", "qwen3-vl-9000b", str(tmp_path / "other"))
    assert unknown.exit_code == 2 and "NAME qwen3-vl-9000b: not an embedded preset" in unknown.output
    assert not (tmp_path / "other").exists()
