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


@pytest.fixture(scope="session")
def sglang_port(tmp_path_factory):
    """The installed SGLang with SGLang PR #33726's slot ported (tests/engines/sglang_upstream.py):
    {"fixed": folder, "broken": folder}, each to put first on PYTHONPATH or to audit as folder/sglang."""
    from tests.engines.sglang_upstream import installed_site, ported

    site = installed_site()
    return {name: ported(site, tmp_path_factory.mktemp(f"sglang-{name}"), broken=name == "broken")
            for name in ("fixed", "broken")}
