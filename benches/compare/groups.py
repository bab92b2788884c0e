#!/usr/bin/env python3
"""How each system spread the trace's groups (system prompts) over its workers.

    python3 benches/compare/groups.py target/bench-compare [OUT ...] [--family F]

For every family x workers x system, the mean over its runs (every seed and repeat in the run
directories given) of: the distinct groups each worker served; how many times per request a
worker's next request was of another group than its last (by send time); and the hit rate.
Under a tight cache a worker keeps little more than its last request or two, so a worker that
switches groups often recomputes their preambles; a router that keeps each group on one worker
serves (groups / workers) groups per worker where groups outnumber workers.
"""
import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from statistics import mean

RECORDS = re.compile(r"(?P<fam>.+)-w(?P<w>\d+)-seed(?P<seed>\d+)-(?P<sys>.+)-r\d+\.json")


def groups_of(trace):
    """Session -> its group (the trace's `system` index) from a trace's JSON lines."""
    out = {}
    for line in trace.read_text().splitlines():
        t = json.loads(line)
        if t.get("type") == "turn":
            out.setdefault(t["session"], t.get("system"))
    return out


def spread(records, groups):
    """(groups per worker, group switches per request) of one run's records."""
    per_worker = defaultdict(list)
    for r in sorted((r for r in records if not r.get("error")), key=lambda r: r["sent"]):
        per_worker[r["worker"]].append(groups.get(r["session"]))
    seq = list(per_worker.values())
    pairs = sum(max(0, len(s) - 1) for s in seq)
    switches = sum(1 for s in seq for a, b in zip(s, s[1:]) if a != b)
    return mean(len(set(s)) for s in seq) if seq else 0.0, switches / max(1, pairs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="+")
    ap.add_argument("--family")
    a = ap.parse_args()
    cells = defaultdict(list)
    for out in map(Path, a.out):
        for p in sorted((out / "records").glob("*.json")):
            m = RECORDS.fullmatch(p.name)
            if not m or (a.family and m["fam"] != a.family):
                continue
            trace = out / "traces" / f"{m['fam']}-seed{m['seed']}.jsonl"
            d = json.loads(p.read_text())
            if not trace.exists() or d["summary"].get("hit_rate") is None:
                continue
            per_worker, switches = spread(d["records"], groups_of(trace))
            cells[(m["fam"], int(m["w"]), m["sys"])].append(
                (per_worker, switches, d["summary"]["hit_rate"]))
    print("| family | workers | system | runs | groups per worker | group switches per request "
          "| hit rate |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for (fam, w, system), runs in sorted(cells.items()):
        print(f"| {fam} | {w} | {system} | {len(runs)} | {mean(r[0] for r in runs):.2f} | "
              f"{mean(r[1] for r in runs):.3f} | {mean(r[2] for r in runs):.3f} |")


if __name__ == "__main__":
    main()
