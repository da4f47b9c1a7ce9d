"""`parity audit --engine vllm` against the installed vLLM, in each supported release's environment (CI's
vLLM stages): the rows it reads from the real source, and the command's exit code and formats.

What the rows assert was read by hand in the same files (docs/engines/vllm-0.33.md §2, §3): the
DeepStack buffers are cleared from the Python forward, which FULL and breakable graphs replay
without; Qwen3-Omni's thinker has a setter of its own, which parity's fix does not wrap.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parity.audit.report import COVERED, DROPPED, EAGER, LEAKS, NOT_AN_INPUT
from tests.engines.servers import installed, real_vllm_marks

_FOUND = installed("vllm")
pytestmark = real_vllm_marks()
ENGINE = "vllm"  # the `report` fixture audits it (tests/engines/conftest.py)


@pytest.mark.parametrize("module", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_models_leak_under_whole_forward_graphs_and_the_fix_covers_them(report, module) -> None:
    row = report.row(module)
    assert row.side_input and "Qwen3VLForConditionalGeneration._set_deepstack_input_embeds" in row.deepstack
    assert report.outcomes(module) == {"NONE": EAGER, "PIECEWISE": COVERED, "FULL": LEAKS, "breakable": LEAKS}
    assert report.outcomes(module, with_fix=True) == {"NONE": EAGER, "PIECEWISE": COVERED, "FULL": COVERED,
                                                    "breakable": COVERED}


def test_the_omni_thinker_has_its_own_setter_and_the_fix_wraps_it(report) -> None:
    row = report.row("qwen3_omni_moe_thinker")
    assert "Qwen3OmniMoeForConditionalGeneration" in row.architectures
    assert "Qwen3OmniMoeThinkerForConditionalGeneration._set_deepstack_input_embeds: the one the fix wraps" in row.method
    assert report.outcomes("qwen3_omni_moe_thinker")["FULL"] == LEAKS
    assert report.outcomes("qwen3_omni_moe_thinker", with_fix=True)["FULL"] == COVERED


def test_the_fix_wraps_every_deepstack_setter_the_release_defines(report) -> None:
    """A release that adds a model with a setter of its own fails here until plugin.TARGETS names it."""
    from parity.engines.vllm.audit import SETTER, fixed_setters

    defined = {row.deepstack.split("(", 1)[1].split(f".{SETTER}")[0] for row in report.rows if "buffers (" in row.deepstack}
    assert defined == {name.rsplit(".", 1)[-1] for name in fixed_setters()}


def test_moss_audio_s_per_step_attribute_is_dropped_by_whole_forward_graphs_and_the_fix_slots_it(report) -> None:
    """Audio DeepStack kept as an attribute each step sets anew: a FULL or breakable graph reads it as
    captured (docs/engines/vllm-0.34.md §6, the draft report); parity's fix gives it a slot
    (test_vllm_moss_audio.py runs it on vLLM's own methods)."""
    row = report.row("moss_audio")
    assert row.side_input and "per-step attribute" in row.deepstack
    assert "MossAudioModel.forward: the fix gives it a slot" in row.method
    assert report.outcomes("moss_audio") == {"NONE": EAGER, "PIECEWISE": COVERED, "FULL": DROPPED, "breakable": DROPPED}
    assert report.outcomes("moss_audio", with_fix=True) == {"NONE": EAGER, "PIECEWISE": COVERED, "FULL": COVERED,
                                                          "breakable": COVERED}


# Every class that keeps DeepStack in vLLM's persistent buffers, per release, as read by hand in the
# wheels (docs/engines/vllm-0.33.md §2, vllm-0.34.md §3): module -> (class, covered by parity's fix).
# Both releases register model packages under vllm.models; Qwen4Exp there inherits Qwen3-VL's setter
# and clear (the audit missed it before it followed those entries), and 0.34 moved Qwen3.5 there.
_BUFFERED = {
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", True),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", True),
    "cosmos3": ("Cosmos3ForConditionalGeneration", True),
    "interns1_pro": ("InternS1ProForConditionalGeneration", True),
    "alpamayo2_super": ("Alpamayo2SuperForConditionalGeneration", True),
    "qwen3_omni_moe_thinker": ("Qwen3OmniMoeThinkerForConditionalGeneration", True),
    "clef_omni": ("ClefOmniForJointSchema", True),
    "cohere_compass": ("CohereCompassForConditionalGeneration", True),
    "vllm.models.qwen4_exp.nvidia.model": ("Qwen4ExpForConditionalGeneration", True),
}
BUFFERED = {"0.33.0": _BUFFERED, "0.34.0": _BUFFERED}
# Qwen3.5 computes DeepStack its forward never reads, wherever the registry points.
QWEN3_5 = {"0.33.0": "qwen3_5", "0.34.0": "vllm.models.qwen3_5.nvidia.model"}


def test_every_class_that_keeps_deepstack_in_buffers_is_found_wherever_it_lives(report) -> None:
    found = {r.module: (r.model_class, r.modes) for r in report.rows if r.side_input and "buffers (" in r.deepstack}
    expected = BUFFERED[_FOUND]
    assert {m: c for m, (c, _) in found.items()} == {m: c for m, (c, _) in expected.items()}
    for module, (model_class, covered) in expected.items():
        assert report.outcomes(module, model_class)["FULL"] == LEAKS and report.outcomes(module, model_class)[
            "breakable"] == LEAKS
        assert report.outcomes(module, model_class, with_fix=True)["FULL"] == (COVERED if covered else LEAKS), module


def test_a_model_whose_forward_never_reads_the_buffers_is_not_judged(report) -> None:
    for model_class in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        assert set(report.outcomes(QWEN3_5[_FOUND], model_class).values()) == {NOT_AN_INPUT}


def test_the_command_exits_1_released_and_0_with_the_fix_and_says_so_in_every_format() -> None:
    def audit(*args):
        return subprocess.run([sys.executable, "-m", "parity", "audit", "--engine", "vllm", *args],
                              capture_output=True, text=True, timeout=300)

    table, fixed, as_json = audit(), audit("--with-fix"), audit("--format", "json")
    assert (table.returncode, fixed.returncode, as_json.returncode) == (1, 0, 1), table.stderr
    assert "moss_audio.MossAudioModel" in table.stdout and "qwen3_vl.Qwen3VLForConditionalGeneration" in table.stdout
    assert "every DeepStack model's graph modes are covered" in fixed.stdout
    data = json.loads(as_json.stdout)
    assert data["exit_code"] == 1 and data["version"] == _FOUND
    assert {"qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe_thinker"} <= {r["module"] for r in data["rows"]}
