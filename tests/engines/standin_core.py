"""What both engines' stand-in servers share (they are run as scripts, not imported by tests):
a deterministic "model" of the next token, the HTTP server with its readiness and crash switches,
and the process shape of a real server (a child in the same process group that a stop must reach).

An engine's stand-in supplies its routes (what its GET paths answer, its one POST path and how a
request is answered) and its start-up (load, warm up, then ready).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Callable, Mapping, Sequence


class Rejected(Exception):
    """A request the engine answers with 400 and this message."""


def step_logprobs(seed: str, vocab: Sequence[int]) -> list[float]:
    """log p(next) over `vocab`, a deterministic function of `seed` (the tokens so far, the image and
    the DeepStack scale, as the engine's stand-in spells them)."""
    rng = random.Random(hashlib.sha256(seed.encode()).hexdigest())
    logits = [3.0 * rng.random() for _ in vocab]
    norm = math.log(sum(math.exp(x) for x in logits))
    return [x - norm for x in logits]


def add_common_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument("--standin-startup-delay", type=float, default=0.0)
    parser.add_argument("--standin-exit-on-start", type=int, default=None)
    parser.add_argument("--standin-crash-after", type=int, default=None, help="die on request N+1")
    parser.add_argument("--standin-no-plugin", action="store_true", help="parity's tap is not installed")


def add_switches(parser: argparse.ArgumentParser, switches: Mapping[str, str]) -> None:
    """On/off behaviours of a stand-in (a bug it plants, a part it leaves out), flag -> what it does."""
    for flag, meaning in switches.items():
        parser.add_argument(flag, action="store_true", help=meaning)


@dataclass
class Routes:
    """What one engine's server answers."""

    ready_path: str  # polled by parity: not logged
    gets: Mapping[str, Callable[[], tuple[int, Any]]]  # path -> (status, document)
    post_path: str
    post: Callable[[dict], dict]  # raises Rejected (400) or a (status, message) exception mapped by `errors`
    errors: Mapping[type, int] = field(default_factory=dict)  # exception type -> status, besides Rejected
    error_body: Callable[[str, int], Any] = lambda message, status: {"error": {"message": message}}
    admin_paths: tuple[str, ...] = ()  # POST with no body, answered with plain text and logged (a cache flush)


@dataclass
class State:
    args: argparse.Namespace
    ready: threading.Event = field(default_factory=threading.Event)
    served: int = 0
    engine: Any = None


def make_handler(state: State, routes: Callable[[], Routes], child_label: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            if self.path != routes().ready_path:  # parity polls it every few ms; it would flood the log tail
                print("standin: " + fmt % args, flush=True)

        def _send(self, status: int, doc: Any) -> None:
            payload = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            answer = routes().gets.get(self.path)
            self._send(*(answer() if answer else (404, {"error": self.path})))

        def do_POST(self) -> None:
            known = routes()
            if self.path in known.admin_paths:
                print(f"standin: admin {self.path}", flush=True)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
                return None
            if self.path != known.post_path:
                return self._send(404, {"error": self.path})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            crash_after = state.args.standin_crash_after
            if crash_after is not None and state.served >= crash_after:
                print(f"standin: simulated fatal error in the {child_label}", flush=True)
                os._exit(3)  # abrupt, like a CUDA fault: the child is orphaned
            state.served += 1
            try:
                self._send(200, known.post(body))
            except Rejected as err:
                self._send(400, known.error_body(str(err), 400))
            except tuple(known.errors) as err:  # e.g. a failed forward the engine answers with 500
                status = next(s for t, s in known.errors.items() if isinstance(err, t))
                self._send(status, known.error_body(str(err), status))

    return Handler


def serve(argv: list[str], args: argparse.Namespace, routes: Callable[[State], Routes],
          start_up: Callable[[State, float], None], child_label: str, fails_here: bool = True) -> None:
    """Run the stand-in: a start-up failure if asked, a child process, the HTTP server, and the
    start-up in the background (the server answers not-ready until it is done)."""
    started = time.monotonic()
    print(f"standin: pid {os.getpid()} started at {time.time():.6f} args {argv}", flush=True)
    if args.standin_exit_on_start is not None and fails_here:
        print("standin: simulated start-up failure (e.g. out of memory)", flush=True)
        sys.exit(args.standin_exit_on_start)
    # The engine's model runs in a child process of the same group; a stop must reach it too.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"standin: {child_label} pid {child.pid}", flush=True)
    state = State(args)
    table = routes(state)
    server = HTTPServer((args.host, args.port), make_handler(state, lambda: table, child_label))
    threading.Thread(target=start_up, args=(state, started), daemon=True).start()
    server.serve_forever()
