"""The vLLM releases parity supports, and every fact parity relies on that differs between them: one
table, so that following a new release is one row here plus its tests (README, "Following a new
engine release"), never an `if version ==` in the modules that patch, tap or audit vLLM.

Each fact was read from the released wheels (docs/engines/vllm-0.33.md, vllm-0.34.md) and is held
to the installed package by tests/engines/test_vllm_real.py in each supported release's
environment. Light: no vLLM, no torch (the backend and the audit read it before anything loads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Release:
    """What one vLLM release has where parity reaches into it."""

    version: str
    # The module of Model Runner V1, which the tap does not wrap (None: V1 was removed, 0.34). Where
    # it exists the CPU servers are told `VLLM_USE_V2_MODEL_RUNNER=1`; 0.34 calls that redundant.
    v1_runner: str | None
    # `--vllm-fix deepstack-clear` was validated on real servers of this release (released FULL and
    # breakable FAIL_STALE_STATE, fixed PASS, eager answers unchanged): only then is it accepted.
    fix_validated: bool
    # It keeps its persistent DeepStack buffers clean across graph steps itself (the rows a step did
    # not write are zero when its forward starts): parity's fix then stands aside, recorded in the
    # run, and the released engine is expected to PASS every scenario it reaches.
    clears_own_buffer: bool = False


# What else moved between the releases, handled by one stand-in or test stub that fits both (so no
# row is needed), for the record: `graph_capture(device=)` (0.33) became `graph_capture(device,
# stream)` (0.34, cpu_patches.cpu_streams takes both); the CPU attention wrappers of the `_C` ops moved
# from `vllm._custom_ops` to `vllm._cpu_ops` (same op names and schemas, cpu_ops.SCHEMAS); V2's graph
# manager keys prefill graphs by `prefill_cudagraph_capture_token_sizes` (0.34), which vLLM still
# fills from `--cudagraph-capture-sizes`; on x86 without Triton 0.34 raises where 0.33 fell back to
# V1 (cpu_patches marks Triton present either way). docs/engines/vllm-0.34.md has the whole diff.


RELEASES: tuple[Release, ...] = (
    Release("0.33.0", v1_runner="vllm.v1.worker.gpu_model_runner", fix_validated=True),
    Release("0.34.0", v1_runner=None, fix_validated=True),
)
SUPPORTED: Mapping[str, Release] = {r.version: r for r in RELEASES}
NEWEST = RELEASES[-1]


def supported() -> str:
    """"0.33.0 and 0.34.0": for messages."""
    versions = [r.version for r in RELEASES]
    return " and ".join([", ".join(versions[:-1]), versions[-1]]) if len(versions) > 1 else versions[0]


def release(version: str | None) -> Release | None:
    """The supported release of that version, or None (not installed, or a release parity does not know)."""
    return SUPPORTED.get(version or "")


def fix_accepted() -> tuple[str, ...]:
    """The releases `--vllm-fix` may be asked on: validated there, or standing aside for the engine's own clear."""
    return tuple(r.version for r in RELEASES if r.fix_validated or r.clears_own_buffer)


def nearest(version: str | None) -> Release:
    """The release whose facts best describe `version`: itself, else the newest parity knows (a
    newer engine is most like the newest release; the tap's contract test says what moved)."""
    return release(version) or NEWEST
