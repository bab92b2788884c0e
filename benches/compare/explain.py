#!/usr/bin/env python3
"""Where one system's cache hits differ from another's, from the per-request records.

    python3 benches/compare/explain.py target/bench-compare [OUT ...] [--a mmrouter]
        [--b sglang] [--family F]

For every family x workers, summed over the seeds both systems ran in each run directory given
(the same requests, joined on session and turn): cached tokens of A minus B on first turns and
on follow-ups, and in the first and second half of the run (by A's send time, split at half
its last); follow-ups
that A and B sent to another worker than the previous turn, with the history tokens such a
move left behind (previous turn's prompt tokens the new worker did not have cached); and
first turns that A sent where less was cached than B found (new content placed away from a
worker that had its prefix).
"""
import argparse
import json
from collections import OrderedDict, defaultdict
from pathlib import Path


def load(out, system):
    runs = {}
    for p in sorted((Path(out) / "records").glob(f"*-{system}-r0.json")):
        d = json.loads(p.read_text())
        fam, rest = p.name.split("-w", 1)
        workers = int(rest.split("-", 1)[0])
        seed = int(rest.split("-seed", 1)[1].split("-", 1)[0])
        if p.name != f"{fam}-w{workers}-seed{seed}-{system}-r0.json":
            continue
        runs[(fam, workers, seed)] = {(r["session"], r["turn"]): r for r in d["records"]
                                      if not r.get("error")}
    return runs


def moves(recs):
    """Follow-ups on another worker than their previous turn: (count, history tokens lost)."""
    n = lost = 0
    for (s, t), r in recs.items():
        if t == 0:
            continue
        prev = recs.get((s, t - 1))
        if prev and prev["worker"] != r["worker"]:
            n += 1
            lost += max(0, prev["prompt_tokens"] - r["cached_tokens"])
    return n, lost


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="+")
    ap.add_argument("--a", default="mmrouter")
    ap.add_argument("--b", default="sglang")
    ap.add_argument("--family")
    a = ap.parse_args()
    ra, rb = {}, {}
    for i, out in enumerate(a.out):
        ra.update({(i, *k): v for k, v in load(out, a.a).items()})
        rb.update({(i, *k): v for k, v in load(out, a.b).items()})
    agg = OrderedDict()
    for key in sorted(set(ra) & set(rb)):
        _, fam, w, _ = key
        if a.family and fam != a.family:
            continue
        x, y = ra[key], rb[key]
        g = agg.setdefault((fam, w), defaultdict(int))
        g["seeds"] += 1
        half = max((r.get("sent") or 0.0 for r in x.values()), default=0.0) / 2
        for k, r in x.items():
            if k not in y:
                continue
            d = r["cached_tokens"] - y[k]["cached_tokens"]
            g["prompt"] += r["prompt_tokens"]
            g["late_diff" if (r.get("sent") or 0.0) >= half else "early_diff"] += d
            if k[1] == 0:
                g["first_diff"] += d
                if d < 0:
                    g["first_worse"] += 1
                    g["first_worse_tokens"] += -d
            else:
                g["follow_diff"] += d
                if d < 0:
                    g["follow_worse"] += 1
                    g["follow_worse_tokens"] += -d
        for name, recs in ((a.a, x), (a.b, y)):
            n, lost = moves(recs)
            g[f"{name}_moved"] += n
            g[f"{name}_moved_lost"] += lost
        g["followups"] += sum(1 for k in x if k[1] > 0)
    print(f"| family | workers | seeds | {a.a} - {a.b} cached tokens: first turns / follow-ups "
          f"(share of prompt) | first turns worse (tokens) | follow-ups worse (tokens) | "
          f"follow-ups moved {a.a} (history tokens left) | moved {a.b} (left) | "
          f"first half / second half (tokens) |")
    print("|---|---:|---:|---|---|---|---|---|---|")
    for (fam, w), g in agg.items():
        p = max(1, g["prompt"])
        print(f"| {fam} | {w} | {g['seeds']} | {g['first_diff']:+d} / {g['follow_diff']:+d} "
              f"({g['first_diff'] / p:+.3f} / {g['follow_diff'] / p:+.3f}) | "
              f"{g['first_worse']} ({g['first_worse_tokens']}) | {g['follow_worse']} "
              f"({g['follow_worse_tokens']}) | {g[f'{a.a}_moved']}/{g['followups']} "
              f"({g[f'{a.a}_moved_lost']}) | {g[f'{a.b}_moved']}/{g['followups']} "
              f"({g[f'{a.b}_moved_lost']}) | {g['early_diff']:+d} / {g['late_diff']:+d} |")


if __name__ == "__main__":
    main()
