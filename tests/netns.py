"""Hosts made of Linux network namespaces, for multi-host tests on one machine.

``Cluster(n)`` creates ``n`` namespaces (``dp-test-h0`` ...), each with its
own loopback and one interface ``eth0`` holding a private address
(``10.77.0.10`` + index, /24), all plugged into a bridge that lives in a
namespace of its own (``dp-test-br``).  Nothing is created in, moved through
or routed via the machine's own network namespace: the veth pairs are created
inside the bridge namespace with their peer end placed straight into the host
namespace, so the machine's interfaces, routes and firewall are never touched
and the 10.77.0.0/24 traffic never leaves the namespaces.

A "host" runs commands through ``ip netns exec``.  It can be lost as a whole
(every process in it stopped, then SIGKILLed: nothing on it gets to react), or
cut off (its switch port goes down: its processes live on, unreachable).

Everything is removed on exit, and namespaces left over by an earlier run that
was killed (same ``dp-test-`` prefix) are removed before a new cluster starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch_util import read_events

PREFIX = "dp-test-"
SUBNET = "10.77.0"
BRIDGE_NS = f"{PREFIX}br"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (for pytest.skip), or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to create network namespaces; run the test as root"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2) to create network namespaces"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here ({made.stderr.strip() or made.returncode}): no network namespaces"
    try:
        veth = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if veth.returncode != 0:
            return f"cannot create veth pairs in a namespace ({veth.stderr.strip()})"
        bridge = _ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"cannot create a bridge in a namespace ({bridge.stderr.strip()})"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def namespace_pids(name: str) -> set[int]:
    """Every process whose network namespace is `name`."""
    out = _ip("netns", "pids", name, check=False)
    return {int(p) for p in out.stdout.split()} if out.returncode == 0 else set()


def alive(pid: int) -> bool:
    """True for a running (or stopped) process, False for a gone or zombie one."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"{pid} ({cmd[:300]})"


def _kill_all(pids: Sequence[int]) -> None:
    """Stop every process first, then SIGKILL each: none of them runs between the first and the last kill."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def remove_leftovers() -> list[str]:
    """Delete `dp-test-` namespaces left by an earlier, interrupted run (killing what still runs in them).

    Only namespaces with this module's prefix are touched; what runs inside them was started by a
    test of this module (nothing else enters them).  Returns what was removed, for the report.
    """
    removed = []
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pids = sorted(namespace_pids(name))
        _kill_all(pids)
        _ip("netns", "del", name, check=False)
        removed.append(f"{name} ({len(pids)} processes)")
    return removed


@dataclass
class Host:
    index: int
    ns: str
    addr: str
    port: str  # the bridge-side end of its veth pair (its switch port)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)


class Cluster:
    """n hosts on one bridge; a context manager that always removes what it made."""

    def __init__(self, n: int) -> None:
        self.hosts = [Host(i, f"{PREFIX}h{i}", f"{SUBNET}.{10 + i}", f"{PREFIX[:3]}p{i}") for i in range(n)]
        self.leftovers_removed: list[str] = []
        self.killed_at_teardown: list[str] = []

    def __enter__(self) -> Cluster:
        self.leftovers_removed = remove_leftovers()
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _create(self) -> None:
        _ip("netns", "add", BRIDGE_NS)
        _ip("-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge")
        _ip("-n", BRIDGE_NS, "link", "set", "br0", "up")
        for host in self.hosts:
            _ip("netns", "add", host.ns)
            _ip("-n", host.ns, "link", "set", "lo", "up")
            # Made inside the bridge namespace; the peer end goes straight into the host namespace.
            _ip("-n", BRIDGE_NS, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            _ip("-n", BRIDGE_NS, "link", "set", host.port, "master", "br0")
            _ip("-n", BRIDGE_NS, "link", "set", host.port, "up")
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.ns, "link", "set", "eth0", "up")
        self._wait_reachable()

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Wait until host 0 reaches every other host (a refused TCP connect is an answer: the path works)."""
        probe = (
            "import socket,sys\n"
            "s=socket.socket(); s.settimeout(1.0)\n"
            "try: s.connect((sys.argv[1], 9))\n"
            "except ConnectionRefusedError: sys.exit(0)\n"
            "except OSError: sys.exit(1)\n"
        )
        deadline = time.monotonic() + timeout
        first = self.hosts[0]
        for host in self.hosts[1:]:
            while True:
                check = subprocess.run(
                    ["ip", "netns", "exec", first.ns, sys.executable, "-c", probe, host.addr],
                    capture_output=True,
                    timeout=10,
                )
                if check.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{host.ns} ({host.addr}) unreachable from {first.ns} after {timeout}s")
                time.sleep(0.1)

    # -- processes ------------------------------------------------------------------------------

    def popen(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` on `host` (`ip netns exec` execs it: the Popen pid is the command's pid)."""
        proc = subprocess.Popen(["ip", "netns", "exec", host.ns, *argv], **kwargs)
        host.procs.append(proc)
        return proc

    def pids(self, host: Host) -> set[int]:
        return {pid for pid in namespace_pids(host.ns) if alive(pid)}

    def kill_host(self, host: Host) -> list[int]:
        """Lose the host at once: every process in it stopped, then SIGKILLed. Returns the pids."""
        pids = sorted(self.pids(host))
        _kill_all(pids)
        return pids

    def cut_link(self, host: Host) -> None:
        """Pull the host's cable: its switch port goes down; its processes live on, unreachable."""
        _ip("-n", BRIDGE_NS, "link", "set", host.port, "down")

    def heal_link(self, host: Host) -> None:
        _ip("-n", BRIDGE_NS, "link", "set", host.port, "up")

    def cut_between(self, a: Host, b: Host) -> None:
        """Cut only the path between two hosts (a blackhole route in each, for the other's address);
        both still reach every other host."""
        _ip("-n", a.ns, "route", "add", "blackhole", f"{b.addr}/32")
        _ip("-n", b.ns, "route", "add", "blackhole", f"{a.addr}/32")

    def find(self, host: Host, needle: str) -> list[int]:
        """The pids of `host` whose command line contains `needle`."""
        return sorted(pid for pid in self.pids(host) if needle in describe(pid))

    def teardown(self) -> None:
        """Kill whatever still runs in our namespaces (recorded for the report), then delete them."""
        for host in self.hosts:
            leftover = sorted(namespace_pids(host.ns))
            self.killed_at_teardown += [f"{host.ns}: {describe(pid)}" for pid in leftover if alive(pid)]
            _kill_all(leftover)
            for proc in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        for host in self.hosts:
            _ip("netns", "del", host.ns, check=False)
        _ip("netns", "del", BRIDGE_NS, check=False)


# -- a DeadPool job across the hosts ---------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "demos" / "train_gpt.py"
COORDINATOR_PORT = 29400  # fixed, like torchrun's --master-port: every host knows it before host 0 starts
STORE_PORT = 29500


class Job:
    """One `deadpool launch` per host, started together (as `srun` would), with their output collected.

    Host 0 runs the coordinator on a fixed port; the others are given its address.  Each host
    writes its own events file (as on a cluster without a shared file system); `events()` merges them.
    """

    def __init__(self, cluster: Cluster, workdir: Path, steps: int, nproc: int = 2, spares: int = 1,
                 extra: Sequence[str] = (), secret: str = "", env: dict[str, str] | None = None,
                 script_args: Sequence[str] = ()) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.lines: list[list[tuple[float, str]]] = [[] for _ in cluster.hosts]
        self.procs: list[subprocess.Popen[str]] = []
        self.threads: list[threading.Thread] = []
        self.event_files = [workdir / f"events-host{h.index}.jsonl" for h in cluster.hosts]
        self.started = time.time()
        head = cluster.hosts[0]
        env = {**os.environ, **(env or {}), "DEADPOOL_SECRET": secret or os.urandom(16).hex(), "PYTHONUNBUFFERED": "1"}
        for host in cluster.hosts:
            argv = [sys.executable, "-m", "deadpool", "launch",
                    "--nnodes", str(len(cluster.hosts)), "--node-rank", str(host.index),
                    "--nproc-per-node", str(nproc), "--spares", str(spares),
                    "--host-name", f"host{host.index}", "--bind-host", host.addr,
                    "--master-addr", head.addr, "--master-port", str(STORE_PORT),
                    "--events", str(self.event_files[host.index]), *extra]
            if host.index == 0:
                argv += ["--coordinator-port", str(COORDINATOR_PORT)]
            else:
                argv += ["--coordinator", f"tcp://{head.addr}:{COORDINATOR_PORT}"]
            argv += [str(DEMO), "--steps", str(steps), *script_args]
            proc = cluster.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 cwd=REPO, env=env)
            self.procs.append(proc)
            thread = threading.Thread(target=self._read, args=(proc, self.lines[host.index]), daemon=True)
            thread.start()
            self.threads.append(thread)

    @staticmethod
    def _read(proc: subprocess.Popen[str], sink: list[tuple[float, str]]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.append((time.time(), line.rstrip("\n")))

    def output(self, host: int) -> str:
        return "\n".join(line for _, line in list(self.lines[host]))

    def wait_line(self, host: int, pattern: str, timeout: float) -> tuple[float, str]:
        """The first line of `host`'s output matching `pattern` (its arrival time and text)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            lines = list(self.lines[host])
            for ts, line in lines[seen:]:
                if regex.search(line):
                    return ts, line
            seen = len(lines)
            if self.procs[host].poll() is not None and not self.threads[host].is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"host{host} never printed /{pattern}/ within {timeout}s:\n{self.output(host)[-3000:]}")

    def wait(self, hosts: Sequence[int], timeout: float) -> dict[int, int | None]:
        """Exit codes of the given hosts' launchers (None: still running at the deadline)."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int | None] = {}
        for host in hosts:
            try:
                codes[host] = self.procs[host].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[host] = None
        for host in hosts:
            if codes[host] is not None:
                self.threads[host].join(timeout=5)
        return codes

    def digest(self, host: int = 0) -> str | None:
        found = DIGEST.findall(self.output(host))
        return found[-1] if found else None

    def events(self) -> list[dict[str, Any]]:
        records = []
        for path in self.event_files:
            records += read_events(path)
        return sorted(records, key=lambda r: r.get("ts", 0.0))


DIGEST = re.compile(r"^final state digest: ([0-9a-f]{64})$", re.MULTILINE)
