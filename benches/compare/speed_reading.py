#!/usr/bin/env python3
"""The prefill speed mmrouter reads from a worker, against the prefills in flight at once.

    python3 benches/compare/speed_reading.py [--mock target/release/mock-worker]
        [--speed 10000] [--words 600] [--rounds 3] [--concurrency 1,2,4,8]

mmrouter reads a worker's prefill speed from its /metrics as the uncached prompt tokens over
the sum of `vllm:request_prefill_time_seconds` between two scrapes (`PrefillSpeed` in
src/worker_metrics.rs; the filter's own poller in src/state/writer.rs does the same). A
request's prefill time runs from its scheduling to its first token, so it counts the time it
waits behind other prefills. This starts one mock worker at `--speed` tokens/s (no cache
hits: every prompt is new), sends `--rounds` rounds of c requests at once for each c, and
prints the speed that reading gives, its share of the true speed, and 2 / (c + 1), the share
a single prefill lane gives when c requests arrive together (the k-th waits for k - 1).
"""
import argparse
import concurrent.futures
import json
import random
import subprocess
import urllib.request

from replay import ROOT, free_port, http_get, parse_metrics, wait_until

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"  # the mock's default served model


def counters(url):
    """(prompt tokens, prefix-cache hit tokens, prefill seconds) from /metrics."""
    vals = parse_metrics(http_get(f"{url}/metrics", timeout=5)[1])
    return tuple(vals.get(name, 0.0) for name in (
        "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
        "vllm:request_prefill_time_seconds_sum"))


def request(url, words, rng):
    text = " ".join(f"w{rng.random():.6f}" for _ in range(words))
    body = json.dumps({"model": MODEL, "max_tokens": 1,
                       "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mock", default=str(ROOT / "target/release/mock-worker"))
    ap.add_argument("--speed", type=float, default=10000.0)
    ap.add_argument("--words", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,2,4,8")
    a = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    mock = subprocess.Popen([a.mock, "--port", str(port), "--prefill-tokens-per-sec",
                             str(a.speed)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    rng = random.Random(0)
    try:
        wait_until(lambda: http_get(f"{url}/health")[0] == 200, 10, "mock worker", mock)
        print("| prefills at once | speed read, tokens/s | share of the true speed | 2 / (c + 1) |")
        print("|---:|---:|---:|---:|")
        for c in (int(x) for x in a.concurrency.split(",")):
            prompt0, hits0, secs0 = counters(url)
            for _ in range(a.rounds):
                with concurrent.futures.ThreadPoolExecutor(c) as ex:
                    list(ex.map(lambda _: request(url, a.words, rng), range(c)))
            prompt1, hits1, secs1 = counters(url)
            read = (prompt1 - prompt0 - (hits1 - hits0)) / (secs1 - secs0)
            print(f"| {c} | {read:,.0f} | {read / a.speed:.2f} | {2 / (c + 1):.2f} |")
    finally:
        mock.terminate()
        mock.wait(timeout=10)


if __name__ == "__main__":
    main()
