"""envoy/istio/: every manifest parses, validates against the Istio and Kubernetes schemas with
unknown fields refused, and carries a plugin configuration the filter's own parser accepts.

Schemas: the pydantic models of PyPI `cloudcoil-models-kubernetes` and
`cloudcoil-models-istio` (generated from the CRDs' OpenAPI schemas; the newest Istio models
that install on this Python are 1.24's, whose EnvoyFilter schema is the one 1.28 has),
switched to `extra="forbid"`. The Envoy side of the EnvoyFilter (patch values are free-form for
Kubernetes) is validated by Envoy itself: `envoy --mode validate` on the emulated result.
"""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
import yaml

import istio_xds
from stack import WASM

ROOT = istio_xds.ROOT
MMROUTER = os.environ.get("MMROUTER_BIN")
ENVOY = os.environ.get("ENVOY_BIN", str(ROOT / ".venv/bin/envoy"))


def _forbid_extra(*modules):
    """Turns every pydantic model of the generated modules into one that refuses unknown
    fields. Nested schemas are copied into their parents when built, so every model is rebuilt
    after all are switched, twice, so that parents pick up their rebuilt children."""
    models = [c for m in modules for c in vars(m).values()
              if isinstance(c, type) and issubclass(c, pydantic.BaseModel) and c.__module__ == m.__name__]
    for c in models:
        c.model_config["extra"] = "forbid"
    for _ in range(2):
        for c in models:
            c.model_rebuild(force=True)


def _schemas():
    from cloudcoil import apimachinery
    from cloudcoil.models.istio.networking import v1alpha3 as istio_networking
    from cloudcoil.models.kubernetes import apps, core
    _forbid_extra(apimachinery, istio_networking, apps.v1, core.v1)
    return {
        ("networking.istio.io/v1alpha3", "EnvoyFilter"): istio_networking.EnvoyFilter,
        ("apps/v1", "Deployment"): apps.v1.Deployment,
        ("v1", "Service"): core.v1.Service,
        ("v1", "ServiceAccount"): core.v1.ServiceAccount,
        ("v1", "ConfigMap"): core.v1.ConfigMap,
    }


SCHEMAS = _schemas()


def validate(doc):
    model = SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if model is None:
        raise AssertionError(f"no schema for {doc.get('apiVersion')} {doc.get('kind')}")
    return model.model_validate(doc)


def test_every_manifest_parses_and_is_listed_in_the_kustomization():
    docs = istio_xds.manifests()
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == ["ConfigMap", "Deployment", "EnvoyFilter", "Service", "Service", "ServiceAccount"]
    kustomization = yaml.safe_load((istio_xds.MANIFESTS / "kustomization.yaml").read_text())
    files = sorted(p.name for p in istio_xds.MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files


@pytest.mark.parametrize("name,doc", istio_xds.manifests(),
                         ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in istio_xds.manifests()])
def test_manifest_validates_against_its_schema(name, doc):
    validate(doc)
    assert doc["metadata"].get("namespace"), f"{name}: every object names its namespace"


def test_schema_validation_refuses_an_unknown_field():
    ef = copy.deepcopy(istio_xds.envoyfilter())
    ef["spec"]["configPatches"][0]["patchh"] = ef["spec"]["configPatches"][0].pop("patch")
    with pytest.raises(pydantic.ValidationError, match="patchh"):
        validate(ef)
    dep = copy.deepcopy(next(d for _, d in istio_xds.manifests() if d["kind"] == "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["argz"] = []
    with pytest.raises(pydantic.ValidationError, match="argz"):
        validate(dep)
    svc = copy.deepcopy(next(d for _, d in istio_xds.manifests() if d["kind"] == "Service"))
    svc["spec"]["ports"][0]["port"] = "eight thousand"
    with pytest.raises(pydantic.ValidationError):
        validate(svc)


def check_config(text, tmp_path):
    path = tmp_path / "plugin.json"
    path.write_text(text)
    cmd = [MMROUTER, "check-config", str(path)] if MMROUTER else \
        ["cargo", "run", "--quiet", "--bin", "mmrouter", "--", "check-config", str(path)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_plugin_config_passes_the_filters_own_parser(tmp_path):
    text = istio_xds.plugin_config(istio_xds.envoyfilter())
    ok = check_config(text, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok" in ok.stdout
    # The same check refuses a broken copy, naming the field.
    broken = json.loads(text)
    broken["sidecar"]["poll_ms"] = 0
    bad = check_config(json.dumps(broken), tmp_path)
    assert bad.returncode == 1
    assert "sidecar" in bad.stdout + bad.stderr


def test_plugin_config_names_clusters_the_envoyfilter_adds():
    ef = istio_xds.envoyfilter()
    plugin = json.loads(istio_xds.plugin_config(ef))
    added = {p["patch"]["value"]["name"] for p in ef["spec"]["configPatches"]
             if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "ADD"}
    assert plugin["sidecar"]["cluster"] in added
    assert plugin.get("metrics", {}).get("cluster", "mmrouter_endpoint") in added
    route = next(p["patch"]["value"] for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_ROUTE")
    assert route["route"]["cluster"] in added
    wasm = istio_xds.extension_config(ef)["typed_config"]["config"]
    assert wasm["allow_on_headers_stop_iteration"] is True
    assert wasm["failure_policy"] == "FAIL_OPEN"


def test_sidecar_and_gateway_resolve_the_same_headless_service():
    docs = [d for _, d in istio_xds.manifests()]
    svc = next(d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
    name = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert f"--dns={name}:{port}" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    workers = next(p["patch"]["value"] for p in istio_xds.envoyfilter()["spec"]["configPatches"]
                   if p["applyTo"] == "CLUSTER" and p["patch"]["value"]["name"] == "mmrouter_workers")
    sa = workers["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (sa["address"], sa["port_value"]) == (name, port)


def test_envoy_accepts_the_emulated_gateway_configuration(tmp_path):
    ef = istio_xds.envoyfilter()
    bootstrap = istio_xds.gateway_base(10000, 10001, [("127.0.0.1", 8000)])
    ecds = istio_xds.apply_envoyfilter(ef, bootstrap)
    istio_xds.ecds_from_file(bootstrap, tmp_path / "ecds.yaml")
    (tmp_path / "ecds.yaml").write_text(json.dumps(istio_xds.ecds_file(ecds)))
    istio_xds.map_services(bootstrap, {
        "vllm-workers.llm.svc.cluster.local:8000": (["127.0.0.1"], 8000),
        "mmrouter-sidecar.istio-system.svc.cluster.local:9902": (["127.0.0.1"], 9902),
    }, 53)
    (tmp_path / "envoy.json").write_text(json.dumps(bootstrap))
    # --mode validate checks the bootstrap (listeners, routes, clusters, the patches in them);
    # the ECDS resource is checked by the same Envoy when it loads it in test_istio.py, and
    # here as a static filter of the same type.
    out = subprocess.run([ENVOY, "--mode", "validate", "-c", str(tmp_path / "envoy.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    wasm = copy.deepcopy(ecds[0])
    wasm["typed_config"]["config"]["vm_config"]["code"] = {"local": {"filename": str(WASM)}}
    static = istio_xds.gateway_base(10000, 10001, [("127.0.0.1", 8000)])
    hcm = static["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, wasm)
    (tmp_path / "static.json").write_text(json.dumps(static))
    out = subprocess.run([ENVOY, "--mode", "validate", "-c", str(tmp_path / "static.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # And an unknown field in a patch is refused by Envoy.
    bad = copy.deepcopy(bootstrap)
    bad["static_resources"]["clusters"][-1]["dns_refresh_ratee"] = "1s"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    out = subprocess.run([ENVOY, "--mode", "validate", "-c", str(tmp_path / "bad.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "dns_refresh_ratee" in out.stdout + out.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
