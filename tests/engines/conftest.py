"""Fixtures every engine test module shares."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_parts():
    from parity.models.tiny import build_config, build_processor, build_tokenizer
    from parity.presets import PRESETS

    tokenizer = build_tokenizer()
    return build_processor(tokenizer), build_config(PRESETS["tiny-qwen3-vl"], tokenizer)


@pytest.fixture(scope="module")
def report(request):
    """`parity audit` of the engine a module's `ENGINE` names, read once per module."""
    from parity.audit.command import run_audit

    return run_audit(request.module.ENGINE)
