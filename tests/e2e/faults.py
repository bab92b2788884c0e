"""Fault injection for the end-to-end fault tests (test_faults.py) and the soak (scripts/soak).

- `Stream`: a steady request stream through a stack (several client threads, one request after
  another), every answer recorded: status, the worker that served it, the router's predicted
  overlap, the routing mode, and the engine's cached tokens.
- `restart_worker`: a mock worker killed (SIGKILL, as a crash) and started again on the same
  HTTP port and, with KV events, the same event ports: its cache is empty again.
- `HangProxy`: a TCP proxy in front of a worker that forwards everything except `GET /metrics`,
  which it accepts and never answers while `hang` is set.
- `hot_restart`: a second Envoy with `--restart-epoch 1` and the same configuration and base id.
Every process and thread started here is stopped by its owner's close().
"""
import json
import random
import re
import select
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from stack import ENVOY, MOCK, start_mock

# vLLM recomputes the last block of a fully cached prompt, and the router counts full blocks:
# a prediction may exceed the engine's cached tokens by this many blocks and still be right.
BLOCK = 16


@dataclass
class Answer:
    start: float
    end: float
    client: int
    body: int  # index in the body pool
    status: int  # HTTP status; 0 when there was no HTTP answer (`error` says why)
    worker: str = ""  # x-mock-worker: who served it
    routed: str = ""  # x-mmrouter-worker: whom the filter chose
    matched: int = 0  # x-mmrouter-overlap: blocks the router predicted cached ...
    total: int = 0  # ... of the request's blocks
    mode: str = ""  # precise / approximate, from x-mmrouter-decision
    cached: int = 0  # usage.prompt_tokens_details.cached_tokens: what the engine had
    error: str = ""

    @property
    def ok(self):
        return self.status == 200

    @property
    def stale(self):
        """The router predicted more cached blocks than the worker that served it had."""
        return self.ok and self.matched * BLOCK > self.cached + BLOCK


def send(url, body, timeout=60):
    """POSTs one chat request; returns (status, headers, body bytes, error)."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read(), ""
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read(), f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ConnectionError) as e:
        return 0, {}, b"", f"{type(e).__name__}: {e}"


def parse_answer(start, client, index, status, headers, data, error):
    a = Answer(start=start, end=time.monotonic(), client=client, body=index, status=status,
               error=error)
    a.worker = headers.get("x-mock-worker") or ""
    a.routed = headers.get("x-mmrouter-worker") or ""
    m = re.fullmatch(r"(\d+)/(\d+)", headers.get("x-mmrouter-overlap") or "")
    if m:
        a.matched, a.total = int(m.group(1)), int(m.group(2))
    a.mode = (headers.get("x-mmrouter-decision") or "").rsplit("mode=", 1)[-1] if \
        "mode=" in (headers.get("x-mmrouter-decision") or "") else ""
    if status == 200:
        try:
            usage = json.loads(data).get("usage") or {}
            a.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        except ValueError as e:
            a.status, a.error = 0, f"answer is not JSON: {e}"
    elif not a.error:
        a.error = f"HTTP {status}: {data[:200]!r}"
    return a


class Stream:
    """`clients` threads, each sending `bodies` (encoded request bodies) picked at random (seeded
    per client) one after another, `pause` seconds apart, until stop()."""

    def __init__(self, url, bodies, clients=2, pause=0.01, seed=0, pick=None):
        self.url = url
        self.bodies = bodies
        self.pause = pause
        self.answers = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pick = pick
        self._threads = [threading.Thread(target=self._client, args=(i, seed), daemon=True)
                         for i in range(clients)]

    def __enter__(self):
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def _client(self, client, seed):
        rng = random.Random(seed * 1000 + client)
        n = 0
        while not self._stop.is_set():
            index = self._pick(rng, n) if self._pick else rng.randrange(len(self.bodies))
            n += 1
            start = time.monotonic()
            status, headers, data, error = send(self.url, self.bodies[index])
            a = parse_answer(start, client, index, status, headers, data, error)
            with self._lock:
                self.answers.append(a)
            if self.pause:
                self._stop.wait(self.pause)

    def since(self, t):
        """Answers to requests started at or after monotonic time `t`."""
        with self._lock:
            return [a for a in self.answers if a.start >= t]

    def failed(self):
        with self._lock:
            return [a for a in self.answers if not a.ok]

    def wait_for(self, pred, since, timeout, what):
        """Waits until pred(answers started since `since`) holds; returns the time it first did,
        in seconds after `since` (the end of the answer that made it hold)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = pred(self.since(since))
            if found is not None:
                return found.end - since
            time.sleep(0.02)
        raise AssertionError(f"{what}: not within {timeout} s")


def first(pred):
    """A predicate for Stream.wait_for: the first answer (by end time) for which pred holds."""
    def check(answers):
        hits = sorted((a for a in answers if pred(a)), key=lambda a: a.end)
        return hits[0] if hits else None
    return check


# --- workers -----------------------------------------------------------------------------------

def _port(endpoint):
    return int(endpoint.rsplit(":", 1)[1])


def kill_worker(stack, name):
    """SIGKILL (a crash: no drain) of a worker of a Stack or PreciseStack."""
    p = _worker_proc(stack, name)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)


def restart_worker(stack, name, args=()):
    """Starts worker `name` again on its old HTTP port (and, in a PreciseStack, its old event
    and replay ports), after kill_worker. Returns the new process."""
    if hasattr(stack, "worker_procs"):  # stack.Stack
        address = dict(stack.workers)[name]
        upstream = getattr(stack, "upstreams", {}).get(name, address)
        log = Path(stack.tmp.name) / f"{name}.log"
        p, _, _ = _retry_bind(lambda: start_mock(name, _port(upstream), log, args))
        stack.worker_procs[name] = p
    else:  # precise.PreciseStack
        address, line, _ = stack.workers[name]
        upstream = getattr(stack, "upstreams", {}).get(name, address)
        ev = re.search(r"events=(\S+) replay=(\S+)", line)
        p, _, _ = _retry_bind(lambda: start_mock(
            name, _port(upstream), stack.dir / f"{name}.log", args,
            events=(_port(ev.group(1)), _port(ev.group(2)))))
        stack.workers[name] = (address, line, p)
    stack.procs.append(p)
    return p


def _retry_bind(start, attempts=50):
    for i in range(attempts):
        try:
            return start()
        except RuntimeError as e:
            if "cannot listen" not in str(e) and "ddress" not in str(e) or i == attempts - 1:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


def _worker_proc(stack, name):
    if hasattr(stack, "worker_procs"):
        return stack.worker_procs[name]
    return stack.workers[name][2]


# --- a proxy whose /metrics can hang -------------------------------------------------------------

class HangProxy:
    """Listens on a free loopback port and relays every connection to `upstream` (ip:port).
    While `hang` is set, a connection whose client sends `GET /metrics` is held: the request is
    accepted and never answered (nor forwarded), as a wedged metrics endpoint would. The other
    requests (POSTs to the engine) pass untouched. One thread per direction per connection."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.hang = threading.Event()
        self.held = 0  # connections held by a hanging /metrics
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(256)
        self.address = "127.0.0.1:%d" % self._server.getsockname()[1]
        self._closed = threading.Event()
        self._socks = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _track(self, s):
        with self._lock:
            self._socks.add(s)

    def _accept(self):
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            self._track(client)
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client):
        host, port = self.upstream.rsplit(":", 1)
        try:
            upstream = socket.create_connection((host, int(port)), timeout=5)
        except OSError:
            client.close()  # the worker is down: the client sees the connection closed
            return
        upstream.settimeout(None)
        self._track(upstream)
        threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()
        self._pipe(client, upstream, True)

    def _pipe(self, src, dst, from_client):
        try:
            while not self._closed.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if from_client and self.hang.is_set() and b"GET /metrics" in data[:64]:
                    with self._lock:
                        self.held += 1
                    # Accepted, never answered: read and drop until the client gives up.
                    while not self._closed.is_set():
                        r, _, _ = select.select([src], [], [], 0.2)
                        if r and not src.recv(65536):
                            break
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self):
        self._closed.set()
        self._server.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.close()
            except OSError:
                pass


def proxied(stack_class):
    """A subclass of Stack or PreciseStack whose workers are registered behind a HangProxy each
    (`stack.proxies[name]`; `stack.upstreams[name]` is the worker's own address). KV events go
    to the worker directly."""

    class Proxied(stack_class):
        def _start_worker(self, name, args):
            if not hasattr(self, "proxies"):
                self.proxies, self.upstreams = {}, {}
            super()._start_worker(name, args)
            if isinstance(self.workers, dict):  # PreciseStack: name -> (address, line, process)
                address, line, p = self.workers[name]
                proxy = HangProxy(address)
                self.workers[name] = (proxy.address, line.replace(address, proxy.address, 1), p)
            else:  # Stack: [(name, address)]
                _, address = self.workers[-1]
                proxy = HangProxy(address)
                self.workers[-1] = (name, proxy.address)
            self.proxies[name] = proxy
            self.upstreams[name] = address

        def close(self):
            try:
                super().close()
            finally:
                for proxy in getattr(self, "proxies", {}).values():
                    proxy.close()

    return Proxied


# --- Envoy hot restart ---------------------------------------------------------------------------

def hot_restart(stack, config, base_id, log_path, parent_shutdown_s=6, drain_s=3):
    """Starts Envoy epoch 1 over the running one (same base id, same configuration file): it takes
    the listeners and the shared memory from its parent, then shuts the parent down after
    `parent_shutdown_s`. Returns the new process (appended to stack.procs)."""
    p = subprocess.Popen(
        [str(ENVOY), "-c", str(config), "--concurrency", "2", "--base-id", str(base_id),
         "--restart-epoch", "1", "--parent-shutdown-time-s", str(parent_shutdown_s),
         "--drain-time-s", str(drain_s), "--drain-strategy", "immediate",
         "--log-level", "warn", "--component-log-level", "wasm:info",
         "--file-flush-interval-msec", "50", "--log-path", str(log_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.procs.append(p)
    return p
