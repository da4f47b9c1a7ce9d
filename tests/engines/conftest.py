"""Fixtures every engine test module shares."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_parts():
    from parity.models.tiny import build_config, build_processor, build_tokenizer
    from parity.presets import PRESETS

    tokenizer = build_tokenizer()
    return build_processor(tokenizer), build_config(PRESETS["tiny-qwen3-vl"], tokenizer)
