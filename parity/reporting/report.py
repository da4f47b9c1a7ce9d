"""Rendering a `RunResult`: the PR-ready markdown report, the terminal table, and JSON."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

from parity import registry
from parity.engines.fix_records import stood_aside_note
from parity.evidence import Evidence, InputFreshness, ReplayCheck, ServingEvidence
from parity.run.localization import not_available, target_of
from parity.judge.metrics import format_delta, tuple_text
from parity.reporting.ci_summary import clip_text
from parity.reporting.text import encodable, md_code, md_text, visible
from parity.judge.identity import SOURCE_KEY, model_of
from parity.plan.sharding import describe as describe_shard
from parity.results import ArmResult, CaseResult, Comparison, RunResult, dumps, localization_to_json
from parity.judge.verdict import PASS, REPEAT_TOL, Check, Group, checks_for, self_delta

FORMATS = ("markdown", "json", "table")
_ARM_TEXT_LIMIT = 4000  # per arm in report.md; the whole report must fit a PR comment
REPORT_BUDGET = 60_000  # a PR comment holds 65,536 characters; the rest is room for a bot's own header
REPORT, FULL_REPORT = "report.md", "report-full.md"
_BACKTICKS = re.compile(r"`+")


def _ok(expect_match: bool, match: bool) -> bool:
    return expect_match == match


def _expectation(expect_match: bool) -> str:
    return "match" if expect_match else "differ"


def rows(case: CaseResult) -> list[tuple[Group, Check, Comparison | None]]:
    """(group, check, comparison or None) for every check of the case, in design order."""
    return [(g, c, case.comparison(c.a, c.b, g.request)) for g, c in checks_for(case)]


def check_label(group: Group, check: Check) -> str:
    prefix = "" if group.request is None else f"request {group.request + 1} ({group.label}): "
    return f"{prefix}{check.a} vs {check.b}"


def arms_with_labels(case: CaseResult) -> Iterator[tuple[str, ArmResult]]:
    """Every arm of the case, named as a reader finds it (`3. bcg_normal` in a sequence)."""
    for arm in case.arms:
        yield arm.name, arm
    for i, request in enumerate(case.requests, 1):
        for arm in request.arms:
            yield f"{i}. {arm.name}", arm


def evidence_text(evidence: Evidence | None, mode: str = "bcg", forced: int | None = None) -> str:
    """One line a reviewer reads to know whether the path under test really ran. Capitals only
    where something is wrong: a graph arm that did not replay, an eager arm that did. `forced`: the
    arm's teacher-forced scorings, each one more LM entry than its generation's."""
    if evidence is None:
        return "no execution evidence recorded"
    if mode == "eager":
        replayed = {True: "prefill replayed: YES, in an eager arm (not a reference)",
                    False: "eager (no replay expected)", None: "eager (replay unknown)"}[evidence.prefill_replayed]
    else:
        replayed = "prefill replayed: " + {True: "yes", False: "NO", None: "unknown"}[evidence.prefill_replayed]
    buckets = ", ".join(map(str, evidence.buckets)) or "—"
    tokens = "?" if evidence.prompt_tokens is None else evidence.prompt_tokens
    leak = evidence.leak
    stale = "" if leak is None else f" · LEAK WITNESS: {leak.rows} stale DeepStack row(s) read in {leak.steps} step(s)"
    # Tensor parallelism: each rank's own share, so a reader sees which rank fell short.
    shown = {True: "yes", False: "no", None: "unknown"}
    ranks = "".join(f" · {r.rank}: replayed {shown[r.prefill_replayed]}, tap calls {r.tap_calls}"
                    for r in evidence.ranks)
    serving = "" if evidence.serving is None else serving_text(evidence.serving)
    checked = "" if evidence.replay_check is None else replay_check_text(evidence.replay_check)
    checked += freshness_text(evidence.freshness)
    counted = "" if forced is None else f"generation steps and {forced} teacher-forced scoring(s); "
    return (f"{replayed} · {evidence.replayed_calls}/{evidence.lm_calls} LM entries replayed ({counted}"
            f"buckets {buckets}) · tap calls {evidence.tap_calls} · prompt {tokens} tokens{ranks}{stale}{serving}"
            f"{checked}")


def replay_check_text(check: ReplayCheck) -> str:
    """The graph path against eager on its own padded shape (design §6), and the padding's noise."""
    noise = "" if check.padding_noise is None else f", padding noise {check.padding_noise:.2g}"
    if check.departure is not None:
        return f" · REPLAY ≠ EAGER ON ITS OWN SHAPE: {check.departure.describe(check.replays)}{noise}"
    worst = max(check.tensors, key=lambda t: t.delta)
    return f" · replay = eager on its own shape (Δ {worst.delta:.2g} ≤ {worst.bound:.2g}{noise})"


def freshness_text(records: tuple[InputFreshness, ...]) -> str:
    """The freshness witness (design §6): how many inputs each replayed graph read, all fresh, or the
    first that was not."""
    if not records:
        return ""
    bad = next((r for r in records if not r.fresh), None)
    poisoned = any(r.poisoned is not None for r in records)
    if bad is None:
        graphs = sorted({r.graph for r in records})
        return (f" · every input fresh ({len(records)} input(s) of {', '.join(graphs)}"
                f"{'; no poison left' if poisoned else ''})")
    how = ", ".join(f"{n} {what}" for n, what in ((bad.stale, "stale"), (bad.unwritten, "never written"),
                                                   (bad.miswritten, "written wrong"), (bad.poisoned, "poisoned")) if n)
    first = f", first {list(bad.first)}" if bad.first else ""
    return f" · INPUT NOT FRESH: {bad.input} of the {bad.graph} graph, {how} row(s){first}"


def serving_text(serving: ServingEvidence) -> str:
    """The serving path a family scenario's request reached (design §10), in the words of its rule."""
    parts = []
    if serving.chunks:
        rows = "/".join(str(c.image_rows) for c in serving.chunks)
        where = ", ".join(f"[{c.start},{c.end})→{c.bucket or 'eager'}" for c in serving.chunks)
        parts.append(f"{len(serving.chunks)} prefill part(s) {where}, image rows per part {rows}")
    if serving.cached_tokens:
        span = serving.image_span
        place = ("" if span is None else " (inside the image)" if span[0] < serving.cached_tokens < span[1]
                 else " (past the image)" if serving.cached_tokens >= span[1] else " (before the image)")
        parts.append(f"{serving.cached_tokens} prompt rows from the prefix cache{place}")
    if serving.buffer_growth is not None:
        parts.append(f"DeepStack buffer grown {serving.buffer_growth[0]}→{serving.buffer_growth[1]} rows")
    if serving.graph_ready is not None:
        parts.append("graph warm before it" if serving.graph_ready else "graph captured by an image request")
    if serving.batch is not None:
        b = serving.batch
        parts.append(f"forward {b.forward} shared by {b.requests} requests ({b.rows} rows → {b.bucket or 'eager'}), "
                     f"its rows [{b.start},{b.end})")
    if serving.encoder is not None:
        e = serving.encoder
        parts.append(f"encoder graph '{e.key}' {'replayed' if e.replayed else 'captured'} for grid "
                     f"{'x'.join(map(str, e.grid))}")
    return "".join(f" · {part}" for part in parts)


def arm_evidence_text(arm: ArmResult) -> str:
    return evidence_text(arm.evidence, arm.mode, len(arm.forced))


def run_notes(run: RunResult) -> list[str]:
    """What a reader must know to read the verdict right, beyond the verdict itself."""
    notes = []
    shard = describe_shard(run)
    if shard:
        notes.append(shard)
    backend = registry.BACKENDS.get(str(run.config.get("backend")))
    asked = backend is not None and run.config.get(f"{backend.name}_fix") is not None  # no fix, no fix's note
    fixes = run.config.get(backend.fix_records_key or "") if asked else None
    aside = stood_aside_note(r for rs in fixes.values() if isinstance(rs, list) for r in rs) \
        if isinstance(fixes, dict) else None
    notes += [aside] if aside else []
    if backend is not None and not backend.in_process:
        judged = ("on its answers, within the dtype's tolerances, and on the freshness witness's record of every "
                  "input its servers' replays read" if backend.witnesses_inputs else
                  "on its answers alone, within the dtype's tolerances")
        notes.append(f"the {backend.name} servers replay their own shapes, so no eager pass over the exact padded "
                     f"inputs can check their replays (design §6): this run is judged {judged}")
    sources = run.environment.get(SOURCE_KEY)
    if isinstance(sources, list):
        notes.append(f"merged with --allow-mixed-code: the shards were written by {len(sources)} different parity "
                     f"sources ({', '.join(map(str, sources))}), so their verdicts may not rest on the same code")
    return notes


def fenced(text: str, info: str = "text") -> str:
    """A code block no backtick run inside `text` can close early."""
    longest = max((len(m) for m in _BACKTICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text}\n{fence}"


# --- markdown ----------------------------------------------------------------------------------

def absent_note(run: RunResult, shown: int = 5) -> str | None:
    """The planned cases a file does not hold, in one line (a plan of 20,000 cases is not 20,000
    sections): how many, and the first few ids; None when every planned case is there."""
    absent = [case.id for case in run.cases if case.absent]
    if not absent:
        return None
    more = f" and {len(absent) - shown} more" if len(absent) > shown else ""
    return (f"{len(absent)} planned case(s) are not in the file, each INCOMPLETE: "
            f"{', '.join(absent[:shown])}{more} (config.plan)")


def held(run: RunResult) -> tuple[CaseResult, ...]:
    """The cases a file holds (a planned case it lacks is reported by `absent_note`)."""
    return tuple(case for case in run.cases if not case.absent)


def render_full_markdown(run: RunResult, images: bool = True) -> str:
    """report-full.md: every case's section, expanded, whatever its length."""
    absent = absent_note(run)
    return "\n".join([_md_header(run), _md_summary(run)] + ([f"_{md_text(absent)}_\n"] if absent else [])
                     + [case_markdown(case, run, True, images) for case in held(run)] + [environment_markdown(run)])


def render_markdown(run: RunResult, images: bool = True, budget: int = REPORT_BUDGET) -> str:
    """report.md, built for pasting: the full report when it fits `budget`; else the cases grouped by
    outcome (`outcome_groups`), each group's first case in full and the others a line each, and the
    first screen says so and where the full report is. `images=False` for where relative links to the
    run folder's plots cannot show (a CI step summary, a PR comment): the plots are then named."""
    return report_files(run, images, budget)[REPORT]


def report_files(run: RunResult, images: bool = True, budget: int = REPORT_BUDGET) -> dict[str, str]:
    """The run folder's two reports by file name: report.md (fitted) and report-full.md (everything)."""
    full = render_full_markdown(run, images)
    fitted = full if len(full) <= budget else _fitted(run, images, budget, len(full))
    return {REPORT: fitted, FULL_REPORT: full}


@dataclass(frozen=True)
class OutcomeGroup:
    """The cases of one scenario that share a verdict code: one section in a fitted report."""

    scenario: str
    code: str
    cases: tuple[CaseResult, ...]


def outcome_groups(cases: Sequence[CaseResult]) -> list[OutcomeGroup]:
    """Cases grouped by (scenario, verdict code), in plan order, what did not pass first: a group's
    first case shows the scenario's detail (a leak witness, a localization, a departure) once."""
    by_key: dict[tuple[str, str], list[CaseResult]] = {}
    for case in cases:
        by_key.setdefault((case.scenario, case.verdict.code), []).append(case)
    groups = [OutcomeGroup(scenario, code, tuple(members)) for (scenario, code), members in by_key.items()]
    return sorted(groups, key=lambda g: g.code == PASS)


# How a fitted report shrinks, in turn, until it fits: arm texts go, then each group lists its first
# cases only (the full report lists them all). Past that, a group that does not fit in full is its
# list alone, and one whose list does not fit either is named on the first screen.
_FITTINGS = ((True, None), (False, None), (False, 10))
_NOTE_ROOM = 1500  # the first screen's note of what was left out


def _fitted(run: RunResult, images: bool, budget: int, full_chars: int) -> str:
    groups = outcome_groups(held(run))
    absent = absent_note(run)
    extras = ([f"_{md_text(absent)}_\n"] if absent else []) + [environment_markdown(run)]
    room = budget - len(_md_header(run)) - _NOTE_ROOM - sum(len(e) + 1 for e in extras)
    for with_texts, listed in _FITTINGS:
        sections, listed_only, cut = [], [], []
        left = room
        for group in groups:  # what did not pass first, so it is what stays
            full = _md_group(group, run, with_texts, images, listed)
            short = _md_group(group, run, with_texts, images, listed, expand=False)
            section = full if len(full) < left else short if len(short) < left else None
            if section is None:
                cut.append(group)
                continue
            if section is short and short != full:
                listed_only.append(group)
            sections.append(section)
            left -= len(section) + 1
        if not (listed_only or cut):
            break
    note = _fitted_note(run, groups, full_chars, with_texts, listed, listed_only, cut)
    return clip_text("\n".join([_md_header(run, note), *sections, *extras]), budget)


def _named(groups: list[OutcomeGroup]) -> str:
    return ", ".join(f"{g.scenario} {g.code} ×{len(g.cases)}" for g in groups)


def _fitted_note(run: RunResult, groups: list[OutcomeGroup], full_chars: int, with_texts: bool,
                 listed: int | None, listed_only: list[OutcomeGroup], cut: list[OutcomeGroup]) -> str:
    left = [] if with_texts else ["arm texts"]
    left += [] if listed is None else [f"all but the first {listed} cases of a group"]
    note = (f"this report is fitted to a PR comment: {len(held(run))} cases in {len(groups)} groups of one scenario "
            "and verdict; each group that did not pass shows its first case in full and lists every case with its "
            "reason, a PASS takes one line")
    note += f"; left out here: {' and '.join(left)}" if left else ""
    note += f"; listed without their first case in full: {_named(listed_only)}" if listed_only else ""
    note += f"; did not fit at all: {_named(cut)}" if cut else ""
    return (f"{note}. The whole report ({full_chars:,} characters) is {FULL_REPORT} beside this file, and "
            "parity report --full prints it from results.json")


def _md_group(group: OutcomeGroup, run: RunResult, with_texts: bool, images: bool, listed: int | None,
              expand: bool = True) -> str:
    icon = "✅" if group.code == PASS else "❌"
    shown = group.cases if listed is None else group.cases[:listed]
    lines = [f"### {icon} `{group.code}` · {md_text(group.scenario)} · {len(group.cases)} case(s)", ""]
    lines += [f"- {md_code(c.id)}: {md_text(c.verdict.reason)}" for c in shown]
    if len(shown) < len(group.cases):
        lines.append(f"- … and {len(group.cases) - len(shown)} more, in {FULL_REPORT}")
    if group.code != PASS and expand:
        lines += ["", f"The first, {md_code(group.cases[0].id)}, in full:" if len(group.cases) > 1 else "", "",
                  case_markdown(group.cases[0], run, with_texts, images, heading="####")]
    return "\n".join(lines) + "\n"


def _md_header(run: RunResult, fitted: str | None = None) -> str:
    icon = "✅" if run.verdict.code == PASS else "❌"
    interrupted = "**Interrupted: only the arms that finished are reported.**\n\n" if run.interrupted else ""
    notes = "".join(f"> **Note:** {md_text(note)}\n\n" for note in ([fitted] if fitted else []) + run_notes(run))
    opening = (f"## parity: {icon} `{run.verdict.code}` · {md_text(placement(run))}\n\n{interrupted}"
               f"{md_text(run.verdict.reason)}\n\n{notes}")
    if run.before_run is not None:  # nothing was compared: no tuples to explain
        return f"{opening}Model {md_code(str(run.config.get('model')))}\n"
    tie = "" if run.tie_margin is None else (f"; a near-tie flip (margin ≤ {run.tie_margin:g}) matches when the "
                                             f"teacher-forced delta is within it too")
    return (
        f"{opening}"
        f"Model {md_code(model_of(run))} · backend {md_code(str(run.config.get('backend')))} · "
        f"{len(run.cases)} case(s) · tuples are `(divergence char, token match, logprob delta)`, "
        f"match = token match and delta ≤ {run.logprob_tol:g}{_mean_rule(run)}{tie}; where the tokens differ, "
        f"the delta is the teacher-forced one (`tf`: both arms scoring the reference's tokens)\n"
    )


_GRAPH_BACKENDS = {"emulated": "emulated graph", "cuda": "CUDA graphs"}


def placement(run: RunResult) -> str:
    """Where the graph ran, for the first line a reader sees: `emulated graph · cpu · float32 · runner
    fixed`, or `CUDA graphs · cuda (NVIDIA H100 80GB HBM3) · bfloat16 · sglang prefill graph breakable`.
    An emulated PASS pasted into a GPU pull request must not read as a CUDA-graph PASS."""
    config, env = run.config, run.environment
    backend = str(config.get("backend", "?"))
    if run.before_run is not None:
        return f"no arm ran ({backend}, judged before any arm)"
    graph = config.get("graph_backend") or config.get(f"{backend}_graph_backend")
    device = env.get("device") or "device not recorded"
    parts = [_GRAPH_BACKENDS.get(str(graph), f"graph backend {graph}" if graph else "graph backend not recorded"),
             f"{device} ({env['gpu']})" if env.get("gpu") else str(device),
             str(config.get("dtype") or "dtype not recorded")]
    if config.get("runner"):
        parts.append(f"runner {config['runner']}" + (" (poisoned slots)" if config.get("poison") is True else ""))
    label = config.get("graph_mode") or registry.of_run(config).graph_label(config)
    parts.append(f"{backend} {label}" if label else backend)
    return " · ".join(parts)


def _mean_rule(run: RunResult) -> str:
    mean = run.logprob_mean_tol
    return "" if mean is None else f" and mean delta over the steps ≤ {mean:g}"


def _md_summary(run: RunResult) -> str:
    """Every case the file holds in one table, when there are several: what a reviewer reads first."""
    cases = held(run)
    if len(cases) < 2:
        return ""
    lines = ["| case | verdict | reason |", "|---|---|---|"]
    lines += [f"| {md_code(c.id, in_table=True)} | `{c.verdict.code}` | {md_text(c.verdict.reason)} |"
              for c in cases]
    return "\n".join(lines) + "\n"


def case_markdown(case: CaseResult, run: RunResult, with_texts: bool = True, images: bool = True,
                  heading: str = "###") -> str:
    tol = run.logprob_tol
    fixture = "text only" if case.fixture is None else media_text(case)
    lines = [f"{heading} {md_code(case.id)}: `{case.verdict.code}`\n", f"{md_text(case.verdict.reason)}\n",
             f"Scenario `{case.scenario}` · {fixture} · prompt: {md_code(case.prompt)}\n"]
    if case.localization is not None:
        lines.append(f"**{md_text(localization_sentence(case))}**\n")
    elif not_localized_note(case, run):
        lines.append(f"_{md_text(not_localized_note(case, run))}_\n")
    if case.requests:
        lines += ["Requests, served back to back in each mode:", "",
                  "| # | request | image | prompt |", "|---|---|---|---|"]
        for i, r in enumerate(case.requests, 1):
            image = "—" if r.fixture is None else md_code(r.fixture.name, in_table=True)
            lines.append(f"| {i} | {md_text(r.label)} | {image} | {md_code(r.prompt, in_table=True)} |")
        lines.append("")
        lines += _md_forwards(case)
    lines += ["| # | comparison | tuple | tf Δ | expected | ok |", "|---|---|---|---|---|---|"]
    for i, (group, check, comp) in enumerate(rows(case), 1):
        tup = f"`{tuple_text(comp, tol, extras=False)}`" if comp else "—"
        tf = "—" if comp is None or comp.tf_delta is None else format_delta(comp.tf_delta, tol)
        tf += " (near-tie)" if comp is not None and comp.tie else ""
        ok = "—" if comp is None else ("✅" if _ok(check.expect_match, comp.match) else "❌")
        label = f"{md_code(check_label(group, check), in_table=True)} ({md_text(check.meaning)})"
        lines.append(f"| {i} | {label} | {tup} | {tf} | {_expectation(check.expect_match)} | {ok} |")
    lines += ["", "| arm | execution evidence |", "|---|---|"]
    lines += [f"| `{label}` | {'failed' if arm.failed else arm_evidence_text(arm)} |"
              for label, arm in arms_with_labels(case)]
    lines.append("")
    lines += _md_repeats(case) + _md_records(case)
    for plot, alt in ((case.plot, "teacher-forced |Δ logprob| per position"),
                      (case.localization_plot, "relative error per layer")):
        if plot:
            lines.append(f"![{alt}]({plot})\n" if images else f"_Plot ({alt}): {md_code(plot)} in the run folder._\n")
    if case.localization is not None:
        lines.append(_md_layers(case.localization))
    if with_texts:
        for label, arm in arms_with_labels(case):
            body = f"error: {arm.error}" if arm.error else clip_text(arm.text, _ARM_TEXT_LIMIT)
            body = visible(body, keep="\n\t")  # an answer keeps its lines; an escape sequence is shown
            lines.append(f"<details><summary><code>{label}</code> ({len(arm.token_ids)} tokens, "
                         f"{arm.seconds:.2f} s)</summary>\n\n{fenced(body)}\n</details>\n")
    return "\n".join(lines)


def media_text(case: CaseResult) -> str:
    """The case's image or video as a reader needs it: a built-in fixture by name; a user's file as
    given, and how many image tokens the model saw of it (the processor resizes every image to its
    pixel budget, a large photo to a small fraction of its pixels)."""
    info = case.fixture
    kind = info.kind
    if is_builtin(info):
        return f"{'video' if info.frames else 'fixture'} {md_code(info.name)} {info.dimensions}, sha256 `{info.sha256}`"
    seen = next((a.deepstack_record.nonzero_rows for a in case.all_arms()
                 if a.deepstack == "normal" and a.mode == "eager" and a.deepstack_record is not None), None)
    tokens = "" if seen is None else (f"; the model saw {seen} {kind} token(s) of it (the processor scales "
                                      f"every {kind} to its pixel budget)")
    return f"user {kind} {md_code(info.name)}, {info.dimensions} as given{tokens}, sha256 `{info.sha256}`"


@functools.lru_cache(maxsize=None)
def _builtin_sha256(name: str) -> str | None:
    from parity.media.catalog import builtin_fixture, builtin_names

    return builtin_fixture(name).sha256 if name in builtin_names(twins=True, videos=True) else None


def is_builtin(info) -> bool:
    """A built-in fixture: its name and its pixels both (a user's `rgb-stripes.png` is not one)."""
    return _builtin_sha256(info.name) == info.sha256


def _md_forwards(case: CaseResult) -> list[str]:
    """Who shared each forward of a graph arm's requests (the batch scenario), from its evidence."""
    forwards: dict[tuple[str, int], list[tuple[int, object]]] = {}
    for i, request in enumerate(case.requests, 1):
        for arm in request.arms:
            batch = None if arm.evidence is None or arm.evidence.serving is None else arm.evidence.serving.batch
            if batch is not None:
                forwards.setdefault((arm.name, batch.forward), []).append((i, batch))
    if not forwards:
        return []
    lines = ["Forwards the requests shared (graph mode; the eager reference served each alone):", "",
             "| arm | forward | bucket | rows | requests: their rows |", "|---|---|---|---|---|"]
    for (name, forward), members in forwards.items():
        first = members[0][1]
        who = ", ".join(f"{i}: [{b.start},{b.end})" for i, b in sorted(members, key=lambda m: m[1].start))
        lines.append(f"| `{name}` | {forward} | {first.bucket or 'eager'} | {first.rows} | {who} |")
    return lines + [""]


def _md_repeats(case: CaseResult) -> list[str]:
    if not any(a.repeats for a in case.all_arms()):
        return []
    lines = ["| arm | runs | self-delta | tolerance | reproduces |", "|---|---|---|---|---|"]
    for label, arm in arms_with_labels(case):
        same, worst = self_delta(arm)
        lines.append(f"| `{label}` | {len(arm.repeats) + 1} | {worst:.3g} | {REPEAT_TOL:g} | {'✅' if same else '❌'} |")
    return lines + [""]


def _md_records(case: CaseResult) -> list[str]:
    records = [(label, a.deepstack_record) for label, a in arms_with_labels(case) if a.deepstack_record]
    if not records:
        return []
    lines = ["| arm | DeepStack seen at LM entry | non-zero rows | L2 norm | sha256 | handed on |",
             "|---|---|---|---|---|---|"]
    lines += [f"| `{label}` | {list(r.shape)} {md_text(r.dtype)} | {r.nonzero_rows} | {r.l2_norm:.4g} | "
              f"{md_code(r.sha256[:16] + '…', in_table=True)} | {md_text(r.action)} |" for label, r in records]
    return lines + [""]


def localization_sentence(case: CaseResult) -> str:
    loc = case.localization
    point = loc.first_point
    if point is None:
        return (f"no layer of {loc.arm} leaves {loc.reference} by more than {loc.threshold:g} (relative error): "
                "the divergence starts after the prefill (decode) or is below the threshold")
    where = "" if loc.request is None else f" (request {loc.request + 1})"
    upstream = _upstream_departure(case)
    if upstream is not None:  # one place for one divergence: where the replay check saw it first
        return (f"first divergent{where}: {_UPSTREAM[upstream.point]}, before decoder layer 0 (the replay check: "
                f"row {upstream.position}, {upstream.tensor} Δ {upstream.delta:.3g} > {upstream.bound:.3g}); every "
                f"layer from {point.layer} inherits it (relative error {point.rel_error:.3g} > {loc.threshold:g})")
    if point.deepstack_block is None:
        detail = "" if _added_before(loc, point.layer) else ", before any DeepStack add"
        text = f"first divergent layer{where}: {point.layer}{detail}"
    else:
        text = f"first divergent layer{where}: {point.layer}, after DeepStack block {point.deepstack_block} is added"
    return f"{text} (relative error {point.rel_error:.3g} > {loc.threshold:g})"


# Where a replay check can see a departure that no decoder-layer probe reaches. (Its "embeddings" point
# is layer 0's keys and values, which the probe's layer 0 sees too: not upstream.)
_UPSTREAM = {"encoder": "the vision encoder's output"}


def _upstream_departure(case: CaseResult):
    """The localized arm's replay-check departure when it lies before the decoder layers (in the
    vision encoder), where a per-layer probe cannot look; else None."""
    loc = case.localization
    arm = case.arm(loc.arm, loc.request) if loc.request is None or loc.request < len(case.requests) else None
    check = None if arm is None or arm.evidence is None else arm.evidence.replay_check
    departure = None if check is None else check.departure
    return departure if departure is not None and departure.point in _UPSTREAM else None


def _added_before(loc, layer: int) -> bool:
    return any(p.deepstack_block is not None and p.layer < layer for p in loc.points)


def not_localized_note(case: CaseResult, run: RunResult) -> str | None:
    """Why a case whose bcg arm disagrees with eager has no localization (None: it has one, or needs none)."""
    if case.localization is not None or target_of(case) is None:
        return None
    backend = registry.of_run(run.config)
    if not backend.localizes:  # the engine's graphs, not parity's: nothing to probe per layer
        return not_available(backend.name) + (f" ({backend.runbook})" if backend.runbook else "")
    return f"not localized in this run; `parity localize results.json --case {case.id} --write` adds it"


def _md_layers(loc) -> str:
    rows = [f"| `{p.label}` | {p.rel_error:.3g} | "
            f"{'**first**' if i == loc.first else ('above' if p.rel_error > loc.threshold else '')} |"
            for i, p in enumerate(loc.points)]
    where = "" if loc.request is None else f", request {loc.request + 1}"
    return (f"<details><summary>relative error per layer ({loc.arm} vs {loc.reference}{where}, "
            f"threshold {loc.threshold:g})</summary>\n\n| point | relative error | |\n|---|---|---|\n"
            + "\n".join(rows) + "\n</details>\n")


def localization_lines(case: CaseResult) -> list[str]:
    """A case's localization for a terminal: the sentence, then one line per probe point."""
    loc = case.localization
    where = "" if loc.request is None else f", request {loc.request + 1}"
    lines = [f"{visible(case.id)}: {localization_sentence(case)}",
             f"  {loc.arm} vs {loc.reference}{where}, relative error per probe point (threshold {loc.threshold:g}):"]
    for i, p in enumerate(loc.points):
        mark = "  <- first divergent" if i == loc.first else ("  above" if p.rel_error > loc.threshold else "")
        lines.append(f"  {p.label:10} {p.rel_error:.3e}{mark}")
    return lines


def localization_json(cases: list[CaseResult]) -> str:
    doc = {"cases": [{"id": c.id, "localization": localization_to_json(c.localization)} for c in cases]}
    return json.dumps(doc, indent=2, allow_nan=False)


def environment_markdown(run: RunResult) -> str:
    env = " · ".join(f"{md_text(str(k))} {md_code(str(v))}" for k, v in run.environment.items())
    # The plan and the shard map list every case: results.json holds them, the report says how many.
    config = " · ".join(f"{md_text(str(k))} {md_code(_config_value(k, v))}" for k, v in run.config.items())
    timings = "" if run.timings is None else f"{timings_sentence(run)}\n\n"
    return f"{timings}<details><summary>Environment and config</summary>\n\n{env}\n\n{config}\n</details>\n"


_TIMING_LABELS = (("load_s", "model load"), ("server_start_s", "server start"), ("capture_s", "graph capture"),
                  ("eager_s", "eager session"), ("bcg_s", "graph session"), ("localize_s", "localization"),
                  ("total_s", "total"))


def timings_sentence(run: RunResult) -> str:
    """Where the run's wall time went (`results.Timings`); each arm's own time is in its table."""
    parts = [f"{label} {getattr(run.timings, key):.2f} s" for key, label in _TIMING_LABELS
             if getattr(run.timings, key) is not None]
    return "Time: " + " · ".join(parts) + " (the graph session includes its capture)"


def _config_value(key: str, value: object) -> str:
    if key == "plan" and isinstance(value, list):
        return f"{len(value)} planned case(s) (see results.json)"
    if key == "shard" and isinstance(value, dict):
        return str({k: v for k, v in value.items() if k != "cases"})
    return str(value)


def verdicts_json(run: RunResult) -> str:
    """`parity verdict --json`: the run's verdict, its exit code and each case's verdict."""
    from parity.judge.verdict import exit_code

    verdict = {"code": run.verdict.code, "reason": run.verdict.reason}
    doc = {"verdict": verdict, "exit_code": exit_code(run.verdict), "ran_on": placement(run),
           "cases": [{"id": c.id, "scenario": c.scenario, "code": c.verdict.code, "reason": c.verdict.reason}
                     for c in run.cases]}
    return encodable(json.dumps(doc, indent=2, ensure_ascii=False))


def render_json(run: RunResult) -> str:
    return encodable(dumps(run))
