"""What a benchmark result records about where it ran: date, commit, machine, load."""
import datetime
import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def describe(envoy_binary, wasm=None):
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "free_g": _run(["free", "-g"]),
        "loadavg_start": loadavg(),
        "envoy": _run([str(envoy_binary), "--version"]).split("version:")[-1].strip(),
        "nginx": _run(["nginx", "-v"]) or subprocess.run(["nginx", "-v"], capture_output=True,
                                                          text=True).stderr.strip(),
        "wrk": _run(["wrk", "--version"]).splitlines()[0] if _run(["wrk", "--version"]) else "",
    }
    if wasm:
        data = Path(wasm).read_bytes()
        info["wasm"] = {"path": str(wasm), "bytes": len(data),
                        "sha256": hashlib.sha256(data).hexdigest()[:16]}
    return info


def header_lines(info):
    lines = [f"date {info['date_utc']}, commit {info['commit']}{' (+ uncommitted changes)' if info['dirty'] else ''}",
             f"machine: nproc {info['nproc']}, {info['cpu']}, load average at start "
             f"{' '.join(str(x) for x in info['loadavg_start'])}",
             f"envoy {info['envoy']}; {info['nginx']}; {info['wrk']}"]
    if "wasm" in info:
        w = info["wasm"]
        lines.append(f"filter: {w['path']} ({w['bytes']} bytes, sha256 {w['sha256']}...)")
    return lines
