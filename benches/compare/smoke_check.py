#!/usr/bin/env python3
"""Assertions of the harness smoke test (scripts/test-harness) on a run's output directory.

    python3 benches/compare/smoke_check.py DIR [--min-requests N] [--systems a,b,...]

Fails (exit 1, with the reasons) unless: report.md holds the table; every system of the run
has a row per family and worker count; hit rates are numbers in [0, 1]; the bound (one
worker, unbounded cache) and the sim reference are at least round robin's; sim does not beat
the bound; every sim row has its sim-online row (the policy without lookahead), at most sim's;
the prebuilt requests match what the mock computed (answers and prompt tokens); the workers'
counters count as many requests as were answered (with --warmup: every system but the bound
warmed up first, on a trace of the same system prompts and other turns, and its requests are
not counted); the simulator
reproduces the bound run's cached tokens; no run failed or had errors; mmrouter rows carry a
prediction error and a TTFT forecast error; in families of URL images the filter fetched
through Envoy at least once and at most once per image; every system named by --systems has
run (a system that failed to start leaves no result).
"""
import json
import sys
from pathlib import Path

from report import SIMULATED
from run import WARMUP_SEED_OFFSET


def turn_texts(lines):
    """The user texts of a trace's turns (its lines after the header)."""
    return {json.loads(x).get("text") for x in lines[1:]} - {None}


def check(out, min_requests, expected=()):
    out = Path(out)
    problems = []
    md = (out / "report.md").read_text()
    if "| family | workers | system | hit rate" not in md:
        problems.append("report.md has no table")
    rows = json.loads((out / "report.json").read_text())["rows"]
    results = json.loads((out / "results.json").read_text())
    meta = out / "meta.json"
    warmup = json.loads(meta.read_text()).get("warmup_s") if meta.exists() else None
    by = {(r["family"], r["workers"], r["system"]): r for r in rows}
    systems = {r["system"] for r in results}
    for s in expected:
        if s not in systems:
            problems.append(f"{s}: no run finished (see the log: it failed to start or run)")
    cells = {(r["family"], r["workers"]) for r in results}
    for fam, w in sorted(cells):
        for s in sorted(systems):
            if (fam, w, s) not in by:
                problems.append(f"no row for {fam} / {w} workers / {s}")
    for r in rows:
        h = r.get("hit_rate")
        if not isinstance(h, (int, float)) or not 0.0 <= h <= 1.0:
            problems.append(f"{r['family']}/{r['workers']}/{r['system']}: hit rate {h!r} not in [0, 1]")
        if r["system"] not in SIMULATED and r.get("errors"):
            problems.append(f"{r['family']}/{r['workers']}/{r['system']}: {r['errors']} errors")
        if r["system"] in ("mmrouter", "mmrouter-approx"):
            for field, what, header in (("prediction_mae_tokens", "prediction error", "overlap"),
                                        ("ttft_forecast_mae_ms", "TTFT forecast error", "decision")):
                if field not in r:
                    problems.append(f"{r['family']}/{r['workers']}/{r['system']}: no {what} "
                                    f"(x-mmrouter-{header} missing?)")
    for fam, w in sorted(cells):
        rr, bound, simr = (by.get((fam, w, s)) for s in ("envoy-rr", "bound", "sim"))
        if rr and bound and bound["hit_rate"] < rr["hit_rate"]:
            problems.append(f"{fam}/{w}: bound {bound['hit_rate']} below round robin {rr['hit_rate']}")
        if rr and simr and simr["hit_rate"] < rr["hit_rate"]:
            problems.append(f"{fam}/{w}: sim {simr['hit_rate']} below round robin {rr['hit_rate']}")
        online = by.get((fam, w, "sim-online"))
        if simr and not online:
            problems.append(f"{fam}/{w}: a sim row without its sim-online row")
        if simr and online and online["hit_rate"] > simr["hit_rate"]:
            problems.append(f"{fam}/{w}: sim-online {online['hit_rate']} above the best sim "
                            f"policy {simr['hit_rate']}")
        if bound and simr and simr["hit_rate"] > bound["hit_rate"] + 0.01:
            problems.append(f"{fam}/{w}: sim {simr['hit_rate']} above the unbounded bound {bound['hit_rate']}")
    for r in results:
        if r["system"] in SIMULATED:
            continue
        tag = f"{r['family']}/{r['workers']}/{r['system']}"
        if r.get("ok", 0) < min_requests:
            problems.append(f"{tag}: only {r.get('ok')} requests answered")
        if r.get("answer_mismatch") or r.get("prompt_tokens_mismatch"):
            problems.append(f"{tag}: {r.get('answer_mismatch')} answers and "
                            f"{r.get('prompt_tokens_mismatch')} prompt token counts differ from trace-blocks")
        trace = out / "traces" / f"{r['family']}-seed{r['seed']}.jsonl"
        trace_lines = trace.read_text().splitlines() if trace.exists() else []
        header = json.loads(trace_lines[0]) if trace_lines else {}
        if header.get("params", {}).get("image_source") == "url" and r["system"].startswith("mmrouter"):
            # Each image once per Envoy: at least one fetch, never more than the images sent.
            n, images = r.get("filter_image_fetches"), len(header["images"])
            if not isinstance(n, int) or not 1 <= n <= images:
                problems.append(f"{tag}: the filter fetched {n!r} times for {images} URL images")
        # The workers' counters count the measured requests only (a --warmup's are taken off).
        served = sum((r.get("per_worker") or {}).values())
        if served != r.get("ok"):
            problems.append(f"{tag}: the workers served {served} requests, {r.get('ok')} answered")
        if warmup and r["system"] != "bound" and not r.get("warmup_wall_s"):
            problems.append(f"{tag}: no warm-up ran (--warmup {warmup})")
        if warmup:
            # Other users of the same applications: the system prompts, not the sessions.
            warm = out / "traces" / f"{r['family']}-seed{r['seed'] + WARMUP_SEED_OFFSET}.jsonl"
            lines = warm.read_text().splitlines() if warm.exists() else []
            if not lines or not trace_lines:
                problems.append(f"{tag}: no warm-up trace {warm.name}")
            else:
                if json.loads(lines[0])["system_prompts"] != header["system_prompts"]:
                    problems.append(f"{tag}: the warm-up's system prompts are not the trace's")
                if turn_texts(lines) & turn_texts(trace_lines):
                    problems.append(f"{tag}: the warm-up repeats the trace's turns")
        c = r.get("sim_check")
        if c and c["mismatched"] > 0.1 * c["requests"]:
            problems.append(f"{tag}: simulated cached tokens differ on {c['mismatched']}/{c['requests']}")
    return problems


if __name__ == "__main__":
    d = sys.argv[1]
    n = int(sys.argv[sys.argv.index("--min-requests") + 1]) if "--min-requests" in sys.argv else 1
    expected = sys.argv[sys.argv.index("--systems") + 1].split(",") if "--systems" in sys.argv else ()
    p = check(d, n, expected)
    if p:
        print("harness smoke: FAILED\n  " + "\n  ".join(p))
        sys.exit(1)
    print("harness smoke: ok")
