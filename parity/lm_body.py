"""The Qwen3-VL language-model body in SGLang's dense DeepStack layout, on Hugging Face's layers.

Hugging Face adds DeepStack as a list of `[n_visual_tokens, hidden]` tensors scattered through a
mask; SGLang (and the graph runner) carry one dense `input_deepstack_embeds` of shape
`[num_tokens, hidden * n]`, zero outside image rows, whose column block k is added to the hidden
states after decoder layer k. A fixed-shape dense tensor is what a captured graph can read from a
slot. The layers, rotary embedding and final norm are Hugging Face's own modules.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class ConsumesDeepStack(Protocol):
    """A body that adds DeepStack rows declares it, with the counts the runner sizes its slot from."""

    @property
    def deepstack_count(self) -> int:
        """How many DeepStack embeddings are added (after decoder layers 0..n-1); may be 0."""
        ...

    @property
    def hidden_size(self) -> int: ...


class Qwen3VLTextBody(nn.Module):
    """`(input_embeds [T, H], positions [3, T], deepstack [T, H*n] | None) -> hidden [T, H]`.

    One sequence, causal attention, no KV cache: every call is a full prefill, which is exactly
    the path a prefill graph replays. Padded rows after the real ones cannot reach real rows.
    """

    def __init__(self, language_model: nn.Module, deepstack_count: int) -> None:
        super().__init__()
        config = language_model.config
        # The causal mask comes from SDPA's is_causal: a None mask means "causal" there only.
        if config._attn_implementation != "sdpa":
            raise ValueError(f"the LM body needs attn_implementation='sdpa', got {config._attn_implementation!r}")
        self.layers = language_model.layers
        self.norm = language_model.norm
        self.rotary_emb = language_model.rotary_emb
        self._hidden_size = int(config.hidden_size)
        self._deepstack_count = int(deepstack_count)

    @property
    def deepstack_count(self) -> int:
        return self._deepstack_count

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    def forward(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, deepstack: torch.Tensor | None
    ) -> torch.Tensor:
        hidden = input_embeds.unsqueeze(0)  # [1, T, H]
        position_embeddings = self.rotary_emb(hidden, positions.unsqueeze(1))  # positions: [3, 1, T]
        width = self._hidden_size
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, position_embeddings=position_embeddings, attention_mask=None, position_ids=None)
            if deepstack is not None and index < self._deepstack_count:
                hidden = hidden + deepstack[:, index * width:(index + 1) * width].unsqueeze(0)
        return self.norm(hidden).squeeze(0)
