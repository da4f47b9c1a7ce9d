"""The `vllm` backend as the registry knows it: its options, capabilities and hints (design §6).
Light: no vLLM, no torch (the verdict reads it)."""

from __future__ import annotations

import click

from parity.design import PROVES_ENCODER_GRAPH, PROVES_GROWTH, PROVES_SHARED_FORWARD
from parity.capabilities import SERVER_OPTIONS, BackendInfo, EngineOption, server_config_fields
from parity.evidence import Evidence

GRAPH_MODE_NAMES = ("full_and_piecewise", "full", "piecewise", "breakable")  # servers.GRAPH_MODES, in order


def not_replayed_hint(evidence: Evidence | None) -> str:
    tokens = "?" if evidence is None or evidence.prompt_tokens is None else evidence.prompt_tokens
    return (f"use --buckets auto or a capture size of at least {tokens}, keep --max-num-batched-tokens above it, "
            "and check that the attention backend allows the --graph-mode for prefills (vLLM's dispatcher "
            "decided NONE)")


VLLM = BackendInfo(
    name="vllm", factory="parity.engines.vllm.backend:from_options",
    options=frozenset({"buckets", "graph_backend", "threads", "chunk_size", *SERVER_OPTIONS}),
    runbook="docs/vllm-runbook.md", servers_key="vllm_servers", fix_records_key="vllm_fix_records", volatile_keys=("vllm_tap_processes",),
    package="vllm", names_its_version=True, witnesses_inputs=True,
    config_fields=server_config_fields("vllm") | {
        "engine", "engine_version", "graph_mode", "graph_cudagraph_modes", "graph_breakable", "vllm_server_env",
        "vllm_args", "vllm_capture_sizes", "vllm_fix", "vllm_fix_records", "vllm_device", "vllm_graph_backend",
        "vllm_compile_mode"},
    own_options=(
        EngineOption("vllm_args", "--vllm-arg", {
            "multiple": True,
            "help": "Extra `vllm serve` flag for both servers (repeatable, vllm backend); flags parity sets are "
                    "refused."}),
        EngineOption("vllm_fix", "--vllm-fix", {
            "type": click.Choice(["deepstack-clear"]), "default": None,
            "help": "Run parity's DeepStack clear fix inside the vLLM servers (the vLLM releases it was "
                    "validated on: 0.33.0 and 0.34.0)."}),
        EngineOption("graph_mode", "--graph-mode", {
            "type": click.Choice(GRAPH_MODE_NAMES), "default": "full_and_piecewise", "show_default": True,
            "help": "vllm backend: the graph server's mode (the eager server runs -cc.cudagraph_mode=NONE)."}),
    ),
    not_replayed_hint=not_replayed_hint,
    # docs/scenarios.md, "The real engines".
    unreachable={
        PROVES_GROWTH: ("vLLM (0.33, 0.34) sizes its DeepStack buffers once, at --max-num-batched-tokens rows "
                        "(Qwen3VLForConditionalGeneration.__init__), and chunks every longer prefill to fit them, "
                        "so they never grow"),
        PROVES_ENCODER_GRAPH: ("vLLM's vision-encoder graphs (-cc.cudagraph_mm_encoder, "
                               "v1/worker/encoder_cudagraph.py) are not started or recorded by parity yet"),
        PROVES_SHARED_FORWARD: ("parity's vLLM backend submits a sequence's requests one at a time, and records no "
                                "forward's composition yet (the batch scenario runs in-process; docs/scenarios.md)"),
    },
)
