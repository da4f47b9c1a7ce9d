"""The `vllm` backend: one real `vllm serve` server per execution mode, the tap steered per request.

Eager and graph servers differ only in `-cc.cudagraph_mode` (servers.py). DeepStack normal/zero
is switched inside a running server through the plugin's channel, so every scenario of a run
costs two launches. Each request carries its own tag as its request id; its evidence is what the
tap recorded, step by step, for the engine requests with that id in the process that ran the
model: the engine's own dispatch decision (graph or eager), the DeepStack it was handed, and the
leak witness (DeepStack rows an earlier request left in vLLM's persistent buffer).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Sequence

from parity.arms import MODES
from parity.backends.base import Answer, Generates, Generation, Request
from parity.errors import ArmFailure, BackendUnavailableError, UsageError
from parity.engines import launcher
from parity.engines.channel import tap_mode
from parity.engines.channel import TapChannel, TapEntry
from parity.engines.evidence import TaggedRequest, TapSilence, arm_evidence, check_fired, processes, request_record
from parity.engines.gpus import cuda_present, gpu_name
from parity.engines.http import ServerRejected, ServerUnreachable, get_json
from parity.engines.pool import Server, ServerPool, parsed, post_tagged
from parity.engines.prompts import ChatPrompts, CheckpointFacts
from parity.engines.vllm import client, plugin
from parity.engines.vllm.servers import (
    DEFAULT_MEM_FRACTION, LAUNCH_MODULE, READY_PATH, VllmSettings, environment_of, graph_mode, mode_cudagraph,
    plan_launch, server_env, server_flags, split_vllm_args,
)

PROBE_PROMPT = "Say OK."


def _own(entry: TapEntry, tag: str) -> bool:
    # The request id parity sent becomes vLLM's chatcmpl-<tag>-<8 chars>: only its steps count.
    return any(tag in request for request in entry.requests)


# --- the session -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VllmSession(Generates):
    """A ready server in one mode; requests go one at a time, each tagged, the tap set before each."""

    server: Server
    backend: "VllmBackend"

    @property
    def process(self) -> launcher.ServerProcess:
        return self.server.process

    def answer(self, request: Request, deepstack: str) -> Answer:
        tap = tap_mode(deepstack)
        if not self.process.alive():
            raise self.process.exited_failure()
        backend = self.backend
        image, sha = backend.image_url(request), request.fixture.sha256 if request.fixture else None
        doc, generated = self.post_tagged(tap, sha, lambda tag: client.generate_body(
            request.prompt, image, backend.settings.max_new_tokens, tag))
        answer = parsed(self.process, client.parse_completion, doc)
        first = TaggedRequest(len(answer.prompt_ids), image is not None, generated)
        self._check_fired(first, "request")  # before scoring: a silent tap fails the arm at once
        generation = replace(answer.generation, deepstack_record=request_record(first),
                             evidence=arm_evidence([first], backend.max_bucket, backend.tag_images))
        return Answer(generation, (tap, request.prompt, image, sha, first))

    def score(self, answer: Answer, force: Sequence[Sequence[int]] = ()) -> Generation:
        tap, prompt, image, sha, first = answer.state
        backend = self.backend
        requests, scores, start = [first], [], time.perf_counter()
        # Its own tokens last: scores from a prefill are compared with scores from a prefill.
        for tokens in (*force, answer.generation.token_ids):
            reference = backend.prompts.decode(tokens)
            doc, scored = self.post_tagged(tap, sha, lambda tag: client.score_body(prompt, image, reference, tag))
            scores.append(parsed(self.process, lambda d: client.parse_scores(d, tokens), doc))
            requests.append(TaggedRequest(len(doc.get("prompt_token_ids") or ()), image is not None, scored))
            self._check_fired(requests[-1], f"teacher-forced scoring request {len(requests) - 1}")
        return replace(answer.generation, evidence=arm_evidence(requests, backend.max_bucket, backend.tag_images),
                       forced=tuple(scores[:-1]), self_forced=scores[-1], forced_seconds=time.perf_counter() - start)

    def post_tagged(self, tap: str, image_sha: str | None, body_for) -> tuple[dict, tuple[TapEntry, ...]]:
        """One request under its own tag (also its request id); its answer and its engine steps."""
        tag, doc, entries = post_tagged(self.server, tap, client.CHAT_PATH, body_for, _own)
        self.backend.tag_images[tag] = image_sha  # a leak witness names the request by its image
        return doc, tuple(entries)

    def _check_fired(self, request: TaggedRequest, what: str) -> None:
        try:
            check_fired(request, self.backend.facts.deepstack_layers, what)
        except TapSilence as silence:
            raise self.process.failure(str(silence)) from None


# --- the backend -------------------------------------------------------------------------------------

class VllmBackend:
    name = "vllm"

    def __init__(self, settings: VllmSettings, prompts: ChatPrompts, facts: CheckpointFacts) -> None:
        self.settings = settings
        self.prompts = prompts
        self.facts = facts
        self.server_facts = settings.facts
        self.capture = settings.capture
        self.plan = plan_launch(settings)  # refuses impossible GPU combinations before any start
        self.tag_images: dict[str, str | None] = {}  # every tag sent -> the sha256 of its image
        self._modes: tuple[str, ...] = MODES
        self._sizes: tuple[int, ...] = self.capture.sizes_for(())
        self.pool = ServerPool(self._start, self._probe, settings.ready_timeout, settings.ready_poll,
                               settings.stop_grace)
        self._commands: dict[str, list[str]] = {}
        self._envs: dict[str, dict[str, str]] = {}
        self._tap_processes: dict[str, list[str]] = {}
        self._images: dict[str, str] = {}
        self._version: str | None = None

    @property
    def launch_count(self) -> int:
        return self.pool.launch_count

    @property
    def max_positions(self) -> int | None:
        return self.server_facts.max_model_len or self.facts.max_positions

    @property
    def max_bucket(self) -> int | None:
        return max(self._sizes, default=None)

    def bucket_of(self, num_tokens: int) -> int | None:
        return self.capture.bucket_of(num_tokens)

    def prompt_length(self, request: Request) -> int:
        return self.prompts.length(request)

    def image_url(self, request: Request) -> str | None:
        fixture = request.fixture
        if fixture is None:
            return None
        if fixture.sha256 not in self._images:
            png = io.BytesIO()
            fixture.image.save(png, format="PNG")  # lossless: the server decodes the very pixels
            self._images[fixture.sha256] = client.image_url(png.getvalue())
        return self._images[fixture.sha256]

    def prepare(self, modes: Sequence[str], prompt_lengths: Sequence[int] = ()) -> None:
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise UsageError(f"unknown mode {', '.join(unknown)}; known: {', '.join(MODES)}")
        self._modes = tuple(modes)
        # Scoring sends the prompt with up to max_new_tokens answer tokens: those prefills replay too.
        self._sizes = self.capture.sizes_for([n + self.settings.max_new_tokens for n in prompt_lengths])
        self.plan = plan_launch(self.settings, self._modes)
        if self.settings.concurrent and len(modes) > 1:
            for stage in self.plan.stages:  # shared GPUs: the next stage starts once this one is ready
                self.pool.launch(tuple(m for m in stage if m in modes))

    @contextmanager
    def session(self, mode: str) -> Iterator[VllmSession]:
        with self.pool.serving(mode) as server:
            yield VllmSession(server, self)

    # --- launching -----------------------------------------------------------------------------

    def _start(self, mode: str, count: int) -> Server:
        placement = self.plan.placements[mode]
        stem = f"vllm-{mode}" if count == 1 else f"vllm-{mode}-{count}"
        channel = TapChannel(self.settings.run_dir / f"{stem}.tap")
        channel.create()
        flags = server_flags(self.settings, mode, placement.mem_fraction, self._sizes)
        env = server_env(self.settings, channel, placement)
        spec = launcher.ServerSpec(name=mode, command=(*self.settings.launch_command, *flags),
                                   log_path=self.settings.run_dir / f"{stem}.log", env=MappingProxyType(env),
                                   ready_path=READY_PATH)
        self._commands[mode], self._envs[mode] = list(flags), environment_of(env)
        return Server(launcher.start_server(spec), channel)

    def _probe(self, server: Server) -> ArmFailure | None:
        """One tagged text-only request: the tap must record its steps, with the engine's dispatch
        decision, in the process that runs the model."""
        session = VllmSession(server, self)
        try:
            _, entries = session.post_tagged("record", None, lambda tag: client.generate_body(
                PROBE_PROMPT, None, 1, tag))
        except ArmFailure as failure:
            return failure
        if not entries:
            return server.process.failure(
                "the tap never fired: no step of a request was recorded in the server's model process; install "
                "parity in the server's Python environment (pip install -e '.[vllm]') so the "
                f"{plugin.ENTRY_POINT_GROUP} entry point is found, keep '{plugin.ENTRY_POINT_NAME}' in VLLM_PLUGINS "
                "if you set it, do not set VLLM_USE_V2_MODEL_RUNNER=0 (the tap wraps Model Runner V2), and look "
                "for 'parity:' lines in the log")
        if any(e.mode is None for e in entries):
            return server.process.failure(
                "the tap saw the request's steps but not vLLM's dispatch decision for them "
                "(CudaGraphManager.dispatch was not wrapped): graph replay cannot be shown; look for 'parity:' "
                "lines in the log")
        self._tap_processes[server.process.name] = processes(entries)
        if self._version is None:
            self._version = _server_version(server.process)
        return None

    # --- reporting -----------------------------------------------------------------------------

    def environment(self) -> Mapping[str, Any]:
        gpu = gpu_name(self.settings.gpus)
        return {"vllm": self._version or _installed_vllm(), "device": "cuda" if gpu else "cpu", "gpu": gpu}

    def config(self) -> Mapping[str, Any]:
        graph = self.settings.graph
        planned = {m: list(server_flags(self.settings, m, self.plan.placements[m].mem_fraction, self._sizes))
                   for m in self._modes}
        return {
            "dtype": self.server_facts.dtype or self.facts.dtype,
            "deepstack_layers": self.facts.deepstack_layers,
            "engine": "vllm",
            "engine_version": self._version or _installed_vllm(),
            "graph_mode": graph.name,
            "graph_cudagraph_modes": {m: mode_cudagraph(self.settings, m) for m in self._modes},
            "graph_breakable": graph.breakable,
            "vllm_servers": {m: self._commands.get(m, planned[m]) for m in self._modes},
            "vllm_server_env": {m: self._envs.get(m, {}) for m in self._modes},
            "vllm_args": list(self.settings.vllm_args),
            "vllm_capture_sizes": {"max": self.max_bucket, "count": len(self._sizes)},
            "vllm_concurrent": self.settings.concurrent,
            "vllm_start_order": [list(s) for s in self.plan.stages] if self.settings.concurrent else None,
            "vllm_gpus": {m: None if p.gpus is None else list(p.gpus) for m, p in self.plan.placements.items()
                          if m in self._modes},
            "vllm_launches": self.launch_count,
            "vllm_tap_processes": dict(self._tap_processes),
            "top_logprobs_num": client.TOP_LOGPROBS,
        }

    def close(self) -> None:
        self.pool.close()


def _server_version(server: launcher.ServerProcess) -> str | None:
    try:
        version = get_json(f"{server.base_url}/version").get("version")
    except (ServerRejected, ServerUnreachable):
        return None
    return str(version) if version is not None else None


def _installed_vllm() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


# --- construction ------------------------------------------------------------------------------------

def check_requirements() -> None:
    """Raise BackendUnavailableError (exit 2) when this machine cannot run vLLM servers."""
    if importlib.util.find_spec("vllm") is None:
        raise BackendUnavailableError("vLLM is not installed in this Python environment; install it with "
                                      "pip install 'parity[vllm]' (vLLM 0.33.0)")
    if not cuda_present():
        raise BackendUnavailableError("the vllm backend needs a CUDA GPU and none is visible "
                                      "(torch.cuda.is_available() is False and nvidia-smi lists no GPU)")
    names = {ep.name for ep in importlib.metadata.entry_points(group=plugin.ENTRY_POINT_GROUP)}
    if plugin.ENTRY_POINT_NAME not in names:
        raise BackendUnavailableError(
            f"parity's vLLM plugin is not registered (no {plugin.ENTRY_POINT_NAME!r} entry point in "
            f"{plugin.ENTRY_POINT_GROUP}); install parity itself, e.g. pip install -e '.[vllm]', "
            "not only put it on PYTHONPATH")


def create_vllm_backend(
    *,
    model: str,
    max_new_tokens: int,
    run_dir: Path,
    vllm_args: tuple[str, ...] = (),
    graph_mode_name: str = "full_and_piecewise",
    buckets: str | tuple[int, ...] = "auto",
    concurrent: bool = False,
    gpus: tuple[int, ...] = (),
    mem_fraction: float = DEFAULT_MEM_FRACTION,
    ready_timeout: float = 1800.0,
    launch_command: Sequence[str] | None = None,
    processor: Any = None,
    model_config: Any = None,
    stop_grace: float = launcher.STOP_GRACE_S,
    ready_poll: float = launcher.POLL_S,
) -> VllmBackend:
    """The backend the CLI builds. `launch_command` replaces `python -m vllm.entrypoints.cli.main
    serve` (tests start a stand-in) and then skips the vLLM/GPU checks; `processor` and
    `model_config` skip loading the checkpoint's (tests inject the tiny ones)."""
    if not 0.0 < mem_fraction < 1.0:
        raise UsageError(f"the memory fraction must be between 0 and 1, got {mem_fraction}")
    if ready_timeout <= 0:
        raise UsageError(f"the ready timeout must be positive, got {ready_timeout}")
    graph_mode(graph_mode_name)
    explicit = None if buckets == "auto" else tuple(buckets)
    if explicit is not None and (not explicit or min(explicit) <= 0):
        raise UsageError("--buckets needs positive token counts (the vllm backend's capture sizes)")
    settings = VllmSettings(
        model=model, max_new_tokens=max_new_tokens, run_dir=Path(run_dir), vllm_args=split_vllm_args(vllm_args),
        graph_mode=graph_mode_name, buckets=explicit, concurrent=concurrent, gpus=tuple(gpus),
        mem_fraction=mem_fraction, ready_timeout=ready_timeout,
        launch_command=tuple(launch_command) if launch_command is not None else (sys.executable, *LAUNCH_MODULE),
        stop_grace=stop_grace, ready_poll=ready_poll,
    )
    plan_launch(settings)  # usage errors (flags, GPU combinations) before anything is checked or loaded
    if launch_command is None:
        check_requirements()
    launcher.free_port()  # fail early (exit 2) when no loopback port can be bound
    if processor is None or model_config is None:
        from parity.models.checkpoint import CheckpointSource, load_config_and_processor

        model_config, processor = load_config_and_processor(CheckpointSource.of(model))
    return VllmBackend(settings, ChatPrompts(processor), CheckpointFacts.of(model_config))
