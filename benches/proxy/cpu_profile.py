"""Where Envoy's CPU goes, per request: `perf record` on the Envoy process during a run, split by
the code it ran (perf's `dso`: Envoy's own C++ and the V8 runtime in `envoy`, the filter's Wasm
code as V8 compiled it in `[JIT]`, `libc` (memcpy/memset of bodies), the kernel (sockets)).

Envoy's V8 writes no perf map, so the Wasm functions have no names here; the split still tells
the filter's own code from the host's work around it. Needs `perf` (Debian linux-perf) and a
kernel that allows sampling (perf_event_paranoid <= 2 as root); software cpu-clock events are
used, so it works in VMs without hardware counters.
"""
import re
import shutil
import subprocess
import time

import load
import processes


def available():
    if not shutil.which("perf"):
        return False
    r = subprocess.run(["perf", "record", "-e", "cpu-clock", "-o", "/dev/null", "--", "true"],
                       capture_output=True)
    return r.returncode == 0


def _group(dso):
    if dso.startswith("[JIT]"):
        return "wasm (V8 JIT code)"
    if dso == "envoy":
        return "envoy (C++, V8 runtime)"
    if dso.startswith("[kernel"):
        return "kernel"
    if dso.startswith("libc"):
        return "libc (memcpy, memset, malloc)"
    return "other"


def profiled_run(e, script, body_path, connections, seconds, data_path, threads=1, hz=999):
    """One wrk run with perf sampling Envoy; {group: µs per request} and the run's requests.

    Envoy's CPU per request comes from /proc over the wrk run, as in the measured runs; perf's
    samples only split it (their window is a little longer than wrk's, as perf attaches first)."""
    perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", str(hz), "-p", str(e.pid),
                             "-o", str(data_path), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # perf attaches to every thread
        cpu0 = e.cpu_ticks()
        r = load.wrk(script, e.url, body_path, connections, seconds, threads)
        cpu_us = (e.cpu_ticks() - cpu0) / processes.CLOCK_TICK * 1e6
    finally:
        perf.send_signal(2)  # SIGINT: perf writes its data and exits
        perf.wait(30)
    rep = subprocess.run(["perf", "report", "-i", str(data_path), "--no-children", "--sort", "dso",
                          "--stdio", "-n"], capture_output=True, text=True).stdout
    groups = {}
    for line in rep.splitlines():
        m = re.match(r"\s+[\d.]+%\s+(\d+)\s+(.*\S)", line)
        if m:
            g = _group(m.group(2))
            groups[g] = groups.get(g, 0) + int(m.group(1))
    n = max(1, r["requests"])
    total = max(1, sum(groups.values()))
    return {g: samples / total * cpu_us / n for g, samples in groups.items()}, r["requests"]


GROUPS = ["wasm (V8 JIT code)", "envoy (C++, V8 runtime)", "libc (memcpy, memset, malloc)", "kernel",
          "other"]


def table(rows):
    """rows: [{"body", "connections", "plain": {group: µs}, "filter": {group: µs}}]."""
    lines = ["| body | conns | " + " | ".join(f"{g}, plain / filter" for g in GROUPS) + " | total added |",
             "|---|---:|" + "---:|" * (len(GROUPS) + 1)]
    for r in rows:
        p, f = r["plain"], r["filter"]
        cells = [f"{p.get(g, 0):,.0f} / {f.get(g, 0):,.0f}" for g in GROUPS]
        added = sum(f.values()) - sum(p.values())
        lines.append(f"| {r['body']} | {r['connections']} | " + " | ".join(cells) + f" | {added:+,.0f} |")
    return "\n".join(lines) + ("\n\nEnvoy CPU in µs per request (utime+stime over one more run, "
                                "split by the shares of perf's cpu-clock samples).")
