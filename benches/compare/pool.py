#!/usr/bin/env python3
"""mmrouter against SGLang over several harness runs: one pair per (run, seed), pooled.

    python3 benches/compare/pool.py [--against SYSTEM] [--by-seed] DIR[:SYSTEM] ...
        # DIR:SYSTEM: mmrouter's row in that run (default mmrouter; the header names it);
        # --against: sglang
        # --by-seed: one pair per seed, the mean over every run and repeat of that seed

Single runs of a tight-cache cell move by about ±0.04, so one run's ratio says little. This
takes every run directory given (each a `scripts/bench-compare --out`), pairs mmrouter's
hit rate with SGLang's (or --against's) of the same run, family, worker count, seed and repeat
(--repeat), and prints per family
and worker count: pairs, mean hit rates, their ratio, the mean difference ± its standard
error, the pairs where mmrouter was at or above, the one-worker bound's mean over the same
runs and seeds (where the runs have it), and the mean of the runs' TTFT p99 (with the pairs
where mmrouter's was lower or equal). A markdown table on stdout. With `--by-seed` the pairs
are seeds: each side's hit rate and TTFT p99 are its means over the seed's runs and repeats,
so that the standard error is over seeds, not over runs of one seed.
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def pairs(spec, against):
    path, _, system = spec.partition(":")
    system = system or "mmrouter"
    results = json.loads((Path(path) / "results.json").read_text())
    by = {(r["family"], r["workers"], r["seed"], r["system"], r.get("repeat", 0)): r
          for r in results}
    for (fam, w, seed, s, rep), r in by.items():
        g = by.get((fam, w, seed, against, rep))
        if s == system and g and r.get("hit_rate") is not None and g.get("hit_rate") is not None:
            yield (fam, w), r, g, by.get((fam, w, seed, "bound", rep), by.get((fam, w, seed, "bound", 0)))


def by_seed(ps):
    """(mmrouter, against) pairs of one cell averaged per seed: one pair of means a seed."""
    seeds = {}
    for r, g in ps:
        seeds.setdefault(r["seed"], []).append((r, g))

    def mean(rows, key):
        values = [x.get(key) for x in rows]
        return None if None in values else statistics.fmean(values)

    out = []
    for _, runs in sorted(seeds.items()):
        sides = ([r for r, _ in runs], [g for _, g in runs])
        out.append(tuple({k: mean(rows, k) for k in ("hit_rate", "ttft_p99")} for rows in sides))
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="DIR[:SYSTEM]",
                    help="a scripts/bench-compare --out directory; SYSTEM: the row paired "
                         "(default mmrouter)")
    ap.add_argument("--against", default="sglang", help="the system it is paired with")
    ap.add_argument("--by-seed", action="store_true",
                    help="one pair per seed: the means over the seed's runs and repeats")
    a = ap.parse_args(argv)
    against, seeded = a.against, a.by_seed
    # The header names the row paired: `mmrouter-hsw`, not `mmrouter`, when DIR:mmrouter-hsw.
    label = " + ".join(dict.fromkeys(spec.partition(":")[2] or "mmrouter" for spec in a.runs))
    cells, bounds = {}, {}
    for spec in a.runs:
        for key, r, g, bound in pairs(spec, against):
            cells.setdefault(key, []).append((r, g))
            bounds.setdefault(key, []).append(bound and bound.get("hit_rate"))
    print(f"| family | workers | pairs | {label} | {against} | ratio | difference ± SE | {label} ≥ "
          f"{against} | bound | TTFT p99 s, {label} / {against} ({label} lower or equal) |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|")
    for (fam, w), ps in sorted(cells.items()):
        if seeded:
            ps = by_seed(ps)
        bs = bounds.get((fam, w), [])
        bound = f"{statistics.fmean(bs):.3f}" if bs and None not in bs else "-"
        a = [r["hit_rate"] for r, _ in ps]
        b = [g["hit_rate"] for _, g in ps]
        d = [x - y for x, y in zip(a, b)]
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        ma, mb = statistics.fmean(a), statistics.fmean(b)
        pa = [r.get("ttft_p99") for r, _ in ps]
        pb = [g.get("ttft_p99") for _, g in ps]
        if None in pa or None in pb:
            p99 = "-"
        else:
            lower = sum(1 for x, y in zip(pa, pb) if x <= y)
            p99 = f"{statistics.fmean(pa):.2f} / {statistics.fmean(pb):.2f} ({lower} of {len(ps)})"
        print(f"| {fam} | {w} | {len(ps)} | {ma:.3f} | {mb:.3f} | {ma / mb:.2f}× | "
              f"{statistics.fmean(d):+.3f} ± {se:.3f} | {sum(1 for x in d if x >= 0)} | {bound} | {p99} |")


if __name__ == "__main__":
    main(sys.argv[1:])
