"""The SGLang tap hook on a kwargs dict shaped as prepare_mm_inputs leaves it (no SGLang needed)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parity.sglang import plugin
from parity.sglang.plugin import DEEPSTACK_KEY, TapChannel, TapChannelError, TapHook, TapEntry
from parity.tap import fingerprint

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


def call(hook: TapHook, lm_kwargs: dict, lm: object = None, raw: int | None = RAW) -> None:
    batch = SimpleNamespace(extend_seq_lens_cpu=[raw]) if raw is not None else SimpleNamespace()
    # Positional, exactly like general_mm_embed_routine: (input_ids, forward_batch, lm, kwargs, ...).
    assert hook(None, None, batch, lm if lm is not None else EagerLM(), lm_kwargs, None, None, None, {}, None) is None


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
    call(hook, {DEEPSTACK_KEY: deepstack()[:RAW].clone()})  # eager: raw rows only
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


def test_absent_key_is_ignored_without_reading_control(channel: TapChannel) -> None:
    channel.control_path.write_text("not json")  # would raise if the hook read it
    lm_kwargs = {"positions": None}
    call(TapHook(channel, capturing=lambda: False), lm_kwargs)
    call(TapHook(channel, capturing=lambda: False), {DEEPSTACK_KEY: None})
    assert lm_kwargs == {"positions": None} and not channel.records_path.exists()


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


def test_request_record_counts_entries_of_the_first_rank(channel: TapChannel) -> None:
    first = fingerprint(deepstack()[:RAW], "normal")
    entries = [TapEntry("t", 10, first), TapEntry("t", 11, first), TapEntry("t", 10, first)]
    record = plugin.request_record(entries)
    assert record is not None and record.calls == 2 and record.sha256 == first.sha256
    assert plugin.request_record([]) is None


def test_garbled_control_file_fails_loudly(channel: TapChannel) -> None:
    channel.control_path.write_text('{"mode": "halve", "tag": "x"}')
    with pytest.raises(TapChannelError, match="expected mode and tag"):
        call(TapHook(channel, capturing=lambda: False), {DEEPSTACK_KEY: deepstack()})
    with pytest.raises(ValueError, match="unknown control mode"):
        channel.arm("normal", "x")


def test_inert_without_the_control_variable(tmp_path: Path) -> None:
    assert plugin.activate({}) is None
    # In a fresh interpreter: register() returns without importing sglang or torch.
    code = ("import sys, os; os.environ.pop('PARITY_SGLANG_TAP', None); import parity.sglang.plugin as p; "
            "p.register(); print('sglang' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.split() == ["False", "False"]


def test_register_adds_an_after_hook_on_prepare_mm_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    registry.HookType = SimpleNamespace(AFTER="after")
    registry.HookRegistry = SimpleNamespace(register=lambda target, hook, kind: calls.append((target, hook, kind)))
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", registry)
    monkeypatch.setenv(plugin.ENV_VAR, str(tmp_path / "tap"))

    plugin.register()
    ((target, hook, kind),) = calls
    assert target == "sglang.srt.managers.mm_utils.prepare_mm_inputs" and kind == "after"
    assert isinstance(hook, TapHook) and hook.channel.folder == tmp_path / "tap"
    assert TapChannel(tmp_path / "tap").loaded_pids() != []
