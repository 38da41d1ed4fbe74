"""A worker process's end, as its launcher sees it: when it ended, with what status, and what it left.

The launcher learns of an exit from the process's pidfd (readable once the kernel
has freed the process) and reads the status without reaping it, so the report
goes out before asyncio's child watcher gets to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from deadpool.agent import jobfile


async def ended(pid: int) -> int | None:
    """Return once process `pid` has ended (its pidfd becomes readable), without waiting for its pipes.

    Returns its exit status as ``Popen.returncode`` has it (``-N``: killed by signal N), read without
    reaping it (the child watcher still does), or None where the kernel cannot tell it that way.
    """
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here (or already reaped): a slow poll instead
        while jobfile.process_alive(pid):
            await asyncio.sleep(0.1)
        return None
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, _set_once, readable)
    try:
        await readable
        return _peek_status(fd)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def _peek_status(pidfd: int) -> int | None:
    """The exit status of the ended process behind `pidfd`, left for its parent to reap (None: unknown)."""
    try:
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (AttributeError, OSError):  # no P_PIDFD (Linux < 5.4), or reaped already
        return None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else None


def kill_group(pgid: int) -> None:
    """SIGKILL (then SIGCONT, for a stopped one) to every process left in group `pgid`, if any."""
    for signum in (signal.SIGKILL, signal.SIGCONT):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
