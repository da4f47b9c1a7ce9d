"""The `sglang` backend: one real SGLang server per execution mode, the tap toggled per request.

Eager and bcg servers differ only in the arms' `--cuda-graph-backend-prefill` value (servers.py).
DeepStack normal/zero is switched inside a running server through the plugin's channel, so every
scenario of a run costs two launches. Each request is tagged, and its evidence is what the hook
recorded for that tag in the process that ran the model, never what the flags imply.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Sequence

from parity.arms import MODES
from parity.backends.base import Answer, Generates, Generation, Request
from parity.buckets import prefill_bucket_ladder, smallest_fitting
from parity.errors import ArmFailure, UsageError
from parity.presets import PRESETS
from parity.engines import launcher
from parity.engines.channel import tap_mode
from parity.engines.evidence import (
    EvidenceFault, TaggedRequest, arm_evidence, check_fired, processes, request_record,
)
from parity.engines.gpus import gpu_count, gpu_memory, gpu_name, visible_gpu_count
from parity.engines.prompts import ChatPrompts, CheckpointFacts, ImageFiles
from parity.engines.sglang import client, deepstack_slot, plugin, server_checks
from parity.engines.sglang.servers import (
    DEFAULT_MEM_FRACTION, LAUNCH_MODULE, MAX_MEM_FRACTION, Placement, SglangSettings, buckets_given,
    check_gpu_count, fraction_for_share, mode_flags, plan_launch, server_env, server_flags, split_user_args,
)

PROBE_PROMPT = "Say OK."
# A launch command other than `python -m sglang.launch_server` (a wrapper, another interpreter, a
# stand-in): shlex-split and used as given, without checking SGLang or a GPU here.
LAUNCH_COMMAND_ENV = "PARITY_SGLANG_LAUNCH"
# What a bcg server that dies while starting most likely hit (sglang-0.5.23.md §8).
BCG_START_HINT = ("SGLang's warm-up sends an image request through the prefill graph, so a crash here is most "
                  "likely the multimodal BCG replay fault, not the DeepStack drop (see docs/sglang-runbook.md)")


@dataclass(frozen=True)
class Server:
    """A ready server of one mode and the channel of its tap."""

    process: launcher.ServerProcess
    channel: plugin.TapChannel
    standin_calls: Path | None = None  # CPU: where the kernel stand-in logs calls

    def standin_failure(self) -> ArmFailure | None:
        problem = server_checks.standin_problem(self.standin_calls)
        return None if problem is None else self.process.failure(problem)


# --- the session -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SglangSession(Generates):
    """A ready server in one mode; requests go one at a time, each tagged, the tap set before each."""

    server: Server
    backend: "SglangBackend"

    @property
    def process(self) -> launcher.ServerProcess:
        return self.server.process

    def answer(self, request: Request, deepstack: str) -> Answer:
        tap = tap_mode(deepstack)
        if not self.process.alive():
            raise self.process.exited_failure()
        image = self.backend.images.path(request.fixture)
        doc, generated = self.post_tagged(tap, lambda tag: client.generate_body(
            self.backend.prompts.text(request), image, self.backend.settings.max_new_tokens, rid=tag))
        answer = self._parsed(client.parse_completion, doc)
        first = TaggedRequest(len(answer.prompt_ids), image is not None, generated)
        self._check_fired(first, "request")  # before scoring: a silent tap fails the arm at once
        generation = replace(answer.generation, deepstack_record=request_record(first),
                             evidence=arm_evidence([first], self.backend.server_facts.max_bucket))
        return Answer(generation, (tap, image, answer.prompt_ids, first))

    def score(self, answer: Answer, force: Sequence[Sequence[int]] = ()) -> Generation:
        tap, image, prompt_ids, first = answer.state
        requests, forced, start = [first], [], time.perf_counter()
        prompt = self.backend.prompts.unexpanded(prompt_ids)
        # Its own tokens last: scores from a prefill are compared with scores from a prefill.
        for tokens in (*force, answer.generation.token_ids):
            doc, scored = self.post_tagged(tap, lambda tag: client.score_body(
                prompt, tokens, len(prompt_ids), image, rid=tag))
            forced.append(self._parsed(lambda d: client.parse_scores(d, tokens), doc))
            requests.append(TaggedRequest(len(prompt_ids) + len(tokens), image is not None, scored))
            self._check_fired(requests[-1], f"teacher-forced scoring request {len(requests) - 1}")
        return replace(answer.generation, evidence=arm_evidence(requests, self.backend.server_facts.max_bucket),
                       forced=tuple(forced[:-1]), self_forced=forced[-1],
                       forced_seconds=time.perf_counter() - start)

    def post_tagged(self, tap: str, body_for) -> tuple[dict, tuple[plugin.TapEntry, ...]]:
        """POST one request under its own tag; its answer and the LM entries the hook recorded for it."""
        tag = uuid.uuid4().hex
        self.server.channel.arm(tap, tag)
        try:
            doc = self._post(body_for(tag))
        finally:
            self.server.channel.disarm()
        return doc, tuple(self.server.channel.entries(tag))

    def _check_fired(self, request: TaggedRequest, what: str) -> None:
        try:
            check_fired(request, self.backend.facts.deepstack_layers, what, self.backend.server_facts.tp_size)
        except EvidenceFault as silence:
            raise self.process.failure(str(silence)) from None

    def _parsed(self, parse, doc):
        try:
            return parse(doc)
        except client.ServerRejected as err:
            raise self.process.failure(str(err)) from None

    def _post(self, body: Mapping[str, Any]) -> dict:
        try:
            doc = client.post_json(f"{self.process.base_url}/generate", body)
        except client.ServerRejected as err:
            raise self.server.standin_failure() or self.process.failure(str(err)) from None
        except client.ServerUnreachable as err:
            if _exited_within(self.process, 5.0):
                raise self.server.standin_failure() or self.process.failure(
                    f"died mid-run with code {self.process.exit_code()}") from None
            raise self.process.failure(f"connection lost: {err}") from None
        failure = self.server.standin_failure()
        if failure is not None:
            raise failure
        return doc


def _exited_within(server: launcher.ServerProcess, seconds: float) -> bool:
    # A dropped connection and the process exit race; give the exit a moment to show.
    deadline = time.monotonic() + seconds
    while server.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.exit_code() is not None


# --- the backend -------------------------------------------------------------------------------------

class SglangBackend:
    name = "sglang"

    def __init__(self, settings: SglangSettings, prompts: ChatPrompts, facts: CheckpointFacts) -> None:
        self.settings = settings
        self.prompts = prompts
        self.facts = facts
        self.server_facts = settings.facts
        self.images = ImageFiles(settings.run_dir / "images")
        self.plan = plan_launch(settings)  # refuses impossible GPU combinations before any start
        self._modes: tuple[str, ...] = MODES
        self._servers: dict[str, Server] = {}
        self._failures: dict[str, ArmFailure] = {}
        self._launches: dict[str, int] = {}
        self._commands: dict[str, list[str]] = {}
        self._tap_processes: dict[str, list[str]] = {}
        self._served_dtype: dict[str, str | None] = {}
        self._fix_records: dict[str, list[dict]] = {}
        self._version: str | None = None

    @property
    def launch_count(self) -> int:
        return sum(self._launches.values())

    @property
    def max_positions(self) -> int | None:
        return self.server_facts.context_length or self.facts.max_positions

    def bucket_of(self, num_tokens: int) -> int | None:
        return self.server_facts.bucket_of(num_tokens)

    def prompt_length(self, request: Request) -> int:
        return self.prompts.length(request)

    def prepare(self, modes: Sequence[str], prompt_lengths: Sequence[int] = ()) -> None:
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise UsageError(f"unknown mode {', '.join(unknown)}; known: {', '.join(MODES)}")
        for mode in modes:
            mode_flags(mode)  # fail on inconsistent arm files before any launch
        self._modes = tuple(modes)
        if self.settings.on_cpu and not buckets_given(self.settings.sglang_args) and prompt_lengths:
            self._cap_buckets(max(prompt_lengths))
        self.plan = plan_launch(self.settings, self._modes)
        if self.settings.concurrent and len(modes) > 1:
            for stage in self.plan.stages:  # shared GPUs: the next stage starts once this one is ready
                self._launch(tuple(m for m in stage if m in modes))

    @contextmanager
    def session(self, mode: str) -> Iterator[SglangSession]:
        if mode not in self._servers and mode not in self._failures:
            self._launch((mode,))
        if mode in self._failures:
            raise self._failures[mode]
        server = self._servers[mode]
        try:
            yield SglangSession(server, self)
        finally:
            # Free the GPU as soon as the mode is done; a later session(mode) launches anew.
            self._servers.pop(mode, None)
            server.process.stop(self.settings.stop_grace)

    def _cap_buckets(self, longest_prompt: int) -> None:
        """On a CPU, capture SGLang's ladder only up to the bucket the run's longest prefill needs
        (a prompt plus teacher-forced tokens): the emulation keeps every captured tensor alive."""
        longest = longest_prompt + self.settings.max_new_tokens
        cap = smallest_fitting(prefill_bucket_ladder(max(longest, 1) * 2), longest)
        args = (*self.settings.sglang_args, "--cuda-graph-max-bs-prefill", str(cap))
        self.settings = replace(self.settings, sglang_args=args)
        self.server_facts = self.settings.facts

    # --- launching -----------------------------------------------------------------------------

    def _launch(self, modes: Sequence[str]) -> None:
        started = []
        for mode in modes:
            try:
                started.append(self._start(mode, self.plan.placements[mode]))
            except ArmFailure as failure:
                self._failures[mode] = failure
        failures = launcher.wait_ready([s.process for s in started], self.settings.ready_timeout,
                                       self.settings.ready_poll)
        for server in started:
            mode = server.process.name
            failure = failures.get(mode)
            failure = server.standin_failure() or failure  # a stand-in call names the op, not "exited"
            if isinstance(failure, launcher.ExitedDuringStartup) and mode == "bcg":
                failure = ArmFailure(f"{failure}; {BCG_START_HINT}", log_tail=failure.log_tail)
            failure = failure or self._probe(server) or self._check_fix(server)
            if failure is not None:
                self._servers.pop(mode, None)
                server.process.stop(self.settings.stop_grace)
                self._failures[mode] = failure
            elif self._version is None:
                self._version = _server_version(server.process)

    def _start(self, mode: str, placement: Placement) -> Server:
        fraction = self._fraction(mode, placement)
        count = self._launches.get(mode, 0) + 1
        self._launches[mode] = count
        stem = f"sglang-{mode}" if count == 1 else f"sglang-{mode}-{count}"
        channel = plugin.TapChannel(self.settings.run_dir / f"{stem}.tap")
        channel.create()
        calls = self.settings.run_dir / f"{stem}.standin-calls.jsonl" if self.settings.on_cpu else None
        command = (*self.settings.launch_command, *server_flags(self.settings, mode, fraction))
        spec = launcher.ServerSpec(name=mode, command=command, log_path=self.settings.run_dir / f"{stem}.log",
                                   env=MappingProxyType(server_env(channel, placement, self.settings, calls)))
        self._commands[mode] = list(command[len(self.settings.launch_command):])
        server = Server(launcher.start_server(spec), channel, calls)
        # Registered before waiting: a Ctrl-C during start-up still finds it in close().
        self._servers[mode] = server
        return server

    def _fraction(self, mode: str, placement: Placement) -> float:
        """The placement's fraction; for a server sharing GPUs with one already running, the fraction
        of the memory free now that gives it its share of the total (SGLang 0.5.23 sizes from free)."""
        if placement.share is None:
            return placement.mem_fraction
        reader = self.settings.gpu_memory or gpu_memory
        memory = reader(placement.gpus, self.server_facts.gpus_per_server)
        fraction = fraction_for_share(placement.share, memory)
        if fraction > MAX_MEM_FRACTION:
            free = "unknown" if memory is None else f"{memory[0] / 1024:.1f} of {memory[1] / 1024:.1f} GiB"
            raise ArmFailure(f"{mode} server: not started: after the first server started, the GPU memory free "
                             f"({free}) cannot give it {placement.share:.2f} of the GPU; lower --mem-fraction, "
                             "give each server its own GPU with --gpus, or run without --concurrent")
        return fraction

    def _probe(self, server: Server) -> ArmFailure | None:
        """One tagged text-only request: the hook must record it in the process that runs the model."""
        session = SglangSession(server, self)
        try:
            doc, entries = session.post_tagged("record", lambda tag: client.generate_body(
                self.prompts.text(Request(None, PROBE_PROMPT)), None, 1, rid=tag))
        except ArmFailure as failure:
            return failure
        if not entries:
            return server.process.failure(
                "the tap never fired: the hook recorded nothing for a request in the server's model process; "
                f"install parity in the server's Python environment (pip install -e '.[sglang]') so the "
                f"{plugin.ENTRY_POINT_GROUP} entry point is found, keep '{plugin.ENTRY_POINT_NAME}' in "
                "SGLANG_PLUGINS if you set it, and look for 'Failed to apply hooks' in the log")
        self._tap_processes[server.process.name] = processes(entries)
        served = server_checks.served_dtype(entries)
        self._served_dtype[server.process.name] = served
        problem = server_checks.dtype_problem(served, self.server_facts.dtype)
        return None if problem is None else server.process.failure(problem)

    def _check_fix(self, server: Server) -> ArmFailure | None:
        problem, records = server_checks.fix_problem(server.channel.folder, self.settings.fix, server.process.name)
        self._fix_records[server.process.name] = records
        return None if problem is None else server.process.failure(problem)

    # --- reporting -----------------------------------------------------------------------------

    def environment(self) -> Mapping[str, Any]:
        gpu = None if self.settings.on_cpu else gpu_name(self.settings.gpus)
        return {"sglang": self._version or _installed_sglang(), "device": "cuda" if gpu else "cpu", "gpu": gpu}

    def config(self) -> Mapping[str, Any]:
        planned = {m: list(server_flags(self.settings, m, self.plan.placements[m].mem_fraction)) for m in self._modes}
        return {
            "dtype": self.server_facts.dtype or self.facts.dtype,
            "deepstack_layers": self.facts.deepstack_layers,
            "sglang_servers": {m: self._commands.get(m, planned[m]) for m in self._modes},
            "sglang_args": list(self.settings.sglang_args),
            "sglang_concurrent": self.settings.concurrent,
            "sglang_start_order": [list(s) for s in self.plan.stages] if self.settings.concurrent else None,
            "sglang_gpus": {m: None if p.gpus is None else list(p.gpus) for m, p in self.plan.placements.items()
                            if m in self._modes},
            "sglang_launches": self.launch_count,
            "sglang_prefill_buckets": {"max": self.server_facts.max_bucket, "count": len(self.server_facts.prefill_buckets)},
            "sglang_tap_processes": dict(self._tap_processes),
            "sglang_device": self.settings.device,
            "tp_size": self.server_facts.tp_size,
            "sglang_graph_backend": self.settings.graph_backend,
            "sglang_server_dtype": dict(self._served_dtype),
            "sglang_fix": self.settings.fix,
            "sglang_fix_slots": dict(self._fix_records),
            "top_logprobs_num": client.TOP_LOGPROBS,
        }

    def close(self) -> None:
        for mode in list(self._servers):
            self._servers.pop(mode).process.stop(self.settings.stop_grace)


def _server_version(server: launcher.ServerProcess) -> str | None:
    try:
        version = client.get_json(f"{server.base_url}/server_info").get("version")
    except (client.ServerRejected, client.ServerUnreachable):
        return None
    return str(version) if version is not None else None


def _installed_sglang() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


# --- construction ------------------------------------------------------------------------------------

def create_sglang_backend(
    *,
    model: str,
    max_new_tokens: int,
    run_dir: Path,
    sglang_args: tuple[str, ...] = (),
    concurrent: bool = False,
    gpus: tuple[int, ...] = (),
    mem_fraction: float = DEFAULT_MEM_FRACTION,
    ready_timeout: float = 1800.0,
    launch_command: Sequence[str] | None = None,
    processor: Any = None,
    model_config: Any = None,
    stop_grace: float = launcher.STOP_GRACE_S,
    ready_poll: float = launcher.POLL_S,
    gpu_memory_reader=None,
    device: str = "cuda",
    graph_backend: str | None = None,
    fix: str | None = None,
    threads: int | None = None,
    seed: int | None = None,
) -> SglangBackend:
    """The backend the CLI builds. `launch_command` (or PARITY_SGLANG_LAUNCH) replaces
    `python -m sglang.launch_server` and then skips the SGLang/GPU checks (tests start a stand-in);
    `processor` and `model_config` skip loading the checkpoint's (tests inject the tiny ones);
    `gpu_memory_reader` replaces nvidia-smi. `device` "cpu" serves on SGLang's CPU engine, whose
    prefill graph replays through parity's emulation (`graph_backend` "emulated", the default
    there); `fix` runs parity's DeepStack slot fix in the servers. An embedded preset as `model`
    (built from `seed`) is served from its checkpoint folder in parity's cache."""
    if not 0.0 < mem_fraction < 1.0:
        raise UsageError(f"the memory fraction must be between 0 and 1, got {mem_fraction}")
    if ready_timeout <= 0:
        raise UsageError(f"the ready timeout must be positive, got {ready_timeout}")
    graph_backend = server_checks.graph_backend(device, graph_backend)
    if device == "cpu" and (concurrent or gpus):
        raise UsageError("--concurrent and --gpus place servers on GPUs; with --device cpu the servers run one "
                         "after the other")
    if fix is not None and fix not in deepstack_slot.VARIANTS:
        raise UsageError(f"unknown SGLang fix {fix!r}; known: {deepstack_slot.FIX}")
    if launch_command is None and os.environ.get(LAUNCH_COMMAND_ENV, "").strip():
        launch_command = shlex.split(os.environ[LAUNCH_COMMAND_ENV])
    settings = SglangSettings(
        model=model, max_new_tokens=max_new_tokens, run_dir=Path(run_dir),
        sglang_args=split_user_args(sglang_args), concurrent=concurrent, gpus=tuple(gpus),
        mem_fraction=mem_fraction, ready_timeout=ready_timeout,
        launch_command=tuple(launch_command) if launch_command is not None else (sys.executable, *LAUNCH_MODULE),
        stop_grace=stop_grace, ready_poll=ready_poll, gpu_memory=gpu_memory_reader,
        device=device, graph_backend=graph_backend, fix=fix, threads=threads,
    )
    plan_launch(settings)  # usage errors (flags, GPU combinations) before anything is checked or loaded
    if launch_command is None:
        server_checks.check_requirements(device)
        server_checks.check_fix_version(fix)
        if device != "cpu":  # a CPU server needs no GPU
            check_gpu_count(settings.facts, settings.gpus, gpu_count(), visible_gpu_count())
    launcher.free_port()  # fail early (exit 2) when no loopback port can be bound
    if model in PRESETS:  # the servers load a folder: the preset, saved once into parity's cache
        from parity.models.preset_checkpoint import saved_preset

        settings = replace(settings, model=str(saved_preset(model, seed)))
    if processor is None or model_config is None:
        from parity.models.checkpoint import CheckpointSource, load_config_and_processor

        model_config, processor = load_config_and_processor(CheckpointSource.of(settings.model))
    prompts, facts = ChatPrompts(processor), CheckpointFacts.of(model_config)
    return SglangBackend(settings, prompts, facts)
