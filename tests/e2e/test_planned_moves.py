"""``deadpool move`` on a live job: the seat goes to a spare at a step boundary, nothing finished is redone.

One run of the GPT demo (4 seats, 2 spares, slowed so that commands land mid-run) gets, in turn:
``deadpool move --rank 2``; bad requests (a seat or host that does not exist, a spare not in the pool, a
drain of the only host), each refused with exit status 2 and one line while the job trains on; and a kill
of rank 1 later (``--chaos``), so that a planned move and a failure repair are measured in the same run.
It ends with the failure-free run's digest. A second run makes rank 1 three times slower (``slow:`` chaos)
under ``--replace-slow``: the coordinator reports it (``seat_slow``) and moves it to a spare, and the job
gets its pace back and ends bit-identical.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from conftest import References
from launch_util import DEMO, REFERENCE_STEPS, REPO, LaunchResult, launch, read_events, wait_for

MOVE_AFTER_STEP = 3
KILL = "kill:rank=1:step=12"


def deadpool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deadpool", *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=60)


def test_a_moved_seat_ends_bit_identical_with_no_finished_step_redone(tmp_path: Path,
                                                                      gpt_reference: LaunchResult) -> None:
    def operate(events: Path) -> None:
        wait_for(events, lambda ev: any(e.get("event") == "step_finished" and e["step"] >= MOVE_AFTER_STEP
                                        for e in ev), 120)
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

    result = launch(tmp_path, "--nproc", "4", "--spares", "2", "--no-progress", "--chaos", KILL,
                    steps=REFERENCE_STEPS, script_args=("--step-delay", "0.25"), during=operate)
    output = result.output
    assert result.returncode == 0, output[-3000:]
    assert result.digest == gpt_reference.digest, "a planned move must end bit-identical"
    (asked,) = result.of("move_requested")
    (left,) = result.of("seat_left")
    assert asked["rank"] == left["rank"] == 2 and asked["trigger"] == "operator"
    (commit,) = [v for v in result.of("view_committed") if v.get("trigger") == "move"]
    finished = max(e["step"] for e in result.of("step_finished") if e["ts"] < commit["ts"])
    assert commit["resume_step"] == left["step"] == finished, "no finished step is redone"
    held = result.of("seat_held")
    assert len(held) == 3 and asked["member"] not in {e["member"] for e in held}, held
    assert {e["step"] for e in held} == {left["step"]}, "the other seats hold at the end of the step it leaves after"
    assert {e["member"] for e in result.of("paused") if asked["ts"] < e["ts"] < commit["ts"]} <= \
        {e["member"] for e in held if e["late"]}, "only a seat told too late begins a step it must then abandon"
    assert [e["member"] for e in result.of("moved_exit")] == [asked["member"]]
    assert f"rank 2 ({asked['member']}) was moved" in output
    failed = result.of("member_failed")
    assert [e["rank"] for e in failed] == [1], "the kill is the only failure: the move is not one"
    swaps = {e["rank"]: e for e in result.of("swap_completed")}
    assert sorted(swaps) == [1, 2]
    (taken,) = [e for e in result.of("restored") if e["member"] == swaps[2]["new_member"]
                and e["epoch"] == commit["epoch"]]
    assert taken["preloaded"] and taken["source"] == "mover", \
        "the move's spare loads the moving seat's own snapshot of the step it left after, fetched as it ended it"
    assert not [e for e in result.of("adopt_failed") if e["epoch"] == commit["epoch"]], \
        "the moving seat's answer left before it exited"
    print(f"planned move of rank 2: {swaps[2]['recovery_s']:.2f} s from the seat leaving to its spare's first "
          f"step; failure repair of rank 1: {swaps[1]['recovery_s']:.2f} s from the kill (same run)")


SLOW_STEPS = 24  # enough steps left after the detection for the move to pay
SLOW = "slow:rank=1:step=4:factor=3"


def test_a_seat_that_stays_slow_is_moved_and_the_job_ends_bit_identical(tmp_path: Path,
                                                                        references: References) -> None:
    job = ("--nproc", "4", "--spares", "2", "--no-progress")
    reference = references.get(DEMO, job, (), SLOW_STEPS)
    result = launch(tmp_path, *job, "--replace-slow", "--slow-steps", "3", "--chaos", SLOW, steps=SLOW_STEPS,
                    script_args=("--step-delay", "0.2"))
    assert result.returncode == 0, result.output[-3000:]
    assert result.digest == reference.digest, "a move for slowness must end bit-identical"
    (slow,) = result.of("seat_slow")
    assert slow["rank"] == 1 and slow["moved"] and slow["score"] >= 1.5, slow
    (asked,) = result.of("move_requested")
    assert asked["rank"] == 1 and asked["trigger"] == "slow"
    (commit,) = [v for v in result.of("view_committed") if v.get("trigger") == "move"]
    finished = max(e["step"] for e in result.of("step_finished") if e["ts"] < commit["ts"])
    assert commit["resume_step"] == finished, "no finished step is redone"
    assert not result.of("member_failed")
    rank0 = {e["step"]: e["step_s"] for e in result.of("step_finished") if e["rank"] == 0}
    before = statistics.median(rank0[s] for s in range(1, 4))
    slowed = statistics.median(rank0[s] for s in range(6, finished + 1))
    after = statistics.median(rank0[s] for s in range(finished + 2, SLOW_STEPS))
    assert slowed > 1.5 * before and after < (before + slowed) / 2, (before, slowed, after)
    print(f"step time of rank 0: {before:.3f} s before the slowdown, {slowed:.3f} s while rank 1 was slow, "
          f"{after:.3f} s after the move ({after / before:.2f}x the first)")
