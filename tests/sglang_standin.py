"""A stand-in for `python -m sglang.launch_server`, for tests and the launch benchmark (no GPU).

It is NOT SGLang. It speaks the small part of SGLang's HTTP API parity uses (`GET /ready`,
`GET /server_info`, `POST /generate` with the native request/answer shapes of
sglang-0.5.23.md §2) and mimics the server life parity must handle: a start-up delay, an image
warm-up request before /ready turns 200, a scheduler child process in the same process group,
and on request a crash, a start-up failure or a server that never gets ready.

Its "model" runs parity's real plugin hook (`parity.sglang.plugin.activate()`, what SGLang's
plugin loader does) on a kwargs dict shaped like `prepare_mm_inputs`'s, with a padded bucket and
the `replay_layer_forward` instance attribute under `--cuda-graph-backend-prefill breakable`.
Like SGLang 0.5.23, its replayed "graph" ignores DeepStack, unless `--standin-deepstack-replay`
(the upstream fix) is given. Answers are a deterministic function of the prompt, the image and
the DeepStack rows the "LM" used, so the four arms give the verdicts a real run would.

Only the standard library at start-up; torch is imported on the first image forward.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # parity from this checkout

from parity.sglang import plugin  # noqa: E402  (stdlib-only at import time)

VERSION = "0.5.23+standin"
DEEPSTACK_WIDTH = 12  # hidden 4 x 3 DeepStack levels
BUCKET = 16


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--cuda-graph-backend-prefill", default="breakable")
    parser.add_argument("--standin-startup-delay", type=float, default=0.0)
    parser.add_argument("--standin-warmup", choices=("image", "text"), default="image")
    parser.add_argument("--standin-never-ready", action="store_true")
    parser.add_argument("--standin-exit-on-start", type=int, default=None)
    parser.add_argument("--standin-fail-backend", default=None,
                        help="exit on start only when --cuda-graph-backend-prefill has this value")
    parser.add_argument("--standin-crash-after", type=int, default=None, help="die on request N+1")
    parser.add_argument("--standin-deepstack-replay", action="store_true", help="the upstream fix")
    parser.add_argument("--standin-no-plugin", action="store_true", help="as if parity were not installed")
    args, _ = parser.parse_known_args(argv)  # every other SGLang flag is accepted and ignored
    return args


class Model:
    """The fake forward: hook at the LM entry, then an answer from what the LM used."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.graph = args.cuda_graph_backend_prefill != "disabled"
        self.deepstack_replay = args.standin_deepstack_replay
        self.hook = None if args.standin_no_plugin else plugin.activate()
        self.language_model = SimpleNamespace()
        if self.graph:
            # What BCG installs on the LM instance before the outer eager forward (§3.3).
            def replay_layer_forward(*_: Any, **__: Any) -> None:
                return None

            self.language_model.forward = replay_layer_forward

    def generate(self, text: str, image: str | None, max_new_tokens: int) -> tuple[list[int], list[float], list]:
        deepstack_sum = self._prefill(text, image) if image is not None else 0.0
        for _ in range(max_new_tokens):
            self._call_hook({"positions": None})  # decode steps: the key is absent
        pixels = image_key(image) if image is not None else "-"
        digest = hashlib.sha256(f"{text}|{pixels}|{deepstack_sum:.6f}".encode()).hexdigest()
        rng = random.Random(digest)
        ids = [rng.randrange(3, 500) for _ in range(max_new_tokens)]
        logprobs = [-round(rng.random(), 6) for _ in ids]
        top = [[[lp, tid, None]] + [[lp - 1.0 - k, (tid + k + 1) % 500, None] for k in range(4)]
               for tid, lp in zip(ids, logprobs)]
        return ids, logprobs, top

    def _prefill(self, text: str, image: str) -> float:
        import torch

        raw = 8 + len(text) % 5  # real tokens of this prefill
        rows = BUCKET if self.graph else raw  # BCG pads the batch to its bucket
        seed = int(image_key(image)[:8], 16)
        deepstack = torch.zeros(rows, DEEPSTACK_WIDTH)
        deepstack[2:6] = torch.randn(4, DEEPSTACK_WIDTH, generator=torch.Generator().manual_seed(seed))
        lm_kwargs = {"positions": None, plugin.DEEPSTACK_KEY: deepstack}  # as prepare_mm_inputs leaves it
        self._call_hook(lm_kwargs, forward_batch=SimpleNamespace(extend_seq_lens_cpu=[raw]))
        if self.graph and not self.deepstack_replay:
            return 0.0  # the captured body never traced the DeepStack add: SGLang 0.5.23's drop
        return float(lm_kwargs[plugin.DEEPSTACK_KEY][:raw].abs().sum())

    def _call_hook(self, lm_kwargs: dict, forward_batch: Any = None) -> None:
        if self.hook is not None:
            # Positional, like general_mm_embed_routine's call; AFTER hooks get the result first.
            self.hook(None, None, forward_batch, self.language_model, lm_kwargs, None, None, None, {}, None)


def image_key(image: str) -> str:
    """The image's identity: its file's bytes (where it is stored must not matter), else the string."""
    path = Path(image)
    return hashlib.sha256(path.read_bytes() if path.is_file() else image.encode()).hexdigest()


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = Model(args)
        self.ready = threading.Event()
        self.served = 0


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            print("standin: " + fmt % args, flush=True)

        def _send(self, status: int, doc: Any) -> None:
            payload = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            if self.path == "/ready":
                self._send(200 if state.ready.is_set() else 503, {"ready": state.ready.is_set()})
            elif self.path == "/server_info":
                backend = state.args.cuda_graph_backend_prefill
                self._send(200, {"version": VERSION, "cuda_graph_backend_prefill": backend})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:
            if self.path != "/generate":
                return self._send(404, {"error": self.path})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            crash_after = state.args.standin_crash_after
            if crash_after is not None and state.served >= crash_after:
                print("standin: simulated fatal error in the scheduler", flush=True)
                os._exit(3)  # abrupt, like a CUDA fault: the scheduler child is orphaned
            state.served += 1
            self._send(200, answer(state.model, body))

    return Handler


def answer(model: Model, body: dict) -> dict:
    params = body["sampling_params"]
    ids, logprobs, top = model.generate(body["text"], body.get("image_data"), int(params["max_new_tokens"]))
    meta = {"id": body.get("rid"), "finish_reason": {"type": "length"}, "completion_tokens": len(ids),
            "output_token_logprobs": [[lp, tid, None] for tid, lp in zip(ids, logprobs)]}
    if body.get("top_logprobs_num"):
        meta["output_top_logprobs"] = [step[: body["top_logprobs_num"]] for step in top]
    return {"text": " ".join(f"t{t}" for t in ids), "output_ids": ids, "meta_info": meta}


def start_up(state: State, started: float) -> None:
    """Load, warm up, then report ready, like SGLang's _wait_and_warmup."""
    if state.args.standin_warmup == "image" and not state.args.standin_no_plugin:
        import torch  # noqa: F401  (part of "loading": inside the start-up delay, not after it)
    time.sleep(max(0.0, state.args.standin_startup_delay - (time.monotonic() - started)))
    if state.args.standin_never_ready:
        return
    # SGLang's VLM warm-up is an image request (§1.4); it runs through the hook before /ready.
    image = "warmup-image" if state.args.standin_warmup == "image" else None
    state.model.generate("warm-up", image, 8)
    print("standin: The server is fired up and ready to roll!", flush=True)
    state.ready.set()


def main(argv: list[str]) -> None:
    started = time.monotonic()
    args = parse_args(argv)
    print(f"standin: pid {os.getpid()} args {argv}", flush=True)
    fails_here = args.standin_fail_backend in (None, args.cuda_graph_backend_prefill)
    if args.standin_exit_on_start is not None and fails_here:
        print("standin: simulated start-up failure (e.g. out of memory)", flush=True)
        sys.exit(args.standin_exit_on_start)
    # SGLang's scheduler runs in a child process of the same group; a stop must reach it too.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"standin: scheduler pid {child.pid}", flush=True)
    state = State(args)
    server = HTTPServer((args.host, args.port), make_handler(state))
    threading.Thread(target=start_up, args=(state, started), daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
