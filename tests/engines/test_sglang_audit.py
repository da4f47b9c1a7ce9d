"""`parity audit --engine sglang` against the installed SGLang 0.5.23 (CI's second stage): the rows it
reads from the real source, and the command's exit code and formats.

What the rows assert was read by hand in the same files (docs/engines/sglang-0.5.23.md §1.2, §6):
Qwen3-VL is not on the multimodal allowlist, an explicit prefill graph replays it with no DeepStack
input, and the Omni wrapper the runner serves does not carry `num_deepstack_embeddings` itself (its
thinker does, and parity's slot is sized through it).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parity.audit.command import run_audit
from parity.audit.report import CARRIED_ENGINE, COVERED, DROPPED, EAGER, to_markdown
from tests.engines.servers import SGLANG_VERSION, installed

_FOUND = installed("sglang")
pytestmark = [
    pytest.mark.real_sglang,
    pytest.mark.skipif(_FOUND != SGLANG_VERSION, reason=f"needs sglang=={SGLANG_VERSION} (found {_FOUND}); "
                       "scripts/setup_sglang_env.sh sets up an environment that has it"),
]
ENGINE = "sglang"  # the `report` fixture audits it (tests/engines/conftest.py)
DEFAULT, BREAKABLE, FULL = "breakable (default)", "breakable (explicit)", "full (explicit)"


@pytest.mark.parametrize("module", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_models_drop_deepstack_when_replayed_and_parity_s_slot_covers_them(report, module) -> None:
    row = report.row(module)
    assert row.side_input and "input_deepstack_embeds" in row.deepstack
    assert report.outcomes(module) == {DEFAULT: EAGER, BREAKABLE: DROPPED, FULL: DROPPED}
    assert report.outcomes(module, with_fix=True) == {DEFAULT: EAGER, BREAKABLE: COVERED, FULL: COVERED}
    assert "num_deepstack_embeddings" in row.method and "present" in row.method


def test_the_omni_wrapper_consumes_deepstack_through_its_thinker_and_the_slot_is_sized_through_it(report) -> None:
    row = report.row("qwen3_omni_moe")
    assert row.model_class == "Qwen3OmniMoeForConditionalGeneration"
    assert row.side_input and "Qwen3MoeLLMModel" in row.deepstack  # thinker.model, as the runner resolves it
    assert report.outcomes("qwen3_omni_moe") == {DEFAULT: EAGER, BREAKABLE: DROPPED, FULL: DROPPED}
    # Only the thinker sets num_deepstack_embeddings; parity's slot is sized through it (deepstack_holder).
    assert report.outcomes("qwen3_omni_moe", with_fix=True) == {DEFAULT: EAGER, BREAKABLE: COVERED, FULL: COVERED}
    assert "on its thinker (Qwen3OmniMoeThinkerForConditionalGeneration" in row.method


def test_a_draft_head_that_never_passes_deepstack_has_nothing_to_carry_and_says_why(report) -> None:
    row = report.row("qwen3_5_mtp")
    assert not row.side_input and "never passed by Qwen3_5ForCausalLMMTP" in row.deepstack
    assert set(report.outcomes("qwen3_5_mtp", with_fix=True).values()) == {"n/a"}


def test_allowlisted_and_gated_architectures(report) -> None:
    # Qwen3.5 is on the allowlist: its image prefills replay by default (and drop DeepStack there).
    assert report.outcomes("qwen3_5")[DEFAULT] == DROPPED
    # can_replay_locally keeps Qwen4Exp's multimodal prefills eager under breakable, not under full.
    assert report.outcomes("qwen4_exp") == {DEFAULT: EAGER, BREAKABLE: EAGER, FULL: DROPPED}
    # DeepStack inside a vision tower only is no side input: nothing to carry.
    assert not report.row("moss_vl").side_input


def test_the_command_exits_1_and_says_so_in_every_format() -> None:
    def audit(*args):
        return subprocess.run([sys.executable, "-m", "parity", "audit", "--engine", "sglang", *args],
                              capture_output=True, text=True, timeout=300)

    table, markdown, as_json = audit(), audit("--format", "markdown"), audit("--format", "json")
    assert (table.returncode, markdown.returncode, as_json.returncode) == (1, 1, 1), table.stderr
    assert "qwen3_omni_moe" in table.stdout and "dropped" in table.stdout
    assert "| `qwen3_vl` | `Qwen3VLForConditionalGeneration` |" in markdown.stdout
    data = json.loads(as_json.stdout)
    assert data["exit_code"] == 1 and data["version"] == SGLANG_VERSION
    assert {"qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe"} <= {r["module"] for r in data["rows"]}
    fixed = audit("--with-fix")  # parity's fix covers every DeepStack model SGLang registers
    assert fixed.returncode == 0 and "every DeepStack model's graph modes are covered" in fixed.stdout, fixed.stdout


# --- the release that carries SGLang PR #33726 (our port of it onto 0.5.23) ----------------------------

@pytest.mark.parametrize("module", ["qwen3_vl", "qwen3_vl_moe"])
def test_an_engine_with_its_own_slot_carries_qwen3_vl_itself_and_the_audit_names_how(sglang_port, module) -> None:
    report = run_audit("sglang", sglang_port["fixed"] / "sglang")
    carried = dict.fromkeys((DEFAULT, BREAKABLE, FULL), CARRIED_ENGINE)  # on the allowlist: the default replays
    assert report.outcomes(module) == report.outcomes(module, with_fix=True) == carried
    row = report.row(module)
    assert all("_refresh_deepstack_replay_slot refreshes the engine's own input_deepstack_embeds slot" in c.why
               for c in row.modes)
    assert "supports_bcg_deepstack_replay = True on Qwen3VLForConditionalGeneration" in row.modes[0].why  # inherited
    assert "stands aside for the engine's own slot" in row.method
    assert module not in {r.module for r in report.uncovered}
    text = to_markdown(report)
    assert "Carried by the engine itself:" in text and "calls _refresh_deepstack_replay_slot before every replay" in text
    # The Omni wrapper does not opt in: still dropped, so the command still exits 1.
    assert report.outcomes("qwen3_omni_moe")[BREAKABLE] == DROPPED


def test_an_engine_slot_that_is_never_refreshed_is_dropped_with_or_without_parity_s_fix(sglang_port) -> None:
    """The negative control: the port without its refresh call binds its slot and reads it as captured;
    parity's fix stands aside for it, so the fix column drops too."""
    report = run_audit("sglang", sglang_port["broken"] / "sglang")
    dropped = dict.fromkeys((DEFAULT, BREAKABLE, FULL), DROPPED)
    assert report.outcomes("qwen3_vl") == report.outcomes("qwen3_vl", with_fix=True) == dropped
    assert "never calls _refresh_deepstack_replay_slot" in report.row("qwen3_vl").modes[1].why
    released = run_audit("sglang")
    assert any("has no DeepStack slot of its own" in fact for fact in released.facts)
