#!/usr/bin/env python3
"""Renders the Envoy configuration for mmrouter in front of N workers.

    envoy/render.py --workers 127.0.0.1:8001,127.0.0.1:8002 --wasm target/.../mmrouter.wasm
                    [--port 10000] [--admin-port 9901] [--names w0,w1] [--router-config FILE]
                    [--upstream override-host|original-dst] [--out envoy.yaml]

The output is a complete static Envoy bootstrap (Envoy >= 1.35 for
allow_on_headers_stop_iteration and the override_host load-balancing policy; tested with 1.40):

- listener on 127.0.0.1:PORT with a 64 MiB per-connection buffer (image bodies are large; a
  body over it gets Envoy's 413);
- HTTP filters: header_mutation strips client steering headers even if the Wasm VM is down,
  then the mmrouter Wasm filter (V8), then the router;
- routes: a request carrying x-gateway-destination-endpoint (set only by the filter) goes to the
  `mmrouter_workers` cluster; everything else (GET /v1/models, /health, ...) goes to the
  round-robin `workers` cluster;
- upstream (`--upstream`):
  - `override-host` (default): `mmrouter_workers` holds the workers and uses Envoy's
    override_host load-balancing policy on the header; the filter writes the chosen worker and
    the next-best two (`retry_alternates: 2`), so a retry on connect failure or reset goes to
    the next-best worker the filter ranked. Outlier detection ejects a worker that keeps
    failing; circuit breakers are sized for long-lived LLM streams;
  - `original-dst`: an ORIGINAL_DST cluster connects to exactly the one address in the header
    (any address the filter learns, no cluster membership needed, no retry elsewhere);
- with `--sidecar HOST:PORT` the filter follows mmrouter-sidecar's feed (membership, engine
  metrics, KV events), and with `--eds-file PATH` the workers cluster takes its members from the
  EDS file the sidecar writes, so workers join and leave without an Envoy restart;
- image fetches (`fetch` in the filter configuration, see README "Images by URL"): the filter
  GETs an image through `mmrouter_fetch` (ORIGINAL_DST to the `ip:port` in
  `x-mmrouter-fetch-address`, set only by the filter's own calls) when the URL names an IP
  address, through `mmrouter_fetch_dns` (Envoy's dynamic forward proxy, its own DNS cache) when
  it names a host allowed by an exact entry, through `mmrouter_fetch_guard` when a host is
  allowed only by a wildcard: an internal listener that resolves the name (the dynamic forward
  proxy filter, the same DNS cache), refuses with RBAC an address in SPECIAL_RANGES (read from
  src/filter/fetch/guard.rs) unless an exact address/CIDR entry of fetch.allow holds it, marks
  that 403 with x-mmrouter-fetch-refused, and routes to `mmrouter_fetch_dns`; `_tls` variants
  for https (SNI and certificate checked against the host). `--fetch-dns-resolver IP:PORT`
  makes the fetches' DNS cache ask only that server.
  Redirects are never followed by Envoy (the filter decides, `fetch.max_redirects`). Envoy
  buffers a call's whole response: `fetch.max_bytes` bounds what the filter reads, not what
  Envoy receives. `--fetch-allow` adds host patterns to `fetch.allow` (and turns fetching on);
- timeouts fit long generations: no route timeout, a 300 s stream idle timeout;
- stats_tags turn the filter's metric names into Prometheus labels (worker, reason);
- admin on 127.0.0.1:ADMIN_PORT.
Only the Python standard library is used.
"""
import argparse
import ipaddress
import json
import os
import re
import sys

BUFFER_LIMIT = 64 << 20


WASM_FILTER = """          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: mmrouter
                root_id: mmrouter
                # The filter pauses at headers and decides on the body: without this Envoy
                # would never call on_http_request_body after the pause.
                allow_on_headers_stop_iteration: true
                # A crashed VM is reloaded instead of failing every request after it.
                failure_policy: FAIL_RELOAD
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: {value}
                vm_config:
                  vm_id: mmrouter
                  runtime: envoy.wasm.runtime.v8
                  code:
                    local:
                      filename: {filename}
"""


# Retries go to the next address the filter listed (override_host), on failures that mean no
# working engine answered: connect failure, refused stream, and a reset before any response
# (`reset`: an engine that crashed with the request in flight; Envoy retries only while no
# response header has gone downstream, so a stream already answering is never replayed). Not
# on 5xx: an engine that answered has done work.
RETRY_POLICY = """                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset
                    num_retries: 2
                    per_try_timeout: 0s"""

# Sized for LLM streams: thousands of concurrent, minutes-long requests per Envoy (the
# default of 1,024 concurrent requests per cluster would refuse the 1,025th stream).
CIRCUIT_BREAKERS = """    circuit_breakers:
      thresholds:
      - priority: DEFAULT
        max_connections: 100000
        max_pending_requests: 100000
        max_requests: 100000
        max_retries: 1000"""

OUTLIER_DETECTION = """    outlier_detection:
      # Connection failures and resets (local origin) eject fast; 5xx from the engine slower.
      split_external_local_origin_errors: true
      consecutive_local_origin_failure: 2
      consecutive_gateway_failure: 3
      consecutive_5xx: 10
      interval: 1s
      base_ejection_time: 5s
      max_ejection_percent: 50"""


# The clusters the filter's image fetches go through (see the module docs).
FETCH_BUFFER_LIMIT = 32 << 20
TLS_SOCKET = """    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          validation_context:
            trusted_ca: {{ filename: /etc/ssl/certs/ca-certificates.crt }}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        upstream_http_protocol_options: {{ auto_sni: true, auto_san_validation: true }}
        explicit_http_config: {{ http_protocol_options: {{}} }}
"""


GUARD_RS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "filter",
                        "fetch", "guard.rs")
REFUSED_HEADER = "x-mmrouter-fetch-refused"
REFUSED_REASON = "resolved_special_address"


def special_ranges(path=GUARD_RS):
    """SPECIAL_RANGES of src/filter/fetch/guard.rs (the one list the filter's literal check and
    the guard listener's check of resolved addresses share), as ipaddress networks."""
    with open(path) as f:
        text = f.read()
    m = re.search(r"pub const SPECIAL_RANGES: \[&str; (\d+)\] = \[(.*?)\];", text, re.S)
    if not m:
        raise SystemExit(f"render.py: SPECIAL_RANGES not found in {path}")
    ranges = [ipaddress.ip_network(r) for r in re.findall(r'"([^"]+)"', m.group(2))]
    if len(ranges) != int(m.group(1)):
        raise SystemExit(f"render.py: SPECIAL_RANGES of {path}: {len(ranges)} ranges read, "
                         f"{m.group(1)} declared")
    return ranges


def allowed_addresses(allow):
    """The exact address and CIDR entries of fetch.allow (what the guard calls an explicit
    allowance of an address), as (network, port): port None for `:*`, "default" without a port.
    Names, `*` and `*.suffix` entries allow no address."""
    out = []
    for entry in allow:
        entry = entry.strip().lower()
        if entry.startswith("["):
            host, _, after = entry[1:].partition("]")
            port = after[1:] if after.startswith(":") else None
        elif entry.count(":") > 1:
            host, port = entry, None
        elif ":" in entry:
            host, port = entry.rsplit(":", 1)
        else:
            host, port = entry, None
        try:
            network = ipaddress.ip_network(host, strict=False)
        except ValueError:
            continue
        out.append((network, "default" if port is None else None if port == "*" else int(port)))
    return out


def dns_cache_config(tls, dns_resolver=None):
    """The DNS cache of the dynamic forward proxy (cluster and guard listener filter share it:
    the same name must have the same configuration). With `dns_resolver` (ip:port) c-ares asks
    only that server."""
    config = {"name": "mmrouter_fetch" + ("_tls" if tls else ""),
              "dns_lookup_family": "V4_PREFERRED", "max_hosts": 1024}
    if dns_resolver:
        host, port = dns_resolver.rsplit(":", 1)
        config["typed_dns_resolver_config"] = {
            "name": "envoy.network.dns_resolver.cares",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3"
                         ".CaresDnsResolverConfig",
                "resolvers": [{"socket_address": {"address": host.strip("[]"),
                                                  "port_value": int(port)}}],
                "dns_resolver_options": {"no_default_search_domain": True}}}
    return json.dumps(config)


def upstream_ip(network, port=None):
    """An RBAC permission on the address the dynamic forward proxy filter resolved."""
    matcher = {"upstream_ip": {"address_prefix": str(network.network_address),
                               "prefix_len": network.prefixlen}}
    if port is not None:
        matcher["upstream_port_range"] = {"start": port, "end": port}
    return {"matcher": {
        "name": "envoy.rbac.matchers.upstream_ip_port",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.rbac.matchers.upstream_ip_port.v3"
                     ".UpstreamIpPortMatcher", **matcher}}}


def guard_rbac(allow, default_port):
    """The guard listener's RBAC: ALLOW only a stream whose name resolved (the filter state the
    dynamic forward proxy filter saved is there: fail closed without it) to an address outside
    SPECIAL_RANGES, or inside an exact address/CIDR entry of fetch.allow on its port."""
    exceptions = [upstream_ip(n, default_port if p == "default" else p)
                  for n, p in allowed_addresses(allow)]
    resolved = {"or_rules": {"rules": [upstream_ip(ipaddress.ip_network("0.0.0.0/0")),
                                       upstream_ip(ipaddress.ip_network("::/0"))]}}
    special = {"or_rules": {"rules": [upstream_ip(n) for n in special_ranges()]}}
    return json.dumps({"action": "ALLOW", "policies": {"resolved_public_or_allowed": {
        "permissions": [{"and_rules": {"rules": [
            resolved, {"or_rules": {"rules": [{"not_rule": special}, *exceptions]}}]}}],
        "principals": [{"any": True}]}}})


def fetch_guard(allow, dns_resolver=None):
    """The guard listeners (internal listeners, no socket) and the clusters that reach them: the
    filter sends a name allowed only by a wildcard there. Each resolves the name with the dynamic
    forward proxy filter (the DNS cache of the `_dns` cluster), refuses a special-use address
    with RBAC (a 403 marked with REFUSED_HEADER by local_reply_config), and routes to the `_dns`
    cluster, which connects to the address that was checked (the same cache entry)."""
    listeners, clusters = [], []
    for tls in (False, True):
        suffix = "_tls" if tls else ""
        name = f"mmrouter_fetch_guard{suffix}"
        listeners.append(f"""  - name: {name}
    internal_listener: {{}}
    per_connection_buffer_limit_bytes: {FETCH_BUFFER_LIMIT}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          # The filter's own timeout bounds each GET; nothing shorter here.
          stream_idle_timeout: 0s
          local_reply_config:
            mappers:
            # Only local replies are mapped: an image server's 403 passes unmarked. The only
            # local 403 here is RBAC's (the dynamic forward proxy's own failures are 503s).
            - filter:
                status_code_filter:
                  comparison:
                    op: EQ
                    value: {{ default_value: 403, runtime_key: mmrouter_fetch_guard.refused_status }}
              headers_to_add:
              - header: {{ key: {REFUSED_HEADER}, value: {REFUSED_REASON} }}
                append_action: OVERWRITE_IF_EXISTS_OR_ADD
          route_config:
            name: {name}
            virtual_hosts:
            - name: fetch
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: mmrouter_fetch_dns{suffix}, timeout: 0s }}
          http_filters:
          # Resolves the name (the request pauses until it is), saves the address.
          - name: envoy.filters.http.dynamic_forward_proxy
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_forward_proxy.v3.FilterConfig
              save_upstream_address: true
              dns_cache_config: {dns_cache_config(tls, dns_resolver)}
          - name: envoy.filters.http.rbac
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC
              rules: {guard_rbac(allow, 443 if tls else 80)}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
""")
        clusters.append(f"""  - name: {name}
    connect_timeout: 2s
    per_connection_buffer_limit_bytes: {FETCH_BUFFER_LIMIT}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              envoy_internal_address: {{ server_listener_name: {name} }}
""")
    return "".join(listeners), "".join(clusters)


def fetch_clusters(dns_resolver=None):
    out = []
    for tls in (False, True):
        suffix = "_tls" if tls else ""
        socket = TLS_SOCKET.format() if tls else ""
        out.append(f"""  - name: mmrouter_fetch{suffix}
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    per_connection_buffer_limit_bytes: {FETCH_BUFFER_LIMIT}
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-mmrouter-fetch-address
{socket}  - name: mmrouter_fetch_dns{suffix}
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    per_connection_buffer_limit_bytes: {FETCH_BUFFER_LIMIT}
    cluster_type:
      name: envoy.clusters.dynamic_forward_proxy
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.clusters.dynamic_forward_proxy.v3.ClusterConfig
        dns_cache_config: {dns_cache_config(tls, dns_resolver)}
{socket}""")
    return "".join(out)


def endpoints_yaml(workers, indent="        "):
    return "\n".join(
        f"""{indent}- endpoint:
{indent}    address:
{indent}      socket_address: {{ address: {a.rsplit(':', 1)[0].strip('[]')}, port_value: {a.rsplit(':', 1)[1]} }}"""
        for a in workers
    )


def workers_cluster(upstream, workers, eds_file=None):
    """The cluster the filter's header selects a worker in. With `eds_file` its members come
    from that file (written by mmrouter-sidecar --eds-file, watched by Envoy)."""
    if upstream == "original-dst":
        return f"""  # Connects to whatever ip:port the filter put in x-gateway-destination-endpoint; the filter
  # only ever writes the workers' addresses, and client copies are stripped above.
  - name: mmrouter_workers
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    per_connection_buffer_limit_bytes: {BUFFER_LIMIT}
{CIRCUIT_BREAKERS}
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
"""
    members = members_yaml(workers, eds_file)
    return f"""  # The workers, selected by the filter's header (override_host): the first address, then
  # the next ones on retries; with no usable address, least-request among them.
  - name: mmrouter_workers
    connect_timeout: 2s
    per_connection_buffer_limit_bytes: {BUFFER_LIMIT}
{CIRCUIT_BREAKERS}
{OUTLIER_DETECTION}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest
{members}
"""


def members_yaml(workers, eds_file):
    if eds_file:
        directory = os.path.dirname(os.path.abspath(eds_file))
        return f"""    type: EDS
    eds_cluster_config:
      eds_config:
        resource_api_version: V3
        path_config_source:
          path: {json.dumps(os.path.abspath(eds_file))}
          watched_directory: {{ path: {json.dumps(directory)} }}"""
    return f"""    type: STATIC
    load_assignment:
      cluster_name: mmrouter_workers
      endpoints:
      - lb_endpoints:
{endpoints_yaml(workers)}"""


def eds_resource(workers, version="0"):
    """The EDS file's content for `workers` (what mmrouter-sidecar --eds-file writes)."""
    return {
        "version_info": version,
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": "mmrouter_workers",
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {
                    "address": a.rsplit(":", 1)[0].strip("[]"),
                    "port_value": int(a.rsplit(":", 1)[1])}}}}
                for a in workers]}],
        }],
    }


SIDECAR_CLUSTER = """  # mmrouter-sidecar: the filter's state writer polls its feed (GET /v1/feed).
  - name: mmrouter_sidecar
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: mmrouter_sidecar
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: {host}, port_value: {port} }}
"""


def render(workers, names, wasm, port, admin_port, router_config, with_filter=True,
           upstream="override-host", sidecar=None, eds_file=None, fetch_dns_resolver=None):
    """The bootstrap YAML. With with_filter=False the Wasm filter is left out: nothing sets the
    destination header, so every request takes the round-robin route (a baseline to compare
    against, same listener, buffers and clusters)."""
    plugin = {}
    if upstream == "override-host":
        plugin["retry_alternates"] = 2
    if sidecar:
        # Workers come from the sidecar's feed; the static list seeds the state until then.
        plugin["sidecar"] = {"cluster": "mmrouter_sidecar", "authority": "mmrouter-sidecar"}
    plugin.update(router_config)
    plugin["workers"] = [{"name": n, "address": a} for n, a in zip(names, workers)]
    plugin_json = json.dumps(plugin, separators=(",", ":"))
    wasm_filter = (
        WASM_FILTER.format(value=json.dumps(plugin_json), filename=json.dumps(wasm))
        if with_filter else ""
    )
    endpoints = endpoints_yaml(workers)
    sidecar_cluster = ""
    if sidecar:
        sidecar_host, sidecar_port = sidecar.rsplit(":", 1)
        sidecar_cluster = SIDECAR_CLUSTER.format(host=sidecar_host.strip("[]"), port=sidecar_port)
    guard_listeners, guard_clusters = fetch_guard(
        (plugin.get("fetch") or {}).get("allow") or ["*"], fetch_dns_resolver)
    return f"""# Generated by envoy/render.py: mmrouter in front of {len(workers)} worker(s).
# xDS from files (the workers' EDS file) needs a node identity.
node: {{ id: mmrouter, cluster: mmrouter }}
# The image fetches' guard listeners are internal listeners (no socket).
bootstrap_extensions:
- name: envoy.bootstrap.internal_listener
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener
admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}

stats_config:
  stats_tags:
  # proxy-wasm metrics have no tags: the filter names them mmrouter.routed.<worker> and
  # mmrouter.fallback.<reason>; these turn the last part into a Prometheus label.
  - tag_name: worker
    regex: '^wasmcustom\\.mmrouter\\.routed(\\.([^.]+))$'
  - tag_name: reason
    regex: '^wasmcustom\\.mmrouter\\.fallback(\\.([^.]+))$'

static_resources:
  listeners:
  - name: mmrouter
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {port} }}
    per_connection_buffer_limit_bytes: {BUFFER_LIMIT}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: mmrouter
          # LLM answers stream for minutes: no overall limit, but a stream silent for 5 min ends.
          stream_idle_timeout: 300s
          request_timeout: 300s
          route_config:
            name: llm
            virtual_hosts:
            - name: llm
              domains: ["*"]
              routes:
              - match:
                  prefix: "/"
                  headers:
                  - name: x-gateway-destination-endpoint
                    present_match: true
                route:
                  cluster: mmrouter_workers
                  timeout: 0s
{RETRY_POLICY}
              - match: {{ prefix: "/" }}
                route: {{ cluster: workers, timeout: 0s }}
          http_filters:
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
                - remove: x-gateway-destination-endpoint
                - remove: x-envoy-original-dst-host
{wasm_filter}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
{guard_listeners}
  clusters:
{workers_cluster(upstream, workers, eds_file)}{sidecar_cluster}
{fetch_clusters(fetch_dns_resolver)}{guard_clusters}  # The filter's own /metrics polls of each worker: to exactly the address in the header.
  - name: mmrouter_endpoint
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
  # Everything the filter does not route (model list, health, other paths).
  - name: workers
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
    per_connection_buffer_limit_bytes: {BUFFER_LIMIT}
    load_assignment:
      cluster_name: workers
      endpoints:
      - lb_endpoints:
{endpoints}
"""


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", required=True, help="comma-separated ip:port list")
    p.add_argument("--names", help="comma-separated worker names (default w0, w1, ...)")
    p.add_argument("--wasm", default="", help="path of mmrouter.wasm (required unless --no-filter)")
    p.add_argument("--port", type=int, default=10000)
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--router-config", help="JSON file merged into the plugin configuration")
    p.add_argument("--no-filter", action="store_true",
                   help="leave the mmrouter filter out: plain round robin (a baseline)")
    p.add_argument("--upstream", choices=["override-host", "original-dst"], default="override-host",
                   help="how the filter's header selects a worker (see the module docs)")
    p.add_argument("--sidecar", metavar="HOST:PORT",
                   help="mmrouter-sidecar's address: the filter follows its feed (precise mode)")
    p.add_argument("--eds-file", metavar="PATH",
                   help="the workers cluster reads its members from this EDS file (written by "
                        "mmrouter-sidecar --eds-file); written from --workers if missing")
    p.add_argument("--fetch-allow", metavar="PATTERNS",
                   help="comma-separated host or host:port patterns added to the filter's "
                        "fetch.allow (turns fetching on), e.g. 127.0.0.1:8765")
    p.add_argument("--fetch-dns-resolver", metavar="IP:PORT",
                   help="the DNS server the image fetches' dynamic forward proxy asks (c-ares, "
                        "that server only; default: the system's resolvers)")
    p.add_argument("--out", help="output file (default stdout)")
    a = p.parse_args(argv)
    workers = [w.strip() for w in a.workers.split(",") if w.strip()]
    names = [n.strip() for n in a.names.split(",")] if a.names else [f"w{i}" for i in range(len(workers))]
    if not a.no_filter and not a.wasm:
        p.error("--wasm is required unless --no-filter")
    if len(names) != len(workers):
        p.error("--names must list one name per worker")
    router_config = {}
    if a.router_config:
        with open(a.router_config) as f:
            router_config = json.load(f)
    extra_allow = [x.strip() for x in (a.fetch_allow or "").split(",") if x.strip()]
    if extra_allow:
        fetch = dict(router_config.get("fetch") or {})
        fetch["enabled"] = True
        fetch["allow"] = list(fetch.get("allow") or ["*"]) + extra_allow
        router_config["fetch"] = fetch
    if a.eds_file and not os.path.exists(a.eds_file):
        os.makedirs(os.path.dirname(os.path.abspath(a.eds_file)), exist_ok=True)
        with open(a.eds_file, "w") as f:
            json.dump(eds_resource(workers), f)
    text = render(workers, names, a.wasm, a.port, a.admin_port, router_config,
                  with_filter=not a.no_filter, upstream=a.upstream, sidecar=a.sidecar,
                  eds_file=a.eds_file, fetch_dns_resolver=a.fetch_dns_resolver)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
