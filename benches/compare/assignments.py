#!/usr/bin/env python3
"""What two systems' assignments of requests to workers are worth without their timing.

    .venv/bin/python benches/compare/assignments.py target/bench-compare [--a mmrouter]
        [--b sglang] [--family F] [--images-dir DIR]

For every family x workers x seed that both systems ran in the run directory, each system's
recorded assignment (which worker each request went to, from `records/`) is replayed in its
recorded send order through the simulator's block pools (`sim.BlockPool`, the mock's pool one
request at a time, with the run's cache size). Then each system's send order is replayed
with the other's first-turn placement (a conversation's first turn on the worker the other
system chose, its follow-ups with it). Printed per family x workers, means over the seeds
(`--per-seed`: one row per seed):

- `measured`: the hit rate the workers reported;
- `replayed`: the hit rate of the same assignment and order in the pools. Close to
  `measured` when the outcome is the assignment's, not the timing's (requests in flight,
  what an engine admitted when);
- `A order, B placement` and `B order, A placement`: where these follow the placement
  rather than the order, the first-turn placement is what separates the two systems.

The requests' blocks come from the run's saved traces (`traces/`), expanded as the harness
does (the trace-blocks tool, `TRACE_BLOCKS_BIN`, and the image pool in `--images-dir`).
"""
import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import blocks  # noqa: E402
import sim  # noqa: E402
import trace as tracegen  # noqa: E402
from explain import load  # noqa: E402
from run import BLOCK_SIZE, tools_from_env  # noqa: E402


def replay_assignment(requests, recs, capacity, placement=None):
    """Cached over prompt tokens of `recs` (records by (session, turn)) replayed in their send
    order through one pool per worker; with `placement` (session -> worker) a conversation's
    first turn goes there instead and its follow-ups go with it."""
    order = sorted(recs.values(), key=lambda r: r["sent"])
    pools = defaultdict(lambda: sim.BlockPool(capacity, BLOCK_SIZE))
    where = {}
    cached = prompt = 0
    for r in order:
        req = requests.get((r["session"], r["turn"]))
        if req is None:
            continue
        worker = r["worker"]
        if placement is not None:
            worker = where.get(r["session"]) or placement.get(r["session"], worker)
        where[r["session"]] = worker
        cached += pools[worker].run(req)
        prompt += req.prompt_tokens
    return cached / prompt if prompt else 0.0


def first_turns(recs):
    return {s: r["worker"] for (s, t), r in recs.items() if t == 0}


def measured(recs):
    prompt = sum(r["prompt_tokens"] for r in recs.values())
    return sum(r["cached_tokens"] for r in recs.values()) / prompt if prompt else 0.0


def cache_sizes(out):
    rows = json.loads((Path(out) / "results.json").read_text())
    return {(r["family"], r["workers"], r["seed"]): r["gpu_blocks"] for r in rows
            if r.get("gpu_blocks")}


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="a scripts/bench-compare output directory")
    ap.add_argument("--a", default="mmrouter")
    ap.add_argument("--b", default="sglang")
    ap.add_argument("--family", help="only this family")
    ap.add_argument("--per-seed", action="store_true", help="one row per seed, not their mean")
    ap.add_argument("--images-dir", default=str(Path(tempfile.gettempdir()) / "mmrouter-cmp-images"))
    a = ap.parse_args(argv)
    runs_a, runs_b = load(a.out, a.a), load(a.out, a.b)
    sizes = cache_sizes(a.out)
    tool = blocks.TraceBlocks(tools_from_env()["trace_blocks"], BLOCK_SIZE)
    expanded = {}
    cells = defaultdict(list)
    try:
        for key in sorted(set(runs_a) & set(runs_b)):
            fam, workers, seed = key
            if (a.family and fam != a.family) or key not in sizes:
                continue
            if (fam, seed) not in expanded:
                header, turns = tracegen.load(Path(a.out) / "traces" / f"{fam}-seed{seed}.jsonl")
                pool = tracegen.ImagePool(header, a.images_dir)
                pool.warm()
                expanded[(fam, seed)] = blocks.expand(header, turns, pool, tool)
            reqs, _ = blocks.fit_to_cache(expanded[(fam, seed)], sizes[key], BLOCK_SIZE)
            requests = {(r.session, r.turn): r for r in reqs}
            ra, rb = runs_a[key], runs_b[key]
            cap = sizes[key]
            cells[(fam, workers, seed if a.per_seed else None)].append((
                measured(ra), measured(rb),
                replay_assignment(requests, ra, cap), replay_assignment(requests, rb, cap),
                replay_assignment(requests, ra, cap, first_turns(rb)),
                replay_assignment(requests, rb, cap, first_turns(ra)),
            ))
    finally:
        tool.close()
    print(f"| family | workers | seeds | {a.a} measured / replayed | {a.b} measured / replayed "
          f"| {a.a} order, {a.b} placement | {a.b} order, {a.a} placement |")
    print("|---|---:|---:|---|---|---:|---:|")
    for (fam, workers, seed), rows in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        m = [sum(c) / len(rows) for c in zip(*rows)]
        seeds = len(rows) if seed is None else f"seed {seed}"
        print(f"| {fam} | {workers} | {seeds} | {m[0]:.3f} / {m[2]:.3f} | {m[1]:.3f} / {m[3]:.3f} "
              f"| {m[4]:.3f} | {m[5]:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
