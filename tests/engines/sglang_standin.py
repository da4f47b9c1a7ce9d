"""A stand-in for `python -m sglang.launch_server`, for tests and the launch benchmark (no GPU).

It is NOT SGLang. It speaks the small part of SGLang's HTTP API parity uses (`GET /ready`,
`GET /server_info`, `POST /generate` with the native request/answer shapes of
docs/engines/sglang-0.5.23.md §2: text or input_ids, image_data, output and input logprobs from
`logprob_start_len`, `return_prompt_token_ids`) and mimics the server life parity must handle: a
start-up delay, an image warm-up request before /ready turns 200, a scheduler child process in
the same process group, and on request a crash, a start-up failure or a server that never gets
ready.

Its "model" runs parity's real plugin hook (`parity.engines.sglang.plugin.activate()`, what SGLang's
plugin loader does) once per LM entry, on arguments shaped like `prepare_mm_inputs`'s: the
prefill (an extend batch, padded to its bucket and with `replay_layer_forward` installed on the
LM instance when it replays) and each decode step. Like SGLang 0.5.23 it replays a prefill under
`--cuda-graph-backend-prefill breakable` when the prompt fits a captured bucket
(`--cuda-graph-max-bs-prefill N`, `--cuda-graph-bs-prefill a b c`), and its replayed "graph"
ignores DeepStack unless `--standin-deepstack-replay` (the upstream fix) is given. Each step's
distribution is a deterministic function of the tokens so far, the image and the DeepStack rows
the "LM" used, so generation and teacher-forced scoring agree and the arms give the verdicts a
real run would.

Its tokenizer is its own (one token per UTF-8 byte, each image placeholder expanded to
IMAGE_TOKENS image tokens), so its token counts are not a real model's.

Only the standard library at start-up; torch is imported on the first image forward.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # parity from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stand-in core beside it

import standin_core as core  # noqa: E402
from standin_core import Rejected, add_common_args, add_switches  # noqa: E402
from parity.runner.buckets import prefill_bucket_ladder  # noqa: E402  (stdlib-only at import time)
from parity.engines import standin_calls  # noqa: E402
from parity.engines.sglang import deepstack_slot, kernel_standin, plugin  # noqa: E402

VERSION = "0.5.23+standin"
DEEPSTACK_WIDTH = 12  # hidden 4 x 3 DeepStack levels
IMAGE_TOKENS = 16
IMAGE_PLACEHOLDER = "<|image_pad|>"
BYTE_OFFSET = 1000  # text token = byte + offset; generated tokens are below it
VOCAB = range(3, 67)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    add_common_args(parser, default_port=30000)
    parser.add_argument("--cuda-graph-backend-prefill", default="breakable")
    parser.add_argument("--cuda-graph-max-bs-prefill", type=int, default=8192)
    parser.add_argument("--cuda-graph-bs-prefill", type=int, nargs="+", default=None)
    parser.add_argument("--standin-image-token-id", type=int, default=151655)
    parser.add_argument("--standin-warmup", choices=("image", "text"), default="image")
    parser.add_argument("--standin-fail-backend", default=None,
                        help="exit on start only when --cuda-graph-backend-prefill has this value")
    parser.add_argument("--dtype", default="bfloat16", help="the DeepStack rows are in the served dtype")
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1, dest="tp_size",
                        help="ranks: each runs the hook on its own copy of the LM inputs, as its own process")
    parser.add_argument("--standin-silent-rank", type=int, default=None, help="this rank's hook never runs")
    parser.add_argument("--standin-disagreeing-rank", type=int, default=None,
                        help="this rank is handed other DeepStack rows than the others")
    add_switches(parser, {
        "--standin-never-ready": "start, but never answer /ready",
        "--standin-deepstack-replay": "the upstream fix",
        "--standin-no-deepstack-key": "the hook is called, but image prefills never carry input_deepstack_embeds",
        "--standin-no-replay": "a breakable server whose prefills all run eager",
        "--standin-replay-image-fault": "replaying an image prefill kills the process (the fault 0.5.23's comment names)",
    })
    parser.add_argument("--standin-kernel-call", default=None,
                        help="call this sgl_kernel op through parity's CPU kernel stand-in (a path that needs it)")
    parser.add_argument("--standin-kernel-call-on", choices=("startup", "request"), default="startup")
    args, _ = parser.parse_known_args(argv)  # every other SGLang flag is accepted and ignored
    return args


# --- tokens --------------------------------------------------------------------------------------------

def tokenize(text: str, image_token: int) -> list[int]:
    ids: list[int] = []
    for i, part in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            ids.append(image_token)
        ids += [b + BYTE_OFFSET for b in part.encode()]
    return ids


def expand(ids: list[int], images: int, image_token: int) -> list[int]:
    """Each placeholder becomes IMAGE_TOKENS image tokens, as SGLang's Qwen-VL processor does;
    a placeholder count that does not match the images is refused (already expanded ids too)."""
    if ids.count(image_token) != images:
        raise Rejected(f"{ids.count(image_token)} image placeholder(s) for {images} image(s)")
    out: list[int] = []
    for token in ids:
        out += [token] * (IMAGE_TOKENS if token == image_token else 1)
    return out


def image_key(image: str) -> str:
    """The image's identity: its file's bytes (where it is stored must not matter), else the string."""
    path = Path(image)
    return hashlib.sha256(path.read_bytes() if path.is_file() else image.encode()).hexdigest()


# --- the model ------------------------------------------------------------------------------------------

class ForwardMode:
    def __init__(self, extend: bool) -> None:
        self._extend = extend

    def is_extend(self) -> bool:
        return self._extend


class Model:
    """The fake forward: the hook at each LM entry, then distributions from what the LM used."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.graph = args.cuda_graph_backend_prefill != "disabled" and not args.standin_no_replay
        self.buckets = args.cuda_graph_bs_prefill or prefill_bucket_ladder(args.cuda_graph_max_bs_prefill)
        self.hook = None if args.standin_no_plugin else plugin.activate()
        # What parity's plugin does first with PARITY_SGLANG_FIX: outside SGLang 0.5.23 it records a
        # refusal (the stand-in has no prefill runner to put a slot in).
        folder = os.environ.get(plugin.ENV_VAR)
        deepstack_slot.activate(os.environ, Path(folder) if folder else None)

        class LanguageModel:
            def forward(self) -> None:
                return None

        self.language_model = LanguageModel()

    def prefill(self, ids: list[int], image: str | None) -> float:
        """Run the prompt's LM entry; the DeepStack "sum" the LM used (0: none, zeroed or dropped)."""
        bucket = min((b for b in self.buckets if b >= len(ids)), default=None) if self.graph else None
        rows = bucket or len(ids)  # BCG pads the batch to its bucket
        lm_kwargs: dict[str, Any] = {"positions": None}
        if image is not None and not self.args.standin_no_deepstack_key:
            import torch

            seed = int(image_key(image)[:8], 16)
            dtype = getattr(torch, self.args.dtype if self.args.dtype != "auto" else "bfloat16")
            deepstack = torch.zeros(rows, DEEPSTACK_WIDTH, dtype=dtype)  # [tokens, hidden * n_ds], text rows zero
            deepstack[2:6] = torch.randn(4, DEEPSTACK_WIDTH, generator=torch.Generator().manual_seed(seed))
            lm_kwargs[plugin.DEEPSTACK_KEY] = deepstack  # as prepare_mm_inputs leaves it
        if bucket is not None:
            if image is not None and self.args.standin_replay_image_fault:
                print("standin: CUDA error: an illegal memory access was encountered (image prefill replay)", flush=True)
                os._exit(1)

            # What BCG installs on the LM instance for the replay (docs/engines/sglang-0.5.23.md §3.3); restored as a bound method after.
            def replay_layer_forward(*_: Any, **__: Any) -> None:
                return None

            self.language_model.forward = replay_layer_forward
        try:
            self._call_hook(rows, lm_kwargs, extend=True, raw=len(ids))
        finally:
            if bucket is not None:
                self.language_model.forward = type(self.language_model).forward.__get__(self.language_model)
        if plugin.DEEPSTACK_KEY not in lm_kwargs or (bucket is not None and not self.args.standin_deepstack_replay):
            return 0.0  # no rows, or the captured body never traced the DeepStack add: 0.5.23's drop
        return float(lm_kwargs[plugin.DEEPSTACK_KEY][:len(ids)].abs().sum())

    def decode_step(self) -> None:
        self._call_hook(1, {"positions": None}, extend=False, raw=1)  # the key is absent in decode

    def _call_hook(self, rows: int, lm_kwargs: dict, extend: bool, raw: int) -> None:
        if self.hook is None:
            return
        batch = SimpleNamespace(forward_mode=ForwardMode(extend), extend_seq_lens_cpu=[raw] if extend else None)
        input_ids = SimpleNamespace(shape=(rows,))
        for hook, kwargs in rank_calls(self.hook, self.args, lm_kwargs):
            # Positional, like general_mm_embed_routine's call; AFTER hooks get the result first.
            hook(None, input_ids, batch, self.language_model, kwargs, None, None, None, {}, None)


@dataclass(frozen=True)
class RankChannel(plugin.TapChannel):
    """The channel as one tensor-parallel rank's model process writes it: SGLang titles each rank's
    process `sglang::scheduler_TP<rank>`, which is how parity tells their records apart."""

    rank: int = 0

    def append(self, entry: plugin.TapEntry) -> None:
        super().append(replace(entry, role=f"sglang::scheduler_TP{self.rank}"))


def rank_calls(hook: plugin.TapHook, args: argparse.Namespace, lm_kwargs: dict) -> list[tuple[Any, dict]]:
    """(hook, LM inputs) per rank that runs the hook. Rank 0's inputs are the ones the "LM" uses;
    every other rank gets its own copy, taken before any rank's tap ran, as a separate process has
    its own tensors."""
    if args.tp_size == 1:
        return [(hook, lm_kwargs)]
    calls = []
    for rank in range(args.tp_size):
        kwargs = lm_kwargs if rank == 0 else dict(lm_kwargs)
        if rank and plugin.DEEPSTACK_KEY in kwargs:
            rows = kwargs[plugin.DEEPSTACK_KEY].clone()
            kwargs[plugin.DEEPSTACK_KEY] = rows * 2 if rank == args.standin_disagreeing_rank else rows
        if rank != args.standin_silent_rank:  # a silent rank: parity's plugin never loaded in its process
            calls.append((plugin.TapHook(RankChannel(hook.channel.folder, rank)), kwargs))
    return calls


def step_logprobs(context: list[int], image: str | None, deepstack: float) -> list[float]:
    """log p(next | context) over VOCAB: a function of the tokens so far, the image and DeepStack."""
    return core.step_logprobs(f"{image_key(image) if image else '-'}|{deepstack:.6f}|{','.join(map(str, context))}",
                              VOCAB)


def answer(model: Model, body: dict) -> dict:
    image = body.get("image_data")
    image_token = model.args.standin_image_token_id
    if ("text" in body) == ("input_ids" in body):
        raise Rejected("give exactly one of text and input_ids")
    ids = tokenize(body["text"], image_token) if "text" in body else [int(t) for t in body["input_ids"]]
    prompt = expand(ids, 1 if image else 0, image_token)
    start = int(body.get("logprob_start_len", -1))
    if start >= len(prompt):
        raise Rejected(f"logprob_start_len {start} >= prompt length {len(prompt)}")
    deepstack = model.prefill(prompt, image)
    context, out_ids, out_lps, tops = list(prompt), [], [], []
    for step in range(int(body["sampling_params"]["max_new_tokens"])):
        if step:
            model.decode_step()
        lps = step_logprobs(context, image, deepstack)
        order = sorted(range(len(lps)), key=lambda i: -lps[i])
        token = VOCAB[order[0]]
        out_ids.append(token)
        out_lps.append(lps[order[0]])
        tops.append([[lps[i], VOCAB[i], None] for i in order[: body.get("top_logprobs_num") or 0]])
        context.append(token)
    meta = {"id": body.get("rid"), "finish_reason": {"type": "length"}, "prompt_tokens": len(prompt),
            "completion_tokens": len(out_ids),
            "output_token_logprobs": [[lp, tid, None] for tid, lp in zip(out_ids, out_lps)]}
    if body.get("top_logprobs_num"):
        meta["output_top_logprobs"] = tops
    if start >= 0:  # entry 0 has no logprob; entry k scores prompt[start + k] (docs/engines/sglang-0.5.23.md §2.2)
        meta["input_token_logprobs"] = [[None, prompt[start], None]] + [
            [step_logprobs(prompt[:k], image, deepstack)[VOCAB.index(prompt[k])] if prompt[k] in VOCAB else -30.0,
             prompt[k], None] for k in range(start + 1, len(prompt))]
    doc = {"text": " ".join(f"t{t}" for t in out_ids), "output_ids": out_ids, "meta_info": meta}
    if body.get("return_prompt_token_ids"):
        doc["prompt_token_ids"] = prompt
    return doc


# --- the server -----------------------------------------------------------------------------------------

def routes(state: core.State) -> core.Routes:
    state.model = Model(state.args)

    def generate(body: dict) -> dict:
        if state.args.standin_kernel_call and state.args.standin_kernel_call_on == "request":
            kernel_standin.stub(state.args.standin_kernel_call)()
        return answer(state.model, body)

    backend = state.args.cuda_graph_backend_prefill
    return core.Routes(
        ready_path="/ready", admin_paths=("/flush_cache",),
        gets={"/ready": lambda: (200 if state.ready.is_set() else 503, {"ready": state.ready.is_set()}),
              "/server_info": lambda: (200, {"version": VERSION, "cuda_graph_backend_prefill": backend})},
        post_path="/generate", post=generate,
        errors={standin_calls.StandinCalled: 500},  # SGLang answers a failed forward with an error
    )


def start_up(state: core.State, started: float) -> None:
    """Load, warm up, then report ready, like SGLang's _wait_and_warmup."""
    if state.args.standin_warmup == "image" and not state.args.standin_no_plugin:
        import torch  # noqa: F401  (part of "loading": inside the start-up delay, not after it)
    time.sleep(max(0.0, state.args.standin_startup_delay - (time.monotonic() - started)))
    if state.args.standin_never_ready:
        return
    if state.args.standin_kernel_call and state.args.standin_kernel_call_on == "startup":
        try:
            kernel_standin.stub(state.args.standin_kernel_call)()
        except standin_calls.StandinCalled as err:
            print(f"standin: scheduler died: {err}", flush=True)
            os._exit(1)
    # SGLang's VLM warm-up is an image request (docs/engines/sglang-0.5.23.md §1.4); it runs through the hook before /ready.
    image = "warmup-image" if state.args.standin_warmup == "image" else None
    placeholder = f"<|vision_start|>{IMAGE_PLACEHOLDER}<|vision_end|>" if image else ""
    answer(state.model, {"text": placeholder + "warm-up", "image_data": image, "sampling_params": {"max_new_tokens": 8}})
    print(f"standin: The server is fired up and ready to roll! at {time.time():.6f}", flush=True)
    state.ready.set()


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    fails_here = args.standin_fail_backend in (None, args.cuda_graph_backend_prefill)
    core.serve(argv, args, routes, start_up, "scheduler", fails_here)


if __name__ == "__main__":
    main(sys.argv[1:])
