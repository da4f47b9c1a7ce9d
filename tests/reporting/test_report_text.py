"""What a reviewer sees: report.md and the terminal show every string literally (no heading, table
break, markup or control sequence from a case id or a prompt), the tuple's notes, a summary of every
case, each request's prompt, calm eager evidence, notes that change how to read a verdict, and a
table readable at 80 columns."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from rich.console import Console

from parity.arms import BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO
from parity.reporting.report import render_json, render_markdown
from parity.reporting.terminal import print_table
from parity.results import FixtureInfo
from parity.judge.verdict import judge_run
from tests.helpers_runs import (
    NORMAL_IDS, ZERO_IDS, fixed_arms, fixture_info, legacy_arms, make_arm, make_case, make_run, scored, stream_case,
)

HOSTILE_ID = "x\n# injected | heading [red]w[/] \x1b[31m `tick` <!--"
HOSTILE_PROMPT = "a | b\n## not a heading </details> [bold]x[/] \x07"


def _terminal(run, width: int = 80) -> str:
    console = Console(width=width, record=True, force_terminal=False, color_system=None, soft_wrap=True)
    print_table(run, console)
    return console.export_text()


def _decisive_flip():
    """The upstream drop, with bcg_normal scored on eager's tokens: a flip with a teacher-forced delta."""
    return [a if a.name != BCG_NORMAL else make_arm(BCG_NORMAL, ZERO_IDS, forced={EAGER_NORMAL: [-2.0] * 5})
            for a in legacy_arms()]


def _hostile_run():
    case = make_case(fixed_arms(), HOSTILE_ID, prompt=HOSTILE_PROMPT,
                     fixture=FixtureInfo("cat|dog`.png", fixture_info("c").sha256, (64, 64)))
    return make_run([case, make_case(_decisive_flip(), "plain/describe")], model="m|`x`")


def _table_rows(markdown: str, header: str) -> list[str]:
    lines = markdown.splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def _cells(row: str) -> int:
    """Cells as GFM splits a row: on every `|` without a backslash before it."""
    return len(re.findall(r"(?<!\\)\|", row)) - 1


def test_case_ids_and_prompts_cannot_break_report_md():
    markdown = render_markdown(_hostile_run())
    lines = markdown.splitlines()
    # Only parity's own headings: the report title and one per case.
    assert [ln for ln in lines if ln.startswith("#")] == [lines[0], *[ln for ln in lines if ln.startswith("### ")]]
    assert len([ln for ln in lines if ln.startswith("### ")]) == 2
    assert "\x1b" not in markdown and "\x07" not in markdown
    outside_code = re.sub(r"(`+).+?\1", "", markdown)
    assert "<!--" not in outside_code and "</details> [bold]" not in outside_code  # no HTML opened by a string
    assert "\\x1b" in markdown and "\\n" in markdown  # shown, not hidden
    summary = _table_rows(markdown, "| case | verdict | reason |")
    assert len(summary) == 2 and all(_cells(row) == 3 for row in summary)
    # Every table keeps its column count, whatever the strings in it.
    for header in ("| # | comparison | tuple | tf Δ | expected | ok |", "| arm | execution evidence |"):
        for row in _table_rows(markdown, header):
            assert _cells(row) == header.count("|") - 1, row


def test_terminal_shows_strings_as_text_and_the_tuple_notes():
    text = _terminal(_hostile_run(), width=120)
    assert "[red]w[/]" in text and "\\x1b[31m" in text and "\x1b" not in text and "\\n# injected" in text
    # A decisive flip's delta is the teacher-forced one, which measures it, not the logprobs of two
    # different tokens; labelled so (rich would take a bracketed note as markup).
    assert re.search(r"\(\d+, False, tf [0-9.e-]+\)", text), text


def test_near_tie_note_reaches_the_terminal():
    # bcg_normal flips its first token against eager_normal within the tie margin, both ways in the top-5.
    top = tuple(((11, -0.50), (99, -0.52), (1, -3.0), (2, -3.1), (3, -3.2)) for _ in NORMAL_IDS)
    flipped = (99, *NORMAL_IDS[1:])
    top_b = tuple(((99, -0.50), (11, -0.52), (1, -3.0), (2, -3.1), (3, -3.2)) for _ in NORMAL_IDS)
    arms = [make_arm(EAGER_NORMAL, NORMAL_IDS, top=top, logprobs=[-0.5] * 5),
            make_arm(EAGER_ZERO, ZERO_IDS),
            make_arm(BCG_NORMAL, flipped, top=top_b, logprobs=[-0.5] * 5,
                     forced={EAGER_NORMAL: [-0.5] * 5}),
            make_arm(BCG_ZERO, ZERO_IDS)]
    run = make_run([make_case(arms)])
    comparison = run.cases[0].comparisons[0]
    assert comparison.tie
    assert "[tie, flip Δ" in _terminal(run, width=120)


def test_the_table_is_readable_at_80_columns():
    run = make_run([stream_case(bcg_ids=[tuple(range(i * 10 + 1, i * 10 + 6)) if i != 3 else (7, 7, 7, 7, 7)
                                         for i in range(5)])])
    text = _terminal(run)
    assert "…" not in text  # nothing cut to an ellipsis
    table = [ln for ln in text.splitlines() if ln[:1] in "┏┃┡│└"]
    assert table and max(len(ln) for ln in table) <= 80
    for word in ("bcg_zero_deepstack", "eager_zero_deepstack", "FAIL_STALE_STATE", "match", "differ"):
        assert word in text, word
    assert re.search(r"\(\d+, False, tf [0-9.]+\)", text)


def test_summary_table_lists_every_case_when_there_are_several():
    one = render_markdown(make_run([make_case(fixed_arms())]))
    assert "| case | verdict | reason |" not in one
    several = render_markdown(make_run([make_case(fixed_arms(), "a/describe"), make_case(legacy_arms(), "b/describe"),
                                        stream_case()]))
    rows = _table_rows(several, "| case | verdict | reason |")
    assert [r.split("|")[1].strip() for r in rows] == ["`a/describe`", "`b/describe`", "`stream/rgb-stripes/describe`"]
    assert "`FAIL_DEEPSTACK_DROPPED`" in rows[1] and several.index("| case |") < several.index("### ")


def test_sequence_cases_show_each_requests_prompt():
    case = stream_case()
    requests = tuple(replace(r, prompt=f"prompt number {i} | with a pipe") for i, r in enumerate(case.requests, 1))
    markdown = render_markdown(make_run([replace(case, requests=requests)]))
    rows = _table_rows(markdown, "| # | request | image | prompt |")
    assert len(rows) == 5 and all(_cells(row) == 4 for row in rows)
    for i, row in enumerate(rows, 1):
        assert f"`prompt number {i} \\| with a pipe`" in row


def test_eager_evidence_is_calm_and_a_graph_arm_that_did_not_replay_is_not():
    markdown = render_markdown(make_run([make_case(fixed_arms())]))
    assert "| `eager_normal` | eager (no replay expected) ·" in markdown and "NO" not in markdown.split("| arm |")[1]
    not_replayed = [a if a.name != BCG_NORMAL else replace(a, evidence=replace(a.evidence, prefill_replayed=False))
                    for a in fixed_arms()]
    assert "prefill replayed: NO" in render_markdown(make_run([make_case(not_replayed)]))
    replayed_eager = [a if a.name != EAGER_NORMAL else replace(a, evidence=replace(a.evidence, prefill_replayed=True))
                      for a in fixed_arms()]
    assert "prefill replayed: YES, in an eager arm" in render_markdown(make_run([make_case(replayed_eager)]))


@pytest.mark.parametrize("runner, scenario, noted", [("no-clear", "four-arm", True), ("no-clear", "stream", False),
                                                     ("fixed", "four-arm", False)])
def test_no_clear_in_four_arm_says_which_scenario_reaches_the_bug(runner, scenario, noted):
    case = make_case(fixed_arms()) if scenario == "four-arm" else stream_case()
    run = make_run([case])
    run = judge_run(replace(run, config={**run.config, "runner": runner}))
    note = "which a four-arm case never reaches (--scenario reuse, stream or all reaches it)"
    markdown, text = render_markdown(run), _terminal(run, width=400)
    assert (note in markdown) is noted and (note in text) is noted
    if noted:
        assert sum(note in line for line in text.splitlines()) == 1


def test_the_step_summary_version_links_no_image(parity_cli, tmp_path):
    from parity.results import write_results

    run = make_run([replace(make_case(fixed_arms()), plot="rgb-stripes__describe.png")])
    assert "](rgb-stripes__describe.png)" in render_markdown(run)
    summary = render_markdown(run, images=False)
    assert "](" not in summary and "`rgb-stripes__describe.png` in the run folder" in summary
    write_results(run, tmp_path / "results.json")
    assert "](" in parity_cli("report", str(tmp_path / "results.json")).output
    assert "](" not in parity_cli("report", str(tmp_path / "results.json"), "--no-images").output


def test_a_lone_surrogate_is_printed_not_a_crash():
    case = make_case([replace(a, text="a\ud800b") for a in fixed_arms()], "id\udfff", fixture=fixture_info("c"))
    run = make_run([case])
    for rendered in (render_markdown(run), _terminal(run)):
        rendered.encode("utf-8")  # strict: would raise on a lone surrogate
        assert "\\ud800" in rendered or "\\udfff" in rendered
    doc = json.loads(render_json(run))  # the JSON escape keeps the very same string
    assert doc["cases"][0]["id"] == "id\udfff"


def test_parity_report_and_verdict_print_any_valid_results_file(parity_cli, tmp_path):
    from parity.results import write_results

    case = make_case([replace(a, text="a\ud800b \x1b[2J") for a in fixed_arms()], "id\udfff\n# x|y",
                     prompt="p\ud800", fixture=fixture_info("c"))
    path = tmp_path / "results.json"
    # Scored as a run writes it: the loader refuses a file whose arms lack teacher-forced scores.
    write_results(make_run([scored(case), scored(make_case(_decisive_flip(), "b/describe"))]), path)
    assert "\\udfff" in path.read_text(encoding="utf-8")  # written as JSON's escape, read back as the same string
    for args in (("report", "--format", "markdown"), ("report", "--format", "table"), ("report", "--format", "json"),
                 ("verdict",), ("verdict", "--json")):
        result = parity_cli(args[0], str(path), *args[1:])
        assert result.exit_code in (0, 1) and "Traceback" not in result.output, (args, result.output)
        assert "\x1b" not in result.output and "id\\udfff" in result.output, args
    doc = json.loads(parity_cli("report", str(path), "--format", "json").output)
    assert doc["cases"][0]["id"] == "id\udfff\n# x|y"


def test_planned_cases_a_file_lacks_are_summarised_not_rendered_one_by_one():
    """A sweep's shard holds a few of its plan's 20,000 cases: each report format says how many are
    absent and names the first few, in one line, not 20,000 sections (or a 526 MB string)."""
    from parity.results import run_to_json
    from parity.trust.loader import run_from_json

    doc = run_to_json(make_run([make_case(fixed_arms())]))
    first = doc["config"]["plan"][0]
    doc["config"]["plan"] += [dict(first, id=f"sweep-{i}/describe") for i in range(20000)]
    run = judge_run(run_from_json(doc, "sweep"))
    assert run.verdict.code == "INCOMPLETE"
    note = "20000 planned case(s) are not in the file, each INCOMPLETE: sweep-0/describe"
    markdown, table = render_markdown(run), _terminal(run, width=400)
    assert note in markdown and markdown.count("sweep-") < 10 and len(markdown) < 20_000
    assert note in table and table.count("sweep-") < 10
    assert len(json.loads(render_json(run))["cases"]) == 1  # the file holds what ran; its plan, the rest
