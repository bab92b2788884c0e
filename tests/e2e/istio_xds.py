"""What istiod and istio-agent would give the gateway's Envoy for envoy/istio/, emulated.

Real here: Envoy 1.40 and everything it does with the result (the ECDS resource, the
remote code fetch and its sha256 check, the patched listener, routes and clusters, STRICT_DNS
resolution, override_host), the OCI registry and the image in it, the mock workers, the sidecar.

Emulated:
- istiod: `gateway_base` stands for the gateway configuration istiod generates before
  EnvoyFilters (a listener whose route sends the LLM host to the vLLM Service's cluster, with
  the stock-Envoy part of Istio's gateway filter chain: CORS, fault, router; Istio's own
  istio_authn and istio.stats filters are not in stock Envoy). `apply_envoyfilter` applies the
  patches with Istio's semantics for the operations the manifests use. xDS goes through a file
  (ECDS, `path_config_source`) and static resources instead of ADS over gRPC.
- istio-agent: `agent_pull` pulls the OCI image from the registry and checks the manifest
  digest against the EnvoyFilter's `sha256`, as the agent's Wasm cache does; the agent would then
  hand Envoy a local file. Here Envoy fetches the extracted module itself over HTTP from a
  loopback server and verifies its sha256 (Envoy's `remote` code source).
- Kubernetes: Service DNS names resolve through a small DNS server on loopback (one A record
  per worker, all on one port, like a headless Service); Service ports are mapped to the test's
  free ports.
"""
import copy
import hashlib
import importlib.util
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "envoy/istio"
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"
# The cluster istiod builds for the vLLM Service that the gateway's VirtualService targets.
VLLM_SERVICE_CLUSTER = "outbound|8000||vllm.llm.svc.cluster.local"

_spec = importlib.util.spec_from_file_location("oci_image", ROOT / "scripts/oci-image.py")
oci = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oci)


def manifests():
    """Every (file name, document) under envoy/istio/ except the kustomization."""
    out = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def envoyfilter():
    found = [d for _, d in manifests() if d.get("kind") == "EnvoyFilter"]
    assert len(found) == 1, f"expected one EnvoyFilter, found {len(found)}"
    return found[0]


def extension_config(ef):
    """The Wasm ECDS resource the EnvoyFilter adds."""
    for p in ef["spec"]["configPatches"]:
        if p["applyTo"] == "EXTENSION_CONFIG":
            return p["patch"]["value"]
    raise AssertionError("no EXTENSION_CONFIG patch")


def plugin_config(ef):
    """The filter's JSON plugin configuration, as text."""
    return extension_config(ef)["typed_config"]["config"]["configuration"]["value"]


def gateway_base(listen_port, admin_port, service_endpoints):
    """The gateway's Envoy configuration before EnvoyFilter patches (see the module doc)."""
    return {
        # Istio names every proxy; ECDS subscriptions need a node id and cluster.
        "node": {"id": "router~127.0.0.1~istio-ingressgateway-0.istio-system~istio-system.svc.cluster.local",
                 "cluster": "istio-ingressgateway.istio-system"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "0.0.0.0_8080",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                "filter_chains": [{"filters": [{
                    "name": HCM,
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "outbound_0.0.0.0_8080",
                        "use_remote_address": True,
                        "route_config": {
                            "name": "http.8080",
                            "virtual_hosts": [{
                                "name": "*:80",
                                "domains": ["*"],
                                "routes": [{
                                    "name": "vllm",
                                    "match": {"prefix": "/"},
                                    "route": {"cluster": VLLM_SERVICE_CLUSTER, "timeout": "0s"},
                                }],
                            }],
                        },
                        "http_filters": [
                            {"name": "envoy.filters.http.cors", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}},
                            {"name": "envoy.filters.http.fault", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"}},
                            {"name": ROUTER, "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
                        ],
                    },
                }]}],
            }],
            "clusters": [{
                "name": VLLM_SERVICE_CLUSTER,
                "type": "STATIC",
                "lb_policy": "LEAST_REQUEST",
                "connect_timeout": "10s",
                "load_assignment": {"cluster_name": VLLM_SERVICE_CLUSTER, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": ip, "port_value": port}}}}
                    for ip, port in service_endpoints]}]},
            }],
        },
    }


def merge(dst, src):
    """Protobuf merge of JSON-shaped values: messages merge, repeated fields append."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k].extend(copy.deepcopy(v))
        else:
            dst[k] = copy.deepcopy(v)


def _listener_matches(listener, match):
    lm = match.get("listener", {})
    if "name" in lm and lm["name"] != listener["name"]:
        return False
    if "portNumber" in lm and lm["portNumber"] != listener["address"]["socket_address"]["port_value"]:
        return False
    return True


def _hcms(listener, match):
    fm = match.get("listener", {}).get("filterChain", {}).get("filter", {})
    for chain in listener["filter_chains"]:
        for f in chain["filters"]:
            if f["name"] == HCM and fm.get("name", HCM) == HCM:
                yield f["typed_config"], fm.get("subFilter", {}).get("name")


def apply_envoyfilter(ef, bootstrap):
    """Applies the EnvoyFilter's patches to `bootstrap` the way istiod does for a gateway
    proxy, for the (applyTo, operation) pairs the manifests use; anything else is an error, so
    a manifest change this emulation does not know fails the tests. Returns the ECDS
    resources the EnvoyFilter adds."""
    ecds = []
    res = bootstrap["static_resources"]
    for p in ef["spec"]["configPatches"]:
        apply_to, op = p["applyTo"], p["patch"]["operation"]
        value, match = p["patch"].get("value", {}), p.get("match", {})
        assert match.get("context", "ANY") in ("ANY", "GATEWAY"), match
        if apply_to == "EXTENSION_CONFIG" and op == "ADD":
            ecds.append(copy.deepcopy(value))
        elif apply_to == "CLUSTER" and op == "ADD":
            res["clusters"].append(copy.deepcopy(value))
        elif apply_to == "LISTENER" and op == "MERGE":
            for listener in res["listeners"]:
                if _listener_matches(listener, match):
                    merge(listener, value)
        elif apply_to == "HTTP_FILTER" and op in ("INSERT_FIRST", "INSERT_BEFORE"):
            for listener in res["listeners"]:
                if not _listener_matches(listener, match):
                    continue
                for hcm, sub in _hcms(listener, match):
                    filters = hcm["http_filters"]
                    at = 0
                    if op == "INSERT_BEFORE":
                        at = next(i for i, f in enumerate(filters) if f["name"] == sub)
                    filters.insert(at, copy.deepcopy(value))
        elif apply_to == "HTTP_ROUTE" and op == "INSERT_FIRST":
            assert "routeConfiguration" not in match, "route matches are not emulated"
            for listener in res["listeners"]:
                for hcm, _ in _hcms(listener, {}):
                    for vhost in hcm["route_config"]["virtual_hosts"]:
                        vhost["routes"].insert(0, copy.deepcopy(value))
        else:
            raise NotImplementedError(f"{apply_to} {op} is not emulated")
    return ecds


def ecds_from_file(bootstrap, ecds_path):
    """Points every ADS config_discovery at a file: the ECDS resources istiod would send."""
    for listener in bootstrap["static_resources"]["listeners"]:
        for hcm, _ in _hcms(listener, {}):
            for f in hcm["http_filters"]:
                source = f.get("config_discovery", {}).get("config_source")
                if source is not None and "ads" in source:
                    del source["ads"]
                    source["path_config_source"] = {"path": str(ecds_path)}


def ecds_file(resources):
    return {
        "version_info": "1",
        "resources": [{"@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig", **r}
                      for r in resources],
    }


def map_services(bootstrap, services, dns_port):
    """Kubernetes emulation: STRICT_DNS clusters on a Service name `name:port` in `services`
    get the test's port for it and resolve through the loopback DNS server."""
    for c in bootstrap["static_resources"]["clusters"]:
        if c.get("type") != "STRICT_DNS":
            continue
        for group in c["load_assignment"]["endpoints"]:
            for e in group["lb_endpoints"]:
                sa = e["endpoint"]["address"]["socket_address"]
                key = f"{sa['address']}:{sa['port_value']}"
                if key not in services:
                    raise AssertionError(f"cluster {c['name']}: no emulated Service for {key}")
                sa["port_value"] = services[key][1]
        c["typed_dns_resolver_config"] = {
            "name": "envoy.network.dns_resolver.cares",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
                "resolvers": [{"socket_address": {"address": "127.0.0.1", "port_value": dns_port,
                                                  "protocol": "UDP"}}],
                "dns_resolver_options": {"no_default_search_domain": True},
            },
        }


def agent_pull(ecds_resource, registry_host):
    """The agent's part for an oci:// url: pull the image (the url's registry is replaced by
    the loopback one), check its manifest digest against `sha256`, extract the module."""
    remote = ecds_resource["typed_config"]["config"]["vm_config"]["code"]["remote"]
    url = remote["http_uri"]["uri"]
    assert url.startswith("oci://"), url
    _, repo, reference = oci.parse_ref(url)
    digest, manifest, blobs = oci.pull(f"{registry_host}/{repo}:{reference}")
    if digest != "sha256:" + remote["sha256"]:
        raise ValueError(f"module downloaded from {url} has checksum {digest}, which does not "
                         f"match: {remote['sha256']}")
    return oci.wasm_module(manifest, blobs)


def serve_module_over_http(ecds_resource, bootstrap, url, cluster_port, sha256):
    """Envoy fetches the module itself: a remote code source on a loopback URL, with the
    sha256 Envoy verifies, through a static cluster."""
    code = ecds_resource["typed_config"]["config"]["vm_config"]["code"]
    code["remote"] = {
        "http_uri": {"uri": url, "cluster": "mmrouter_wasm_fetch", "timeout": "10s"},
        "sha256": sha256,
        "retry_policy": {"num_retries": 1},
    }
    bootstrap["static_resources"]["clusters"].append({
        "name": "mmrouter_wasm_fetch",
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": "mmrouter_wasm_fetch", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                         "port_value": cluster_port}}}}]}]},
    })


class ModuleServer:
    """Serves one file over HTTP on loopback; counts GETs."""

    def __init__(self, data):
        self.gets = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.gets += 1
                self.send_response(200)
                self.send_header("content-type", "application/wasm")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.sha256 = hashlib.sha256(data).hexdigest()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/mmrouter/plugin.wasm"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class DnsServer:
    """Answers A queries for the names it holds (one record per address, TTL 1 s), an empty
    answer for their other types, NXDOMAIN otherwise: a headless Service's DNS."""

    def __init__(self, records):
        self.records = {k.lower().rstrip("."): list(v) for k, v in records.items()}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(0.2)
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while self.running:
            try:
                query, addr = self.sock.recvfrom(512)
            except (socket.timeout, OSError):
                continue
            answer = self._answer(query)
            if answer:
                self.sock.sendto(answer, addr)

    def _answer(self, q):
        if len(q) < 12:
            return None
        qid, _flags, qdcount = struct.unpack(">HHH", q[:6])
        if qdcount != 1:
            return None
        labels, i = [], 12
        while i < len(q) and q[i] != 0:
            n = q[i]
            labels.append(q[i + 1:i + 1 + n].decode("ascii", "replace"))
            i += 1 + n
        question_end = i + 5
        if question_end > len(q):
            return None
        qtype = struct.unpack(">H", q[i + 1:i + 3])[0]
        name = ".".join(labels).lower()
        ips = self.records.get(name)
        rcode = 0 if ips is not None else 3
        answers = b""
        count = 0
        if ips and qtype == 1:
            for ip in ips:
                answers += struct.pack(">HHHIH", 0xC00C, 1, 1, 1, 4) + socket.inet_aton(ip)
                count += 1
        header = struct.pack(">HHHHHH", qid, 0x8400 | 0x0100 | 0x0080 | rcode, 1, count, 0, 0)
        return header + q[12:question_end] + answers

    def close(self):
        self.running = False
        self.thread.join(timeout=2)
        self.sock.close()
