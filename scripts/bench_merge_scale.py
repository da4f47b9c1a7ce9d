"""How a merged sweep scales (issue 21): 5,000 cases at 64 new tokens in 64 shards through
`parity merge`, `parity verdict` and `parity report`, each a process of its own, with its wall time
and peak memory, and the merged file's size against the loader's cap.

    python scripts/bench_merge_scale.py [--cases 5000] [--shards 64] [--tokens 64] [--work DIR]

The shards are made from one real run of the embedded preset (`--fixture all` at --tokens new
tokens): each synthetic case is one of its fixtures with its own prompt, and carries that fixture's
real arms, so every file is one the loader accepts and the merge re-judges real comparisons. Targets
(on a 2-core machine): each command under 60 s and 2 GiB, the merged file under the loader's cap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parity.plan.entries import PlanEntry, plan_json, read_plan, text_sha256  # noqa: E402
from parity.trust.loader import MAX_FILE_BYTES  # noqa: E402
from parity.plan.sharding import Shard, assignment, shard_config  # noqa: E402


def parity(*args: str, stdout=subprocess.DEVNULL) -> tuple[int, float, float]:
    """(exit code, wall seconds, peak RSS MiB) of `python -m parity ARGS` in its own process."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "parity", *args], stdout=stdout, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) not in (0, 1, 3):
        sys.exit(f"parity {args[0]} failed: {process.stderr.read().decode()[-2000:]}")
    return os.waitstatus_to_exitcode(status), wall, usage.ru_maxrss / 1024


def real_run(work: Path, tokens: int) -> dict:
    out = work / "real"
    if not (out / "results.json").exists():
        code, wall, _ = parity("run", "--fixture", "all", "--max-new-tokens", str(tokens), "--no-plot",
                               "--out", str(out))
        print(f"real run: --fixture all at {tokens} tokens, exit {code}, {wall:.1f} s")
    return json.loads((out / "results.json").read_text())


def synthetic_shards(real: dict, work: Path, cases: int, count: int) -> list[Path]:
    """`cases` four-arm cases (the real fixtures, each with many prompts) in `count` shard files."""
    by_fixture = {c["fixture"]["name"]: c for c in real["cases"]}
    tokens = {e.id: e.prompt_tokens for e in read_plan(real["config"])}
    fixtures = list(by_fixture)
    per_fixture = -(-cases // len(fixtures))
    made = []
    for i in range(per_fixture):
        for name in fixtures:
            if len(made) == cases:
                break
            source = by_fixture[name]
            prompt = f"{source['prompt']} (variant {i + 1})"
            made.append(dict(source, id=f"{name}/prompt-{i + 1}", prompt=prompt, comparisons=[], verdict=None))
    # Case-list order is fixture-major, as `parity run` plans fixture x prompt.
    made.sort(key=lambda c: (fixtures.index(c["id"].split("/")[0]), int(c["id"].rsplit("-", 1)[1])))
    plan = [PlanEntry(c["id"], "four-arm", c["fixture"]["sha256"], text_sha256(c["prompt"]),
                      tokens[by_fixture[c["fixture"]["name"]]["id"]]) for c in made]
    config = dict(real["config"], plan=plan_json(plan))
    shards = assignment(plan, config["arms"], count)
    paths = []
    for k in range(1, count + 1):
        doc = dict(real, config=dict(config, shard=shard_config(Shard(k, count), shards)),
                   cases=[c for c in made if shards[c["id"]] == k], verdict=None)
        path = work / f"shard-{k}.json"
        path.write_text(json.dumps(doc))
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--work", type=Path, default=None, help="keep the files here (default: a temp folder)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="parity-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    real = real_run(work, args.tokens)
    paths = synthetic_shards(real, work, args.cases, args.shards)
    size = sum(p.stat().st_size for p in paths)
    print(f"{args.cases} cases at {args.tokens} tokens in {args.shards} shards: {size / 2**20:.0f} MiB of shard files")
    merged = work / "merged"
    rows = [("merge", parity("merge", *map(str, paths), "--out", str(merged), "--no-plot"))]
    results = merged / "results.json"
    rows.append(("verdict", parity("verdict", str(results))))
    rows.append(("report", parity("report", "--no-images", str(results))))
    print(f"merged results.json: {results.stat().st_size / 2**20:.0f} MiB "
          f"(the loader's cap: {MAX_FILE_BYTES / 2**20:.0f} MiB)")
    print(f"{'command':8} {'exit':>4} {'wall s':>7} {'peak MiB':>9}")
    for name, (code, wall, peak) in rows:
        print(f"{name:8} {code:>4} {wall:>7.1f} {peak:>9.0f}")


if __name__ == "__main__":
    main()
