#!/usr/bin/env python3
"""First-turn placement rules compared offline, in the simulator's pools, over many seeds.

    .venv/bin/python benches/compare/placement.py --family tight-256 --workers 2 \
        --seeds 200-229 [--users 16] [--against groups-least] [--per-seed] [--sessions N]

`assignments.py` showed that where a conversation starts (its first turn's worker; its
follow-ups go with it) is what separates mmrouter from SGLang in the tight families. This
replays each seed's trace in the harness's nominal order (`sim.nominal_order`) through one
`sim.BlockPool` per worker, with follow-ups always on their first turn's worker, and only the
first turns placed by a rule:

- `longest-hit`: the worker with the longest cached prefix, ties to the fewest requests
  (SGLang's cache-aware choice, and `sim-online` made sticky);
- `groups-least`: every group of sessions that share a system prompt on one worker, a new
  group on the worker with the fewest requests so far (mmrouter's homes with 2 workers, where
  their load bound never binds; its "least homed traffic" counted in requests);
- `groups-fewest`: the same, a new group on the worker with the fewest groups, ties to the
  fewest requests (`scoring.home_fewest_groups`);
- `split` (2 workers, at most 10 groups): every split of the groups between the two workers,
  reported as the worst, median and best; with the strict rules being splits themselves, this
  says how much the split decides and where the rules land in it.

Printed: per rule the mean hit rate over the seeds and its difference from `--against` with
the standard error and the seeds where it was higher. One request at a time, with the state
exact: it ranks rules, it does not predict a concurrent run's hit rate (docs/BENCHMARKS.md,
fifty-fifth run, compares it with measured runs).
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import blocks  # noqa: E402
import sim  # noqa: E402
import trace as tracegen  # noqa: E402
from run import BLOCK_SIZE, WORKER_DEFAULTS, tools_from_env  # noqa: E402


def replay(order, workers, capacity, place):
    """Hit rate of `order` with each session's first turn on `place(request, pools, counts)`
    and its follow-ups with it."""
    pools = [sim.BlockPool(capacity, BLOCK_SIZE) for _ in range(workers)]
    counts = [0] * workers
    where = {}
    cached = prompt = 0
    for r in order:
        w = where.get(r.session)
        if w is None:
            w = where[r.session] = place(r, pools, counts)
        counts[w] += 1
        cached += pools[w].run(r)
        prompt += r.prompt_tokens
    return cached / prompt if prompt else 0.0


def longest_hit(workers):
    def place(r, pools, counts):
        hits = [p.hit_blocks(r) for p in pools]
        return max(range(workers), key=lambda w: (hits[w], -counts[w], -w))
    return place


def groups(workers, group_of, by_groups):
    home = {}

    def place(r, pools, counts):
        g = group_of[r.session]
        if g not in home:
            homed = [sum(1 for h in home.values() if h == w) for w in range(workers)]
            key = (lambda w: (homed[w], counts[w], w)) if by_groups else (lambda w: (counts[w], w))
            home[g] = min(range(workers), key=key)
        return home[g]
    return place


def splits(order, capacity, group_of):
    names = sorted(set(group_of.values()))
    out = []
    for mask in range(2 ** (len(names) - 1)):
        side = {g: (mask >> i) & 1 for i, g in enumerate(names)}
        out.append(replay(order, 2, capacity, lambda r, pools, counts: side[group_of[r.session]]))
    return sorted(out)


def seeds_arg(text):
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="tight-256", choices=list(tracegen.NAMED))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seeds", type=seeds_arg, default=seeds_arg("200-209"),
                    help="comma-separated seeds or ranges (200-229)")
    ap.add_argument("--users", type=int, help="closed-loop users (the family's otherwise)")
    ap.add_argument("--sessions", type=int, help="sessions per trace (the family's otherwise)")
    ap.add_argument("--against", default="groups-least")
    ap.add_argument("--per-seed", action="store_true")
    ap.add_argument("--images-dir", default=str(Path(tempfile.gettempdir()) / "mmrouter-cmp-images"))
    a = ap.parse_args(argv)
    tool = blocks.TraceBlocks(tools_from_env()["trace_blocks"], BLOCK_SIZE)
    results = {}
    try:
        for seed in a.seeds:
            over = {"users": a.users} if a.users else {}
            header, turns = tracegen.family_trace(a.family, seed, sessions=a.sessions, **over)
            pool = tracegen.ImagePool(header, a.images_dir)
            pool.warm()
            capacity = tracegen.family_params(a.family)["gpu_blocks"]
            reqs, _ = blocks.fit_to_cache(blocks.expand(header, turns, pool, tool), capacity, BLOCK_SIZE)
            order = sim.nominal_order(reqs, header["arrival"], WORKER_DEFAULTS["prefill_tps"],
                                      WORKER_DEFAULTS["decode_tps"], WORKER_DEFAULTS["encoder_ms"])
            group_of = {t["session"]: t["system"] for t in turns}
            row = {
                "longest-hit": replay(order, a.workers, capacity, longest_hit(a.workers)),
                "groups-least": replay(order, a.workers, capacity, groups(a.workers, group_of, False)),
                "groups-fewest": replay(order, a.workers, capacity, groups(a.workers, group_of, True)),
            }
            if a.workers == 2 and len(set(group_of.values())) <= 10:
                s = splits(order, capacity, group_of)
                row.update({"split, worst": s[0], "split, median": statistics.median(s),
                            "split, best": s[-1]})
            results[seed] = row
            if a.per_seed:
                print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()), flush=True)
    finally:
        tool.close()
    base = [results[s][a.against] for s in a.seeds]
    print(f"| rule | {a.family}, {a.workers} workers{f', {a.users} users' if a.users else ''}: "
          f"mean over {len(a.seeds)} seeds | − {a.against} ± SE | seeds higher |")
    print("|---|---:|---|---:|")
    for rule in results[a.seeds[0]]:
        v = [results[s][rule] for s in a.seeds]
        d = [x - y for x, y in zip(v, base)]
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        print(f"| {rule} | {statistics.fmean(v):.4f} | {statistics.fmean(d):+.4f} ± {se:.4f} "
              f"| {sum(1 for x in d if x > 0)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
