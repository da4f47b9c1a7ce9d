"""The plan of a run (design §4b): every case it set out to judge, recorded in every results file.

A results file says which cases it holds; without the plan it cannot say which it lacks. An
interrupted run with its unfinished cases deleted, a merge that dropped a shard from its own
record, shards run with other prompts or other image pixels under the same case ids: each reads as
a complete, passing run unless the file also records what was planned. So every run writes
`config.plan`, sharded or not, one entry per planned case in plan order:

    {"id": "<case id>", "scenario": "four-arm", "image": "<sha256 of the RGB pixels>" | null,
     "prompt": "<sha256 of the prompt text>", "prompt_tokens": <the case's longest request prompt>}

The plan has the shape every run gives it: the scenarios of `config.scenarios`, in that order, each
over the same base cases (fixture x prompt) in the same order. The shard partition is a pure
function of it (`sharding.assignment`), so the loader recomputes what `--shard K/N` ran instead of trusting
the file. Torch-free.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from parity.arms import arm
from parity.results import FOUR_ARM, SCENARIOS

PLAN_KEY = "plan"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a sha256 as parity writes it


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def scenario_case_id(scenario: str, base_id: str) -> str:
    """A case's id: its fixture/prompt, prefixed by the scenario for the sequence scenarios."""
    return base_id if scenario == FOUR_ARM else f"{scenario}/{base_id}"


@dataclass(frozen=True)
class PlanEntry:
    id: str
    scenario: str
    image: str | None  # sha256 of the case image's raw RGB pixels; None: no image
    prompt: str  # sha256 of the case's prompt text
    prompt_tokens: int  # the longest prompt among the case's requests, image tokens included

    def to_json(self) -> dict:
        return {"id": self.id, "scenario": self.scenario, "image": self.image, "prompt": self.prompt,
                "prompt_tokens": self.prompt_tokens}


def plan_json(entries: Sequence[PlanEntry]) -> list[dict]:
    return [e.to_json() for e in entries]


# --- reading it back -------------------------------------------------------------------------------

# The last plan read, by the very objects it was read from: the loader's rules ask for one file's plan
# several times, and a sweep's plan has tens of thousands of cases.
_LAST_READ: list = [None, None]


def read_plan(config: Mapping[str, Any]) -> tuple[PlanEntry, ...]:
    """`config.plan` parsed and held to the shape every run gives it; ValueError names what is wrong."""
    source = (config.get(PLAN_KEY), config.get("scenarios"), config.get("arms"))
    if _LAST_READ[0] is not None and all(a is b for a, b in zip(_LAST_READ[0], source)):
        return _LAST_READ[1]
    entries = _read_plan(config)
    _LAST_READ[:] = [source, entries]
    return entries


def _read_plan(config: Mapping[str, Any]) -> tuple[PlanEntry, ...]:
    raw = config.get(PLAN_KEY)
    if raw is None:
        raise ValueError("is missing: every run records its plan since parity's v4 results (a file written "
                         "before cannot show which cases it lacks; run it again)")
    if not isinstance(raw, list) or not raw:
        raise ValueError("must be a non-empty list of the run's planned cases")
    entries = tuple(_entry(item, i) for i, item in enumerate(raw))
    seen: set[str] = set()
    for entry in entries:
        if entry.id in seen:
            raise ValueError(f"plans case {entry.id!r} twice")
        seen.add(entry.id)
    _check_shape(entries, config.get("scenarios"))
    arms = config.get("arms")
    if not isinstance(arms, list) or not arms or any(not isinstance(a, str) for a in arms):
        raise ValueError("needs config.arms, the arms the run selected (its cases' costs)")
    for name in arms:
        try:
            arm(name)
        except KeyError:
            raise ValueError(f"config.arms names unknown arm {name!r}") from None
    return entries


def _entry(item: Any, i: int) -> PlanEntry:
    where = f"[{i}]"
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object")
    extra = set(item) - {"id", "scenario", "image", "prompt", "prompt_tokens"}
    if extra:
        raise ValueError(f"{where} has unknown key {sorted(extra)[0]!r}")
    case_id, scenario, image, prompt, tokens = (item.get(k) for k in ("id", "scenario", "image", "prompt",
                                                                      "prompt_tokens"))
    if not isinstance(case_id, str) or not case_id.strip():
        raise ValueError(f"{where}.id must be a non-empty case id")
    if scenario not in SCENARIOS:
        raise ValueError(f"{where}.scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    if image is not None and not (isinstance(image, str) and SHA256_HEX.fullmatch(image)):
        raise ValueError(f"{where}.image must be null or a sha256 (64 lowercase hex digits)")
    if not (isinstance(prompt, str) and SHA256_HEX.fullmatch(prompt)):
        raise ValueError(f"{where}.prompt must be the sha256 of the prompt text (64 lowercase hex digits)")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"{where}.prompt_tokens must be an integer >= 1, got {tokens!r}")
    return PlanEntry(case_id, scenario, image, prompt, tokens)


def _check_shape(entries: Sequence[PlanEntry], scenarios: Any) -> None:
    """Scenario-major over the same base cases: `parity run` plans no other shape, so a plan that
    lost some of its cases (a dropped shard, an unfinished case deleted) shows the hole."""
    if not isinstance(scenarios, list) or not scenarios or any(s not in SCENARIOS for s in scenarios):
        raise ValueError("needs config.scenarios, the scenarios the run planned")
    if len(entries) % len(scenarios):
        raise ValueError(f"has {len(entries)} cases, not the same number for each of the {len(scenarios)} "
                         "scenario(s) in config.scenarios: planned cases are missing")
    per = len(entries) // len(scenarios)
    prefix = "" if scenarios[0] == FOUR_ARM else f"{scenarios[0]}/"
    for i, entry in enumerate(entries):
        scenario, base = scenarios[i // per], entries[i % per]
        if not base.id.startswith(prefix) or base.id == prefix:
            raise ValueError(f"[{i % per}] is {base.id!r}, but a {scenarios[0]} case's id starts with {prefix!r}")
        expected_id = scenario_case_id(scenario, base.id[len(prefix):])
        if entry.scenario != scenario or entry.id != expected_id:
            raise ValueError(f"[{i}] is {entry.id!r} ({entry.scenario}), but a plan over config.scenarios "
                             f"{scenarios} holds {expected_id!r} ({scenario}) there: planned cases are missing "
                             "or out of order")
        if (entry.image, entry.prompt) != (base.image, base.prompt):
            raise ValueError(f"[{i}] ({entry.id}) has another image or prompt than [{i % per}] ({base.id}), "
                             "the same fixture and prompt in another scenario")
