"""The child processes of a benchmark: started with a parent-death signal, all stopped at exit.

Every process a benchmark starts goes through `Processes.start`, so that `stop_all` (run from a
`finally`, and on SIGINT/SIGTERM through `exit_on_signals`) leaves nothing behind. The kernel
sends SIGTERM to a child whose parent dies without cleaning up (PR_SET_PDEATHSIG), so even a
SIGKILLed benchmark does not leave Envoy or nginx running.
"""
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from ports import free_port  # noqa: E402,F401  (tests/support/ports.py; used as processes.free_port)

PR_SET_PDEATHSIG = 1


def _die_with_parent():
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def exit_on_signals():
    """Turns SIGTERM (and SIGINT, already KeyboardInterrupt) into SystemExit so finally runs."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def wait_port(host, port, timeout, proc=None):
    """Waits until host:port accepts a TCP connection; False on timeout or when proc exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def cpu_ticks(pid):
    """utime + stime of one process, in clock ticks (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # The command name (field 2) is in parentheses and may hold spaces.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def children(pid):
    """Direct children of pid."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def rss_bytes(pid):
    """Resident set size of pid (VmRSS of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_ticks():
    """CPU ticks the whole machine spent busy (all cores; /proc/stat: total less idle and
    iowait), for the CPU that other processes took during a run."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]


class Processes:
    """The processes one benchmark started, to stop them all at the end."""

    def __init__(self):
        self.procs = []

    def start(self, argv, log_path, env=None):
        log = open(log_path, "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, preexec_fn=_die_with_parent)
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc, timeout=10.0):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self):
        for proc in reversed(list(self.procs)):
            self.stop(proc)
