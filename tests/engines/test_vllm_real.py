"""parity against the real vLLM 0.33.0 code, where it is installed (no GPU needed).

scripts/setup_vllm_env.sh builds such an environment on a CPU machine; run these with
`VENV/bin/python -m pytest -q -m real_vllm tests/engines/test_vllm_real.py`. Without vLLM 0.33.0 every
test here is skipped with the reason; the stand-in tests (test_vllm_backend.py) cover CI. The
wheel has no CPU kernels, so no model runs: what runs here is vLLM's own code (with
VLLM_TARGET_DEVICE=cpu) on stub instances that hold only what the code under test reads:

- parity's server command lines through vLLM's `vllm serve` parser and `AsyncEngineArgs`, and the
  capture sizes through `VllmConfig._set_cudagraph_sizes`;
- parity's plugin applied by `load_general_plugins()` (and inert without parity's variable);
- the real `DefaultModelState.prepare_inputs_embeds` -> `Qwen3VLForConditionalGeneration.embed_input_ids`
  -> `_set_deepstack_input_embeds` path with parity's wrappers: zeroing and fingerprinting;
- the real `CudaGraphManager` dispatch: FULL for an image prefill under `cudagraph_mode=FULL`,
  NONE for the eager server;
- the leak itself: a FULL step (vLLM's own `run_fullgraph` replaying the forward captured at
  start-up into parity's emulated graph, so no Python runs and nothing clears) followed by a text
  step that reads the image's rows, seen by the leak witness, against the eager path. Real servers
  doing the same end to end: test_vllm_real_server.py.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's config code needs a platform; CPU is this one

from parity.engines.vllm import plugin, servers  # noqa: E402
from tests.engines.servers import installed, real_vllm_marks  # noqa: E402
from tests.engines.vllm_steps import HIDDEN, IMAGE_PROMPT, LEVELS, TEXT_PROMPT, Engine  # noqa: E402





_FOUND = installed("vllm")
pytestmark = real_vllm_marks()


# --- command lines ------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _serve_parser():
    """`vllm serve`'s parser, as vLLM's CLI builds it (about 20 s: built once)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(root.add_subparsers(dest="subparser"))
    return root


def _parse(flags):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = _serve_parser().parse_args(["serve", *flags, "--host", "127.0.0.1", "--port", "8000"])
    args.model = args.model_tag  # what `vllm serve` does with its positional model (cli/serve.py)
    return args, AsyncEngineArgs.from_cli_args(args)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    # A local folder: with the hub offline (tests never reach it) vLLM resolves a hub id to its cache.
    return str(tmp_path_factory.mktemp("Qwen3-VL-8B-Instruct"))


@pytest.fixture(scope="module")
def parsed(checkpoint):
    """Every mode's command line of every graph mode, parsed by vLLM."""
    sizes = servers.CaptureSizes(None, None).sizes_for([300])
    out = {}
    for name in servers.GRAPH_MODES:
        settings = servers.VllmSettings(model=checkpoint, max_new_tokens=20, run_dir=Path("."),
                                        graph_mode=name, vllm_args=servers.split_vllm_args(["-tp 2"]))
        for mode in ("eager", "bcg"):
            out[name, mode] = (settings, sizes, *_parse(servers.server_flags(settings, mode, 0.35, sizes)))
    return out


def test_parity_command_lines_parse_with_vllms_own_parser(parsed, checkpoint) -> None:
    from vllm.config.compilation import CUDAGraphMode

    for (name, mode), (settings, sizes, args, engine) in parsed.items():
        expected = "NONE" if mode == "eager" else servers.GRAPH_MODES[name].cudagraph_mode
        assert args.model_tag == engine.model == checkpoint
        assert engine.compilation_config.cudagraph_mode == CUDAGraphMode[expected], (name, mode)
        assert engine.cudagraph_capture_sizes == list(sizes)
        assert engine.enable_prefix_caching is False and engine.generation_config == "vllm" and engine.seed == 0
        assert engine.gpu_memory_utilization == 0.35 and engine.max_model_len == servers.DEFAULT_MAX_MODEL_LEN
        assert engine.max_num_batched_tokens == max(servers.DEFAULT_MAX_BATCHED_TOKENS, sizes[-1])
        assert engine.limit_mm_per_prompt == {"image": 1, "video": 1}
        assert engine.tensor_parallel_size == 2 == settings.facts.gpus_per_server  # the user's flag, read alike
        assert engine.enforce_eager is False  # eager is cudagraph_mode NONE with torch.compile kept


@pytest.mark.parametrize("flag", ["-cc.cudagraph_mode=NONE", "--compilation-config.mode=0", "-O0", "-O=0",
                                  "--enforce-eager", "--max-cudagraph-capture-size=8", "--enable-prefix-caching",
                                  "--seed=1", "--generation-config=auto"])
def test_every_form_of_a_flag_parity_owns_is_refused_and_vllm_would_take_it(flag, checkpoint) -> None:
    from parity.errors import UsageError

    with pytest.raises(UsageError, match="may not set"):
        servers.split_vllm_args([flag])
    _parse([checkpoint, flag])  # vLLM accepts it: had parity let it through, it would change a server


def test_capture_sizes_resolve_as_parity_plans_and_vllms_default_is_the_trap() -> None:
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.config.vllm import VllmConfig

    def resolve(sizes, max_num_seqs, batched=8192):
        """The prefill graphs' token sizes and the largest, as vLLM resolves them (0.34 resolves the
        decode graphs apart, by request count; the prefill sizes are what an image prefill needs)."""
        stub = object.__new__(VllmConfig)  # every method of the real config, only these fields set
        fields = dict(model_config=SimpleNamespace(enforce_eager=False), speculative_config=None,
                      performance_mode="balanced",
                      scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched),
                      compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL,
                                                           **({} if sizes is None else {"cudagraph_capture_sizes": sizes})))
        for key, value in fields.items():
            object.__setattr__(stub, key, value)
        VllmConfig._set_cudagraph_sizes(stub)
        config = stub.compilation_config
        # 0.34 keeps the prefill graphs' token sizes apart (versions.py); 0.33 has the one list.
        prefill = getattr(config, "prefill_cudagraph_capture_token_sizes", config.cudagraph_capture_sizes)
        return list(prefill), max(prefill, default=0)

    planned = servers.CaptureSizes(None, None).sizes_for([300, 41])
    assert planned[-1] == 304 and resolve(list(planned), 1) == (list(planned), 304)  # they stand, whatever --max-num-seqs
    assert resolve(None, 1) == ([1, 2], 2)  # vLLM's default with --max-num-seqs 1: no image prefill replays
    # parity's ladder is vLLM's own default ladder (256 requests: up to 512).
    assert resolve(None, 256)[0] == list(servers.ladder(512))
    assert servers.CaptureSizes(None, 256).sizes_for([300])[-1] == 256  # sizes over the token budget are dropped
    assert resolve(list(servers.ladder(320)), 1, batched=256)[1] == 256


# --- the request bodies --------------------------------------------------------------------------------------

def test_the_bodies_pass_vllms_validation_as_greedy_requests_whatever_the_generation_config() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from parity.engines.vllm import client

    image = client.media_part(b"png", is_video=False)
    checkpoint_defaults = {"repetition_penalty": 1.05, "presence_penalty": 1.5, "top_k": 20, "top_p": 0.8}
    for body, logprobs, prompt_logprobs in ((client.generate_body("Describe.", image, 20, "t1"), 5, None),
                                            (client.score_body("Describe.", image, "A red", "t2"), None, 0)):
        request = ChatCompletionRequest.model_validate(body)
        params = request.to_sampling_params(20, checkpoint_defaults)  # --generation-config auto would pass these
        assert (params.temperature, params.repetition_penalty, params.presence_penalty) == (0.0, 1.0, 0.0)
        assert (params.logprobs, params.prompt_logprobs, params.seed) == (logprobs, prompt_logprobs, 0)
        assert request.request_id == body["request_id"] and request.return_token_ids
    scoring = ChatCompletionRequest.model_validate(client.score_body("Describe.", image, "A red", "t2"))
    assert scoring.continue_final_message and not scoring.add_generation_prompt
    video = ChatCompletionRequest.model_validate(client.generate_body("Describe.", client.media_part(b"v", True), 20, "t4"))
    assert video.messages[0]["content"][0]["type"] == "video_url"
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="logprobs"):  # vLLM refuses top_logprobs without logprobs
        ChatCompletionRequest.model_validate(client.generate_body("x", None, 1, "t3") | {"logprobs": False})


# --- the plugin ---------------------------------------------------------------------------------------------

_WRAPPED = """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
print("WRAPPED=" + json.dumps([getattr(f, "__parity_tap__", False) for f in (
    CudaGraphManager.dispatch, DefaultModelState.prepare_inputs_embeds,
    Qwen3VLForConditionalGeneration._set_deepstack_input_embeds)]))
"""


@pytest.mark.parametrize("armed", [True, False])
def test_load_general_plugins_applies_the_tap_only_when_parity_sets_its_variable(tmp_path: Path, armed: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != plugin.ENV_VAR} | {"VLLM_PLUGINS": plugin.ENTRY_POINT_NAME}
    if armed:
        env[plugin.ENV_VAR] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _WRAPPED], capture_output=True, text=True, env=env, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WRAPPED=")), None)
    assert line is not None, proc.stderr[-2000:]
    assert json.loads(line.removeprefix("WRAPPED=")) == [armed] * 3
    names = {ep.name for ep in importlib.metadata.entry_points(group=plugin.ENTRY_POINT_GROUP)}
    assert plugin.ENTRY_POINT_NAME in names


# --- the model process, at function level --------------------------------------------------------------------

def test_the_real_dispatcher_picks_full_for_an_image_prefill_and_none_for_the_eager_server(tmp_path: Path) -> None:
    for mode, expected in (("FULL", "FULL"), ("FULL_AND_PIECEWISE", "PIECEWISE"), ("NONE", "NONE")):
        engine = Engine(tmp_path, mode)
        _, dispatched, entry = engine.request(IMAGE_PROMPT, (3, 16))
        assert dispatched == expected == entry.mode, mode
        assert entry.replay is (expected != "NONE") and entry.extend is True
        assert entry.tokens == entry.raw_tokens == 24  # 24 is a captured size
        assert entry.requests == ("chatcmpl-tag1-0a1b2c3d",)


def test_the_wrapped_setter_zeroes_and_records_with_the_real_methods(tmp_path: Path) -> None:
    import torch

    from parity.runner.tap import fingerprint

    recorded, zeroed = Engine(tmp_path / "r", "FULL"), Engine(tmp_path / "z", "FULL", control="zero")
    normal_hidden, _, seen = recorded.request(IMAGE_PROMPT, (3, 16))
    zero_hidden, _, blank = zeroed.request(IMAGE_PROMPT, (3, 16))
    # Same input, same fingerprint in parity's [tokens, hidden * levels] layout: the 16 image rows.
    features = torch.randn(16, HIDDEN * (1 + LEVELS), generator=torch.Generator().manual_seed(1))
    expected = torch.zeros(24, HIDDEN * LEVELS)
    expected[3:19] = features[:, HIDDEN:]
    assert seen.record.sha256 == blank.record.sha256 == fingerprint(expected, "normal").sha256
    assert seen.record.nonzero_rows == 16 and (seen.record.action, blank.record.action) == ("normal", "zero")
    assert seen.record.replay is True
    # The zero arm's buffer holds zeros (never cleared under FULL): its LM added nothing.
    assert all(float(level.abs().sum()) == 0.0 for level in zeroed.model.deepstack_input_embeds)
    assert zeroed.model.deepstack_input_embeds_num_tokens == 24
    added = (normal_hidden - zero_hidden).abs().sum(dim=1) > 0
    assert added.nonzero().flatten().tolist() == list(range(3, 19))


def test_the_leak_at_function_level(tmp_path: Path) -> None:
    """Under cudagraph_mode=FULL the image request's rows stay in the buffer and the next text
    request reads them; the leak witness names them. The eager server's path clears them."""
    results = {}
    for mode in ("FULL", "NONE"):
        engine = Engine(tmp_path, mode)
        _, _, image = engine.request(IMAGE_PROMPT, (3, 16))
        uncleared = engine.model.deepstack_input_embeds_num_tokens
        text_hidden, dispatched, text = engine.request(TEXT_PROMPT, None)
        results[mode] = (image, uncleared, text_hidden, dispatched, text)
    image, uncleared, leaked_hidden, dispatched, text = results["FULL"]
    assert dispatched == "FULL" and uncleared == 24  # the clear never ran after the image replay
    assert text.stale_rows == 16 and text.stale_source == image.tag and text.uncleared == 24
    assert text.record is None  # no setter call: the text step did not write its rows
    _, eager_uncleared, clean_hidden, eager_dispatch, eager_text = results["NONE"]
    assert eager_dispatch == "NONE" and eager_uncleared == 0 and eager_text.stale_rows == 0
    # The stale rows changed exactly the text request's rows 3..18, nothing else.
    changed = (leaked_hidden - clean_hidden).abs().sum(dim=1) > 0
    assert changed.nonzero().flatten().tolist() == list(range(3, 19))
    # parity's evidence for that request: a leak witness naming the image that left the rows.
    from parity.engines.evidence import TaggedRequest, arm_evidence

    evidence = arm_evidence([TaggedRequest(24, False, (text,))], 48, {image.tag: "sha-of-the-image"})
    assert evidence.leak.rows == 16 and evidence.leak.source_sha256 == "sha-of-the-image"
    assert evidence.prefill_replayed is True


def test_the_partial_clear_residue_is_seen_on_the_next_longer_step(tmp_path: Path) -> None:
    """After a FULL image step, an eager (over-the-largest-size) step clears only its own rows;
    the rest stays with the counter at 0 (docs/engines/vllm-0.33.md §1.4), and the witness still sees it."""
    engine = Engine(tmp_path, "FULL")
    engine.request(IMAGE_PROMPT, (3, 16))
    _, dispatched, short = engine.request([1, 2, 3, 4, 5, 6, 7, 8], None)
    assert dispatched == "FULL" and short.stale_rows == 5  # rows 3..7 of the image
    big = Engine(tmp_path / "b", "FULL")
    big.request(IMAGE_PROMPT, (3, 16))
    big.model._get_deepstack_input_embeds(8)  # an eager step of 8 rows: _get, LM, then
    big.model._clear_deepstack_input_embeds(8)  # _clear([:8]) and the counter to 0
    assert big.model.deepstack_input_embeds_num_tokens == 0
    _, _, later = big.request(TEXT_PROMPT, None)
    assert later.stale_rows == 11 and later.uncleared == 0  # rows 8..18 survived a clear that reset the counter


def test_the_clear_fix_with_the_real_methods_leaves_no_stale_row_and_keeps_the_steps_own(tmp_path: Path) -> None:
    """parity's --vllm-fix deepstack-clear around vLLM's own setter and step preparation: under FULL
    the text request after an image reads no stale row and answers as the eager server does, the
    image request's own rows are untouched, and the partial-clear residue is gone too."""
    import torch

    fixed, released, eager = (Engine(tmp_path / "f", "FULL", fix=True), Engine(tmp_path / "r", "FULL"),
                              Engine(tmp_path / "e", "NONE"))
    image = {name: engine.request(IMAGE_PROMPT, (3, 16)) for name, engine in
             (("fixed", fixed), ("released", released), ("eager", eager))}
    assert torch.equal(image["fixed"][0], image["released"][0])  # the step's own rows: never zeroed
    text = {name: engine.request(TEXT_PROMPT, None) for name, engine in
            (("fixed", fixed), ("released", released), ("eager", eager))}
    assert text["released"][2].stale_rows == 16  # negative control: the leak is there without the fix
    assert text["fixed"][1] == "FULL" and text["fixed"][2].stale_rows == 0
    assert torch.equal(text["fixed"][0], text["eager"][0])
    residue = Engine(tmp_path / "p", "FULL", fix=True)
    residue.request(IMAGE_PROMPT, (3, 16))
    residue.model._clear_deepstack_input_embeds(8)  # an eager step's partial clear: rows 8..23 left
    assert residue.request(TEXT_PROMPT, None)[2].stale_rows == 0

