#!/usr/bin/env python3
"""Envoy's memory with the filter: RSS and each VM's Wasm linear memory, before and after traffic.

    .venv/bin/python benches/proxy/run_memory.py --wasm mmrouter.wasm [--workers 4,64,1024]
        [--concurrency 2,8] [--requests 400] [--clients 8] [--quick] [--out DIR]

For each (workers, concurrency): a fresh Envoy with the filter in front of `workers` synthetic
workers (127.0.x.y:PORT, all served by one nginx with the echo module, upstream.py; its
/metrics answers a fixed vLLM text, so the filter's polls succeed), --concurrency as given.
After start-up and a settle time it reads Envoy's RSS (/proc/<pid>/status) and the filter's
gauges mmrouter.vm_memory_bytes.<vm> (one per VM: the main thread's and one per worker
thread); then it sends the same requests (bodies.memory_traffic: a system prompt, one image
from a pool of 12 with popular ones repeated, a question of its own), each on a new connection
so that every worker thread takes its share, waits for the VMs' ticks, and reads them again.
With --plain-baseline (default on) a plain Envoy (render.py --no-filter) takes the same traffic
for comparison of RSS.

Prints start / after / growth per configuration and the ratio of growth at the highest
concurrency to growth at the lowest, per worker count. Writes DIR/results.json and
DIR/summary.md. scripts/bench-memory installs what this needs and builds the filter.
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bodies  # noqa: E402
import envoy  # noqa: E402
import machine  # noqa: E402
import processes  # noqa: E402
import upstream  # noqa: E402

MIB = 1 << 20


def send(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json", "Connection": "close"})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def drive(port, traffic, clients):
    """Sends every body once (clients at a time); returns {status: count} and the seconds."""
    t0 = time.monotonic()
    statuses = {}
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for status in pool.map(lambda b: send(port, b), traffic):
            statuses[status] = statuses.get(status, 0) + 1
    return statuses, time.monotonic() - t0


def snapshot(e):
    vms = e.vm_memory() if e.with_filter else {}
    return {"rss": e.rss_bytes(), "vms": vms, "vm_total": sum(vms.values())}


def measure(procs, out, binary, wasm, workers, concurrency, nginx_port, traffic, clients, settle,
            router_config):
    name = f"{'filter' if wasm else 'plain'}-w{workers}-c{concurrency}"
    e = envoy.Envoy(procs, out, name, binary, upstream.worker_addresses(workers, nginx_port), wasm,
                    concurrency, router_config)
    try:
        time.sleep(settle)
        start = snapshot(e)
        counters0 = e.counters() if wasm else {}
        statuses, seconds = drive(e.port, traffic, clients)
        time.sleep(max(1.0, settle / 2))  # the VMs' ticks set the gauges (every 20 ms by default)
        after = snapshot(e)
        counters1 = e.counters() if wasm else {}
    finally:
        procs.stop(e.proc)
    delta = {k: counters1.get(k, 0) - counters0.get(k, 0) for k in counters1}
    routed = sum(v for k, v in delta.items() if ".routed." in k)
    fallbacks = {k: v for k, v in delta.items() if ".fallback." in k and v}
    return {
        "envoy": "filter" if wasm else "plain", "workers": workers, "concurrency": concurrency,
        "start": start, "after": after,
        "rss_growth": after["rss"] - start["rss"],
        "vm_growth": after["vm_total"] - start["vm_total"],
        "requests": len(traffic), "statuses": statuses, "seconds": seconds,
        "routed": routed, "fallbacks": fallbacks,
    }


def mib(x):
    return f"{x / MIB:,.1f}"


def table(results):
    lines = ["| Envoy | workers | concurrency | VMs | RSS start | RSS after | RSS growth "
             "| VM memory start (sum) | after (sum) | growth | per VM after (min-max) | routed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        # One gauge stays 0: a VM that never ticks (see docs/BENCHMARKS.md, Memory).
        vms = [v for v in r["after"]["vms"].values() if v > 0]
        per_vm = f"{mib(min(vms))}-{mib(max(vms))}" if vms else ""
        vm_cols = (f"{mib(r['start']['vm_total'])} | {mib(r['after']['vm_total'])} | {mib(r['vm_growth'])}"
                   if r["envoy"] == "filter" else "- | - | -")
        lines.append(
            f"| {r['envoy']} | {r['workers']:,} | {r['concurrency']} | {len(vms) or '-'} "
            f"| {mib(r['start']['rss'])} | {mib(r['after']['rss'])} | {mib(r['rss_growth'])} "
            f"| {vm_cols} | {per_vm} | {r['routed'] if r['envoy'] == 'filter' else '-'} |")
    return "\n".join(lines) + "\n\nAll sizes in MiB."


def ratios(results, lo, hi):
    """Growth at concurrency hi over growth at lo, per worker count and Envoy variant."""
    out = []
    by = {(r["envoy"], r["workers"], r["concurrency"]): r for r in results}
    for (variant, workers, c), r in sorted(by.items()):
        if c != hi or (variant, workers, lo) not in by:
            continue
        base = by[(variant, workers, lo)]
        row = {"envoy": variant, "workers": workers,
               "rss": r["rss_growth"] / base["rss_growth"] if base["rss_growth"] > 0 else None}
        if variant == "filter":
            row["vm"] = r["vm_growth"] / base["vm_growth"] if base["vm_growth"] > 0 else None
        out.append(row)
    return out


def ratio_lines(rs, lo, hi):
    def f(x):
        return "n/a (no growth at the lower concurrency)" if x is None else f"{x:.2f}x"
    lines = []
    for r in rs:
        s = f"- {r['envoy']}, {r['workers']:,} workers: RSS growth at concurrency {hi} / {lo}: {f(r['rss'])}"
        if "vm" in r:
            s += f"; VM linear memory growth: {f(r['vm'])}"
        lines.append(s)
    return "\n".join(lines)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wasm", default=os.environ.get("MMROUTER_WASM"), help="the filter (mmrouter.wasm)")
    p.add_argument("--envoy", default=os.environ.get("MMROUTER_ENVOY", str(envoy.ROOT / ".venv/bin/envoy")))
    p.add_argument("--workers", default="4,64,1024", help="comma-separated worker counts")
    p.add_argument("--concurrency", default="2,8", help="comma-separated Envoy --concurrency values")
    p.add_argument("--requests", type=int, help="requests of the traffic (default 400; --quick 80)")
    p.add_argument("--clients", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--traffic", choices=["images", "text"], default="images",
                   help="images (default): each request carries one image of the pool; text: the "
                        "same requests without their images")
    p.add_argument("--settle", type=float, help="seconds after start before the first reading (default 3; --quick 1)")
    p.add_argument("--no-plain-baseline", action="store_true", help="skip the plain Envoy runs")
    p.add_argument("--router-config", help="JSON file merged into the filter's configuration")
    p.add_argument("--nginx-workers", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke run: 80 requests, 1 s settle (explicit --requests/--settle win)")
    p.add_argument("--out", help="output directory (default target/bench-memory/<UTC time>)")
    a = p.parse_args(argv)
    if a.requests is None:
        a.requests = 80 if a.quick else 400
    if a.settle is None:
        a.settle = 1.0 if a.quick else 3.0
    if not a.wasm:
        p.error("--wasm (or MMROUTER_WASM) is required")
    worker_counts = [int(x) for x in a.workers.split(",") if x.strip()]
    concurrencies = [int(x) for x in a.concurrency.split(",") if x.strip()]
    if max(worker_counts) > 250 * 250:
        p.error("at most 62,500 workers")
    target = Path(os.environ.get("CARGO_TARGET_DIR", envoy.ROOT / "target"))
    out = (Path(a.out) if a.out else target / "bench-memory" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)

    processes.exit_on_signals()
    procs = processes.Processes()
    try:
        info = machine.describe(a.envoy, a.wasm)
        traffic = bodies.memory_traffic(a.requests, with_images=a.traffic == "images")
        router_config = envoy.load_router_config(a.router_config)
        nginx = upstream.Nginx(procs, out, processes.free_port("0.0.0.0"), a.nginx_workers)
        for line in machine.header_lines(info):
            print(f"bench-memory: {line}")
        print(f"bench-memory: traffic: {len(traffic)} requests ({a.traffic}), {sum(map(len, traffic)) / MIB:,.1f} MiB, "
              f"{a.clients} in flight, one connection each; settle {a.settle:g} s; out {out}")
        results = []
        variants = [a.wasm] + ([] if a.no_plain_baseline else [None])
        for workers in worker_counts:
            for wasm in variants:
                for c in concurrencies:
                    r = measure(procs, out, a.envoy, wasm, workers, c, nginx.port, traffic, a.clients,
                                a.settle, router_config)
                    results.append(r)
                    bad = {s: n for s, n in r["statuses"].items() if s != 200}
                    print(f"  {r['envoy']:6} workers {workers:5} concurrency {c}: RSS {mib(r['start']['rss'])} -> "
                          f"{mib(r['after']['rss'])} MiB"
                          + (f", VMs ({sum(1 for v in r['after']['vms'].values() if v)}) {mib(r['start']['vm_total'])} -> "
                             f"{mib(r['after']['vm_total'])} MiB, routed {r['routed']}" if wasm else "")
                          + (f", fallbacks {r['fallbacks']}" if r["fallbacks"] else "")
                          + (f", NON-200 {bad}" if bad else "")
                          + f" ({r['seconds']:.1f} s)", flush=True)
        info["loadavg_end"] = machine.loadavg()
        lo, hi = min(concurrencies), max(concurrencies)
        rs = ratios(results, lo, hi) if lo != hi else []
        md = table(results)
        rl = ratio_lines(rs, lo, hi)
        settings = {k: getattr(a, k) for k in ("workers", "concurrency", "requests", "traffic", "clients", "settle",
                                                "router_config", "nginx_workers")}
        (out / "results.json").write_text(json.dumps(
            {"machine": info, "settings": settings, "results": results, "growth_ratios": rs}, indent=1))
        header = "\n".join(f"- {line}" for line in machine.header_lines(info))
        (out / "summary.md").write_text(f"# bench-memory\n\n{header}\n- settings: {json.dumps(settings)}\n\n"
                                        f"{md}\n\n{rl}\n")
        print()
        print(md)
        if rl:
            print()
            print(rl)
        print(f"\nbench-memory: load average at end {' '.join(map(str, info['loadavg_end']))}; "
              f"wrote {out / 'results.json'} and {out / 'summary.md'}")
        failed = sum(n for r in results for s, n in r["statuses"].items() if s != 200)
        unrouted = [r for r in results if r["envoy"] == "filter" and r["routed"] < r["requests"]]
        if failed or unrouted:
            print(f"bench-memory: WARNING: {failed} non-200 answers; "
                  f"{len(unrouted)} filter run(s) routed fewer requests than sent")
            return 1
        return 0
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
