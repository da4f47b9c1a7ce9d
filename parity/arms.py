"""Arm definitions: one JSON file per arm under `arms/`, loaded into frozen specs."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from parity.data import data_dir
from parity.design import ARM_ORDER, BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO, RUN_ORDER  # noqa: F401
from parity.errors import UsageError

class _Named(str, enum.Enum):
    """A name that reads, prints and serializes as its value ("bcg", not "Mode.BCG")."""

    __str__ = str.__str__
    __format__ = str.__format__


class Mode(_Named):
    EAGER = "eager"
    BCG = "bcg"  # the engine's graph mode under test


class DeepStack(_Named):
    """What an arm does with DeepStack at the language model's entry."""

    NORMAL = "normal"
    ZERO = "zero"

    @property
    def tap_mode(self) -> str:
        """What it asks of the tap: pass DeepStack on and fingerprint it, or hand the model zeros."""
        return "record" if self is DeepStack.NORMAL else "zero"


MODES: tuple[Mode, ...] = tuple(Mode)
DEEPSTACK_ACTIONS: tuple[DeepStack, ...] = tuple(DeepStack)


@dataclass(frozen=True)
class Arm:
    """An arm of the experiment: one execution mode and one DeepStack action."""

    name: str
    mode: Mode
    deepstack: DeepStack


_ARMS = {a.name: a for a in (Arm(EAGER_NORMAL, Mode.EAGER, DeepStack.NORMAL), Arm(EAGER_ZERO, Mode.EAGER, DeepStack.ZERO),
                             Arm(BCG_NORMAL, Mode.BCG, DeepStack.NORMAL), Arm(BCG_ZERO, Mode.BCG, DeepStack.ZERO))}


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
    if raw.get("mode") not in MODES or raw.get("deepstack") not in DEEPSTACK_ACTIONS or raw.get("name") != path.stem:
        raise ValueError(f"arm file {path} is inconsistent: {raw}")
    spec = ArmSpec(
        name=raw["name"],
        mode=Mode(raw["mode"]),
        deepstack=DeepStack(raw["deepstack"]),
        description=raw["description"],
        backends=MappingProxyType({k: MappingProxyType(v) for k, v in raw.get("backends", {}).items()}),
    )
    if _ARMS.get(spec.name) != Arm(spec.name, spec.mode, spec.deepstack):
        raise ValueError(f"arm file {path} says {spec.name} is {spec.mode} {spec.deepstack}; parity's design "
                         "(parity.arms) says otherwise")
    return spec


def arm(name: str) -> Arm:
    """The arm of that name; KeyError for a name parity does not know."""
    return _ARMS[name]


def arm_for(mode: str, deepstack: str) -> Arm:
    """The arm that runs `mode` with DeepStack `deepstack`."""
    return next(a for a in _ARMS.values() if (a.mode, a.deepstack) == (mode, deepstack))


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
