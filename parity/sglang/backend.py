"""The `sglang` backend: one real SGLang server per execution mode, the tap toggled per request.

Eager and bcg servers differ only in the arms' `--cuda-graph-backend-prefill` value; everything
else is the determinism set of sglang-0.5.23.md §7 plus the user's `--sglang-arg`s. DeepStack
normal/zero is switched inside a running server through the plugin's channel, so four arms cost
two launches, and with `concurrent` both start-ups overlap.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Sequence

from parity.arms import MODES
from parity.backends.base import Generation, Request
from parity.errors import ArmFailure, BackendUnavailableError, UsageError
from parity.fixtures import Fixture
from parity.models.qwen3_vl import chat_text
from parity.sglang import client, launcher, plugin
from parity.sglang.servers import (
    DEFAULT_MAX_PREFILL_BUCKET, DEFAULT_MEM_FRACTION, LAUNCH_MODULE, Placement, SglangSettings, mode_flags,
    placements, prefill_buckets, server_env, server_flags, split_user_args,
)

TAP_MODE_OF = MappingProxyType({"normal": "record", "zero": "zero"})


# --- prompts and images ------------------------------------------------------------------------------

class ChatPrompts:
    """The model's own chat template and image placeholder, from its processor (client side)."""

    def __init__(self, processor: Any) -> None:
        self._processor = processor

    @classmethod
    def load(cls, model: str) -> "ChatPrompts":
        from transformers import AutoProcessor

        try:
            return cls(AutoProcessor.from_pretrained(model))
        except Exception as err:  # offline, gated, not a VLM: all mean "cannot build prompts"
            raise UsageError(f"cannot load the processor of {model!r} to build prompts with its chat "
                             f"template ({err.__class__.__name__}: {err}); download it first or pass "
                             "a local checkpoint path") from None

    def text(self, request: Request) -> str:
        text = chat_text(self._processor, request.fixture, request.prompt)
        placeholder = getattr(self._processor, "image_token", None)
        if request.fixture is not None and placeholder and placeholder not in text:
            raise UsageError(f"the chat template put no image placeholder {placeholder!r} into the prompt")
        return text

    def length(self, request: Request) -> int:
        images = [request.fixture.image] if request.fixture is not None else None
        encoded = self._processor(text=[self.text(request)], images=images)
        return len(encoded["input_ids"][0])


class ImageFiles:
    """Fixtures saved once as PNG (lossless, decoded by PIL in SGLang) under the run folder."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder

    def path(self, fixture: Fixture) -> str:
        path = (self._folder / f"{fixture.name}-{fixture.sha256[:12]}.png").resolve()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fixture.image.save(path, format="PNG")
        return str(path)  # absolute: SGLang base64-decodes relative paths


# --- the session -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SglangSession:
    """A ready server in one mode; requests go one at a time, the tap set before each."""

    server: launcher.ServerProcess
    channel: plugin.TapChannel
    prompts: ChatPrompts
    images: ImageFiles
    max_new_tokens: int

    def generate(self, request: Request, deepstack: str) -> Generation:
        if deepstack not in TAP_MODE_OF:
            raise UsageError(f"unknown deepstack action {deepstack!r}; known: {', '.join(TAP_MODE_OF)}")
        if not self.server.alive():
            raise self.server.exited_failure()
        tag = uuid.uuid4().hex
        image = self.images.path(request.fixture) if request.fixture is not None else None
        body = client.generate_body(self.prompts.text(request), image, self.max_new_tokens, rid=tag)
        self.channel.arm(TAP_MODE_OF[deepstack], tag)
        try:
            completion = self._post(body)
        finally:
            self.channel.disarm()
        record = plugin.request_record(self.channel.entries(tag))
        return replace(completion, deepstack_record=record)

    def _post(self, body: Mapping[str, Any]) -> Generation:
        try:
            return client.parse_completion(client.post_json(f"{self.server.base_url}/generate", body))
        except client.ServerRejected as err:
            raise self.server.failure(str(err)) from None
        except client.ServerUnreachable as err:
            if _exited_within(self.server, 5.0):
                raise self.server.failure(f"died mid-run with code {self.server.exit_code()}") from None
            raise self.server.failure(f"connection lost: {err}") from None


def _exited_within(server: launcher.ServerProcess, seconds: float) -> bool:
    # A dropped connection and the process exit race; give the exit a moment to show.
    deadline = time.monotonic() + seconds
    while server.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.exit_code() is not None


# --- the backend -------------------------------------------------------------------------------------

class SglangBackend:
    name = "sglang"

    def __init__(self, settings: SglangSettings, prompts: ChatPrompts) -> None:
        self.settings = settings
        self._prompts = prompts
        self._images = ImageFiles(settings.run_dir / "images")
        self._modes: tuple[str, ...] = MODES
        self._servers: dict[str, tuple[launcher.ServerProcess, plugin.TapChannel]] = {}
        self._failures: dict[str, ArmFailure] = {}
        self._launches: dict[str, int] = {}
        self._version: str | None = None

    @property
    def launch_count(self) -> int:
        return sum(self._launches.values())

    def prepare(self, modes: Sequence[str]) -> None:
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise UsageError(f"unknown mode {', '.join(unknown)}; known: {', '.join(MODES)}")
        self._modes = tuple(modes)
        for mode in modes:
            mode_flags(mode)  # fail on inconsistent arm files before any launch
        if self.settings.concurrent:
            self._launch(self._modes)

    @contextmanager
    def session(self, mode: str) -> Iterator[SglangSession]:
        if mode not in self._servers and mode not in self._failures:
            self._launch((mode,))
        if mode in self._failures:
            raise self._failures[mode]
        server, channel = self._servers[mode]
        try:
            yield SglangSession(server, channel, self._prompts, self._images, self.settings.max_new_tokens)
        finally:
            # Free the GPU as soon as the mode is done; a later session(mode) launches anew.
            self._servers.pop(mode, None)
            server.stop(self.settings.stop_grace)

    def _launch(self, modes: Sequence[str]) -> None:
        where = placements(self.settings, modes)
        started = []
        for mode in modes:
            try:
                started.append(self._start(mode, where[mode]))
            except ArmFailure as failure:
                self._failures[mode] = failure
        failures = launcher.wait_ready([server for server, _ in started], self.settings.ready_timeout,
                                       self.settings.ready_poll)
        for server, channel in started:
            failure = failures.get(server.name) or self._check_plugin(server, channel)
            if failure is not None:
                self._servers.pop(server.name, None)
                server.stop(self.settings.stop_grace)
                self._failures[server.name] = failure
            elif self._version is None:
                self._version = _server_version(server)

    def _start(self, mode: str, placement: Placement) -> tuple[launcher.ServerProcess, plugin.TapChannel]:
        count = self._launches.get(mode, 0) + 1
        self._launches[mode] = count
        stem = f"sglang-{mode}" if count == 1 else f"sglang-{mode}-{count}"
        channel = plugin.TapChannel(self.settings.run_dir / f"{stem}.tap")
        channel.create()
        spec = launcher.ServerSpec(
            name=mode,
            command=(*self.settings.launch_command, *server_flags(self.settings, mode, placement.mem_fraction)),
            log_path=self.settings.run_dir / f"{stem}.log",
            env=MappingProxyType(server_env(channel, placement)),
        )
        server = launcher.start_server(spec)
        # Registered before waiting: a Ctrl-C during start-up still finds it in close().
        self._servers[mode] = (server, channel)
        return server, channel

    @staticmethod
    def _check_plugin(server: launcher.ServerProcess, channel: plugin.TapChannel) -> ArmFailure | None:
        if channel.loaded_pids():
            return None
        return server.failure(
            f"did not load parity's plugin (no marker in {channel.folder}); install parity in the "
            f"server's Python environment (pip install -e '.[sglang]') so the {plugin.ENTRY_POINT_GROUP} "
            f"entry point is found, and keep '{plugin.ENTRY_POINT_NAME}' in SGLANG_PLUGINS if you set it")

    def bucket_of(self, num_tokens: int) -> int | None:
        return next((b for b in prefill_buckets(self._max_prefill_bucket()) if b >= num_tokens), None)

    def _max_prefill_bucket(self) -> int:
        args = self.settings.sglang_args
        for flag, value in zip(args, args[1:]):
            if flag == "--cuda-graph-max-bs-prefill":
                return int(value)
        return DEFAULT_MAX_PREFILL_BUCKET

    def prompt_length(self, request: Request) -> int:
        return self._prompts.length(request)

    def environment(self) -> Mapping[str, Any]:
        gpu = _gpu_name(self.settings.gpus)
        return {"sglang": self._version or _installed_sglang(), "device": "cuda" if gpu else "cpu", "gpu": gpu}

    def config(self) -> Mapping[str, Any]:
        where = placements(self.settings, self._modes)
        return {
            "sglang_servers": {mode: list(server_flags(self.settings, mode, where[mode].mem_fraction))
                               for mode in self._modes},
            "sglang_args": list(self.settings.sglang_args),
            "sglang_concurrent": self.settings.concurrent,
            "sglang_gpus": {mode: list(p.gpus) if p.gpus is not None else None for mode, p in where.items()},
            "sglang_launches": self.launch_count,
            "top_logprobs_num": client.TOP_LOGPROBS,
        }

    def close(self) -> None:
        for mode in list(self._servers):
            server, _ = self._servers.pop(mode)
            server.stop(self.settings.stop_grace)


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


def _gpu_name(gpus: tuple[int, ...]) -> str | None:
    names = [line.strip() for line in _nvidia_smi("--query-gpu=name", "--format=csv,noheader").splitlines()
             if line.strip()]
    index = gpus[0] if gpus else 0
    return names[index] if index < len(names) else None


def _nvidia_smi(*args: str) -> str:
    """nvidia-smi's output, or "" where it is missing or fails (then there is no GPU to name)."""
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


# --- construction ------------------------------------------------------------------------------------

def check_requirements() -> None:
    """Raise BackendUnavailableError (exit 2) when this machine cannot run SGLang servers."""
    if importlib.util.find_spec("sglang") is None:
        raise BackendUnavailableError("SGLang is not installed in this Python environment; install it with "
                                      "pip install 'parity[sglang]' (SGLang 0.5.23)")
    if not _cuda_present():
        raise BackendUnavailableError("the sglang backend needs a CUDA GPU and none is visible "
                                      "(torch.cuda.is_available() is False and nvidia-smi lists no GPU)")
    names = {ep.name for ep in importlib.metadata.entry_points(group=plugin.ENTRY_POINT_GROUP)}
    if plugin.ENTRY_POINT_NAME not in names:
        raise BackendUnavailableError(
            f"parity's SGLang plugin is not registered (no {plugin.ENTRY_POINT_NAME!r} entry point in "
            f"{plugin.ENTRY_POINT_GROUP}); install parity itself, e.g. pip install -e '.[sglang]', "
            "not only put it on PYTHONPATH")


def _cuda_present() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    return "GPU" in _nvidia_smi("-L")


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
    stop_grace: float = launcher.STOP_GRACE_S,
    ready_poll: float = launcher.POLL_S,
) -> SglangBackend:
    """The backend the CLI builds. `launch_command` replaces `python -m sglang.launch_server`
    (tests start a stand-in) and then skips the SGLang/GPU checks; `processor` skips loading
    the model's processor (tests inject the tiny one)."""
    if not 0.0 < mem_fraction < 1.0:
        raise UsageError(f"the memory fraction must be between 0 and 1, got {mem_fraction}")
    if ready_timeout <= 0:
        raise UsageError(f"the ready timeout must be positive, got {ready_timeout}")
    if launch_command is None:
        check_requirements()
    launcher.free_port()  # fail early (exit 2) when no loopback port can be bound
    settings = SglangSettings(
        model=model, max_new_tokens=max_new_tokens, run_dir=Path(run_dir),
        sglang_args=split_user_args(sglang_args), concurrent=concurrent, gpus=tuple(gpus),
        mem_fraction=mem_fraction, ready_timeout=ready_timeout,
        launch_command=tuple(launch_command) if launch_command is not None else (sys.executable, *LAUNCH_MODULE),
        stop_grace=stop_grace, ready_poll=ready_poll,
    )
    prompts = ChatPrompts(processor) if processor is not None else ChatPrompts.load(model)
    return SglangBackend(settings, prompts)
