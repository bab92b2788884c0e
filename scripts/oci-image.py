#!/usr/bin/env python3
"""Builds, pushes and pulls OCI images without a container daemon (Python standard library only).

    scripts/oci-image.py wasm    --wasm mmrouter.wasm --out DIR [--tag TAG]
    scripts/oci-image.py binary  --binary mmrouter-sidecar --out DIR [--tag TAG] [--port 9902]
    scripts/oci-image.py push    --layout DIR --to HOST:PORT/REPO:TAG [--insecure]
    scripts/oci-image.py pull    --ref HOST:PORT/REPO:TAG|@sha256:... --out FILE [--insecure]

`wasm` writes the filter as an OCI image layout directory in the *compat* variant of the Wasm
Image Specification that Istio's agent reads (solo-io/wasm `spec/spec-compat.md`; Istio
`pkg/wasm/imagefetcher.go`, `extractOCIStandardImage`): an OCI image manifest with the
annotation `module.wasm.image/variant: compat` and exactly one layer of media type
`application/vnd.oci.image.layer.v1.tar+gzip` holding `plugin.wasm`. `binary` writes a
one-file image of a static executable (the sidecar): `/mmrouter-sidecar`, run as 65532.

Both are reproducible: tar entries have mtime 0 and uid/gid 0, gzip has mtime 0, JSON is
compact with sorted keys, so the same input file gives the same manifest digest.

`push` uploads the layout's image (blobs, then the manifest under TAG) with the OCI
Distribution API (`/v2/`); `pull` downloads a manifest and its blobs, checks every digest and,
for a Wasm image, writes `plugin.wasm` to FILE (for another image, the first layer). Both speak
plain HTTP to a registry on loopback (or with --insecure) and HTTPS otherwise, without
authentication: for a registry that needs a login, push the layout with `skopeo copy
oci:DIR docker://...`, `crane push DIR REF` or `oras`. Each prints the manifest digest.
"""
import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
VARIANT = "module.wasm.image/variant"
WASM_FILE = "plugin.wasm"
SIDECAR_FILE = "mmrouter-sidecar"


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical(obj):
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def tar_layer(files):
    """A reproducible tar of (name, bytes, mode) entries: returns (tar bytes, tar.gz bytes)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, mode in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    tar_bytes = raw.getvalue()
    return tar_bytes, gzip.compress(tar_bytes, compresslevel=9, mtime=0)


def image(files, config_extra, annotations, platform):
    """Blobs (digest -> bytes) and the manifest bytes of a one-layer image."""
    tar_bytes, layer = tar_layer(files)
    config = {
        "architecture": platform[0],
        "os": platform[1],
        "config": config_extra,
        "rootfs": {"type": "layers", "diff_ids": [sha256(tar_bytes)]},
    }
    config_bytes = canonical(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": sha256(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": LAYER, "digest": sha256(layer), "size": len(layer)}],
        "annotations": annotations,
    }
    blobs = {sha256(config_bytes): config_bytes, sha256(layer): layer}
    return blobs, canonical(manifest)


def wasm_image(wasm):
    """The compat-variant Wasm image of a module."""
    if wasm[:4] != b"\0asm":
        raise ValueError("not a WebAssembly module (no \\0asm magic)")
    return image(
        [(WASM_FILE, wasm, 0o644)],
        {},
        {VARIANT: "compat", "org.opencontainers.image.title": "mmrouter"},
        # GOARCH/GOOS spelling of a WASI module; nothing runs this image as a container.
        ("wasm", "wasip1"),
    )


def binary_image(binary, port):
    """A one-file image of a static Linux executable, run as an unprivileged user."""
    if binary[:4] != b"\x7fELF":
        raise ValueError("not an ELF executable")
    return image(
        [(SIDECAR_FILE, binary, 0o755)],
        {"Entrypoint": ["/" + SIDECAR_FILE], "User": "65532:65532",
         "ExposedPorts": {f"{port}/tcp": {}}},
        {"org.opencontainers.image.title": "mmrouter-sidecar"},
        ("amd64", "linux"),
    )


def write_layout(out, blobs, manifest, tag):
    """Writes an OCI image layout (image-spec `image-layout.md`) holding one tagged manifest."""
    blob_dir = os.path.join(out, "blobs", "sha256")
    os.makedirs(blob_dir, exist_ok=True)
    for digest, data in {**blobs, sha256(manifest): manifest}.items():
        with open(os.path.join(blob_dir, digest.split(":", 1)[1]), "wb") as f:
            f.write(data)
    with open(os.path.join(out, "oci-layout"), "wb") as f:
        f.write(canonical({"imageLayoutVersion": "1.0.0"}))
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [{
            "mediaType": MANIFEST,
            "digest": sha256(manifest),
            "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    }
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(canonical(index))
    return sha256(manifest)


def read_layout(path):
    """(manifest bytes, blobs digest -> bytes, tag) of the single image in a layout."""
    with open(os.path.join(path, "index.json"), "rb") as f:
        index = json.load(f)
    entries = index.get("manifests", [])
    if len(entries) != 1:
        raise ValueError(f"{path}: expected one manifest in index.json, found {len(entries)}")

    def blob(digest):
        with open(os.path.join(path, "blobs", *digest.split(":", 1)), "rb") as f:
            data = f.read()
        if sha256(data) != digest:
            raise ValueError(f"{path}: blob {digest} does not match its digest")
        return data

    manifest = blob(entries[0]["digest"])
    m = json.loads(manifest)
    blobs = {d["digest"]: blob(d["digest"]) for d in [m["config"], *m["layers"]]}
    tag = entries[0].get("annotations", {}).get("org.opencontainers.image.ref.name", "latest")
    return manifest, blobs, tag


def parse_ref(ref):
    """HOST[:PORT]/REPO[:TAG|@DIGEST] -> (host, repo, tag or digest)."""
    ref = ref.removeprefix("oci://")
    host, _, rest = ref.partition("/")
    if not rest:
        raise ValueError(f"`{ref}`: expected HOST/REPO[:TAG|@DIGEST]")
    if "@" in rest:
        repo, _, reference = rest.partition("@")
    else:
        repo, sep, reference = rest.rpartition(":")
        if not sep or "/" in reference:
            repo, reference = rest, "latest"
    return host, repo, reference


class Registry:
    """A client of the OCI Distribution API (no authentication)."""

    def __init__(self, host, insecure=False):
        plain = insecure or host.split(":")[0] in ("localhost", "127.0.0.1", "[::1]")
        self.base = ("http://" if plain else "https://") + host

    def request(self, method, path, data=None, headers=None, ok=(200,)):
        url = path if path.startswith("http") else self.base + path
        req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                body = r.read()
                status, resp_headers = r.status, r.headers
        except urllib.error.HTTPError as e:
            body, status, resp_headers = e.read(), e.code, e.headers
        if status not in ok:
            raise RuntimeError(f"{method} {url}: HTTP {status}: {body[:300]!r}")
        return status, resp_headers, body

    def has_blob(self, repo, digest):
        status, _, _ = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", ok=(200, 404))
        return status == 200

    def push_blob(self, repo, digest, data):
        if self.has_blob(repo, digest):
            return
        _, headers, _ = self.request("POST", f"/v2/{repo}/blobs/uploads/", data=b"", ok=(202,))
        location = urllib.parse.urljoin(self.base + "/", headers["Location"])
        sep = "&" if "?" in location else "?"
        self.request("PUT", f"{location}{sep}digest={urllib.parse.quote(digest)}", data=data,
                     headers={"Content-Type": "application/octet-stream"}, ok=(201,))

    def push(self, repo, tag, manifest, blobs):
        for digest, data in blobs.items():
            self.push_blob(repo, digest, data)
        media_type = json.loads(manifest).get("mediaType", MANIFEST)
        _, headers, _ = self.request("PUT", f"/v2/{repo}/manifests/{tag}", data=manifest,
                                     headers={"Content-Type": media_type}, ok=(201,))
        digest = headers.get("Docker-Content-Digest", sha256(manifest))
        if digest != sha256(manifest):
            raise RuntimeError(f"registry stored the manifest as {digest}, expected {sha256(manifest)}")
        return digest

    def manifest(self, repo, reference):
        _, headers, body = self.request(
            "GET", f"/v2/{repo}/manifests/{reference}",
            headers={"Accept": f"{MANIFEST}, {DOCKER_MANIFEST}"})
        digest = sha256(body)
        if reference.startswith("sha256:") and reference != digest:
            raise RuntimeError(f"manifest {reference} has digest {digest}")
        served = headers.get("Docker-Content-Digest")
        if served and served != digest:
            raise RuntimeError(f"registry says manifest {served}, content is {digest}")
        return body, digest

    def blob(self, repo, digest):
        _, _, body = self.request("GET", f"/v2/{repo}/blobs/{digest}")
        if sha256(body) != digest:
            raise RuntimeError(f"blob {digest} has digest {sha256(body)}")
        return body


def pull(ref, insecure=False):
    """(manifest digest, manifest dict, blobs) of an image, every digest checked."""
    host, repo, reference = parse_ref(ref)
    reg = Registry(host, insecure)
    body, digest = reg.manifest(repo, reference)
    m = json.loads(body)
    blobs = {d["digest"]: reg.blob(repo, d["digest"]) for d in [m["config"], *m["layers"]]}
    return digest, m, blobs


def layer_file(layer, name=None):
    """A file from a tar.gz layer: `name`, or the only regular file."""
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer)), mode="r:") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        for m in members:
            if name is None and len(members) == 1 or name is not None and os.path.basename(m.name) == name:
                return tar.extractfile(m).read()
    raise ValueError(f"layer has no {name or 'single file'}")


def wasm_module(manifest, blobs):
    """The Wasm module of a compat-variant image, as Istio's agent extracts it: `plugin.wasm`
    in the last layer, which must be a tar+gzip layer."""
    last = manifest["layers"][-1]
    if last["mediaType"] != LAYER:
        raise ValueError(f"last layer is {last['mediaType']}, expected {LAYER}")
    return layer_file(blobs[last["digest"]], WASM_FILE)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wasm", help="write the filter's Wasm image (compat variant) as an OCI layout")
    w.add_argument("--wasm", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--tag", default="latest")
    b = sub.add_parser("binary", help="write a one-file image of a static executable")
    b.add_argument("--binary", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--tag", default="latest")
    b.add_argument("--port", type=int, default=9902)
    u = sub.add_parser("push", help="push a layout's image to a registry")
    u.add_argument("--layout", required=True)
    u.add_argument("--to", required=True, help="HOST[:PORT]/REPO[:TAG] (TAG defaults to the layout's)")
    u.add_argument("--insecure", action="store_true", help="plain HTTP")
    d = sub.add_parser("pull", help="pull an image and write its Wasm module (or its one file)")
    d.add_argument("--ref", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--insecure", action="store_true", help="plain HTTP")
    a = p.parse_args(argv)

    if a.cmd in ("wasm", "binary"):
        with open(a.wasm if a.cmd == "wasm" else a.binary, "rb") as f:
            data = f.read()
        blobs, manifest = wasm_image(data) if a.cmd == "wasm" else binary_image(data, a.port)
        print(write_layout(a.out, blobs, manifest, a.tag))
    elif a.cmd == "push":
        manifest, blobs, tag = read_layout(a.layout)
        host, repo, reference = parse_ref(a.to)
        if ":" not in a.to.split("/", 1)[1]:
            reference = tag
        print(Registry(host, a.insecure).push(repo, reference, manifest, blobs))
    else:
        digest, manifest, blobs = pull(a.ref, a.insecure)
        if manifest.get("annotations", {}).get(VARIANT) == "compat":
            data = wasm_module(manifest, blobs)
        else:
            data = layer_file(blobs[manifest["layers"][0]["digest"]])
        with open(a.out, "wb") as f:
            f.write(data)
        print(digest)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, RuntimeError, OSError) as e:
        print(f"oci-image: {e}", file=sys.stderr)
        sys.exit(1)
