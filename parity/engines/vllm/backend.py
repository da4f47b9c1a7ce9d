"""The `vllm` backend: one real `vllm serve` server per execution mode, the tap steered per request.

Eager and graph servers differ only in `-cc.cudagraph_mode` (servers.py). DeepStack normal/zero
is switched inside a running server through the plugin's channel, so every scenario of a run
costs two launches. Each request carries its own tag as its request id; its evidence is what the
tap recorded, step by step, for the engine requests with that id in the process that ran the
model: the engine's own dispatch decision (graph or eager), the DeepStack it was handed, and the
leak witness (DeepStack rows an earlier request left in vLLM's persistent buffer).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from parity.backends.options import BackendOptions
from parity.backends.protocol import Request
from parity.engines import launcher
from parity.engines.channel import TapChannel, TapEntry
from parity.engines.engine import (
    Completion, EngineBackend, checkpoint_inputs, server_args_for, served_identity, served_model,
)
from parity.engines.placement import LaunchPlan, Placement
from parity.engines.pool import Server
from parity.engines.prompts import MediaFiles
from parity.engines.fix_records import read_records
from parity.engines.settings import EnginePackage, check_cpu_placement, resolve_graph_backend
from parity.engines.vllm import client, cpu_ops, cpu_patches, deepstack_clear, planted, plugin, versions
from parity.engines.vllm.servers import (
    CACHE_FLUSH_PATH, READY_PATH, VllmSettings, cpu_compile, environment_of, graph_mode, mode_cudagraph,
    plan_launch, server_env, server_flags, split_vllm_args,
)
from parity.errors import ArmFailure, BackendUnavailableError, UsageError
from parity.media.fixtures import Fixture
from parity.presets import PRESETS


PACKAGE = EnginePackage("vllm", "vLLM", versions.NEWEST.version, "vllm", plugin.ENTRY_POINT_GROUP, plugin.ENTRY_POINT_NAME)
# vLLM's Qwen3-VL video loader samples at 2 frames a second (0.33 and 0.34) (Qwen3VLVideoBackend.load_bytes).
VIDEO_FPS = 2.0
# Where the fix wraps vLLM (plugin.TARGETS with a fix wrapper): the model process must report the step
# and a DeepStack setter (each model's points are wrapped when its module is imported: the served model's are).
FIX_POINTS = tuple(f"{t.cls}.{t.method}" for t in plugin.TARGETS
                   if t.fix_wrapper and not t.of_a_model and not t.fix_wrapper.startswith("planted."))
FIX_SETTERS = tuple(f"{t.cls}.{t.method}" for t in plugin.TARGETS
                    if t.fix_wrapper and t.of_a_model and t.method in plugin.SETTERS)


class VllmBackend(EngineBackend):
    name = "vllm"
    request_path = client.CHAT_PATH
    version_path = "/version"
    cache_flush_path = CACHE_FLUSH_PATH
    package = PACKAGE
    tap_hint = ("install parity in the server's Python environment (pip install -e '.[vllm]') so the "
                f"{plugin.ENTRY_POINT_GROUP} entry point is found, keep '{plugin.ENTRY_POINT_NAME}' in VLLM_PLUGINS "
                "if you set it, do not set VLLM_USE_V2_MODEL_RUNNER=0 (the tap wraps Model Runner V2), and look "
                "for 'parity:' lines in the log")

    def __init__(self, settings: VllmSettings, prompts, facts, identity) -> None:
        self.capture = settings.capture
        self._sizes: tuple[int, ...] = self.capture.sizes_for(())
        super().__init__(settings, prompts, facts, identity)
        self._envs: dict[str, dict[str, str]] = {}
        # A video is written at the rate vLLM's Qwen3-VL loader samples (multimodal/video.py::
        # Qwen3VLVideoBackend, 2 fps), so that it keeps every frame (docs/engines/vllm-cpu.md).
        self.media = MediaFiles(settings.run_dir / "media", video_fps=VIDEO_FPS)
        self._parts: dict[str, dict] = {}
        self._fix_records: dict[str, list[dict]] = {}

    @property
    def max_positions(self) -> int | None:
        return self.server_facts.max_model_len or self.facts.max_positions

    @property
    def max_bucket(self) -> int | None:
        return max(self._sizes, default=None)

    def bucket_of(self, num_tokens: int) -> int | None:
        return self.capture.bucket_of(num_tokens)

    # --- launching -----------------------------------------------------------------------------

    def plan_launch(self, modes: Sequence[str]) -> LaunchPlan:
        return plan_launch(self.settings, modes)

    def plan_run(self, modes: Sequence[str], prompt_lengths: Sequence[int]) -> None:
        # Scoring sends the prompt with up to max_new_tokens answer tokens: those prefills replay too.
        self._sizes = self.capture.sizes_for([n + self.settings.max_new_tokens for n in prompt_lengths])

    def server_spec(self, mode: str, placement: Placement, stem: str, channel: TapChannel,
                    profile: str | None = None):
        flags = server_flags(self.settings, mode, placement.mem_fraction, self._sizes, profile)
        calls = self.settings.run_dir / f"{stem}.standin-calls.jsonl" if self.settings.on_cpu else None
        env = server_env(self.settings, channel, placement, calls)
        self._envs[mode] = environment_of(env)
        return launcher.ServerSpec(name=mode, command=(*self.settings.launch_command, *flags),
                                   log_path=self.settings.run_dir / f"{stem}.log", env=MappingProxyType(env),
                                   ready_path=READY_PATH), None if calls is None else cpu_ops.call_log(calls)

    def planned_flags(self, mode: str) -> list[str]:
        return list(server_flags(self.settings, mode, self.plan.placements[mode].mem_fraction, self._sizes))

    def explain_exit(self, mode: str, failure: ArmFailure) -> ArmFailure:
        """A CPU server that died on a patch target parity did not find says that first (another vLLM)."""
        missing = next((line[line.index(cpu_patches.MISSING):] for line in (failure.log_tail or "").splitlines()
                        if cpu_patches.MISSING in line), None)
        return failure if missing is None else ArmFailure(f"{missing}; {failure}", log_tail=failure.log_tail)

    def started_problem(self, server: Server) -> str | None:
        """A server whose model process built vLLM's V1 runner: the tap, which wraps V2, cannot see it."""
        built = plugin.runners(server.channel.folder)
        v1 = [r for r in built if r.get("runner") == "V1"]
        if not v1:
            return None
        return (f"vLLM built its V1 model runner ({v1[0].get('class', '?')}, pid {v1[0].get('pid', '?')}), whose "
                "steps parity's tap cannot see (it wraps Model Runner V2): no answer of this server can be judged; "
                "vLLM falls back to V1 when Triton is missing or a feature is not in V2 yet (its log says which), "
                "or when VLLM_USE_V2_MODEL_RUNNER=0")

    def check_started(self, server: Server, entries: Sequence[TapEntry]) -> ArmFailure | None:
        if any(e.mode is None for e in entries):
            return server.process.failure(
                "the tap saw the request's steps but not vLLM's dispatch decision for them "
                "(CudaGraphManager.dispatch was not wrapped): graph replay cannot be shown; look for 'parity:' "
                "lines in the log")
        problem = self._fix_problem(server)
        return None if problem is None else server.process.failure(problem)

    def _fix_problem(self, server: Server) -> str | None:
        """With --vllm-fix: the model process must have wrapped the step and a DeepStack setter."""
        fix = self.settings.fix
        if not fix:
            return None
        records = read_records(server.channel.folder)
        self._fix_records[server.process.name] = [r.to_json() for r in records]
        refused = [r for r in records if r.refused]
        if refused:
            return f"parity's {fix} fix refused to install: {refused[0].note}"
        if any(r.stood_aside for r in records):  # the report says so (fix_records.stood_aside_note)
            return None
        wrapped = {r.note for r in records}
        points = (*FIX_POINTS, *((planted.POINTS[fix],) if fix in planted.POINTS else ()))  # and a plant's own
        missing = [t for t in points if f"wrapped {t}" not in wrapped]
        if not any(f"wrapped {t}" in wrapped for t in FIX_SETTERS):
            missing.append(f"a DeepStack setter ({', '.join(FIX_SETTERS)})")
        if missing:
            return (f"parity's {fix} fix was asked for but the model process did not wrap {', '.join(missing)}; "
                    "look for 'parity:' lines in the log")
        return None

    # --- requests ------------------------------------------------------------------------------

    def belongs(self, entry: TapEntry, tag: str) -> bool:
        # The request id parity sent becomes vLLM's chatcmpl-<tag>-<8 chars>: only its steps count.
        return any(tag in request for request in entry.requests)

    def media_input(self, fixture: Fixture | None) -> dict | None:
        if fixture is None:
            return None
        if fixture.sha256 not in self._parts:  # lossless files: the server decodes the very pixels
            data = Path(self.media.path(fixture)).read_bytes()
            self._parts[fixture.sha256] = client.media_part(data, fixture.is_video)
        return self._parts[fixture.sha256]

    def generate_body(self, request: Request, media: Any, max_new_tokens: int, tag: str) -> dict:
        return client.generate_body(request.prompt, media, max_new_tokens, tag)

    def parse_completion(self, doc: dict) -> Completion:
        return client.parse_completion(doc)

    def score_body(self, request: Request, media: Any, prompt_ids: tuple[int, ...], tokens: Sequence[int],
                   tag: str) -> dict:
        return client.score_body(request.prompt, media, self.prompts.decode(tokens), tag)

    def parse_scores(self, doc: dict, prompt_ids: tuple[int, ...], tokens: Sequence[int]) -> tuple[float, ...] | None:
        return client.parse_scores(doc, tokens)

    def scored_length(self, doc: dict, prompt_ids: tuple[int, ...], tokens: Sequence[int]) -> int:
        return len(doc.get("prompt_token_ids") or ())

    def cached_tokens(self, doc: dict) -> int | None:
        return client.cached_tokens(doc)

    # --- reporting -----------------------------------------------------------------------------

    def engine_config(self) -> Mapping[str, Any]:
        graph = self.settings.graph
        return {
            "engine": "vllm",
            "engine_version": self._version or self.installed_version(),
            "graph_mode": graph.name,
            "graph_cudagraph_modes": {m: mode_cudagraph(self.settings, m) for m in self._modes},
            "graph_breakable": graph.breakable,
            "vllm_server_env": {m: self._envs.get(m, {}) for m in self._modes},
            "vllm_args": list(self.settings.vllm_args),
            "vllm_capture_sizes": {"max": self.max_bucket, "count": len(self._sizes)},
            "vllm_fix": self.settings.fix,
            "vllm_fix_records": dict(self._fix_records),
            "vllm_device": self.settings.device,
            "vllm_graph_backend": self.settings.graph_backend,
            "vllm_compile_mode": cpu_compile(self.settings).mode if self.settings.on_cpu else "vllm default",
            "top_logprobs_num": client.TOP_LOGPROBS,
        }


# --- construction ------------------------------------------------------------------------------------



def create_vllm_backend(*, vllm_args: tuple[str, ...] = (), graph_mode_name: str = "full_and_piecewise",
                        buckets: str | tuple[int, ...] = "auto", fix: str | None = None, device: str = "cuda",
                        graph_backend: str | None = None, threads: int | None = None, seed: int | None = None,
                        launch_command: Sequence[str] | None = None, processor: Any = None, model_config: Any = None,
                        identity: Any = None, **server: Any) -> VllmBackend:
    """The backend the CLI builds; `server` holds the `ServerSettings` fields. `launch_command`
    replaces `python -m vllm.entrypoints.cli.main serve` (tests start a stand-in) and then skips
    the vLLM/GPU checks; `processor` and `model_config` skip loading the checkpoint's (tests inject
    the tiny ones), and `identity` (a callable) identifying its weights. `fix` runs parity's DeepStack clear fix in the servers. `device` "cpu" serves
    on vLLM's CPU worker, whose graphs replay through parity's emulation (`graph_backend`
    "emulated", the default there); an embedded preset as `model` (built from `seed`) is served
    from its checkpoint folder in parity's cache."""
    graph_mode(graph_mode_name)
    graph_backend = resolve_graph_backend("vllm", device, graph_backend)
    if device == "cpu":
        check_cpu_placement(server)
    if fix is not None and fix not in deepstack_clear.VARIANTS:
        raise UsageError(f"unknown vLLM fix {fix!r}; known: {', '.join(deepstack_clear.VARIANTS)}")
    explicit = None if buckets == "auto" else tuple(buckets)
    if explicit is not None and (not explicit or min(explicit) <= 0):
        raise UsageError("--buckets needs positive token counts (the vllm backend's capture sizes)")
    if launch_command is not None:
        server["launch_command"] = tuple(launch_command)
    settings = VllmSettings(vllm_args=split_vllm_args(vllm_args), graph_mode=graph_mode_name, buckets=explicit,
                            fix=fix, device=device, graph_backend=graph_backend, threads=threads, **server)
    plan_launch(settings)  # usage errors (flags, GPU combinations) before anything is checked or loaded
    if launch_command is None:
        PACKAGE.check_installed(device == "cuda", "; --device cpu serves on the CPU")
        check_release(PACKAGE.installed_version(), fix)
    launcher.free_port()  # fail early (exit 2) when no loopback port can be bound
    identity = identity or served_identity(settings.model, seed)
    settings = replace(settings, model=served_model(settings.model, seed))
    return VllmBackend(settings, *checkpoint_inputs(settings.model, processor, model_config), identity)


def check_release(found: str | None, fix: str | None) -> None:
    """One line when the installed vLLM is not a release parity supports: exit 2 with `--vllm-fix`,
    which is accepted only where it was validated; a warning otherwise, and the run goes on as best
    it can (the tap's probe fails the run, naming what it missed, if a hook target moved)."""
    release = versions.release(found)
    if fix is not None and found not in versions.fix_accepted():
        raise BackendUnavailableError(f"--vllm-fix {fix} is validated on vLLM {', '.join(versions.fix_accepted())}; "
                                      f"this environment has vLLM {found}")
    if release is None:
        print(f"warning: parity supports vLLM {versions.supported()}; this environment has vLLM {found}: the tap "
              "runs as for the newest it knows, and the run fails naming any hook that moved (README: Following a "
              "new engine release)", file=sys.stderr, flush=True)


def from_options(options: BackendOptions, max_new_tokens: int, run_dir: Path) -> VllmBackend:
    """The backend the command line builds: a checkpoint served by `vllm serve`; on the CPU, the
    embedded presets too, from a cached checkpoint folder."""
    if options.model in PRESETS and options.device != "cpu":
        raise UsageError(f"{options.model!r} is an embedded preset: the {options.name} backend serves it with "
                         "--device cpu; on a GPU give it a Qwen3-VL checkpoint id or path")
    device, vllm_args = server_args_for(options, tuple(options.own("vllm_args", ())))
    return create_vllm_backend(vllm_args=vllm_args, graph_mode_name=options.own("graph_mode", "full_and_piecewise"),
                               buckets=options.buckets, fix=options.own("vllm_fix"), device=device,
                               graph_backend=options.graph_backend, threads=options.threads, seed=options.seed,
                               max_new_tokens=max_new_tokens, run_dir=run_dir, **options.server)
