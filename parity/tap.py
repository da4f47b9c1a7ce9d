"""The DeepStack tap: the one place that passes, zeroes or fingerprints DeepStack at the LM entry.

Every backend calls `apply_tap` on the live tensor where it is handed to the language model,
outside any captured region: a hook inside a captured graph body sees nothing at replay.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import torch

TapMode = Literal["normal", "zero", "record"]
TAP_MODES: tuple[TapMode, ...] = ("normal", "zero", "record")


@dataclass(frozen=True)
class DeepStackRecord:
    """Fingerprint of the DeepStack tensor the tap saw, before any zeroing.

    It proves the input was present and non-zero at the LM entry: `nonzero_rows` > 0 and the same
    `sha256` in eager and graph arms means both modes were handed the same features.
    """

    shape: tuple[int, ...]
    dtype: str
    nonzero_rows: int
    l2_norm: float
    sha256: str
    action: str  # what the tap then handed on: "normal" or "zero"
    calls: int = 1  # how many LM entries the tap saw for this request
    replay: bool | None = None  # whether the entry was a graph replay, when the backend knows

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape), "dtype": self.dtype, "nonzero_rows": self.nonzero_rows,
            "l2_norm": self.l2_norm, "sha256": self.sha256, "action": self.action,
            "calls": self.calls, "replay": self.replay,
        }

    @classmethod
    def from_json(cls, raw: dict) -> "DeepStackRecord":
        return cls(
            shape=tuple(int(x) for x in raw["shape"]), dtype=str(raw["dtype"]),
            nonzero_rows=int(raw["nonzero_rows"]), l2_norm=float(raw["l2_norm"]),
            sha256=str(raw["sha256"]), action=str(raw["action"]), calls=int(raw.get("calls", 1)),
            replay=raw.get("replay"),
        )


def fingerprint(tensor: torch.Tensor, action: str) -> DeepStackRecord:
    data = tensor.detach()
    rows = data.reshape(data.shape[0], -1) if data.dim() else data.reshape(1, 1)
    raw = rows.contiguous().cpu()
    return DeepStackRecord(
        shape=tuple(data.shape),
        dtype=str(data.dtype).removeprefix("torch."),
        nonzero_rows=int((rows != 0).any(dim=1).sum().item()),
        l2_norm=float(rows.float().norm().item()),
        sha256=hashlib.sha256(raw.view(torch.uint8).numpy().tobytes()).hexdigest(),
        action=action,
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
