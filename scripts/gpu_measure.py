"""The measurements `scripts/gpu_check.py` runs, one subcommand each, every row appended to a JSON
lines file as it is made (a step cut by its time limit keeps the rows it finished):

    python scripts/gpu_measure.py matrix --preset P --dtype D --device cuda --out rows.jsonl [--runs DIR]
        each runner variant x scenario on one preset and dtype, against the verdict a correct
        harness gives (docs/scenarios.md); failing cases localized on the device;
    python scripts/gpu_measure.py shapes --device cuda --out rows.jsonl
        the shape presets (Qwen3-VL-8B, -30B-A3B; on the CPU their -scaled variants) in bf16, one at
        a time, each skipped (saying why) where the device's free memory cannot hold it: build time and
        weights' memory against the formula, every bucket 16 ... 8192 captured
        (time, graphs' peak memory, the slot against max_tokens x hidden x 3 x 2 bytes), then per
        bucket replay vs eager side by side, and the noise of a correct replay at full depth: against
        eager over its own padded inputs (the replay check's reference) and against the unpadded prompt.

`--device cpu` runs the same code on the emulated graph (a dry run: no timing worth reading).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from parity.arms import select_arms  # noqa: E402
from parity.backends.transformers_backend import TransformersBackend  # noqa: E402
from parity.errors import ModelUnavailableError  # noqa: E402
from parity.design import FAMILY_SCENARIOS, PLANTED_BUGS  # noqa: E402
from parity.judge.metrics import tuple_text  # noqa: E402
from parity.media.catalog import builtin_fixture  # noqa: E402
from parity.media.fixtures import default_prompts  # noqa: E402
from parity.models import load_model  # noqa: E402
from parity.reporting.report import localization_sentence, render_markdown  # noqa: E402
from parity.results import write_results  # noqa: E402
from parity.run.experiment import RunInterrupted, run_experiment  # noqa: E402
from parity.run.planning import CaseSpec, RunSpec  # noqa: E402
from parity.runner.graph_runner import GraphBackend, PrefillGraphRunner, RunnerVariant  # noqa: E402

CORE = ("four-arm", "reuse", "stream", "shrink")
# The bug family: the fixed runner on each family scenario, each planted variant on its own.
FAMILY_RUNS = tuple(("fixed", s) for s in FAMILY_SCENARIOS) + tuple((v, s) for v, (s, _) in PLANTED_BUGS.items())
# What each planted variant gives on its own scenario, alone in a run (docs/scenarios.md's table).
PLANTED_VERDICTS = {"chunk-misaligned": "FAIL_GRAPH_DIVERGES", "prefix-offset": "FAIL_GRAPH_DIVERGES",
                    "growth-rebind": "FAIL_STALE_STATE", "warmup-specialized": "FAIL_DEEPSTACK_DROPPED",
                    "layout-keyed": "FAIL_GRAPH_DIVERGES", "clears-own-rows": "FAIL_STALE_STATE"}


def expected_verdict(preset: str, runner: str, scenario: str) -> str:
    """What tests/run/test_end_to_end.py and docs/scenarios.md say each variant gives, on any device."""
    if "nodeepstack" in preset:  # nothing to drop or leak, and no power: no scenario proves anything
        return "INCONCLUSIVE_NO_POWER"
    if runner == "fixed":
        return "PASS"
    if runner in PLANTED_VERDICTS:
        return PLANTED_VERDICTS[runner]
    if runner == "legacy":  # no slot: the first image request of any scenario already drops DeepStack
        return "FAIL_DEEPSTACK_DROPPED"
    # no-clear: the slot is refreshed on presence; only a sequence's absence lets stale rows through.
    return "PASS" if scenario == "four-arm" else "FAIL_STALE_STATE"


def _graph_backend(device: str) -> str:
    return "cuda" if device == "cuda" else "emulated"


def _append(out: Path, row: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def matrix(args) -> None:
    loaded = load_model(args.preset, device=args.device, dtype=args.dtype)
    fixture = builtin_fixture("rgb-stripes")
    case = CaseSpec(fixture, default_prompts(fixture)[0])
    # The planted variants first (their departures are what reduced precision on a GPU can hide), the
    # fixed runner last: a run stopped at its time limit has written the rows that matter most.
    core = [(r, s) for r in ("legacy", "no-clear", "fixed") for s in CORE]
    runs = sorted(FAMILY_RUNS, key=lambda run: (run[0] == "fixed", run[0] not in ("layout-keyed", "clears-own-rows")))
    runs += core
    for runner, scenario in runs:
        want = expected_verdict(args.preset, runner, scenario)
        name = f"{args.preset}-{args.dtype}-{runner}-{scenario}"
        start = time.perf_counter()
        try:
            spec = RunSpec(model=args.preset, arms=select_arms("all"), cases=(case,), scenarios=(scenario,))
            backend = TransformersBackend(loaded, max_new_tokens=20, runner_variant=RunnerVariant(runner),
                                          graph_backend=_graph_backend(args.device))
            run = run_experiment(spec, backend)
            got, reason = run.verdict.code, run.verdict.reason
            first = run.cases[0].comparisons[0] if run.cases[0].comparisons else None
            graph_vs_eager = tuple_text(first, run.logprob_tol) if first else "—"
            if run.cases[0].localization is not None:
                graph_vs_eager += f"; {localization_sentence(run.cases[0])}"
            if args.runs is not None:
                folder = Path(args.runs) / name
                folder.mkdir(parents=True, exist_ok=True)
                write_results(run, folder / "results.json")
                (folder / "report.md").write_text(render_markdown(run))
        except RunInterrupted:  # stopped at the step's time limit: the rows so far are written
            raise
        except Exception as err:  # a check that crashes is a finding, not the end of the matrix
            got, reason, graph_vs_eager = "CRASH", f"{err.__class__.__name__}: {err}", "—"
            traceback.print_exc()
        _append(args.out, {"preset": args.preset, "dtype": args.dtype, "runner": runner, "scenario": scenario,
                           "expected": want, "got": got, "ok": got == want, "reason": reason,
                           "graph_vs_eager": graph_vs_eager, "seconds": round(time.perf_counter() - start, 2)})
        print(f"{name:55} {got:28} {'ok' if got == want else 'UNEXPECTED (want ' + want + ')'}", flush=True)


def _median_seconds(fn, device: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _runner(adapter, device: str, buckets) -> PrefillGraphRunner:
    return PrefillGraphRunner(adapter.body, hidden_size=adapter.hidden_size, dtype=adapter.dtype, device=adapter.device,
                              buckets=buckets, graph_backend=GraphBackend(_graph_backend(device)))


def _random_inputs(adapter, tokens: int, generator: torch.Generator):
    embeds = torch.randn(tokens, adapter.hidden_size, generator=generator, device=adapter.device, dtype=adapter.dtype)
    positions = torch.arange(tokens, device=adapter.device).expand(3, -1).contiguous()
    deepstack = torch.randn(tokens, adapter.hidden_size * adapter.deepstack_count, generator=generator,
                            device=adapter.device, dtype=adapter.dtype)
    return embeds, positions, deepstack


SHAPE_PRESETS = {"cuda": ("shape-qwen3-vl-8b", "shape-qwen3-vl-30b-a3b"),
                 "cpu": ("shape-qwen3-vl-8b-scaled", "shape-qwen3-vl-30b-a3b-scaled")}
SHAPE_BUCKETS = {"cuda": (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), "cpu": (16, 32, 64, 128, 256)}


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def shapes(args) -> None:
    import gc

    from parity.models import shapes as shape_presets

    cuda = args.device == "cuda"
    buckets = SHAPE_BUCKETS[args.device]
    for preset in SHAPE_PRESETS[args.device]:
        row = {"preset": preset, "dtype": "bfloat16"}
        try:
            shape_presets.check_memory(preset, torch.device(args.device), torch.bfloat16)
        except ModelUnavailableError as refused:  # an H100 holds less than an H200: say what was skipped, and why
            print(f"{preset}: skipped: {refused}", flush=True)
            _append(args.out, {"what": "skipped", **row, "reason": str(refused)})
            continue
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            adapter = load_model(preset, device=args.device, dtype="bfloat16").adapter
            row["build_s"] = round(time.perf_counter() - start, 2)
            formula = shape_presets.parameter_count(preset) * 2
            row.update(weights_formula_bytes=formula,
                       weights_bytes=sum(p.numel() * p.element_size() for p in adapter.model.parameters()),
                       allocated_after_build=(torch.cuda.memory_allocated() - base) if cuda else None)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            runner = _runner(adapter, args.device, buckets)
            slot_formula = max(buckets) * adapter.hidden_size * adapter.deepstack_count * adapter.dtype.itemsize
            row.update(capture_s=round(time.perf_counter() - start, 2), buckets=list(buckets),
                       capture_peak_bytes=(torch.cuda.max_memory_allocated() - before) if cuda else None,
                       slot_bytes=runner.deepstack_slot_bytes, slot_formula_bytes=slot_formula,
                       slot_ok=runner.deepstack_slot_bytes == slot_formula)
            print(f"{preset}: built in {row['build_s']} s ({row['weights_bytes'] / 2**30:.1f} GiB, formula "
                  f"{formula / 2**30:.1f}), {len(buckets)} buckets captured in {row['capture_s']} s, slot "
                  f"{runner.deepstack_slot_bytes / 2**20:.0f} MiB (formula {slot_formula / 2**20:.0f})", flush=True)
            _append(args.out, {"what": "build", **row})
            generator = torch.Generator(device=adapter.device).manual_seed(0)
            for bucket in buckets:
                tokens = bucket - bucket // 8  # a prompt that pads up to the bucket
                inputs = _random_inputs(adapter, tokens, generator)
                with torch.inference_mode():
                    replayed = runner.replay(*inputs)[0]
                    padded_inputs = runner.padded_inputs(*inputs)[:3]
                    padded = adapter.body(*padded_inputs)[0][:tokens]
                    repeat = adapter.body(*padded_inputs)[0][:tokens]  # the bound: eager against itself
                    unpadded = adapter.body(*inputs)[0]
                    iters = args.iters if bucket <= 1024 else max(3, args.iters // 6)
                    for _ in range(2):
                        adapter.body(*inputs)
                        runner.replay(*inputs)
                    eager_s = _median_seconds(lambda: adapter.body(*inputs), adapter.device, iters)
                    replay_s = _median_seconds(lambda: runner.replay(*inputs), adapter.device, iters)
                timing = {"what": "bucket", "preset": preset, "bucket": bucket, "tokens": tokens,
                          "eager_ms": eager_s * 1e3, "replay_ms": replay_s * 1e3, "speedup": eager_s / replay_s,
                          "vs_padded_eager_max_abs": _max_abs(replayed, padded),
                          "padded_eager_repeat_max_abs": _max_abs(padded, repeat),
                          "vs_unpadded_eager_max_abs": _max_abs(replayed, unpadded),
                          "hidden_rms": float(unpadded.float().pow(2).mean().sqrt())}
                _append(args.out, timing)
                print(f"{preset} bucket {bucket:5}: eager {eager_s * 1e3:9.3f} ms  replay {replay_s * 1e3:9.3f} ms  "
                      f"x{eager_s / replay_s:5.2f}  |replay-padded eager| {timing['vs_padded_eager_max_abs']:.3g}  "
                      f"|replay-eager| {timing['vs_unpadded_eager_max_abs']:.3g}", flush=True)
            runner.close()
        except Exception as err:  # a shape that cannot be built or captured here is a finding, not the end
            traceback.print_exc()
            _append(args.out, {"what": "error", **row, "error": f"{err.__class__.__name__}: {err}"})
        adapter = runner = None
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("matrix", "shapes"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
        cmd.add_argument("--out", type=Path, required=True, help="JSON lines, one row per measurement")
        if name == "matrix":
            cmd.add_argument("--preset", required=True)
            cmd.add_argument("--dtype", required=True)
            cmd.add_argument("--runs", help="write each run's results.json and report.md under this folder")
        if name == "shapes":
            cmd.add_argument("--iters", type=int, default=12)
    args = parser.parse_args()
    {"matrix": matrix, "shapes": shapes}[args.what](args)


if __name__ == "__main__":
    main()
