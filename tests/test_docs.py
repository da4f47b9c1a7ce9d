"""Every citation in the code resolves in the repository: `design §N` to a heading of
docs/design.md, `<engine notes>.md §N` to a heading of docs/engines/, a `docs/...` path to a file;
and the README's package map names every module."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = re.compile(r"design §(\d+[a-z]?(?:\.\d+)?)")
ENGINE_NOTE = re.compile(r"((?:sglang|vllm)-[\w.]+?\.md) §(\d+(?:\.\d+)?)")
DOC_PATH = re.compile(r"\bdocs/[\w./-]+\.md")


def _sources() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "parity", "tests", "scripts"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    return [ROOT / f for f in listed if f.endswith(".py")]


def _sections(doc: Path) -> set[str]:
    """"4b", "2.3": the numbers that open the document's headings."""
    return {m[1] for m in re.finditer(r"^#+ (\d+[a-z]?(?:\.\d+)*)\.? ", doc.read_text(encoding="utf-8"), re.M)}


def _citations(pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    return [(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m)
            for path in _sources() for text in [path.read_text(encoding="utf-8")] for m in pattern.finditer(text)]


def test_every_design_citation_names_a_section_of_docs_design() -> None:
    sections = _sections(ROOT / "docs" / "design.md")
    cited = _citations(DESIGN)
    assert cited  # the pattern still finds what the code writes
    assert [f"{where}: design §{m[1]}" for where, m in cited if m[1] not in sections] == []


def test_every_engine_note_citation_names_a_section_in_docs_engines() -> None:
    cited = _citations(ENGINE_NOTE)
    assert cited
    missing = [f"{where}: {m[1]} §{m[2]}" for where, m in cited
               if not (ROOT / "docs" / "engines" / m[1]).is_file()
               or m[2] not in _sections(ROOT / "docs" / "engines" / m[1])]
    assert missing == []


def test_every_docs_path_in_the_code_exists() -> None:
    cited = _citations(DOC_PATH)
    assert [f"{where}: {m[0]}" for where, m in cited if not (ROOT / m[0]).is_file()] == []


def test_the_readme_package_map_names_every_module() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    modules = [p.relative_to(ROOT).as_posix() for p in (ROOT / "parity").rglob("*.py")
               if p.name != "__init__.py" and "standin" not in p.parts]
    assert [m for m in modules if f"`{m}`" not in readme and f"`{Path(m).name}`" not in readme] == []


# --- numbers and versions the docs state, held to the code ---------------------------------------

_COUNTS = {"seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}


def test_docs_verdicts_counts_the_scenarios_the_code_has() -> None:
    from parity.results import SCENARIOS

    said = re.search(r"runs all (\w+) scenarios", (ROOT / "docs" / "verdicts.md").read_text(encoding="utf-8"))
    assert said is not None and _COUNTS.get(said[1]) == len(SCENARIOS), (said and said[1], len(SCENARIOS))


def test_the_extras_pin_the_newest_supported_engine_releases() -> None:
    from parity.engines.sglang import versions as sglang_versions
    from parity.engines.vllm import versions as vllm_versions

    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pins = dict(re.findall(r'^(sglang|vllm) = \["(?:sglang|vllm)==([\d.]+)"\]', pyproject, re.M))
    assert pins == {"sglang": sglang_versions.NEWEST.version, "vllm": vllm_versions.NEWEST.version}


def test_the_readme_names_the_supported_vllm_releases_and_the_report_budget() -> None:
    from parity.engines.vllm.versions import supported
    from parity.reporting.report import REPORT_BUDGET

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"`parity/engines/vllm/versions.py`: {supported()})" in readme
    assert f"fits {REPORT_BUDGET:,} characters" in readme
