#!/usr/bin/env python3
"""Soak: many requests with ~1 MiB inline images through Envoy + the filter + mock workers,
Envoy's RSS and the filter's VM linear memory sampled over time.

    .venv/bin/python benches/proxy/run_soak.py --wasm mmrouter.wasm --mock mock-worker
        [--requests 100000] [--connections 8] [--workers 4] [--images 4] [--out DIR]

The stack: `--workers` mock vLLM workers (--time-scale 0: answers at once, the cost is the
proxying), Envoy (--concurrency 2) with the filter in its default configuration, rendered by
envoy/render.py as scripts/run does. The load: wrk with `--connections` keep-alive connections
(that many requests in flight), cycling through a fixed, seeded rotation of bodies: `--images`
distinct JPEGs of ~1 MiB each (bodies ~1.4 MiB), each with a question of its own, and as many
~2 KiB text chats; half the requests carry an image. wrk is stopped (SIGINT) once Envoy has
answered `--requests` requests; its own count (a few more, the ones in flight) is reported.

Every `--sample-s` seconds: requests answered so far (Envoy's downstream counter), Envoy's RSS
(VmRSS) and each VM's `mmrouter.vm_memory_bytes.<vm>` gauge. At the end: first quarter against
last quarter (by requests answered) of RSS and of the VMs' summed linear memory, and a verdict:
plateau when the last quarter's maximum exceeds the first quarter's maximum by at most
`--tolerance` (default 10%, at least 8 MiB for RSS and 1 MiB for the VMs). Exit status 1 when
a request failed, a request was not routed by the filter, or memory did not plateau.
Writes DIR/samples.csv, DIR/results.json and DIR/summary.md. scripts/soak installs what this
needs and builds the filter and the mock worker.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bodies  # noqa: E402
import envoy  # noqa: E402
import machine  # noqa: E402
import processes  # noqa: E402

MIB = 1 << 20

WRK_LUA = r"""
-- Written by benches/proxy/run_soak.py: POSTs the files listed in $SOAK_BODIES (one path a
-- line) in that order, round robin, each thread from its own offset; prints a JSON summary.
local bodies = {}
for path in io.lines(os.getenv("SOAK_BODIES")) do
  local f = assert(io.open(path, "rb"))
  bodies[#bodies + 1] = f:read("*a")
  f:close()
end
local headers = {["Content-Type"] = "application/json"}
local n = 0
local counter = 0

setup = function(thread)
  counter = counter + 1
  thread:set("offset", counter * 7)
end

request = function()
  n = n + 1
  local i = ((offset or 0) + n) % #bodies + 1
  return wrk.format("POST", "/v1/chat/completions", headers, bodies[i])
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'SOAK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"p50":%d,"p90":%d,"p99":%d,"max":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


def make_bodies(out, images, seed):
    """Writes the rotation's bodies to out/bodies/ and returns their paths, in rotation order,
    with a description of each distinct body."""
    rng = random.Random(seed)
    sizes = [(1600, 1200), (1400, 1050), (1280, 960), (1500, 1000), (1200, 1200), (1920, 1080)]
    distinct = []
    for i in range(images):
        w, h = sizes[i % len(sizes)]
        data = bodies.jpeg_near(w, h, 300 + i, 1 << 20)
        question = f"Soak image {i}: " + bodies.sentence_text(random.Random(400 + i), 100)
        body = bodies._dump({"model": bodies.MODEL, "max_tokens": 16, "messages": [
            bodies.image_message(data, question)]})
        distinct.append((f"image{i}", body, f"{w}x{h} JPEG {len(data):,} B, body {len(body):,} B"))
    for i in range(images):
        body = bodies.text_chat(2048, seed=50 + i)
        distinct.append((f"text{i}", body, f"text chat, body {len(body):,} B"))
    d = out / "bodies"
    d.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, body, _ in distinct:
        paths[name] = d / f"{name}.json"
        paths[name].write_bytes(body)
    # A rotation of 4 rounds of every body, shuffled: the order repeats, the neighbours vary.
    rotation = [name for name, _, _ in distinct for _ in range(4)]
    rng.shuffle(rotation)
    return [paths[n] for n in rotation], {n: desc for n, _, desc in distinct}


def start_mock(procs, out, binary, name):
    log = out / f"{name}.log"
    p = procs.start([binary, "--port", "0", "--name", name, "--time-scale", "0"], log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        for line in text.splitlines():
            if "listening on " in line:
                return line.split("listening on ", 1)[1].split()[0]
        if p.poll() is not None:
            raise RuntimeError(f"mock worker {name} exited: {text[-500:]}")
        time.sleep(0.05)
    raise RuntimeError(f"mock worker {name} did not start")


def answered(e):
    """Requests Envoy's HTTP connection manager has answered (downstream_rq_completed)."""
    got = e.stats(r"^http\.mmrouter\.downstream_rq_completed$")
    return sum(got.values())


def sample(e, t0, rps_from):
    vms = e.vm_memory()
    return {"t": round(time.monotonic() - t0, 2), "answered": answered(e) - rps_from,
            "rss": e.rss_bytes(), "vm_total": sum(vms.values()),
            "vm_max": max(vms.values(), default=0), "vms": len([v for v in vms.values() if v])}


def quarter(samples, total, which):
    """The samples whose request count falls in quarter `which` (0..3) of `total`."""
    lo, hi = total * which / 4, total * (which + 1) / 4
    return [s for s in samples if lo <= s["answered"] <= hi]


def plateau(first, last, key, tolerance, floor):
    a = max(s[key] for s in first)
    b = max(s[key] for s in last)
    return {"first_max": a, "last_max": b, "first_mean": sum(s[key] for s in first) / len(first),
            "last_mean": sum(s[key] for s in last) / len(last), "growth": b - a,
            "allowed": max(a * tolerance, floor), "plateau": b - a <= max(a * tolerance, floor)}


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wasm", default=os.environ.get("MMROUTER_WASM"), help="the filter (mmrouter.wasm)")
    p.add_argument("--envoy", default=os.environ.get("MMROUTER_ENVOY", str(envoy.ROOT / ".venv/bin/envoy")))
    p.add_argument("--mock", default=os.environ.get("MOCK_WORKER_BIN"), help="the mock-worker binary")
    p.add_argument("--requests", type=int, default=100_000, help="requests to send (default 100,000)")
    p.add_argument("--connections", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--threads", type=int, default=2, help="wrk threads (default 2)")
    p.add_argument("--workers", type=int, default=4, help="mock workers (default 4)")
    p.add_argument("--images", type=int, default=4, help="distinct ~1 MiB images (default 4)")
    p.add_argument("--concurrency", type=int, default=2, help="Envoy --concurrency (default 2)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="growth allowed from the first quarter's max to the last's (default 0.10)")
    p.add_argument("--max-hours", type=float, default=6.0, help="stop wrk after this long anyway")
    p.add_argument("--out", help="output directory (default target/soak/<UTC time>)")
    a = p.parse_args(argv)
    if not a.wasm or not a.mock:
        p.error("--wasm and --mock (or MMROUTER_WASM, MOCK_WORKER_BIN) are required")
    target = Path(os.environ.get("CARGO_TARGET_DIR", envoy.ROOT / "target"))
    out = (Path(a.out) if a.out else target / "soak" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)

    processes.exit_on_signals()
    procs = processes.Processes()
    wrk = None
    try:
        info = machine.describe(a.envoy, a.wasm)
        rotation, described = make_bodies(out, a.images, seed=9)
        (out / "rotation.txt").write_text("".join(f"{p}\n" for p in rotation))
        workers = [start_mock(procs, out, a.mock, f"w{i}") for i in range(a.workers)]
        e = envoy.Envoy(procs, out, "soak", a.envoy, workers, a.wasm, a.concurrency, {})
        for line in machine.header_lines(info):
            print(f"soak: {line}")
        for name, desc in described.items():
            print(f"soak: body {name}: {desc}")
        print(f"soak: {a.requests:,} requests, {a.connections} in flight (wrk, {a.threads} threads), "
              f"{a.workers} mock workers, Envoy --concurrency {a.concurrency}; out {out}", flush=True)

        script = out / "soak.lua"
        script.write_text(WRK_LUA)
        base = answered(e)
        t0 = time.monotonic()
        samples = [sample(e, t0, base)]
        wrk_log = open(out / "wrk.out", "w")
        wrk = subprocess.Popen(
            ["wrk", "-t", str(min(a.threads, a.connections)), "-c", str(a.connections),
             "-d", f"{int(a.max_hours * 3600)}s", "--timeout", "30s", "-s", str(script), e.url],
            env=dict(os.environ, SOAK_BODIES=str(out / "rotation.txt")),
            stdout=wrk_log, stderr=subprocess.STDOUT, preexec_fn=processes._die_with_parent)
        next_print = 0.0
        while wrk.poll() is None:
            time.sleep(a.sample_s)
            s = sample(e, t0, base)
            samples.append(s)
            if s["t"] >= next_print:
                rate = s["answered"] / s["t"] if s["t"] else 0
                print(f"  t={s['t']:7.0f}s answered {s['answered']:>8,} ({rate:,.0f}/s) RSS "
                      f"{s['rss'] / MIB:6.1f} MiB, VMs {s['vms']} sum {s['vm_total'] / MIB:5.1f} MiB "
                      f"(max {s['vm_max'] / MIB:4.1f})", flush=True)
                next_print = s["t"] + 60
            if s["answered"] >= a.requests:
                break
            if e.proc.poll() is not None:
                raise RuntimeError(f"Envoy exited: see {e.log_path}")
        if wrk.poll() is None:
            wrk.send_signal(signal.SIGINT)  # wrk prints its summary and exits
        wrk.wait(timeout=120)
        wrk_log.close()
        wrk_text = (out / "wrk.out").read_text()
        line = next((l for l in wrk_text.splitlines() if l.startswith("SOAK_JSON ")), None)
        if line is None:
            raise RuntimeError(f"wrk gave no summary: {wrk_text[-2000:]}")
        w = json.loads(line[len("SOAK_JSON "):])
        time.sleep(1.0)  # the VMs' ticks set the gauges
        samples.append(sample(e, t0, base))
        counters = e.counters()
        codes = e.stats(r"^http\.mmrouter\.downstream_rq_[2-5]xx$")
        info["loadavg_end"] = machine.loadavg()

        total = samples[-1]["answered"]
        first, last = quarter(samples, total, 0), quarter(samples, total, 3)
        rss = plateau(first, last, "rss", a.tolerance, 8 * MIB)
        vm = plateau(first, last, "vm_total", a.tolerance, 1 * MIB)
        routed = sum(v for k, v in counters.items() if ".routed." in k)
        fallbacks = {k: v for k, v in counters.items() if ".fallback." in k and v}
        non2xx = sum(v for k, v in codes.items() if not k.endswith("2xx"))
        errors = sum(w["errors"].values())
        seconds = w["duration_us"] / 1e6
        result = {"machine": info, "settings": vars(a), "bodies": described, "wrk": w,
                  "answered": total, "codes": codes, "counters": counters, "routed": routed,
                  "fallbacks": fallbacks, "rss": rss, "vm": vm, "samples": len(samples)}
        (out / "results.json").write_text(json.dumps(result, indent=1))
        with open(out / "samples.csv", "w") as f:
            f.write("t_s,answered,rss_bytes,vm_total_bytes,vm_max_bytes,vms\n")
            for s in samples:
                f.write(f"{s['t']},{s['answered']},{s['rss']},{s['vm_total']},{s['vm_max']},{s['vms']}\n")

        def row(name, r):
            return (f"| {name} | {r['first_mean'] / MIB:.1f} | {r['first_max'] / MIB:.1f} | "
                    f"{r['last_mean'] / MIB:.1f} | {r['last_max'] / MIB:.1f} | {r['growth'] / MIB:+.1f} | "
                    f"{'yes' if r['plateau'] else 'NO'} |")
        md = "\n".join([
            f"{w['requests']:,} requests answered by wrk in {seconds:,.0f} s ({w['requests'] / seconds:,.0f}/s), "
            f"Envoy counted {total:,}; wrk errors {w['errors']}; Envoy codes {codes}; "
            f"filter routed {routed:,}, fallbacks {fallbacks or 'none'}; latency p50 "
            f"{w['latency_us']['p50'] / 1000:.1f} ms, p99 {w['latency_us']['p99'] / 1000:.1f} ms; "
            f"{len(samples)} samples.",
            "",
            "| MiB | first quarter mean | first quarter max | last quarter mean | last quarter max | growth (max) | plateau |",
            "|---|---:|---:|---:|---:|---:|---|",
            row("Envoy RSS", rss),
            row("VM linear memory (sum of VMs)", vm),
        ])
        (out / "summary.md").write_text(f"# soak\n\n" + "\n".join(f"- {l}" for l in machine.header_lines(info))
                                        + f"\n- settings: {json.dumps(vars(a))}\n\n{md}\n")
        print()
        print(md)
        print(f"\nsoak: load average at end {' '.join(map(str, info['loadavg_end']))}; wrote {out}/summary.md, "
              f"results.json, samples.csv")
        problems = []
        if errors or non2xx:
            problems.append(f"{errors} wrk errors, {non2xx} non-2xx answers")
        if routed < total - 1:  # the last sample's own count may lag one request
            problems.append(f"the filter routed {routed:,} of {total:,} requests")
        if not (rss["plateau"] and vm["plateau"]):
            problems.append("memory did not plateau")
        if problems:
            print("soak: FAILED: " + "; ".join(problems))
            return 1
        return 0
    finally:
        if wrk is not None and wrk.poll() is None:
            wrk.kill()
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
