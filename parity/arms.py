"""Arm definitions: one JSON file per arm under `arms/`, loaded into frozen specs."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping

from parity.data import data_dir
from parity.errors import UsageError

Mode = Literal["eager", "bcg"]
DeepStack = Literal["normal", "zero"]
MODES: tuple[Mode, ...] = ("eager", "bcg")
DEEPSTACK_ACTIONS: tuple[DeepStack, ...] = ("normal", "zero")

# The canonical order of the experiment (design §1); reports and verdicts rely on these names.
EAGER_NORMAL = "eager_normal"
EAGER_ZERO = "eager_zero_deepstack"
BCG_NORMAL = "bcg_normal"
BCG_ZERO = "bcg_zero_deepstack"
ARM_ORDER = (EAGER_NORMAL, EAGER_ZERO, BCG_NORMAL, BCG_ZERO)
# The order arms run in within a case: each comparison's reference runs before the arm compared with it.
RUN_ORDER = (EAGER_NORMAL, EAGER_ZERO, BCG_ZERO, BCG_NORMAL)


@dataclass(frozen=True)
class ArmSpec:
    name: str
    mode: Mode
    deepstack: DeepStack
    description: str
    # Backend-specific settings, e.g. {"sglang": {"server_args": [...]}}; read-only.
    backends: Mapping[str, Mapping] = field(default_factory=lambda: MappingProxyType({}))

    def backend_settings(self, backend: str) -> Mapping:
        return self.backends.get(backend, MappingProxyType({}))


def _parse(path) -> ArmSpec:
    raw = json.loads(path.read_text())
    spec = ArmSpec(
        name=raw["name"],
        mode=raw["mode"],
        deepstack=raw["deepstack"],
        description=raw["description"],
        backends=MappingProxyType({k: MappingProxyType(v) for k, v in raw.get("backends", {}).items()}),
    )
    if spec.mode not in MODES or spec.deepstack not in DEEPSTACK_ACTIONS or spec.name != path.stem:
        raise ValueError(f"arm file {path} is inconsistent: {raw}")
    return spec


@functools.lru_cache(maxsize=None)
def _known_arms() -> tuple[ArmSpec, ...]:
    return tuple(load_arms().values())


def arm_mode_and_deepstack(name: str) -> tuple[str, str]:
    """(mode, deepstack) of a known arm; KeyError for an unknown name."""
    spec = next((s for s in _known_arms() if s.name == name), None)
    if spec is None:
        raise KeyError(name)
    return spec.mode, spec.deepstack


def arm_named(mode: str, deepstack: str) -> str:
    """The known arm that runs `mode` with DeepStack `deepstack`."""
    return next(s.name for s in _known_arms() if (s.mode, s.deepstack) == (mode, deepstack))


def load_arms() -> dict[str, ArmSpec]:
    """All arm definitions shipped with parity, in the experiment's canonical order."""
    specs = {s.name: s for s in map(_parse, sorted(data_dir("arms").glob("*.json")))}
    ordered = [n for n in ARM_ORDER if n in specs] + sorted(set(specs) - set(ARM_ORDER))
    return {n: specs[n] for n in ordered}


def select_arms(selection: str) -> tuple[ArmSpec, ...]:
    """`all` or a comma list of arm names, returned in canonical order."""
    known = load_arms()
    if selection.strip() == "all":
        return tuple(known.values())
    names = [n.strip() for n in selection.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(
            f"unknown arm {', '.join(unknown) or repr(selection)}; known arms: all, {', '.join(known)}"
        )
    return tuple(spec for name, spec in known.items() if name in names)
