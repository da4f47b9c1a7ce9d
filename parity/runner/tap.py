"""The DeepStack tap: the one place that passes, zeroes or fingerprints DeepStack at the LM entry.

Every backend calls `apply_tap` on the live tensor where it is handed to the language model,
outside any captured region: a hook inside a captured graph body sees nothing at replay.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch

from parity.evidence import DeepStackRecord

TapMode = Literal["normal", "zero", "record"]
TAP_MODES: tuple[TapMode, ...] = ("normal", "zero", "record")


def fingerprint(tensor: torch.Tensor, action: str) -> DeepStackRecord:
    data = tensor.detach()
    rows = data.reshape(data.shape[0], -1) if data.dim() else data.reshape(1, 1)
    raw = rows.contiguous().cpu()
    nonzero = (raw != 0).any(dim=1).nonzero().flatten()
    return DeepStackRecord(
        shape=tuple(data.shape),
        dtype=str(data.dtype).removeprefix("torch."),
        nonzero_rows=len(nonzero),
        l2_norm=float(rows.float().norm().item()),
        sha256=hashlib.sha256(raw.view(torch.uint8).numpy().tobytes()).hexdigest(),
        action=action,
        nonzero_span=(int(nonzero[0]), int(nonzero[-1]) + 1) if len(nonzero) else None,
    )


def apply_tap(mode: TapMode, tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, DeepStackRecord | None]:
    """Return the tensor to hand on and, for `zero` and `record`, the fingerprint of what was seen.

    `normal` is a pass-through with no cost; `record` passes through and fingerprints; `zero`
    fingerprints, then hands on zeros of the same shape, dtype and device. No tensor, no record.
    """
    if mode not in TAP_MODES:
        raise ValueError(f"unknown tap mode {mode!r}; known: {', '.join(TAP_MODES)}")
    if tensor is None or mode == "normal":
        return tensor, None
    if mode == "zero":
        return torch.zeros_like(tensor), fingerprint(tensor, "zero")
    return tensor, fingerprint(tensor, "normal")
