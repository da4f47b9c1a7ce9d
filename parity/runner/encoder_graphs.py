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
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from parity.runner import emulated_graph
from parity.evidence import EncoderRun, ReplayCheck
from parity.runner.replay_check import ReplayChecker


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

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, return_dict: bool = True) -> Any:
        grid = tuple(int(x) for x in grid_thw[0])
        patches = int(pixel_values.shape[0])
        key = f"grid {grid[0]}x{grid[1]}x{grid[2]}" if self._by_grid else f"{patches} patches"
        replayed = key in self._graphs
        if not replayed:
            slot = pixel_values.clone()
            # The grid is read at capture, as an engine computes its metadata once per graph.
            graph, outputs = emulated_graph.capture(
                lambda: self._encoder(slot, grid_thw=grid_thw.clone(), return_dict=True),
                name=f"the encoder graph for {key}", graph_class=emulated_graph.EngineEmulatedGraph)
            self._graphs[key] = (graph, slot, outputs)
        graph, slot, outputs = self._graphs[key]
        slot.copy_(pixel_values)
        graph.replay()
        self.runs.append(EncoderRun(grid, patches, key, replayed))
        # Graph outputs are borrowed: the next replay overwrites them.
        copied = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)
        if self._checker is not None:
            self.checks.append(self._checker.encoder(
                f"encoder {key}", lambda: self._encoder(pixel_values, grid_thw=grid_thw, return_dict=True), copied))
        return copied

    def close(self) -> None:
        self._graphs.clear()
