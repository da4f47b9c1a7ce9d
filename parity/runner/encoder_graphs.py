"""Vision-encoder graphs as an engine keys them (design §10): the layout scenario's path.

An engine that captures its vision encoder replays one graph per key. The encoder's layout
metadata (the patch grid, its rotary positions, the position-embedding interpolation, the window
boundaries) is computed in Python from the grid at capture and frozen into the graph, so the key
must tell grids apart: an image with as many patches on a transposed grid, replayed in another
grid's graph, is encoded with the wrong layout (SGLang PR #37043, keyed by token count).

The graphs are emulated on every device (`parity.runner.emulated_graph`, as an engine's graph:
`EngineEmulatedGraph`): Hugging Face's vision tower reads its grid on the host inside the call,
which a CUDA capture refuses (an engine reads it before capture), and the bug lives in the key,
not in the kernels.

The freshness witness (design §6) watches them as it watches the prefill graphs: the per-call
inputs each reads, and who wrote their rows. `pixel_values`, the slot each image is copied into,
must be this image's copy in every patch row. `grid_thw` is the grid the graph was captured for:
an engine computes its layout metadata from it once, at capture, and never refreshes it, so it
is judged by what it holds. A correctly keyed graph was captured for this very grid; a graph
keyed too coarsely (the planted `layout-keyed`) replays another grid's, which the witness names
whatever the answer does.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from parity.runner import emulated_graph
from parity.evidence import EncoderRun, InputFreshness, ReplayCheck
from parity.runner.freshness import FreshnessWitness, Supplied
from parity.runner.replay_check import ReplayChecker

PIXELS = "pixel_values"  # the encoder graphs' inputs, as the witness names them
GRID = "grid_thw"


class EncoderGraphs:
    """`encoder(pixel_values, grid_thw)` through captured graphs, one per key: the grid
    (`by_grid`, what a correct engine keys on) or the patch count alone (the planted bug). Each
    replay is checked against the encoder run eagerly on the same pixels and grid (design §6)."""

    def __init__(self, encoder: Callable[..., Any], by_grid: bool = True, checker: ReplayChecker | None = None) -> None:
        self._encoder = encoder
        self._by_grid = by_grid
        self._checker = checker
        self._graphs: dict[str, tuple[emulated_graph.EmulatedGraph, torch.Tensor, Any]] = {}
        self.runs: list[EncoderRun] = []
        self.checks: list[ReplayCheck] = []
        self.freshness: list[tuple[InputFreshness, ...]] = []  # per replay, its inputs' freshness
        weights = [*encoder.parameters(), *encoder.buffers()] if isinstance(encoder, torch.nn.Module) else []
        self._witness = FreshnessWitness(weights)
        self.owner: str | None = None  # the tag of the image being encoded (its sha256), for the witness

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, return_dict: bool = True) -> Any:
        grid = tuple(int(x) for x in grid_thw[0])
        patches = int(pixel_values.shape[0])
        key = f"grid {grid[0]}x{grid[1]}x{grid[2]}" if self._by_grid else f"{patches} patches"
        replayed = key in self._graphs
        if not replayed:
            slot, grid_slot = pixel_values.clone(), grid_thw.clone()
            self._witness.watch(PIXELS, slot)
            self._witness.watch(GRID, grid_slot)
            # The grid is read at capture, as an engine computes its metadata once per graph.
            graph, outputs = emulated_graph.capture(
                self._witness.captured(key, lambda: self._encoder(slot, grid_thw=grid_slot.clone(), return_dict=True)),
                name=f"the encoder graph for {key}", graph_class=emulated_graph.EngineEmulatedGraph)
            self._graphs[key] = (graph, slot, outputs)
        graph, slot, outputs = self._graphs[key]
        with self._witness.writes(self.owner):
            slot.copy_(pixel_values)
        graph.replay()
        # Every patch row of the slot is read, and a correct copy writes them all; the grid frozen at
        # capture must be this image's.
        self.freshness.append(self._witness.check(key, f"encoder {key}", {
            PIXELS: Supplied(pixel_values), GRID: Supplied(grid_thw, by_content=True)}))
        self.runs.append(EncoderRun(grid, patches, key, replayed))
        # Graph outputs are borrowed: the next replay overwrites them.
        copied = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)
        if self._checker is not None:
            self.checks.append(self._checker.encoder(
                f"encoder {key}", lambda: self._encoder(pixel_values, grid_thw=grid_thw, return_dict=True), copied))
        return copied

    def close(self) -> None:
        self._graphs.clear()
