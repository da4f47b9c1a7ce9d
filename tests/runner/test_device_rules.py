"""What a GPU enforces on CUDA graphs, enforced by the emulation (parity/runner/device_rules.py).

Each rule with its negative control: the emulation refuses exactly what CUDA refuses (a capture
into a dead pool, a host sync or the default stream during capture) and raises where a GPU would
silently return garbage (a borrowed output read after another graph of its pool replayed), and
lets through what a GPU lets through. Then the runner: `--scenario all` in one process, which
crashed the H200, passes; the runner that reused its dead pool is an ERROR here too.
"""

from __future__ import annotations

import gc

import numpy  # noqa: F401 - .numpy() below needs it importable
import pytest
import torch

from parity.runner import device_rules
from parity.runner.device_rules import (
    DEFAULT_STREAM, CaptureSyncError, DefaultStreamCaptureError, PoisonedOutputError, PoolReuseError, Stream,
    on_stream,
)
from parity.runner.emulated_graph import EmulatedGraph, EngineEmulatedGraph, capture, graph, graph_pool_handle
from parity.results import SCENARIOS
from tests.library_runs import library_run as _run
from tests.mutants import KeepsBorrowedOutputs, RecapturesIntoItsDeadPool
from tests.library_runs import library_run as _run


# --- pools ----------------------------------------------------------------------------------------------

def test_a_pool_lives_while_one_of_its_graphs_lives():
    pool = graph_pool_handle()
    x = torch.ones(4)
    first, _ = capture(lambda: x * 2, pool=pool)
    second, _ = capture(lambda: x * 3, pool=pool)
    assert device_rules.POOLS.use_count(pool) == 2
    del first
    gc.collect()
    third, _ = capture(lambda: x * 4, pool=pool)  # the second still holds the pool: allowed, as on a GPU
    assert device_rules.POOLS.use_count(pool) == 2
    second.reset()
    del third
    gc.collect()
    assert device_rules.POOLS.use_count(pool) == 0
    with pytest.raises(PoolReuseError, match="use_count > 0"):
        capture(lambda: x * 5, pool=pool)
    capture(lambda: x * 5, pool=graph_pool_handle())  # a new pool id is the fix


def test_an_engine_graph_keeps_the_pool_rule():
    pool = graph_pool_handle()
    engine_graph = EngineEmulatedGraph()
    with graph(engine_graph, pool=pool):
        torch.ones(2) + 1
    engine_graph.reset()
    with pytest.raises(PoolReuseError):
        with graph(EngineEmulatedGraph(), pool=pool):
            torch.ones(2) + 1


# --- host syncs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sync", [
    lambda t: t.sum().item(),
    lambda t: t.tolist(),
    lambda t: t.cpu(),
    lambda t: t.numpy(),
    lambda t: bool(t[0] > 0),
    lambda t: int(t[0]),
    lambda t: torch.nonzero(t),
    lambda t: t[t > 1],  # masked: an output shaped by the data
], ids=["item", "tolist", "cpu", "numpy", "bool", "int", "nonzero", "masked"])
def test_a_host_sync_during_capture_is_refused(sync):
    x = torch.arange(4.0)
    with pytest.raises(CaptureSyncError, match="during graph capture"):
        capture(lambda: sync(x * 2))
    sync(x * 2)  # outside a capture it is fine
    engine_graph = EngineEmulatedGraph()  # an engine's graph on a CPU server cannot tell host from device
    with graph(engine_graph):
        sync(x * 2)


def test_device_preserving_work_passes_during_capture():
    x = torch.arange(6.0).reshape(2, 3)
    captured, out = capture(lambda: (x.to(x.device).to(torch.float64) @ x.t().double()).softmax(-1)[:, :1])
    captured.replay()
    assert out.shape == (2, 1)


# --- streams ---------------------------------------------------------------------------------------------

def test_capture_on_the_default_stream_is_refused():
    with pytest.raises(DefaultStreamCaptureError, match="non-default stream"):
        EmulatedGraph().capture_begin()
    with pytest.raises(DefaultStreamCaptureError):
        with graph(EmulatedGraph(), stream=DEFAULT_STREAM):
            pass
    assert device_rules.current_stream() is DEFAULT_STREAM  # the refusal left no stream current
    on_side = EmulatedGraph()
    with on_stream(Stream("side")):  # `with torch.cuda.stream(side):` then capture_begin
        on_side.capture_begin()
        torch.ones(2) + 1
        on_side.capture_end()
    with graph(EmulatedGraph()):  # a side stream of its own
        torch.ones(2) + 1
    inside_a_server = EngineEmulatedGraph()  # inside a CPU server every stream is the CPU's one
    inside_a_server.capture_begin()
    inside_a_server.capture_end()


# --- borrowed outputs ------------------------------------------------------------------------------------

def test_an_output_read_after_another_graph_of_its_pool_replayed_raises():
    pool = graph_pool_handle()
    x = torch.arange(4.0)
    first, first_out = capture(lambda: x * 2, pool=pool, name="the first graph")
    second, second_out = capture(lambda: x * 3, pool=pool)
    with pytest.raises(PoisonedOutputError, match="before it replayed at all"):
        first_out.sum()  # a capture computes nothing: garbage on a GPU
    first.replay()
    kept = first_out[:2].clone()  # copied out right after its replay: the caller's own
    view = first_out[:2]
    assert first_out.tolist() == [0.0, 2.0, 4.0, 6.0]
    second.replay()
    assert second_out.tolist() == [0.0, 3.0, 6.0, 9.0]
    with pytest.raises(PoisonedOutputError, match="the first graph"):
        first_out.tolist()
    with pytest.raises(PoisonedOutputError):
        view + 1  # a view taken earlier is borrowed too
    assert first_out.shape == (4,) and view.dtype == torch.float32  # metadata reads no memory
    assert kept.tolist() == [0.0, 2.0]
    first.replay()
    assert view.tolist() == [0.0, 2.0]


def test_graphs_of_other_pools_never_poison_each_other():
    x = torch.arange(3.0)
    first, first_out = capture(lambda: x + 1)
    second, _ = capture(lambda: x + 2)
    first.replay()
    second.replay()
    assert first_out.tolist() == [1.0, 2.0, 3.0]


# --- the runner ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_scenario_all_runs_in_one_process_on_the_emulated_graph(request, preset):
    """The H200's crash: growth recaptured every graph into the pool the destroyed ones shared, and
    every later request in the process failed on CUDA's allocator assert."""
    assert _run(request.getfixturevalue(preset), scenarios=SCENARIOS).verdict.code == "PASS"
    run = _run(request.getfixturevalue(preset), RecapturesIntoItsDeadPool, scenarios=SCENARIOS)
    assert run.verdict.code == "ERROR" and "PoolReuseError" in run.verdict.reason, run.verdict


def test_a_runner_that_keeps_borrowed_outputs_is_an_error(tiny):
    """Its answers are read after other replays: of the same graph (the self-check sees the forced
    scores move), or of another graph of the pool (a chunk's context graph: the read raises)."""
    run = _run(tiny, KeepsBorrowedOutputs, scenarios=SCENARIOS)
    assert run.verdict.code == "ERROR", run.verdict
    assert any("PoisonedOutputError" in case.verdict.reason for case in run.cases), [c.verdict for c in run.cases]
