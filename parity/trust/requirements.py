"""What every run writes, required of every file that says it is one (design §4b).

`results_consistency` refuses files that contradict themselves; these rules refuse files that lack
what `parity run` always records, or relabel it: an edit that deletes a power arm's teacher-forced
score, an arm's repeats or a tensor-parallel rank, or that raises an "auto" tolerance, changes what
the verdict can see without contradicting anything else. `check_all` runs both sets, in the loader
on every file and in `parity run` on the run itself (which fails the arm a rule names, so that
`parity run` and `parity verdict` of its file always agree). Torch-free.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

from parity import registry
from parity.judge.metrics import auto_tolerances
from parity.judge.verdict import groups
from parity.evidence import CHECKED_TENSORS
from parity.results import SCHEMA, FixtureInfo, RunResult
from parity.plan.entries import read_plan
from parity.plan.sharding import read_shard
from parity.trust.consistency import RULES, Contradiction, _ran, _requests
from parity.trust.path_proofs import RULES as PATH_RULES
from parity.trust.serving import RULES as SERVING_RULES, _runs


def repeats_as_configured(run: RunResult) -> None:
    """`--repeat N` gives every arm that ran N - 1 repeats; fewer only in a run that was stopped."""
    repeat = run.config.get("repeat")
    if not isinstance(repeat, int):
        return
    for request in _requests(run):
        for arm in _ran(request):
            held = len(arm.repeats)
            if held > repeat - 1 or (held < repeat - 1 and not run.interrupted):
                raise request.contradiction(
                    arm, f"{request.at(arm)}.repeats holds {held} repeat(s), but config.repeat {repeat} gives every "
                         f"arm that ran {repeat - 1}")


def ranks_as_configured(run: RunResult) -> None:
    """A tensor-parallel server's arm keeps one evidence record per rank (design §8), every run of it.
    The SGLang backend records `tp_size` (a vLLM server's ranks are not counted yet: not checked)."""
    if "tp_size" not in run.config:
        backend = registry.of_run(run.config)
        if run.schema == SCHEMA and backend.records_ranks:
            raise Contradiction(f"config.tp_size is missing: a {backend.name} run records its tensor-parallel size")
        return
    tp_size = run.config["tp_size"]
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise Contradiction(f"config.tp_size must be an integer >= 1, got {tp_size!r}")
    for request in _requests(run):
        for arm in _ran(request):
            for where, evidence in _runs(arm):
                labels = {r.rank for r in evidence.ranks}
                expected = tp_size if tp_size > 1 else 0
                if len(evidence.ranks) != expected or len(labels) != len(evidence.ranks):
                    raise request.contradiction(
                        arm, f"{request.at(arm)}.{where}.ranks holds {len(labels)} distinct rank(s), but "
                             f"config.tp_size {tp_size} runs every request on {tp_size} rank(s), each recorded "
                             f"apart{' (none recorded for one rank)' if tp_size == 1 else ''}")


def auto_tolerances_are_the_dtypes(run: RunResult) -> None:
    """`logprob_tol_source: auto` means the dtype's measured bounds, not a number raised by hand;
    `tie_margin_source: auto` the dtype's near-tie margin."""
    config = run.config
    auto = auto_tolerances(str(config.get("dtype")))
    sources = (("logprob_tol_source", (("logprob_tol", auto.logprob_tol), ("logprob_mean_tol", auto.mean_tol))),
               ("tie_margin_source", (("tie_margin", auto.tie_margin),)))
    for source, fields in sources:
        if config.get(source) != "auto":
            if run.schema == SCHEMA and config.get(source) != "user":
                raise Contradiction(f"config.{source} must be 'auto' or 'user', got {config.get(source)!r}")
            continue
        for key, value in fields:
            if config.get(key) != value:
                raise Contradiction(f"config.{key} is {config.get(key)!r}, but config.{source} 'auto' gives "
                                    f"{value!r} for dtype {config.get('dtype')!r}")


@functools.lru_cache(maxsize=1)
def _builtin_pixels() -> dict[str, tuple[str, tuple[int, int], int]]:
    from parity.media.catalog import builtin_fixture, builtin_names

    return {name: (f.sha256, f.size, len(f.frames))
            for name in builtin_names(twins=True, videos=True) for f in (builtin_fixture(name),)}


def builtin_fixtures_are_theirs(run: RunResult) -> None:
    """A fixture named like a built-in one has its pixels (a user image never takes such a name)."""
    for ci, case in enumerate(run.cases):
        fixtures = [(f"cases[{ci}].fixture", case.fixture)] + [
            (f"cases[{ci}].requests[{ri}].fixture", r.fixture) for ri, r in enumerate(case.requests)]
        for where, fixture in fixtures:
            _check_builtin(where, fixture)


def _check_builtin(where: str, fixture: FixtureInfo | None) -> None:
    if fixture is None:
        return
    known = _builtin_pixels().get(fixture.name)
    if known is not None and known != (fixture.sha256, fixture.size, fixture.frames):
        raise Contradiction(f"{where} is named {fixture.name!r}, the built-in fixture, but its sha256 "
                            f"{fixture.sha256[:12]}… (size {list(fixture.size)}, {fixture.frames} frames) is not "
                            f"that fixture's ({known[0][:12]}…, size {list(known[1])}, {known[2]} frames)")


def records_in_the_runs_dtype(run: RunResult) -> None:
    """The tap records the DeepStack rows the model computed, in the dtype it ran in."""
    dtype = run.config.get("dtype")
    if dtype is None:
        return
    for request in _requests(run):
        for arm in _ran(request):
            record = arm.deepstack_record
            if record is not None and record.dtype != dtype:
                raise request.contradiction(
                    arm, f"{request.at(arm)}.deepstack_record.dtype is {record.dtype!r}, but config.dtype is "
                         f"{dtype!r}: the model computed DeepStack in another dtype than the file says")


def arms_are_the_configured(run: RunResult) -> None:
    """Every arm in the file is one `config.arms` selected (v5): an eager-only run with graph arms
    spliced in would otherwise be judged as if the graph had run."""
    selected = run.config.get("arms")
    if run.schema != SCHEMA or not isinstance(selected, list):
        return
    for request in _requests(run):
        for arm in request.arms:
            if arm.name not in selected:
                raise request.contradiction(arm, f"{request.at(arm)} is not one of the arms the run selected "
                                                 f"(config.arms {selected})")


def plan_prompts_are_the_evidence(run: RunResult) -> None:
    """A case's planned prompt length (`config.plan[].prompt_tokens`, what buckets are captured for)
    is its longest request's, as its arms recorded it: where parity counts the prompt it prefilled
    itself (the in-process backend), no arm's prompt is longer and, once every request has run, one
    is as long; a server's serving evidence is never longer than planned."""
    if run.schema != SCHEMA:
        return
    try:
        planned = {entry.id: entry.prompt_tokens for entry in read_plan(run.config)}
    except ValueError:
        return  # the loader has refused the plan already
    exact = registry.of_run(run.config).in_process
    seen: dict[int, list[int]] = {}
    for request in _requests(run):
        tokens = planned.get(request.case.id)
        if tokens is None:
            continue
        for arm in _ran(request):
            evidence = arm.evidence
            own = None if evidence is None else (
                evidence.prompt_tokens if exact else evidence.serving and evidence.serving.prompt_tokens)
            if own is None:
                continue
            if own > tokens:
                raise request.contradiction(arm, f"{request.at(arm)}.evidence has a {own}-token prompt, longer than the "
                                                 f"{tokens} tokens config.plan plans for {request.case.id}")
            seen.setdefault(request.case_index, []).append(own)
    for ci, prompts in seen.items():
        case, tokens = run.cases[ci], planned[run.cases[ci].id]
        ran_whole = all(request.arms for request in case.requests) and not any(a.failed for a in case.all_arms())
        if exact and ran_whole and not run.interrupted and max(prompts) != tokens:
            raise Contradiction(f"config.plan plans {tokens} prompt tokens for {case.id}, but its longest request "
                                f"recorded {max(prompts)}")


def replays_checked_in_process(run: RunResult) -> None:
    """An in-process run checks every graph replay against eager on its own padded shape (design
    §6): each run of an arm that replayed (its prefill, or a vision-encoder graph) records the check
    (an eager arm that replayed, a runner bug, too), one that did not records none, and a server's arm records none (a server replays its
    own shapes, which no eager pass of parity's reproduces)."""
    if run.schema != SCHEMA:
        return
    backend = registry.of_run(run.config)
    in_process = backend.in_process
    for request in _requests(run):
        for arm in _ran(request):
            for where, evidence in _runs(arm):
                encoder = evidence.serving is not None and evidence.serving.encoder is not None
                checked, replayed = evidence.replay_check is not None, evidence.replayed_calls > 0 or encoder
                if checked and not (in_process and replayed):
                    raise request.contradiction(
                        arm, f"{request.at(arm)}.{where}.replay_check is recorded, but only an in-process arm that "
                             "replayed checks its replays against eager")
                if not checked and in_process and replayed:
                    raise request.contradiction(
                        arm, f"{request.at(arm)}.{where} replayed a graph but records no replay_check: an in-process run "
                             "checks every replay against eager on its own shape")
                if checked:
                    problem = _check_shape_problem(evidence.replay_check, evidence.prefill_replayed is True, encoder)
                    if problem:
                        raise request.contradiction(arm, f"{request.at(arm)}.{where}.replay_check {problem}")
                problem = _freshness_shape_problem(evidence, in_process, backend.witnesses_inputs,
                                                   run.config.get("poison") is True)
                if problem:
                    raise request.contradiction(arm, f"{request.at(arm)}.{where}.freshness {problem}")


PREFILL_TENSORS = tuple(t for t in CHECKED_TENSORS if t != "encoder")


def _check_shape_problem(check, prefill: bool, encoder: bool) -> str | None:
    """What a replay check must hold, by what replayed (trust v7; its departure and its per-graph
    bounds are held to it by `ReplayCheck.inconsistency`): the four prefill tensors exactly when a
    prefill replayed, `encoder` exactly when a vision-encoder graph ran, and each graph's bounds."""
    held = tuple(t.tensor for t in check.tensors)
    expected = (PREFILL_TENSORS if prefill else ()) + (("encoder",) if encoder else ())
    if held == expected:
        bounded = {b.tensor for b in check.bounds}
        if bounded != set(held):
            return (f"records bounds per graph for {', '.join(sorted(bounded)) or 'no tensor'}, but holds "
                    f"{', '.join(held)}: each checked tensor's bound is measured once per graph in every run")
        return None
    return (f"holds {', '.join(held) or 'no tensor'}, but its replays had {', '.join(expected) or 'none'} "
            f"(a prefill {'replayed' if prefill else 'did not replay'}, an encoder graph "
            f"{'ran' if encoder else 'did not run'})")


def one_bound_per_graph(run: RunResult) -> None:
    """A graph's bound is measured once in a run, on its first replay, and every arm that replays it
    is held to that one (design §6, trust v7): a file that gives the same graph another bound for one
    arm claimed it. Per shard: each shard's run measured its own."""
    if run.schema != SCHEMA:
        return
    try:
        shards = read_shard(run.config)
    except ValueError:
        return  # the plan check refuses the file
    seen: dict[tuple[int, str, str], tuple[float, str]] = {}
    for request in _requests(run):
        shard = 0 if shards is None else shards.cases.get(request.case.id, 0)
        for arm in _ran(request):
            for where, evidence in _runs(arm):
                for bound in () if evidence.replay_check is None else evidence.replay_check.bounds:
                    here = f"{request.at(arm)}.{where}.replay_check.bounds[{bound.graph!r}].{bound.tensor}"
                    first = seen.setdefault((shard, bound.graph, bound.tensor), (bound.bound, here))
                    if first[0] != bound.bound:
                        raise request.contradiction(
                            arm, f"{here} is {bound.bound:g}, but {first[1]} is {first[0]:g}: a graph's bound is "
                                 "measured once per run, the same for every arm that replays it")


# What every captured prefill body reads from outside the graph, whatever the model (design §6); a
# server's body reads its embeddings, and its positions by the engine's name for them.
ALWAYS_READ = ("input_embeds", "positions")
SERVER_ALWAYS_READ = ("input_embeds",)
GRAPH_NAME = re.compile(r"(prefill|context) (?P<size>\d{1,7})")
# In-process vision-encoder graphs, by their key (the layout scenario): each reads its pixel slot.
ENCODER_GRAPH_NAME = re.compile(r"encoder (grid \d{1,5}x\d{1,5}x\d{1,5}|\d{1,9} patches)")
ENCODER_READS = "pixel_values"
# A server names its graphs by step kind, token count and, where it has one, its variant or mode:
# SGLang's "prefill 48 (chunked_prefix:1)", vLLM's "prefill 48 (full)" and "decode 1 (full)".
SERVER_GRAPH_NAME = re.compile(r"(?P<kind>prefill|decode) (?P<size>\d{1,7})( \([\w:.-]{1,64}\))?")


def _freshness_shape_problem(evidence, in_process: bool, server_witness: bool, poison: bool) -> str | None:
    """What the freshness witness must hold, by what replayed (design §6): in-process, every graph
    whose bucket a prefill replayed in, each with the inputs every body reads, each input of a graph
    over the same replays; nothing for a graph that did not replay. With --poison, every input every
    body reads says how many rows kept the sentinel; without, none. A server whose replays parity
    watches (SGLang, vLLM) records what its witness saw, where it saw it: the same rules, its graphs
    named by step kind and its own buckets (and variants or modes), each holding its embeddings; the
    engine names its positions; its decode graphs are no prefill bucket."""
    records = evidence.freshness
    encoder = evidence.serving is not None and evidence.serving.encoder is not None
    if not (in_process or server_witness) or (evidence.replayed_calls == 0 and not (in_process and encoder)):
        return "is recorded, but only an arm whose replays parity watched has one" if records else None
    if in_process:
        problem = _encoder_records_problem(records, encoder)
        if problem:
            return problem
        records = tuple(r for r in records if not ENCODER_GRAPH_NAME.fullmatch(r.graph))
    if not in_process and not records:
        return None  # a server's witness that saw no replay (or was not installed): the answers judge
    counted = [r for r in records if r.poisoned is not None]
    if not poison and counted:
        return f"counts poisoned rows of {counted[0].input}, but the run did not poison its slots"
    always = ALWAYS_READ if in_process else SERVER_ALWAYS_READ
    if poison and any(r.poisoned is None for r in records if r.input in always):
        return f"lacks the poisoned rows of {', '.join(always)}, which a run with --poison counts"
    graphs: dict[str, dict[str, int]] = {}
    for record in records:
        graphs.setdefault(record.graph, {})[record.input] = record.replays
    buckets = set()
    for graph in graphs:
        match = GRAPH_NAME.fullmatch(graph) if in_process else SERVER_GRAPH_NAME.fullmatch(graph)
        if match is None:
            return f"names graph {graph!r}, not {'prefill N or context N' if in_process else 'prefill|decode N (variant)'}"
        if in_process or match["kind"] == "prefill":  # the arm's buckets are its prefills'
            buckets.add(int(match["size"]))
    for graph, inputs in graphs.items():
        missing = [name for name in always if name not in inputs]
        if missing:
            return f"lists the {graph} graph without {', '.join(missing)}, which every prefill graph reads"
        if len(set(inputs.values())) > 1:
            return f"counts other replays of the {graph} graph for some of its inputs than for others"
    if buckets != set(evidence.buckets):
        return (f"covers the graphs of buckets {sorted(buckets) or 'none'}, but the arm replayed in "
                f"{list(evidence.buckets)}")
    return None


def _encoder_records_problem(records, encoder: bool) -> str | None:
    """In-process, an arm whose image went through the encoder graphs lists the one it replayed, with
    its pixel slot; no other arm lists one."""
    graphs = {r.graph for r in records if ENCODER_GRAPH_NAME.fullmatch(r.graph)}
    if encoder != bool(graphs):
        return ("lists no vision-encoder graph, but the arm's image went through one" if encoder
                else f"lists {sorted(graphs)[0]!r}, but the arm's image went through no encoder graph")
    if len(graphs) > 1:
        return f"lists {len(graphs)} vision-encoder graphs for one image"
    if graphs and ENCODER_READS not in {r.input for r in records if r.graph in graphs}:
        return f"lists the {next(iter(graphs))} graph without {ENCODER_READS}, which every encoder graph reads"
    return None


def interrupted_runs_lack_something(run: RunResult) -> None:
    """`interrupted` relaxes the rules for what a stop cut short (fewer repeats, absent cases), so a
    file that says so lacks something a whole run has (v6): a planned case, an arm, or a repeat."""
    if run.schema != SCHEMA or not run.interrupted:
        return
    try:
        planned = [entry.id for entry in read_plan(run.config)]
    except ValueError:
        return  # the loader has refused the plan already
    held = {case.id for case in run.cases}
    repeat = run.config.get("repeat") if isinstance(run.config.get("repeat"), int) else 1
    short = any(len(arm.repeats) < repeat - 1 for case in run.cases for arm in case.all_arms() if not arm.failed)
    missing_arm = any(name not in group.arms for case in run.cases for group in groups(case) for name in group.needed)
    if not (set(planned) - held or short or missing_arm):
        raise Contradiction("interrupted is true, but every planned case, arm and repeat is in the file: a run a stop "
                            "cut short lacks one of them")


def engine_release_named(run: RunResult) -> None:
    """A server run whose servers answered names the engine release it judged (v6): the version its
    servers reported, or the installed package's."""
    backend = registry.of_run(run.config)
    if run.schema != SCHEMA or not backend.names_its_version:
        return
    ran = any(not arm.failed for case in run.cases for arm in case.all_arms())
    version = run.environment.get(backend.package)
    if ran and (not isinstance(version, str) or not version.strip()):
        raise Contradiction(f"environment.{backend.package} is {version!r}, but a {backend.name} run whose servers "
                            "answered names the release it judged")


REQUIREMENTS: tuple[Callable[[RunResult], None], ...] = (
    repeats_as_configured, ranks_as_configured, auto_tolerances_are_the_dtypes, builtin_fixtures_are_theirs,
    records_in_the_runs_dtype, arms_are_the_configured, plan_prompts_are_the_evidence, replays_checked_in_process,
    one_bound_per_graph,
    engine_release_named, interrupted_runs_lack_something,
)


def check_all(run: RunResult) -> None:
    """Raise `Contradiction` for the first consistency rule or requirement the run breaks."""
    for rule in (*RULES, *SERVING_RULES, *PATH_RULES, *REQUIREMENTS):
        rule(run)
