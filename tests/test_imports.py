"""Light commands stay light: what a command imports is what a user waits for.

Each command runs in a fresh interpreter (this test process has torch loaded already), and the test
reads which heavy packages ended up in `sys.modules`.
"""

import json
import subprocess
import sys

import pytest

from parity.results import write_results
from tests.helpers_runs import fixed_arms, legacy_arms, make_case, make_run

HEAVY = ("torch", "transformers", "matplotlib")
_PROBE = f"""
import json, sys
from parity.cli import main
sys.argv = ["parity", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit:
    pass
print("HEAVY=" + json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & {set(HEAVY)!r})))
"""


def heavy_imports(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(args))], capture_output=True, text=True,
                          timeout=120)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("HEAVY="))
    return json.loads(line.removeprefix("HEAVY="))


@pytest.fixture(scope="module")
def results_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("light")
    write_results(make_run([make_case(legacy_arms())]), folder / "before.json")
    write_results(make_run([make_case(fixed_arms())]), folder / "after.json")
    return str(folder / "before.json"), str(folder / "after.json")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["arms"], ["models"], ["fixtures"], ["run", "--help"]])
def test_listing_and_help_import_nothing_heavy(args):
    assert heavy_imports(*args) == []


@pytest.mark.parametrize("command", ["verdict", "report", "compare"])
def test_commands_that_read_results_import_nothing_heavy(results_files, command):
    before, after = results_files
    args = [command, before, after] if command == "compare" else [command, before]
    assert heavy_imports(*args) == []
