"""JUnit XML for CI test reporters: one `<testcase>` per case, its verdict as the outcome.

Outcome mapping, chosen so that no CI consumer shows green for a run that proved nothing:

- `PASS` -> a plain passing testcase.
- `FAIL_*` -> `<failure>`: the runtime was tested and gave a wrong answer.
- `INCOMPLETE`, `INCONCLUSIVE_*` -> `<failure>` as well, NOT `<skipped>`. Jenkins, GitLab, Azure
  DevOps and the common GitHub reporter actions count a skipped test as "not failed", so a gate built
  on the report would go green when an arm never ran or DeepStack had no effect; the exit code (3)
  says "not proven", and the report must not contradict it. `type` carries the exact code, so a
  consumer that wants to tell the two apart still can.
- `ERROR` -> `<error>`: the harness or a backend broke (exit 4), not an assertion about the runtime.
- A run whose verdict is not PASS although every case passed (interrupted, merged without a shard, a
  file that cannot show it is complete) gets one more testcase, "run verdict", failing with that
  verdict: a test view is never green on a run that did not pass.

The document is built with ElementTree, which escapes `& < > "`; characters XML 1.0 cannot carry at
all (ANSI escapes from server logs, NUL) are removed first, since no escaping can make them valid.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from parity.results import CaseResult, RunResult, Verdict
from parity.textfiles import write_atomically
from parity.judge.metrics import tuple_text
from parity.reporting.report import arm_evidence_text, arms_with_labels, check_label, placement, rows
from parity.judge.verdict import ERROR, PASS, judged

SUITE_PREFIX = "parity"

# Everything outside XML 1.0's Char production (tab, newline and carriage return are allowed).
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_CLASSNAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def xml_safe(text: str) -> str:
    return _XML_INVALID.sub("", text)


def junit_xml(run: RunResult | Sequence[RunResult]) -> str:
    """The judged run as a JUnit XML document; several runs (the experiments of a matrix report) are
    one `<testsuite>` each."""
    runs = [run] if isinstance(run, RunResult) else list(run)
    root = ET.Element("testsuites", name=SUITE_PREFIX)
    suites = []
    for run in map(judged, runs):
        suite = ET.SubElement(root, "testsuite", _suite_attributes(run))
        _add_properties(suite, run)
        for case in run.cases:
            _add_testcase(suite, case, _classname(run), run.logprob_tol)
        if _run_verdict_unshown(run):
            _add_run_testcase(suite, run)
        suites.append(suite)
    # The root repeats the totals: some consumers (GitLab) read only the outermost element.
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(sum(int(s.get(key)) for s in suites)))
    root.set("time", _seconds(sum(float(s.get("time")) for s in suites)))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(run: RunResult | Sequence[RunResult], path: str | Path) -> Path:
    """Write the document whole or not at all: a CI reporter must never read half a file."""
    path = Path(path)
    write_atomically(path, junit_xml(run))
    return path


# --- suite ---------------------------------------------------------------------------------------

def _run_verdict_unshown(run: RunResult) -> bool:
    """The run did not pass, but every case did: a stop, a shard merged without, a schema that cannot
    show completeness. A CI test view must not be green then, so the run gets a testcase of its own."""
    return run.verdict.code != PASS and all(case.verdict.code == PASS for case in run.cases)


def _add_run_testcase(suite: ET.Element, run: RunResult) -> None:
    testcase = ET.SubElement(suite, "testcase", name="run verdict", classname=_classname(run), time="0.000")
    element = ET.SubElement(testcase, _outcome_element(run.verdict),
                            message=xml_safe(f"{run.verdict.code}: {run.verdict.reason}"), type=run.verdict.code)
    element.text = xml_safe(run.verdict.reason)


def _suite_attributes(run: RunResult) -> dict[str, str]:
    codes = [case.verdict.code for case in run.cases] + [run.verdict.code] * _run_verdict_unshown(run)
    errors = sum(code == ERROR for code in codes)
    failures = sum(code not in (PASS, ERROR) for code in codes)
    attrs = {
        "name": _suite_name(run),
        "tests": str(len(codes)),
        "failures": str(failures),
        "errors": str(errors),
        "skipped": "0",  # by design: nothing is reported as skipped (see module docstring)
        "time": _seconds(sum(_case_seconds(c) for c in run.cases)),
    }
    stamp = _timestamp(run.created)
    if stamp is not None:
        attrs["timestamp"] = stamp
    return attrs


def _suite_name(run: RunResult) -> str:
    model = str(run.config.get("model", "unknown-model"))
    backend = run.config.get("backend")
    return xml_safe(f"{SUITE_PREFIX} {model}" + (f" ({backend})" if backend else ""))


def _classname(run: RunResult) -> str:
    # Reporters split classname on dots into packages; "Qwen/Qwen3-VL-8B" must stay one segment.
    model = str(run.config.get("model", "unknown-model"))
    return f"{SUITE_PREFIX}.{_CLASSNAME_UNSAFE.sub('_', model).strip('_') or 'model'}"


def _timestamp(created: str) -> str | None:
    # The JUnit schema's timestamp is an ISO 8601 date-time without offset; normalise to UTC.
    try:
        moment = datetime.fromisoformat(created)
    except ValueError:
        return None
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc).replace(tzinfo=None)
    return moment.isoformat(timespec="seconds")


def _add_properties(suite: ET.Element, run: RunResult) -> None:
    props = ET.SubElement(suite, "properties")
    values = {key: run.config.get(key) for key in ("model", "backend", "dtype", "runner", "max_new_tokens")}
    values["ran_on"] = placement(run)  # the graph backend (emulated or CUDA graphs) and the device
    values["device"] = run.environment.get("gpu") or run.environment.get("device")
    values["logprob_tol"] = None if run.before_run else run.logprob_tol
    values["overall_verdict"] = run.verdict.code
    for key, value in values.items():
        if value is not None:
            ET.SubElement(props, "property", name=key, value=xml_safe(str(value)))


# --- cases ---------------------------------------------------------------------------------------

def _case_seconds(case: CaseResult) -> float:
    return sum(arm.seconds + arm.forced_seconds for arm in case.all_arms())


def _seconds(value: float) -> str:
    return f"{value:.3f}"


def _add_testcase(suite: ET.Element, case: CaseResult, classname: str, tol: float) -> None:
    testcase = ET.SubElement(suite, "testcase", name=xml_safe(case.id), classname=classname,
                             time=_seconds(_case_seconds(case)))
    outcome = _outcome_element(case.verdict)
    if outcome is not None:
        element = ET.SubElement(testcase, outcome, message=xml_safe(f"{case.verdict.code}: {case.verdict.reason}"),
                                type=case.verdict.code)
        element.text = xml_safe(case.verdict.reason)
    ET.SubElement(testcase, "system-out").text = xml_safe(_case_log(case, tol))


def _outcome_element(verdict: Verdict) -> str | None:
    if verdict.code == PASS:
        return None
    return "error" if verdict.code == ERROR else "failure"


def _case_log(case: CaseResult, tol: float) -> str:
    """What a reader of the CI log needs: the verdict, every comparison with its expectation, the
    evidence that the path under test ran, arm errors."""
    fixture = "none" if case.fixture is None else f"{case.fixture.name} sha256={case.fixture.sha256}"
    lines = [f"verdict: {case.verdict.code}: {case.verdict.reason}", f"prompt: {case.prompt}", f"fixture: {fixture}"]
    for group, check, comparison in rows(case):
        expected = "match" if check.expect_match else "differ"
        label = check_label(group, check)
        if comparison is None:
            lines.append(f"{label}: not compared (arm missing or failed); expected {expected}")
            continue
        ok = comparison.match == check.expect_match
        lines.append(f"{label} {tuple_text(comparison, tol)} match={comparison.match} "
                     f"expected {expected} [{'ok' if ok else 'UNEXPECTED'}] ({check.meaning})")
    for label, arm in arms_with_labels(case):
        lines.append(f"arm {label} failed: {arm.error}" if arm.failed else f"arm {label}: {arm_evidence_text(arm)}")
    return "\n".join(lines) + "\n"
