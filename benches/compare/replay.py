"""Fleets of fresh mock workers behind one system, and the replay of prebuilt requests.

Systems (each gets its own fresh workers, so every cache starts empty):
  mmrouter     what ./scripts/run starts: Envoy + the mmrouter Wasm filter (MMROUTER_WASM),
               rendered by envoy/render.py, following mmrouter-sidecar (MMROUTER_SIDECAR_BIN),
               which follows the workers' KV events (precise mode); with
               {"response_headers": true} so that every response carries x-mmrouter-overlap
  mmrouter-approx  the same without the sidecar: the filter's embedded approximate mode
               (its own decisions and the workers' /metrics), MMROUTER_SIDECAR=0 of scripts/run
  mmrouter-L   mmrouter with a --router-config L=FILE merged into the plugin configuration
  sglang       SGLang's router (PyPI sglang-router 0.3.2), --policy cache_aware, defaults
  sglang-bal   the same with --balance-abs-threshold 4 (default 64)
  envoy-rr     plain Envoy (render.py --no-filter), round robin over the same workers
  bound        not a router: one mock worker with an unbounded cache and no emulated time

Families of images by URL (`image_source="url"`) are served by `ImageServer` over loopback;
mmrouter's Envoy is rendered with that address in `fetch.allow`, and the images its filter
fetched are counted from Envoy's stats (`filter_image_fetches` in the results).

MMROUTER_CMP_KEEP_LOGS=1 keeps each run's directory (Envoy's, the sidecar's and the workers'
logs, the rendered configuration) instead of removing it; its path is printed. With
--router-config L=FILE holding {"decision_log": "info"}, envoy.log then has every decision
with the wait and recompute it weighed.
"""
import asyncio
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
ROUTERS = ("mmrouter", "mmrouter-approx", "sglang", "sglang-bal", "envoy-rr")

# SGLang's balance thresholds scaled to this fleet: its defaults (abs 64, rel 1.5 requests in
# flight) are for large batches and never trigger at a few requests per worker.
SGLANG_BALANCED = ("--balance-abs-threshold", "4", "--balance-rel-threshold", "1.5")

# The mmrouter configuration every run gets (scripts/run sets the same): the overlap header is
# what the prediction error is measured from, and it is off by default in later builds.
MMROUTER_BASE_CONFIG = {"response_headers": True}

sys.path.insert(0, str(ROOT / "tests" / "support"))
from ports import free_port  # noqa: E402  (tests/support/ports.py)


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
    """Mock workers, one per list of flags in `worker_args`, and one system in front of them;
    every process is stopped on close."""

    def __init__(self, system, worker_args, tools, router_config=None, fetch_allow=None):
        self.tmp = Path(tempfile.mkdtemp(prefix=f"mmrouter-cmp-{system}-"))
        self.procs = []
        self.workers = []  # (name, "127.0.0.1:port", log path)
        self.system = system
        self.tools = tools
        self.events = {}  # name -> (events endpoint, replay endpoint), precise mode
        self.fetch_allow = fetch_allow  # "ip:port" of the image server, for URL images
        self.admin_port = None  # Envoy's, once started
        precise = system.startswith("mmrouter") and system != "mmrouter-approx"
        try:
            for i, args in enumerate(worker_args):
                self._start_worker(f"w{i}", args, precise)
            self.port = free_port()
            if system == "bound":
                self.port = int(self.workers[0][1].rsplit(":", 1)[1])
            elif system.startswith("mmrouter"):
                sidecar = self._start_sidecar() if precise else None
                self._start_envoy(dict(MMROUTER_BASE_CONFIG, **(router_config or {})), sidecar)
            elif system == "envoy-rr":
                self._start_envoy(None)
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

    def _start_worker(self, name, args, precise=False):
        log = self.tmp / f"{name}.log"
        events = []
        if precise:
            # vLLM's --kv-events-config on free ports, as scripts/run starts its workers.
            events = ["--kv-events-config", json.dumps(
                {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                 "replay_endpoint": "tcp://*:0", "topic": f"kv@{name}"})]
        p = subprocess.Popen([str(self.tools["mock"]), "--port", "0", "--name", name, *args,
                              *events], stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        self.procs.append(p)

        def ready():
            text = log.read_text()
            m = re.search(r"listening on ([0-9.]+:\d+)", text)
            ev = re.search(r"kv-events on (tcp://\S+) replay (tcp://\S+)", text)
            if m and (ev or not precise):
                self.workers.append((name, m.group(1), log))
                if ev:
                    self.events[name] = (ev.group(1), ev.group(2))
                return True
            return False

        wait_until(ready, 20, f"mock worker {name}", p, log)

    def _start_sidecar(self):
        """mmrouter-sidecar over the workers (a membership file, as scripts/run writes it);
        returns (its address, the EDS file it writes)."""
        members = self.tmp / "workers.txt"
        members.write_text("".join(
            f"{n} {a} events={self.events[n][0]} replay={self.events[n][1]}\n"
            for n, a, _ in self.workers))
        port, eds, log = free_port(), self.tmp / "eds" / "workers.json", self.tmp / "sidecar.log"
        self.procs.append(subprocess.Popen(
            [str(self.tools["sidecar"]), "--listen", f"127.0.0.1:{port}",
             "--workers-file", str(members), "--eds-file", str(eds)],
            stdout=subprocess.DEVNULL, stderr=open(log, "w")))

        def ready():
            status, body = http_get(f"http://127.0.0.1:{port}/v1/state")
            if status != 200:
                return False
            workers = json.loads(body).get("workers", [])
            return sum(1 for w in workers if w.get("healthy")) >= len(self.workers)

        wait_until(ready, 30, "mmrouter-sidecar", self.procs[-1], log)
        return f"127.0.0.1:{port}", eds

    def _start_envoy(self, plugin_config, sidecar=None):
        """Envoy from envoy/render.py's command line, as scripts/run renders it; no plugin
        configuration = no filter (round robin); `sidecar` = (address, EDS file)."""
        path = self.tmp / "envoy.yaml"
        self.admin_port = free_port()
        cmd = [sys.executable, str(ROOT / "envoy/render.py"),
               "--workers", ",".join(a for _, a, _ in self.workers),
               "--names", ",".join(n for n, _, _ in self.workers),
               "--port", str(self.port), "--admin-port", str(self.admin_port), "--out", str(path)]
        if plugin_config is None:
            cmd.append("--no-filter")
        else:
            cfg = self.tmp / "router-config.json"
            cfg.write_text(json.dumps(plugin_config))
            cmd += ["--wasm", str(self.tools["wasm"]), "--router-config", str(cfg)]
            if sidecar:
                cmd += ["--sidecar", sidecar[0], "--eds-file", str(sidecar[1])]
            if self.fetch_allow:
                cmd += ["--fetch-allow", self.fetch_allow]
        subprocess.run(cmd, check=True)
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
             "--policy", "cache_aware", "--log-level", "warn",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *extra],
            stdout=open(log, "w"), stderr=subprocess.STDOUT))

        def ready():
            # Workers register in the background after the listener is up.
            status, body = http_get(f"{self.url}/workers")
            return status == 200 and body.count("127.0.0.1:") >= len(urls)

        wait_until(ready, 60, "sglang router", self.procs[-1], log)

    def image_fetches(self):
        """Images Envoy fetched for the filter: 2xx answers on its mmrouter_fetch* clusters,
        from Envoy's admin stats (cluster.NAME.upstream_rq_2xx, not its internal/external
        split); None without Envoy."""
        if self.admin_port is None:
            return None
        _, text = http_get(f"http://127.0.0.1:{self.admin_port}/stats?filter=^cluster%5C.mmrouter_fetch",
                           timeout=5)
        return sum(int(v) for k, v in (line.split(": ", 1) for line in text.splitlines() if ": " in line)
                   if len(k.split(".")) == 3 and k.endswith(".upstream_rq_2xx"))

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
                m = re.search(r"cached_tokens=(\d+).*queued_ms=([\d.]+) ttft_ms=([\d.]+) "
                              r"total_ms=([\d.]+)", line)
                if m:
                    rows.append({"worker": name, "cached_tokens": int(m.group(1)),
                                 "queued_ms": float(m.group(2)), "ttft_ms": float(m.group(3)),
                                 "total_ms": float(m.group(4))})
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
                p.wait()
        if os.environ.get("MMROUTER_CMP_KEEP_LOGS"):
            print(f"replay: logs kept in {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


# The image server's process: Python's http.server with HTTP/1.1 keep-alive and a listen
# backlog of 1024. `python -m http.server` listens with a backlog of 5: a first wave of
# requests, each fetching its images from the router and the worker at once, overflows it,
# and a dropped SYN is retried after a second, which the first turns' TTFT then shows.
IMAGE_SERVER = """
import functools, http.server, sys
class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 1024
class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
Server(("127.0.0.1", int(sys.argv[2])),
       functools.partial(Handler, directory=sys.argv[1])).serve_forever()
"""


class ImageServer:
    """The image pool's directory over loopback HTTP (`IMAGE_SERVER`, its own process), for
    families whose images are URLs; stopped when the harness exits."""

    def __init__(self, directory):
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        self.url = f"http://{self.address}"
        self.proc = subprocess.Popen([sys.executable, "-c", IMAGE_SERVER, str(directory), str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(self.close)
        wait_until(lambda: http_get(self.url + "/")[0] == 200, 20, "image server", self.proc)

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


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
    """Streams one chat completion; returns a record (times in seconds from the send)."""
    import aiohttp

    rec = {"status": None, "ttft": None, "e2e": None, "prompt_tokens": None,
           "cached_tokens": None, "worker": None, "overlap": None, "decision": None,
           "error": None, "text": ""}
    t0 = time.perf_counter()
    try:
        async with http.post(url + "/v1/chat/completions", data=body,
                             headers={"content-type": "application/json"},
                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            rec["status"] = r.status
            rec["worker"] = r.headers.get("x-mock-worker")
            rec["overlap"] = r.headers.get("x-mmrouter-overlap")
            rec["decision"] = r.headers.get("x-mmrouter-decision")
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


async def replay(url, requests, arrival, sleep_factor, deadline_s, timeout_s=300.0):
    """Sends `requests` (blocks.Request, sessions in trace order) to `url`.

    Closed arrival: `users` tasks each take the next session and run its turns; open: each
    session starts at its `at`. A turn waits `think` after the previous answer. Every wait is
    multiplied by `sleep_factor` (the mock's --time-scale, so that the emulated timeline keeps
    its shape). Returns (records, wall seconds)."""
    import aiohttp

    sessions = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    records = []
    start = time.perf_counter()

    async def run_session(http, rs):
        for k, r in enumerate(rs):
            if k and time.perf_counter() - start <= deadline_s:
                await asyncio.sleep(r.think * sleep_factor)
            if time.perf_counter() - start > deadline_s:
                records.append({"session": r.session, "turn": r.turn, "error": "skipped: run deadline"})
                continue
            sent = time.perf_counter() - start
            rec = await one_request(http, url, r.body, timeout_s)
            text = rec.pop("text", "")
            rec.update(session=r.session, turn=r.turn, sent=round(sent, 4),
                       images=r.images, images_in_prompt=r.images_in_prompt,
                       expected_prompt_tokens=r.prompt_tokens, blocks=len(r.blocks),
                       answer_ok=(text == r.output) if not rec["error"] else None)
            records.append(rec)

    async def open_session(http, rs):
        await asyncio.sleep(max(0.0, rs[0].at * sleep_factor - (time.perf_counter() - start)))
        await run_session(http, rs)

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as http:
        if arrival.get("mode") == "closed":
            queue = list(sessions.values())
            queue.reverse()

            async def user():
                while queue:
                    await run_session(http, queue.pop())

            await asyncio.gather(*(user() for _ in range(arrival.get("users", 8))))
        else:
            await asyncio.gather(*(open_session(http, rs) for rs in sessions.values()))
    return records, time.perf_counter() - start
