"""`parity audit --engine vllm`: vLLM's DeepStack models against its graph modes.

Read from the installed source (docs/engines/vllm-0.33.md §2, §3, vllm-0.34.md §3):
- a model class is served under the architectures `model_executor/models/registry.py` maps to it,
  wherever it lives: `("qwen3_vl", …)` names a module of `model_executor.models`, a full module
  string (`"vllm.models.qwen4_exp"`, 0.34) names a package of its own, whose `__init__` may
  re-export the class lazily;
- it keeps DeepStack in persistent per-model buffers when its class (or an ancestor) defines
  `_set_deepstack_input_embeds`; the step's rows are copied in before the forward, the forward
  reads views of them, and `_clear_deepstack_input_embeds` zeroes them from the Python `forward`;
- NONE runs that `forward`; PIECEWISE runs it between the compiled pieces; FULL and breakable
  graphs replay the whole forward without Python, so the clear never runs there and a later step
  reads rows an earlier one left (a leak, not a drop: the buffers are the graph's own inputs);
- parity's fix (`deepstack_clear.py`) wraps the setters of the classes named in the plugin's targets
  (Qwen3-VL's, the Qwen3-Omni thinker's, Cohere Compass's: every class that defines one) and the
  per-step input preparation: it covers a class whose setter is one of those. A class with a setter
  of its own that no target names is not covered;
- DeepStack kept as an attribute that each step's embedding sets to new tensors and the forward
  reads (MossAudio's audio DeepStack) is no buffer: PIECEWISE passes the step's tensors, FULL and
  breakable graphs read what the attribute held at capture (None), so they drop it; parity's fix
  gives such a class a slot when the plugin's targets name its forward (docs/engines/vllm-0.34.md §6);
- DeepStack that reaches the language model any other way (a per-call tensor) is not analysed.
"""

from __future__ import annotations

from parity.audit.report import COVERED, DROPPED, EAGER, LEAKS, NOT_AN_INPUT, UNKNOWN, AuditRow, ModeCell
from parity.audit.source_index import SourceIndex
from parity.engines.vllm import deepstack_clear, versions
from parity.engines.vllm.plugin import TARGETS

PACKAGE = "vllm"
MODELS = "model_executor.models"
REGISTRY = f"{MODELS}.registry"
SETTER, GET, CLEAR = "_set_deepstack_input_embeds", "_get_deepstack_input_embeds", "_clear_deepstack_input_embeds"
NAMES = frozenset({SETTER, deepstack_clear.BUFFER_ATTR, "use_deepstack", "deepstack_visual_indexes"})
NONE, PIECEWISE, FULL, BREAKABLE = "NONE", "PIECEWISE", "FULL", "breakable"
MODES = (NONE, PIECEWISE, FULL, BREAKABLE)
WHOLE_FORWARD = (FULL, BREAKABLE)  # modes that replay the forward without running its Python


def fixed_classes(method: str) -> tuple[str, ...]:
    """`model_executor.models.qwen3_vl.Qwen3VLForConditionalGeneration`, ...: the classes whose `method`
    parity's fix wraps."""
    return tuple(f"{t.module.removeprefix(PACKAGE + '.')}.{t.cls}" for t in TARGETS if t.method == method and t.fix_wrapper)


def fixed_setters() -> tuple[str, ...]:
    """The classes whose setter parity's fix wraps."""
    return fixed_classes(SETTER)


def audit_rows(index: SourceIndex) -> tuple[tuple[AuditRow, ...], tuple[str, ...]]:
    registry = index.module(REGISTRY)
    if registry is None:
        return (), (f"{REGISTRY} not found: this is not a vLLM parity knows ({versions.supported()})",)
    classes: dict[str, list[str]] = {}
    for node in registry.assignments.values():
        for key, value in zip(getattr(node, "keys", []), getattr(node, "values", [])):
            parts = [getattr(e, "value", None) for e in getattr(value, "elts", [])]
            arch = getattr(key, "value", None)
            if len(parts) == 2 and all(isinstance(p, str) for p in parts) and isinstance(arch, str):
                classes.setdefault(registry_class(*parts), []).append(arch)
    rows = tuple(row for qualname, archs in sorted(classes.items())
                 if (row := _row(index, qualname, tuple(archs))) is not None)
    fixed = ", ".join(f"{name.rsplit('.', 1)[-1]}.{SETTER}" for name in fixed_setters())
    facts = (
        f"{REGISTRY}: the architectures each class serves",
        f"{SETTER} copies a step's rows into the persistent `{deepstack_clear.BUFFER_ATTR}` buffers; "
        f"{CLEAR} zeroes them from the Python forward, which {NONE} and {PIECEWISE} run and "
        f"{FULL} and {BREAKABLE} graphs replay without",
        f"parity's fix wraps {fixed} and DefaultModelState.prepare_inputs_embeds "
        "(parity/engines/vllm/plugin.py TARGETS): it covers the classes that use one of those setters",
    )
    return rows, facts


def registry_class(module: str, name: str) -> str:
    """A registry entry's class, relative to the package root: a bare module names one of
    `model_executor.models`, a full module string (`vllm.models.qwen3_5`) itself."""
    if module.startswith(PACKAGE + "."):
        return f"{module.removeprefix(PACKAGE + '.')}.{name}"
    return f"{MODELS}.{module}.{name}"


def _where(info) -> str:
    """Where a class lives, as rows name it: `qwen3_vl` in `model_executor.models`, else its full
    module (`vllm.models.qwen4_exp.nvidia.model`)."""
    return info.module.removeprefix(MODELS + ".") if info.module.startswith(MODELS + ".") else \
        f"{PACKAGE}.{info.module}"


def _row(index: SourceIndex, qualname: str, archs: tuple[str, ...]) -> AuditRow | None:
    info = index.cls(qualname)
    if info is None or not index.mentions(info.qualname, NAMES):
        return None
    qualname, module, name = info.qualname, _where(info), info.name
    setter = index.defining(qualname, SETTER)
    switch = index.sets(qualname, "use_deepstack")
    forward = index.defining(qualname, "forward")
    calls = forward.methods["forward"].calls if forward else frozenset()
    if switch is not None and switch.constants.get("use_deepstack") is False:
        return _no_input(module, name, archs, "switched off", f"{switch.name} sets use_deepstack = False")
    if setter is None and not index.mentions(qualname, frozenset({deepstack_clear.BUFFER_ATTR})):
        return _no_input(module, name, archs, "not a language-model input", "used outside the LM")
    if setter is None and _per_step_attribute(index, qualname, forward):
        slotted = forward.qualname in fixed_classes("forward")  # the fix gives its attribute a slot
        cells = tuple(_attribute_cell(m, slotted) for m in MODES)
        return AuditRow(module, name, archs, f"LM side input, a per-step attribute (`self.{deepstack_clear.BUFFER_ATTR}` "
                        f"set anew each step, read by {forward.name}.forward)", True, "none (a new tensor each step)",
                        cells, f"{forward.name}.forward: the fix gives it a slot the graphs read" if slotted else
                        "nothing: no buffer to clear, and no slot parity binds for it")
    if setter is None:
        cells = tuple(ModeCell(m, EAGER, EAGER, "no graph") if m == NONE else
                      ModeCell(m, UNKNOWN, UNKNOWN, "DeepStack reaches the LM as a per-call tensor, not the "
                               "buffers the audit knows") for m in MODES)
        return AuditRow(module, name, archs, "LM input, passed another way (no buffers)", True, "not analysed",
                        cells, "nothing it knows to carry")
    if GET not in calls:
        return _no_input(module, name, archs, "computed, never read by its forward",
                         f"{forward.name if forward else name}.forward never calls {GET}: ignored eagerly too")
    cleared_in_forward = CLEAR in calls
    fix_covers = setter.qualname in fixed_setters()
    cells = tuple(_cell(m, cleared_in_forward, fix_covers) for m in MODES)
    buffers = f"`{deepstack_clear.BUFFER_ATTR}`, " + (
        f"cleared by {CLEAR} in {forward.name}.forward" if cleared_in_forward else "never cleared")
    method = f"{setter.name}.{SETTER}: " + ("the one the fix wraps" if fix_covers else "its own, not wrapped")
    return AuditRow(module, name, archs, f"LM side input, buffers ({setter.name}.{SETTER})", True, buffers,
                    cells, method)


def _per_step_attribute(index: SourceIndex, qualname: str, forward) -> bool:
    """DeepStack kept as an attribute that the step's embedding sets to new tensors and the forward
    reads (MossAudio): not a buffer, so a whole-forward graph reads what the attribute held at capture."""
    holder = index.sets(qualname, deepstack_clear.BUFFER_ATTR)
    return (holder is not None and forward is not None
            and deepstack_clear.BUFFER_ATTR in forward.methods["forward"].names
            and any(deepstack_clear.BUFFER_ATTR in m.names for n, m in holder.methods.items() if n != "__init__"))


def _attribute_cell(mode: str, slotted: bool) -> ModeCell:
    if mode == NONE:
        return ModeCell(mode, EAGER, EAGER, "no graph")
    if mode not in WHOLE_FORWARD:
        return ModeCell(mode, COVERED, COVERED, "the Python forward runs every step and passes the step's own tensors")
    why = ("the whole forward replays without Python: it reads the attribute as it was at capture (None: the "
           "forward resets it after every step), so a replay never adds this step's DeepStack")
    return ModeCell(mode, DROPPED, COVERED if slotted else DROPPED, why)


def _no_input(module: str, name: str, archs: tuple[str, ...], how: str, why: str) -> AuditRow:
    cells = tuple(ModeCell(m, NOT_AN_INPUT, NOT_AN_INPUT, why) for m in MODES)
    return AuditRow(module, name, archs, how, False, "none", cells, "nothing to carry")


def _cell(mode: str, cleared_in_forward: bool, fix_covers: bool) -> ModeCell:
    if mode == NONE:
        return ModeCell(mode, EAGER, EAGER, "no graph")
    if mode not in WHOLE_FORWARD and cleared_in_forward:
        return ModeCell(mode, COVERED, COVERED, "the Python forward runs between the pieces and clears the rows")
    fixed = COVERED if fix_covers else LEAKS
    why = ("the whole forward replays, so its clear never runs: later steps read earlier rows"
           if cleared_in_forward else "nothing clears the buffers")
    return ModeCell(mode, LEAKS, fixed, why)
