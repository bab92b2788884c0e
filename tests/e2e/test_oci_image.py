"""scripts/oci-image.py: the filter's Wasm image (Istio's compat variant) and the sidecar's
image, written as OCI layouts without a container daemon, pushed to a real registry on
loopback (Debian's docker-registry) and pulled back."""
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

import istio_xds
from registry import Registry
from stack import WASM

SCRIPT = str(istio_xds.ROOT / "scripts/oci-image.py")
SIDECAR_STATIC = os.environ.get("MMROUTER_SIDECAR_STATIC", "")
oci = istio_xds.oci


def run(*args):
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="module")
def registry():
    r = Registry()
    yield r
    r.close()


def blob(layout, digest):
    return (layout / "blobs" / "sha256" / digest.split(":", 1)[1]).read_bytes()


def test_wasm_layout_is_istios_compat_variant(tmp_path):
    digest = run("wasm", "--wasm", str(WASM), "--out", str(tmp_path / "img"), "--tag", "v1")
    layout = tmp_path / "img"
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout / "index.json").read_text())
    assert [m["digest"] for m in index["manifests"]] == [digest]
    manifest_bytes = blob(layout, digest)
    assert "sha256:" + hashlib.sha256(manifest_bytes).hexdigest() == digest
    manifest = json.loads(manifest_bytes)
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert manifest["annotations"]["module.wasm.image/variant"] == "compat"
    assert [l["mediaType"] for l in manifest["layers"]] == ["application/vnd.oci.image.layer.v1.tar+gzip"]
    layer = blob(layout, manifest["layers"][0]["digest"])
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer))) as tar:
        assert tar.getnames() == ["plugin.wasm"]
        assert tar.extractfile("plugin.wasm").read() == WASM.read_bytes()
    config = json.loads(blob(layout, manifest["config"]["digest"]))
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest()]


def test_wasm_image_is_reproducible(tmp_path):
    a = run("wasm", "--wasm", str(WASM), "--out", str(tmp_path / "a"))
    b = run("wasm", "--wasm", str(WASM), "--out", str(tmp_path / "b"))
    assert a == b


def test_wasm_image_refuses_a_file_that_is_not_wasm(tmp_path):
    (tmp_path / "x").write_bytes(b"#!/bin/sh\n")
    out = subprocess.run([sys.executable, SCRIPT, "wasm", "--wasm", str(tmp_path / "x"), "--out",
                          str(tmp_path / "img")], capture_output=True, text=True)
    assert out.returncode == 1
    assert "not a WebAssembly module" in out.stderr


def test_wasm_image_round_trips_through_a_registry(tmp_path, registry):
    digest = run("wasm", "--wasm", str(WASM), "--out", str(tmp_path / "img"), "--tag", "0.1.0")
    pushed = run("push", "--layout", str(tmp_path / "img"), "--to", f"{registry.host}/mmrouter/mmrouter-wasm")
    assert pushed == digest
    pulled = run("pull", "--ref", f"{registry.host}/mmrouter/mmrouter-wasm:0.1.0", "--out", str(tmp_path / "back.wasm"))
    assert pulled == digest
    back = (tmp_path / "back.wasm").read_bytes()
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(WASM.read_bytes()).hexdigest()
    assert back == WASM.read_bytes()
    # By digest too, the way a WasmPlugin/EnvoyFilter url pins it.
    by_digest = run("pull", "--ref", f"{registry.host}/mmrouter/mmrouter-wasm@{digest}", "--out", str(tmp_path / "d.wasm"))
    assert by_digest == digest
    assert (tmp_path / "d.wasm").read_bytes() == back


def test_pull_refuses_a_digest_the_registry_does_not_have(tmp_path, registry):
    run("wasm", "--wasm", str(WASM), "--out", str(tmp_path / "img"))
    run("push", "--layout", str(tmp_path / "img"), "--to", f"{registry.host}/mmrouter/other:1")
    wrong = "sha256:" + hashlib.sha256(b"no such manifest").hexdigest()
    out = subprocess.run([sys.executable, SCRIPT, "pull", "--ref", f"{registry.host}/mmrouter/other@{wrong}",
                          "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert out.returncode == 1
    assert "404" in out.stderr


@pytest.mark.skipif(not SIDECAR_STATIC, reason="MMROUTER_SIDECAR_STATIC not set (needs the sidecar "
                    "binary in the tree; scripts/test builds it statically when it is)")
def test_sidecar_image_round_trips_and_is_static(tmp_path, registry):
    binary = open(SIDECAR_STATIC, "rb").read()
    # A static executable has no program interpreter (PT_INTERP): it runs on an empty image.
    readelf = subprocess.run(["readelf", "-l", SIDECAR_STATIC], capture_output=True, text=True)
    if readelf.returncode == 0:
        assert "INTERP" not in readelf.stdout
    digest = run("binary", "--binary", SIDECAR_STATIC, "--out", str(tmp_path / "img"), "--tag", "0.1.0")
    manifest = json.loads(blob(tmp_path / "img", digest))
    config = json.loads(blob(tmp_path / "img", manifest["config"]["digest"]))
    assert config["config"]["Entrypoint"] == ["/mmrouter-sidecar"]
    assert config["config"]["User"] == "65532:65532"
    assert run("push", "--layout", str(tmp_path / "img"), "--to",
               f"{registry.host}/mmrouter/mmrouter-sidecar") == digest
    assert run("pull", "--ref", f"{registry.host}/mmrouter/mmrouter-sidecar:0.1.0", "--out",
               str(tmp_path / "back")) == digest
    assert (tmp_path / "back").read_bytes() == binary
    # The pulled file runs.
    os.chmod(tmp_path / "back", 0o755)
    out = subprocess.run([str(tmp_path / "back"), "--help"], capture_output=True, text=True, timeout=10)
    assert "mmrouter-sidecar" in out.stdout + out.stderr
