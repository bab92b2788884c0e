"""Free TCP ports for the Python harnesses (tests/e2e, benches/compare, benches/proxy,
scripts/check-docs): one helper, so that none of them can hand out a port twice.

A port from the kernel's free ports is free when it is picked, not when the program it is for
binds it; the kernel can hand the same port back to the next caller meanwhile. In the 184th
run of docs/BENCHMARKS.md the sidecar got the port already picked for Envoy's listener, and a
whole run's requests went to the sidecar (HTTP 405)."""

import socket

_ISSUED = set()


def free_port(host="127.0.0.1"):
    """A port nothing listens on now that no earlier call in this process returned (another
    process may still take it before it is bound)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _ISSUED:
            _ISSUED.add(port)
            return port
