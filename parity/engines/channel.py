"""The channel between parity and a tap inside an engine's model processes, and what the tap records.

The channel is a folder shared by the parity process and the server's model processes:

- `control.json`  {"mode": "record"|"zero", "tag": "<request tag>"}, written atomically by parity
  right before each request and removed right after it. No file: the tap passes through and
  records nothing; that is the state during start-up, so an engine's own warm-up requests are
  never tapped or recorded.
- `records.jsonl` one line per LM entry the tap saw while a tag was set.

Standard library only: every engine process imports it, and an inactive tap must stay cheap.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from parity.arms import DEEPSTACK_ACTIONS, DeepStack
from parity.errors import UsageError

if TYPE_CHECKING:  # imported lazily below: an inactive plugin must not pull in torch
    from parity.evidence import DeepStackRecord, InputFreshness

CONTROL_FILE = "control.json"
RECORDS_FILE = "records.jsonl"
CAPTURES_FILE = "captures.jsonl"  # one line per graph capture a server ran (its buckets)
FRESHNESS_FILE = "freshness.jsonl"  # one line per graph replay the freshness witness held (design §6)
# Set to "off" in a server's environment: the engines' freshness witness watches nothing (what
# scripts/bench_witness.py pairs against it to measure its cost; the answers still judge).
FRESHNESS_OFF_ENV = "PARITY_FRESHNESS"
CONTROL_MODES = ("record", "zero")


def tap_mode(deepstack: str) -> str:
    """The control mode for an arm's DeepStack action (`arms.DeepStack.tap_mode`); UsageError for an
    unknown action."""
    if deepstack not in DEEPSTACK_ACTIONS:
        raise UsageError(f"unknown deepstack action {deepstack!r}; known: {', '.join(DEEPSTACK_ACTIONS)}")
    return DeepStack(deepstack).tap_mode


class TapChannelError(RuntimeError):
    """The control file exists but cannot be understood; tapping blindly would mislabel an arm."""


@dataclass(frozen=True)
class Control:
    mode: str  # "record" or "zero"
    tag: str


@dataclass(frozen=True)
class TapEntry:
    """One LM entry the hook saw during a tagged request, as stored in records.jsonl."""

    tag: str
    pid: int
    role: str  # the process's title: SGLang names its model process "sglang::scheduler..."
    extend: bool | None  # an extend (prompt) batch; None: the batch did not say
    tokens: int | None  # rows the LM gets: the bucket under replay, the real tokens otherwise
    raw_tokens: int | None  # the real tokens of the batch
    replay: bool | None  # the entry ran by graph replay; None: the engine's decision was not seen
    record: DeepStackRecord | None  # the tap's fingerprint; None: no DeepStack rows in this entry
    dtype: str | None = None  # of the embeddings handed to the LM: the dtype the model really runs in
    # Engines that say more (vLLM): the engine's own name for how the entry ran ("FULL",
    # "PIECEWISE", "BREAKABLE", "NONE"), the engine's ids of the batch's requests, and the leak
    # witness: real rows of this entry that read DeepStack an earlier entry left in a persistent
    # buffer, which entry's request (tag) wrote them, and the rows the engine still counted as
    # uncleared when the entry began.
    mode: str | None = None
    requests: tuple[str, ...] = ()
    stale_rows: int = 0
    stale_source: str | None = None
    uncleared: int = 0

    def to_json(self) -> dict:
        return {"tag": self.tag, "pid": self.pid, "role": self.role, "extend": self.extend, "tokens": self.tokens,
                "raw_tokens": self.raw_tokens, "replay": self.replay,
                "record": None if self.record is None else self.record.to_json(), "dtype": self.dtype,
                "mode": self.mode, "requests": list(self.requests), "stale_rows": self.stale_rows,
                "stale_source": self.stale_source, "uncleared": self.uncleared}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "TapEntry":
        from parity.evidence import DeepStackRecord

        record, replay = raw.get("record"), raw.get("replay")
        return cls(tag=str(raw["tag"]), pid=int(raw["pid"]), role=str(raw.get("role", "")), extend=raw.get("extend"),
                   tokens=raw.get("tokens"), raw_tokens=raw.get("raw_tokens"),
                   replay=None if replay is None else bool(replay),
                   record=None if record is None else DeepStackRecord.from_json(record), dtype=raw.get("dtype"),
                   mode=raw.get("mode"), requests=tuple(str(r) for r in raw.get("requests", ())),
                   stale_rows=int(raw.get("stale_rows", 0)), stale_source=raw.get("stale_source"),
                   uncleared=int(raw.get("uncleared", 0)))


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

    def captured_buckets(self) -> frozenset[int] | None:
        """Every prefill bucket the server's graph runners recorded capturing so far (None: none
        recorded one): read once a server is ready, these are the graphs it captured at start-up."""
        path = self.folder / CAPTURES_FILE
        if not path.exists():
            return None
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return frozenset(int(b) for line in lines for b in line.get("buckets", ()))

    def freshness(self, tag: str) -> list[tuple[tuple[int, str], tuple["InputFreshness", ...]]]:
        """Per graph replay of the request `tag`, in order: the model process that ran it (pid,
        title) and the freshness witness's records of its inputs."""
        from parity.evidence import InputFreshness

        path = self.folder / FRESHNESS_FILE
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        return [((int(line["pid"]), str(line["role"])), tuple(InputFreshness.from_json(r) for r in line["records"]))
                for line in lines if line.get("tag") == tag]

    def entries(self, tag: str) -> list[TapEntry]:
        """The entries of `tag`, in the order the hook saw them."""
        if not self.records_path.exists():
            return []
        lines = self.records_path.read_text().splitlines()
        return [e for e in (TapEntry.from_json(json.loads(line)) for line in lines if line.strip()) if e.tag == tag]

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

    def record_capture(self, buckets) -> None:
        """A graph runner captured these buckets (the server's side of `captured_buckets`)."""
        with open(self.folder / CAPTURES_FILE, "a", encoding="utf-8") as out:
            out.write(json.dumps({"pid": os.getpid(), "role": process_role(),
                                  "buckets": sorted(int(b) for b in buckets)}) + "\n")

    def append_freshness(self, tag: str, pid: int, role: str, records: tuple["InputFreshness", ...]) -> None:
        """The freshness witness's records of one graph replay for the request `tag`."""
        with open(self.folder / FRESHNESS_FILE, "a", encoding="utf-8") as out:
            out.write(json.dumps({"tag": tag, "pid": pid, "role": role,
                                  "records": [r.to_json() for r in records]}) + "\n")

    def append(self, entry: TapEntry) -> None:
        # One short O_APPEND write per line: concurrent writers (TP ranks) do not interleave.
        with open(self.records_path, "a", encoding="utf-8") as out:
            out.write(json.dumps(entry.to_json()) + "\n")


def process_role() -> str:
    """This process's title (SGLang names the process that runs the model "sglang::scheduler...", vLLM
    "VLLM::EngineCore" or "VLLM::Worker...")."""
    try:
        import setproctitle  # a dependency of both engines

        return str(setproctitle.getproctitle())
    except ImportError:
        return multiprocessing.current_process().name
