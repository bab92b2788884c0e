#!/usr/bin/env python3
"""Summaries, tables and plots of the routing-quality harness.

    python3 benches/compare/report.py target/bench-compare      # rewrites report.md/.json/PNGs

Reads DIR/results.json (one entry per run, written by run.py as it goes) and writes:
- DIR/report.md: the table (per family x workers x system, mean over seeds; for mmrouter the
  error of its cached-token prediction and of its time-to-first-token forecast, the wait plus
  prefill it compared, against what was measured) and one summary line per family;
- DIR/report.json: the same numbers;
- DIR/hit-vs-cache.png, DIR/p99-vs-cache.png, DIR/hit-vs-workers.png, DIR/p99-vs-workers.png
  (matplotlib; skipped with a note when it is not installed).
A re-run of the same (family, workers, seed, system, repeat) replaces the earlier one.
"""
import json
import statistics
import sys
from collections import OrderedDict
from pathlib import Path

SYSTEM_ORDER = ("mmrouter", "sglang", "sglang-bal", "envoy-rr", "bound", "sim", "sim-online")
# References, not routers: no latency, no errors, no requests per worker of their own.
SIMULATED = ("sim", "sim-online")  # offline (sim.py): a policy, no requests per worker
REFERENCES = ("bound",) + SIMULATED
ROUTER_SYSTEMS = ("mmrouter", "sglang", "sglang-bal", "envoy-rr")
CACHE_FAMILIES = ("tight-256", "tight-1024", "sessions")  # one trace, three cache sizes


# ----------------------------------------------------------------------------- one run

def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def r3(x):
    return None if x is None else round(x, 4)


def parse_overlap(value):
    """x-mmrouter-overlap "matched/total" -> matched blocks (None when absent/unreadable)."""
    if not value:
        return None
    try:
        return int(str(value).split("/", 1)[0])
    except ValueError:
        return None


def parse_forecast(value):
    """x-mmrouter-decision "wait_ms=W; prefill_ms=P; ..." -> the router's forecast of the time
    to first token, W + P, in seconds of its (wall) clock; None when absent or unreadable."""
    if not value:
        return None
    parts = dict(p.strip().split("=", 1) for p in str(value).split(";") if "=" in p)
    try:
        return (float(parts["wait_ms"]) + float(parts["prefill_ms"])) / 1000.0
    except (KeyError, ValueError):
        return None


def ttft_forecast(ok, time_scale):
    """The wait and prefill the router compared (x-mmrouter-decision) against each answered
    request's measured time to first token: {"requests", "mae_ms", "bias_ms"} in emulated ms
    (like the latencies), or None when no record carries a forecast."""
    scale = time_scale if time_scale and time_scale > 0 else 1.0
    errs = []
    for r in ok:
        f = parse_forecast(r.get("decision"))
        if f is not None and r.get("ttft") is not None:
            errs.append((f - r["ttft"]) / scale)
    if not errs:
        return None
    return {"requests": len(errs),
            "mae_ms": round(1000 * statistics.fmean(abs(e) for e in errs), 1),
            "bias_ms": round(1000 * statistics.fmean(errs), 1)}


def summarize(records, metrics, wall, expected, time_scale, block_size=16):
    """The numbers of one run. Latencies are in emulated seconds (measured / time_scale)."""
    ok = [r for r in records if not r.get("error")]
    scale = time_scale if time_scale and time_scale > 0 else 1.0
    ttft = [r["ttft"] / scale for r in ok if r.get("ttft") is not None]
    e2e = [r["e2e"] / scale for r in ok if r.get("e2e") is not None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    m_tot = lambda k: sum(m.get(k, 0.0) for m in metrics.values())  # noqa: E731
    per_worker = {w: int(m.get("vllm:request_success_total", 0)) for w, m in sorted(metrics.items())}
    counts = list(per_worker.values())
    mean = sum(counts) / max(1, len(counts))
    last, switched = {}, 0
    fu = [r for r in ok if r["turn"] > 0]
    for r in sorted(ok, key=lambda r: (r["session"], r["turn"])):
        if r["turn"] > 0 and last.get(r["session"]) not in (None, r["worker"]):
            switched += 1
        last[r["session"]] = r["worker"]
    hit = lambda rs: r3(sum(r["cached_tokens"] for r in rs) / max(1, sum(r["prompt_tokens"] for r in rs)))  # noqa: E731
    s = {
        "requests": expected, "ok": len(ok),
        "errors": len(records) - len(ok) + (expected - len(records)),
        "error_samples": sorted({r["error"] for r in records if r.get("error")})[:3],
        "wall_s": round(wall, 1), "time_scale": time_scale,
        "ttft_p50": r3(pct(ttft, 50)), "ttft_p99": r3(pct(ttft, 99)),
        "e2e_p50": r3(pct(e2e, 50)), "e2e_p99": r3(pct(e2e, 99)),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": r3(cached / prompt) if prompt else None,
        "followup_hit_rate": hit(fu), "first_turn_hit_rate": hit([r for r in ok if r["turn"] == 0]),
        "followups": len(fu), "followups_switched_worker": switched,
        "per_worker": per_worker,
        "imbalance_max_over_mean": round(max(counts) / mean, 3) if counts and mean else None,
        "kv_blocks_evicted": int(m_tot("mock:kv_blocks_removed_total")),
        "encoder_runs": int(m_tot("mock:encoder_runs_total")),
        "images_in_prompts": int(m_tot("vllm:mm_cache_queries_total")),
        # Harness self-checks: the bytes sent were built ahead with the mock's own rules.
        "answer_mismatch": sum(1 for r in ok if r.get("answer_ok") is False),
        "prompt_tokens_mismatch": sum(1 for r in ok if r.get("expected_prompt_tokens") not in
                                      (None, r["prompt_tokens"])),
    }
    # mmrouter's prediction: overlap blocks x block size against the reported cached tokens.
    pairs = [(parse_overlap(r.get("overlap")) * block_size, r["cached_tokens"]) for r in ok
             if parse_overlap(r.get("overlap")) is not None]
    if pairs:
        errs = [p - c for p, c in pairs]
        s["prediction"] = {
            "requests": len(pairs),
            "mae_tokens": round(statistics.fmean(abs(e) for e in errs), 1),
            "bias_tokens": round(statistics.fmean(errs), 1),
            "mae_over_prompt": round(sum(abs(e) for e in errs) / max(1, prompt), 4),
            "exact": sum(1 for e in errs if e == 0),
        }
    forecast = ttft_forecast(ok, time_scale)
    if forecast:
        s["ttft_forecast"] = forecast
    return s


# ----------------------------------------------------------------------------- aggregate

def latest_runs(results):
    latest = OrderedDict()
    for r in results:
        key = (r["family"], r["workers"], r["seed"], r["system"], r.get("repeat", 0))
        latest.pop(key, None)
        latest[key] = r
    return list(latest.values())


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def aggregate(runs):
    """{(family, workers, system): row} with means over seeds (and repeats)."""
    groups = OrderedDict()
    for r in runs:
        groups.setdefault((r["family"], r["workers"], r["system"]), []).append(r)
    rows = OrderedDict()
    for key, rs in groups.items():
        hits = [r["hit_rate"] for r in rs if r.get("hit_rate") is not None]
        row = {
            "family": key[0], "workers": key[1], "system": key[2], "runs": len(rs),
            "seeds": sorted({r["seed"] for r in rs}),
            "hit_rate": r3(_mean(hits)),
            "hit_rate_min": r3(min(hits)) if hits else None,
            "hit_rate_max": r3(max(hits)) if hits else None,
            "gpu_blocks": rs[0].get("gpu_blocks"),
            "errors": sum(r.get("errors", 0) for r in rs),
            "requests": sum(r.get("requests", 0) for r in rs),
        }
        for k in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "followup_hit_rate",
                  "imbalance_max_over_mean"):
            row[k] = r3(_mean([r.get(k) for r in rs]))
        sw = [(r.get("followups_switched_worker"), r.get("followups")) for r in rs]
        if all(a is not None for a, _ in sw):
            row["followups_switched"] = [sum(a for a, _ in sw), sum(b for _, b in sw)]
        pw = [sorted(r["per_worker"].values(), reverse=True) for r in rs if r.get("per_worker")]
        if pw and all(len(p) == len(pw[0]) for p in pw):
            row["per_worker_sorted"] = [round(statistics.fmean(c)) for c in zip(*pw)]
        preds = [r["prediction"] for r in rs if r.get("prediction")]
        if preds:
            row["prediction_mae_tokens"] = round(_mean([p["mae_tokens"] for p in preds]), 1)
            row["prediction_bias_tokens"] = round(_mean([p["bias_tokens"] for p in preds]), 1)
            row["prediction_mae_over_prompt"] = r3(_mean([p["mae_over_prompt"] for p in preds]))
        forecasts = [r["ttft_forecast"] for r in rs if r.get("ttft_forecast")]
        if forecasts:
            row["ttft_forecast_mae_ms"] = round(_mean([f["mae_ms"] for f in forecasts]), 1)
            row["ttft_forecast_bias_ms"] = round(_mean([f["bias_ms"] for f in forecasts]), 1)
        if key[2] in SIMULATED:
            row["policies_won"] = sorted({r.get("policy") for r in rs})
        rows[key] = row
    return rows


def ordered(rows):
    fam_order = []
    for f, _, _ in rows:
        if f not in fam_order:
            fam_order.append(f)
    rank = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    return sorted(rows.values(), key=lambda r: (fam_order.index(r["family"]), r["workers"],
                                                rank.get(r["system"], 0.5 if r["system"].startswith("mmrouter-") else 50),
                                                r["system"]))


# ----------------------------------------------------------------------------- markdown

def f2(x, d=2, scale=1.0):
    return "-" if x is None else f"{x * scale:.{d}f}"


def table(rows):
    out = ["| family | workers | system | hit rate [min, max] | TTFT p50 / p99 s | e2e p50 / p99 s "
           "| requests per worker | follow-ups moved | errors | prediction MAE / bias (tokens) "
           "| TTFT forecast MAE / bias (ms) |",
           "|---|---:|---|---|---|---|---|---:|---:|---|---|"]
    for r in ordered(rows):
        hr = "-" if r["hit_rate"] is None else (
            f"{r['hit_rate']:.3f}" + (f" [{r['hit_rate_min']:.3f}, {r['hit_rate_max']:.3f}]"
                                      if r["runs"] > 1 else ""))
        lat = r["system"] not in REFERENCES
        ttft = f"{f2(r['ttft_p50'])} / {f2(r['ttft_p99'])}" if lat else "-"
        e2e = f"{f2(r['e2e_p50'])} / {f2(r['e2e_p99'])}" if lat else "-"
        pw = "/".join(str(c) for c in r.get("per_worker_sorted", [])) or "-"
        if r["system"] in SIMULATED:
            pw = ", ".join(r.get("policies_won", []))
        moved = (f"{r['followups_switched'][0]}/{r['followups_switched'][1]}"
                 if r.get("followups_switched") and lat else "-")
        pred = (f"{r['prediction_mae_tokens']:.0f} / {r['prediction_bias_tokens']:+.0f}"
                if "prediction_mae_tokens" in r else "-")
        forecast = (f"{r['ttft_forecast_mae_ms']:.0f} / {r['ttft_forecast_bias_ms']:+.0f}"
                    if "ttft_forecast_mae_ms" in r else "-")
        errors = str(r["errors"]) if r["system"] not in REFERENCES else "-"
        out.append(f"| {r['family']} | {r['workers']} | {r['system']} | {hr} | {ttft} | {e2e} | "
                   f"{pw} | {moved} | {errors} | {pred} | {forecast} |")
    return "\n".join(out)


def family_lines(rows):
    """One line per family: the best router by hit rate at each worker count and its margin
    over the next; mmrouter against SGLang (hit rate, ratio, LOSS when below; p99 TTFT); and
    mmrouter against the two references."""
    fams = OrderedDict()
    for r in ordered(rows):
        fams.setdefault(r["family"], OrderedDict()).setdefault(r["workers"], {})[r["system"]] = r
    lines = []
    for fam, by_w in fams.items():
        ws = list(by_w)
        parts = []
        win = []
        for w in ws:
            routers = sorted((r for s, r in by_w[w].items() if s not in REFERENCES
                              and r["hit_rate"] is not None), key=lambda r: -r["hit_rate"])
            if routers:
                m = routers[0]["hit_rate"] - routers[1]["hit_rate"] if len(routers) > 1 else 0.0
                win.append(f"{w}w {routers[0]['system']} (+{m:.3f})")
        if win:
            parts.append("best router by hit rate: " + ", ".join(win))

        def pair(a, b, key, fmt, ratio=False, loss=False):
            out = []
            for w in ws:
                x, y = by_w[w].get(a), by_w[w].get(b)
                if not x or not y or x.get(key) is None or y.get(key) is None:
                    continue
                t = f"{w}w {x[key]:{fmt}} vs {y[key]:{fmt}}"
                if ratio and y[key]:
                    t += f" ({x[key] / y[key]:.2f}x)"
                if loss and x[key] < y[key]:
                    t += " LOSS"
                out.append(t)
            return ", ".join(out)

        for b in ("sglang",) + REFERENCES:
            t = pair("mmrouter", b, "hit_rate", ".3f", ratio=True, loss=(b == "sglang"))
            if t:
                parts.append(f"mmrouter vs {b} hit: {t}")
        t = pair("mmrouter", "sglang", "ttft_p99", ".2f")
        if t:
            parts.append(f"p99 TTFT (s) mmrouter vs sglang: {t}")
        lines.append(f"- **{fam}**: " + "; ".join(parts) + ".")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots

def plots(rows, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(plots skipped: matplotlib is not installed)"]
    written = []
    systems = [s for s in SYSTEM_ORDER if any(k[2] == s for k in rows)]
    systems += sorted({k[2] for k in rows} - set(systems))
    style = {"bound": dict(linestyle="--", color="black"), "sim": dict(linestyle=":", color="gray"),
             "sim-online": dict(linestyle="-.", color="silver")}

    def draw(path, panels, xlabel, ylabel, key, logx=False, with_refs=True):
        if not panels:
            return
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
        for ax, (title, xs_by_sys) in zip(axes[0], panels):
            for s in systems:
                if s in REFERENCES and not with_refs:
                    continue
                pts = sorted(xs_by_sys.get(s, []))
                pts = [(x, r) for x, r in pts if r.get(key) is not None]
                if not pts:
                    continue
                xs = [x for x, _ in pts]
                ys = [r[key] for _, r in pts]
                kw = dict(marker="o", label=s, **style.get(s, {}))
                if key == "hit_rate" and all(r.get("hit_rate_min") is not None for _, r in pts):
                    lo = [r[key] - r["hit_rate_min"] for _, r in pts]
                    hi = [r["hit_rate_max"] - r[key] for _, r in pts]
                    ax.errorbar(xs, ys, yerr=[lo, hi], capsize=3, **kw)
                else:
                    ax.plot(xs, ys, **kw)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if logx:
                ax.set_xscale("log", base=2)
            xs_all = sorted({x for v in xs_by_sys.values() for x, _ in v})
            ax.set_xticks(xs_all)
            ax.set_xticklabels([str(x) for x in xs_all])
            if key == "hit_rate":
                ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)

    # Against cache size: the sessions trace at 256 / 1024 / 4096 blocks, one panel per
    # worker count.
    by_w = OrderedDict()
    for (fam, w, s), r in rows.items():
        if fam in CACHE_FAMILIES and r.get("gpu_blocks"):
            by_w.setdefault(w, {}).setdefault(s, []).append((r["gpu_blocks"], r))
    cache_panels = [(f"sessions trace, {w} workers", v) for w, v in sorted(by_w.items())]
    draw(out_dir / "hit-vs-cache.png", cache_panels, "KV blocks per worker", "hit rate",
         "hit_rate", logx=True)
    draw(out_dir / "p99-vs-cache.png", cache_panels, "KV blocks per worker",
         "TTFT p99 (emulated s)", "ttft_p99", logx=True, with_refs=False)
    # Against worker count, one panel per family.
    by_f = OrderedDict()
    for (fam, w, s), r in rows.items():
        by_f.setdefault(fam, {}).setdefault(s, []).append((w, r))
    fam_panels = [(fam, v) for fam, v in by_f.items()]
    draw(out_dir / "hit-vs-workers.png", fam_panels, "workers", "hit rate", "hit_rate")
    draw(out_dir / "p99-vs-workers.png", fam_panels, "workers", "TTFT p99 (emulated s)",
         "ttft_p99", with_refs=False)
    return written


# ----------------------------------------------------------------------------- main

def records_path(out_dir, family, workers, seed, system, repeat=0):
    """Where run.py keeps one run's per-request records."""
    return Path(out_dir) / "records" / f"{family}-w{workers}-seed{seed}-{system}-r{repeat}.json"


def backfill_forecasts(runs, out_dir):
    """mmrouter runs recorded before results carried `ttft_forecast` get it from their records
    (only mmrouter answers with x-mmrouter-decision: other systems' records are not read)."""
    for r in runs:
        if "ttft_forecast" in r or not r["system"].startswith("mmrouter"):
            continue
        path = records_path(out_dir, r["family"], r["workers"], r["seed"], r["system"],
                            r.get("repeat", 0))
        if not path.exists():
            continue
        ok = [x for x in json.loads(path.read_text()).get("records", []) if not x.get("error")]
        forecast = ttft_forecast(ok, r.get("time_scale"))
        if forecast:
            r["ttft_forecast"] = forecast


def write_report(out_dir, meta=None, make_plots=True):
    out_dir = Path(out_dir)
    results = json.loads((out_dir / "results.json").read_text())
    runs = latest_runs(results)
    backfill_forecasts(runs, out_dir)
    rows = aggregate(runs)
    meta = meta or {}
    meta_path = out_dir / "meta.json"
    if not meta and meta_path.exists():
        meta = json.loads(meta_path.read_text())
    pngs = plots(rows, out_dir) if make_plots else []
    checks = [r for r in runs if r["system"] == "bound" and r.get("sim_check")]
    md = ["# Routing quality: harness report", ""]
    if meta:
        md += [f"- command: `{meta.get('command', '?')}`",
               f"- date: {meta.get('date', '?')}; build: {meta.get('build', '?')}",
               f"- time scale {meta.get('time_scale')}: latencies are emulated seconds "
               f"(measured / time scale); machine load {meta.get('load', '?')}", ""]
        fams = meta.get("families") or {}
        if fams:
            md += ["Families:", ""] + [f"- `{k}`: {v}" for k, v in fams.items()] + [""]
    md += [table(rows), "", "Per family (w = workers; margins and ratios in hit rate):", "",
           family_lines(rows), ""]
    if checks:
        bad = sum(c["sim_check"]["mismatched"] for c in checks)
        n = sum(c["sim_check"]["requests"] for c in checks)
        md += [f"Simulator check against the mock (bound runs, one worker, unbounded cache): "
               f"{n - bad}/{n} requests with the same cached tokens.", ""]
    mism = sum(r.get("answer_mismatch", 0) + r.get("prompt_tokens_mismatch", 0) for r in runs)
    md += [f"Prebuilt bodies against the mock: {mism} answer or prompt-token mismatches.", ""]
    if pngs:
        md += ["Plots: " + ", ".join(pngs), ""]
    (out_dir / "report.md").write_text("\n".join(md))
    (out_dir / "report.json").write_text(json.dumps(
        {"meta": meta, "rows": ordered(rows)}, indent=1))
    return "\n".join(md)


if __name__ == "__main__":
    d = sys.argv[1] if len(sys.argv) > 1 else "target/bench-compare"
    print(write_report(d))
