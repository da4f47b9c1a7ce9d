"""Shards of a run (design §8): which cases `parity run --shard K/N` runs, and what its results
file records so `parity merge` can put the shards back together.

The partition is a pure function of the planned cases' ids, their expected costs and their
order, so every machine of a CI matrix computes the same one without talking to the others.

**How cases are assigned.** Cases are taken in *case-list order* — each fixture × prompt of the
run in the order the user gave them, and within one, its scenarios most expensive first — and each
goes to the shard with the least expected cost so far (the lowest index on a tie). This is greedy
list scheduling: a case's shard depends only on the cases before it, so **appending cases to the
case list (another fixture or image given last) never moves a case that was already
assigned**, and a re-run of one old shard still runs the same cases. A hash of the case id would be
stable under any insertion, but with the few cases of a typical run (tens) it leaves shards empty
or twice as heavy; sorting all cases by cost first (LPT) balances a little better but reshuffles
every shard when one case is added. With `--scenario all`, the heaviest of three shards carries
1.07× the mean over the seven built-in fixtures, 1.10× over three, 1.12× over two (four-arm
only, cases of equal cost: within one case of the mean).

**Expected cost** is the number of generations a case asks for (its arms over its requests, in
every mode: 4 for a four-arm case, 5 for `reuse`, 11 for `stream`), which is what a run spends
its time on; prompt length varies far less between the built-in fixtures than that.

The results file of a shard keeps the whole plan in `config.shard`, so each file knows the
experiment it belongs to and the merge can tell missing and duplicate shards apart:

    "shard": {"index": 2, "count": 3, "cases": {"<case id>": <its shard>, ...}}   (a shard)
    "shard": {"count": 3, "cases": {...}, "merged": [1, 3], "missing": [2]}      (a merge)

`cases` lists every planned case in plan order with the shard that runs it. Torch-free.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from parity.arms import arm
from parity.errors import UsageError
from parity.plan.entries import PlanEntry
from parity.results import FOUR_ARM, SEQUENCE_REQUESTS, RunResult

CONFIG_KEY = "shard"
_SPEC = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclass(frozen=True)
class Shard:
    """`--shard K/N`: the K-th (1-based) of N shards."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Shard":
        match = _SPEC.fullmatch(text)
        if not match:
            raise UsageError(f"--shard {text}: expected K/N, e.g. 2/3 (the second of three shards)")
        index, count = int(match[1]), int(match[2])
        if count < 1 or not 1 <= index <= count:
            raise UsageError(f"--shard {text}: K must be between 1 and N, and N at least 1")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def case_cost(scenario: str, arms: Sequence[str]) -> int:
    """The generations a case asks for (sharding's expected cost): its arms over its requests, in
    every mode, and a sequence's eager power arm."""
    if scenario == FOUR_ARM:
        return len(arms)
    modes = {arm(a).mode for a in arms}
    return len(SEQUENCE_REQUESTS[scenario]) * len(modes) + ("eager" in modes)


def partition(costs: Sequence[tuple[str, int]], count: int) -> dict[str, int]:
    """Case id -> its shard (1-based), for cases given in case-list order with their costs: each goes
    to the shard with the least expected cost so far (the lowest index on a tie)."""
    # A heap of (load, shard): the lightest shard in O(log N), so a plan of many cases over many
    # shards is assigned in O(cases log N), not O(cases x N) (a file's plan is checked on every load).
    loads = [(0, k) for k in range(count)]
    assigned = {}
    for case_id, cost in costs:
        load, lightest = loads[0]
        heapq.heapreplace(loads, (load + max(cost, 1), lightest))
        assigned[case_id] = lightest + 1
    return assigned


def assignment(entries: Sequence[PlanEntry], arms: Sequence[str], count: int) -> dict[str, int]:
    """Case id -> shard, in plan order. Cases are taken in case-list order (each base case, its
    scenarios most expensive first), so appending cases never moves one already assigned."""
    scenarios = list(dict.fromkeys(e.scenario for e in entries))
    per_scenario = len(entries) // max(len(scenarios), 1)
    costs = [case_cost(e.scenario, arms) for e in entries]
    order = sorted(range(len(entries)), key=lambda i: (i % per_scenario, -costs[i], i // per_scenario))
    shards = partition([(entries[i].id, costs[i]) for i in order], count)
    return {e.id: shards[e.id] for e in entries}


def check_not_empty(shard: Shard, cases: int) -> None:
    """Every shard gets a case when there are at least N of them (greedy fills empty shards first)."""
    if cases < shard.count:
        raise UsageError(f"--shard {shard}: the run plans only {cases} case(s), so shard(s) past {cases} of "
                         f"{shard.count} would run nothing; use at most {cases} shards")


def shard_config(shard: Shard, assignment: Mapping[str, int]) -> dict:
    """`config.shard` of a shard's results file; `assignment` in plan order."""
    return {"index": shard.index, "count": shard.count, "cases": dict(assignment)}


# --- reading it back ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardRecord:
    """What a results file says about its place in a sharded run."""

    count: int
    cases: Mapping[str, int]  # every planned case, in plan order -> its shard
    index: int | None = None  # a shard's own file: which shard it is
    merged: tuple[int, ...] = ()  # a merged file: the shards it holds
    missing: tuple[int, ...] = ()  # a merged file: the shards it was told to go without

    @property
    def covers(self) -> tuple[int, ...]:
        """The shards whose cases this file holds."""
        return (self.index,) if self.index is not None else self.merged

    def cases_of(self, shards: Sequence[int]) -> list[str]:
        return [case_id for case_id, k in self.cases.items() if k in shards]


def merged_config(count: int, cases: Mapping[str, int], merged: Sequence[int], missing: Sequence[int]) -> dict:
    """`config.shard` of a merged results file."""
    return {"count": count, "cases": dict(cases), "merged": sorted(merged), "missing": sorted(missing)}


def read_shard(config: Mapping[str, Any]) -> ShardRecord | None:
    """`config.shard` parsed; None when the run was not sharded. ValueError names what is wrong."""
    raw = config.get(CONFIG_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("must be an object")
    count = _int(raw, "count", 1)
    cases = raw.get("cases")
    if not isinstance(cases, dict) or not cases:
        raise ValueError("cases must be a non-empty object of case id -> shard")
    for case_id, k in cases.items():
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= count:
            raise ValueError(f"cases.{case_id} must be a shard between 1 and {count}, got {k!r}")
    if "index" in raw:
        if "merged" in raw or "missing" in raw:
            raise ValueError("a shard's file has an index, a merged file has merged/missing, not both")
        index = _int(raw, "index", 1)
        if index > count:
            raise ValueError(f"index {index} is larger than count {count}")
        return ShardRecord(count, dict(cases), index=index)
    merged, missing = _shards(raw, "merged", count), _shards(raw, "missing", count)
    if not merged:
        raise ValueError("needs an index (a shard) or a non-empty merged list (a merge)")
    if set(merged) & set(missing) or set(merged) | set(missing) != set(range(1, count + 1)):
        raise ValueError(f"merged {merged} and missing {missing} must split the shards 1..{count} between them")
    return ShardRecord(count, dict(cases), merged=merged, missing=missing)


def _int(raw: Mapping[str, Any], key: str, minimum: int) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _shards(raw: Mapping[str, Any], key: str, count: int) -> tuple[int, ...]:
    values = raw.get(key, [])
    if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= count
                                           for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{key} must be a list of distinct shards between 1 and {count}")
    return tuple(sorted(values))


def unmerged_note(config: Mapping[str, Any]) -> str | None:
    """Why a merged run cannot pass: the shards it was merged without, or None."""
    try:
        record = read_shard(config)
    except ValueError:
        return None  # the loader refuses such a file; a run built in memory is well-formed
    if record is None or not record.missing:
        return None
    cases = len(record.cases_of(record.missing))
    shards = ", ".join(map(str, record.missing))
    return (f"shard(s) {shards} of {record.count} not merged, so {cases} planned case(s) were never judged "
            f"(merged with --allow-missing)")


def describe(run: RunResult) -> str | None:
    """One line for a report's header: which part of a sharded run the report covers."""
    config, judged_cases = run.config, sum(not c.absent for c in run.cases)
    try:
        record = read_shard(config)
    except ValueError:
        return None
    if record is None:
        return None
    planned = len(record.cases)
    if record.index is not None:
        return f"Shard {record.index} of {record.count}: {judged_cases} of the run's {planned} planned cases"
    text = f"Merged from shard(s) {', '.join(map(str, record.covers))} of {record.count}"
    if record.missing:
        text += f"; shard(s) {', '.join(map(str, record.missing))} missing on purpose (--allow-missing)"
    return f"{text}: {judged_cases} of {planned} planned cases"
