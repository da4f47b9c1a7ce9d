"""The `sglang` backend as the registry knows it: its options, capabilities and hints (design §6).
Light: no SGLang, no torch (the verdict reads it)."""

from __future__ import annotations

from typing import Any, Mapping

import click

from parity.design import PROVES_ENCODER_GRAPH, PROVES_GROWTH, PROVES_SHARED_FORWARD
from parity.capabilities import SERVER_OPTIONS, BackendInfo, EngineOption, server_config_fields
from parity.evidence import Evidence

GRAPH_FLAG = "--cuda-graph-backend-prefill"  # what the bcg server's flags set, and the eager server's do not


def not_replayed_hint(evidence: Evidence | None) -> str:
    tokens = None if evidence is None else evidence.prompt_tokens
    largest = None if evidence is None else evidence.max_bucket
    if tokens is not None and largest is not None and tokens <= largest:
        # A bucket fits, so the server itself did not replay: SGLang turned its prefill graph off
        # (an auto-disable such as torch_native attention) or declined this batch.
        return ("a captured bucket fits the prompt, so the server did not replay it: look for SGLang's "
                "\"Disable prefill CUDA graph because ...\" lines in the bcg server's log (sglang-bcg.log) and "
                "for a flag that turns the prefill graph off (--sglang-arg)")
    return (f"raise --cuda-graph-max-bs-prefill to at least {tokens if tokens is not None else '?'} and do not "
            "disable the prefill CUDA graph (--sglang-arg)")


def graph_label(config: Mapping[str, Any]) -> str | None:
    bcg = (config.get("sglang_servers") or {}).get("bcg")
    if isinstance(bcg, list) and GRAPH_FLAG in bcg[:-1]:
        return f"prefill graph {bcg[bcg.index(GRAPH_FLAG) + 1]}"
    return None


SGLANG = BackendInfo(
    name="sglang", factory="parity.engines.sglang.backend:from_options",
    # SGLang's buckets come from its own flags (--sglang-arg), not --buckets.
    options=frozenset({"graph_backend", "threads", "chunk_size", *SERVER_OPTIONS}),
    runbook="docs/sglang-runbook.md", servers_key="sglang_servers", fix_records_key="sglang_fix_slots", volatile_keys=("sglang_tap_processes",),
    records_ranks=True, version_in_every_run=True, package="sglang", names_its_version=True, witnesses_inputs=True,
    config_fields=server_config_fields("sglang") | {
        "sglang_args", "sglang_prefill_buckets", "sglang_device", "tp_size", "sglang_graph_backend",
        "sglang_server_dtype", "sglang_fix", "sglang_fix_slots"},
    own_options=(
        EngineOption("sglang_args", "--sglang-arg", {
            "multiple": True, "help": "Extra SGLang server flag (repeatable, sglang backend)."}),
        EngineOption("sglang_fix", "--sglang-fix", {
            "type": click.Choice(["deepstack-slot"]), "default": None,
            "help": "Run parity's DeepStack slot fix inside the SGLang servers (the SGLang releases it was "
                    "validated on: 0.5.23; it stands aside, and says so, where the engine carries its own slot)."}),
    ),
    not_replayed_hint=not_replayed_hint, graph_label=graph_label,
    # docs/scenarios.md, "The real engines".
    unreachable={
        PROVES_GROWTH: ("SGLang keeps no DeepStack buffer across batches (prepare_mm_inputs builds one per batch), "
                        "a prefill graph's DeepStack slot is sized once, at the largest captured bucket, and a prompt "
                        "past every bucket runs eagerly, so nothing can grow"),
        PROVES_ENCODER_GRAPH: ("SGLang 0.5.23's vision-encoder graphs (SGLANG_VIT_ENABLE_CUDA_GRAPH, "
                               "srt/multimodal/vit_cuda_graph_runner.py) are not started or recorded by parity yet"),
        PROVES_SHARED_FORWARD: ("parity's SGLang backend submits a sequence's requests one at a time, and records no "
                                "forward's composition yet (the batch scenario runs in-process; docs/scenarios.md)"),
    },
)
