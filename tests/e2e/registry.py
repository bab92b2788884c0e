"""A real OCI registry on loopback for tests: Debian's `docker-registry` (distribution 2.8).

scripts/test installs the package (`scripts/setup istio`); the binary is found on PATH or in
REGISTRY_BIN. The registry listens on a free 127.0.0.1 port and stores blobs in a temporary
directory that goes away with it.
"""
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from stack import free_port


def registry_binary():
    return os.environ.get("REGISTRY_BIN") or shutil.which("docker-registry") or shutil.which("registry")


class Registry:
    def __init__(self):
        binary = registry_binary()
        if not binary:
            raise RuntimeError("docker-registry is not installed (scripts/setup istio installs it)")
        self.tmp = tempfile.TemporaryDirectory(prefix="mmrouter-registry-")
        self.proc = None
        for _ in range(5):  # the port is picked before the registry binds it: retry on a race
            self.port = free_port()
            config = Path(self.tmp.name) / "config.yml"
            config.write_text(
                "version: 0.1\n"
                "log: {level: warn}\n"
                f"storage: {{filesystem: {{rootdirectory: {self.tmp.name}/data}}}}\n"
                f"http: {{addr: 127.0.0.1:{self.port}}}\n")
            self.log = open(Path(self.tmp.name) / "registry.log", "w+")
            self.proc = subprocess.Popen([binary, "serve", str(config)],
                                         stdout=self.log, stderr=subprocess.STDOUT)
            if self._wait():
                return
            self.proc.kill()
            self.proc.wait()
        self.log.seek(0)
        raise RuntimeError("docker-registry did not start:\n" + self.log.read()[-2000:])

    def _wait(self):
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        return False

    @property
    def host(self):
        return f"127.0.0.1:{self.port}"

    def close(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        self.tmp.cleanup()
