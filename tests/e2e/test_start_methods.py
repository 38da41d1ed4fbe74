"""Workers forked from the host's fork server start as fresh interpreters would, and train to the same bits.

Each seat of the same job prints what it was started with (``tiny_train.py --print-process``) under
``--start-method fork`` (the default) and ``exec``; everything but the per-process draws and the member ids
(new per job) must match, and both runs end with the same final state digest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from launch_util import TINY, TINY_JOB, LaunchResult, launch

STEPS = 4


def facts(result: LaunchResult) -> dict[str, dict[str, Any]]:
    """Each worker's printed facts, by its output label."""
    found = {}
    for line in result.output.splitlines():
        label, _, rest = line.partition("] process-facts ")
        if rest:
            found[label.lstrip("[")] = json.loads(rest)
    return found


def comparable(seat: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in seat["env"].items() if k not in ("DEADPOOL_MEMBER_ID", "DEADPOOL_AGENT",
                                                             "DEADPOOL_AGENT_PID", "DEADPOOL_COORDINATOR",
                                                             "DEADPOOL_EVENTS", "DEADPOOL_SECRET", "MASTER_PORT")}
    return {**seat, "env": env, "random": None}


def test_a_forked_worker_starts_as_an_exec_one_would_and_trains_the_same_bits(tmp_path: Path) -> None:
    runs = {}
    for method in ("fork", "exec"):
        result = launch(tmp_path, *TINY_JOB, "--start-method", method, script=TINY, steps=STEPS,
                        script_args=("--print-process",))
        assert result.returncode == 0 and result.digest, result.output[-3000:]
        runs[method] = result
    forked, executed = facts(runs["fork"]), facts(runs["exec"])
    assert sorted(forked) == sorted(executed) == ["rank0", "rank1", "spare0"], runs["fork"].output[-3000:]
    for label, seat in forked.items():
        assert comparable(seat) == comparable(executed[label]), label
        assert seat["parent_is_agent"] and seat["session_leader"] and seat["sigint_default"], seat
        assert seat["sigterm_default"] and seat["stdout_is_stderr"], seat
    assert len({seat["random"] for seat in forked.values()}) == len(forked), "each fork draws its own random stream"
    assert runs["fork"].digest == runs["exec"].digest
    assert "fork server" not in runs["fork"].output, "the fork server ran without falling back"


ORPHANS = """
import os, sys, time
from deadpool.agent.forked import become_subreaper, orphaned_zombies
assert become_subreaper()
worker = os.fork()
if worker == 0:  # a worker: its own session, a child of its own (a DataLoader worker), then it dies
    os.setsid()
    if os.fork() == 0:
        time.sleep(0.3)
        os._exit(0)
    os._exit(0)
os.waitpid(worker, 0)
deadline = time.monotonic() + 10
while not (found := orphaned_zombies({worker})) and time.monotonic() < deadline:
    time.sleep(0.05)
print(len(found), orphaned_zombies({12345}) == [])
os.waitpid(found[0], 0)
"""


def test_the_launcher_finds_the_orphans_a_dead_workers_session_left_with_it() -> None:
    done = subprocess.run([sys.executable, "-c", ORPHANS], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.split() == ["1", "True"], done
