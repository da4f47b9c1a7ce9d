"""The DeepStack replay slot contract (design §6), on plain tensors: one implementation for
parity's in-process graph runner and for parity's fix inside SGLang's prefill runner.

A captured graph reads DeepStack only from its slot, so before every replay the slot's bucket must
hold exactly this batch's rows: the live rows copied, the rest of the bucket zeroed, the whole
bucket zeroed when the batch has no DeepStack; and a live tensor that cannot fit is refused
before anything is written (fail closed). Nothing is imported: tensors come in, so the module
loads inside a server before torch does.
"""

from __future__ import annotations

from typing import Any


class SlotRejected(RuntimeError):
    """The live DeepStack cannot fill the slot; the slot was left untouched and nothing replays."""


def mismatch(slot: Any, live: Any, bucket: int, rows: int | None = None) -> str | None:
    """Why `live` cannot fill `slot`'s first `bucket` rows (with exactly `rows` rows when given);
    None when it fits."""
    if bucket > slot.shape[0]:
        return f"bucket of {bucket} tokens exceeds the slot's {slot.shape[0]} rows"
    if live.dtype != slot.dtype:
        return f"dtype {live.dtype}, expected {slot.dtype}"
    if live.dim() != 2:
        return f"rank {live.dim()} tensor, expected [tokens, {slot.shape[1]}]"
    if live.shape[1] != slot.shape[1]:
        return f"width {live.shape[1]}, expected {slot.shape[1]} (hidden x DeepStack blocks)"
    if live.device != slot.device:
        return f"device {live.device}, expected {slot.device}"
    if rows is not None and live.shape[0] != rows:
        return f"{live.shape[0]} rows for a request of {rows} tokens"
    if live.shape[0] > bucket:
        return f"{live.shape[0]} rows for a bucket of {bucket} tokens"
    return None


def refresh(slot: Any, live: Any, bucket: int, *, rows: int | None = None, clear: bool = True) -> None:
    """Fill `slot`'s bucket before a replay: validate, then copy the live rows and zero the rest.

    `live` None or empty: the batch has no DeepStack, and the bucket is zeroed. A tensor that does
    not fit raises `SlotRejected` before any write. `clear=False` is the buggy variant parity must
    catch: a slot never zeroed, whose stale rows leak into the next batch.
    """
    absent = live is None or live.numel() == 0
    problem = (f"bucket of {bucket} tokens exceeds the slot's {slot.shape[0]} rows" if bucket > slot.shape[0]
               else None) if absent else mismatch(slot, live, bucket, rows)
    if problem is not None:
        raise SlotRejected(f"DeepStack replay input rejected, slot left untouched: {problem}")
    filled = 0 if absent else live.shape[0]
    if filled:
        slot[:filled].copy_(live)
    if clear and bucket > filled:
        slot[filled:bucket].zero_()
