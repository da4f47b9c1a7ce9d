"""The embedded models, the eager reference against Hugging Face, and the LM body against HF's forward."""

import pytest
import torch

from parity.arms import select_arms
from parity.backends.protocol import Request
from parity.backends.transformers_backend import TransformersBackend
from parity.errors import ModelUnavailableError
from parity.run.experiment import run_experiment
from parity.run.planning import CaseSpec, RunSpec
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import default_prompts
from parity.models import load_model
from parity.models.tiny import SPECIAL_TOKENS

PROMPT = "Describe the image in one sentence."


def _eager(loaded, deepstack="normal", fixture="rgb-stripes", prompt=PROMPT, force=()):
    with TransformersBackend(loaded, max_new_tokens=20).session("eager") as session:
        return session.generate(Request(builtin_fixture(fixture) if fixture else None, prompt), deepstack, force)


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe", "tiny_omni"])
def test_eager_reference_equals_hf_generate(preset, request):
    adapter = request.getfixturevalue(preset).adapter
    inputs = adapter.processor_inputs(builtin_fixture("rgb-stripes"), PROMPT)
    out = adapter.model.generate(**inputs, max_new_tokens=20, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
    hf_ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    hf_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, hf_ids)]
    mine = _eager(request.getfixturevalue(preset), force=[hf_ids])
    assert list(mine.token_ids) == hf_ids and len(hf_ids) == 20
    assert max(abs(a - b) for a, b in zip(mine.token_logprobs, hf_logprobs)) <= 1e-5
    # Teacher forcing its own answer in one cached pass scores what generation chose, to rounding.
    assert max(abs(a - b) for a, b in zip(mine.forced[0], mine.token_logprobs)) <= 1e-5


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe", "tiny_nodeepstack", "tiny_omni"])
@pytest.mark.parametrize("fixture_name", ["checkerboard", "video-bouncing-bar"])
def test_lm_body_logits_equal_hf_forward(preset, fixture_name, request):
    adapter = request.getfixturevalue(preset).adapter
    fixture = builtin_fixture(fixture_name)
    inputs = adapter.processor_inputs(fixture, PROMPT)
    prepared = adapter.prepare(fixture, PROMPT)
    with torch.no_grad():
        reference = adapter.model(**inputs).logits[0]
        mine = adapter.lm_head(adapter.body(prepared.input_embeds, prepared.positions, prepared.deepstack)[0])
    assert torch.allclose(mine, reference, atol=1e-5, rtol=0)


def test_dense_deepstack_is_zero_outside_image_rows(tiny):
    prepared = tiny.adapter.prepare(builtin_fixture("rgb-stripes"), PROMPT)
    image_rows = prepared.input_ids == tiny.adapter.config.image_token_id
    assert prepared.deepstack.shape == (prepared.input_ids.shape[0], tiny.adapter.hidden_size * 3)
    assert prepared.deepstack[image_rows].abs().sum(dim=1).gt(0).all()
    assert not prepared.deepstack[~image_rows].any()
    assert tiny.adapter.prepare(None, PROMPT).deepstack is None


@pytest.mark.parametrize("preset", ["tiny", "tiny_omni"])
def test_the_verdict_recomputes_where_the_template_puts_an_image(preset, request):
    """What the loader recomputes without torch or transformers (parity.preset_tokenizer, trust v7)
    is where the model's own processor puts every built-in image's first row, whatever the prompt."""
    from parity.evidence import image_span
    from parity.media.fixtures import builtin_fixtures
    from parity.preset_tokenizer import first_image_row

    adapter = request.getfixturevalue(preset).adapter
    for fixture in builtin_fixtures():
        for prompt in (*default_prompts(fixture), "Describe the picture in one long sentence, please."):
            prepared = adapter.prepare(fixture, prompt)
            span = image_span(prepared.input_ids.tolist(), {prepared.visual_token})
            assert span[0] == first_image_row(prompt), (fixture.name, prompt)


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_zeroing_deepstack_changes_the_answer(preset, request):
    loaded = request.getfixturevalue(preset)
    assert _eager(loaded, "normal").token_ids != _eager(loaded, "zero").token_ids


def test_nodeepstack_preset_has_no_power(tiny_nodeepstack):
    assert tiny_nodeepstack.adapter.deepstack_count == 0
    assert _eager(tiny_nodeepstack, "normal").token_ids == _eager(tiny_nodeepstack, "zero").token_ids


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe", "tiny_nodeepstack"])
def test_generator_never_emits_special_tokens(preset, request):
    loaded = request.getfixturevalue(preset)
    special = set(loaded.adapter.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
    for fixture in ("rgb-stripes", "checkerboard", "gradient-circle", None):
        for deepstack in ("normal", "zero"):
            gen = _eager(loaded, deepstack, fixture)
            assert len(gen.token_ids) == 20 and not special & set(gen.token_ids)
            assert gen.text.isascii() and gen.text.isprintable()


def test_presets_are_deterministic_across_builds(tiny):
    again = load_model("tiny-qwen3-vl", device="cpu")
    for (name, a), b in zip(tiny.adapter.model.state_dict().items(), again.adapter.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("preset, power", [("tiny", True), ("tiny_moe", True), ("tiny_nodeepstack", False)])
def test_eager_two_arm_run_is_incomplete_and_shows_power(preset, power, request):
    loaded = request.getfixturevalue(preset)
    fixture = builtin_fixture("rgb-stripes")
    spec = RunSpec(model=loaded.name, arms=select_arms("eager_normal,eager_zero_deepstack"),
                   cases=(CaseSpec(fixture, default_prompts(fixture)[0]),))
    run = run_experiment(spec, TransformersBackend(loaded, max_new_tokens=20))
    (comparison,) = run.cases[0].comparisons
    assert run.verdict.code == "INCOMPLETE"
    assert (comparison.a, comparison.b) == ("eager_zero_deepstack", "eager_normal")
    assert comparison.match is (not power)


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    """The tiny preset saved as an ordinary Hugging Face checkpoint folder."""
    folder = tmp_path_factory.mktemp("checkpoint") / "tiny"
    tiny.adapter.model.save_pretrained(folder)
    tiny.adapter.processor.save_pretrained(folder)
    return folder


def _broken(checkpoint, tmp_path, name, edit):
    import shutil

    folder = tmp_path / name
    shutil.copytree(checkpoint, folder)
    edit(folder)
    return folder


def test_a_checkpoint_folder_loads_through_from_pretrained_and_passes(parity_cli, checkpoint):
    result, doc, _ = parity_cli.run("--model", str(checkpoint))
    assert result.exit_code == 0, result.output
    assert doc["config"]["model"] == str(checkpoint) and doc["config"]["preset_seed"] is None


@pytest.mark.parametrize("name, edit, message", [
    ("truncated", lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
     "its weights cannot be loaded from that folder"),
    ("no-tokenizer", lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
     "its tokenizer does not map the image token"),
    ("no-config", lambda f: (f / "config.json").unlink(), "its config cannot be loaded from that folder"),
])
def test_a_broken_checkpoint_is_a_usage_error_before_any_arm(parity_cli, checkpoint, tmp_path, name, edit, message):
    folder = _broken(checkpoint, tmp_path, name, edit)
    result, doc, out = parity_cli.run("--model", str(folder))
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert "hf download" not in result.output and doc is None and not out.exists()


def test_missing_folders_and_uncached_hub_ids_say_what_to_do(monkeypatch, tmp_path):
    from huggingface_hub import constants

    with pytest.raises(ModelUnavailableError, match="no checkpoint folder there .no such folder"):
        load_model(str(tmp_path / "no-such-checkpoint"), device="cpu")
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelUnavailableError, match="it is a file"):
        load_model(str(tmp_path / "file"), device="cpu")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelUnavailableError, match=r"not in the local Hugging Face cache .*hf download Qwen/Qwen3-VL-8B"):
        load_model("Qwen/Qwen3-VL-8B-Instruct", device="cpu")
    # Online mode with a hub that cannot be reached: the cache is read at once, no downloader retries.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    from parity.models import checkpoint as module

    assert not module.hub_reachable()
    with pytest.raises(ModelUnavailableError, match="the hub cannot be reached from here"):
        load_model("Qwen/Qwen3-VL-2B-Instruct", device="cpu")


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_power_on_every_builtin_fixture_and_prompt(preset, request):
    from parity.media.fixtures import builtin_fixtures

    loaded = request.getfixturevalue(preset)
    for fixture in builtin_fixtures():
        for prompt in default_prompts(fixture):
            assert _eager(loaded, "normal", fixture.name, prompt.text).token_ids != \
                _eager(loaded, "zero", fixture.name, prompt.text).token_ids, (fixture.name, prompt.id)


# --- models that add no DeepStack, and models parity does not run ------------------------------------------

def _config_only(folder, config) -> str:
    folder.mkdir()
    config.save_pretrained(folder)
    return str(folder)


def test_a_qwen3_5_without_deepstack_is_no_power_before_any_arm(parity_cli, tmp_path):
    """The preset and a Qwen3.5 checkpoint folder alike: the config says there is nothing to prove;
    nothing is built and no server starts, but the verdict's files are written for CI (no case)."""
    from parity.models.checkpoint import NO_DEEPSTACK_REASON
    from parity.models.tiny import build_config, build_tokenizer
    from parity.presets import PRESETS

    result, doc, out = parity_cli.run("--model", "tiny-qwen3.5")
    assert result.exit_code == 3, result.output
    assert f"INCONCLUSIVE_NO_POWER: 'tiny-qwen3.5' (qwen3_5): {NO_DEEPSTACK_REASON}" in result.output
    assert "Error" not in result.output and doc["cases"] == [] and doc["before_run"]["code"] == "INCONCLUSIVE_NO_POWER"
    assert sorted(p.name for p in out.iterdir()) == ["report-full.md", "report.md", "results.json"]
    for backend in ("sglang", "vllm"):  # said before any engine is looked for
        result, _, _ = parity_cli.run("--model", "tiny-qwen3.5", "--backend", backend, "--device", "cpu")
        assert result.exit_code == 3 and NO_DEEPSTACK_REASON in result.output, result.output
    config = build_config(PRESETS["tiny-qwen3.5"], build_tokenizer())
    assert config.model_type == "qwen3_5" and config.vision_config.deepstack_visual_indexes == []
    folder = _config_only(tmp_path / "qwen3_5", config)
    result, doc, _ = parity_cli.run("--model", folder)
    assert result.exit_code == 3 and NO_DEEPSTACK_REASON in result.output, result.output
    assert doc["cases"] == [] and doc["config"]["cause"] == "model"


def test_an_architecture_parity_does_not_run_is_a_usage_error_naming_those_it_runs(parity_cli, tmp_path):
    from transformers import LlamaConfig

    from parity.models.tiny import build_config, build_tokenizer
    from parity.presets import PRESETS

    result, _, _ = parity_cli.run("--model", _config_only(tmp_path / "llama", LlamaConfig()))
    assert result.exit_code == 2 and "is a 'llama' checkpoint" in result.output
    assert "qwen3_vl, qwen3_vl_moe" in result.output and "parity models" in result.output
    with_deepstack = build_config(PRESETS["tiny-qwen3.5"], build_tokenizer())
    with_deepstack.vision_config.deepstack_visual_indexes = [0, 1]  # a Qwen3.5 that adds DeepStack: not runnable yet
    result, _, _ = parity_cli.run("--model", _config_only(tmp_path / "qwen3_5_ds", with_deepstack))
    assert result.exit_code == 2 and "'qwen3_5' checkpoint with DeepStack" in result.output, result.output
