"""Run ``deadpool launch`` as a real subprocess and read back what it did."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "demos" / "train_gpt.py"
# Every test run of the GPT demo (and its shared reference) at a quarter of the demo's batch and half its context:
# the same model and snapshots, a fifth less time per job on 2 cores. A test's own --batch or --block comes after.
GPT_WORKLOAD = ("--batch", "2", "--block", "32")
TINY = REPO / "tests" / "fixtures" / "tiny_train.py"  # a small DDP script with switches for misbehaviour
TINY_JOB = ("--nproc", "2", "--spares", "1", "--no-progress")  # the job of TINY's shared failure-free run
REFERENCE_STEPS = 16  # the steps of the GPT demo's failure-free reference run (``gpt_reference``, conftest.py)
DIGEST = re.compile(r"^final state digest: ([0-9a-f]{64})$", re.MULTILINE)


@dataclass
class LaunchResult:
    returncode: int
    output: str
    events: list[dict[str, Any]]
    elapsed: float

    @property
    def digest(self) -> str | None:
        found = DIGEST.findall(self.output)
        return found[-1] if found else None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    def pids(self) -> set[int]:
        return {int(e["pid"]) for e in self.of("member_joined") if e.get("source_process") == "worker"}


def launch(
    tmp_path: Path,
    *launch_args: str,
    steps: int = 40,
    script_args: tuple[str, ...] = (),
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    script: Path = DEMO,
    during: Callable[[Path], None] | None = None,
) -> LaunchResult:
    """Run one job to its end (the GPT demo unless `script` names another); the timeout bounds the whole test.

    `during(events)`, when given, runs while the job does (an operator's commands, say), with the job's events
    file; the job is then waited for (and killed if `during` raised)."""
    events = tmp_path / f"events-{time.monotonic_ns()}.jsonl"
    if script == DEMO:
        script_args = (*GPT_WORKLOAD, *script_args)
    command = [
        sys.executable,
        "-m",
        "deadpool.tools.cli",
        "launch",
        "--events",
        str(events),
        *launch_args,
        str(script),
        "--steps",
        str(steps),
        *script_args,
    ]
    started = time.monotonic()
    if during is None:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO
        )
        code, output = done.returncode, done.stdout + done.stderr
    else:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, cwd=REPO)
        try:
            during(events)
            output, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        code = proc.returncode
    result = LaunchResult(code, output, read_events(events), time.monotonic() - started)
    assert_no_survivors(result)
    return result


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events written so far.  A job may still be appending: a reader can see a line's
    single ``write`` half done, so the text after the last newline is left for the next read."""
    if not path.exists():
        return []
    complete = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def wait_for(path: Path, predicate: Any, timeout: float) -> list[dict[str, Any]]:
    """Poll a live job's events until `predicate(events)` holds; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = read_events(path)
        if predicate(events):
            return events
        time.sleep(0.1)
    raise AssertionError(f"not seen within {timeout}s; last events: {[e['event'] for e in read_events(path)][-30:]}")


def assert_no_survivors(result: LaunchResult) -> None:
    """Every worker process the job started is gone when launch returns."""
    deadline = time.monotonic() + 5.0
    alive = set(result.pids())
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if running(pid)}
        time.sleep(0.05)
    assert not alive, f"worker processes still alive after launch returned: {alive}"


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except OSError:
        return False
