#!/usr/bin/env python3
"""Replays one multimodal trace through several routers in front of fresh mock vLLM workers.

    .venv/bin/python benches/compare/run.py [--trace FILE | --seed N] [--systems a,b,...]
        [--workers 4] [--repeat 1] [--out DIR] [--router-config LABEL=FILE ...]

Systems (each gets its own fresh workers, so every cache starts empty):
  mmrouter     Envoy + the mmrouter Wasm filter (envoy/render.py), default configuration
  mmrouter-L   the same with --router-config L=FILE merged into the plugin configuration
  sglang       SGLang's router (PyPI sglang-router), --policy cache_aware, default thresholds
  sglang-bal   the same with --balance-abs-threshold 4 (default 64): balances at this scale
  envoy-rr     plain Envoy, round robin over the same workers (no filter)
  oracle       not a router: one mock worker with an unbounded cache and no emulated time,
               the trace replayed 10x faster; its hit rate bounds what routing can reach

Every system sees the same trace: session starts at the trace's Poisson times, later turns
`think` seconds after the previous turn finished, each re-sending the whole conversation with
the answers the workers streamed (identical on every worker: the mock's output depends only on
the prompt). Requests stream with stream_options.include_usage, so TTFT is the first content
chunk and cached_tokens comes from the usage chunk.

Per system it writes DIR/<system>-<run>.json (per-request records, worker metrics) and prints
a summary; DIR/summary.json and DIR/summary.md hold every run. Needs aiohttp and Pillow
(benches/compare/requirements.txt), Envoy (MMROUTER_ENVOY or .venv/bin/envoy), the filter
(MMROUTER_WASM) and the mock worker (MOCK_WORKER_BIN); scripts/bench-compare sets them.
"""
import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "envoy"))
import render  # noqa: E402  envoy/render.py
import trace as tracegen  # noqa: E402

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
SYSTEMS = ("mmrouter", "sglang", "envoy-rr", "oracle")

MOCK_FLAGS = {"prefill_tps": "prefill-tokens-per-sec", "encoder_ms": "encoder-ms-per-image",
              "decode_tps": "decode-tokens-per-sec", "gpu_blocks": "num-gpu-blocks",
              "max_num_seqs": "max-num-seqs", "mm_cache_items": "mm-cache-items"}

# SGLang's balance thresholds scaled to this fleet: its defaults (abs 64, rel 1.5 requests in
# flight) are for large batches and never trigger at a few requests per worker.
SGLANG_BALANCED = ("--balance-abs-threshold", "4", "--balance-rel-threshold", "1.5")

# The mock's timing model and cache sizes (see docs/MOCK_WORKER.md); every one is a flag.
WORKER_DEFAULTS = {
    "prefill_tps": 8000.0,  # uncached prompt tokens per second, one prefill at a time
    "encoder_ms": 40.0,  # per image that needs the encoder
    "decode_tps": 50.0,  # output tokens per second per sequence
    "gpu_blocks": 2560,  # 16-token KV blocks per worker: ~20 prompts of the default trace (mean ~2k tokens)
    "max_num_seqs": 32,
    "mm_cache_items": 8,  # vLLM's encoder cache holds a few images, not hundreds
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode(errors="replace")


def wait_until(pred, timeout, what, proc=None, log=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if pred():
                return
        except Exception:  # noqa: BLE001  (not up yet)
            pass
        if proc is not None and proc.poll() is not None:
            tail = Path(log).read_text()[-3000:] if log else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}\n{tail}")
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout}s")


class Fleet:
    """N mock workers and one router in front of them; every process is stopped on close."""

    def __init__(self, system, n_workers, worker_args, tools, router_config=None):
        self.tmp = Path(tempfile.mkdtemp(prefix=f"mmrouter-cmp-{system}-"))
        self.procs = []
        self.workers = []  # (name, "127.0.0.1:port", log path)
        self.system = system
        self.tools = tools
        try:
            for i in range(n_workers):
                self._start_worker(f"w{i}", worker_args)
            self.port = free_port()
            if system == "oracle":
                self.port = int(self.workers[0][1].rsplit(":", 1)[1])
            elif system.startswith("mmrouter"):
                self._start_envoy(render.render(
                    [a for _, a, _ in self.workers], [n for n, _, _ in self.workers],
                    str(tools["wasm"]), self.port, free_port(), router_config or {}))
            elif system == "envoy-rr":
                # The same Envoy configuration without the filter: round robin.
                self._start_envoy(render.render(
                    [a for _, a, _ in self.workers], [n for n, _, _ in self.workers],
                    "", self.port, free_port(), {}, with_filter=False))
            elif system == "sglang":
                self._start_sglang()
            elif system == "sglang-bal":
                self._start_sglang(SGLANG_BALANCED)
            else:
                raise ValueError(f"unknown system {system}")
        except BaseException:
            self.close()
            raise

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def _start_worker(self, name, args):
        log = self.tmp / f"{name}.log"
        p = subprocess.Popen([str(self.tools["mock"]), "--port", "0", "--name", name, *args],
                             stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        self.procs.append(p)

        def ready():
            m = re.search(r"listening on ([0-9.]+:\d+)", log.read_text())
            if m:
                self.workers.append((name, m.group(1), log))
                return True
            return False

        wait_until(ready, 20, f"mock worker {name}", p, log)

    def _start_envoy(self, config):
        path = self.tmp / "envoy.yaml"
        path.write_text(config)
        log = self.tmp / "envoy.log"
        self.procs.append(subprocess.Popen(
            [str(self.tools["envoy"]), "-c", str(path), "--concurrency", "2",
             "--use-dynamic-base-id", "--log-level", "warn", "--component-log-level", "wasm:info",
             "--log-path", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until(lambda: http_get(f"{self.url}/health")[0] == 200, 60, "envoy",
                   self.procs[-1], log)

    def _start_sglang(self, extra=()):
        log = self.tmp / "sglang.log"
        urls = [f"http://{a}" for _, a, _ in self.workers]
        self.procs.append(subprocess.Popen(
            [str(self.tools["python"]), "-m", "sglang_router.launch_router",
             "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *urls,
             "--policy", "cache_aware", "--log-level", "warn", *extra],
            stdout=open(log, "w"), stderr=subprocess.STDOUT))

        def ready():
            # Workers register in the background after the listener is up.
            status, body = http_get(f"{self.url}/workers")
            return status == 200 and body.count("127.0.0.1:") >= len(urls)

        wait_until(ready, 60, "sglang router", self.procs[-1], log)

    def metrics(self):
        out = {}
        for name, addr, _ in self.workers:
            _, text = http_get(f"http://{addr}/metrics", timeout=5)
            out[name] = parse_metrics(text)
        return out

    def worker_log_lines(self):
        rows = []
        for name, _, log in self.workers:
            for line in log.read_text().splitlines():
                m = re.search(r"queued_ms=([\d.]+) ttft_ms=([\d.]+) total_ms=([\d.]+)", line)
                if m:
                    rows.append({"worker": name, "queued_ms": float(m.group(1)),
                                 "ttft_ms": float(m.group(2)), "total_ms": float(m.group(3))})
        return rows

    def close(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def parse_metrics(text):
    """Sums every sample of each metric name (labels dropped; one engine per mock)."""
    vals = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(3))
    return vals


# ----------------------------------------------------------------------------- replay

async def one_request(http, url, body, timeout):
    """Streams one chat completion; returns a record (times relative to the send)."""
    import aiohttp

    rec = {"status": None, "ttft": None, "e2e": None, "prompt_tokens": None,
           "cached_tokens": None, "worker": None, "error": None, "text": ""}
    t0 = time.perf_counter()
    try:
        async with http.post(url + "/v1/chat/completions", data=body,
                             headers={"content-type": "application/json"},
                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            rec["status"] = r.status
            rec["worker"] = r.headers.get("x-mock-worker")
            rec["overlap"] = r.headers.get("x-mmrouter-overlap")
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                return rec
            parts = []
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:]
                        if data == b"[DONE]":
                            continue
                        obj = json.loads(data)
                        for ch in obj.get("choices") or []:
                            c = (ch.get("delta") or {}).get("content")
                            if c:
                                if rec["ttft"] is None:
                                    rec["ttft"] = time.perf_counter() - t0
                                parts.append(c)
                        u = obj.get("usage")
                        if u:
                            rec["prompt_tokens"] = u.get("prompt_tokens")
                            rec["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get(
                                "cached_tokens", 0) or 0
            rec["text"] = "".join(parts)
            rec["e2e"] = time.perf_counter() - t0
            if rec["prompt_tokens"] is None:
                rec["error"] = "no usage chunk"
    except Exception as e:  # noqa: BLE001  (a failed request is a result, not a crash)
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    return rec


def user_message(text, image_ids, pool):
    content = [{"type": "image_url", "image_url": {"url": pool.data_url(i)}} for i in image_ids]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


async def replay(url, header, turns, pool, deadline_s, timeout_s=120.0, time_factor=1.0):
    import aiohttp

    sessions = {}
    for t in turns:
        sessions.setdefault(t["session"], []).append(t)
    records = []
    start = time.perf_counter()
    system = {"role": "system", "content": header["system_prompt"]}

    async def run_session(ts):
        messages = [system]
        await asyncio.sleep(max(0.0, ts[0]["at"] * time_factor - (time.perf_counter() - start)))
        for t in ts:
            if t["turn"] > 0:
                await asyncio.sleep(t["think"] * time_factor)
            if time.perf_counter() - start > deadline_s:
                records.append({"session": t["session"], "turn": t["turn"], "error": "skipped: run deadline"})
                return
            messages.append(user_message(t["text"], t["images"], pool))
            body = json.dumps({
                "model": MODEL, "messages": messages, "max_tokens": t["max_tokens"],
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            })
            sent = time.perf_counter() - start
            rec = await one_request(http, url, body, timeout_s)
            rec.update(session=t["session"], turn=t["turn"], sent=round(sent, 4),
                       images=len(t["images"]),
                       images_in_prompt=sum(1 for m in messages for c in (m["content"] if isinstance(m["content"], list) else []) if c.get("type") == "image_url"),
                       body_bytes=len(body))
            text = rec.pop("text", "")
            records.append(rec)
            if rec["error"]:
                return  # the conversation cannot go on without the answer
            messages.append({"role": "assistant", "content": text})

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as http:
        await asyncio.gather(*(run_session(ts) for ts in sessions.values()))
    return records, time.perf_counter() - start


# ----------------------------------------------------------------------------- stats

def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(records, metrics, wlog, wall, expected):
    ok = [r for r in records if not r.get("error")]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2e = [r["e2e"] for r in ok]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    m_tot = lambda k: sum(m.get(k, 0.0) for m in metrics.values())  # noqa: E731
    mm_q, enc = m_tot("vllm:mm_cache_queries_total"), m_tot("mock:encoder_runs_total")
    per_worker = {w: int(m.get("vllm:request_success_total", 0)) for w, m in metrics.items()}
    counts = list(per_worker.values())
    mean = sum(counts) / max(1, len(counts))
    wttft = [r["ttft_ms"] / 1e3 for r in wlog]
    wq = [r["queued_ms"] / 1e3 for r in wlog]
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    last = {}
    switched = 0
    fu = [r for r in ok if r["turn"] > 0]
    first = [r for r in ok if r["turn"] == 0]
    for r in sorted(ok, key=lambda r: (r["session"], r["turn"])):
        if r["turn"] > 0 and last.get(r["session"]) not in (None, r["worker"]):
            switched += 1
        last[r["session"]] = r["worker"]
    hit = lambda rs: round(sum(r["cached_tokens"] for r in rs) / max(1, sum(r["prompt_tokens"] for r in rs)), 4)  # noqa: E731
    return {
        "requests": expected, "ok": len(ok), "errors": len(records) - len(ok) + (expected - len(records)),
        "error_samples": sorted({r["error"] for r in records if r.get("error")})[:3],
        "wall_s": round(wall, 1),
        "ttft_p50": r3(pct(ttft, 50)), "ttft_p90": r3(pct(ttft, 90)), "ttft_p99": r3(pct(ttft, 99)),
        "ttft_mean": r3(statistics.fmean(ttft) if ttft else None),
        "e2e_p50": r3(pct(e2e, 50)), "e2e_p90": r3(pct(e2e, 90)),
        "worker_ttft_p50": r3(pct(wttft, 50)), "worker_ttft_p90": r3(pct(wttft, 90)),
        "worker_queued_p90": r3(pct(wq, 90)),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "first_turn_hit_rate": hit(first), "followup_hit_rate": hit(fu),
        "followups_switched_worker": switched, "followups": len(fu),
        "engine_hit_rate": round(m_tot("vllm:prefix_cache_hits_total") / max(1.0, m_tot("vllm:prefix_cache_queries_total")), 4),
        "images_in_prompts": int(mm_q), "encoder_runs": int(enc),
        "encoder_avoided": round(1 - enc / mm_q, 4) if mm_q else None,
        "kv_blocks_evicted": int(m_tot("mock:kv_blocks_removed_total")),
        "per_worker": per_worker,
        "imbalance_max_over_mean": round(max(counts) / mean, 3) if counts and mean else None,
    }


def fmt_row(system, s):
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    dist = "/".join(str(v) for v in s["per_worker"].values())
    return (f"| {system} | {f(s['ttft_p50'])} | {f(s['ttft_p90'])} | {f(s['ttft_p99'])} | "
            f"{f(s['e2e_p50'])} | {f(s['e2e_p90'])} | {f(100 * s['hit_rate'], 1) if s['hit_rate'] is not None else '-'}% | "
            f"{f(100 * s['encoder_avoided'], 1) if s['encoder_avoided'] is not None else '-'}% "
            f"({s['encoder_runs']}/{s['images_in_prompts']}) | {dist} | {s['errors']} |")


TABLE_HEAD = ("| system | TTFT p50 s | TTFT p90 s | TTFT p99 s | e2e p50 s | e2e p90 s | "
              "prefix hit | encoder avoided (runs/images) | requests per worker | errors |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")


# ----------------------------------------------------------------------------- main

def tools_from_env():
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return {
        "wasm": Path(os.environ.get("MMROUTER_WASM", target / "wasm32-wasip1/wasm/mmrouter.wasm")),
        "mock": Path(os.environ.get("MOCK_WORKER_BIN", target / "release/mock-worker")),
        "envoy": Path(os.environ.get("MMROUTER_ENVOY", ROOT / ".venv/bin/envoy")),
        "python": Path(os.environ.get("BENCH_PYTHON", sys.executable)),
    }


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--trace", help="replay this JSONL trace; None = generate one from --seed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, help="requests in a generated trace; None = 300")
    ap.add_argument("--rate", type=float, help="requests/s of a generated trace; None = 5.0")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated: mmrouter, sglang, sglang-bal, envoy-rr, oracle")
    ap.add_argument("--router-config", action="append", default=[], metavar="LABEL=FILE",
                    help="also run mmrouter-LABEL with FILE (JSON) merged into the filter configuration; repeatable")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="runs of every system")
    ap.add_argument("--deadline", type=float, default=110.0, help="seconds after which a run sends nothing more")
    for k, v in WORKER_DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v,
                        help="mock-worker --" + MOCK_FLAGS[k])
    ap.add_argument("--images-dir", default=str(Path(tempfile.gettempdir()) / "mmrouter-cmp-images"))
    ap.add_argument("--out", default=str(ROOT / "target/bench-compare"))
    a = ap.parse_args(argv)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.trace:
        header, turns = tracegen.load(a.trace)
        trace_name = a.trace
    else:
        header, turns = tracegen.generate(a.seed, requests=a.requests, rate=a.rate)
        trace_name = str(out / f"trace-seed{a.seed}.jsonl")
        tracegen.save(trace_name, header, turns)
    pool = tracegen.ImagePool(header, a.images_dir)
    pool.warm()
    tsum = tracegen.summary(header, turns, pool)
    print(f"trace {trace_name}: {json.dumps(tsum)}", flush=True)

    tools = tools_from_env()
    for k in ("mock", "envoy"):
        if not tools[k].exists():
            sys.exit(f"missing {k}: {tools[k]}")
    worker_args = ["--time-scale", "1", "--prefill-tokens-per-sec", str(a.prefill_tps),
                   "--encoder-ms-per-image", str(a.encoder_ms), "--decode-tokens-per-sec", str(a.decode_tps),
                   "--num-gpu-blocks", str(a.gpu_blocks), "--max-num-seqs", str(a.max_num_seqs),
                   "--mm-cache-items", str(a.mm_cache_items), "--model", MODEL]
    variants = {}
    for spec in a.router_config:
        label, _, path = spec.partition("=")
        variants[f"mmrouter-{label}"] = json.loads(Path(path).read_text())
    systems = [s.strip() for s in a.systems.split(",") if s.strip()] + list(variants)
    results = []
    for rep in range(a.repeat):
        for system in systems:
            load_before = os.getloadavg()
            if system == "oracle":
                # One worker, a cache that never evicts, no emulated time and the trace 10x
                # faster: the most any router could get from the caches on this trace.
                args = worker_args + ["--time-scale", "0", "--num-gpu-blocks", "1000000",
                                      "--mm-cache-items", "0"]
                fleet, factor = Fleet(system, 1, args, tools), 0.1
            else:
                fleet, factor = Fleet(system, a.workers, worker_args, tools,
                                      variants.get(system)), 1.0
            try:
                records, wall = asyncio.run(replay(fleet.url, header, turns, pool, a.deadline,
                                                   time_factor=factor))
                time.sleep(0.3)  # let the last finished lines reach the worker logs
                metrics = fleet.metrics()
                wlog = fleet.worker_log_lines()
            finally:
                fleet.close()
            s = summarize(records, metrics, wlog, wall, len(turns))
            s.update(system=system, run=rep, seed=header["seed"], trace=trace_name,
                     load_before=[round(x, 2) for x in load_before],
                     load_after=[round(x, 2) for x in os.getloadavg()])
            results.append(s)
            (out / f"{system}-seed{header['seed']}-run{rep}.json").write_text(json.dumps(
                {"summary": s, "records": records, "metrics": metrics, "worker_log": wlog}, indent=1))
            print(TABLE_HEAD.splitlines()[0] if len(results) == 1 else "", end="", flush=True)
            print(("\n" if len(results) == 1 else "") + fmt_row(f"{system} #{rep}", s)
                  + f"  load {s['load_before'][0]:.1f}->{s['load_after'][0]:.1f} wall {s['wall_s']}s", flush=True)
    params = {"workers": a.workers, **{k: getattr(a, k) for k in WORKER_DEFAULTS},
              "trace": tsum, "trace_params": header["params"], "router_configs": variants}
    summary_path = out / "summary.json"
    prev = json.loads(summary_path.read_text()) if summary_path.exists() else []
    summary_path.write_text(json.dumps(prev + [{"params": params, "results": results}], indent=1))
    md = [f"trace seed {header['seed']}: {json.dumps(tsum)}", "", TABLE_HEAD]
    md += [fmt_row(f"{r['system']} #{r['run']}", r) for r in results]
    (out / f"summary-seed{header['seed']}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main(sys.argv[1:])
