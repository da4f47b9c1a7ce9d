"""What the loader holds a server's freshness records to (design §6): SGLang's witness records what
it saw where its replays ran, under the in-process rules with the engine's own graph names; a
server parity does not watch, or an arm that never replayed, records none."""

from __future__ import annotations

import pytest

from parity.evidence import Evidence, InputFreshness
from parity.trust.requirements import _freshness_shape_problem


def arm(*records: InputFreshness, replayed: int = 2, buckets=(48,)) -> Evidence:
    return Evidence(lm_calls=9, replayed_calls=replayed, prefill_replayed=replayed > 0, buckets=buckets, tap_calls=2,
                    freshness=records)


def fresh(graph: str = "prefill 48", name: str = "input_embeds", replays: int = 2) -> InputFreshness:
    return InputFreshness(graph, name, replays, 48 * replays)


def judged(evidence: Evidence, server_witness: bool = True) -> str | None:
    return _freshness_shape_problem(evidence, in_process=False, server_witness=server_witness, poison=False)


def test_a_watched_server_s_records_pass_in_its_own_names() -> None:
    assert judged(arm(fresh(), fresh(name="mrope_positions"), fresh(name="deepstack"))) is None
    assert judged(arm(fresh("prefill 8"), fresh("prefill 8 (chunked_prefix:1)"), buckets=(8,))) is None
    assert judged(arm()) is None  # a witness that recorded nothing: the answers judge
    # vLLM's: its mode in the name, and decode graphs beside the prefill buckets the arm replayed in
    assert judged(arm(fresh("prefill 48 (full)"), fresh("decode 1 (full)", replays=7))) is None


@pytest.mark.parametrize("evidence, server_witness, says", [
    (arm(fresh(), replayed=0, buckets=()), True, "only an arm whose replays parity watched has one"),
    (arm(fresh()), False, "only an arm whose replays parity watched has one"),
    (arm(fresh("context 1"), buckets=(1,)), True, "names graph 'context 1'"),
    (arm(fresh("decode 1 (full)")), True, "covers the graphs of buckets none, but the arm replayed in [48]"),
    (arm(fresh(name="mrope_positions")), True, "without input_embeds"),
    (arm(fresh(), fresh(name="deepstack", replays=1)), True, "counts other replays of the prefill 48 graph"),
    (arm(fresh("prefill 64")), True, "covers the graphs of buckets [64], but the arm replayed in [48]"),
])
def test_a_server_s_records_that_do_not_fit_are_refused(evidence: Evidence, server_witness: bool, says: str) -> None:
    problem = judged(evidence, server_witness)
    assert problem is not None and says in problem, problem
