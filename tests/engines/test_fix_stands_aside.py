"""When the upstream fix lands (issue 46): parity's fixes recognise an engine that carries DeepStack
itself, and where they bind, prove that the captured graph reads what they bound.

SGLang's hooks run here on a small runner shaped like 0.5.23's `PrefillCudaGraphRunner` where the
hooks touch it (capture -> `_run_forward` -> `_build_layer_model_forward_kwargs` -> the body's
`forward`, then the input_embeds fill before a replay); the same hooks on the real runner, and on
SGLang 0.5.23 patched with PR #33726's slot, run in the SGLang CI stage
(test_sglang_real_server.py, test_sglang_audit.py). Nothing here needs SGLang or vLLM installed.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest
import torch

from parity.engines import fix_records
from parity.engines.sglang import deepstack_slot, server_checks
from parity.engines.sglang import versions as sglang_versions
from parity.engines.vllm import backend as vllm_backend
from parity.engines.vllm import deepstack_clear
from parity.engines.vllm import versions as vllm_versions

HIDDEN, BLOCKS, MAX_TOKENS, BUCKETS = 4, 3, 16, (8, 16)
KWARG = deepstack_slot.DEEPSTACK_KWARG


class Registry:
    """The runner's buffer registry: its named graph slots."""

    def __init__(self, engine_slot: bool) -> None:
        self.slots = {"input_embeds": torch.zeros(MAX_TOKENS, HIDDEN)}
        if engine_slot:
            self.slots[KWARG] = torch.zeros(MAX_TOKENS, HIDDEN * BLOCKS)

    def has_slot(self, name: str) -> bool:
        return name in self.slots

    def get_slot(self, name: str):
        return types.SimpleNamespace(slice_for=lambda bs, tokens: self.slots[name][:tokens])


class Body(torch.nn.Module):
    """The LM body the runner captures: adds DeepStack when it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor | None] = []
        self.embeds: list[torch.Tensor | None] = []

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, input_deepstack_embeds=None):
        self.seen.append(input_deepstack_embeds)
        self.embeds.append(input_embeds)
        return input_embeds


DEEPSTACK_CONFIG = types.SimpleNamespace(vision_config=types.SimpleNamespace(deepstack_visual_indexes=[1, 2, 3]))


class Qwen3VL(torch.nn.Module):
    """The served model as SGLang's Qwen3-VL is: a vision tower, and how many DeepStack blocks it adds."""

    def __init__(self, blocks: int | None = BLOCKS) -> None:
        super().__init__()
        self.visual = torch.nn.Identity()
        if blocks is not None:
            self.num_deepstack_embeddings = blocks


class OmniWrapper(torch.nn.Module):
    """SGLang's Qwen3OmniMoeForConditionalGeneration: it serves its thinker's forward, and only the
    thinker says how many DeepStack blocks it adds."""

    def __init__(self) -> None:
        super().__init__()
        self.thinker = Qwen3VL()


class MtpHead(torch.nn.Module):
    """A draft head (Qwen3_5ForCausalLMMTP): the LM body takes DeepStack, but no tower computes any."""


class Runner:
    """Capture -> _run_forward -> layer kwargs -> body, as SGLang 0.5.23 calls them through its hook
    registry. `engine`: the runner registers and binds its own slot (PR #33726); `overrides`: it
    overwrites the body's DeepStack argument after the kwargs are built without registering a slot
    (what a release with another mechanism could do)."""

    def __init__(self, fix: deepstack_slot.DeepStackSlotFix, engine: bool = False, overrides: bool = False,
                 model: torch.nn.Module | None = None) -> None:
        self.fix, self.engine, self.overrides = fix, engine, overrides
        self.buffer_registry = Registry(engine)
        self.layer_model = Body()
        model = Qwen3VL() if model is None else model
        self.model_runner = types.SimpleNamespace(
            model=model, model_config=types.SimpleNamespace(hidden_size=HIDDEN, hf_config=DEEPSTACK_CONFIG),
            dtype=torch.float32, pp_group=types.SimpleNamespace(is_first_rank=True))
        self.prefill_backend_name, self.device = "breakable", "cpu"
        self.max_num_tokens, self.capture_num_tokens = MAX_TOKENS, list(BUCKETS)

    def capture(self) -> None:
        self.fix.around_capture(lambda runner: [self._forward(n) for n in BUCKETS], self)

    def _forward(self, num_tokens: int):
        return self.fix.around_run_forward(lambda runner, batch, n: self._run_forward(n), self, None, num_tokens)

    def _run_forward(self, num_tokens: int):
        # As 0.5.23's _build_layer_model_forward_kwargs: the embeddings only where the body's
        # signature takes them, so a hook that hides the signature loses them.
        kwargs = {}
        if "input_embeds" in inspect.signature(self.layer_model.forward).parameters:
            kwargs["input_embeds"] = self.buffer_registry.slots["input_embeds"][:num_tokens]
        kwargs = self.fix.after_layer_kwargs(kwargs)
        if self.engine:
            kwargs[KWARG] = self.buffer_registry.get_slot(KWARG).slice_for(1, num_tokens)
        elif self.overrides:
            kwargs[KWARG] = torch.zeros(num_tokens, HIDDEN * BLOCKS)
        return self.layer_model.forward(None, None, None, **kwargs)

    def replay(self, live: torch.Tensor | None, bucket: int) -> None:
        """SGLang fills its input_embeds slot before a replay; the fix's hook runs right after."""
        self.fix.after_fill(None, self, (), {} if live is None else {KWARG: live}, bucket)


def captured(tmp_path: Path, **runner) -> tuple[Runner, list[fix_records.FixRecord]]:
    fix = deepstack_slot.DeepStackSlotFix(deepstack_slot.FIX, tmp_path)
    target = Runner(fix, **runner)
    target.capture()
    return target, fix_records.read_records(tmp_path)


def test_the_fix_binds_its_slot_and_proves_every_captured_body_reads_it(tmp_path: Path) -> None:
    runner, (record,) = captured(tmp_path)
    slot = getattr(runner, deepstack_slot.SLOT_ATTRIBUTE).slot
    assert record.slot == (MAX_TOKENS, HIDDEN * BLOCKS) and not record.stood_aside
    assert (record.captures, record.reads) == (len(BUCKETS), len(BUCKETS))
    assert all(seen.data_ptr() == slot.data_ptr() for seen in runner.layer_model.seen)
    assert "forward" not in vars(runner.layer_model)  # the watch is undone after capture
    # The watch kept the body's signature: every capture still read the engine's input_embeds slot.
    assert all(e is not None and e.data_ptr() == runner.buffer_registry.slots["input_embeds"].data_ptr()
               for e in runner.layer_model.embeds)
    assert server_checks.fix_problem(tmp_path, deepstack_slot.FIX, "bcg") == (None, [record.to_json()])
    live = torch.ones(5, HIDDEN * BLOCKS)
    runner.replay(live, 8)
    assert torch.equal(slot[:5], live) and not slot[5:].any()


def test_the_omni_wrapper_gets_its_thinker_s_slot(tmp_path: Path) -> None:
    """The seed's warning: a model whose DeepStack count lives on a sub-model got no slot, and its
    DeepStack was dropped silently. The slot is sized through the thinker that computes DeepStack."""
    runner, (record,) = captured(tmp_path, model=OmniWrapper())
    slot = getattr(runner, deepstack_slot.SLOT_ATTRIBUTE).slot
    assert record.slot == (MAX_TOKENS, HIDDEN * BLOCKS) and "from its Qwen3VL" in record.note
    assert (record.captures, record.reads) == (len(BUCKETS), len(BUCKETS))
    live = torch.ones(5, HIDDEN * BLOCKS)
    runner.replay(live, 8)
    assert torch.equal(slot[:5], live)


def test_a_slot_sized_from_the_omni_wrapper_is_none_and_drops_deepstack(tmp_path: Path) -> None:
    """The planted Omni bug (`deepstack-slot-wrapper-width`): sized from the wrapper's own count, which
    it has not, the slot is not made, silently; the real servers show the drop it causes
    (test_sglang_real_server.py). The fix proper sizes it through the thinker (the test above)."""
    fix = deepstack_slot.DeepStackSlotFix(deepstack_slot.WRAPPER_WIDTH, tmp_path)
    runner = Runner(fix, model=OmniWrapper())
    runner.capture()
    (record,) = fix_records.read_records(tmp_path)
    assert getattr(runner, deepstack_slot.SLOT_ATTRIBUTE) is None and not record.refused
    assert "no slot: the model has 0 DeepStack blocks" in record.note
    assert all(seen is None for seen in runner.layer_model.seen)  # no capture bound DeepStack


def test_the_omni_body_reads_the_mrope_positions_its_thinker_uses(tmp_path: Path) -> None:
    """SGLang 0.5.23 hands the captured body mRoPE positions only where the model or its
    `language_model` says is_mrope_enabled; Omni's wrapper has neither, so its graph read one-row
    positions. With the fix the body reads the three-row ones; a model whose runner already chose
    them, or that uses none, is left as the runner chose (the negative controls)."""
    fix = deepstack_slot.DeepStackSlotFix(deepstack_slot.FIX, tmp_path)
    batch = types.SimpleNamespace(positions=torch.arange(4), mrope_positions=torch.zeros(3, 4, dtype=torch.long))
    omni = OmniWrapper()
    omni.thinker.is_mrope_enabled = True
    runner = Runner(fix, model=omni)
    assert fix.after_positions(batch.positions, runner, batch) is batch.mrope_positions
    plain = Runner(fix, model=OmniWrapper())  # a thinker without mRoPE
    assert fix.after_positions(batch.positions, plain, batch) is batch.positions
    text = types.SimpleNamespace(positions=batch.positions, mrope_positions=None)
    assert fix.after_positions(batch.positions, runner, text) is batch.positions


def test_a_model_that_computes_deepstack_but_gives_no_width_is_refused_not_given_an_empty_slot(tmp_path: Path):
    fix = deepstack_slot.DeepStackSlotFix(deepstack_slot.FIX, tmp_path)
    with pytest.raises(RuntimeError, match="Qwen3VL computes DeepStack .* neither it nor a sub-model says how many "
                                           "blocks it adds"):
        Runner(fix, model=Qwen3VL(blocks=None)).capture()
    (record,) = fix_records.read_records(tmp_path)
    assert record.refused and record.slot is None and "declares 3 levels" in record.note


def test_a_draft_head_that_computes_no_deepstack_gets_no_slot_and_no_refusal(tmp_path: Path) -> None:
    runner, (record,) = captured(tmp_path, model=MtpHead())
    assert getattr(runner, deepstack_slot.SLOT_ATTRIBUTE) is None and not record.refused
    assert "no slot: the model has 0 DeepStack blocks" in record.note
    assert all(seen is None for seen in runner.layer_model.seen)


def test_a_slot_the_captured_graph_does_not_read_is_not_credited(tmp_path: Path) -> None:
    """The negative control: the runner overwrites the fix's binding (the upstream slot did exactly
    this), so the slot is allocated yet never read; the server check refuses to call the fix in place."""
    _, (record,) = captured(tmp_path, overrides=True)
    assert record.slot is not None and (record.captures, record.reads) == (len(BUCKETS), 0)
    problem, _ = server_checks.fix_problem(tmp_path, deepstack_slot.FIX, "bcg")
    assert problem == (f"parity's deepstack-slot fix allocated its slot, but 2 of 2 captured bodies took another "
                       f"tensor as {KWARG}: the graph does not read parity's slot, so the fix is not in place")


def test_the_fix_stands_aside_for_the_engine_s_own_slot_and_says_so(tmp_path: Path) -> None:
    runner, (record,) = captured(tmp_path, engine=True)
    assert record.stood_aside and record.slot is None and "registers its own input_deepstack_embeds" in record.note
    assert (record.captures, record.reads) == (len(BUCKETS), len(BUCKETS))  # the engine's slot, read
    engine_slot = runner.buffer_registry.slots[KWARG]
    runner.replay(torch.ones(5, HIDDEN * BLOCKS), 8)
    assert not engine_slot.any()  # parity refreshes nothing: the engine's own code does
    assert server_checks.fix_problem(tmp_path, deepstack_slot.FIX, "bcg")[0] is None
    note = fix_records.stood_aside_note([record.to_json()])
    assert note.startswith("parity's deepstack-slot fix stood aside: SGLang's prefill runner registers its own")
    assert "read the engine's own slot in 2 of 2 captures" in note and "not parity's fix" in note
    assert fix_records.stood_aside_note([]) is None


def test_a_release_with_its_own_slot_accepts_the_fix_only_to_stand_aside(tmp_path: Path, monkeypatch) -> None:
    """The release row for the SGLang that ships PR #33726 (own slot, parity's fix not validated):
    --sglang-fix is accepted there; on a model the engine registered no slot for, the fix refuses
    rather than bind unvalidated."""
    future = sglang_versions.Release("0.5.30", own_deepstack_slot=True, fix_validated=False)
    monkeypatch.setattr(sglang_versions, "SUPPORTED", {**sglang_versions.SUPPORTED, future.version: future})
    monkeypatch.setattr(sglang_versions, "RELEASES", (*sglang_versions.RELEASES, future))
    monkeypatch.setattr(deepstack_slot, "installed_sglang", lambda: "0.5.30")
    server_checks.check_fix_version(deepstack_slot.FIX)
    fix = deepstack_slot.activate({deepstack_slot.ENV_FIX: deepstack_slot.FIX}, tmp_path)
    Runner(fix, engine=True).capture()
    with pytest.raises(RuntimeError, match="registered none for this model"):
        Runner(fix).capture()
    aside, refused = fix_records.read_records(tmp_path)
    assert aside.stood_aside and refused.refused
    monkeypatch.setattr(deepstack_slot, "installed_sglang", lambda: "0.5.24")
    with pytest.raises(Exception, match="validated on SGLang 0.5.23, 0.5.30"):
        server_checks.check_fix_version(deepstack_slot.FIX)


def test_the_release_tables_name_the_engines_own_fixes() -> None:
    assert [(r.version, r.own_deepstack_slot) for r in sglang_versions.RELEASES] == [("0.5.23", False)]
    assert sglang_versions.NEWEST.version == server_checks.PACKAGE.version
    assert not any(r.clears_own_buffer for r in vllm_versions.RELEASES)  # 0.33 and 0.34 leak (docs/scenarios.md)


def test_the_vllm_fix_stands_aside_on_a_release_that_clears_its_own_buffer(tmp_path: Path, monkeypatch) -> None:
    cleared = vllm_versions.Release("0.35.0", v1_runner=None, fix_validated=False, clears_own_buffer=True)
    monkeypatch.setattr(vllm_versions, "SUPPORTED", {**vllm_versions.SUPPORTED, cleared.version: cleared})
    monkeypatch.setattr(vllm_versions, "RELEASES", (*vllm_versions.RELEASES, cleared))
    environ = {deepstack_clear.ENV_FIX: deepstack_clear.FIX}
    assert deepstack_clear.activate(environ, tmp_path, version=lambda: "0.35.0") is None  # wraps nothing
    (record,) = fix_records.read_records(tmp_path)
    assert record.stood_aside and "vLLM 0.35.0 clears its own DeepStack buffers" in record.note
    vllm_backend.check_release("0.35.0", deepstack_clear.FIX)  # accepted: it stands aside
    server = types.SimpleNamespace(channel=types.SimpleNamespace(folder=tmp_path),
                                   process=types.SimpleNamespace(name="bcg"))
    owner = types.SimpleNamespace(settings=types.SimpleNamespace(fix=deepstack_clear.FIX), _fix_records={})
    assert vllm_backend.VllmBackend._fix_problem(owner, server) is None
    # The negative control: a release that leaks gets the fix, which wraps vLLM's setter.
    assert isinstance(deepstack_clear.activate(environ, tmp_path, version=lambda: "0.34.0"),
                      deepstack_clear.DeepStackClear)


@pytest.mark.parametrize("backend, key", [("sglang", "sglang_fix_slots"), ("vllm", "vllm_fix_records")])
def test_the_report_says_the_fix_stood_aside_and_that_the_engine_was_judged(backend, key) -> None:
    from dataclasses import replace
    from types import MappingProxyType

    from parity.reporting.report import render_markdown
    from tests.helpers_runs import fixed_arms, make_case, make_run

    run = make_run([make_case(fixed_arms())], backend=backend)
    aside = fix_records.FixRecord(7, "f", None, None, "stood aside: the engine's own slot", stood_aside=True)
    marked = replace(run, config=MappingProxyType({**run.config, key: {"bcg": [aside.to_json()]}, f"{backend}_fix": "f"}))
    assert "parity's f fix stood aside: the engine's own slot. This run judges the engine's own mechanism" in \
        render_markdown(marked)
    assert "stood aside" not in render_markdown(run)  # the negative control: a fix that bound


def test_the_sglang_setup_script_and_ci_install_the_newest_release_of_the_table() -> None:
    """Following SGLang's release that ships its own slot is one row in versions.py and these two pins."""
    import re

    from tests.engines.servers import REPO

    script = (REPO / "scripts" / "setup_sglang_env.sh").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^SGLANG_VERSION=(\S+)$", script, re.M).group(1) == sglang_versions.NEWEST.version
    assert re.search(r"^SGLANG=(\S+)", ci, re.M).group(1) == sglang_versions.NEWEST.version


def _vllm_owner_and_server(tmp_path: Path, *wrapped: str):
    for point in wrapped:
        fix_records.append_record(tmp_path, fix_records.FixRecord(7, deepstack_clear.FIX, None, None, f"wrapped {point}"))
    server = types.SimpleNamespace(channel=types.SimpleNamespace(folder=tmp_path),
                                   process=types.SimpleNamespace(name="bcg"))
    owner = types.SimpleNamespace(settings=types.SimpleNamespace(fix=deepstack_clear.FIX), _fix_records={})
    return owner, server


@pytest.mark.parametrize("setter", vllm_backend.FIX_SETTERS)
def test_the_vllm_fix_is_in_place_with_the_step_and_the_served_model_s_setter(tmp_path: Path, setter: str) -> None:
    """A process wraps the setter of the model it serves (each setter's module is wrapped when it is
    imported): Qwen3-Omni's thinker serves with its own setter wrapped, not Qwen3-VL's."""
    assert len(vllm_backend.FIX_SETTERS) == 4 and any("Qwen3OmniMoeThinker" in s for s in vllm_backend.FIX_SETTERS)
    assert "MossAudioModel._cache_deepstack_input_embeds" in vllm_backend.FIX_SETTERS
    owner, server = _vllm_owner_and_server(tmp_path, "DefaultModelState.prepare_inputs_embeds", setter)
    assert vllm_backend.VllmBackend._fix_problem(owner, server) is None


def test_the_vllm_fix_without_a_wrapped_setter_is_not_in_place(tmp_path: Path) -> None:
    owner, server = _vllm_owner_and_server(tmp_path, "DefaultModelState.prepare_inputs_embeds")
    problem = vllm_backend.VllmBackend._fix_problem(owner, server)
    assert problem is not None and "did not wrap a DeepStack setter" in problem


def test_the_planted_clear_that_skips_the_omni_thinker_leaves_its_rows_and_clears_qwen3_vl_s() -> None:
    """`deepstack-clear-skip-thinker`: a clear written for Qwen3-VL's class alone. The Omni thinker's
    buffers keep an earlier step's rows (the leak the real servers show); Qwen3-VL's are cleared."""
    fix = deepstack_clear.DeepStackClear(None, capturing=lambda: False, variant=deepstack_clear.SKIP_THINKER)
    kept = {}
    for name in (deepstack_clear.OMNI_THINKER, "Qwen3VLForConditionalGeneration"):
        buffers = [torch.ones(4, 2)]
        model = type(name, (), {})()
        model.deepstack_input_embeds = buffers
        fix.step(lambda s: None, types.SimpleNamespace(model=model))
        kept[name] = bool(buffers[0].any())
    assert kept == {deepstack_clear.OMNI_THINKER: True, "Qwen3VLForConditionalGeneration": False}


def test_the_vllm_fix_leaves_a_per_step_attribute_alone(tmp_path: Path) -> None:
    """MossAudio keeps a new IntermediateTensors under the buffers' name each step: no buffer to zero,
    and never a crash of the step (it indexed the mapping as a list of levels before)."""
    fix = deepstack_clear.DeepStackClear(None, capturing=lambda: False)
    attribute = {"deepstack_input_embeds_0": torch.ones(4, 2)}
    state = types.SimpleNamespace(model=types.SimpleNamespace(deepstack_input_embeds=attribute))
    assert fix.step(lambda s: "embeds", state) == "embeds"
    assert torch.equal(attribute["deepstack_input_embeds_0"], torch.ones(4, 2))
    buffers = [torch.ones(4, 2)]  # the negative control: real buffers an earlier step left are zeroed
    state.model = types.SimpleNamespace(deepstack_input_embeds=buffers)
    fix.step(lambda s: None, state)
    assert not buffers[0].any()
