"""The DeepStack slot contract (design §6) on plain tensors: the one implementation that parity's
in-process runner and its fix inside SGLang's runner both call (parity/runner/slot_contract.py)."""

from __future__ import annotations

import pytest
import torch

from parity.runner import slot_contract


def slot_with(rows: int = 8, width: int = 6) -> torch.Tensor:
    return torch.full((rows, width), 9.0)  # stale rows from an earlier request


def test_a_fitting_tensor_fills_the_bucket_and_zeroes_its_tail() -> None:
    slot = slot_with()
    live = torch.ones(3, 6)
    slot_contract.refresh(slot, live, bucket=4)
    assert slot[:3].eq(1).all() and slot[3].eq(0).all() and slot[4:].eq(9).all()  # beyond the bucket: not read


def test_absence_zeroes_the_bucket() -> None:
    for absent in (None, torch.empty(0, 6)):
        slot = slot_with()
        slot_contract.refresh(slot, absent, bucket=4)
        assert slot[:4].eq(0).all() and slot[4:].eq(9).all()


@pytest.mark.parametrize("live, bucket, problem", [
    (torch.ones(3, 5), 4, "width 5"),
    (torch.ones(3, 6, dtype=torch.float64), 4, "dtype"),
    (torch.ones(2, 3, 6), 4, "rank 3"),
    (torch.ones(5, 6), 4, "5 rows for a bucket of 4"),
    (torch.ones(3, 6), 16, "exceeds the slot's 8 rows"),
])
def test_a_malformed_tensor_is_refused_before_any_write(live, bucket, problem) -> None:
    slot = slot_with()
    with pytest.raises(RuntimeError, match=problem):
        slot_contract.refresh(slot, live, bucket)
    assert slot.eq(9).all()


def test_the_no_clear_variant_leaks_stale_rows() -> None:
    slot = slot_with()
    slot_contract.refresh(slot, None, bucket=4, clear=False)
    assert slot[:4].eq(9).all()  # what the stream scenario must catch on a real server
    slot_contract.refresh(slot, torch.ones(2, 6), bucket=4, clear=False)
    assert slot[:2].eq(1).all() and slot[2:4].eq(9).all()


def test_an_exact_row_count_is_held_when_the_request_size_is_known() -> None:
    slot = slot_with()
    with pytest.raises(slot_contract.SlotRejected, match="3 rows for a request of 2 tokens"):
        slot_contract.refresh(slot, torch.ones(3, 6), bucket=4, rows=2)
    assert slot.eq(9).all()
