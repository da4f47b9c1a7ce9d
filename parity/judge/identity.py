"""What makes results files one experiment: the same model, engine, dtype, tolerances, runner,
graph mode, scenarios, plan and environment (design §8).

Shards of one experiment agree on all of it; anything else is another experiment (another row of
a matrix report), never something to merge. The identity is the whole config and environment, less
what legitimately differs between the machines of one CI matrix: which shard a file is, the
process ids and per-machine memory fraction of its servers, and a GPU run's CPU thread count.
Torch-free.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Iterator, Mapping

from parity import __version__
from parity import registry
from parity.model_identity import CONFIG_KEY as IDENTITY_KEY
from parity.model_identity import CHECKPOINT, read_identity
from parity.results import RunResult

# `environment.parity_source`: the code that wrote a file. Shards of different code are not one
# experiment unless the merge is told so (`--allow-mixed-code`), and then its report says it.
SOURCE_KEY = "parity_source"

# Named first when files differ, in this order: what a reader checks first (the model by its weights).
MODEL_FIELD = "config.model"
FIRST_FIELDS = (
    f"config.{IDENTITY_KEY}", MODEL_FIELD, "config.backend", "config.dtype", "config.logprob_tol", "config.logprob_mean_tol",
    "config.tie_margin", "config.runner", "config.graph_backend", "config.graph_mode",
    *(f"config.{b.servers_key}" for b in registry.BACKENDS.values() if b.servers_key),
    "config.scenarios", "environment.gpu", "environment.device",
)
# Differ between machines of one experiment: where the servers ran, not what was run. The source is
# compared on its own (merge.check_one_experiment), so that the override can name it.
VOLATILE = frozenset({*(f"config.{k}" for b in registry.BACKENDS.values() for k in b.volatile_keys),
                      f"environment.{SOURCE_KEY}"})
_SERVERS_KEYS = frozenset(b.servers_key for b in registry.BACKENDS.values() if b.servers_key)
# Only these keys of config.shard say which experiment a file is; the rest says which shard.
_SHARD_IDENTITY = ("count", "cases")
# Worked out on each machine from the GPU memory free when a server starts (sharing a GPU).
_PER_MACHINE_FLAGS = ("--mem-fraction-static", "--gpu-memory-utilization")


def identity(run: RunResult) -> dict[str, Any]:
    """Field path -> value, for every field that must agree between shards of one experiment."""
    fields: dict[str, Any] = {"schema": run.schema}
    for key, value in run.config.items():
        if key == "shard":
            value = {k: value.get(k) for k in _SHARD_IDENTITY} if isinstance(value, dict) else value
        elif key in _SERVERS_KEYS:
            value = _masked(value)
        fields[f"config.{key}"] = value
    fields.setdefault("config.shard", None)
    try:
        model = read_identity(run.config.get(IDENTITY_KEY))
    except ValueError:  # a /1 file: its name is all there is
        model = None
    if model is not None:  # the weights decide: one checkpoint at two paths is one model
        fields[f"config.{IDENTITY_KEY}"] = model.weights()
        if model.kind == CHECKPOINT:
            fields[MODEL_FIELD] = None
    for key, value in run.environment.items():
        # CPU threads change a CPU run's numerics, not a GPU run's; runners of one pool differ in cores.
        if key == "threads" and run.environment.get("device") == "cuda":
            continue
        fields[f"environment.{key}"] = value
    return {k: v for k, v in fields.items() if k not in VOLATILE}


@functools.lru_cache(maxsize=1)
def source_identity() -> str:
    """`<version>+<sha256 prefix>` of the installed package's Python files: two installs of one
    version from different checkouts are told apart, a wheel and an editable install of one checkout
    are not (their package data lives in different places; a fixture's pixels are in the plan)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{__version__}+{digest.hexdigest()[:16]}"


def model_of(run: RunResult) -> str:
    """The model a run judged, for a message: its identity described, else its name."""
    try:
        return read_identity(run.config.get(IDENTITY_KEY)).describe()
    except ValueError:  # a /1 file, or one built in memory without it
        return repr(run.config.get("model"))


def _masked(servers: Any) -> Any:
    if not isinstance(servers, dict):
        return servers
    out = {}
    for mode, flags in servers.items():
        if isinstance(flags, list):
            flags = ["*" if i and flags[i - 1] in _PER_MACHINE_FLAGS else f for i, f in enumerate(flags)]
        out[mode] = flags
    return out


def _ordered(keys: set[str]) -> Iterator[str]:
    yield from (k for k in FIRST_FIELDS if k in keys)
    yield from sorted(k for k in keys if k not in FIRST_FIELDS)


def first_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """The first field (FIRST_FIELDS first) where two identities differ, or None."""
    return next((k for k in _ordered(set(a) | set(b)) if a.get(k) != b.get(k)), None)


def difference_path(field: str, a: Any, b: Any) -> tuple[str, Any, Any]:
    """The deepest place where two values of `field` differ, and each one's value there: a plan's
    first differing case and key (`config.plan[3] (bands/prompt-1).prompt`), not two long prefixes."""
    path = field
    while True:
        if isinstance(a, dict) and isinstance(b, dict):
            key = next((k for k in [*a, *(k for k in b if k not in a)] if a.get(k) != b.get(k)), None)
            if key is None:
                return path, a, b
            path, a, b = f"{path}.{key}", a.get(key), b.get(key)
        elif isinstance(a, list) and isinstance(b, list) and a and b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if i is None:
                return f"{path} (length {len(a)} vs {len(b)})", len(a), len(b)
            label = f" ({a[i]['id']})" if isinstance(a[i], dict) and isinstance(a[i].get("id"), str) else ""
            path, a, b = f"{path}[{i}]{label}", a[i], b[i]
        else:
            return path, a, b


def shown(value: Any, limit: int = 80) -> str:
    """A value for a one-line message: its repr, cut when long (a plan of many case ids)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
