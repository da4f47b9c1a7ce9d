"""The `sglang` backend: one real SGLang server per execution mode, the tap toggled per request.

Eager and bcg servers differ only in the arms' `--cuda-graph-backend-prefill` value (servers.py).
DeepStack normal/zero is switched inside a running server through the plugin's channel, so every
scenario of a run costs two launches. The session, the pool and the evidence are every engine's
(`parity.engines.engine`); this adapter says what only SGLang knows: its native /generate bodies,
its launch command and environment, the dtype and fix checks, and how its memory is shared.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from parity.backends.options import BackendOptions
from parity.backends.protocol import Request
from parity.runner.buckets import prefill_bucket_ladder, smallest_fitting
from parity.engines import launcher
from parity.engines.channel import TapChannel, TapEntry
from parity.engines.engine import (
    Completion, EngineBackend, checkpoint_inputs, server_args_for, served_identity, served_model,
)
from parity.engines.gpus import gpu_count, gpu_memory, visible_gpu_count
from parity.engines.placement import LaunchPlan, Placement
from parity.engines.pool import Server
from parity.engines.settings import check_cpu_placement, resolve_graph_backend
from parity.engines.prompts import MediaFiles
from parity.engines.sglang import client, deepstack_slot, kernel_standin, plugin, server_checks
from parity.engines.sglang.servers import (
    CACHE_FLUSH_PATH, MAX_MEM_FRACTION, SglangSettings, buckets_given, check_gpu_count,
    fraction_for_share, mode_flags, plan_launch, server_env, server_flags, split_user_args,
)
from parity.errors import ArmFailure, UsageError
from parity.media.fixtures import Fixture

# A launch command other than `python -m sglang.launch_server` (a wrapper, another interpreter, a
# stand-in): shlex-split and used as given, without checking SGLang or a GPU here.
LAUNCH_COMMAND_ENV = "PARITY_SGLANG_LAUNCH"
# SGLang 0.5.23 samples a video at 2 frames a second (srt/multimodal/processors/qwen_vl.py::FPS,
# smart_nframes) and floors the count to whole pairs.
VIDEO_FPS = 2.0
# What a bcg server that dies while starting most likely hit (docs/engines/sglang-0.5.23.md §8).
BCG_START_HINT = ("SGLang's warm-up sends an image request through the prefill graph, so a crash here is most "
                  "likely the multimodal BCG replay fault, not the DeepStack drop (see docs/sglang-runbook.md)")


class SglangBackend(EngineBackend):
    name = "sglang"
    request_path = "/generate"
    version_path = "/server_info"
    cache_flush_path = CACHE_FLUSH_PATH
    package = server_checks.PACKAGE
    tap_hint = ("install parity in the server's Python environment (pip install -e '.[sglang]') so the "
                f"{plugin.ENTRY_POINT_GROUP} entry point is found, keep '{plugin.ENTRY_POINT_NAME}' in "
                "SGLANG_PLUGINS if you set it, and look for 'Failed to apply hooks' in the log")

    def __init__(self, settings: SglangSettings, prompts, facts, identity) -> None:
        super().__init__(settings, prompts, facts, identity)
        # A video is written at SGLang's own sampling rate, padded to whole pairs, so that its
        # preprocessing keeps every frame (docs/engines/sglang-cpu.md, "Video requests").
        self.media = MediaFiles(settings.run_dir / "media", video_fps=VIDEO_FPS, even_frames=True)
        self._served_dtype: dict[str, str | None] = {}
        self._fix_records: dict[str, list[dict]] = {}

    @property
    def ranks(self) -> int:
        return self.server_facts.tp_size

    @property
    def max_bucket(self) -> int | None:
        return self.server_facts.max_bucket

    @property
    def max_positions(self) -> int | None:
        return self.server_facts.context_length or self.facts.max_positions

    def bucket_of(self, num_tokens: int) -> int | None:
        return self.server_facts.bucket_of(num_tokens)

    # --- launching -----------------------------------------------------------------------------

    def plan_launch(self, modes: Sequence[str]) -> LaunchPlan:
        return plan_launch(self.settings, modes)

    def plan_run(self, modes: Sequence[str], prompt_lengths: Sequence[int]) -> None:
        for mode in modes:
            mode_flags(mode)  # fail on inconsistent arm files before any launch
        if self.settings.on_cpu and not buckets_given(self.settings.sglang_args) and prompt_lengths:
            self._cap_buckets(max(prompt_lengths))

    def _cap_buckets(self, longest_prompt: int) -> None:
        """On a CPU, capture SGLang's ladder only up to the bucket the run's longest prefill needs
        (a prompt plus teacher-forced tokens): the emulation keeps every captured tensor alive. The
        answer gets room twice over: a video's scoring request goes through text
        (`ChatPrompts.scoring_ids`), where an answer can re-tokenize into more tokens (8 into 10
        measured), and a prefill past the cap would run eagerly."""
        longest = longest_prompt + 2 * self.settings.max_new_tokens
        cap = smallest_fitting(prefill_bucket_ladder(max(longest, 1) * 2), longest)
        self.settings = replace(self.settings, sglang_args=(*self.settings.sglang_args,
                                                            "--cuda-graph-max-bs-prefill", str(cap)))

    def server_spec(self, mode: str, placement: Placement, stem: str, channel: TapChannel,
                    profile: str | None = None):
        fraction = self._fraction(mode, placement)
        calls = self.settings.run_dir / f"{stem}.standin-calls.jsonl" if self.settings.on_cpu else None
        command = (*self.settings.launch_command, *server_flags(self.settings, mode, fraction, profile))
        env = server_env(channel, placement, self.settings, calls)
        spec = launcher.ServerSpec(name=mode, command=command, log_path=self.settings.run_dir / f"{stem}.log",
                                   env=MappingProxyType(env))
        return spec, None if calls is None else kernel_standin.call_log(calls)

    def planned_flags(self, mode: str) -> list[str]:
        return list(server_flags(self.settings, mode, self.plan.placements[mode].mem_fraction))

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

    def explain_exit(self, mode: str, failure: ArmFailure) -> ArmFailure:
        if isinstance(failure, launcher.ExitedDuringStartup) and self.mode_of(mode) == "bcg":
            return ArmFailure(f"{failure}; {BCG_START_HINT}", log_tail=failure.log_tail)
        return failure

    def check_started(self, server: Server, entries: Sequence[TapEntry]) -> ArmFailure | None:
        """The dtype the model really runs in, and the fix in place when asked for."""
        key = server.process.name
        served = self._served_dtype[key] = server_checks.served_dtype(entries)
        problem = server_checks.dtype_problem(served, self.server_facts.dtype)
        if problem is None:
            problem, self._fix_records[key] = server_checks.fix_problem(server.channel.folder, self.settings.fix,
                                                                        self.mode_of(key))
        return None if problem is None else server.process.failure(problem)

    # --- requests ------------------------------------------------------------------------------

    def media_input(self, fixture: Fixture | None) -> dict[str, str]:
        return client.media_data(self.media.path(fixture), fixture is not None and fixture.is_video)

    def generate_body(self, request: Request, media: Any, max_new_tokens: int, tag: str) -> dict:
        return client.generate_body(self.prompts.text(request), media, max_new_tokens, rid=tag)

    def parse_completion(self, doc: dict) -> Completion:
        return client.parse_completion(doc)

    def score_body(self, request: Request, media: Any, prompt_ids: tuple[int, ...], tokens: Sequence[int],
                   tag: str) -> dict:
        return client.score_body(self.prompts.scoring_ids(request, prompt_ids), tokens, len(prompt_ids), media, rid=tag)

    def parse_scores(self, doc: dict, prompt_ids: tuple[int, ...], tokens: Sequence[int]) -> tuple[float, ...] | None:
        return client.parse_scores(doc, tokens, prompt_ids)

    def refuses_to_score(self, failure: ArmFailure) -> bool:
        # The generation with the same prompt and media was served: what is refused is the answer.
        return client.PLACEHOLDER_REFUSED in str(failure)

    def scored_length(self, doc: dict, prompt_ids: tuple[int, ...], tokens: Sequence[int]) -> int:
        return len(doc.get("prompt_token_ids") or ()) or len(prompt_ids) + len(tokens)

    def cached_tokens(self, doc: dict) -> int | None:
        return client.cached_tokens(doc)

    # --- reporting -----------------------------------------------------------------------------

    def gpu_name(self) -> str | None:
        return None if self.settings.on_cpu else super().gpu_name()

    def engine_config(self) -> Mapping[str, Any]:
        return {
            "sglang_args": list(self.settings.sglang_args),
            "sglang_prefill_buckets": {"max": self.server_facts.max_bucket,
                                       "count": len(self.server_facts.prefill_buckets)},
            "sglang_device": self.settings.device,
            "tp_size": self.server_facts.tp_size,
            "sglang_graph_backend": self.settings.graph_backend,
            "sglang_server_dtype": dict(self._served_dtype),
            "sglang_fix": self.settings.fix,
            "sglang_fix_slots": dict(self._fix_records),
            "top_logprobs_num": client.TOP_LOGPROBS,
        }


# --- construction ------------------------------------------------------------------------------------

def create_sglang_backend(*, sglang_args: tuple[str, ...] = (), device: str = "cuda", graph_backend: str | None = None,
                          fix: str | None = None, threads: int | None = None, seed: int | None = None,
                          gpu_memory_reader=None, launch_command: Sequence[str] | None = None,
                          processor: Any = None, model_config: Any = None, identity: Any = None,
                          **server: Any) -> SglangBackend:
    """The backend the CLI builds; `server` holds the `ServerSettings` fields (model, max_new_tokens,
    run_dir, concurrent, gpus, mem_fraction, ready_timeout, stop_grace, ready_poll).

    `launch_command` (or PARITY_SGLANG_LAUNCH) replaces `python -m sglang.launch_server` and then
    skips the SGLang/GPU checks (tests start a stand-in); `processor` and `model_config` skip loading
    the checkpoint's (tests inject the tiny ones), and `identity` (a callable) identifying its weights;
    `gpu_memory_reader` replaces nvidia-smi. `device`
    "cpu" serves on SGLang's CPU engine, whose prefill graph replays through parity's emulation
    (`graph_backend` "emulated", the default there); `fix` runs parity's DeepStack slot fix in the
    servers. An embedded preset as `model` (built from `seed`) is served from its checkpoint folder
    in parity's cache."""
    graph_backend = resolve_graph_backend("sglang", device, graph_backend)
    if device == "cpu":
        check_cpu_placement(server)
    if fix is not None and fix not in deepstack_slot.VARIANTS:
        raise UsageError(f"unknown SGLang fix {fix!r}; known: {deepstack_slot.FIX}")
    if launch_command is None and os.environ.get(LAUNCH_COMMAND_ENV, "").strip():
        launch_command = shlex.split(os.environ[LAUNCH_COMMAND_ENV])
    if launch_command is not None:
        server["launch_command"] = tuple(launch_command)
    settings = SglangSettings(sglang_args=split_user_args(sglang_args), gpu_memory=gpu_memory_reader, device=device,
                              graph_backend=graph_backend, fix=fix, threads=threads, **server)
    plan_launch(settings)  # usage errors (flags, GPU combinations) before anything is checked or loaded
    if launch_command is None:
        server_checks.PACKAGE.check_installed(device == "cuda", "; --device cpu serves on the CPU")
        server_checks.check_fix_version(fix)
        if device != "cpu":  # a CPU server needs no GPU
            check_gpu_count(settings.facts, settings.gpus, gpu_count(), visible_gpu_count())
    launcher.free_port()  # fail early (exit 2) when no loopback port can be bound
    identity = identity or served_identity(settings.model, seed)
    settings = replace(settings, model=served_model(settings.model, seed))
    return SglangBackend(settings, *checkpoint_inputs(settings.model, processor, model_config), identity)


def from_options(options: BackendOptions, max_new_tokens: int, run_dir: Path) -> SglangBackend:
    """The backend the command line builds. SGLang serves the embedded presets too, on the CPU from a
    cached checkpoint folder."""
    device, sglang_args = server_args_for(options, tuple(options.own("sglang_args", ())))
    return create_sglang_backend(sglang_args=sglang_args, device=device, graph_backend=options.graph_backend,
                                 fix=options.own("sglang_fix"), threads=options.threads, seed=options.seed,
                                 max_new_tokens=max_new_tokens, run_dir=run_dir, **options.server)
