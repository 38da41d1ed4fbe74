"""The coordinator processes an agent runs, and what their exits mean for the job.

Host 0's agent runs the active coordinator (restarting it on the same address if
it dies); host 1's agent (by default, in jobs of 3 hosts or more) runs the standby,
which takes over with a higher term if host 0 is lost.  Either process ends with
the job's status (0 finished, 1 failed) when it was the active coordinator at the
end; ``terms.EXIT_CODES`` say when it ended without that: superseded by a newer
term (the job goes on elsewhere), or cut off from most hosts (this host's
workers stop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable

from deadpool.errors import MisuseError
from deadpool.protocol.link import EXIT_CODES, StandDown

COORDINATOR_START_TIMEOUT = 60.0
MAX_COORDINATOR_RESTARTS = 5
MIN_STANDBY_HOSTS = 3  # a takeover needs a majority that is not the head host alone


def standby_wanted(args: argparse.Namespace) -> bool:
    """Does this host run the standby coordinator? (host 1 of 3 or more by default; ``--standby-coordinator``)"""
    if getattr(args, "no_standby", False) or args.nnodes < MIN_STANDBY_HOSTS:
        return False
    return bool(getattr(args, "standby_coordinator", False)) or args.node_rank == 1


async def start(args: argparse.Namespace, world: int, events: str, env: dict[str, str], bind: str = "",
                recover: bool = False, standby_of: str = "") -> tuple[asyncio.subprocess.Process, str, str]:
    """Start a coordinator (or, with `standby_of`, a standby) and read the addresses it bound from its first line.

    Raises:
        MisuseError: it did not start (its error is on stderr).
    """
    host = args.master_addr or "127.0.0.1"
    if standby_of:  # any free ports on this host: the active tells everyone the standby's address
        host = args.bind_host or args.master_addr or "127.0.0.1"
        bind, store_port = f"tcp://{host}:0", "0"
    else:
        store_port = "0" if recover else str(args.master_port)
    command = [sys.executable, "-m", "deadpool.coordinator.main", "--world-size", str(world), "--events", events,
               "--bind", bind or f"tcp://{host}:{args.coordinator_port}", "--store-port", store_port,
               "--hosts", str(args.nnodes)]
    if recover:
        command.append("--recover")
    if standby_of:
        command += ["--standby-of", standby_of]
    elif getattr(args, "metrics_port", -1) >= 0:
        command += ["--metrics-port", str(args.metrics_port)]
    proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE, env=env)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), COORDINATOR_START_TIMEOUT)
        ready = json.loads(line)
        if ready.get("metrics"):
            print(f"deadpool: Prometheus metrics at {ready['metrics']}", flush=True)
        return proc, ready["control"], ready["store"]
    except (TimeoutError, json.JSONDecodeError, KeyError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        what = "standby coordinator" if standby_of else "coordinator"
        raise MisuseError(f"the {what} did not start (see its error above)") from None


def describe(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit {code}"


Restart = Callable[[], Awaitable[asyncio.subprocess.Process]]


async def active_lifetime(proc: asyncio.subprocess.Process, restart: Restart,
                          stopping: Callable[[], bool]) -> int | StandDown:
    """Wait for the active coordinator's end; restart it (same address) if it died rather than ended.

    Returns the job's status (0 or 1), or why it stood down.  Training does not need the
    coordinator while nothing fails; a restarted one learns the view from the members.
    """
    restarts = 0
    while True:
        code = await proc.wait()
        for kind, status in EXIT_CODES.items():
            if code == status:
                return kind
        if code in (0, 1) or stopping() or restarts >= MAX_COORDINATOR_RESTARTS:
            return 1 if code not in (0, 1) else code
        restarts += 1
        print(f"deadpool: the coordinator died ({describe(code)}); restarting it on the same address "
              f"(restart {restarts}); training goes on meanwhile", file=sys.stderr, flush=True)
        proc = await restart()


async def standby_lifetime(proc: asyncio.subprocess.Process) -> int | None:
    """Wait for the standby's end: the job's status if it took over and ran the job to its end, else None."""
    code = await proc.wait()
    if code in (0, 1):
        return code
    if code not in EXIT_CODES.values():
        print(f"deadpool: the standby coordinator ended ({describe(code)}); the active coordinator starts "
              "another on another host", file=sys.stderr, flush=True)
    return None
