import hashlib

import pytest
import torch

from parity.runner.tap import apply_tap, fingerprint


def _deepstack():
    t = torch.zeros(5, 6)
    t[1:3] = torch.arange(12, dtype=torch.float32).reshape(2, 6) + 1
    return t


def test_zero_hands_on_zeros_and_fingerprints_what_it_saw():
    live = _deepstack()
    out, record = apply_tap("zero", live)
    assert out.shape == live.shape and out.dtype == live.dtype and not out.any()
    assert record.action == "zero" and record.nonzero_rows == 2 and record.shape == (5, 6)
    assert record.l2_norm == pytest.approx(float(live.norm()))
    assert live.any(), "the live tensor itself must not be modified"


def test_record_passes_through_and_hashes_raw_rows():
    live = _deepstack()
    out, record = apply_tap("record", live)
    assert out is live and record.action == "normal" and record.dtype == "float32"
    assert record.sha256 == hashlib.sha256(live.numpy().tobytes()).hexdigest()


def test_normal_and_absent_cost_nothing():
    live = _deepstack()
    assert apply_tap("normal", live) == (live, None)
    assert apply_tap("zero", None) == (None, None)
    with pytest.raises(ValueError):
        apply_tap("drop", live)


def test_bf16_fingerprint_differs_from_fp32():
    live = _deepstack()
    assert fingerprint(live.bfloat16(), "normal").dtype == "bfloat16"
    assert fingerprint(live.bfloat16(), "normal").sha256 != fingerprint(live, "normal").sha256
