"""A results file held to its own plan (design §4b): the cases it holds are the planned cases of
the shards it covers, unaltered, and its shard fields are what the plan's partition gives.

Extra or altered cases, or shard fields the partition contradicts, are edits (`Invalid`, exit 2);
a planned case the file lacks is reported back so the loader can judge it INCOMPLETE by name.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from parity.plan.entries import PlanEntry, read_plan, text_sha256
from parity.results import CaseResult
from parity.trust.fields import Invalid
from parity.plan.sharding import ShardRecord, assignment, read_shard


def planned_but_absent(config: Mapping[str, Any], cases: Sequence[CaseResult]) -> tuple[PlanEntry, ...]:
    """The planned cases of the file's shards that it does not hold, in plan order; `Invalid` when it
    holds a case the plan does not give it, or gives otherwise."""
    try:
        plan = read_plan(config)
    except ValueError as err:
        raise Invalid(f"config.plan {err}") from None
    record = _shard_record(config, plan)
    covered = {e.id for e in plan if record is None or record.cases[e.id] in record.covers}
    by_id = {e.id: e for e in plan}
    for ci, case in enumerate(cases):
        entry = by_id.get(case.id)
        if entry is None:
            raise Invalid(f"cases[{ci}] ({case.id}) is not a case of config.plan: a case the run never planned")
        if case.id not in covered:
            raise Invalid(f"cases[{ci}] ({case.id}) belongs to shard {record.cases[case.id]} of {record.count}, "
                          f"which this file does not cover")
        _check_case(ci, case, entry)
    present = {c.id for c in cases}
    return tuple(e for e in plan if e.id in covered and e.id not in present)


def _shard_record(config: Mapping[str, Any], plan: Sequence[PlanEntry]) -> ShardRecord | None:
    try:
        record = read_shard(config)
    except ValueError as err:
        raise Invalid(f"config.shard: {err}") from None
    if record is None:
        return None
    if record.count > len(plan):
        raise Invalid(f"config.shard.count is {record.count}, more shards than the plan's {len(plan)} case(s)")
    expected = assignment(plan, config["arms"], record.count)
    if list(record.cases) != list(expected):
        raise Invalid("config.shard.cases does not list config.plan's cases in plan order")
    wrong = next((c for c in expected if record.cases[c] != expected[c]), None)
    if wrong is not None:
        raise Invalid(f"config.shard.cases puts {wrong!r} in shard {record.cases[wrong]}, but --shard "
                      f"K/{record.count} of config.plan runs it in shard {expected[wrong]}")
    return record


def _check_case(ci: int, case: CaseResult, entry: PlanEntry) -> None:
    where = f"cases[{ci}] ({case.id})"
    if case.scenario != entry.scenario:
        raise Invalid(f"{where} is a {case.scenario} case, but config.plan plans it as {entry.scenario}")
    image = None if case.fixture is None else case.fixture.sha256
    if image != entry.image:
        raise Invalid(f"{where} has image sha256 {_short(image)}, but config.plan planned {_short(entry.image)}: "
                      "another image under the same case id")
    if text_sha256(case.prompt) != entry.prompt:
        raise Invalid(f"{where} has another prompt than config.plan planned (its sha256 differs): another "
                      "prompt under the same case id")


def _short(sha: str | None) -> str:
    return "none (no image)" if sha is None else f"{sha[:12]}…"
