"""Torch-native stand-ins for the compiled ops of vLLM's CPU build, for the servers parity starts on a CPU.

The PyPI vLLM wheel is the CUDA build: its CPU extension (`vllm._C` with the CPU kernels) is absent,
yet the CPU worker, CPU attention and CPU MoE call seven of its ops (docs/engines/vllm-cpu.md §2-3). They are
registered here, with `torch.library`, in the `_C` namespace of the server processes only (parity's
start-up hook, `standin/sitecustomize.py`); nothing is installed over vLLM.

- `init_cpu_memory_env`: NUMA memory binding; nothing to do for one process on one node.
- `weak_ref_tensor`: an alias of its input (declared as one, so a graph recorder treats it as a view).
- `get_scheduler_metadata`: the compiled kernel's work split; the stand-in attention needs none.
- `cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`: a paged attention that reads every
  bound (`query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`) from its tensors when it
  runs. Recorded whole by an emulated graph and re-run at replay, it sees each replay's refreshed
  metadata, as a graph-capable attention kernel (FA3) does on a GPU.
- `prepack_moe_weight`, `cpu_fused_moe`: the unquantized experts of `CPUUnquantizedExperts` (every
  ISA class: `vec`, `amx`, `neon`, `vsx`). The stand-in keeps vLLM's layout as it is (the "packing"
  is a copy) and computes each token's routed experts from `topk_ids` and `topk_weights` when it
  runs, with no count read on the host: a replay recomputes the routing of the replayed rows.

What the stand-in attention cannot compute faithfully (ALiBi, soft-capping, sinks, sliding windows,
a bidirectional mask given as a tensor, a quantized KV cache) is never approximated: such a call is
written to the call log (`PARITY_VLLM_STANDIN_CALLS`) and raises, so the run is an `ERROR` naming
the op (`parity/engines/standin_calls.py`).
"""

from __future__ import annotations

import os
from typing import Any

from parity.engines import standin_calls

ENV_CALLS = "PARITY_VLLM_STANDIN_CALLS"  # a file: one JSON line per unfaithful call
NAMESPACE = "_C"
PACKAGE = "vllm._C"
# The KV cache dtypes the stand-in stores as they are (vLLM's "auto" is the model's dtype).
PLAIN_KV_DTYPES = frozenset({"auto", "bfloat16", "float16", "float32"})

SCHEMAS = {
    "init_cpu_memory_env": "init_cpu_memory_env(int[] nodes) -> ()",
    "weak_ref_tensor": "weak_ref_tensor(Tensor(a) tensor) -> Tensor(a)",
    "get_scheduler_metadata": (
        "get_scheduler_metadata(int num_reqs, int num_heads, int num_kv_heads, int head_dim, Tensor seq_lens, "
        "ScalarType dtype, Tensor query_start_loc, bool causal, int window_size, str isa, bool enable_kv_split, "
        "Tensor? dynamic_causal, str kv_cache_dtype) -> Tensor"),
    "cpu_attn_reshape_and_cache": (
        "cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, str isa, float k_scale, float v_scale, str kv_cache_dtype) -> ()"),
    "cpu_attention_with_kv_cache": (
        "cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a!) output, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, Tensor? alibi_slopes, int sliding_window, "
        "Tensor block_table, float softcap, Tensor scheduler_metadata, Tensor? s_aux, Tensor? dynamic_causal, "
        "float k_scale, float v_scale, str kv_cache_dtype) -> ()"),
    "prepack_moe_weight": "prepack_moe_weight(Tensor weight, Tensor(a!) packed, str isa) -> ()",
    "cpu_fused_moe": (
        "cpu_fused_moe(Tensor(a!) output, Tensor input, Tensor w13, Tensor w2, Tensor? w13_bias, Tensor? w2_bias, "
        "Tensor topk_weights, Tensor topk_ids, bool skip_weighted, str act, str isa) -> ()"),
}
# The gated activations of `MoEActivation` (gate = the first half of w13's rows, as vLLM lays it out).
MOE_ACTIVATIONS = {"silu": ("silu", {}), "gelu": ("gelu", {}), "gelu_tanh": ("gelu", {"approximate": "tanh"})}
OPS = tuple(SCHEMAS)

_LIBRARY = None  # kept alive: dropping a torch.library.Library deregisters its ops


def call_log(path) -> standin_calls.StandinLog:
    return standin_calls.StandinLog(path, PACKAGE, "vLLM")


def unfaithful(op: str, why: str, environ=os.environ) -> None:
    """Log the call of `op` for a case the stand-in cannot compute, and raise."""
    standin_calls.stub(f"torch.ops._C.{op} ({why})", ENV_CALLS, PACKAGE, environ)()


# --- the ops ---------------------------------------------------------------------------------------------

def init_cpu_memory_env(nodes: list[int]) -> None:
    return None


def weak_ref_tensor(tensor):
    return tensor.view(tensor.shape)


_SCHEDULER_METADATA: list = []  # what get_scheduler_metadata made since the freshness witness last asked


def get_scheduler_metadata(*args: Any):
    import torch

    made = torch.zeros(1, dtype=torch.int32)
    _SCHEDULER_METADATA.append(made)
    return made


def scheduler_metadata_made() -> list:
    """The stand-in scheduler metadata made since the last call (the freshness witness names it: a
    FULL graph's attention reads the one made at capture as an argument, and the stand-in ignores it)."""
    made = list(_SCHEDULER_METADATA)
    _SCHEDULER_METADATA.clear()
    return made


def _check_kv_dtype(op: str, kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in PLAIN_KV_DTYPES:
        unfaithful(op, f"kv_cache_dtype={kv_cache_dtype}")


def cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa: str, k_scale: float,
                               v_scale: float, kv_cache_dtype: str) -> None:
    """Write each token's key and value at its slot (block = slot // block size); slot -1 is padding."""
    _check_kv_dtype("cpu_attn_reshape_and_cache", kv_cache_dtype)
    count = min(key.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:count].long()
    keep = slots >= 0
    slots = slots[keep]
    block_size = key_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets, :] = key[:count][keep].to(key_cache.dtype)
    value_cache[blocks, :, offsets, :] = value[:count][keep].to(value_cache.dtype)


def cpu_attention_with_kv_cache(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale: float,
                                causal: bool, alibi_slopes, sliding_window: int, block_table, softcap: float,
                                scheduler_metadata, s_aux, dynamic_causal, k_scale: float, v_scale: float,
                                kv_cache_dtype: str) -> None:
    """Each request's queries against its first `seq_len` cached positions, read through its block
    table; a query at position p attends to positions <= p when causal. Padded requests (no query
    tokens) are skipped; rows past the last request's tokens are left as they are."""
    import torch

    op = "cpu_attention_with_kv_cache"
    _check_kv_dtype(op, kv_cache_dtype)
    for name, given in (("alibi_slopes", alibi_slopes is not None), ("softcap", softcap != 0),
                        ("sliding_window", sliding_window > 0), ("s_aux", s_aux is not None),
                        ("dynamic_causal", dynamic_causal is not None)):
        if given:
            unfaithful(op, name)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    block_size = key_cache.shape[2]
    heads, kv_heads = query.shape[1], key_cache.shape[1]
    for request, seq_len in enumerate(lengths[:len(starts) - 1]):
        start, end = starts[request], min(starts[request + 1], query.shape[0])
        if end <= start or seq_len <= 0:
            continue
        blocks = block_table[request, :(seq_len + block_size - 1) // block_size].long()
        keys = key_cache[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, key_cache.shape[3])[:, :seq_len]
        values = value_cache[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, value_cache.shape[3])[:, :seq_len]
        keys = keys.repeat_interleave(heads // kv_heads, dim=0).float()
        values = values.repeat_interleave(heads // kv_heads, dim=0).float()
        q = query[start:end].transpose(0, 1).float()  # heads x tokens x head size
        scores = torch.matmul(q, keys.transpose(1, 2)) * scale
        if causal:
            positions = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1)
            scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > positions, float("-inf"))
        attended = torch.matmul(torch.softmax(scores, dim=-1), values).transpose(0, 1)
        output[start:end].copy_(attended.reshape(output[start:end].shape).to(output.dtype))


def prepack_moe_weight(weight, packed, isa: str) -> None:
    packed.copy_(weight)


def cpu_fused_moe(output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted: bool, act: str,
                  isa: str) -> None:
    """output[t] = sum over k of weight[t, k] * expert(topk_ids[t, k])(input[t]), each expert a gated MLP
    (w13: experts x 2I x H, w2: experts x H x I), accumulated in float32. Every expert's rows are
    computed densely and masked by the routing, so nothing depends on a count read on the host."""
    import torch
    import torch.nn.functional as F

    if act not in MOE_ACTIVATIONS:
        unfaithful("cpu_fused_moe", f"activation {act!r}")
    name, kwargs = MOE_ACTIVATIONS[act]
    x = input.float()
    inter = w13.shape[1] // 2
    total = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    weights = torch.ones_like(topk_weights, dtype=torch.float32) if skip_weighted else topk_weights.float()
    for expert in range(w13.shape[0]):
        # Each token's weight for this expert (0 where it is not routed there).
        routed = ((topk_ids.long() == expert) * weights).sum(dim=-1, keepdim=True)
        gate_up = x @ w13[expert].float().t()
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].float()
        hidden = getattr(F, name)(gate_up[:, :inter], **kwargs) * gate_up[:, inter:]
        down = hidden @ w2[expert].float().t()
        if w2_bias is not None:
            down = down + w2_bias[expert].float()
        total += routed * down
    output[:x.shape[0]].copy_(total.to(output.dtype))


def install(torch_module: Any) -> None:
    """Register the stand-ins as `torch.ops._C.<op>` in this process (once)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch_module.library.Library(NAMESPACE, "FRAGMENT")
    implementations = globals()
    for name, schema in SCHEMAS.items():
        library.define(schema)
        library.impl(name, implementations[name], "CompositeExplicitAutograd")
    _LIBRARY = library
