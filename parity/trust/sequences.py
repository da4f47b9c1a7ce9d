"""A sequence case read back (design §6): each request one of its scenario's, in its order, with the
image the scenario sends and the DeepStack action it runs; a request the file lacks counts as not
run (INCOMPLETE), like a missing arm.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from parity.design import EXTENDED_TEXT, LONG_TEXT, OTHER_TEXT, SAME_TEXT, TWIN_IMAGE
from parity.media.fixtures import RESHAPED_SIZES
from parity.results import CASE_IMAGE, SEQUENCE_REQUESTS, CaseResult, FixtureInfo, RequestResult, RequestSpec
from parity.trust.arms import read_arms, read_fixture
from parity.trust.fields import Invalid, get
from parity.judge.verdict import SEQUENCE_POWER_ARM

def read_requests(raw: Any, where: str, scenario: str, fixture: FixtureInfo | None, prompt: str
                  ) -> tuple[RequestResult, ...]:
    """The requests the file holds, in file order; each must be one of the scenario's, in its order."""
    if not isinstance(raw, list) or not raw:
        raise Invalid(f"{where} must be a non-empty list of requests")
    specs = SEQUENCE_REQUESTS[scenario]
    labels = [spec.label for spec in specs]
    requests, last = [], -1
    for i, request in enumerate(raw):
        rwhere = f"{where}[{i}]"
        label = get(request, "label", str, rwhere)
        if label not in labels:
            raise Invalid(f"{rwhere}.label {label!r} is not a request of the {scenario} scenario "
                          f"({', '.join(map(repr, labels))})")
        if labels.index(label) <= last:
            raise Invalid(f"{rwhere}.label {label!r} is repeated or out of order; a {scenario} case holds "
                          f"{', '.join(map(repr, labels))} in that order")
        last = labels.index(label)
        spec = specs[last]
        arms = read_arms(get(request, "arms", dict, rwhere), f"{rwhere}.arms", True)
        # One DeepStack action in both modes; a power request adds its eager zero-DeepStack arm.
        wrong = [a.name for a in arms if a.deepstack != spec.deepstack
                 and not (spec.power and a.name == SEQUENCE_POWER_ARM)]
        if wrong:
            raise Invalid(f"{rwhere}.arms has {', '.join(wrong)}, but the request {label!r} runs DeepStack "
                          f"{spec.deepstack!r} in both modes")
        result = RequestResult(label, read_fixture(request.get("fixture"), f"{rwhere}.fixture"),
                               get(request, "prompt", str, rwhere), arms, spec.deepstack)
        if arms:  # an arm-less request (interrupted) is INCOMPLETE whatever it claims
            _check_request(result, spec, rwhere, fixture, prompt)
        requests.append(result)
    return tuple(requests)


def _check_request(request: RequestResult, spec: RequestSpec, where: str, fixture: FixtureInfo | None,
                   prompt: str) -> None:
    """The request is what its scenario sends: the case's image, its twin, its wide, tall, large or
    small form, or no image; and the case's prompt, or the form of it the scenario sends."""
    got = request.fixture
    if spec.image is None:
        if got is not None:
            raise Invalid(f"{where}.fixture is {got.name!r}, but {spec.label!r} is a text-only request")
        return
    if got is None:
        raise Invalid(f"{where}.fixture is null, but {spec.label!r} is an image request")
    _check_prompt(request.prompt, spec, where, prompt)
    if spec.image in RESHAPED_SIZES:
        if got.size != RESHAPED_SIZES[spec.image]:
            raise Invalid(f"{where}.fixture is {got.size[0]}x{got.size[1]}, but {spec.label!r} sends the "
                          f"{spec.image} form of the case's image ({RESHAPED_SIZES[spec.image][0]}x"
                          f"{RESHAPED_SIZES[spec.image][1]})")
        return
    if fixture is None:
        return
    same = (got.sha256, got.size) == (fixture.sha256, fixture.size)
    if spec.image == CASE_IMAGE and not same:
        raise Invalid(f"{where}.fixture is not the case's image ({fixture.name}, sha256 {fixture.sha256[:12]}…), "
                      f"which {spec.label!r} sends")
    if spec.image == TWIN_IMAGE and (same or got.size != fixture.size):
        raise Invalid(f"{where}.fixture must be the twin of the case's image (same size, other pixels)")


def _check_prompt(sent: str, spec: RequestSpec, where: str, prompt: str) -> None:
    if spec.text == SAME_TEXT and sent != prompt:
        raise Invalid(f"{where}.prompt differs from the case's prompt, which {spec.label!r} sends")
    if spec.text in (EXTENDED_TEXT, LONG_TEXT) and not (sent.startswith(prompt) and len(sent) > len(prompt)):
        raise Invalid(f"{where}.prompt must be the case's prompt lengthened, which {spec.label!r} sends")
    if spec.text == OTHER_TEXT and sent == prompt:
        raise Invalid(f"{where}.prompt is the case's prompt, but {spec.label!r} asks another question")


def completed(case: CaseResult) -> CaseResult:
    """A /2 sequence case with every request of its scenario: one the file lacks has no arms, so
    the verdict counts it like an arm that was not run (INCOMPLETE)."""
    if not case.is_sequence:
        return case
    held = {r.label: r for r in case.requests}
    requests = tuple(held.get(spec.label) or RequestResult(
        spec.label, case.fixture if spec.image == CASE_IMAGE else None,
        case.prompt if spec.image is not None else "", (), spec.deepstack)
        for spec in SEQUENCE_REQUESTS[case.scenario])
    return replace(case, requests=requests)
