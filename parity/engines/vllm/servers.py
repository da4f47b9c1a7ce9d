"""What each mode's vLLM server is: its settings, command line, environment and GPU placement.

The eager and graph servers differ only in `-cc.cudagraph_mode`: NONE for eager (torch.compile
stays on, the same kernels; `--enforce-eager` would also change kernels and skip JIT warm-up),
the mode under test for graph. Breakable graphs are an environment switch, set alike in both
servers (it also turns torch.compile off, docs/engines/vllm-0.33.md §6). Everything else is explicit: a fixed
seed, no prefix caching (a cached image prefix skips DeepStack), `--generation-config vllm` (the
checkpoint's repetition and presence penalties would apply even at temperature 0, docs/engines/vllm-0.33.md §1.7), a
bounded context, and capture sizes that cover every prompt of the run (vLLM's default ceiling
follows `--max-num-seqs`; with `--max-num-seqs 1` every image prefill silently runs eager, docs/engines/vllm-0.33.md §0).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Sequence

from parity.arms import MODES
from parity.design import CHUNKED, PREFIX
from parity.errors import UsageError
from parity.engines.channel import TapChannel
from parity.engines.fix_records import installed_version
from parity.engines.flags import flag_values, int_flag, split_user_args
from parity.engines.placement import LaunchPlan, Placement, plan_placement
from parity.engines.settings import ServerSettings
from parity.engines.startup import standin_env
from parity.engines.vllm import cpu_ops, cpu_patches, deepstack_clear, plugin, versions

LAUNCH_MODULE = ("-m", "vllm.entrypoints.cli.main", "serve")
ARG_OPTION = "--vllm-arg"
READY_PATH = "/health"
BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"
PLUGINS_ENV = "VLLM_PLUGINS"
EAGER_CUDAGRAPH_MODE = "NONE"
# The API server's default on an H100/H200 (docs/engines/vllm-0.33.md §6); raised when a prompt needs more.
DEFAULT_MAX_BATCHED_TOKENS = 8192
DEFAULT_MAX_MODEL_LEN = 8192
DETERMINISM_FLAGS = ("--seed", "0", "--generation-config", "vllm")
# The serving features of a profile (design.Serving.server_profile), for the server's whole life. No
# prefix reuse except where the scenario is about it (a cached image prefix skips DeepStack); the
# prefix profile's answers say how many prompt tokens the cache gave, and its cache can be emptied
# (a development endpoint, turned on by DEV_MODE_ENV).
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)
# Cache hits land on whole KV blocks: the smallest block vLLM's GPU attention takes (multiples of 16;
# parity's CPU attention takes it too, cpu_patches), so a hit can end inside the image.
PREFIX_BLOCK_TOKENS = 16
PREFIX_CACHE = ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", str(PREFIX_BLOCK_TOKENS))
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
CACHE_FLUSH_PATH = "/reset_prefix_cache"
# Defaults the user may override with --vllm-arg (parity reads them back): one image or video per
# prompt keeps the encoder's start-up profiling small.
DEFAULT_FLAGS = ("--limit-mm-per-prompt", json.dumps({"image": 1, "video": 1}))
# Flags (and their dotted or attached forms) that would make the servers differ in more than the
# graph mode, undo what parity sets, or fight the launcher.
RESERVED_FLAGS = (
    "-cc", "--compilation-config", "-O", "--optimization-level", "--enforce-eager",
    "--cudagraph-capture-sizes", "--max-cudagraph-capture-size", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--generation-config", "--seed", "--gpu-memory-utilization",
    "--model", "--host", "--port",
)
RESERVED_WHY = "parity sets it so the eager and graph servers differ only in the CUDA-graph mode"
# On a CPU (docs/engines/vllm-cpu.md): no inductor (its C++ kernels are invisible to the graph
# recorder; see cpu_compile), no JIT warm-up (its top-k kernel fails in the Triton interpreter;
# greedy requests never launch it), and an explicit KV cache (the default sizes it from the RAM).
CPU_FLAGS = ("--kernel-config.enable_jit_warmup=false",)
CPU_COMPILE_MODE = "none"
CPU_COMPILE_PIECEWISE = "VLLM_COMPILE, dynamo's eager backend"
CPU_COMPILE_FLAGS = ("-cc.mode=VLLM_COMPILE", "-cc.backend=eager", "-cc.pass_config.fuse_norm_quant=false",
                     "-cc.pass_config.fuse_act_quant=false")
CPU_KV_CACHE_BYTES = 256 * 2**20
# The step budget, which also sizes the encoder's start-up profile (8192 tokens: 128 images of the
# preset through the vision tower, two minutes on 2 cores under compile).
CPU_MAX_BATCHED_TOKENS = 1024
CPU_MAX_MODEL_LEN = 4096
STANDIN_DIR = Path(__file__).resolve().parent / "standin"  # what goes on a CPU server's PYTHONPATH
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


@dataclass(frozen=True)
class GraphMode:
    """A graph mode under test: vLLM's cudagraph_mode for the graph server, and breakable graphs."""

    name: str
    cudagraph_mode: str
    breakable: bool
    meaning: str


GRAPH_MODES = MappingProxyType({m.name: m for m in (
    GraphMode("full_and_piecewise", "FULL_AND_PIECEWISE", False,
              "vLLM's default: prefills as compiled piecewise graphs, decode as full graphs"),
    GraphMode("full", "FULL", False, "the whole forward replayed as one graph, prefills included"),
    GraphMode("piecewise", "PIECEWISE", False, "compiled piecewise graphs, attention eager between them"),
    GraphMode("breakable", "FULL_AND_PIECEWISE", True,
              "breakable graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1, what VLLM_BATCH_INVARIANT=1 turns on for "
              "Qwen3-VL-2B/8B on Hopper): prefills replayed whole in segments"),
)})
DEFAULT_GRAPH_MODE = "full_and_piecewise"
PIECEWISE_MODES = ("FULL_AND_PIECEWISE", "PIECEWISE")  # need vLLM's piecewise compile


def graph_mode(name: str) -> GraphMode:
    if name not in GRAPH_MODES:
        raise UsageError(f"unknown --graph-mode {name!r}; known: {', '.join(GRAPH_MODES)}")
    return GRAPH_MODES[name]


# --- the user's flags --------------------------------------------------------------------------------

def split_vllm_args(values: Sequence[str]) -> tuple[str, ...]:
    """`--vllm-arg "-tp 2"` and `--vllm-arg -tp --vllm-arg 2` mean the same; flags parity owns are refused."""
    args = split_user_args(values, ARG_OPTION, (), RESERVED_WHY)
    owned = sorted({_owned(a) for a in args} - {None})
    if owned:
        raise UsageError(f"{ARG_OPTION} may not set {', '.join(owned)}: {RESERVED_WHY}")
    return args


def _owned(token: str) -> str | None:
    name = token.split("=", 1)[0]
    for flag in RESERVED_FLAGS:
        # -cc.cudagraph_mode=FULL, --compilation-config.mode=..., -O2, -O=2, --seed=1
        if name == flag or name.startswith(flag + ".") or (flag == "-O" and name[:2] == "-O" and name[2:].isdigit()):
            return flag
    return None


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _token_count(args: Sequence[str], name: str, auto: bool = False) -> int | None:
    """A count flag as vLLM reads it: 8192, 32k (decimal), 32K (binary); `auto` or -1 where vLLM
    takes the model's own (None here). Not given: None."""
    values = flag_values(args, name)
    if values is None:
        return None
    text = values[0] if len(values) == 1 else ""
    if auto and text in ("auto", "-1"):
        return None
    try:
        if text[-1:] in _SUFFIXES:
            number = float(text[:-1]) if text[-1].islower() else int(text[:-1])
            return int(number * _SUFFIXES[text[-1]])
        return int(text)
    except ValueError:
        raise UsageError(f"{ARG_OPTION} {name} needs one count (e.g. 8192, 32k), got {' '.join(values) or 'nothing'}") \
            from None


@dataclass(frozen=True)
class ServerFacts:
    """What the user's `--vllm-arg`s decide for parity, resolved as vLLM does (0.33 and 0.34 alike)."""

    gpus_per_server: int  # tensor x pipeline x data parallel sizes
    max_model_len: int | None  # None: the model's own context (--max-model-len auto)
    max_batched_tokens: int | None  # None: parity sets it to cover the capture sizes
    dtype: str | None
    max_model_len_given: bool = False  # the user set --max-model-len (else parity sets its default)

    @classmethod
    def parse(cls, args: Sequence[str]) -> "ServerFacts":
        gpus = 1
        for names in (("-tp", "--tensor-parallel-size"), ("-pp", "--pipeline-parallel-size"),
                      ("-dp", "--data-parallel-size")):
            size = int_flag(args, ARG_OPTION, *names)
            gpus *= size if size is not None else 1
        given = flag_values(args, "--max-model-len") is not None
        max_len = _token_count(args, "--max-model-len", auto=True)
        dtype = flag_values(args, "--dtype")
        facts = cls(gpus_per_server=gpus,
                    max_model_len=max_len if given else DEFAULT_MAX_MODEL_LEN,
                    max_batched_tokens=_token_count(args, "--max-num-batched-tokens"),
                    dtype=dtype[0] if dtype else None, max_model_len_given=given)
        if min(facts.gpus_per_server, facts.max_model_len or 1, facts.max_batched_tokens or 1) <= 0:
            raise UsageError(f"{ARG_OPTION}: parallel sizes, --max-model-len and --max-num-batched-tokens must be > 0")
        return facts


# --- capture sizes ----------------------------------------------------------------------------------------

def ladder_ceiling(num_tokens: int) -> int:
    """The smallest size of vLLM's default capture ladder (1, 2, 4, 8..248 by 8, 256.. by 16,
    config/vllm.py:2573-2596) that holds `num_tokens`."""
    if num_tokens <= 4:
        return 1 if num_tokens <= 1 else 2 if num_tokens == 2 else 4
    if num_tokens < 256:
        return 8 * math.ceil(num_tokens / 8)
    return 256 + 16 * math.ceil((num_tokens - 256) / 16)


def ladder(largest: int) -> tuple[int, ...]:
    """vLLM's default capture ladder up to and including `largest` (a ladder size)."""
    sizes = [s for s in (1, 2, 4) if s <= largest]
    sizes += range(8, min(largest + 1, 256), 8)
    sizes += range(256, largest + 1, 16)
    return tuple(sizes)


@dataclass(frozen=True)
class CaptureSizes:
    """The sizes the graph server captures: vLLM's ladder up to what the run needs, or the user's."""

    explicit: tuple[int, ...] | None  # --buckets a,b,c; None: auto
    limit: int | None  # --max-num-batched-tokens: vLLM drops larger sizes

    def bucket_of(self, num_tokens: int) -> int | None:
        if num_tokens <= 0:
            return None
        if self.explicit is not None:
            bucket = min((s for s in self.explicit if s >= num_tokens), default=None)
        else:
            bucket = ladder_ceiling(num_tokens)
        return None if bucket is None or (self.limit is not None and bucket > self.limit) else bucket

    def sizes_for(self, lengths: Sequence[int]) -> tuple[int, ...]:
        """The sizes to capture for requests of these token counts."""
        if self.explicit is not None:
            return tuple(sorted(set(self.explicit)))
        largest = ladder_ceiling(max(lengths, default=1))
        return tuple(s for s in ladder(largest) if self.limit is None or s <= self.limit)


# --- settings, flags and environment ---------------------------------------------------------------------

@dataclass(frozen=True)
class VllmSettings(ServerSettings):
    launch_command: tuple[str, ...] = (sys.executable, *LAUNCH_MODULE)
    vllm_args: tuple[str, ...] = ()
    graph_mode: str = DEFAULT_GRAPH_MODE
    buckets: tuple[int, ...] | None = None  # None: vLLM's ladder up to what the run needs

    @property
    def facts(self) -> ServerFacts:
        return ServerFacts.parse(self.vllm_args)

    @property
    def graph(self) -> GraphMode:
        return graph_mode(self.graph_mode)

    @property
    def capture(self) -> CaptureSizes:
        return CaptureSizes(self.buckets, self.facts.max_batched_tokens)


@dataclass(frozen=True)
class CpuCompile:
    """How a CPU server compiles (both servers of a run alike, so they differ only in the graph mode)."""

    mode: str  # recorded in the results' config
    flags: tuple[str, ...]
    piecewise: bool  # vLLM's piecewise compile, with parity's gates for it (cpu_patches.ENV_COMPILE)


def cpu_compile(settings: VllmSettings) -> CpuCompile:
    """Whole graphs (full, breakable) need no compile; piecewise graphs need vLLM's piecewise
    compile, kept with dynamo's eager backend (aten ops the recorder sees) instead of the inductor a
    CPU platform picks, and without the fusion passes this platform does not define."""
    if settings.graph.cudagraph_mode in PIECEWISE_MODES and not settings.graph.breakable:
        return CpuCompile(CPU_COMPILE_PIECEWISE, CPU_COMPILE_FLAGS, True)
    return CpuCompile(CPU_COMPILE_MODE, ("-cc.mode=none",), False)


def mode_cudagraph(settings: VllmSettings, mode: str) -> str:
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    return EAGER_CUDAGRAPH_MODE if mode == "eager" else settings.graph.cudagraph_mode


def profile_flags(profile: str | None, chunk_size: int) -> tuple[str, ...]:
    """A chunked prefill is a step budget of the chunk's tokens (so as many sequences at most)."""
    if profile == PREFIX:
        return PREFIX_CACHE
    chunked = ("--max-num-batched-tokens", str(chunk_size), "--max-num-seqs", str(chunk_size))
    return (*NO_PREFIX_CACHE, *(chunked if profile == CHUNKED else ()))


def server_flags(settings: VllmSettings, mode: str, mem_fraction: float, sizes: Sequence[int],
                 profile: str | None = None) -> tuple[str, ...]:
    """The flags after `vllm serve`. Parity's defaults first, the user's flags after them (argparse
    keeps the last), the graph flags parity owns in between; only `-cc.cudagraph_mode` differs by mode,
    and the profile's serving features by profile."""
    facts = settings.facts
    floor = CPU_MAX_BATCHED_TOKENS if settings.on_cpu else DEFAULT_MAX_BATCHED_TOKENS
    batched = () if facts.max_batched_tokens is not None or profile == CHUNKED else (
        "--max-num-batched-tokens", str(max(floor, max(sizes, default=0))))
    context = () if facts.max_model_len_given else (
        "--max-model-len", str(CPU_MAX_MODEL_LEN if settings.on_cpu else DEFAULT_MAX_MODEL_LEN))
    cpu = () if not settings.on_cpu else (*CPU_FLAGS, *cpu_compile(settings).flags, *(
        () if flag_values(settings.vllm_args, "--kv-cache-memory-bytes")
        else ("--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES))))
    return (settings.model, *DETERMINISM_FLAGS, "--gpu-memory-utilization", f"{mem_fraction:.4g}",
            *context, *batched, *profile_flags(profile, settings.chunk_size), *DEFAULT_FLAGS, *cpu,
            f"-cc.cudagraph_mode={mode_cudagraph(settings, mode)}",
            "--cudagraph-capture-sizes", *map(str, sizes), *settings.vllm_args)


def server_env(settings: VllmSettings, channel: TapChannel, placement: Placement,
               standin_calls: Path | None = None) -> dict[str, str]:
    env = {plugin.ENV_VAR: str(channel.folder.resolve()), BREAKABLE_ENV: "1" if settings.graph.breakable else "0",
           DEV_MODE_ENV: "1"}
    if settings.fix:
        env[deepstack_clear.ENV_FIX] = settings.fix
    if settings.on_cpu:
        env.update(cpu_env(settings, standin_calls or channel.folder / "standin-calls.jsonl",
                           installed_version("vllm")))
    if PLUGINS_ENV in os.environ:  # unset loads every plugin; set (even empty) must name parity too
        names = [n.strip() for n in os.environ[PLUGINS_ENV].split(",") if n.strip()]
        env[PLUGINS_ENV] = ",".join(dict.fromkeys([*names, plugin.ENTRY_POINT_NAME]))
    if placement.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in placement.gpus)
    return env


def cpu_env(settings: VllmSettings, standin_calls: Path, version: str | None = None) -> dict[str, str]:
    """A CPU server's environment: parity's start-up hook first on its own PYTHONPATH (never parity's),
    Model Runner V2 with Triton interpreted (forced where the release still has V1 to fall back to,
    `versions.Release.v1_runner`; where the tap never fires), the graph emulation when asked, and
    capped threads. `version`: the installed vLLM's."""
    v2 = {V2_ENV: "1"} if versions.nearest(version).v1_runner else {}
    return {
        **standin_env(STANDIN_DIR, settings.threads),
        "VLLM_TARGET_DEVICE": "cpu",
        **v2,
        "TRITON_INTERPRET": "1",
        cpu_patches.ENV_CPU: "1",
        cpu_patches.ENV_GRAPH: settings.graph_backend,
        cpu_patches.ENV_COMPILE: cpu_patches.COMPILE_EAGER if cpu_compile(settings).piecewise else "",
        cpu_ops.ENV_CALLS: str(standin_calls.resolve()),
    }


def plan_launch(settings: VllmSettings, modes: Sequence[str] = MODES) -> LaunchPlan:
    """GPUs, memory and start order as for SGLang; vLLM's --gpu-memory-utilization is a fraction of
    the total, so a server sharing a GPU simply gets its share (`Placement.mem_fraction`)."""
    return plan_placement(settings.gpus, settings.facts.gpus_per_server, settings.concurrent, settings.mem_fraction,
                          modes, "vLLM", ARG_OPTION)


def environment_of(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a server's environment that shapes its execution, for the results' config."""
    return {k: v for k, v in env.items()
            if k in (BREAKABLE_ENV, PLUGINS_ENV, "CUDA_VISIBLE_DEVICES", deepstack_clear.ENV_FIX, V2_ENV,
                     "TRITON_INTERPRET", "VLLM_TARGET_DEVICE", cpu_patches.ENV_CPU, cpu_patches.ENV_GRAPH, cpu_patches.ENV_COMPILE,
                     "OMP_NUM_THREADS")}
