"""The graph path judged against eager on the very shape it replayed (design §6, "Replay against
eager on its own shape").

The graph arm runs the body on the bucket-padded input, the eager arm on the exact prompt: other
shapes pick other kernels and reduction orders, and in bf16 that alone moves a logprob by up to the
dtype's tolerance, so the token-level comparison must excuse it. A replay executes the kernels an
eager pass launches for the same shape, so against an eager pass over the same padded inputs it
should agree to the bit, in any dtype. Each replayed prefill (and vision-encoder graph) is computed
again eagerly on the inputs a correct replay of it sees: its live rows (this prefill's own
DeepStack rows, as a correct engine hands them), the padding as the slots hold it, the past rows of
a context graph. The bound is what repeats of that eager pass show on this device, measured in the
run once per graph (0 where the kernels are deterministic), never a constant. Beyond it, the graph
path changed the computation. The eager pass on the exact rows gives the case's padding noise: what
the token-level comparison has to tolerate, reported beside it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from parity.evidence import CHECKED_TENSORS, Departure, GraphBound, ReplayCheck, TensorCheck
from parity.runner.lm_body import Past

Outputs = tuple[torch.Tensor, ...]  # (hidden [T, H], keys [T, L, kv, d], values [T, L, kv, d]) of real rows


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _prefill_tensors(outputs: Outputs, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    hidden, keys, values = outputs[:3]
    return {"logits": logits, "hidden": hidden, "keys": keys, "values": values}


def _spread(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: _max_abs(first[name], second[name]) for name in first}


class ReplayChecker:
    """Checks a run's replays against eager on their own shape; keeps, per graph, the spread that
    repeats of the eager pass show (measured on the graph's first check): one bound per graph for
    every arm that replays it, which the results file records and the loader holds it to."""

    def __init__(self, lm_head: Callable[[torch.Tensor], torch.Tensor], point_after: Callable[[int], str]) -> None:
        self._lm_head = lm_head
        self._point_after = point_after  # decoder layer k -> the label of its output ("L0+DS0")
        self._spreads: dict[str, dict[str, float]] = {}

    @torch.inference_mode()
    def prefill(self, key: str, body: Callable[..., Outputs], replayed: Outputs,
                padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Past | None],
                exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Past | None], start: int) -> ReplayCheck:
        """`key`: the graph ("prefill 48"); `replayed`: the replay's outputs (real rows); `padded`: the
        inputs of a correct replay (embeds, positions, DeepStack, past) at the bucket's shape; `exact`:
        the same prefill at its own length; `start`: its first prompt row."""
        return self.prefill_packed(key, body, replayed, padded, exact, ((0, replayed[0].shape[0], start),))[0]

    @torch.inference_mode()
    def prefill_packed(self, key: str, body: Callable[..., Outputs], replayed: Outputs,
                       padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Past | None],
                       exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Past | None],
                       spans: tuple[tuple[int, int, int], ...]) -> tuple[ReplayCheck, ...]:
        """`prefill` for requests that shared the forward: one check per span `(first row, end, its
        first prompt row)`, each on its request's rows (and its last row's logits), so a departure is
        the request's whose rows departed. The bound is the graph's, as for one request."""
        rows = replayed[0].shape[0]
        reference = self._outputs(body, padded, rows)
        if key not in self._spreads:  # the eager pass's own spread, on fresh copies of its inputs
            again = tuple(None if t is None else _cloned(t) for t in padded)
            self._spreads[key] = _spread(self._cut(reference, 0, rows), self._cut(self._outputs(body, again, rows),
                                                                                  0, rows))
        bounds = self._spreads[key]
        unpadded = self._outputs(body, exact, rows)
        checks = []
        for first, end, start in spans:
            mine, theirs = self._cut(replayed, first, end), self._cut(reference, first, end)
            tensors = tuple(TensorCheck(name, _max_abs(mine[name], theirs[name]), bounds[name])
                            for name in CHECKED_TENSORS if name in mine)
            noise = _max_abs(self._cut(unpadded, first, end)["logits"], theirs["logits"])
            checks.append(ReplayCheck(1, tensors, noise, self._departure(mine, theirs, bounds, start),
                                      tuple(GraphBound(key, t.tensor, t.bound) for t in tensors)))
        return tuple(checks)

    @staticmethod
    def _outputs(body, inputs, rows: int) -> Outputs:
        embeds, positions, deepstack, past = inputs
        return tuple(t[:rows] for t in body(embeds, positions, deepstack, past=past)[:3])

    def _cut(self, outputs: Outputs, first: int, end: int) -> dict[str, torch.Tensor]:
        """Rows `[first, end)` of a prefill's outputs, with their last row's logits."""
        cut = tuple(t[first:end] for t in outputs[:3])
        return _prefill_tensors(cut, self._last_logits(cut[0]))

    def _last_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(hidden[-1:]).float()  # the position whose logits give the next token

    def _departure(self, mine: dict, reference: dict, bounds: dict, start: int) -> Departure | None:
        """The first place a departure shows: the lowest decoder layer whose keys or values left
        the bound (its input departed: the previous layer's output), else the final hidden state,
        else the logits; and there the first row."""
        layers = mine["keys"].shape[1]
        for layer in range(layers):
            for name in ("keys", "values"):
                per_row = (mine[name][:, layer].float() - reference[name][:, layer].float()).flatten(1).abs().amax(1)
                beyond = (per_row > bounds[name]).nonzero()
                if len(beyond):
                    row = int(beyond[0])
                    point = "embeddings" if layer == 0 else self._point_after(layer - 1)
                    return Departure(0, name, point, start + row, float(per_row[row]), bounds[name])
        for name, point in (("hidden", "final"), ("logits", "logits")):
            per_row = (mine[name].float() - reference[name].float()).flatten(1).abs().amax(1)
            beyond = (per_row > bounds[name]).nonzero()
            if len(beyond):
                row = int(beyond[0])
                position = start + (row if name == "hidden" else mine["hidden"].shape[0] - 1)
                return Departure(0, name, point, position, float(per_row[row]), bounds[name])
        return None

    @torch.inference_mode()
    def encoder(self, key: str, encode: Callable[[], Any], replayed: Any) -> ReplayCheck:
        """A vision-encoder graph's outputs against the encoder run eagerly on the same pixels and grid."""
        reference = _leaves(encode())
        if key not in self._spreads:
            self._spreads[key] = {"encoder": max(_max_abs(a, b) for a, b in zip(reference, _leaves(encode())))}
        bound = self._spreads[key]["encoder"]
        mine = _leaves(replayed)
        delta = max(_max_abs(a, b) for a, b in zip(mine, reference))
        departure = None
        for a, b in zip(mine, reference):
            per_row = (a.float() - b.float()).reshape(a.shape[0], -1).abs().amax(1)
            beyond = (per_row > bound).nonzero()
            if len(beyond):
                row = int(beyond[0])
                departure = Departure(0, "encoder", "encoder", row, float(per_row[row]), bound)
                break
        return ReplayCheck(1, (TensorCheck("encoder", delta, bound),), None, departure,
                           (GraphBound(key, "encoder", bound),))


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]


def _cloned(value: Any) -> Any:
    if isinstance(value, Past):
        return Past(value.keys.clone(), value.values.clone(), value.mask.clone())
    return value.clone()
