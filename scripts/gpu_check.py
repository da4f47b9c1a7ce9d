"""Every GPU check of the graph runner in one call (see scripts/gpu_check.sh).

1. Verdicts: each embedded preset x runner variant x dtype (fp32, bf16) x scenario (four-arm, reuse,
   stream) on the `cuda` graph backend, against the verdict a correct harness must give; then the
   bug family (docs/scenarios.md): the fixed runner on each family scenario, each planted variant on
   its own; failing cases are localized on the GPU too (the first divergent layer is in the summary).
2. Replay vs eager prefill time per bucket (<= 512 tokens) for tiny-qwen3-vl and mid-qwen3-vl (bf16).
3. The DeepStack slot's memory: exactly max_tokens x hidden x n x dtype bytes, 0 without DeepStack.

Writes summary.md, summary.json and runs.tar.gz (every results.json and report.md) under --out.
`--device cpu` runs the same checks on the emulated backend (a dry run of this script, no timings
worth reading).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
import time
import traceback
from pathlib import Path

import torch

from parity.arms import select_arms
from parity.backends.transformers_backend import TransformersBackend
from parity.design import FAMILY_SCENARIOS, PLANTED_BUGS
from parity.run.experiment import run_experiment
from parity.run.planning import CaseSpec, RunSpec
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import default_prompts
from parity.runner.graph_runner import PrefillGraphRunner, RunnerVariant
from parity.models import load_model
from parity.judge.metrics import tuple_text
from parity.reporting.report import localization_sentence, render_markdown
from parity.results import write_results

PRESETS = ("tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-qwen3-vl-nodeepstack")
TIMED_PRESETS = ("tiny-qwen3-vl", "mid-qwen3-vl")
BUCKETS = (16, 32, 64, 128, 256, 512)
SCENARIOS = ("four-arm", "reuse", "stream")
# The bug family: the fixed runner on each scenario, each planted variant on its own (docs/scenarios.md).
FAMILY_RUNS = tuple(("fixed", s) for s in FAMILY_SCENARIOS) + tuple((v, s) for v, (s, _) in PLANTED_BUGS.items())
# What each planted variant gives on its own scenario, alone in a run (docs/scenarios.md's table).
PLANTED_VERDICTS = {"chunk-misaligned": "FAIL_GRAPH_DIVERGES", "prefix-offset": "FAIL_GRAPH_DIVERGES",
                    "growth-rebind": "FAIL_STALE_STATE", "warmup-specialized": "FAIL_DEEPSTACK_DROPPED",
                    "layout-keyed": "FAIL_GRAPH_DIVERGES"}


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


def verdict_matrix(device: str, graph_backend: str, runs_dir: Path) -> list[dict]:
    rows = []
    fixture = builtin_fixture("rgb-stripes")
    case = CaseSpec(fixture, default_prompts(fixture)[0])
    for dtype in ("float32", "bfloat16"):
        for preset in PRESETS:
            loaded = load_model(preset, device=device, dtype=dtype)
            runs = [(r, s) for r in ("fixed", "legacy", "no-clear") for s in SCENARIOS] + list(FAMILY_RUNS)
            for runner, scenario in runs:
                want = expected_verdict(preset, runner, scenario)
                name = f"{preset}-{dtype}-{runner}-{scenario}"
                start = time.perf_counter()
                try:
                    spec = RunSpec(model=preset, arms=select_arms("all"), cases=(case,), scenarios=(scenario,))
                    backend = TransformersBackend(loaded, max_new_tokens=20, runner_variant=RunnerVariant(runner),
                                                  graph_backend=graph_backend)
                    run = run_experiment(spec, backend)
                    got, reason = run.verdict.code, run.verdict.reason
                    # bcg vs eager: tells a bf16 near-tie flip (small delta) from a real divergence.
                    first = run.cases[0].comparisons[0] if run.cases[0].comparisons else None
                    graph_vs_eager = tuple_text(first, run.logprob_tol) if first else "—"
                    if run.cases[0].localization is not None:
                        graph_vs_eager += f"; {localization_sentence(run.cases[0])}"
                    folder = runs_dir / name
                    folder.mkdir(parents=True)
                    write_results(run, folder / "results.json")
                    (folder / "report.md").write_text(render_markdown(run))
                except Exception as err:  # a check that crashes is a finding, not the end of the script
                    got, reason, graph_vs_eager = "CRASH", f"{err.__class__.__name__}: {err}", "—"
                    traceback.print_exc()
                rows.append({"preset": preset, "dtype": dtype, "runner": runner, "scenario": scenario,
                             "expected": want, "got": got, "ok": got == want, "reason": reason, "graph_vs_eager": graph_vs_eager,
                             "seconds": round(time.perf_counter() - start, 2)})
                print(f"{name:55} {got:28} {'ok' if got == want else 'UNEXPECTED (want ' + want + ')'}", flush=True)
            del loaded
    return rows


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


def replay_timings(device: str, graph_backend: str, iters: int) -> list[dict]:
    rows = []
    for preset in TIMED_PRESETS:
        loaded = load_model(preset, device=device, dtype="bfloat16")
        adapter = loaded.adapter
        start = time.perf_counter()
        runner = PrefillGraphRunner(adapter.body, hidden_size=adapter.hidden_size, dtype=adapter.dtype,
                                    device=adapter.device, buckets=BUCKETS, graph_backend=_graph(graph_backend, adapter.device))
        capture_s = time.perf_counter() - start
        generator = torch.Generator(device=adapter.device).manual_seed(0)
        for bucket in BUCKETS:
            embeds = torch.randn(bucket, adapter.hidden_size, generator=generator, device=adapter.device, dtype=adapter.dtype)
            positions = torch.arange(bucket, device=adapter.device).expand(3, -1).contiguous()
            deepstack = torch.randn(bucket, adapter.hidden_size * adapter.deepstack_count, generator=generator,
                                    device=adapter.device, dtype=adapter.dtype)
            with torch.inference_mode():
                eager_out = adapter.body(embeds, positions, deepstack)[0]
                replay_out = runner.replay(embeds, positions, deepstack)[0]
                for _ in range(3):  # warm-up both paths
                    adapter.body(embeds, positions, deepstack)
                    runner.replay(embeds, positions, deepstack)
                eager_s = _median_seconds(lambda: adapter.body(embeds, positions, deepstack), adapter.device, iters)
                replay_s = _median_seconds(lambda: runner.replay(embeds, positions, deepstack), adapter.device, iters)
            rows.append({"preset": preset, "bucket": bucket, "eager_ms": eager_s * 1e3, "replay_ms": replay_s * 1e3,
                         "speedup": eager_s / replay_s, "capture_s": capture_s,
                         "max_abs_diff": float((eager_out.float() - replay_out.float()).abs().max())})
            print(f"{preset:16} bucket {bucket:4}: eager {eager_s * 1e3:8.3f} ms  replay {replay_s * 1e3:8.3f} ms  "
                  f"x{eager_s / replay_s:5.2f}", flush=True)
        runner.close()
        del loaded, runner
    return rows


def slot_memory(device: str, graph_backend: str) -> list[dict]:
    rows = []
    for preset in ("tiny-qwen3-vl", "tiny-qwen3-vl-nodeepstack"):
        for dtype in ("float32", "bfloat16"):
            adapter = load_model(preset, device=device, dtype=dtype).adapter
            runner = PrefillGraphRunner(adapter.body, hidden_size=adapter.hidden_size, dtype=adapter.dtype,
                                        device=adapter.device, buckets=BUCKETS, graph_backend=_graph(graph_backend, adapter.device))
            formula = max(BUCKETS) * adapter.hidden_size * adapter.deepstack_count * adapter.dtype.itemsize
            rows.append({"preset": preset, "dtype": dtype, "slot_bytes": runner.deepstack_slot_bytes,
                         "formula_bytes": formula, "ok": runner.deepstack_slot_bytes == formula})
            print(f"{preset:26} {dtype:9} DeepStack slot {runner.deepstack_slot_bytes:9} B (formula {formula})", flush=True)
            runner.close()
    return rows


def _graph(name: str, device: torch.device):
    from parity.runner.graph_runner import GraphBackend

    return GraphBackend.resolve(name, device)


def write_summary(out: Path, summary: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# parity GPU check\n\n{summary['environment']}\n", f"## Verdicts ({summary['graph_backend']} graph backend)\n",
             "| preset | dtype | runner | scenario | expected | got | ok | bcg vs eager | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['preset']} | {r['dtype']} | {r['runner']} | {r['scenario']} | {r['expected']} | {r['got']} | "
              f"{'✅' if r['ok'] else '❌'} | {r['graph_vs_eager']} | {r['seconds']} |" for r in summary["verdicts"]]
    lines += ["\n## Replay vs eager prefill (bf16)\n", "| preset | bucket | eager ms | replay ms | speed-up | max abs diff |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['preset']} | {r['bucket']} | {r['eager_ms']:.3f} | {r['replay_ms']:.3f} | {r['speedup']:.2f}× | "
              f"{r['max_abs_diff']:.3g} |" for r in summary["timings"]]
    lines += ["\n## DeepStack slot memory\n", "| preset | dtype | slot bytes | formula | ok |", "|---|---|---|---|---|"]
    lines += [f"| {r['preset']} | {r['dtype']} | {r['slot_bytes']} | {r['formula_bytes']} | {'✅' if r['ok'] else '❌'} |"
              for r in summary["memory"]]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu-check-out")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    graph_backend = "cuda" if args.device == "cuda" else "emulated"
    env = f"torch {torch.__version__}, device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}"
    summary = {"environment": env, "graph_backend": graph_backend, "verdicts": [], "timings": [], "memory": []}
    try:
        summary["memory"] = slot_memory(args.device, graph_backend)
        summary["verdicts"] = verdict_matrix(args.device, graph_backend, runs)
        summary["timings"] = replay_timings(args.device, graph_backend, args.iters)
    finally:
        write_summary(out, summary)
        with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
            tar.add(runs, arcname="runs")
    bad = [r for r in summary["verdicts"] if not r["ok"]] + [r for r in summary["memory"] if not r["ok"]]
    print(f"{len(bad)} unexpected result(s); summary in {out / 'summary.md'}")


if __name__ == "__main__":
    main()
