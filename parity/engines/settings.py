"""What every engine's servers are given, and what parity checks before it starts any (design §6)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from parity.design import DEFAULT_CHUNK_TOKENS
from parity.engines import launcher
from parity.engines.fix_records import installed_version
from parity.errors import BackendUnavailableError, UsageError

DEFAULT_MEM_FRACTION = 0.70
DEVICES = ("cuda", "cpu")
GRAPH_BACKENDS = ("cuda", "emulated")


def resolve_graph_backend(engine: str, device: str, asked: str | None) -> str:
    """`auto`/None: real CUDA graphs on a GPU, parity's emulation inside the server on a CPU."""
    if device not in DEVICES:
        raise UsageError(f"the {engine} backend runs on {' or '.join(DEVICES)}, not {device!r}")
    resolved = asked if asked not in (None, "auto") else ("emulated" if device == "cpu" else "cuda")
    if resolved not in GRAPH_BACKENDS:
        raise UsageError(f"unknown graph backend {resolved!r}; known: {', '.join(GRAPH_BACKENDS)}")
    if (device, resolved) in {("cpu", "cuda"), ("cuda", "emulated")}:
        raise UsageError(f"--graph-backend {resolved} with --device {device}: the {engine} backend replays real CUDA "
                         "graphs on a GPU and parity's emulation inside the server on a CPU")
    return resolved


def check_cpu_placement(server: dict) -> None:
    """CPU servers run one after the other, on no GPU."""
    if server.get("concurrent") or server.get("gpus"):
        raise UsageError("--concurrent and --gpus place servers on GPUs; with --device cpu the servers run one "
                         "after the other")


@dataclass(frozen=True)
class ServerSettings:
    """A run's servers, whatever the engine: an engine's settings add its own fields to these."""

    model: str
    max_new_tokens: int
    run_dir: Path
    concurrent: bool = False
    gpus: tuple[int, ...] = ()
    mem_fraction: float = DEFAULT_MEM_FRACTION
    ready_timeout: float = 1800.0
    launch_command: tuple[str, ...] = ()  # the engine's own server command unless replaced
    stop_grace: float = launcher.STOP_GRACE_S
    ready_poll: float = launcher.POLL_S
    chunk_size: int = DEFAULT_CHUNK_TOKENS  # the chunked profile's prefill chunk, in tokens (design §10)
    device: str = "cuda"  # "cpu": the engine's CPU worker with parity's stand-ins (docs/engines/*-cpu.md)
    graph_backend: str = "cuda"  # "emulated": the engine's graphs replay through parity's emulation (CPU)
    fix: str | None = None  # parity's DeepStack fix in the servers (the engine's fix module's VARIANTS)
    threads: int | None = None  # CPU threads of each server process (CPU only)

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def __post_init__(self) -> None:
        if not 0.0 < self.mem_fraction < 1.0:
            raise UsageError(f"the memory fraction must be between 0 and 1, got {self.mem_fraction}")
        if self.ready_timeout <= 0:
            raise UsageError(f"the ready timeout must be positive, got {self.ready_timeout}")
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        object.__setattr__(self, "gpus", tuple(self.gpus))


@dataclass(frozen=True)
class EnginePackage:
    """An engine's Python package and the plugin entry point parity registers for it."""

    module: str  # "sglang"
    title: str  # "SGLang"
    version: str  # the release parity is written against
    extra: str  # pip install 'parity[<extra>]'
    entry_point_group: str
    entry_point_name: str

    def check_installed(self, needs_gpu: bool, gpu_hint: str = "") -> None:
        """Raise BackendUnavailableError (exit 2) when this machine cannot run the engine's servers."""
        from parity.engines.gpus import cuda_present

        if importlib.util.find_spec(self.module) is None:
            raise BackendUnavailableError(f"{self.title} is not installed in this Python environment; install it "
                                          f"with pip install 'parity[{self.extra}]' ({self.title} {self.version})")
        if needs_gpu and not cuda_present():
            raise BackendUnavailableError(f"the {self.module} backend needs a CUDA GPU and none is visible "
                                          f"(torch.cuda.is_available() is False and nvidia-smi lists no GPU){gpu_hint}")
        names = {ep.name for ep in importlib.metadata.entry_points(group=self.entry_point_group)}
        if self.entry_point_name not in names:
            raise BackendUnavailableError(
                f"parity's {self.title} plugin is not registered (no {self.entry_point_name!r} entry point in "
                f"{self.entry_point_group}); install parity itself, e.g. pip install -e '.[{self.extra}]', "
                "not only put it on PYTHONPATH")

    def installed_version(self) -> str | None:
        return installed_version(self.module)
