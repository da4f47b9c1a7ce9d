"""The Qwen3-VL language-model body in SGLang's dense DeepStack layout, on Hugging Face's layers.

Hugging Face adds DeepStack as a list of `[n_visual_tokens, hidden]` tensors scattered through a
mask; SGLang (and the graph runner) carry one dense `input_deepstack_embeds` of shape
`[num_tokens, hidden * n]`, zero outside image rows, whose column block k is added to the hidden
states after decoder layer k. A fixed-shape dense tensor is what a captured graph can read from a
slot. The layers, rotary embedding and final norm are Hugging Face's own modules.

A request is served as a server does it: one prefill of the prompt (`forward`, the path a graph
replays), whose keys and values are outputs, then KV-cached decode steps (`forward_cached`), which
carry no DeepStack and run eagerly in every arm.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
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


class KVCache:
    """Keys and values per layer, in the one call Hugging Face's attention makes on a cache:
    `update(key, value, layer_idx, ...) -> (all keys, all values)`.

    Duck-typed on purpose: transformers renamed the layer argument (`past_key_values` in 5.17,
    `cache` in 5.24) and changed `update`'s extra arguments between releases.
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [1, kv_heads, T, head_dim]
        self.values: dict[int, torch.Tensor] = {}

    @classmethod
    def from_prefill(cls, keys: torch.Tensor, values: torch.Tensor) -> "KVCache":
        """A cache holding a prefill's rows; `keys`/`values` are [T, layers, kv_heads, head_dim]."""
        cache = cls()
        for layer in range(keys.shape[1]):
            cache.keys[layer] = keys[:, layer].transpose(0, 1).unsqueeze(0)
            cache.values[layer] = values[:, layer].transpose(0, 1).unsqueeze(0)
        return cache

    @property
    def length(self) -> int:
        """Rows already cached."""
        return next(iter(self.keys.values())).shape[-2] if self.keys else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx in self.keys:
            key_states = torch.cat([self.keys[layer_idx], key_states], dim=-2)
            value_states = torch.cat([self.values[layer_idx], value_states], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as [T, layers, kv_heads, head_dim]: token-major, like every body output."""
        order = sorted(self.keys)
        keys = torch.stack([self.keys[i][0] for i in order]).permute(2, 0, 1, 3).contiguous()
        values = torch.stack([self.values[i][0] for i in order]).permute(2, 0, 1, 3).contiguous()
        return keys, values


@dataclass(frozen=True)
class Past:
    """The rows a prefill attends to before its own: keys and values `[P, layers, kv_heads, head_dim]`
    and the mask `[T, P + T]` (True: may attend) of its T rows over those and its own."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, rows: int) -> "Past":
        """Every past row, then causal over the `rows` new ones: an eager chunk's mask."""
        mask = torch.ones(rows, keys.shape[0] + rows, dtype=torch.bool, device=keys.device).tril(keys.shape[0])
        return cls(keys, values, mask)


def fill_past_mask(mask: torch.Tensor, past_rows: int, rows: int) -> None:
    """A padded chunk's mask in place, `[bucket, capacity + bucket]` over a past slot of `capacity`
    rows of which `past_rows` are real: real rows see the real past and, causally, the chunk; each
    padded row sees only itself (an all-masked row would be NaN, and NaN is not inert)."""
    fill_packed_mask(mask, ((0, rows, past_rows),))


def fill_packed_mask(mask: torch.Tensor, spans: tuple[tuple[int, int, int], ...]) -> None:
    """The mask of requests packed side by side in one forward, in place, `[bucket, capacity +
    bucket]`: each span `(start, end, past_rows)` is one request's rows, which see the first
    `past_rows` rows of the past slot (its own earlier rows: only one request's may be there) and,
    causally, its own rows, never another request's; each padded row sees only itself."""
    bucket = mask.shape[0]
    capacity = mask.shape[1] - bucket
    mask.zero_()
    own = mask[:, capacity:]
    for start, end, past_rows in spans:
        mask[start:end, :past_rows] = True
        own[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool, device=mask.device).tril()
    used = max((end for _, end, _ in spans), default=0)
    own[used:, used:].fill_diagonal_(True)


def _cache_argument(layer: nn.Module) -> str:
    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class Qwen3VLTextBody(nn.Module):
    """Prefill: `(input_embeds [T, H], positions [3, T], deepstack [T, H*n] | None)` ->
    `(hidden [T, H], keys [T, L, kv, d], values [T, L, kv, d])`, plus, with `probe=True`, the hidden
    state at every probe point `[T, P, H]` (after each decoder layer and after each DeepStack add).

    Every output is token-major, so a runner can cut a padded bucket's real rows with `[:T]`.
    Causal attention: padded rows after the real ones cannot reach real rows.
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
        self._cache_kw = _cache_argument(self.layers[0])

    @property
    def deepstack_count(self) -> int:
        return self._deepstack_count

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    def deepstack_block_after(self, layer: int) -> int | None:
        """Which DeepStack block is added after decoder layer `layer` (SGLang: block k after layer k)."""
        return layer if layer < self._deepstack_count else None

    def probe_points(self) -> tuple[tuple[int, int | None], ...]:
        """(layer, DeepStack block added there or None) for each probe output, in order."""
        points = []
        for layer in range(len(self.layers)):
            points.append((layer, None))
            block = self.deepstack_block_after(layer)
            if block is not None:
                points.append((layer, block))
        return tuple(points)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim): one token's keys (or values), as the outputs hold them."""
        attention = self.layers[0].self_attn
        return len(self.layers), int(attention.config.num_key_value_heads), int(attention.head_dim)

    def forward(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, deepstack: torch.Tensor | None,
        probe: bool = False, past: Past | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """`past`: rows prefilled before these (a prefix-cache hit, the earlier chunks of a chunked
        prefill); the outputs' keys and values are then these rows' only."""
        cache = KVCache() if past is None else KVCache.from_prefill(past.keys, past.values)
        mask = None if past is None else past.mask[None, None]
        hidden = input_embeds.unsqueeze(0)  # [1, T, H]
        width = self._hidden_size
        points = []
        position_embeddings = self.rotary_emb(hidden, positions.unsqueeze(1))  # positions: [3, 1, T]
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, position_embeddings=position_embeddings, attention_mask=mask,
                           position_ids=None, **{self._cache_kw: cache})
            points.append(hidden)
            block = self.deepstack_block_after(index)
            if deepstack is not None and block is not None:
                hidden = hidden + deepstack[:, block * width:(block + 1) * width].unsqueeze(0)
            if block is not None:
                points.append(hidden)
        keys, values = cache.stacked()
        if past is not None:
            keys, values = keys[past.keys.shape[0]:], values[past.keys.shape[0]:]
        outputs = (self.norm(hidden).squeeze(0), keys, values)
        if probe:
            outputs += (torch.stack([p[0] for p in points], dim=1),)  # [T, P, H]
        return outputs

    def forward_cached(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Tokens `[n, H]` at `positions` `[3, n]` after the rows in `cache` -> hidden `[n, H]`.

        n = 1 is a decode step (no mask: the token sees every cached row). n > 1 feeds known tokens
        at once (teacher forcing): each sees the cached rows and the tokens before it.
        """
        hidden = embeds.unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, positions.unsqueeze(1))
        n, past = embeds.shape[0], cache.length
        # SDPA's is_causal aligns the mask upper-left; with cached rows the diagonal is past + i.
        mask = None if n == 1 else torch.ones(n, past + n, dtype=torch.bool, device=embeds.device).tril(past)[None, None]
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=position_embeddings, attention_mask=mask,
                           position_ids=None, **{self._cache_kw: cache})
        return self.norm(hidden).squeeze(0)
