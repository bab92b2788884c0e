#!/usr/bin/env python3
"""Aggregates benches/compare results (summary.json of run.py) into markdown tables.

    python3 benches/compare/report.py target/bench-compare/summary.json

Prints, per system, the mean over every run and seed (a re-run of the same system, seed and
run number replaces the earlier one) with the [min, max] spread, then one row
per run with the machine load (1-minute load average before and after the run).
"""
import json
import statistics
import sys
from collections import OrderedDict

ORDER = ("mmrouter", "sglang", "sglang-bal", "envoy-rr", "oracle", "mmrouter-nocache",
         "mmrouter-sticky")
COLS = [
    ("ttft_p50", "TTFT p50 s", 1, 2), ("ttft_p90", "TTFT p90 s", 1, 2),
    ("ttft_p99", "TTFT p99 s", 1, 2), ("e2e_p50", "e2e p50 s", 1, 2),
    ("e2e_p90", "e2e p90 s", 1, 2), ("hit_rate", "prefix hit %", 100, 1),
    ("followup_hit_rate", "follow-up hit %", 100, 1),
    ("first_turn_hit_rate", "first-turn hit %", 100, 1),
    ("encoder_avoided", "encoder runs avoided %", 100, 1),
    ("imbalance_max_over_mean", "busiest worker / mean", 1, 2),
]


def cell(vals, scale, digits):
    vals = [v * scale for v in vals if v is not None]
    if not vals:
        return "-"
    m = statistics.fmean(vals)
    if len(vals) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{min(vals):.{digits}f}, {max(vals):.{digits}f}]"


def main(path):
    latest = OrderedDict()  # a later run of the same (system, seed, run) replaces an earlier one
    for block in json.load(open(path)):
        for r in block["results"]:
            latest.pop((r["system"], r["seed"], r["run"]), None)
            latest[(r["system"], r["seed"], r["run"])] = r
    runs = list(latest.values())
    by = OrderedDict((s, []) for s in ORDER)
    for r in runs:
        by.setdefault(r["system"], []).append(r)
    print("| system | runs | " + " | ".join(c[1] for c in COLS) + " | errors |")
    print("|---|---:|" + "---:|" * len(COLS) + "---:|")
    by = OrderedDict((s, rs) for s, rs in by.items() if rs)
    for system, rs in by.items():
        cells = [cell([r.get(k) for r in rs], s, d) for k, _, s, d in COLS]
        errors = sum(r["errors"] for r in rs)
        print(f"| {system} | {len(rs)} | " + " | ".join(cells) + f" | {errors} |")
    print()
    print("| system | seed | TTFT p50 / p90 / p99 s | prefix hit % | encoder runs / images | "
          "requests per worker | follow-ups that changed worker | KV blocks evicted | load before -> after |")
    print("|---|---:|---|---:|---|---|---:|---:|---|")
    for r in sorted(runs, key=lambda r: (list(by).index(r["system"]), r["seed"], r["run"])):
        dist = "/".join(str(v) for v in r["per_worker"].values())
        print(f"| {r['system']} | {r['seed']} | {r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} / "
              f"{r['ttft_p99']:.2f} | {100 * r['hit_rate']:.1f} | {r['encoder_runs']} / "
              f"{r['images_in_prompts']} | {dist} | {r.get('followups_switched_worker', '-')}"
              f"/{r.get('followups', '-')} | {r['kv_blocks_evicted']} | "
              f"{r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "target/bench-compare/summary.json")
