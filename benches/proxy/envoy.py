"""Envoy under test: rendered by envoy/render.py (with or without the filter), started, read.

What is read: the process's CPU (utime+stime) and RSS from /proc, and the filter's gauges
`mmrouter.vm_memory_bytes.<vm>` (each VM's Wasm linear memory) and counters from the admin
`/stats`.
"""
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import processes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "envoy"))
import render  # noqa: E402  envoy/render.py


def http_get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode(errors="replace")


class Envoy:
    """One Envoy process in front of `workers` (ip:port strings)."""

    def __init__(self, procs, run_dir, name, binary, workers, wasm=None, concurrency=2,
                 router_config=None, upstream="override-host"):
        run_dir = Path(run_dir)
        self.name = name
        self.with_filter = wasm is not None
        self.port = processes.free_port()
        self.admin_port = processes.free_port()
        names = [f"w{i}" for i in range(len(workers))]
        yaml = render.render(workers, names, wasm or "", self.port, self.admin_port,
                             router_config or {}, with_filter=self.with_filter, upstream=upstream)
        self.config_path = run_dir / f"envoy-{name}.yaml"
        self.config_path.write_text(yaml)
        self.log_path = run_dir / f"envoy-{name}.log"
        self.proc = procs.start([binary, "-c", str(self.config_path), "--concurrency", str(concurrency),
                                 "--use-dynamic-base-id", "--log-level", "warn"], self.log_path)
        self.pid = self.proc.pid
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready(concurrency)

    def _wait_ready(self, concurrency, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Envoy ({self.name}) exited: see {self.log_path}")
            try:
                status, body = http_get(f"http://127.0.0.1:{self.admin_port}/ready", 1.0)
                if status == 200 and body.strip() == "LIVE" and processes.wait_port(
                        "127.0.0.1", self.port, 1.0):
                    break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"Envoy ({self.name}) not ready in {timeout:.0f} s: see {self.log_path}")
        # The pid is Envoy's: .venv/bin/envoy exec()s the binary.
        with open(f"/proc/{self.pid}/comm") as f:
            comm = f.read().strip()
        if comm != "envoy":
            raise RuntimeError(f"pid {self.pid} is {comm!r}, not envoy")
        if self.with_filter:
            # Every VM (main thread + one per worker) reports its memory on its first ticks.
            while time.monotonic() < deadline and len(self.vm_memory()) < concurrency + 1:
                time.sleep(0.05)

    def stats(self, pattern):
        """Admin /stats lines whose name matches pattern: {name: int value}."""
        _, body = http_get(f"http://127.0.0.1:{self.admin_port}/stats?filter={pattern}")
        out = {}
        for line in body.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name.strip()] = int(value)
        return out

    def vm_memory(self):
        """{vm id: linear memory bytes} from the filter's gauges."""
        return {name.rsplit(".", 1)[1]: v for name, v in self.stats(r"vm_memory_bytes").items()}

    def counters(self):
        """The filter's request counters (mmrouter.requests, routed.*, fallback.*, no_worker)."""
        got = self.stats(r"mmrouter\.(requests|routed|fallback|no_worker|images)")
        return {re.sub(r"^wasmcustom\.", "", k): v for k, v in got.items()}

    def cpu_ticks(self):
        return processes.cpu_ticks(self.pid)

    def rss_bytes(self):
        return processes.rss_bytes(self.pid)


def load_router_config(path):
    if not path:
        return {}
    with open(path) as f:
        return json.load(f)
