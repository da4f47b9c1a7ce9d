"""The CUDA-graph emulation SGLang's prefill runner replays through on a CPU: is it faithful?

A real graph's defining properties, each with a negative control: a replay computes what eager
computes on the captured tensors' current contents; a live tensor that was not copied into a
captured one is invisible; Python decisions and scalars are frozen at capture; a shape change at
replay is an error, never a silent fallback to eager. Plus the state rules of torch.cuda.CUDAGraph
and the eager breaks of a segmented (breakable) capture. What a GPU enforces on top (pools, host
syncs, streams, borrowed outputs) is tests/runner/test_device_rules.py.
"""

from __future__ import annotations

import pytest
import torch

from parity.runner.emulated_graph import EngineEmulatedGraph, GraphReplayError, capture, graph, graph_pool_handle

# Replay runs the same ops on the same shapes in the same process as the eager reference; only the
# buffers' addresses differ, which some BLAS kernels let move the last bit. A stated floor, not 0.
NOISE = 1e-6


class Body(torch.nn.Module):
    """A small LM-like body: reads a static input slot, an optional side input added mid-way."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.nn.functional.silu(self.a(x))
        if side is not None:  # Python decides at capture, like `input_deepstack_embeds is None`
            h = h + side
        return self.b(h).softmax(-1)


@pytest.fixture
def body() -> Body:
    return Body().eval()


def test_replay_computes_what_eager_computes_on_the_captured_inputs(body: Body) -> None:
    slot = torch.zeros(8, 16)  # [bucket, hidden]
    with torch.inference_mode():
        graph, out = capture(lambda: body(slot))
        for seed in range(3):
            live = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
            slot.copy_(live)  # the runner's refresh before replay
            graph.replay()
            torch.testing.assert_close(out, body(live), rtol=0, atol=NOISE)
    assert graph.op_count >= 4  # two linears, the activation, the softmax


def test_a_live_tensor_not_copied_into_a_captured_one_is_invisible(body: Body) -> None:
    slot, side_slot = torch.zeros(8, 16), torch.zeros(8, 16)
    with torch.inference_mode():
        graph, out = capture(lambda: body(slot, side_slot))
        live = torch.randn(8, 16)
        slot.copy_(live)
        side = torch.randn(8, 16)  # a request-specific side input, never copied into side_slot
        graph.replay()
        torch.testing.assert_close(out, body(live, torch.zeros(8, 16)), rtol=0, atol=NOISE)
        assert (out - body(live, side)).abs().max() > 1e-3  # it would have mattered
        side_slot.copy_(side)  # copied in: now the graph sees it
        graph.replay()
        torch.testing.assert_close(out, body(live, side), rtol=0, atol=NOISE)


def test_python_decisions_are_frozen_at_capture(body: Body) -> None:
    # Captured without the side input (0.5.23's "None at capture"): the add is not in the graph,
    # whatever is handed in later.
    slot = torch.zeros(8, 16)
    with torch.inference_mode():
        captured, out = capture(lambda: body(slot, None))
        live, side = torch.randn(8, 16), torch.randn(8, 16)
        slot.copy_(live)
        captured.replay()
        torch.testing.assert_close(out, body(live, None), rtol=0, atol=NOISE)
        assert (out - body(live, side)).abs().max() > 1e-3
    # A scalar read back to Python: an engine's graph on a CPU server (host reads cannot be told
    # from device reads there) keeps the value it read at capture.
    scale = torch.tensor(2.0)
    engine_graph = EngineEmulatedGraph()
    with graph(engine_graph):
        out = torch.ones(3) * scale.item()
    scale.fill_(5.0)
    engine_graph.replay()
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_in_place_writes_and_out_arguments_are_replayed_into_the_same_tensors() -> None:
    src, dst, acc = torch.zeros(4), torch.zeros(6), torch.zeros(4)
    graph, _ = capture(lambda: (dst[:4].copy_(src), torch.add(src, 1.0, out=acc), dst.mul_(2.0)))
    src.copy_(torch.arange(4.0))
    dst.fill_(7.0)
    graph.replay()
    assert dst.tolist() == [0.0, 2.0, 4.0, 6.0, 14.0, 14.0] and acc.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("make_copy", [
    lambda x: x.to(torch.float64),  # `to` aliases by its schema, converts here
    lambda x: x.t().reshape(-1),  # `reshape` of a non-contiguous tensor copies
    lambda x: x.t().contiguous(),
])
def test_an_op_that_may_alias_but_copied_is_re_run_under_inference_mode(make_copy) -> None:
    """Under inference mode these composite ops reach the recorder whole; the ones that returned a
    copy at capture must be re-run at replay, or every later op reads the capture's stale values."""
    x = torch.zeros(4, 4)
    with torch.inference_mode():
        graph, out = capture(lambda: make_copy(x) * 2)
        x.copy_(torch.arange(16.0).reshape(4, 4))
        graph.replay()
        assert torch.equal(out, make_copy(x) * 2)


def test_a_shape_change_at_replay_is_an_error_not_a_fallback() -> None:
    # A data-dependent shape, captured where host syncs pass (an engine's graph on a CPU server).
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    engine_graph = EngineEmulatedGraph()
    with graph(engine_graph):
        rows = torch.nonzero(mask)
    mask.fill_(1.0)  # 4 rows now, 2 at capture
    with pytest.raises(GraphReplayError, match="cannot change shape"):
        engine_graph.replay()
    assert rows.shape == (2, 1)  # the captured output was not replaced
    x = torch.ones(4)
    captured, _ = capture(lambda: x * 2)
    x.resize_(6)  # a captured tensor resized after capture
    with pytest.raises(GraphReplayError):
        captured.replay()


def test_graph_states_follow_torch_cuda_cudagraph() -> None:
    # The calls SGLang's breakable capture makes on the class it is given (capture_begin directly).
    cuda_graph = EngineEmulatedGraph()
    with pytest.raises(GraphReplayError, match="never captured"):
        cuda_graph.replay()
    with pytest.raises(GraphReplayError):
        cuda_graph.capture_end()
    pool = graph_pool_handle()
    cuda_graph.capture_begin(pool=pool, capture_error_mode="global")
    x = torch.ones(2) + 1
    cuda_graph.capture_end()
    assert cuda_graph.pool() == pool and cuda_graph.pool() != graph_pool_handle()
    with pytest.raises(GraphReplayError, match="already captured"):
        cuda_graph.capture_begin()
    cuda_graph.reset()
    assert cuda_graph.op_count == 0
    with pytest.raises(GraphReplayError):
        cuda_graph.replay()
    assert x.tolist() == [2.0, 2.0]


def test_segments_with_an_eager_break_between_them_replay_in_order() -> None:
    # A breakable capture: segment 1, an eager function on captured tensors, segment 2. The break
    # runs eagerly at replay (not recorded), its output copied into the tensor segment 2 reads.
    x, bridge = torch.zeros(3), torch.zeros(3)
    calls = []

    def eager_break(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t * 10

    pool = graph_pool_handle()  # one pool for every segment, as SGLang's global graph pool
    first, second = EngineEmulatedGraph(), EngineEmulatedGraph()
    first.capture_begin(pool)
    y = x + 1
    first.capture_end()
    bridge.copy_(eager_break(y))
    second.capture_begin(pool)
    z = bridge + 0.5
    second.capture_end()
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    first.replay()
    bridge.copy_(eager_break(y))
    second.replay()
    assert z.tolist() == [20.5, 30.5, 40.5] and len(calls) == 2
