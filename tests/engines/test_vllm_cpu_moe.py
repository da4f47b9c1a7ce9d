"""vLLM's CPU MoE experts (`CPUUnquantizedExperts`) through parity's stand-ins for the CPU build's two
MoE ops (`parity/engines/vllm/cpu_ops.py`, docs/engines/vllm-cpu.md §8): against transformers' own
sparse block, through the emulated graph, and refusing what they do not compute. No vLLM needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity.engines import standin_calls
from parity.engines.vllm import cpu_ops
from parity.runner.emulated_graph import EmulatedGraph, graph

# fp32 against transformers' own block, computed in another order: rounding only.
NOISE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def ops():
    cpu_ops.install(torch)
    return torch.ops._C


def sparse_block(seed: int, experts: int = 4, top_k: int = 2, hidden: int = 64, inter: int = 32):
    """transformers' own Qwen3-VL-MoE sparse block, random weights: the reference the stand-in must equal.
    Its experts are laid out as vLLM holds them (w13: experts x 2I x H, gate rows first; w2: experts x H x I)."""
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    config = Qwen3VLMoeTextConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                                  num_experts_per_tok=top_k, hidden_act="silu")
    block = Qwen3VLMoeTextSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return block, torch.randn(7, hidden, generator=gen)


def fused_moe(block, x, weights, ids, skip_weighted: bool = False, act: str = "silu"):
    packed13 = torch.empty_like(block.experts.gate_up_proj)
    packed2 = torch.empty_like(block.experts.down_proj)
    torch.ops._C.prepack_moe_weight(block.experts.gate_up_proj.detach(), packed13, "vec")
    torch.ops._C.prepack_moe_weight(block.experts.down_proj.detach(), packed2, "vec")
    output = torch.zeros_like(x)
    torch.ops._C.cpu_fused_moe(output, x, packed13, packed2, None, None, weights, ids, skip_weighted, act, "vec")
    return output


def test_the_moe_experts_equal_transformers_sparse_block() -> None:
    block, x = sparse_block(3)
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        assert (fused_moe(block, x, weights, ids.int()) - block(x[None])[0]).abs().max() < NOISE
        # apply_router_weight_on_input: the weights were applied to the input, so the experts sum unweighted
        unweighted = block.experts(x, ids, torch.ones_like(weights))
        assert (fused_moe(block, x, weights, ids.int(), skip_weighted=True) - unweighted).abs().max() < NOISE


def test_the_moe_experts_read_the_routing_at_replay() -> None:
    """Captured once, replayed after the routing changed in place: each row follows its new experts
    (no count or expert list read on the host at capture)."""
    block, x = sparse_block(4)
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        ids = ids.int()
        packed13, packed2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
        output = torch.zeros_like(x)
        captured = EmulatedGraph()
        with graph(captured):
            torch.ops._C.cpu_fused_moe(output, x, packed13, packed2, None, None, weights, ids, False, "silu", "vec")
        ids.copy_((ids + 1) % 4)  # every token to other experts
        weights.copy_(weights.flip(-1))
        output.zero_()
        captured.replay()
        expected = block.experts(x, ids.long(), weights)
    assert (output - expected).abs().max() < NOISE
    assert [op.func.name() for op in captured._ops].count("_C::cpu_fused_moe") == 1


def test_an_moe_activation_the_standin_does_not_compute_is_logged_and_raised(tmp_path: Path, monkeypatch) -> None:
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv(cpu_ops.ENV_CALLS, str(calls))
    block, x = sparse_block(5)
    with torch.no_grad(), pytest.raises(standin_calls.StandinCalled, match="cpu_fused_moe"):
        _, weights, ids = block.gate(x)
        fused_moe(block, x, weights, ids.int(), act="swigluoai")
    assert "torch.ops._C.cpu_fused_moe (activation 'swigluoai') was called" in cpu_ops.call_log(calls).problem()
