"""``deadpool move`` on a live job: the seat goes to a spare at a step boundary, nothing finished is redone.

One run of the GPT demo (4 seats, 2 spares, slowed so that commands land mid-run) gets, in turn: bad
``deadpool move --rank 2``; bad requests (a seat or host that does not exist, a spare not in the pool, a
drain of the only host), each refused with exit status 2 and one line while the job trains on; and a kill
of rank 1
later (``--chaos``), so that a planned move and a failure repair are measured in the same run. It ends
with the failure-free run's digest.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from launch_util import DEMO, GPT_WORKLOAD, REFERENCE_STEPS, REPO, LaunchResult, assert_no_survivors, read_events

MOVE_AFTER_STEP = 3
KILL = "kill:rank=1:step=12"


def deadpool(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadpool", *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=60, env=env)


def test_a_moved_seat_ends_bit_identical_with_no_finished_step_redone(tmp_path: Path,
                                                                      gpt_reference: LaunchResult) -> None:
    events = tmp_path / "events.jsonl"
    command = [sys.executable, "-m", "deadpool", "launch", "--nproc", "4", "--spares", "2", "--no-progress",
               "--events", str(events), "--chaos", KILL, str(DEMO), "--steps", str(REFERENCE_STEPS), *GPT_WORKLOAD,
               "--step-delay", "0.25"]
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not any(e.get("event") == "step_finished" and e["step"] >= MOVE_AFTER_STEP
                      for e in read_events(events)):
            assert time.monotonic() < deadline and proc.poll() is None, "the job never reached the move's step"
            time.sleep(0.1)
        address = next(e["address"] for e in read_events(events) if e.get("event") == "coordinator_started")
        moved = deadpool("move", "--rank", "2", "--coordinator", address)
        assert moved.returncode == 0 and "rank 2 moves to" in moved.stdout, moved
        refusals = {
            ("move", "--rank", "7"): "no rank 7 in the job (ranks 0..3)",
            ("drain", "--host", "nowhere"): "no host 'nowhere' in the job",
            ("move", "--rank", "0", "--spare", "nobody"): "spare nobody is not free in the pool",
        }
        for argv, message in refusals.items():
            refused = deadpool(*argv, "--coordinator", address)
            assert refused.returncode == 2 and message in refused.stderr, (argv, refused)
            assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        host = next(e["host"] for e in read_events(events) if e.get("event") == "member_joined")
        only = deadpool("drain", "--host", host, "--coordinator", address)
        assert only.returncode == 2 and "holds every seat of the job" in only.stderr, only
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = LaunchResult(proc.returncode, output, read_events(events), time.monotonic() - started)
    assert result.returncode == 0, output[-3000:]
    assert result.digest == gpt_reference.digest, "a planned move must end bit-identical"
    assert_no_survivors(result)
    (asked,) = result.of("move_requested")
    (left,) = result.of("seat_left")
    assert asked["rank"] == left["rank"] == 2 and asked["trigger"] == "operator"
    (commit,) = [v for v in result.of("view_committed") if v.get("trigger") == "move"]
    finished = max(e["step"] for e in result.of("step_finished") if e["ts"] < commit["ts"])
    assert commit["resume_step"] == left["step"] == finished, "no finished step is redone"
    assert [e["member"] for e in result.of("moved_exit")] == [asked["member"]]
    assert f"rank 2 ({asked['member']}) was moved" in output
    failed = result.of("member_failed")
    assert [e["rank"] for e in failed] == [1], "the kill is the only failure: the move is not one"
    swaps = {e["rank"]: e for e in result.of("swap_completed")}
    assert sorted(swaps) == [1, 2]
    print(f"planned move of rank 2: {swaps[2]['recovery_s']:.2f} s from the seat leaving to its spare's first "
          f"step; failure repair of rank 1: {swaps[1]['recovery_s']:.2f} s from the kill (same run)")
