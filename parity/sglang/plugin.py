"""parity's tap inside an SGLang server: a general plugin and the channel that steers it.

SGLang loads `register()` through the `sglang.srt.plugins` entry point in every server process
(sglang-0.5.23.md §4.1). It does nothing unless `PARITY_SGLANG_TAP` names a channel folder, so
installing parity next to a production server changes nothing. When set, it adds an AFTER hook
on `prepare_mm_inputs`, the last eager point before the language model in both execution modes
(§3.4), and hands `input_deepstack_embeds` to parity's one tap (`parity.tap.apply_tap`).

The channel is a folder shared by the parity process and the server's scheduler subprocess:

- `control.json`  {"mode": "record"|"zero", "tag": "<request tag>"}, written atomically by parity
  right before each request and removed right after it. No file: the tap passes through and
  records nothing; that is the state during start-up, so the server's own warm-up request is
  never tapped or recorded.
- `records.jsonl` one line per LM entry that carried DeepStack rows while a tag was set.
- `loaded-<pid>.json` written when a server process activates the plugin: proof that the
  server's environment really has parity's entry point.

Nothing here imports sglang or torch at module import time: the hook is unit-tested without
SGLang, and an inactive plugin costs one environment lookup.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # imported lazily below: an inactive plugin must not pull in torch
    from parity.tap import DeepStackRecord

# What the hook relies on in SGLang 0.5.23; tests/test_sglang_contract.py checks each one
# against the released wheel, so a rename upstream fails a test instead of silently not tapping.
ENV_VAR = "PARITY_SGLANG_TAP"
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "parity"
HOOK_TARGET = "sglang.srt.managers.mm_utils.prepare_mm_inputs"
FORWARD_BATCH_ARG = (1, "forward_batch")
LANGUAGE_MODEL_ARG = (2, "language_model")
KWARGS_ARG = (3, "kwargs")  # the dict later spread into language_model(...)
DEEPSTACK_KEY = "input_deepstack_embeds"
RAW_LENGTHS_FIELD = "extend_seq_lens_cpu"  # ForwardBatch: per-request extend lengths, unpadded
REPLAY_FORWARD_NAME = "replay_layer_forward"  # what BCG installs as the LM instance's forward

CONTROL_FILE = "control.json"
RECORDS_FILE = "records.jsonl"
LOADED_PREFIX = "loaded-"
CONTROL_MODES = ("record", "zero")


class TapChannelError(RuntimeError):
    """The control file exists but cannot be understood; tapping blindly would mislabel an arm."""


@dataclass(frozen=True)
class Control:
    mode: str  # "record" or "zero"
    tag: str


@dataclass(frozen=True)
class TapEntry:
    """One LM entry the tap saw during a tagged request, as stored in records.jsonl."""

    tag: str
    pid: int
    record: DeepStackRecord


@dataclass(frozen=True)
class TapChannel:
    """The folder both sides share; parity writes control, the server appends records."""

    folder: Path

    @property
    def control_path(self) -> Path:
        return self.folder / CONTROL_FILE

    @property
    def records_path(self) -> Path:
        return self.folder / RECORDS_FILE

    # --- parity side ---------------------------------------------------------------------------

    def create(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.disarm()

    def arm(self, mode: str, tag: str) -> None:
        """Tap the next request in `mode`; its records carry `tag`."""
        if mode not in CONTROL_MODES:
            raise ValueError(f"unknown control mode {mode!r}; known: {', '.join(CONTROL_MODES)}")
        # Write then rename: the scheduler must never read a half-written file.
        tmp = self.folder / f".{CONTROL_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps({"mode": mode, "tag": tag}))
        os.replace(tmp, self.control_path)

    def disarm(self) -> None:
        self.control_path.unlink(missing_ok=True)

    def entries(self, tag: str) -> list[TapEntry]:
        if not self.records_path.exists():
            return []
        lines = self.records_path.read_text().splitlines()
        entries = [_entry_from_json(json.loads(line)) for line in lines if line.strip()]
        return [e for e in entries if e.tag == tag]

    def loaded_pids(self) -> list[int]:
        return sorted(int(p.stem.removeprefix(LOADED_PREFIX)) for p in self.folder.glob(f"{LOADED_PREFIX}*.json"))

    # --- server side ---------------------------------------------------------------------------

    def read_control(self) -> Control | None:
        try:
            raw = json.loads(self.control_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as err:
            raise TapChannelError(f"{self.control_path}: unreadable ({err})") from None
        if not isinstance(raw, dict) or raw.get("mode") not in CONTROL_MODES or not isinstance(raw.get("tag"), str):
            raise TapChannelError(f"{self.control_path}: expected mode and tag, got {raw!r}")
        return Control(raw["mode"], raw["tag"])

    def append(self, entry: TapEntry) -> None:
        line = json.dumps({"tag": entry.tag, "pid": entry.pid, "record": entry.record.to_json()})
        # One short O_APPEND write per line: concurrent writers (TP ranks) do not interleave.
        with open(self.records_path, "a", encoding="utf-8") as out:
            out.write(line + "\n")

    def mark_loaded(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"{LOADED_PREFIX}{os.getpid()}.json").write_text(json.dumps({"pid": os.getpid()}))


def _entry_from_json(raw: Mapping[str, Any]) -> TapEntry:
    from parity.tap import DeepStackRecord

    return TapEntry(tag=str(raw["tag"]), pid=int(raw["pid"]), record=DeepStackRecord.from_json(raw["record"]))


def request_record(entries: list[TapEntry]) -> DeepStackRecord | None:
    """The record of a request: its first LM entry with DeepStack rows, counting its entries.

    With tensor parallelism every rank sees the same entries, so only the first writer counts.
    """
    if not entries:
        return None
    first = entries[0]
    calls = sum(1 for e in entries if e.pid == first.pid)
    return replace(first.record, calls=calls)


# --- the hook --------------------------------------------------------------------------------------

def _capturing() -> bool:
    # The decode CUDA-graph capture runs the embed routine inside a capture: no sync allowed.
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _argument(args: tuple, kwargs: Mapping[str, Any], position: tuple[int, str]) -> Any:
    index, name = position
    return args[index] if len(args) > index else kwargs.get(name)


def _raw_rows(forward_batch: Any, rows: int) -> int:
    # Under BCG the batch is padded to its bucket; the real tokens are the sum of extend lengths.
    lengths = getattr(forward_batch, RAW_LENGTHS_FIELD, None)
    if lengths is None:
        return rows
    return min(rows, int(sum(int(n) for n in lengths)))


def _is_replay(language_model: Any) -> bool:
    # BCG shadows the LM's class forward with an instance attribute for the replay; `forward` is
    # absent from the instance dict until the first replay, hence the getattr form.
    installed = getattr(language_model, "__dict__", {}).get("forward")
    return getattr(installed, "__name__", None) == REPLAY_FORWARD_NAME


@dataclass(frozen=True)
class TapHook:
    """The AFTER hook on prepare_mm_inputs: `hook(result, *args, **kwargs)`, returns None."""

    channel: TapChannel
    capturing: Callable[[], bool] = _capturing

    def __call__(self, result: Any, *args: Any, **kwargs: Any) -> None:
        lm_kwargs = _argument(args, kwargs, KWARGS_ARG)
        if not isinstance(lm_kwargs, dict) or lm_kwargs.get(DEEPSTACK_KEY) is None:
            return None  # text-only and decode batches never carry the key
        if self.capturing():
            return None
        control = self.channel.read_control()
        if control is None:
            return None  # start-up and warm-up: pass through, record nothing
        tensor = lm_kwargs[DEEPSTACK_KEY]
        handed, record = self._tap(control.mode, tensor, _argument(args, kwargs, FORWARD_BATCH_ARG))
        lm_kwargs[DEEPSTACK_KEY] = handed  # the same dict is spread into language_model(...)
        replay = _is_replay(_argument(args, kwargs, LANGUAGE_MODEL_ARG))
        self.channel.append(TapEntry(control.tag, os.getpid(), replace(record, replay=replay)))
        return None

    @staticmethod
    def _tap(mode: str, tensor: Any, forward_batch: Any) -> tuple[Any, DeepStackRecord]:
        from parity.tap import apply_tap
        import torch

        # Fingerprint only the real rows: a BCG bucket's padded tail would make eager and graph
        # fingerprints differ for the same input.
        rows = tensor[: _raw_rows(forward_batch, tensor.shape[0])]  # [raw_tokens, hidden * n_ds]
        handed, record = apply_tap(mode, rows)
        assert record is not None  # record and zero always fingerprint a tensor
        if handed is rows:
            return tensor, record  # pass-through: hand on the very object SGLang built
        if rows.shape[0] < tensor.shape[0]:
            # Keep the bucket's padded tail so the LM gets the shape it expects.
            handed = torch.cat([handed, tensor[rows.shape[0]:]], dim=0)
        return handed, record


# --- entry point -----------------------------------------------------------------------------------

def activate(environ: Mapping[str, str] = os.environ) -> TapHook | None:
    """The hook for this process, or None when parity's control variable is not set."""
    folder = environ.get(ENV_VAR)
    if not folder:
        return None
    channel = TapChannel(Path(folder))
    channel.mark_loaded()
    return TapHook(channel)


def register() -> None:
    """SGLang general-plugin entry point: inert unless PARITY_SGLANG_TAP is set."""
    hook = activate()
    if hook is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, hook, HookType.AFTER)
