"""parity against the real SGLang 0.5.23 code, where it is installed (no GPU needed).

scripts/setup_sglang_env.sh builds such an environment on a CPU machine. Without SGLang 0.5.23
every test here is skipped with the reason; the stand-in tests (test_sglang_backend.py) and the
wheel contract (test_sglang_contract.py) cover CI. What runs here is SGLang's own code:

- parity's exact server command lines through `prepare_server_args` (SGLang's argparse), and the
  facts parity reads from user flags equal to what SGLang parses from them;
- the plugin discovered and applied by `load_plugins()`, then the real `general_mm_embed_routine`
  firing parity's hook with stub inputs: only the real rows zeroed, replay detected, text-only
  entries recorded;
- the `/generate` bodies (generation and scoring) through the real request normalization, the
  scoring prompt expanded by the real Qwen-VL `build_input_ids`, and the scoring answer laid out
  by the real logprob processor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from parity.arms import MODES
from parity.engines.sglang import client, plugin, servers
from tests.engines.servers import SGLANG_VERSION, installed

_FOUND = installed("sglang")
pytestmark = [
    pytest.mark.real_sglang,
    pytest.mark.skipif(
        _FOUND != SGLANG_VERSION,
        reason=(f"SGLang {SGLANG_VERSION} is not installed here (found: {_FOUND or 'none'}); "
                "scripts/setup_sglang_env.sh sets up an environment that has it"),
    ),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A local Qwen3-VL checkpoint folder without weights (config, tokenizer, processor)."""
    from parity.models.tiny import build_config, build_processor, build_tokenizer
    from parity.presets import PRESETS

    folder = tmp_path_factory.mktemp("tiny-qwen3-vl")
    tokenizer = build_tokenizer()
    build_config(PRESETS["tiny-qwen3-vl"], tokenizer).save_pretrained(folder)
    build_processor(tokenizer).save_pretrained(folder)
    return folder


def parse(argv) -> object:
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args([*argv, "--host", "127.0.0.1", "--port", "30000"])


# --- command lines ---------------------------------------------------------------------------------------

def test_parity_command_lines_parse_with_sglangs_own_parser(checkpoint: Path) -> None:
    settings = servers.SglangSettings(model=str(checkpoint), max_new_tokens=20, run_dir=Path("."),
                                      sglang_args=("--cuda-graph-max-bs-prefill=1024", "--tp-size", "1"))
    for mode in MODES:
        args = parse(servers.server_flags(settings, mode, 0.35))
        assert args.cuda_graph_backend_prefill == {"eager": "disabled", "bcg": "breakable"}[mode]
        assert (args.attention_backend, args.enable_deterministic_inference, args.random_seed) == ("fa3", True, 0)
        assert args.disable_radix_cache and args.mem_fraction_static == 0.35
        assert args.model_path == str(checkpoint) and args.cuda_graph_max_bs_prefill == 1024


@pytest.mark.parametrize("user_args", [
    ("--cuda-graph-max-bs-prefill", "1000"),
    ("--cuda-graph-max-bs-prefill=512",),
    ("--cuda-graph-bs-prefill", "64", "16", "32", "--tp-size", "1"),
    ("--cuda-graph-bs-prefill=48",),
    ("--tensor-parallel-size", "2", "--pp-size=2"),
    ("--cuda-graph-max-seq-len-prefill", "300", "--context-length", "4096", "--dtype", "bfloat16"),
])
def test_the_facts_parity_reads_are_what_sglang_parses(checkpoint: Path, user_args) -> None:
    from sglang.srt.arg_groups.cuda_graph_hook import generate_prefill_cuda_graph_batch_sizes

    args = parse(("--model-path", str(checkpoint), *user_args))
    facts = servers.ServerFacts.parse(user_args)
    if args.cuda_graph_bs_prefill is not None:
        expected = tuple(sorted(args.cuda_graph_bs_prefill))
    else:  # the default max is chunked_prefill_size, resolved only on a GPU; 8192 on an H100/H200
        expected = tuple(generate_prefill_cuda_graph_batch_sizes(args.cuda_graph_max_bs_prefill or 8192))
    assert facts.prefill_buckets == expected
    assert facts.gpus_per_server == args.tp_size * args.pp_size * args.dp_size
    assert (facts.max_replay_tokens, facts.context_length) == (args.cuda_graph_max_seq_len_prefill, args.context_length)
    assert facts.dtype == (args.dtype if args.dtype != "auto" else None)


# --- the plugin in SGLang's plugin system ----------------------------------------------------------------

_ROUTINE = textwrap.dedent('''
    import json, os, sys
    import torch
    from types import SimpleNamespace
    from sglang.srt.plugins import load_plugins
    from sglang.srt.managers import mm_utils
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    load_plugins()  # what SGLang's scheduler process runs first: discovers parity, applies its hook

    RAW, BUCKET, HIDDEN, WIDTH = 5, 8, 4, 12
    deepstack = torch.zeros(BUCKET, WIDTH)  # [bucket tokens, hidden * n_ds]: padded like a BCG batch
    deepstack[1:4] = 1.0
    deepstack[RAW:] = 7.0  # a recognisable padded tail that must reach the LM untouched

    def embed_mm_inputs(**kw):  # stands in for the vision tower and the scatter of image rows
        return torch.ones(BUCKET, HIDDEN), {"input_deepstack_embeds": deepstack.clone()}
    mm_utils.embed_mm_inputs = embed_mm_inputs  # prepare_mm_inputs looks it up at call time
    mm_utils.get_server_args = lambda: None  # no server here: skips the encoder-dispatch branch

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, HIDDEN)
        def get_input_embeddings(self):
            return self.embed
        def forward(self, input_ids=None, forward_batch=None, input_embeds=None, **kwargs):
            seen.append(kwargs.get("input_deepstack_embeds"))
            return input_embeds

    def replay_layer_forward(*args, **kwargs):  # what BCG installs on the LM instance (docs/engines/sglang-0.5.23.md §3.3)
        seen.append(kwargs.get("input_deepstack_embeds"))
        return kwargs["input_embeds"]

    def batch(image):
        return SimpleNamespace(forward_mode=ForwardMode.EXTEND, contains_mm_inputs=lambda: image,
                               mm_inputs=[SimpleNamespace(mm_items=[])] if image else None,
                               extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[RAW], input_embeds=None,
                               spec_algorithm=None)

    seen, lm = [], LM()
    channel = os.environ["PARITY_SGLANG_TAP"]
    def arm(mode, tag):
        with open(os.path.join(channel, "control.json"), "w") as f:
            json.dump({"mode": mode, "tag": tag}, f)

    ids = torch.zeros(BUCKET, dtype=torch.long)
    use = {mm_utils.Modality.IMAGE: True}
    arm("zero", "image-eager")
    mm_utils.general_mm_embed_routine(ids, batch(True), lm, multimodal_model=lm, use_deepstack=use, positions=None)
    lm.forward = replay_layer_forward
    arm("zero", "image-replay")
    mm_utils.general_mm_embed_routine(ids, batch(True), lm, multimodal_model=lm, use_deepstack=use, positions=None)
    arm("record", "text-replay")
    mm_utils.general_mm_embed_routine(ids, batch(False), lm, multimodal_model=lm, use_deepstack=use, positions=None)
    print(json.dumps({
        "wrapped": mm_utils.prepare_mm_inputs.__name__ == "prepare_mm_inputs" and hasattr(mm_utils.prepare_mm_inputs, "__wrapped__"),
        "seen": [None if t is None else t.tolist() for t in seen],
    }))
''')


def test_load_plugins_applies_the_hook_and_the_real_routine_fires_it(tmp_path: Path) -> None:
    channel = plugin.TapChannel(tmp_path / "tap")
    channel.create()
    env = {**os.environ, plugin.ENV_VAR: str(channel.folder), "SGLANG_PLUGINS": plugin.ENTRY_POINT_NAME}
    done = subprocess.run([sys.executable, "-c", _ROUTINE], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["wrapped"], "load_plugins() did not wrap prepare_mm_inputs"
    eager, replayed, text = out["seen"]
    for handed in (eager, replayed):  # the LM got zeros in the real rows, the padded tail untouched
        assert all(v == 0.0 for row in handed[:5] for v in row) and all(v == 7.0 for row in handed[5:] for v in row)
    assert text is None  # a text-only batch carries no DeepStack
    (e,) = channel.entries("image-eager")
    (r,) = channel.entries("image-replay")
    (t,) = channel.entries("text-replay")
    assert (e.replay, r.replay, t.replay) == (False, True, True)
    assert (e.extend, e.tokens, e.raw_tokens) == (True, 8, 5)
    assert e.record.shape == (5, 12) and e.record.nonzero_rows == 3 and e.record.action == "zero"
    assert e.record.sha256 == r.record.sha256 and t.record is None
    assert e.pid != os.getpid()  # the process that ran the routine, not pytest's


# --- /generate bodies, scoring -------------------------------------------------------------------------------

def normalized(body: dict):
    from sglang.srt.managers.io_struct import GenerateReqInput

    request = GenerateReqInput(**body)
    request.normalize_batch_and_arguments()
    return request


def test_generation_and_scoring_bodies_pass_the_real_normalization() -> None:
    from sglang.api.v1.api_types import GenerateRequest
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    image = client.media_data("/abs/img.png", is_video=False)
    generation = client.generate_body("<|vision_start|><|image_pad|><|vision_end|>Hi", image, 20, rid="g")
    request = normalized(generation)
    assert request.return_logprob and request.top_logprobs_num == client.TOP_LOGPROBS
    assert request.return_prompt_token_ids and request.rid == "g" and request.image_data == "/abs/img.png"
    assert request.sampling_params == {"temperature": 0, "max_new_tokens": 20}
    score = client.score_body([1, 2, 151655, 3], [7, 8], expanded_length=40, media=image, rid="s")
    request = normalized(score)
    assert request.input_ids == [1, 2, 151655, 3, 7, 8] and request.logprob_start_len == 39
    assert request.sampling_params["max_new_tokens"] == 1 and request.return_logprob
    video = client.generate_body("<|vision_start|><|video_pad|><|vision_end|>Hi",
                                 client.media_data("/abs/v.mkv", is_video=True), 20, rid="v")
    assert normalized(video).video_data == "/abs/v.mkv" and normalized(video).image_data is None
    for body in (generation, score, video):  # /generate's schema gate admits each, and keeps every key parity sends
        assert generate_contract_error(body) is None
        decoded = GenerateRequest.from_json_value(body)
        assert all(getattr(decoded, key) is not None for key in body)


def test_the_scoring_prompt_expands_like_the_generation() -> None:
    # The Qwen-VL processor's build_input_ids turns each image placeholder into the image's tokens;
    # parity folds the expanded prompt back to one placeholder, so the server rebuilds the same ids.
    import torch
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor
    from parity.backends.protocol import Request
    from parity.engines.prompts import ChatPrompts
    from parity.media.catalog import builtin_fixture
    from parity.models.tiny import build_processor, build_tokenizer

    tiny = build_processor(build_tokenizer())
    pad = tiny.tokenizer.convert_tokens_to_ids(tiny.image_token)
    processor = SimpleNamespace(IM_TOKEN_ID=pad, VIDEO_TOKEN_ID=None, audio_token_id=None, spatial_merge_size=2)
    grid = torch.tensor([[1, 8, 6]])  # 48 patches / 2^2 = 12 image tokens
    prompts = ChatPrompts(tiny)
    request = Request(builtin_fixture("rgb-stripes"), "Describe it.")
    prompt = tiny.tokenizer(prompts.text(request), add_special_tokens=False)["input_ids"]
    expanded, _, _ = BaseMultimodalProcessor.build_input_ids(processor, prompt, img_grid_thw=grid)
    assert expanded.count(pad) == 12
    folded = prompts.scoring_ids(request, expanded)
    assert folded == tuple(prompt)
    again, _, modalities = BaseMultimodalProcessor.build_input_ids(processor, [*folded, 7, 8], img_grid_thw=grid)
    assert again == [*expanded, 7, 8] and len(modalities) == 1
    # Sending the expanded ids instead makes every pad the start of an image of its own: the
    # processor's own invariant breaks and the request fails.
    with pytest.raises(AssertionError):
        BaseMultimodalProcessor.build_input_ids(processor, expanded, img_grid_thw=grid.repeat(12, 1))


def test_the_scoring_answer_layout_is_what_parity_parses() -> None:
    from sglang.srt.managers.scheduler_components.logprob_result_processor import SchedulerLogprobResultProcessor

    prompt, forced = [10, 11, 12, 13], [7, 8, 9]
    origin = prompt + forced
    start = len(prompt) - 1
    # max_new_tokens 1: not a prefill-only request, so the regular input-logprob layout applies.
    req = SimpleNamespace(logprob_start_len=start, origin_input_ids=origin, logprob=SimpleNamespace(),
                          is_prefill_only=False)
    processor = SchedulerLogprobResultProcessor(model_config=SimpleNamespace(vocab_size=1000))
    # What the forward computes for positions start+1 .. end (the last is the sampled token's slot).
    computed = [-0.7, -0.8, -0.9, -1.0]
    processor._process_input_token_logprobs(req, computed)
    entries = [[v, i, None] for v, i in zip(req.logprob.input_token_logprobs_val, req.logprob.input_token_logprobs_idx)]
    assert client.parse_scores({"meta_info": {"input_token_logprobs": entries}}, forced) == (-0.7, -0.8, -0.9)


def test_the_released_runner_gives_omni_s_body_one_row_positions_and_the_fix_its_mrope(tmp_path: Path) -> None:
    """SGLang's own `_get_layer_model_positions` on a runner serving Qwen3-Omni's wrapper: it looks for
    is_mrope_enabled on the model and its `language_model`, and the wrapper keeps it on `thinker`, so
    a breakable graph of Omni reads one-row positions (docs/engines/sglang-0.5.23.md §8). The fix's hook,
    as the hook registry runs it after the method, gives the three-row mRoPE positions."""
    import torch
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    from parity.engines.sglang import deepstack_slot

    thinker = torch.nn.Module()  # the thinker as SGLang builds it: a sub-module of the wrapper
    thinker.num_deepstack_embeddings, thinker.is_mrope_enabled = 3, True
    omni = torch.nn.Module()
    omni.thinker = thinker
    runner = object.__new__(PrefillCudaGraphRunner)
    runner.enable_cp_bcg_capture = False
    runner.model_runner = SimpleNamespace(model=omni)
    batch = SimpleNamespace(positions=torch.arange(6), mrope_positions=torch.zeros(3, 6, dtype=torch.long))
    released = PrefillCudaGraphRunner._get_layer_model_positions(runner, batch)
    assert released is batch.positions  # the bug: one row, where eager uses the thinker's mRoPE
    fix = deepstack_slot.DeepStackSlotFix(deepstack_slot.FIX, tmp_path)
    assert fix.after_positions(released, runner, batch) is batch.mrope_positions
    dense = SimpleNamespace(is_mrope_enabled=True, num_deepstack_embeddings=3)  # Qwen3-VL: the runner finds it
    runner.model_runner = SimpleNamespace(model=dense)
    assert PrefillCudaGraphRunner._get_layer_model_positions(runner, batch) is batch.mrope_positions
