"""The README stack in precise mode for a test: mock workers publishing vLLM KV events,
mmrouter-sidecar following them (membership from a watched file, Envoy's workers cluster from its
EDS file), and Envoy with the filter following the sidecar's feed. As scripts/run starts it.

Paths from the environment, as stack.py: MMROUTER_WASM, MOCK_WORKER_BIN, ENVOY_BIN, and
MMROUTER_SIDECAR_BIN (the mmrouter-sidecar binary).
"""
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import render  # noqa: F401  (stack.py puts envoy/ on the path)
from stack import ENVOY, MOCK, ROOT, TARGET, WASM, free_port, start_mock

SIDECAR = Path(os.environ.get("MMROUTER_SIDECAR_BIN", TARGET / "debug/mmrouter-sidecar"))


class PreciseStack:
    def __init__(self, workers=3, listed=None, worker_args=(), plugin_config=None):
        """Starts `workers` mock workers; the first `listed` of them (default all) are in the
        sidecar's membership file."""
        self.tmp = tempfile.TemporaryDirectory(prefix="mmrouter-precise-")
        self.dir = Path(self.tmp.name)
        self.procs = []
        self.workers = {}  # name -> (address, membership line, process)
        self.sidecar = None
        try:
            for i in range(workers):
                self._start_worker(f"w{i}", worker_args)
            listed = workers if listed is None else listed
            self.members = self.dir / "workers.txt"
            self.set_members([f"w{i}" for i in range(listed)])
            self.sidecar_port = free_port()
            self.eds = self.dir / "eds" / "workers.json"
            self.start_sidecar()
            self.port, self.admin = free_port(), free_port()
            config = {"response_headers": True, "decision_log": "info",
                      "sidecar": {"cluster": "mmrouter_sidecar", "stale_ms": 600,
                                  "poll_ms": 100, "timeout_ms": 90}}
            config.update(plugin_config or {})
            first = [self.workers[f"w{i}"][0] for i in range(listed)]
            out = self.dir / "envoy.yaml"
            subprocess.run(
                ["python3", str(ROOT / "envoy/render.py"), "--workers", ",".join(first),
                 "--wasm", str(WASM), "--port", str(self.port), "--admin-port", str(self.admin),
                 "--sidecar", f"127.0.0.1:{self.sidecar_port}", "--eds-file", str(self.eds),
                 "--router-config", self._write("config.json", json.dumps(config)),
                 "--out", str(out)], check=True)
            self.envoy_log = self.dir / "envoy.log"
            self.envoy_config = out
            self.base_id_path = self.dir / "base-id"
            self.procs.append(subprocess.Popen(
                [str(ENVOY), "-c", str(out), "--concurrency", "2", "--use-dynamic-base-id",
                 # the base id a hot restart (test_faults.py) passes to the next epoch
                 "--base-id-path", str(self.base_id_path),
                 "--log-level", "warn", "--component-log-level", "wasm:info",
                 "--file-flush-interval-msec", "50", "--log-path", str(self.envoy_log)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self._wait(lambda: self._get(f"http://127.0.0.1:{self.admin}/ready") == 200, "envoy")
            self._wait(lambda: "mode=precise" in self.decision(), "precise mode")
        except BaseException:
            self.close()
            raise

    def _write(self, name, text):
        path = self.dir / name
        path.write_text(text)
        return str(path)

    def _start_worker(self, name, args):
        p, addr, (events, replay) = start_mock(name, 0, self.dir / f"{name}.log", args,
                                               events=(0, 0))
        self.procs.append(p)
        line = f"{name} {addr} events={events} replay={replay}"
        self.workers[name] = (addr, line, p)

    def set_members(self, names):
        """Rewrites the membership file (atomically) to exactly `names`."""
        tmp = self.dir / "workers.txt.tmp"
        tmp.write_text("".join(self.workers[n][1] + "\n" for n in names))
        tmp.replace(self.dir / "workers.txt")

    def start_sidecar(self):
        log = open(self.dir / "sidecar.log", "a")
        self.sidecar = subprocess.Popen(
            [str(SIDECAR), "--listen", f"127.0.0.1:{self.sidecar_port}",
             "--workers-file", str(self.members), "--eds-file", str(self.eds)],
            stdout=subprocess.DEVNULL, stderr=log)
        self._wait(lambda: self._get(f"http://127.0.0.1:{self.sidecar_port}/health") == 200,
                   "sidecar")

    def kill_sidecar(self):
        self.sidecar.kill()
        self.sidecar.wait(timeout=10)

    def state(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.sidecar_port}/v1/state", timeout=5) as r:
            return json.loads(r.read())

    def _get(self, url):
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status
        except (urllib.error.URLError, ConnectionError, OSError):
            return None

    def _wait(self, pred, what, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if pred():
                    return
            except (urllib.error.URLError, ConnectionError, OSError, KeyError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{what} not ready after {timeout}s")

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def post(self, body, path="/v1/chat/completions"):
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def decision(self):
        """The x-mmrouter-decision header of a throwaway text request."""
        _, h, _ = self.post({"model": "Qwen/Qwen2.5-VL-7B-Instruct", "max_tokens": 1,
                             "messages": [{"role": "user", "content": "ping"}]})
        return h.get("x-mmrouter-decision") or ""

    def stats(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/stats/prometheus") as r:
            return r.read().decode()

    def close(self):
        for p in self.procs + ([self.sidecar] if self.sidecar else []):
            if p.poll() is None:
                p.terminate()
        for p in self.procs + ([self.sidecar] if self.sidecar else []):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.tmp.cleanup()
