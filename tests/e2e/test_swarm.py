"""The swarm benchmark (bench/swarm.py) at a small size: the real coordinator process, real sockets, one kill.

96 members on 127.0.0.1 in one swarm process; one member crashes, its host agent reports the
exit, the coordinator swaps a spare into its seat, and every invariant the benchmark checks holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_swarm_swaps_a_crashed_member_with_no_violation() -> None:
    command = [sys.executable, str(ROOT / "bench" / "swarm.py"), "--members", "96", "--kills", "1",
               "--steady-s", "0.5", "--join-s", "0.5", "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["members"] == 96 and row["kills"] == 1
    assert row["invariant_violations"] == 0, row["violations"]
    assert row["swaps_completed"] == 1
    kill = row["per_kill"][0]
    assert kill["kind"] == "crash" and kill["detected_by"] == "exit"
    assert kill["detect_s"] is not None and kill["view_change_s"] is not None and kill["swap_s"] is not None
    assert row["false_positives"] == 0
