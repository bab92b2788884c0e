"""envoy/istio/ end to end: the EnvoyFilter turned into what istiod would push, run by the real
Envoy 1.40, with the filter pulled from a real OCI registry and fetched by Envoy over HTTP
with its sha256 checked, routing requests to mock vLLM workers. What is emulated and what is
real: istio_xds.py (module doc) and envoy/istio/README.md ("How it is tested").

Workers listen on 127.0.0.2.. with one port, like pods behind a headless Service; the gateway's
STRICT_DNS cluster resolves the Service name through a loopback DNS server. With the sidecar
binary in the tree (`mmrouter-sidecar`, MMROUTER_SIDECAR_BIN) the manifest's plugin config is
used as is and the sidecar serves the feed; without it the `sidecar` key is replaced by the
same workers as a static list, and the tests that need the sidecar are skipped.
"""
import copy
import hashlib
import json
import os
import random
import re
import socket
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import pytest

import istio_xds
from conftest import chat, png
from registry import Registry
from stack import ENVOY, MOCK, WASM, free_port

SIDECAR = os.environ.get("MMROUTER_SIDECAR_BIN", "")
WORKERS_SERVICE = "vllm-workers.llm.svc.cluster.local:8000"
SIDECAR_SERVICE = "mmrouter-sidecar.istio-system.svc.cluster.local:9902"
IMAGE_REPO = "mmrouter/mmrouter-wasm"


def common_free_port(ips):
    """A port free on every one of `ips`."""
    for _ in range(50):
        port = free_port()
        socks = []
        try:
            for ip in ips:
                s = socket.socket()
                s.bind((ip, port))
                socks.append(s)
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no common free port")


def wait_for(pattern, log, proc, what, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        log.seek(0)
        m = re.search(pattern, log.read())
        if m:
            return m
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start")


class Mesh:
    """Registry + image, workers, DNS, optional sidecar, and the gateway's Envoy."""

    def __init__(self, workers=3, sha256=None, plugin_overrides=None):
        self.tmp = tempfile.TemporaryDirectory(prefix="mmrouter-istio-")
        self.dir = Path(self.tmp.name)
        self.procs, self.closers = [], []
        try:
            self._start(workers, sha256, plugin_overrides or {})
        except BaseException:
            self.close()
            raise

    def _start(self, n, sha256, overrides):
        # The image, pushed to a real registry as scripts/oci-image.py does.
        self.registry = Registry()
        self.closers.append(self.registry.close)
        blobs, manifest = istio_xds.oci.wasm_image(WASM.read_bytes())
        self.image_digest = istio_xds.oci.Registry(self.registry.host).push(
            IMAGE_REPO, "test", manifest, blobs)

        # Workers: pods of the headless Service, one IP each, one port.
        ips = [f"127.0.0.{i + 2}" for i in range(n)]
        self.worker_port = common_free_port(ips)
        self.workers = {}
        for i, ip in enumerate(ips):
            log = open(self.dir / f"w{i}.log", "w+")
            p = subprocess.Popen([str(MOCK), "--host", ip, "--port", str(self.worker_port),
                                  "--name", f"w{i}", "--time-scale", "0"],
                                 stdout=subprocess.DEVNULL, stderr=log)
            self.procs.append(p)
            wait_for(r"listening on", log, p, f"mock worker w{i}")
            self.workers[f"{ip}:{self.worker_port}"] = f"w{i}"

        # The EnvoyFilter as the operator applies it, with the two values they set.
        ef = istio_xds.envoyfilter()
        ext = istio_xds.extension_config(ef)
        remote = ext["typed_config"]["config"]["vm_config"]["code"]["remote"]
        remote["http_uri"]["uri"] = f"oci://registry.example.com/{IMAGE_REPO}:test"
        remote["sha256"] = self.image_digest.split(":", 1)[1]
        plugin = json.loads(istio_xds.plugin_config(ef))
        services = {WORKERS_SERVICE: (ips, self.worker_port)}
        if SIDECAR:
            log = open(self.dir / "sidecar.log", "w+")
            workers = ",".join(f"{name}={addr}" for addr, name in self.workers.items())
            p = subprocess.Popen([SIDECAR, "--listen", "127.0.0.1:0", "--workers", workers,
                                  "--no-events"], stdout=log, stderr=subprocess.STDOUT)
            self.procs.append(p)
            m = wait_for(r"listening on [0-9.]+:(\d+)", log, p, "mmrouter-sidecar")
            services[SIDECAR_SERVICE] = (["127.0.0.1"], int(m.group(1)))
        else:
            del plugin["sidecar"]
            plugin["workers"] = [{"name": name, "address": addr} for addr, name in self.workers.items()]
            services[SIDECAR_SERVICE] = (["127.0.0.1"], free_port())  # nothing listens there
        # The tests read the decision log line (debug by default).
        plugin.update({"decision_log": "info", **overrides})
        ext["typed_config"]["config"]["configuration"]["value"] = json.dumps(plugin)

        # istio-agent's part: pull the image, check the manifest digest, extract the module.
        self.module = istio_xds.agent_pull(ext, self.registry.host)

        # istiod's part: the gateway's configuration with the EnvoyFilter applied.
        self.port, self.admin = free_port(), free_port()
        bootstrap = istio_xds.gateway_base(self.port, self.admin,
                                           [(ip, self.worker_port) for ip in ips])
        resources = istio_xds.apply_envoyfilter(ef, bootstrap)
        self.dns = istio_xds.DnsServer({k.rsplit(":", 1)[0]: v[0] for k, v in services.items()})
        self.closers.append(self.dns.close)
        istio_xds.map_services(bootstrap, services, self.dns.port)
        # The stats tags of stats-tags.yaml, as Istio merges them into the bootstrap.
        configmap = next(d for _, d in istio_xds.manifests() if d["kind"] == "ConfigMap")
        istio_xds.merge(bootstrap, json.loads(configmap["data"]["custom_bootstrap.json"]))

        # Envoy fetches the module over HTTP and checks its sha256.
        self.server = istio_xds.ModuleServer(self.module)
        self.closers.append(self.server.close)
        istio_xds.serve_module_over_http(resources[0], bootstrap, self.server.url, self.server.port,
                                         sha256 or self.server.sha256)
        ecds = self.dir / "ecds.json"
        ecds.write_text(json.dumps(istio_xds.ecds_file(resources)))
        istio_xds.ecds_from_file(bootstrap, ecds)
        config = self.dir / "envoy.json"
        config.write_text(json.dumps(bootstrap, indent=1))
        self.envoy_log = self.dir / "envoy.log"
        self.envoy = subprocess.Popen(
            [str(ENVOY), "-c", str(config), "--concurrency", "2", "--use-dynamic-base-id",
             "--log-level", "warn", "--component-log-level", "wasm:info,config:info",
             "--file-flush-interval-msec", "50", "--log-path", str(self.envoy_log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(self.envoy)
        self._wait_admin()

    def _wait_admin(self):
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/ready", timeout=1).read()
                return
            except urllib.error.HTTPError:
                return  # admin answers (503 while the listener warms)
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.envoy.poll() is not None:
                raise RuntimeError("envoy exited:\n" + self.log()[-3000:])
            time.sleep(0.1)
        raise RuntimeError("envoy admin did not come up")

    def wait_serving(self, timeout=60):
        """Until the listener serves (it warms until the filter's ECDS config is loaded)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError("gateway listener did not serve:\n" + self.log()[-3000:])

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def post(self, body, headers=None):
        req = urllib.request.Request(f"{self.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     method="POST",
                                     headers={"content-type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def admin_get(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}{path}", timeout=5) as r:
            return r.read().decode()

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
        for c in reversed(self.closers):
            c()
        self.tmp.cleanup()


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    m.wait_serving()
    yield m
    m.close()


def noise_png(width, height, seed):
    """A PNG of random pixels, stored uncompressed: about width*height*3 bytes."""
    rng = random.Random(seed)
    raw = b"".join(b"\x00" + rng.randbytes(width * 3) for _ in range(height))

    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 0)) + chunk(b"IEND", b""))


def wasm_stats(mesh):
    stats = mesh.admin_get("/stats?filter=^wasm\\.remote_load_fetch_")
    return {k.strip(): int(v) for k, v in (line.split(":") for line in stats.strip().splitlines())}


def test_agent_pull_returns_the_built_module_and_envoy_loads_it(mesh):
    assert mesh.module == WASM.read_bytes()
    assert mesh.server.gets >= 1, "Envoy fetched the module over HTTP"
    stats = wasm_stats(mesh)
    assert stats["wasm.remote_load_fetch_successes"] >= 1
    assert stats["wasm.remote_load_fetch_failures"] == 0


def test_same_image_lands_on_the_same_worker(mesh):
    # Large enough for many full KV blocks (480x360: about 220 image tokens for Qwen2.5-VL).
    image = png(480, 360, seed=11)
    first = mesh.post(chat(image))
    assert first[0] == 200, first[2][:300]
    worker = first[1]["x-mock-worker"]
    assert worker in mesh.workers.values()
    for _ in range(3):
        again = mesh.post(chat(image))
        assert again[0] == 200
        assert again[1]["x-mock-worker"] == worker
    # Envoy flushes its log every 50 ms: wait for the repeats' lines, not only the first one's.
    def full_matches():
        overlaps = re.findall(r"\[ROUTING\] Best: (\S+) with (\d+)/(\d+) blocks overlap", mesh.log())
        return overlaps, any(w == worker and int(m) > 0 and m == t for w, m, t in overlaps)

    deadline = time.time() + 5
    overlaps, found = full_matches()
    while not found and time.time() < deadline:
        time.sleep(0.1)
        overlaps, found = full_matches()
    assert found, overlaps


def test_routed_requests_go_through_the_override_host_cluster_and_are_counted(mesh):
    before = mesh.admin_get("/stats?filter=^cluster\\.mmrouter_workers\\.upstream_rq_total$")
    status, headers, _ = mesh.post(chat(png(40, 40, seed=23)))
    assert status == 200
    after = mesh.admin_get("/stats?filter=^cluster\\.mmrouter_workers\\.upstream_rq_total$")
    count = lambda text: int(text.strip().rsplit(" ", 1)[1]) if text.strip() else 0  # noqa: E731
    assert count(after) == count(before) + 1
    # STRICT_DNS found every worker behind the Service name.
    hosts = mesh.admin_get("/clusters")
    for addr in mesh.workers:
        assert f"mmrouter_workers::{addr}::" in hosts
    prom = mesh.admin_get("/stats/prometheus")
    assert re.search(r"^mmrouter_requests(\{[^}]*\})? [1-9]", prom, re.M), prom[:2000]
    # stats-tags.yaml turns the worker into a label.
    assert re.search(r'^mmrouter_routed\{worker="w\d"\} [1-9]', prom, re.M), \
        [l for l in prom.splitlines() if "mmrouter_routed" in l]


def test_requests_the_filter_does_not_route_keep_the_gateways_route(mesh):
    with urllib.request.urlopen(f"{mesh.url}/v1/models", timeout=10) as r:
        assert r.status == 200
        assert r.headers["x-mock-worker"] in mesh.workers.values()
    vllm = mesh.admin_get("/stats?filter=vllm\\.llm\\.svc\\.cluster\\.local\\.upstream_rq_total$")
    assert int(vllm.strip().rsplit(" ", 1)[1]) >= 1


def test_client_steering_header_is_stripped(mesh):
    # A client naming the admin port as its destination still reaches a worker.
    status, headers, _ = mesh.post(chat(png(32, 32, seed=5)),
                                   headers={"x-gateway-destination-endpoint": f"127.0.0.1:{mesh.admin}"})
    assert status == 200
    assert headers["x-mock-worker"] in mesh.workers.values()


def test_image_body_over_istios_default_buffer_is_routed(mesh):
    # Istio's default per-connection buffer is 1 MiB; the LISTENER patch raises it to 64 MiB.
    image = noise_png(600, 600, seed=3)
    body = chat(image)
    assert len(json.dumps(body)) > (1 << 20)
    before = mesh.admin_get("/stats?filter=^cluster\\.mmrouter_workers\\.upstream_rq_total$")
    status, headers, text = mesh.post(body)
    assert status == 200, text[:300]
    assert headers["x-mock-worker"] in mesh.workers.values()
    after = mesh.admin_get("/stats?filter=^cluster\\.mmrouter_workers\\.upstream_rq_total$")
    assert after != before, "routed by the filter, not by the gateway's own route"


def test_agent_refuses_an_image_whose_manifest_digest_differs(mesh):
    ext = copy.deepcopy(istio_xds.extension_config(istio_xds.envoyfilter()))
    remote = ext["typed_config"]["config"]["vm_config"]["code"]["remote"]
    remote["http_uri"]["uri"] = f"oci://registry.example.com/{IMAGE_REPO}:test"
    remote["sha256"] = hashlib.sha256(b"another image").hexdigest()
    with pytest.raises(ValueError, match="does not match"):
        istio_xds.agent_pull(ext, mesh.registry.host)


def test_envoy_refuses_a_module_whose_sha256_differs():
    # The same module from the same server, announced with another sha256.
    m = Mesh(workers=1, sha256=hashlib.sha256(b"not the module").hexdigest())
    try:
        m.wait_serving()
        assert m.server.gets >= 1, "Envoy fetched the module"
        stats = wasm_stats(m)
        assert stats["wasm.remote_load_fetch_successes"] == 0
        assert stats["wasm.remote_load_fetch_failures"] >= 1
        assert "Plugin mmrouter failed to load" in m.log()
        # Fail open: requests still reach a worker, through the gateway's own route, unrouted.
        status, headers, _ = m.post(chat(png(480, 360, seed=2)))
        assert status == 200
        assert m.admin_get("/stats?filter=^cluster\\.mmrouter_workers\\.upstream_rq_total$").strip() \
            .endswith(" 0")
        assert "mmrouter" not in m.admin_get("/stats?filter=^wasmcustom")
    finally:
        m.close()


@pytest.mark.skipif(not SIDECAR, reason="mmrouter-sidecar is not in this tree (MMROUTER_SIDECAR_BIN unset)")
def test_filter_reads_the_sidecars_feed_through_its_service(mesh):
    deadline = time.time() + 10
    while time.time() < deadline:
        prom = mesh.admin_get("/stats/prometheus")
        m = re.search(r"^mmrouter_feed_ok(\{[^}]*\})? (\d+)", prom, re.M)
        if m and int(m.group(2)) > 0:
            break
        time.sleep(0.2)
    assert m and int(m.group(2)) > 0, [l for l in prom.splitlines() if "feed" in l]
    polls = mesh.admin_get("/stats?filter=^cluster\\.mmrouter_sidecar\\.upstream_rq_total$")
    assert int(polls.strip().rsplit(" ", 1)[1]) > 0
