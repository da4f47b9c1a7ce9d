"""A stand-in for `python -m vllm.entrypoints.cli.main serve`, for tests (no GPU, no vLLM).

It is NOT vLLM. It speaks the small part of vLLM's HTTP API parity uses (`GET /health`,
`GET /version`, `POST /v1/chat/completions` with the OpenAI chat shapes of docs/engines/vllm-0.33.md §7.1:
image as a data URL, `logprobs`/`top_logprobs`, `return_token_ids`,
`return_tokens_as_token_ids`, `prompt_logprobs` with `continue_final_message`) and mimics the
server life parity must handle: a start-up delay, a child process in the same process group,
and on request a crash or a start-up failure.

Its "engine" has the three points parity's tap wraps in vLLM 0.33, with the same meaning, and
runs parity's real wrappers on them (`parity.engines.vllm.plugin.activate()` and `parity.engines.vllm.tap`, what
the plugin installs in a real model process):

- `Manager.dispatch`: the graph decision per step from `-cc.cudagraph_mode`, the capture sizes
  (`--cudagraph-capture-sizes`, else vLLM's default ladder up to min(2 x --max-num-seqs, 512)) and
  VLLM_USE_BREAKABLE_CUDAGRAPH, as vLLM's table (docs/engines/vllm-0.33.md §1.1);
- `ModelState.prepare_inputs_embeds`: one step, which hands image steps' DeepStack to
- `Model._set_deepstack_input_embeds`: persistent per-level buffers, a row counter, and a clear
  that runs after the language model only when the step was not replayed whole (FULL, breakable).

So `--graph-mode full` leaks an image request's DeepStack rows into the next text-only request,
as vLLM 0.33 does by code reading. Each step's distribution is a deterministic function of the
tokens so far, the image and the DeepStack rows the "LM" read, so generation and teacher-forced
scoring agree and the arms give the verdicts a real run would.

`ByteProcessor` is its tokenizer and chat template (one token per UTF-8 byte, each image
placeholder expanded to IMAGE_TOKENS tokens): tests hand parity the same one, as a real run
reads the checkpoint's processor the server also uses.

Only the standard library at start-up; torch is imported for the engine's buffers.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import random
import sys
import time
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # parity from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stand-in core beside it

import standin_core as core  # noqa: E402
from standin_core import Rejected, add_common_args, add_switches  # noqa: E402

VERSION = "0.33.0+standin"
LEVELS, HIDDEN = 3, 4
IMAGE_TOKENS = 16
BYTE_OFFSET = 1000
SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2, "<|vision_start|>": 3, "<|vision_end|>": 4, "<|image_pad|>": 5}
IMAGE_TOKEN_ID = SPECIAL["<|image_pad|>"]
VOCAB = tuple(BYTE_OFFSET + ord(c) for c in "abcdefghijklmnopqrstuvwxyz .")  # what the "model" generates


# --- tokenizer and chat template ----------------------------------------------------------------------

class ByteTokenizer:
    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIAL[token]

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in SPECIAL if text.startswith(s, i)), None)
            if special:
                ids.append(SPECIAL[special])
                i += len(special)
            else:
                ids += [b + BYTE_OFFSET for b in text[i].encode()]
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        names = {v: k for k, v in SPECIAL.items()}
        out, raw = [], bytearray()
        for token in ids:
            if token >= BYTE_OFFSET:
                raw.append(token - BYTE_OFFSET)
                continue
            out.append(raw.decode(errors="replace"))
            raw = bytearray()
            out.append("" if skip_special_tokens else names.get(token, ""))
        return "".join(out) + raw.decode(errors="replace")


class ByteProcessor:
    """The chat template and processor parity and the stand-in share (Qwen's layout, byte tokens)."""

    image_token = "<|image_pad|>"

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False,
                            continue_final_message: bool = False) -> str:
        text = ""
        for i, message in enumerate(messages):
            parts = message["content"] if isinstance(message["content"], list) else [
                {"type": "text", "text": message["content"]}]
            body = "".join("<|vision_start|><|image_pad|><|vision_end|>" if p["type"] in ("image", "image_url")
                           else p["text"] for p in parts)
            last = i == len(messages) - 1
            text += f"<|im_start|>{message['role']}\n{body}" + ("" if last and continue_final_message else "<|im_end|>\n")
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, images=None):
        ids = []
        for token in self.tokenizer.encode(text[0]):
            ids += [token] * (IMAGE_TOKENS if token == IMAGE_TOKEN_ID else 1)
        if ids.count(IMAGE_TOKEN_ID) != IMAGE_TOKENS * len(images or ()):
            raise ValueError("one image placeholder per image")
        return {"input_ids": [ids]}


def model_config() -> SimpleNamespace:
    """What parity reads from a checkpoint's config: three DeepStack blocks, bf16, a long context."""
    return SimpleNamespace(vision_config=SimpleNamespace(deepstack_visual_indexes=[0, 1, 2]),
                           text_config=SimpleNamespace(dtype="bfloat16", max_position_embeddings=32768))


# --- the engine ------------------------------------------------------------------------------------------

class CUDAGraphMode(Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


def default_ladder(largest: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= largest] + list(range(8, min(largest + 1, 256), 8))
    return sizes + list(range(256, largest + 1, 16))


class Manager:
    """Dispatch as vLLM 0.33's CudaGraphManager: the mode by batch kind, the smallest captured size."""

    def __init__(self, args: argparse.Namespace, breakable: bool) -> None:
        self.mode = args.cudagraph_mode
        self.use_breakable_cg = breakable and self.mode in ("FULL_AND_PIECEWISE", "PIECEWISE")
        batched = args.max_num_batched_tokens
        sizes = args.cudagraph_capture_sizes or default_ladder(min(args.max_num_seqs * 2, 512))
        self.sizes = sorted(s for s in set(sizes) if s <= batched)
        self.prefill_eager = args.standin_full_prefill_eager

    def dispatch(self, num_reqs: int, num_tokens: int, uniform_token_count, num_active_loras: int = 0,
                 max_query_len=None):
        decode = uniform_token_count == 1
        table = {"NONE": ("NONE", "NONE"), "PIECEWISE": ("PIECEWISE", "PIECEWISE"), "FULL": ("FULL", "FULL"),
                 "FULL_AND_PIECEWISE": ("FULL", "PIECEWISE"), "FULL_DECODE_ONLY": ("FULL", "NONE")}
        mode = table[self.mode][0 if decode else 1]
        if not decode and self.prefill_eager:
            mode = "NONE"  # an attention backend that allows FULL graphs for decode only
        bucket = min((s for s in self.sizes if s >= num_tokens), default=None)
        if mode == "NONE" or bucket is None:
            return SimpleNamespace(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs)
        return SimpleNamespace(cg_mode=CUDAGraphMode[mode], num_tokens=bucket, num_reqs=num_reqs)


class Model:
    """DeepStack as vLLM 0.33's Qwen3-VL keeps it: persistent buffers, a counter, set/get/clear."""

    def __init__(self, rows: int) -> None:
        import torch

        # In the served dtype (the stand-in checkpoint's bfloat16), as vLLM allocates them.
        self.deepstack_input_embeds = [torch.zeros(rows, HIDDEN, dtype=torch.bfloat16) for _ in range(LEVELS)]
        self.deepstack_input_embeds_num_tokens = 0

    def _set_deepstack_input_embeds(self, embeds) -> None:  # [LEVELS, tokens, HIDDEN]
        tokens = embeds.shape[1]
        for level, buffer in enumerate(self.deepstack_input_embeds):
            buffer[:tokens].copy_(embeds[level])
        self.deepstack_input_embeds_num_tokens = tokens

    def _get_deepstack_input_embeds(self, num_tokens: int) -> list:
        return [buffer[:num_tokens] for buffer in self.deepstack_input_embeds]  # views of the buffers

    def _clear_deepstack_input_embeds(self, num_tokens: int) -> None:
        if self.deepstack_input_embeds_num_tokens == 0:
            return
        for buffer in self.deepstack_input_embeds:
            buffer[:num_tokens].zero_()
        self.deepstack_input_embeds_num_tokens = 0


class ModelState:
    def __init__(self, model: Model) -> None:
        self.model = model

    def prepare_inputs_embeds(self, scheduled_encoder_inputs, input_batch, req_states) -> None:
        if scheduled_encoder_inputs:  # this step carries image rows: the setter gets the whole step
            import torch

            rows = torch.zeros(LEVELS, input_batch.num_tokens, HIDDEN, dtype=torch.bfloat16)  # text rows zero
            for start, image in scheduled_encoder_inputs:
                seed = int(hashlib.sha256(image.encode()).hexdigest()[:8], 16)
                features = torch.randn(LEVELS, IMAGE_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))
                rows[:, start:start + IMAGE_TOKENS] = features.to(rows.dtype)
            self.model._set_deepstack_input_embeds(rows)


class Engine:
    """One request at a time: a prefill step, then one decode step per further token."""

    def __init__(self, args: argparse.Namespace) -> None:
        from parity.engines.vllm import deepstack_clear, plugin, tap, versions

        self.args = args
        breakable = os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") == "1"
        self.manager, self.model = Manager(args, breakable), Model(args.max_num_batched_tokens)
        self.state = ModelState(self.model)
        hooks = None if args.standin_no_plugin else plugin.activate()
        folder = os.environ.get(plugin.ENV_VAR)
        # The stand-in is the newest vLLM parity supports, as far as the fix is concerned (none is installed).
        fix = None if args.standin_no_plugin else deepstack_clear.activate(
            os.environ, Path(folder) if folder else None, version=lambda: versions.NEWEST.version)
        if fix is not None:  # the fix wraps first, as parity's plugin does: the tap sees what a step reads
            self.state.prepare_inputs_embeds = deepstack_clear.wrap_step(
                ModelState.prepare_inputs_embeds, fix).__get__(self.state)
            self.model._set_deepstack_input_embeds = deepstack_clear.wrap_setter(
                Model._set_deepstack_input_embeds, fix).__get__(self.model)
            # What it wrapped: the step and the setter of the one model it serves (Qwen3-VL's, as named).
            for target in plugin.TARGETS:
                if target.fix_wrapper and target.cls in ("DefaultModelState", "Qwen3VLForConditionalGeneration"):
                    fix.installed(f"{target.cls}.{target.method}")
        if hooks is not None:  # what parity's plugin installs in a vLLM model process
            if not args.standin_no_dispatch_hook:
                self.manager.dispatch = tap.wrap_dispatch(Manager.dispatch, hooks).__get__(self.manager)
            self.state.prepare_inputs_embeds = tap.wrap_step(
                self.state.prepare_inputs_embeds.__func__, hooks).__get__(self.state)
            self.model._set_deepstack_input_embeds = tap.wrap_setter(
                self.model._set_deepstack_input_embeds.__func__, hooks).__get__(self.model)

    def step(self, request_id: str, ids: list[int], images: list[tuple[int, str]], decode: bool) -> float:
        """One engine step over `ids` (the step's tokens); the DeepStack the LM added to its real rows."""
        desc = self.manager.dispatch(1, len(ids), 1 if decode else None)
        batch = SimpleNamespace(req_ids=[request_id], num_reqs=1, num_tokens=len(ids),
                                num_tokens_after_padding=desc.num_tokens, input_ids=ids)
        self.state.prepare_inputs_embeds(images, batch, None)
        mode = desc.cg_mode.name
        whole = mode == "FULL" or (mode == "PIECEWISE" and self.manager.use_breakable_cg)
        # The graph reads the buffers at their captured addresses; eager and compiled pieces call
        # _get in Python. Either way: the first num_tokens_after_padding rows.
        deepstack = self.model._get_deepstack_input_embeds(desc.num_tokens)
        dropped = mode != "NONE" and self.args.standin_drop_deepstack  # a graph that never traced the add
        used = 0.0 if dropped else float(sum(level[:len(ids)].abs().sum() for level in deepstack))
        if not whole or self.args.standin_fixed_clear:
            self.model._clear_deepstack_input_embeds(desc.num_tokens)  # Python after the LM: skipped on replay
        return round(used, 4)


def step_logprobs(context: list[int], image: str | None, deepstack: float) -> list[float]:
    """log p(next | context) over VOCAB: a function of the tokens so far, the image and DeepStack."""
    return core.step_logprobs(f"{image or '-'}|{deepstack:.4f}|{','.join(map(str, context))}", VOCAB)


# --- requests --------------------------------------------------------------------------------------------

PROCESSOR = ByteProcessor()


def _image(messages: list) -> str | None:
    images = [p["image_url"]["url"] for m in messages if isinstance(m["content"], list)
              for p in m["content"] if p["type"] == "image_url"]
    if len(images) > 1:
        raise Rejected("at most 1 image per prompt (--limit-mm-per-prompt)")
    if not images:
        return None
    url = images[0]
    if not url.startswith("data:image/png;base64,"):
        raise Rejected("the stand-in takes PNG data URLs only")
    return hashlib.sha256(base64.b64decode(url.split(",", 1)[1])).hexdigest()


def answer(engine: Engine, body: dict, served: int) -> dict:
    if body.get("top_logprobs") and not body.get("logprobs"):
        raise Rejected("when using `top_logprobs`, `logprobs` must be set to true")
    messages = body["messages"]
    image = _image(messages)
    text = PROCESSOR.apply_chat_template(messages, add_generation_prompt=body.get("add_generation_prompt", True),
                                         continue_final_message=body.get("continue_final_message", False))
    prompt = PROCESSOR(text=[text], images=[image] if image else None)["input_ids"][0]
    if len(prompt) + int(body.get("max_completion_tokens", 16)) > engine.args.max_model_len:
        raise Rejected(f"this model's maximum context length is {engine.args.max_model_len} tokens")
    request_id = f"chatcmpl-{body.get('request_id') or served}-{random.Random(served).getrandbits(32):08x}"
    start = prompt.index(IMAGE_TOKEN_ID) if image else None
    deepstack = engine.step(request_id, prompt, [(start, image)] if image else [], decode=False)
    context, ids, lps, tops = list(prompt), [], [], []
    for k in range(int(body.get("max_completion_tokens", 16))):
        if k:
            deepstack = round(deepstack + engine.step(request_id, [context[-1]], [], decode=True), 4)
        step = step_logprobs(context, image, deepstack)
        order = sorted(range(len(VOCAB)), key=lambda i: -step[i])
        ids.append(VOCAB[order[0]])
        lps.append(step[order[0]])
        tops.append([{"token": f"token_id:{VOCAB[i]}", "logprob": step[i]} for i in order[: body.get("top_logprobs", 0)]])
        context.append(ids[-1])
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length",
                              "message": {"role": "assistant", "content": PROCESSOR.tokenizer.decode(ids, True)}}
    if body.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": lp, "top_logprobs": top}
                                          for t, lp, top in zip(ids, lps, tops)]}
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
    doc: dict[str, Any] = {"id": request_id, "object": "chat.completion", "model": body.get("model"),
                           "choices": [choice],
                           "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}
    if body.get("return_token_ids"):
        doc["prompt_token_ids"] = prompt
    if body.get("prompt_logprobs") is not None:
        # Entry i scores prompt token i given the tokens before it, under this request's prefill.
        doc["prompt_logprobs"] = [None] + [
            {str(prompt[i]): {"logprob": _scored(prompt, i, image, deepstack), "rank": 1}} for i in range(1, len(prompt))]
    return doc


def _scored(prompt: list[int], i: int, image: str | None, deepstack: float) -> float:
    return step_logprobs(prompt[:i], image, deepstack)[VOCAB.index(prompt[i])] if prompt[i] in VOCAB else -30.0


# --- the server ------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    add_common_args(parser, default_port=8000)
    parser.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=32768)
    add_switches(parser, {
        "--standin-no-dispatch-hook": "dispatch is not wrapped",
        "--standin-full-prefill-eager": "FULL graphs for decode only (an attention backend without FULL prefills)",
        "--standin-drop-deepstack": "replayed graphs ignore DeepStack (the #43617 class of bug)",
        "--standin-fixed-clear": "the buffers are cleared after every step, replayed or not (a fixed engine)",
    })
    # vLLM's dotted compilation flags: -cc.cudagraph_mode=FULL
    dotted = [a for a in argv if a.startswith("-cc.cudagraph_mode=")]
    args, _ = parser.parse_known_args([a for a in argv if a not in dotted])  # other vLLM flags are ignored
    args.cudagraph_mode = dotted[-1].split("=", 1)[1].upper() if dotted else "FULL_AND_PIECEWISE"
    return args


def routes(state: core.State) -> core.Routes:
    return core.Routes(
        ready_path="/health",
        gets={"/health": lambda: (200 if state.ready.is_set() else 503, {}),
              "/version": lambda: (200, {"version": VERSION})},
        post_path="/v1/chat/completions", post=lambda body: answer(state.engine, body, state.served),
        error_body=lambda message, status: {"error": {"message": message, "type": "BadRequestError", "code": status}},
    )


def start_up(state: core.State, started: float) -> None:
    state.engine = Engine(state.args)
    # vLLM's start-up runs dummy steps (profiling, capture, warm-up) before /health answers 200.
    state.engine.step("warmup", [BYTE_OFFSET + 1] * 8, [], decode=False)
    time.sleep(max(0.0, state.args.standin_startup_delay - (time.monotonic() - started)))
    print(f"standin: Application startup complete. at {time.time():.6f}", flush=True)
    state.ready.set()


def main(argv: list[str]) -> None:
    core.serve(argv, parse_args(argv), routes, start_up, "engine core")


if __name__ == "__main__":
    main(sys.argv[1:])
