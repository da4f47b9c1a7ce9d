"""The SGLang tap hook on arguments shaped as prepare_mm_inputs gets them, and the evidence parity
assembles from its entries (no SGLang needed; test_sglang_real.py calls the real code)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parity.engines.sglang import plugin
from parity.engines.evidence import TaggedRequest, TapSilence, arm_evidence, check_fired, request_record
from parity.engines.channel import TapChannelError
from parity.engines.sglang.plugin import DEEPSTACK_KEY, TapChannel, TapEntry, TapHook
from parity.runner.tap import fingerprint

RAW, BUCKET, WIDTH = 6, 8, 12  # 6 real tokens padded to an 8-token bucket, 4 x 3 DeepStack


def deepstack() -> torch.Tensor:
    tensor = torch.zeros(BUCKET, WIDTH)  # [bucket_tokens, hidden * n_ds]; the padded tail is zero
    tensor[1:4] = torch.arange(3 * WIDTH, dtype=torch.float32).reshape(3, WIDTH) + 1.0
    return tensor


def replay_lm() -> SimpleNamespace:
    def replay_layer_forward(*_args, **_kwargs):  # what BCG puts on the LM instance
        return None

    return SimpleNamespace(forward=replay_layer_forward)


class EagerLM:
    def forward(self) -> None:  # class method only: nothing in the instance dict
        return None


class Mode:
    def __init__(self, extend: bool) -> None:
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend


def call(hook: TapHook, lm_kwargs: dict, lm: object = None, raw: int | None = RAW, rows: int = BUCKET,
         extend: bool = True) -> None:
    batch = SimpleNamespace(forward_mode=Mode(extend), extend_seq_lens_cpu=[raw] if raw is not None else None)
    input_ids = torch.zeros(rows, dtype=torch.long)  # [tokens]: the bucket under replay
    # Positional, exactly like general_mm_embed_routine: (input_ids, forward_batch, lm, kwargs, ...).
    assert hook(None, input_ids, batch, lm if lm is not None else EagerLM(), lm_kwargs, None, None, None, {},
                None) is None


@pytest.fixture
def channel(tmp_path: Path) -> TapChannel:
    ch = TapChannel(tmp_path / "tap")
    ch.create()
    return ch


def test_zero_replaces_raw_rows_keeps_tail_and_fingerprints_what_it_saw(channel: TapChannel) -> None:
    original = deepstack()
    original[RAW:] = 7.0  # a recognisable tail, to see it is handed on untouched and not hashed
    lm_kwargs = {"positions": None, DEEPSTACK_KEY: original}
    channel.arm("zero", "req-1")
    call(TapHook(channel, capturing=lambda: False), lm_kwargs, lm=replay_lm())

    handed = lm_kwargs[DEEPSTACK_KEY]
    assert handed is not original and handed.shape == original.shape
    assert torch.count_nonzero(handed[:RAW]) == 0
    assert torch.equal(handed[RAW:], original[RAW:])
    assert torch.count_nonzero(original[1:4]) > 0  # the live tensor itself is not modified
    (entry,) = channel.entries("req-1")
    assert entry.record.action == "zero" and entry.record.replay is True
    assert (entry.extend, entry.tokens, entry.raw_tokens, entry.replay) == (True, BUCKET, RAW, True)
    assert entry.pid > 0 and entry.role
    assert entry.record.shape == (RAW, WIDTH)
    assert entry.record.sha256 == fingerprint(original[:RAW], "zero").sha256
    assert entry.record.nonzero_rows == 3


def test_record_passes_the_same_object_and_notes_eager(channel: TapChannel) -> None:
    original = deepstack()
    lm_kwargs = {DEEPSTACK_KEY: original}
    channel.arm("record", "req-2")
    call(TapHook(channel, capturing=lambda: False), lm_kwargs)
    assert lm_kwargs[DEEPSTACK_KEY] is original
    (entry,) = channel.entries("req-2")
    assert entry.record.action == "normal" and entry.record.replay is False and entry.record.nonzero_rows == 3


def test_eager_and_padded_graph_fingerprints_agree_on_raw_rows(channel: TapChannel) -> None:
    hook = TapHook(channel, capturing=lambda: False)
    channel.arm("record", "eager")
    call(hook, {DEEPSTACK_KEY: deepstack()[:RAW].clone()}, rows=RAW)  # eager: raw rows only
    channel.arm("record", "graph")
    call(hook, {DEEPSTACK_KEY: deepstack()}, lm=replay_lm())  # graph: padded to the bucket
    assert channel.entries("eager")[0].record.sha256 == channel.entries("graph")[0].record.sha256


def test_no_control_file_passes_through_and_records_nothing(channel: TapChannel) -> None:
    # The server's warm-up runs before parity arms the channel: it must leave no trace.
    original = deepstack()
    lm_kwargs = {DEEPSTACK_KEY: original}
    call(TapHook(channel, capturing=lambda: False), lm_kwargs)
    assert lm_kwargs[DEEPSTACK_KEY] is original
    assert not channel.records_path.exists()


def test_text_only_and_decode_entries_are_recorded_without_a_tap(channel: TapChannel) -> None:
    # A text-only request in a bcg sequence must still show whether its prefill replayed.
    channel.arm("zero", "text")
    hook = TapHook(channel, capturing=lambda: False)
    lm_kwargs = {"positions": None}
    call(hook, lm_kwargs, lm=replay_lm())  # prefill: no DeepStack key
    call(hook, {DEEPSTACK_KEY: None}, raw=None, rows=1, extend=False)  # a decode step
    assert lm_kwargs == {"positions": None}
    prefill, decode = channel.entries("text")
    assert (prefill.extend, prefill.replay, prefill.tokens, prefill.record) == (True, True, BUCKET, None)
    assert (decode.extend, decode.replay, decode.tokens, decode.record) == (False, False, 1, None)


def test_untagged_calls_never_read_more_than_the_control_file(channel: TapChannel) -> None:
    channel.control_path.write_text("not json")  # a garbled control file is loud, not ignored
    with pytest.raises(TapChannelError):
        call(TapHook(channel, capturing=lambda: False), {"positions": None})
    channel.disarm()
    call(TapHook(channel, capturing=lambda: False), {"positions": None})
    assert not channel.records_path.exists()


def test_capture_in_progress_is_left_alone(channel: TapChannel) -> None:
    original = deepstack()
    lm_kwargs = {DEEPSTACK_KEY: original}
    channel.arm("zero", "req-3")
    call(TapHook(channel, capturing=lambda: True), lm_kwargs)
    assert lm_kwargs[DEEPSTACK_KEY] is original and channel.entries("req-3") == []


def test_kwargs_passed_by_keyword(channel: TapChannel) -> None:
    lm_kwargs = {DEEPSTACK_KEY: deepstack()[:RAW].clone()}
    channel.arm("zero", "req-4")
    hook = TapHook(channel, capturing=lambda: False)
    hook(None, None, forward_batch=SimpleNamespace(extend_seq_lens_cpu=[RAW]), language_model=EagerLM(),
         kwargs=lm_kwargs)
    assert torch.count_nonzero(lm_kwargs[DEEPSTACK_KEY]) == 0 and len(channel.entries("req-4")) == 1


def test_mode_switches_between_requests_and_records_split_by_tag(channel: TapChannel) -> None:
    hook = TapHook(channel, capturing=lambda: False)
    for mode, tag in (("record", "a"), ("zero", "b"), ("record", "c")):
        channel.arm(mode, tag)
        call(hook, {DEEPSTACK_KEY: deepstack()})
        channel.disarm()
    assert [e.record.action for t in "abc" for e in channel.entries(t)] == ["normal", "zero", "normal"]


def entry(pid: int = 10, extend: bool | None = True, replay: bool = False, tapped: bool = True,
          tokens: int = BUCKET) -> TapEntry:
    record = fingerprint(deepstack()[:RAW], "normal") if tapped else None
    return TapEntry("t", pid, "sglang::scheduler", extend, tokens, RAW, replay, record)


def test_request_record_counts_entries_of_the_first_rank() -> None:
    request = TaggedRequest(RAW, True, (entry(10), entry(11), entry(10), entry(10, extend=False, tapped=False)))
    record = request_record(request)
    assert record is not None and record.calls == 2 and record.replay is False
    assert request_record(TaggedRequest(RAW, False, ())) is None


def test_a_chunked_video_s_record_is_of_the_first_chunk_with_features() -> None:
    """Its first chunk holds the template and a timestamp: DeepStack there is all zeros (the tap
    still records it), and the features come with the next chunk, which replayed."""
    empty = TapEntry("t", 10, "sglang::scheduler", True, BUCKET, RAW, False,
                     fingerprint(torch.zeros(RAW, WIDTH), "normal"))
    record = request_record(TaggedRequest(2 * RAW, True, (empty, entry(10, replay=True))))
    assert record is not None and record.nonzero_rows == 3 and record.replay is True and record.calls == 2
    only_zeros = request_record(TaggedRequest(RAW, True, (empty,)))
    assert only_zeros is not None and only_zeros.nonzero_rows == 0  # a request with no features says so


def test_evidence_counts_entries_replays_buckets_and_taps() -> None:
    generation = TaggedRequest(30, True, (entry(replay=True, tokens=32), entry(extend=False, tapped=False)))
    forced = TaggedRequest(36, True, (entry(replay=True, tokens=48),))
    evidence = arm_evidence([generation, forced], max_bucket=64)
    assert (evidence.lm_calls, evidence.replayed_calls, evidence.tap_calls) == (3, 2, 2)
    assert evidence.prefill_replayed is True and evidence.buckets == (32, 48)
    assert (evidence.prompt_tokens, evidence.max_bucket) == (30, 64) and evidence.inconsistency() is None


def test_one_eager_prefill_means_not_replayed_and_names_that_prompt() -> None:
    generation = TaggedRequest(30, True, (entry(replay=True, tokens=32),))
    forced = TaggedRequest(70, True, (entry(replay=False),))  # longer than every bucket
    evidence = arm_evidence([generation, forced], max_bucket=64)
    assert evidence.prefill_replayed is False and evidence.prompt_tokens == 70


def test_batches_that_do_not_say_extend_leave_replay_unknown() -> None:
    evidence = arm_evidence([TaggedRequest(30, True, (entry(extend=None, replay=True),))], max_bucket=64)
    assert evidence.prefill_replayed is None


def test_silent_tap_is_named() -> None:
    with pytest.raises(TapSilence, match="recorded no LM entry"):
        check_fired(TaggedRequest(30, False, ()), 3, "request")
    with pytest.raises(TapSilence, match="no DeepStack rows"):
        check_fired(TaggedRequest(30, True, (entry(tapped=False),)), 3, "request")
    check_fired(TaggedRequest(30, True, (entry(tapped=False),)), 0, "request")  # no DeepStack to see
    check_fired(TaggedRequest(30, False, (entry(tapped=False),)), 3, "request")  # text only


def test_garbled_control_file_fails_loudly(channel: TapChannel) -> None:
    channel.control_path.write_text('{"mode": "halve", "tag": "x"}')
    with pytest.raises(TapChannelError, match="expected mode and tag"):
        call(TapHook(channel, capturing=lambda: False), {DEEPSTACK_KEY: deepstack()})
    with pytest.raises(ValueError, match="unknown control mode"):
        channel.arm("normal", "x")


def test_inert_without_the_control_variable(tmp_path: Path) -> None:
    assert plugin.activate({}) is None
    # In a fresh interpreter: register() returns without importing sglang or torch.
    code = ("import sys, os; os.environ.pop('PARITY_SGLANG_TAP', None); import parity.engines.sglang.plugin as p; "
            "p.register(); print('sglang' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.split() == ["False", "False"]


def test_register_adds_the_tap_the_capture_recorder_and_the_freshness_witness(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from parity.engines.sglang import freshness

    calls = []
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    registry.HookType = SimpleNamespace(AFTER="after", AROUND="around")
    registry.HookRegistry = SimpleNamespace(register=lambda target, hook, kind: calls.append((target, hook, kind)))
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", registry)
    monkeypatch.setenv(plugin.ENV_VAR, str(tmp_path / "tap"))

    plugin.register()
    ((target, hook, kind), (capture_target, recorder, capture_kind), *witness) = calls
    assert [(t, k) for t, _, k in witness] == [(t, "around") for t in freshness.TARGETS.values()]
    assert target == "sglang.srt.managers.mm_utils.prepare_mm_inputs" and kind == "after"
    assert isinstance(hook, TapHook) and hook.channel.folder == tmp_path / "tap"
    assert capture_target.endswith("PrefillCudaGraphRunner.capture") and capture_kind == "after"
    # The recorder writes the runner's buckets where parity reads what a server captured at start-up.
    hook.channel.create()
    assert hook.channel.captured_buckets() is None
    recorder(None, SimpleNamespace(capture_num_tokens=[64, 16, 32]))
    assert hook.channel.captured_buckets() == frozenset({16, 32, 64})


def test_answers_with_non_finite_logprobs_are_rejected() -> None:
    from parity.engines.sglang import client

    doc = {"text": "a", "output_ids": [5], "prompt_token_ids": [1, 2],
           "meta_info": {"output_token_logprobs": [[float("nan"), 5, None]]}}
    with pytest.raises(client.ServerRejected, match="non-finite output logprob"):
        client.parse_completion(doc)
    scores = {"meta_info": {"input_token_logprobs": [[None, 2, None], [float("-inf"), 7, None]]}}
    with pytest.raises(client.ServerRejected, match="non-finite scored logprob"):
        client.parse_scores(scores, [7])
    with pytest.raises(client.ServerRejected, match="misaligned"):
        client.parse_scores(scores, [8])
