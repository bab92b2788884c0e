"""The load: wrk POSTing one body over keep-alive connections, read back as numbers.

wrk's Lua `done` hook prints one JSON line (requests, duration, errors, latency percentiles in
microseconds), so nothing is scraped from its human output.
"""
import json
import os
import subprocess
from pathlib import Path

WRK_LUA = r"""
-- Written by benches/proxy/load.py: POSTs the file $BENCH_BODY, prints a JSON summary.
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.path = os.getenv("BENCH_PATH") or "/v1/chat/completions"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"p50":%d,"p90":%d,"p99":%d,"mean":%.1f,"max":%d,"min":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max, latency.min))
end
"""


def write_script(path):
    Path(path).write_text(WRK_LUA)
    return path


def wrk(script, url, body_path, connections, seconds, threads=1, timeout_s=10):
    """Runs wrk; returns its summary with req/s and latencies in ms added."""
    threads = max(1, min(threads, connections))
    env = dict(os.environ, BENCH_BODY=str(body_path))
    argv = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{int(seconds)}s",
            "--timeout", f"{timeout_s}s", "-s", str(script), url]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    line = next((l for l in out.stdout.splitlines() if l.startswith("BENCH_JSON ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout}\n{out.stderr}")
    r = json.loads(line[len("BENCH_JSON "):])
    r["seconds"] = r["duration_us"] / 1e6
    r["rps"] = r["requests"] / r["seconds"] if r["seconds"] > 0 else 0.0
    r["latency_ms"] = {k: v / 1000.0 for k, v in r["latency_us"].items()}
    r["errors_total"] = sum(r["errors"].values())
    return r
