"""One engine backend, written once for every server engine (design §6).

The backend runs real servers on the shared pool, one per execution mode and serving profile
(design §10), probes each once ready, and hands out sessions (`session.EngineSession`): a session
sends each request under its own tag with the tap set, reads back what the tap recorded for that
tag, and scores answers teacher-forced in the same server.
What differs between engines is declared by `EngineBackend`'s abstract methods: the server
command and environment of a mode, the request bodies and their parsing, which tap records belong
to a request, the start-up checks beyond the tap, the exit explanation, and the config keys.
"""

from __future__ import annotations

import abc
import functools
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from parity.arms import MODES
from parity.backends.protocol import Generation, Request
from parity.engines import launcher
from parity.engines.channel import TapChannel, TapEntry
from parity.engines.flags import flag_values
from parity.engines.evidence import EvidenceFault, Replays, TaggedRequest, arm_evidence, check_fired, processes
from parity.engines.http import ServerRejected, ServerUnreachable, get_json, post_admin
from parity.engines.placement import LaunchPlan, Placement
from parity.engines.pool import Server, ServerPool, post_tagged
from parity.engines.prompts import ChatPrompts, CheckpointFacts
from parity.engines.session import EngineSession
from parity.engines.settings import EnginePackage
from parity.engines.standin_calls import StandinLog
from parity.design import SERVER_PROFILES
from parity.errors import ArmFailure, UsageError
from parity.evidence import ChunkRun, ServingEvidence, image_span
from parity.media.fixtures import Fixture
from parity.model_identity import CONFIG_KEY, ModelIdentity, of_checkpoint
from parity.presets import PRESETS

PROBE_PROMPT = "Say OK."


@dataclass(frozen=True)
class Completion:
    """A generation as an engine answered it, and the prompt ids the server prefilled."""

    generation: Generation
    prompt_ids: tuple[int, ...]


class EngineBackend(abc.ABC):
    """The `Backend` protocol for a server engine; a subclass declares what only its engine knows."""

    name: str
    request_path: str  # where generation and scoring requests are POSTed
    version_path: str  # GET: a JSON document with the server's "version"
    tap_hint: str  # how to make a tap that never fired fire (install hints, the engine's plugin switch)
    package: EnginePackage  # the engine's Python package and parity's plugin entry point for it
    cache_flush_path: str  # POST: empties a server's prefix cache

    def __init__(self, settings: Any, prompts: ChatPrompts, facts: CheckpointFacts,
                 identity: Callable[[], ModelIdentity]) -> None:
        self.settings = settings
        self.prompts = prompts
        self.facts = facts
        self._identify = identity  # called once, after the servers have loaded (and fetched) the weights
        self._identity: ModelIdentity | None = None
        self.plan = self.plan_launch(MODES)  # refuses impossible GPU combinations before any start
        self.tag_images: dict[str, str | None] = {}  # every tag sent -> the sha256 of its image
        self.witnessed: dict[str, Replays] = {}  # every tag sent -> the freshness witness's records of its replays
        self.pool = ServerPool(self._start, self._probe, settings.ready_timeout, settings.ready_poll,
                               settings.stop_grace, self.explain_exit)
        self._modes: tuple[str, ...] = MODES
        self._roles: dict[str, tuple[str, str | None]] = {}  # server key -> (mode, server profile)
        self._first_profile: str | None = None  # the profile the run's sessions serve first
        self._captured: dict[str, frozenset[int] | None] = {}  # server key -> buckets captured at start-up
        self._commands: dict[str, list[str]] = {}
        self._tap_processes: dict[str, list[str]] = {}
        self._version: str | None = None

    # --- what an engine declares -----------------------------------------------------------------

    @abc.abstractmethod
    def plan_launch(self, modes: Sequence[str]) -> LaunchPlan:
        """Each mode's GPUs, memory fraction and the start order (`placement.plan_placement`)."""

    @abc.abstractmethod
    def plan_run(self, modes: Sequence[str], prompt_lengths: Sequence[int]) -> None:
        """What the run's modes and prompt lengths decide before any launch (capture sizes)."""

    @abc.abstractmethod
    def server_spec(self, mode: str, placement: Placement, stem: str, channel: TapChannel,
                    profile: str | None = None) -> tuple[launcher.ServerSpec, StandinLog | None]:
        """The mode's server with the profile's serving features (`design.Serving.server_profile`),
        and the log its stand-in ops write calls to (None: no stand-ins)."""

    @abc.abstractmethod
    def cached_tokens(self, doc: dict) -> int | None:
        """The prompt tokens a generation answer says came from the prefix cache (None: not said)."""

    @abc.abstractmethod
    def media_input(self, fixture: Fixture | None) -> Any:
        """The image or video as the engine's request body carries it (a file path, a data URL)."""

    @abc.abstractmethod
    def generate_body(self, request: Request, media: Any, max_new_tokens: int, tag: str) -> dict:
        ...

    @abc.abstractmethod
    def parse_completion(self, doc: dict) -> Completion:
        ...

    @abc.abstractmethod
    def score_body(self, request: Request, media: Any, prompt_ids: tuple[int, ...], tokens: Sequence[int],
                   tag: str) -> dict:
        """A request whose answer holds the logprob of each of `tokens` after the prompt."""

    @abc.abstractmethod
    def parse_scores(self, doc: dict, prompt_ids: tuple[int, ...], tokens: Sequence[int]) -> tuple[float, ...] | None:
        """The logprobs of `tokens` after the generation's expanded prompt `prompt_ids`; None where
        the server re-tokenized the answer's text into other tokens (no score of these tokens)."""

    @abc.abstractmethod
    def scored_length(self, doc: dict, prompt_ids: tuple[int, ...], tokens: Sequence[int]) -> int:
        """The prompt tokens a scoring request prefilled."""

    @abc.abstractmethod
    def engine_config(self) -> Mapping[str, Any]:
        """The engine's own keys for the results' `config`."""

    def belongs(self, entry: TapEntry, tag: str) -> bool:
        """Whether a tap record filed under `tag` is a step of that request."""
        return True

    def check_started(self, server: Server, entries: Sequence[TapEntry]) -> ArmFailure | None:
        """Checks of a ready server beyond the tap firing, given the probe's tap records."""
        return None

    def started_problem(self, server: Server) -> str | None:
        """What a ready server's own processes recorded that makes its answers unjudgeable (else None)."""
        return None

    def explain_exit(self, mode: str, failure: ArmFailure) -> ArmFailure:
        """A server that exited while starting: what it most likely hit."""
        return failure

    @property
    def server_facts(self) -> Any:
        """What the user's engine flags decide for parity (buckets, GPUs, context, dtype)."""
        return self.settings.facts

    def installed_version(self) -> str | None:
        return self.package.installed_version()

    @property
    def ranks(self) -> int:
        """Model processes that run every request, each with its own tap (tensor parallelism)."""
        return 1

    @property
    def max_bucket(self) -> int | None:
        return None

    @property
    def max_positions(self) -> int | None:
        return self.facts.max_positions

    def bucket_of(self, num_tokens: int) -> int | None:
        return None

    # --- written once ------------------------------------------------------------------------------

    @property
    def launch_count(self) -> int:
        return self.pool.launch_count

    def prompt_length(self, request: Request) -> int:
        return self.prompts.length(request)

    def evidence(self, requests: Sequence[TaggedRequest], unscored: Sequence[TaggedRequest] = ()):
        return arm_evidence(requests, self.max_bucket, self.tag_images, unscored, self.witnessed)

    def post_tagged(self, server: Server, tap: str, request: Request, body_for) -> tuple[dict, tuple[TapEntry, ...]]:
        """One request under its own tag; its answer and the tap records that belong to it. A
        stand-in op called while serving it fails the arm naming the op, whatever the answer. On a
        prefix-cache server, an ablated request runs on an empty cache and leaves it empty: rows it
        computed without DeepStack must never be reused by another request, nor it reuse theirs; a
        sequence's first request starts on an empty cache too (`design.Serving.empty_cache`)."""
        isolated = tap != "record" and request.serving.prefix_cache
        if isolated or request.serving.empty_cache:
            self._flush_cache(server)
        try:
            tag, doc, entries = post_tagged(server, tap, self.request_path, body_for, self.belongs)
        except ArmFailure as failure:
            raise server.standin_failure() or failure from None
        failure = server.standin_failure()
        if failure is not None:
            raise failure
        if isolated:
            self._flush_cache(server)
        self.tag_images[tag] = request.fixture.sha256 if request.fixture is not None else None
        self.witnessed[tag] = server.channel.freshness(tag)
        return doc, tuple(entries)

    def _flush_cache(self, server: Server) -> None:
        try:
            post_admin(f"{server.process.base_url}{self.cache_flush_path}")
        except (ServerRejected, ServerUnreachable) as err:
            raise server.process.failure(f"the prefix cache could not be emptied around an ablated request: {err}")

    def refuses_to_score(self, failure: ArmFailure) -> bool:
        """Whether a rejected scoring request means the engine cannot take the answer's tokens back as
        input: no score of these tokens (as where it re-tokenizes them otherwise), not a failed arm."""
        return False

    def computes_visual_rows(self, request: Request, doc: dict, prompt_ids: Sequence[int]) -> bool:
        """Whether a request's prefill computes any of its image or video rows, given its answer and
        the prompt as the server expanded it: a prefix-cache hit can cover them all (a video's last
        rows are followed by fewer question tokens than a cache block), and then its prefill holds
        no DeepStack row."""
        if request.fixture is None:
            return False
        span = image_span(prompt_ids, self.prompts.visual_token_ids)
        return span is None or (self.cached_tokens(doc) or 0) < span[1]

    def check_tap(self, server: Server, request: TaggedRequest, what: str) -> None:
        try:
            check_fired(request, self.facts.deepstack_layers, what, self.ranks)
        except EvidenceFault as silence:
            raise server.process.failure(str(silence)) from None

    def serving_evidence(self, server: Server, doc: dict, first: TaggedRequest,
                         prompt_ids: Sequence[int] = ()) -> ServingEvidence:
        """What the server's own records show of a family request's serving path (design §10): its
        prefills in order (the chunks, after the rows the answer says came from the prefix cache),
        each one's bucket when replayed and its visual rows (DeepStack rows the tap saw), and whether
        every graph it replayed was captured at start-up, and where the prompt's image or video tokens are
        (`prompt_ids`, as the server expanded them). A server's DeepStack buffers are sized once
        (`BackendInfo.unreachable`), and no encoder graph is recorded, so neither is claimed."""
        cached = self.cached_tokens(doc) or 0
        prefills = first.prefills(first.ranks[0]) if first.ranks else ()
        chunks: list[ChunkRun] = []
        if all(e.raw_tokens for e in prefills):
            start = cached
            for e in prefills:
                rows = int(e.raw_tokens)
                chunks.append(ChunkRun(start, start + rows, e.tokens if e.replay else None,
                                       e.record.nonzero_rows if e.record is not None else 0))
                start += rows
        replayed = {e.tokens for e in prefills if e.replay}
        captured = self._captured.get(server.process.name)
        ready = None if not replayed else (captured is not None and replayed <= captured)
        return ServingEvidence(chunks=tuple(chunks), cached_tokens=cached, graph_ready=ready,
                               image_span=image_span(prompt_ids, self.prompts.visual_token_ids),
                               prompt_tokens=first.prompt_tokens)

    def prepare(self, modes: Sequence[str], prompt_lengths: Sequence[int] = (), serving: Sequence = ()) -> None:
        # A server has its serving features set by its flags: each profile gets its own servers
        # when its first request comes (`server_for`); only the default ones start in stages here.
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise UsageError(f"unknown mode {', '.join(unknown)}; known: {', '.join(MODES)}")
        self._modes = tuple(modes)
        # The profile `planning.serving_order` serves first.
        self._first_profile = min((s.server_profile for s in serving), key=SERVER_PROFILES.index, default=None)
        self.plan_run(self._modes, prompt_lengths)
        self.plan = self.plan_launch(self._modes)
        if self.settings.concurrent and len(modes) > 1:
            for stage in self.plan.stages:  # shared GPUs: the next stage starts once this one is ready
                self.pool.launch(tuple(self.server_key(m, self._first_profile) for m in stage if m in modes))

    @contextmanager
    def session(self, mode: str) -> Iterator[EngineSession]:
        """The mode's session, its first server ready (ArmFailure when it cannot come up)."""
        try:
            self.server_for(mode, self._first_profile)
            yield EngineSession(mode, self)
        finally:  # free the GPUs as soon as the mode is done; a later session launches anew
            self.pool.stop([k for k in self.pool.running if self.mode_of(k) == mode])

    def server_key(self, mode: str, profile: str | None) -> str:
        """A server's name: its mode, with the serving profile its flags give ("bcg-chunked")."""
        key = mode if profile is None else f"{mode}-{profile}"
        self._roles[key] = (mode, profile)
        return key

    def mode_of(self, key: str) -> str:
        return self._roles.get(key, (key, None))[0]

    def server_for(self, mode: str, profile: str | None) -> Server:
        """The mode's server for a serving profile (`design.Serving.server_profile`). A server's flags
        hold for its life, so each profile has its own, and only one of a mode's runs at a time (the
        experiment serves a profile's cases together, `planning.serving_order`)."""
        key = self.server_key(mode, profile)
        self.pool.stop([k for k in self.pool.running if self.mode_of(k) == mode and k != key])
        return self.pool.acquire(key)

    def _start(self, key: str, count: int) -> Server:
        mode, profile = self._roles.get(key, (key, None))
        stem = f"{self.name}-{key}" if count == 1 else f"{self.name}-{key}-{count}"
        channel = TapChannel(self.settings.run_dir / f"{stem}.tap")
        channel.create()
        spec, standins = self.server_spec(mode, self.plan.placements[mode], stem, channel, profile)
        spec = replace(spec, name=key)
        self._commands[key] = list(spec.command[len(self.settings.launch_command):])
        return Server(launcher.start_server(spec), channel, standins)

    def _probe(self, server: Server) -> ArmFailure | None:
        """One tagged text-only request: the tap must record it in the process that runs the model."""
        problem = self.started_problem(server)
        if problem is not None:
            return server.process.failure(problem)
        probe = Request(None, PROBE_PROMPT)
        try:
            _, entries = self.post_tagged(server, "record", probe,
                                          lambda tag: self.generate_body(probe, self.media_input(None), 1, tag))
        except ArmFailure as failure:
            return failure
        if not entries:
            return server.process.failure(f"the tap never fired: the hook recorded nothing for a request in the "
                                          f"server's model process; {self.tap_hint}")
        self._tap_processes[server.process.name] = processes(entries)
        self._captured[server.process.name] = server.channel.captured_buckets()
        failure = self.check_started(server, entries)
        if failure is None and self._version is None:
            self._version = self._server_version(server.process)
        return failure

    def _server_version(self, process: launcher.ServerProcess) -> str | None:
        try:
            version = get_json(f"{process.base_url}{self.version_path}").get("version")
        except (ServerRejected, ServerUnreachable):
            return None
        return str(version) if version is not None else None

    def environment(self) -> Mapping[str, Any]:
        gpu = self.gpu_name()
        return {self.name: self._version or self.installed_version(), "device": "cuda" if gpu else "cpu", "gpu": gpu}

    def gpu_name(self) -> str | None:
        from parity.engines.gpus import gpu_name

        return gpu_name(self.settings.gpus)

    def config(self) -> Mapping[str, Any]:
        name, settings = self.name, self.settings
        planned = {m: self.planned_flags(m) for m in self._modes}
        if self._identity is None:
            self._identity = self._identify()
        return {
            "dtype": settings.facts.dtype or self.facts.dtype,
            "deepstack_layers": self.facts.deepstack_layers,
            CONFIG_KEY: self._identity.to_json(),
            **self.engine_config(),
            f"{name}_servers": {**{m: self._commands.get(m, planned[m]) for m in self._modes}, **self._commands},
            f"{name}_concurrent": settings.concurrent,
            "chunk_size": settings.chunk_size,  # the chunked profile's servers' prefill chunk (design §10)
            f"{name}_start_order": [list(s) for s in self.plan.stages] if settings.concurrent else None,
            f"{name}_gpus": {m: None if p.gpus is None else list(p.gpus) for m, p in self.plan.placements.items()
                             if m in self._modes},
            f"{name}_launches": self.launch_count,
            f"{name}_tap_processes": dict(self._tap_processes),
        }

    @abc.abstractmethod
    def planned_flags(self, mode: str) -> list[str]:
        """The mode's server flags as they would be launched now (for a mode not launched yet)."""

    def timings(self) -> Mapping[str, float | None]:
        return {"server_start_s": self.pool.start_seconds}

    def close(self) -> None:
        self.pool.close()


def checkpoint_inputs(model: str, processor: Any = None, model_config: Any = None) -> tuple[ChatPrompts, CheckpointFacts]:
    """The checkpoint's chat prompts and facts (tests inject a processor and config instead)."""
    if processor is None or model_config is None:
        from parity.models.checkpoint import CheckpointSource, load_config_and_processor

        model_config, processor = load_config_and_processor(CheckpointSource.of(model))
    return ChatPrompts(processor), CheckpointFacts.of(model_config)


def served_model(model: str, seed: int | None = None) -> str:
    """What a server loads for `model`: an embedded preset (built from `seed`) is saved once into
    parity's cache as a checkpoint folder; anything else is given to the engine as it is."""
    if model not in PRESETS:
        return model
    from parity.models.preset_checkpoint import saved_preset

    return str(saved_preset(model, seed))


def served_identity(model: str, seed: int | None = None) -> Callable[[], ModelIdentity]:
    """How to identify what the servers load for `model`, once they have: an embedded preset by its
    built weights (the same identity as in-process), a checkpoint by its files (a hub id's weights are
    fetched by the servers themselves, into the cache this reads)."""
    if model in PRESETS:
        from parity.models import preset_identity

        return functools.partial(preset_identity, model, seed)
    return functools.partial(of_checkpoint, model)


def server_args_for(options: Any, args: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """(device, the engine flags) for a server backend's `BackendOptions`: `--seed` only builds an
    embedded preset; the servers, not parity, load the weights, so `--dtype` becomes their flag,
    float32 for a preset or on a CPU unless asked (engines run a float32 checkpoint in half precision
    under `auto`, docs/engines/sglang-cpu.md), else the engine's own choice."""
    device = "cpu" if options.device == "cpu" else "cuda"
    embedded = options.model in PRESETS
    if options.seed is not None and not embedded:
        raise UsageError(f"--seed builds an embedded preset ({', '.join(PRESETS)}); {options.model!r} is a checkpoint")
    dtype = options.dtype if options.dtype != "auto" else ("float32" if device == "cpu" or embedded else None)
    if dtype is not None and flag_values(args, "--dtype") is None:
        args = (*args, "--dtype", dtype)
    return device, args
