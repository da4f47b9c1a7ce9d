"""`parity audit --engine sglang`: SGLang's DeepStack models against its prefill graph runner.

Read from the installed source (docs/engines/sglang-0.5.23.md §1.2, §3, §6):
- a model class is served under its own name (`EntryClass`); it consumes DeepStack as a side input
  when the language model the runner captures takes `input_deepstack_embeds`. The runner finds that
  module the way `model_loader/utils.py::resolve_language_model` and the runner's
  `_resolve_transformer_layer_model` do: the Omni wrapper's `thinker.model`, else `model`, else
  `language_model`, then `.model` until a module has `layers`;
- without a flag, the breakable prefill graph serves a multimodal model only when its architecture
  is on `configs/model_config.py::multimodal_breakable_cuda_graph_supported_model_archs`; an
  explicit `--cuda-graph-backend-prefill breakable|full` skips that list;
- `PrefillCudaGraphRunner.can_replay_locally` keeps a multimodal prefill eager for the
  architectures of `is_qwen4_exp` (breakable) and under FA4 (full);
- the runner binds at capture only what `_build_layer_model_forward_kwargs` names: when DeepStack is
  not among them, a replayed prefill drops it silently;
- the release that carries SGLang PR #33726 gives the runner its own DeepStack slot: a module
  function (or runner method) `_refresh_deepstack_replay_slot` that the runner calls before each
  replay, an `input_deepstack_embeds` slot it registers for a model class whose
  `supports_bcg_deepstack_replay` is True (set on the class or an ancestor). Such a model is
  "carried (engine)" wherever it replays, with parity's fix too (the fix stands aside there); a
  refresh that is defined but never called carries nothing;
- parity's fix (`deepstack_slot.py`) sizes its slot from `num_deepstack_embeddings` of the object
  that computes DeepStack (the served model, or the sub-model it serves through: the Omni wrapper's
  thinker) and binds it as the body's `input_deepstack_embeds`; a class that computes DeepStack and
  sets the count nowhere is refused at capture;
- a class whose body takes `input_deepstack_embeds` but that never passes it and builds no vision
  tower (`Qwen3_5ForCausalLMMTP`, a draft head fed the target model's hidden states) has nothing to
  carry.
DeepStack is a per-batch tensor in SGLang 0.5.23, not a buffer kept across steps: nothing to clear.
"""

from __future__ import annotations

from parity.audit.report import CARRIED_ENGINE, COVERED, DROPPED, EAGER, NOT_AN_INPUT, UNKNOWN, AuditRow, ModeCell
from parity.audit.source_index import SourceIndex, literal_strings
from parity.engines.sglang.deepstack_slot import BLOCKS_ATTRIBUTE, DEEPSTACK_KWARG, REPLAYING_BACKENDS

PACKAGE = "sglang"
MODELS = "srt.models"
CONFIG = "srt.configs.model_config"
RUNNER_MODULE = "srt.model_executor.runner.prefill_cuda_graph_runner"
RUNNER = f"{RUNNER_MODULE}.PrefillCudaGraphRunner"
ALLOWLIST = "multimodal_breakable_cuda_graph_supported_model_archs"
NAMES = frozenset({DEEPSTACK_KWARG, "use_deepstack", BLOCKS_ATTRIBUTE, "deepstack_visual_indexes",
                   "separate_deepstack_embeds"})
DEFAULT_BREAKABLE, EXPLICIT_BREAKABLE, EXPLICIT_FULL = "breakable (default)", "breakable (explicit)", "full (explicit)"
MODES = (DEFAULT_BREAKABLE, EXPLICIT_BREAKABLE, EXPLICIT_FULL)
OMNI_WRAPPER = "Qwen3OmniMoeForConditionalGeneration"  # resolve_language_model's one named case
REFRESH = "_refresh_deepstack_replay_slot"  # SGLang PR #33726: the engine's own slot refresh
OPT_IN = "supports_bcg_deepstack_replay"  # ... and the model class's opt-in to it


class RunnerFacts:
    """What the installed runner and config decide for every model."""

    def __init__(self, index: SourceIndex) -> None:
        config = index.module(CONFIG)
        runner = index.cls(RUNNER)
        self.found = config is not None and runner is not None and "can_replay_locally" in runner.methods
        self.allowlist = literal_strings(config.assignments.get(ALLOWLIST)) if config else ()
        qwen4 = config.functions.get("is_qwen4_exp") if config else None
        gate = runner.methods["can_replay_locally"].names if self.found else frozenset()
        # The breakable gate holds for multimodal batches when can_replay_locally checks the
        # side-channel flag that __init__ derives from is_qwen4_exp.
        self.breakable_gated = qwen4.strings if qwen4 and {"contains_mm_inputs", "_qwen_bcg_hc_sidechannel"} <= gate \
            else frozenset()
        self.full_fa4_gate = {"contains_mm_inputs", "_fa4_prefill"} <= gate
        module = index.module(RUNNER_MODULE)
        binder = module.functions.get("_build_layer_model_forward_kwargs") if module else None
        self.engine_slot = binder is not None and any("deepstack" in n for n in binder.names)
        # PR #33726's slot: the refresh exists, the runner calls it, and the runner gates it on the opt-in.
        defined = module is not None and (REFRESH in module.functions or (runner is not None and REFRESH in runner.methods))
        called = runner is not None and any(REFRESH in m.calls for m in runner.methods.values())
        # A runner gated on the opt-in binds a slot of its own for the models that opt in, and parity's fix
        # stands aside there, refreshed or not.
        self.own_slot = runner is not None and OPT_IN in runner.names
        self.refresh = "called" if defined and called else "uncalled" if defined else None

    def lines(self) -> tuple[str, ...]:
        if not self.found:
            return (f"{RUNNER}.can_replay_locally or {CONFIG} not found: this is not the SGLang parity "
                    "knows (0.5.23); every replaying cell is not analysed",)
        slot = ("binds DeepStack" if self.engine_slot else
                f"binds no DeepStack (only input_embeds and pp proxies): a replayed prefill drops "
                f"{DEEPSTACK_KWARG} silently")
        if not self.own_slot:
            own = f"has no DeepStack slot of its own ({OPT_IN} is not read: SGLang PR #33726 is not in this release)"
        elif self.refresh == "called":
            own = (f"registers its own {DEEPSTACK_KWARG} slot for a model class with {OPT_IN} = True, binds it at "
                   f"capture and calls {REFRESH} before every replay (SGLang PR #33726)")
        else:
            own = (f"binds an {DEEPSTACK_KWARG} slot of its own for a model class with {OPT_IN} = True but never "
                   f"calls {REFRESH} before a replay: the graph reads the slot as captured")
        return (
            f"{RUNNER} {own}",
            f"{CONFIG}.{ALLOWLIST} holds {len(set(self.allowlist))} architectures; the breakable prefill "
            "graph serves other multimodal architectures only when asked for explicitly",
            f"{RUNNER}.can_replay_locally keeps multimodal prefills eager under breakable for "
            f"{', '.join(sorted(self.breakable_gated)) or 'no architecture'}"
            + (" and under full with FA4 attention" if self.full_fa4_gate else ""),
            f"{RUNNER_MODULE}._build_layer_model_forward_kwargs {slot}",
            "DeepStack is a per-batch tensor (mm_utils.general_mm_embed_routine), kept in no buffer across "
            "steps: nothing to clear; parity's slot is zeroed for a batch without DeepStack",
        )


def audit_rows(index: SourceIndex) -> tuple[tuple[AuditRow, ...], tuple[str, ...]]:
    facts = RunnerFacts(index)
    rows = []
    for module in index.modules_under(MODELS):
        for name in _entry_classes(module):
            row = _row(index, facts, f"{module.name}.{name}")
            if row is not None:
                rows.append(row)
    return tuple(rows), facts.lines()


def _entry_classes(module) -> tuple[str, ...]:
    node = module.assignments.get("EntryClass")
    if node is None:
        return ()
    elements = getattr(node, "elts", [node])
    return tuple(getattr(e, "id", "") for e in elements if getattr(e, "id", "") in module.classes)


def _row(index: SourceIndex, facts: RunnerFacts, qualname: str) -> AuditRow | None:
    subs = index.built(qualname)
    mentioned = index.mentions(qualname, NAMES).union(*(index.mentions(s, NAMES) for s in subs.values()))
    if not mentioned:
        return None
    module, name = qualname.rsplit(".", 2)[-2:]
    body = _layer_model(index, qualname)
    forward = index.defining(body, "forward") if body else None
    side_input = forward is not None and DEEPSTACK_KWARG in forward.methods["forward"].params
    if side_input:
        how = f"LM side input `{DEEPSTACK_KWARG}` ({forward.name}.forward)"
    else:
        how = "not a language-model input (used outside the LM)"
    # What parity's slot is sized through (deepstack_slot.deepstack_holder): the served class, else
    # the sub-model it serves through (the Omni wrapper's thinker).
    blocks_from = index.sets(qualname, BLOCKS_ATTRIBUTE)
    through = None if blocks_from else next(((attr, sub.rsplit(".", 1)[-1], index.sets(sub, BLOCKS_ATTRIBUTE).name)
                                             for attr, sub in subs.items() if index.sets(sub, BLOCKS_ATTRIBUTE)), None)
    # A class that reuses a DeepStack body but never passes DeepStack to it, and builds no vision tower
    # (an MTP draft head: its body gets the target model's hidden states): nothing reaches the LM.
    never_passed = (side_input and blocks_from is None and through is None and "visual" not in subs
                    and not index.mentions(qualname, NAMES))
    fix_covers = side_input and (blocks_from is not None or through is not None)
    opts_in = index.sets(qualname, OPT_IN)
    own_slot = facts.own_slot and opts_in is not None and opts_in.constants.get(OPT_IN) is True
    own = None if not own_slot else (f"{OPT_IN} = True on {opts_in.name}", facts.refresh == "called")
    if never_passed:
        how += f", never passed by {name}: it builds no vision tower and computes no DeepStack (a draft head)"
        method, side_input = "nothing to carry", False
    elif not side_input:
        method = "nothing to carry"
    elif own is not None:
        method = f"nothing: it stands aside for the engine's own slot ({own[0]})"
    elif blocks_from is not None:
        method = f"`{BLOCKS_ATTRIBUTE}` (set by {blocks_from.name}) and `{DEEPSTACK_KWARG}`: present"
    elif through is not None:
        attr, sub, setter = through
        method = (f"`{BLOCKS_ATTRIBUTE}` on its {attr} ({sub}, set by {setter}), which the slot is sized through, "
                  f"and `{DEEPSTACK_KWARG}`: present")
    else:
        method = (f"`{BLOCKS_ATTRIBUTE}` on {name} and its sub-models: absent, so the fix refuses it at capture "
                  "(no slot can be sized)")
    modes = tuple(_cell(mode, facts, name, side_input, fix_covers, own) for mode in MODES)
    return AuditRow(module, name, (name,), how, side_input, "none (a per-batch tensor)", modes, method)


def _cell(mode: str, facts: RunnerFacts, arch: str, side_input: bool, fix_covers: bool,
          own: tuple[str, bool] | None) -> ModeCell:
    """`own`: the model's opt-in to the engine's own slot, and whether the runner refreshes it."""
    if not side_input:
        return ModeCell(mode, NOT_AN_INPUT, NOT_AN_INPUT, "no DeepStack reaches the language model: nothing to carry")
    if not facts.found:
        return ModeCell(mode, UNKNOWN, UNKNOWN, "the runner is not the one parity knows")
    if mode == DEFAULT_BREAKABLE and arch not in facts.allowlist:
        return ModeCell(mode, EAGER, EAGER, f"{arch} is not on {ALLOWLIST}: prefill graph disabled")
    if mode != EXPLICIT_FULL and arch in facts.breakable_gated:
        return ModeCell(mode, EAGER, EAGER, "can_replay_locally keeps its multimodal prefills eager")
    if own is not None:  # parity's fix stands aside for the engine's slot (deepstack_slot.py): one outcome
        opted, refreshed = own
        if refreshed:
            return ModeCell(mode, CARRIED_ENGINE, CARRIED_ENGINE, f"replayed; {RUNNER_MODULE}.{REFRESH} refreshes "
                            f"the engine's own {DEEPSTACK_KWARG} slot before every replay ({opted})")
        return ModeCell(mode, DROPPED, DROPPED, f"replayed; the engine binds its own {DEEPSTACK_KWARG} slot ({opted}) "
                        f"but never calls {REFRESH}, so the graph reads it as captured; parity's fix stands aside")
    engine = COVERED if facts.engine_slot else DROPPED
    backend = "full" if mode == EXPLICIT_FULL else "breakable"
    fixed = COVERED if facts.engine_slot or (fix_covers and backend in REPLAYING_BACKENDS) else DROPPED
    why = ("replayed with DeepStack bound" if engine == COVERED else
           "replayed; the captured body has no DeepStack input, so DeepStack is dropped silently")
    if mode == EXPLICIT_FULL and facts.full_fa4_gate:
        why += " (eager under FA4 attention)"
    return ModeCell(mode, engine, fixed, why)


def _layer_model(index: SourceIndex, qualname: str) -> str | None:
    subs = index.built(qualname)
    if qualname.endswith("." + OMNI_WRAPPER) and "thinker" in subs:
        current = index.submodel(subs["thinker"], "model")
    else:
        current = index.submodel(qualname, "model") or index.submodel(qualname, "language_model")
    seen: set[str] = set()
    while current and current not in seen and not index.sets(current, "layers"):
        seen.add(current)
        current = index.submodel(current, "model") or current
    return current
