"""Tensor-parallel servers (design §8): the tap in every rank, every rank's records kept and labelled.

Rules 1b and 4 hold only when every rank that ran the request shows the tap and the replay, and
ranks whose DeepStack fingerprints disagree are ERROR. Shown on hook records built by hand (what
each rank's process appends), then end to end with the stand-in server emitting several ranks'
records: agreeing, one rank silent, one rank disagreeing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from parity.arms import BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO
from parity.errors import ResultsFileError
from parity.results import write_results
from parity.trust.loader import load_results
from parity.engines.evidence import RankDisagreement, TaggedRequest, TapSilence, arm_evidence, check_fired, rank_label
from parity.engines.sglang.plugin import TapEntry
from parity.engines.sglang.servers import ServerFacts, check_gpu_count
from parity.runner.tap import fingerprint
from parity.judge.verdict import judge_run
from tests.helpers_runs import NORMAL_IDS, ZERO_IDS, make_arm, make_case, make_run
from tests.engines.servers import assert_nothing_left
from tests.engines.runs import four_arms, make_backend, run

RAW, BUCKET = 6, 8


def rows(scale: float = 1.0) -> torch.Tensor:
    return torch.arange(RAW * 12, dtype=torch.float32).reshape(RAW, 12) * scale  # [tokens, hidden * n_ds]


def entry(rank: int, extend: bool = True, replay: bool = False, tapped: bool = True, scale: float = 1.0) -> TapEntry:
    record = fingerprint(rows(scale), "normal") if tapped and extend else None
    return TapEntry("t", 4000, f"sglang::scheduler_TP{rank}", extend, BUCKET if replay else RAW, RAW, replay, record)


def request(*entries: TapEntry, image: bool = True) -> TaggedRequest:
    return TaggedRequest(RAW, image, tuple(entries))


def prefill_and_decode(rank: int, decodes: int = 1, **kwargs) -> tuple[TapEntry, ...]:
    return (entry(rank, **kwargs),) + (entry(rank, extend=False, replay=False, tapped=False),) * decodes


# --- check_fired ---------------------------------------------------------------------------------------

def test_agreeing_ranks_pass_and_are_labelled_by_their_process_title():
    check_fired(request(*prefill_and_decode(0), *prefill_and_decode(1)), 3, "request", ranks=2)
    assert rank_label((4000, "sglang::scheduler_TP1")) == "TP1 (pid 4000)"
    assert rank_label((4000, "sglang::scheduler_DP0_TP3")) == "DP0 TP3 (pid 4000)"


def test_a_silent_rank_is_named():
    with pytest.raises(TapSilence, match=r"fired in 1 of the server's 2 tensor-parallel ranks .*TP0 \(pid 4000\)"):
        check_fired(request(*prefill_and_decode(0)), 3, "request", ranks=2)
    check_fired(request(*prefill_and_decode(0)), 3, "request", ranks=1)  # the negative control: one rank expected
    # A rank that records its decode steps but never saw DeepStack in the image prefill.
    with pytest.raises(TapSilence, match=r"in rank TP1 \(pid 4000\).*no DeepStack rows"):
        check_fired(request(*prefill_and_decode(0), *prefill_and_decode(1, tapped=False)), 3, "request", ranks=2)


def test_disagreeing_ranks_are_named_with_their_fingerprints():
    with pytest.raises(RankDisagreement, match=r"different DeepStack inputs .*TP0 \(pid 4000\) sha256 .*TP1"):
        check_fired(request(*prefill_and_decode(0), *prefill_and_decode(1, scale=2.0)), 3, "request", ranks=2)


# --- evidence and the verdict ------------------------------------------------------------------------

def judged(bcg_evidence=None, eager_evidence=None):
    """A four-arm case whose bcg arms (or eager arms) carry the given evidence; a correct answer."""
    def arm(name, ids, evidence):
        return make_arm(name, ids) if evidence is None else make_arm(name, ids, evidence=evidence)

    arms = (arm(EAGER_NORMAL, NORMAL_IDS, eager_evidence), arm(EAGER_ZERO, ZERO_IDS, eager_evidence),
            arm(BCG_NORMAL, NORMAL_IDS, bcg_evidence), arm(BCG_ZERO, ZERO_IDS, bcg_evidence))
    return make_run([make_case(arms)]).verdict


def test_every_rank_must_show_the_replay():
    # One prefill and 4 decode steps per rank: the 5 tokens each arm answers (the loader checks it).
    both = arm_evidence([request(*prefill_and_decode(0, 4, replay=True), *prefill_and_decode(1, 4, replay=True))], 64)
    assert both.prefill_replayed is True and [r.rank for r in both.ranks] == ["TP0 (pid 4000)", "TP1 (pid 4000)"]
    assert judged(bcg_evidence=both).code == "PASS"
    one = arm_evidence([request(*prefill_and_decode(0, replay=True), *prefill_and_decode(1, replay=False))], 64)
    assert one.prefill_replayed is False and one.inconsistency() is None
    assert judged(bcg_evidence=one).code == "INCONCLUSIVE_NOT_REPLAYED"
    # An eager arm that replayed on one rank is not an eager reference either.
    eager = arm_evidence([request(*prefill_and_decode(0), *prefill_and_decode(1, replay=True))], 64)
    assert judged(eager_evidence=eager).code == "INCONCLUSIVE_NOT_REPLAYED"


def test_every_rank_must_show_the_tap():
    silent = arm_evidence([request(*prefill_and_decode(0, replay=True), *prefill_and_decode(1, replay=True,
                                                                                          tapped=False))], 64)
    assert silent.tap_calls == 0 and [r.tap_calls for r in silent.ranks] == [1, 0]
    assert judged(bcg_evidence=silent).code == "ERROR"


def test_one_rank_reads_as_before():
    evidence = arm_evidence([request(*prefill_and_decode(0, replay=True))], 64)
    assert evidence.ranks == () and "ranks" not in evidence.to_json()


def test_rank_evidence_survives_the_file_and_a_lie_is_refused(tmp_path):
    # One prefill and 4 decode steps per rank: the 5 tokens each arm answers (the loader checks it).
    both = arm_evidence([request(*prefill_and_decode(0, 4, replay=True), *prefill_and_decode(1, 4, replay=True))], 64)
    eager = arm_evidence([request(*prefill_and_decode(0, 4, replay=False), *prefill_and_decode(1, 4, replay=False))], 64)
    arms = (make_arm(EAGER_NORMAL, NORMAL_IDS, evidence=eager), make_arm(EAGER_ZERO, ZERO_IDS, evidence=eager),
            make_arm(BCG_NORMAL, NORMAL_IDS, evidence=both), make_arm(BCG_ZERO, ZERO_IDS, evidence=both))
    path = tmp_path / "results.json"
    run = make_run([make_case(arms)], backend="sglang")
    write_results(replace(run, config=MappingProxyType({**run.config, "tp_size": 2})), path)
    loaded = load_results(path)
    assert loaded.cases[0].arm(BCG_NORMAL).evidence == both and judge_run(loaded).verdict.code == "PASS"

    def edit(change):
        doc = json.loads(path.read_text())
        change(doc["cases"][0]["arms"][BCG_NORMAL]["evidence"]["ranks"][1])
        bad = tmp_path / "edited.json"
        bad.write_text(json.dumps(doc))
        return bad

    with pytest.raises(ResultsFileError, match="not those of its ranks"):
        load_results(edit(lambda rank: rank.update(prefill_replayed=False)))
    with pytest.raises(ResultsFileError, match="fingerprints differ"):
        load_results(edit(lambda rank: rank.update(sha256="0" * 64)))


# --- GPUs per server ---------------------------------------------------------------------------------

def test_tp_flags_count_gpus_as_sglang_reads_them():
    for args in (("--tp-size", "2"), ("--tp", "2"), ("--tensor-parallel-size=2",)):
        facts = ServerFacts.parse(args)
        assert (facts.tp_size, facts.gpus_per_server) == (2, 2)
    assert ServerFacts.parse(("--tp", "2", "--dp", "2")).gpus_per_server == 4


def test_gpu_count_is_checked_before_launch():
    tp2 = ServerFacts.parse(("--tp", "2"))
    with pytest.raises(Exception, match="needs 2 GPUs .* but 1 is visible"):
        check_gpu_count(tp2, (), present=1, visible=1)
    with pytest.raises(Exception, match="--gpus 2,3: this machine has 2 GPU"):
        check_gpu_count(tp2, (2, 3), present=2, visible=2)
    check_gpu_count(tp2, (), present=2, visible=2)
    check_gpu_count(tp2, (), present=None, visible=None)  # no nvidia-smi: the launch will say


# --- end to end, with the stand-in's ranks ----------------------------------------------------------

TP2 = {"sglang_args": ("--tp-size", "2"), "gpus": (0, 1, 2, 3)}


def test_stand_in_with_agreeing_ranks_passes_with_every_ranks_evidence(tmp_path: Path, tiny_parts) -> None:
    result = run(make_backend(tmp_path, tiny_parts, "--standin-deepstack-replay", **TP2))
    assert result.verdict.code == "PASS", result.verdict.reason
    for name, arm in four_arms(result).items():
        assert [r.rank.split()[0] for r in arm.evidence.ranks] == ["TP0", "TP1"], name
        assert len({r.sha256 for r in arm.evidence.ranks}) == 1
    write_results(result, tmp_path / "results.json")
    assert judge_run(load_results(tmp_path / "results.json")).verdict.code == "PASS"
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("fault, message", [
    ("--standin-silent-rank", "tap fired in 1 of the server's 2 tensor-parallel ranks"),
    ("--standin-disagreeing-rank", "the ranks saw different DeepStack inputs"),
])
def test_stand_in_with_a_faulty_rank_is_error(tmp_path: Path, tiny_parts, fault, message) -> None:
    # One arm (one server) is enough: the fault is in every server of the run.
    backend = make_backend(tmp_path, tiny_parts, "--standin-deepstack-replay", fault, "1", **TP2)
    result = run(backend, arms="eager_normal")
    assert result.verdict.code == "ERROR" and message in result.verdict.reason, result.verdict.reason
    assert backend.launch_count == 1
    assert_nothing_left(tmp_path)


def test_the_report_names_each_rank():
    from parity.reporting.report import evidence_text

    one = arm_evidence([request(*prefill_and_decode(0, replay=True), *prefill_and_decode(1, replay=False))], 64)
    text = evidence_text(one)
    assert text.startswith("prefill replayed: NO") and "TP0 (pid 4000): replayed yes" in text
    assert "TP1 (pid 4000): replayed no" in text
