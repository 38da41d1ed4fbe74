"""The launcher's view of a worker's end: its status read from the pidfd before anyone reaps it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

from deadpool.agent import exits


def _end(code: str, kill: bool) -> tuple[int | None, int]:
    """(what ``ended`` read, what reaping it afterwards says): no child watcher races the peek here."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    if kill:
        proc.send_signal(signal.SIGKILL)
    return asyncio.run(exits.ended(proc.pid)), proc.wait(10)


def test_a_killed_worker_reads_as_killed_by_its_signal_and_is_still_reaped_after() -> None:
    assert _end("import time; time.sleep(60)", kill=True) == (-signal.SIGKILL, -signal.SIGKILL)


def test_a_worker_that_exits_reads_as_its_exit_code() -> None:
    assert _end("import sys; sys.exit(3)", kill=False) == (3, 3)


def test_a_process_already_reaped_reads_as_unknown() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert asyncio.run(exits.ended(proc.pid)) is None
