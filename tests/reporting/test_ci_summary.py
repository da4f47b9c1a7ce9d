"""Job summary appending and clipping long text under a character budget."""

from __future__ import annotations

import pytest

from parity.reporting.ci_summary import MAX_COMMENT_CHARS, append_step_summary, clip_text


def test_append_creates_then_appends(tmp_path, monkeypatch):
    target = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(target))
    assert append_step_summary("## parity\n| a | b |") == target  # default env is os.environ
    assert append_step_summary("second") == target
    assert target.read_text(encoding="utf-8") == "## parity\n| a | b |\n\nsecond\n"


def test_append_keeps_what_earlier_steps_wrote(tmp_path):
    target = tmp_path / "summary.md"
    target.write_text("earlier step\n", encoding="utf-8")
    append_step_summary("**PASS** ✓", env={"GITHUB_STEP_SUMMARY": str(target)})
    assert target.read_text(encoding="utf-8") == "earlier step\n\n**PASS** ✓\n"


def test_no_summary_outside_actions(tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.chdir(tmp_path)
    assert append_step_summary("x") is None
    assert append_step_summary("x", env={"GITHUB_STEP_SUMMARY": ""}) is None
    assert list(tmp_path.iterdir()) == []


def test_clip_leaves_short_text_unchanged():
    assert clip_text("short", 5) == "short"
    assert clip_text("", 0) == ""
    assert MAX_COMMENT_CHARS == 65536


@pytest.mark.parametrize("length,limit", [(100, 50), (1000, 40), (70000, MAX_COMMENT_CHARS), (10**5, 10**4 + 20)])
def test_clip_cuts_with_a_note_within_the_limit(length, limit):
    text = "".join(chr(ord("a") + i % 26) for i in range(length))
    clipped = clip_text(text, limit)
    head, note = clipped.split("… [cut: ")
    cut = int(note.removesuffix(" more characters]"))
    assert text.startswith(head) and len(head) + cut == length
    # As close to the limit as the note allows: one more kept character would not fit.
    assert len(clipped) in (limit, limit - 1)


def test_clip_refuses_a_limit_smaller_than_its_note():
    with pytest.raises(ValueError):
        clip_text("x" * 100, 10)
