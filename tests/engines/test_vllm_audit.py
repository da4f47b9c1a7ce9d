"""`parity audit --engine vllm` against the installed vLLM 0.33.0 (CI's third stage): the rows it reads
from the real source, and the command's exit code and formats.

What the rows assert was read by hand in the same files (docs/engines/vllm-0.33.md §2, §3): the
DeepStack buffers are cleared from the Python forward, which FULL and breakable graphs replay
without; Qwen3-Omni's thinker has a setter of its own, which parity's fix does not wrap.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parity.audit.command import run_audit
from parity.audit.report import COVERED, EAGER, LEAKS, NOT_AN_INPUT
from tests.engines.servers import installed

VERSION = "0.33.0"
_FOUND = installed("vllm")
pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(_FOUND != VERSION, reason=f"needs vllm=={VERSION} (found {_FOUND}); "
                       "scripts/setup_vllm_env.sh sets up an environment that has it"),
]


@pytest.fixture(scope="module")
def report():
    return run_audit("vllm")


@pytest.mark.parametrize("module", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_models_leak_under_whole_forward_graphs_and_the_fix_covers_them(report, module) -> None:
    row = report.row(module)
    assert row.side_input and "Qwen3VLForConditionalGeneration._set_deepstack_input_embeds" in row.deepstack
    assert report.outcomes(module) == {"NONE": EAGER, "PIECEWISE": COVERED, "FULL": LEAKS, "breakable": LEAKS}
    assert report.outcomes(module, with_fix=True) == {"NONE": EAGER, "PIECEWISE": COVERED, "FULL": COVERED,
                                                    "breakable": COVERED}


def test_the_omni_thinker_has_its_own_setter_and_still_leaks_with_the_fix(report) -> None:
    row = report.row("qwen3_omni_moe_thinker")
    assert "Qwen3OmniMoeForConditionalGeneration" in row.architectures
    assert "its own" in row.method
    assert report.outcomes("qwen3_omni_moe_thinker", with_fix=True)["FULL"] == LEAKS


def test_a_model_whose_forward_never_reads_the_buffers_is_not_judged(report) -> None:
    assert set(report.outcomes("qwen3_5").values()) == {NOT_AN_INPUT}


def test_the_command_exits_1_and_says_so_in_every_format() -> None:
    def audit(*args):
        return subprocess.run([sys.executable, "-m", "parity", "audit", "--engine", "vllm", *args],
                              capture_output=True, text=True, timeout=300)

    table, as_json = audit("--with-fix"), audit("--format", "json")
    assert (table.returncode, as_json.returncode) == (1, 1), table.stderr
    assert "qwen3_omni_moe_thinker" in table.stdout and "leaks" in table.stdout
    data = json.loads(as_json.stdout)
    assert data["exit_code"] == 1 and data["version"] == VERSION
    assert {"qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe_thinker"} <= {r["module"] for r in data["rows"]}
