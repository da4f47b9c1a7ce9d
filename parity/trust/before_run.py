"""A results file whose verdict was found before any arm ran (design §4c): what it may hold, and the
verdict recomputed where parity can.

Such a run compared nothing, so its file holds no case, and its verdict is never PASS. It exists so
that a CI gate finds every shard's file, report and JUnit. What decides it is anchored where it can be:
for an embedded preset the loader judges its definition again (a family without DeepStack, and no
DeepStack block: what `parity.models.check_runnable` finds) and keeps that reason, not the file's.
For a checkpoint, which it cannot load here, and for audio-only cases (which need the model and the
clips), it trusts the stored reason, which can only ever say INCONCLUSIVE.
"""

from __future__ import annotations

from typing import Any, Mapping

from parity import registry
from parity.presets import NO_DEEPSTACK_MODEL_TYPES, PRESETS, no_power_before_any_arm
from parity.results import SCENARIOS, RunResult, Verdict
from parity.trust.fields import Invalid, get

BEFORE_RUN_KEY = "before_run"
CAUSES = ("model", "audio")  # what the verdict rests on: the model's config, or the audio clips
# The config such a file holds: what the run was asked, no more (nothing was measured).
CONFIG_FIELDS: Mapping[str, type] = {"model": str, "backend": str, "dtype": str, "scenarios": list,
                                     "max_new_tokens": int, "shard_asked": str, "cause": str}


def read_before_run(doc: Any, environment: dict) -> RunResult:
    from parity.judge.verdict import INCONCLUSIVE_NO_POWER

    raw = get(doc, BEFORE_RUN_KEY, dict, "document")
    code, reason = get(raw, "code", str, BEFORE_RUN_KEY), get(raw, "reason", str, BEFORE_RUN_KEY)
    if code != INCONCLUSIVE_NO_POWER:
        raise Invalid(f"{BEFORE_RUN_KEY}.code is {code!r}: the only verdict found before any arm is "
                      f"{INCONCLUSIVE_NO_POWER}")
    if get(doc, "cases", list, "document"):
        raise Invalid(f"a file with {BEFORE_RUN_KEY} holds no case: no arm ran")
    config = get(doc, "config", dict, "document")
    for key, value in config.items():
        kind = CONFIG_FIELDS.get(key)
        if kind is None:
            raise Invalid(f"config.{key} is not a field of a verdict before any arm ({', '.join(CONFIG_FIELDS)})")
        get(config, key, kind, "config")
    for key in ("model", "backend", "cause"):
        get(config, key, str, "config")
    if config["backend"] not in registry.BACKENDS:
        raise Invalid(f"config.backend {config['backend']!r} is not a backend parity has")
    if config["cause"] not in CAUSES:
        raise Invalid(f"config.cause must be one of {', '.join(CAUSES)}, got {config['cause']!r}")
    unknown = [s for s in config.get("scenarios") or () if s not in SCENARIOS]
    if unknown:
        raise Invalid(f"config.scenarios: {unknown[0]!r} is not a scenario")
    if config["cause"] == "model":
        reason = recomputed_reason(config["model"], reason)
    return RunResult(created=get(doc, "created", str, "document"), environment=environment, config=config,
                     cases=(), before_run=Verdict(code, reason))


def recomputed_reason(model: str, stored: str) -> str:
    """An embedded preset's judgement, made again from its definition (a family without DeepStack,
    and no DeepStack block); a checkpoint's stored reason (it cannot be loaded here, and the verdict
    it carries is never PASS)."""
    preset = PRESETS.get(model)
    if preset is None:
        return stored
    if preset.model_type in NO_DEEPSTACK_MODEL_TYPES and not preset.deepstack_layers:
        return no_power_before_any_arm(model, preset.model_type)
    raise Invalid(f"{BEFORE_RUN_KEY}: the preset {model!r} adds DeepStack, so its verdict comes from its arms, "
                  "not before them")
