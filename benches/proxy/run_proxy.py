#!/usr/bin/env python3
"""What the filter costs a request: plain Envoy against Envoy with the filter, side by side.

    .venv/bin/python benches/proxy/run_proxy.py --wasm mmrouter.wasm [--seconds 8] [--repeat 2]
        [--connections 1,16] [--bodies text,image] [--concurrency 2] [--quick] [--out DIR]

Two Envoys from the same binary and the same envoy/render.py configuration, one rendered with
--no-filter (plain), one with the filter, stand in front of the same upstream: one nginx with
the echo module that reads the whole body and answers a fixed chat.completion (upstream.py).
The client is wrk with a Lua script that POSTs one body over keep-alive connections.

Cells: body (text: a ~2 KiB text chat; image: a ~1.53 MiB body with one inline JPEG) x
connections. In each cell the runs alternate plain, filter, plain, filter, ... (--repeat each);
every run is preceded by an unmeasured warm-up. Per run: req/s, latency percentiles, and the
Envoy process's CPU (utime+stime from /proc/<pid>/stat over the run) per request.

Writes DIR/results.json (every run, the machine, the bodies' hashes), DIR/summary.md (the
table) and prints the table. scripts/bench-proxy installs what this needs and builds the filter.
"""
import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bodies  # noqa: E402
import envoy  # noqa: E402
import load  # noqa: E402
import machine  # noqa: E402
import processes  # noqa: E402
import cpu_profile  # noqa: E402
import upstream  # noqa: E402

BODY_LABELS = {"text": "~2 KiB text chat", "image": "~1.5 MiB, one inline JPEG"}


def make_bodies(out_dir, names, text_file=None, image_file=None):
    out = {}
    for name in names:
        given = {"text": text_file, "image": image_file}.get(name)
        if given:
            data = Path(given).read_bytes()
        elif name == "text":
            data = bodies.text_chat()
        elif name == "image":
            data = bodies.image_chat()
        else:
            raise SystemExit(f"unknown body {name!r} (text, image)")
        path = out_dir / f"body-{name}.json"
        path.write_bytes(data)
        out[name] = {"path": path, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16],
                     "source": str(given) if given else "generated"}
    return out


def post(url, data):
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read()


def routed_and_fallbacks(counters):
    routed = sum(v for k, v in counters.items() if ".routed." in k)
    fallbacks = {k: v for k, v in counters.items() if ".fallback." in k and v}
    return routed, fallbacks


def check_paths(plain, filtered, body_files):
    """One request per body through each Envoy: both answer the upstream's reply, and the filter
    routed it (not a fallback), so the runs measure the filter's real path."""
    for name, b in body_files.items():
        data = b["path"].read_bytes()
        routed0, _ = routed_and_fallbacks(filtered.counters())
        for e in (plain, filtered):
            status, reply = post(e.url, data)
            if status != 200 or json.loads(reply) != json.loads(upstream.CHAT_COMPLETION):
                raise RuntimeError(f"{e.name}: body {name}: status {status}, reply {reply[:200]!r}")
        routed1, fallbacks = routed_and_fallbacks(filtered.counters())
        if routed1 - routed0 < 1 or fallbacks:
            raise RuntimeError(f"the filter did not route body {name}: routed +{routed1 - routed0}, "
                               f"fallbacks {fallbacks}; see {filtered.log_path}")


def one_run(e, nginx, script, body, connections, seconds, warmup, threads):
    if warmup > 0:
        load.wrk(script, e.url, body["path"], connections, warmup, threads)
    before_counters = e.counters() if e.with_filter else {}
    wrk0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0 = processes.machine_busy_ticks()
    cpu0, up0, t0 = e.cpu_ticks(), nginx.cpu_ticks(), time.monotonic()
    r = load.wrk(script, e.url, body["path"], connections, seconds, threads)
    cpu1, up1, t1 = e.cpu_ticks(), nginx.cpu_ticks(), time.monotonic()
    busy1 = processes.machine_busy_ticks()
    wrk1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = {
        "envoy": e.name, "requests": r["requests"], "seconds": r["seconds"], "rps": r["rps"],
        "latency_ms": r["latency_ms"], "errors": r["errors"], "errors_total": r["errors_total"],
        "envoy_cpu_s": (cpu1 - cpu0) / processes.CLOCK_TICK,
        "upstream_cpu_s": (up1 - up0) / processes.CLOCK_TICK,
        "client_cpu_s": (wrk1.ru_utime + wrk1.ru_stime) - (wrk0.ru_utime + wrk0.ru_stime),
        "wall_s": t1 - t0, "loadavg": machine.loadavg(),
    }
    # What the rest of the machine took meanwhile (other builds and tests): cores busy on
    # average, besides Envoy, nginx and wrk. Near nproc means the run was starved.
    ours = run["envoy_cpu_s"] + run["upstream_cpu_s"] + run["client_cpu_s"]
    run["others_cores"] = max(0.0, (busy1 - busy0) / processes.CLOCK_TICK - ours) / run["wall_s"]
    n = max(1, r["requests"])
    run["envoy_cpu_us_per_request"] = run["envoy_cpu_s"] * 1e6 / n
    run["upstream_cpu_us_per_request"] = run["upstream_cpu_s"] * 1e6 / n
    if e.with_filter:
        after = e.counters()
        delta = {k: after.get(k, 0) - before_counters.get(k, 0) for k in after}
        run["filter_counters"] = {k: v for k, v in delta.items() if v}
    return run


def mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def summarize(cell_runs):
    s = {}
    for variant in ("plain", "floor", "filter"):
        runs = [r for r in cell_runs if r["envoy"] == variant]
        if not runs:
            continue
        s[variant] = {
            "rps": mean([r["rps"] for r in runs]),
            "rps_min": min(r["rps"] for r in runs), "rps_max": max(r["rps"] for r in runs),
            "p50_ms": mean([r["latency_ms"]["p50"] for r in runs]),
            "p99_ms": mean([r["latency_ms"]["p99"] for r in runs]),
            "cpu_us": mean([r["envoy_cpu_us_per_request"] for r in runs]),
            "upstream_cpu_us": mean([r["upstream_cpu_us_per_request"] for r in runs]),
            "errors": sum(r["errors_total"] for r in runs),
            "others_cores": mean([r["others_cores"] for r in runs]),
            "runs": len(runs),
        }
    p, f = s["plain"], s["filter"]
    s["ratio"] = f["rps"] / p["rps"] if p["rps"] else float("nan")
    s["added_p50_ms"] = f["p50_ms"] - p["p50_ms"]
    s["added_cpu_us"] = f["cpu_us"] - p["cpu_us"]
    if "floor" in s:
        fl = s["floor"]
        s["floor_ratio"] = fl["rps"] / p["rps"] if p["rps"] else float("nan")
        s["floor_added_p50_ms"] = fl["p50_ms"] - p["p50_ms"]
        s["floor_added_cpu_us"] = fl["cpu_us"] - p["cpu_us"]
    # Spread: the widest relative range of req/s over one variant's repetitions.
    s["spread"] = max((v["rps_max"] - v["rps_min"]) / v["rps"] if v["rps"] else 0.0
                      for k, v in s.items() if k in ("plain", "floor", "filter"))
    return s


def floor_table(cells, body_files):
    """The filter against the floor filter (benches/proxy/floor) and plain Envoy, same runs."""
    head = ("| body | conns | plain req/s | floor req/s | filter req/s | floor / plain | filter / plain "
            "| added p50, floor / filter | added Envoy CPU per request, floor / filter |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for c in cells:
        s = c["summary"]
        if "floor" not in s:
            continue
        b = body_files[c["body"]]
        label = f"{BODY_LABELS.get(c['body'], c['body'])} ({b['bytes'] / 1024:,.0f} KiB)"
        lines.append(
            f"| {label} | {c['connections']} | {s['plain']['rps']:,.0f} | {s['floor']['rps']:,.0f} "
            f"| {s['filter']['rps']:,.0f} | {s['floor_ratio']:.2f} | {s['ratio']:.2f} "
            f"| {s['floor_added_p50_ms']:+.2f} / {s['added_p50_ms']:+.2f} ms "
            f"| {s['floor_added_cpu_us']:.0f} / {s['added_cpu_us']:.0f} µs |")
    return "\n".join(lines)


def table(cells, body_files):
    head = ("| body | conns | plain req/s | filter req/s | ratio | p50 plain / filter | added p50 "
            "| p99 plain / filter | Envoy CPU per request, plain / filter | added CPU per request "
            "| req/s spread | other load (cores) |")
    lines = [head, "|---|---:|---:|---:|---:|---|---:|---|---|---:|---:|---:|"]

    def ms(x):
        return f"{x:.2f}" if x < 10 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"

    def us(x):
        return f"{x:.0f} µs" if x < 1000 else f"{x / 1000:.2f} ms"

    for c in cells:
        s = c["summary"]
        p, f = s["plain"], s["filter"]
        b = body_files[c["body"]]
        label = f"{BODY_LABELS.get(c['body'], c['body'])} ({b['bytes'] / 1024:,.0f} KiB)"
        err = "" if p["errors"] + f["errors"] == 0 else f" (errors: {p['errors']} / {f['errors']})"
        lines.append(
            f"| {label} | {c['connections']} | {p['rps']:,.0f} | {f['rps']:,.0f}{err} | {s['ratio']:.2f} "
            f"| {ms(p['p50_ms'])} / {ms(f['p50_ms'])} ms | {s['added_p50_ms']:+.2f} ms "
            f"| {ms(p['p99_ms'])} / {ms(f['p99_ms'])} ms | {us(p['cpu_us'])} / {us(f['cpu_us'])} "
            f"| {us(s['added_cpu_us'])} | ±{s['spread'] * 50:.0f}% "
            f"| {(p['others_cores'] + f['others_cores']) / 2:.1f} |")
    return "\n".join(lines)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wasm", default=os.environ.get("MMROUTER_WASM"), help="the filter (mmrouter.wasm)")
    p.add_argument("--envoy", default=os.environ.get("MMROUTER_ENVOY", str(envoy.ROOT / ".venv/bin/envoy")))
    p.add_argument("--seconds", type=int, help="measured seconds per run (default 8; --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured seconds before each run (default 1)")
    p.add_argument("--repeat", type=int, help="runs per variant and cell, interleaved (default 2; --quick 1)")
    p.add_argument("--connections", default="1,16", help="comma-separated (default 1,16)")
    p.add_argument("--bodies", default="text,image", help="comma-separated: text, image")
    p.add_argument("--text-body", help="a JSON body file to use instead of the generated text chat")
    p.add_argument("--image-body", help="a JSON body file to use instead of the generated image chat")
    p.add_argument("--concurrency", type=int, default=2, help="Envoy --concurrency (default 2)")
    p.add_argument("--workers", type=int, default=4, help="synthetic workers (loopback addresses of the one nginx)")
    p.add_argument("--router-config", help="JSON file merged into the filter's configuration")
    p.add_argument("--floor", metavar="WASM",
                   help="also run a third Envoy with this filter, interleaved with the other two: "
                        "the floor filter of benches/proxy/floor (scripts/bench-proxy --floor builds it)")
    p.add_argument("--upstream", choices=["override-host", "original-dst"], default="override-host")
    p.add_argument("--wrk-threads", type=int, default=1)
    p.add_argument("--nginx-workers", type=int, default=1)
    p.add_argument("--profile", action="store_true",
                   help="after the runs, one more run per cell and Envoy under perf: Envoy's CPU per "
                        "request split into the filter's Wasm code, Envoy's C++, libc and the kernel")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 s runs, 1 repetition (explicit --seconds/--repeat win)")
    p.add_argument("--out", help="output directory (default target/bench-proxy/<UTC time>)")
    a = p.parse_args(argv)
    if a.seconds is None:
        a.seconds = 2 if a.quick else 8
    if a.repeat is None:
        a.repeat = 1 if a.quick else 2
    if not a.wasm:
        p.error("--wasm (or MMROUTER_WASM) is required")
    if a.seconds < 1 or a.warmup < 0 or a.repeat < 1:
        p.error("--seconds >= 1, --warmup >= 0 and --repeat >= 1 (wrk takes whole seconds)")
    if a.workers < 1 or a.workers > 250 * 250:
        p.error("--workers must be 1..62500")
    target = Path(os.environ.get("CARGO_TARGET_DIR", envoy.ROOT / "target"))
    out = (Path(a.out) if a.out else target / "bench-proxy" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    conns = [int(c) for c in a.connections.split(",") if c.strip()]
    names = [b.strip() for b in a.bodies.split(",") if b.strip()]

    processes.exit_on_signals()
    procs = processes.Processes()
    try:
        info = machine.describe(a.envoy, a.wasm)
        body_files = make_bodies(out, names, a.text_body, a.image_body)
        script = load.write_script(out / "post.lua")
        nginx = upstream.Nginx(procs, out, processes.free_port("0.0.0.0"), a.nginx_workers)
        workers = upstream.worker_addresses(a.workers, nginx.port)
        router_config = envoy.load_router_config(a.router_config)
        plain = envoy.Envoy(procs, out, "plain", a.envoy, workers, None, a.concurrency,
                            router_config, a.upstream)
        filtered = envoy.Envoy(procs, out, "filter", a.envoy, workers, a.wasm, a.concurrency,
                               router_config, a.upstream)
        floor = None
        if a.floor:
            floor = envoy.Envoy(procs, out, "floor", a.envoy, workers, a.floor, a.concurrency,
                                router_config, a.upstream)
            check_paths(plain, floor, body_files)
        check_paths(plain, filtered, body_files)
        variants = [e for e in (plain, floor, filtered) if e is not None]
        for line in machine.header_lines(info):
            print(f"bench-proxy: {line}")
        for name, b in body_files.items():
            print(f"bench-proxy: body {name}: {b['bytes']:,} bytes ({b['source']}, sha256 {b['sha256']}...)")
        print(f"bench-proxy: Envoy --concurrency {a.concurrency}, {a.workers} workers (nginx :{nginx.port}), "
              f"{a.seconds:g} s runs after {a.warmup:g} s warm-up, {a.repeat} repetition(s), out {out}")

        cells = []
        for name in names:
            for c in conns:
                runs = []
                for rep in range(a.repeat):
                    for e in variants:
                        run = one_run(e, nginx, script, body_files[name], c, a.seconds, a.warmup,
                                      a.wrk_threads)
                        run["repetition"] = rep
                        runs.append(run)
                        print(f"  {name:5} c={c:<3} rep {rep} {e.name:6}: {run['rps']:9,.1f} req/s  "
                              f"p50 {run['latency_ms']['p50']:7.2f} ms  p99 {run['latency_ms']['p99']:7.2f} ms  "
                              f"Envoy CPU {run['envoy_cpu_us_per_request']:8.1f} µs/req  other load {run['others_cores']:.1f} cores"
                              + (f"  errors {run['errors']}" if run["errors_total"] else ""), flush=True)
                cells.append({"body": name, "connections": c, "runs": runs, "summary": summarize(runs)})
        profile_rows = []
        if a.profile:
            if not cpu_profile.available():
                print("bench-proxy: --profile: perf is missing or not allowed here; skipped")
            for c in cells if cpu_profile.available() else []:
                row = {"body": c["body"], "connections": c["connections"]}
                for e in (plain, filtered):
                    row[e.name], _ = cpu_profile.profiled_run(
                        e, script, body_files[c["body"]]["path"], c["connections"], a.seconds,
                        out / f"perf-{c['body']}-c{c['connections']}-{e.name}.data", a.wrk_threads)
                profile_rows.append(row)
                print(f"  profiled {c['body']} c={c['connections']}", flush=True)
        info["loadavg_end"] = machine.loadavg()
        md = table(cells, body_files)
        if floor is not None:
            md += "\n\n" + floor_table(cells, body_files)
        if profile_rows:
            md += "\n\n" + cpu_profile.table(profile_rows)
        settings = {k: getattr(a, k) for k in ("seconds", "warmup", "repeat", "concurrency", "workers",
                                                "upstream", "wrk_threads", "nginx_workers", "router_config", "profile",
                                                "floor")}
        result = {"machine": info, "settings": settings, "cells": cells, "profile": profile_rows,
                  "bodies": {k: {kk: str(vv) for kk, vv in v.items()} for k, v in body_files.items()}}
        (out / "results.json").write_text(json.dumps(result, indent=1))
        header = "\n".join(f"- {line}" for line in machine.header_lines(info))
        (out / "summary.md").write_text(
            f"# bench-proxy\n\n{header}\n- load average at end {' '.join(map(str, info['loadavg_end']))}\n"
            f"- settings: {json.dumps(settings)}\n\n{md}\n")
        print()
        print(md)
        print(f"\nbench-proxy: load average at end {' '.join(map(str, info['loadavg_end']))}; "
              f"wrote {out / 'results.json'} and {out / 'summary.md'}")
        errors = sum(r["errors_total"] for c in cells for r in c["runs"])
        if errors:
            print(f"bench-proxy: WARNING: {errors} failed requests (see results.json)")
            return 1
        return 0
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
