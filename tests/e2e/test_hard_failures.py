"""Membership under hard failures: hangs, failures during a swap, double kills, lost copies,
a dead coordinator, partitions and spares joining late.  Real processes, real signals.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from launch_util import (
    DEMO,
    GPT_WORKLOAD,
    REFERENCE_STEPS,
    REPO,
    LaunchResult,
    assert_no_survivors,
    launch,
    read_events,
    wait_for,
)

STEPS = REFERENCE_STEPS  # their digests are the shared reference run's (gpt_reference)
SLOW = ("--step-delay", "0.15")


@pytest.fixture(scope="module")
def baseline(gpt_reference: LaunchResult) -> LaunchResult:
    return gpt_reference


def one_view_per_epoch(result: LaunchResult) -> None:
    """No split brain: every epoch was committed at most once, and epochs only grew."""
    epochs = [v["epoch"] for v in result.of("view_committed")]
    assert max(Counter(epochs).values()) == 1, epochs
    assert epochs == sorted(epochs)


def test_hung_rank_is_fenced_by_kill_and_swapped(tmp_path: Path, baseline: LaunchResult) -> None:
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--chaos", "stop:rank=1:step=6:at=allreduce",
                    steps=STEPS)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest
    failed = result.of("member_failed")
    assert [f["detected_by"] for f in failed] == ["heartbeat"]
    stopped_at = result.of("chaos_injected")[0]["ts"]
    # Detected by missed heartbeats (failure_timeout 2 s), well before any survivor's collective timeout
    # (pg_timeout 10 s) could have fired; the bounds leave room for a loaded CI machine.
    assert failed[0]["ts"] - stopped_at < 2.0 + 5.0
    assert result.of("swap_completed")[0]["ts"] - stopped_at < 2.0 + 20.0
    one_view_per_epoch(result)


def test_second_failure_during_swap_converges(tmp_path: Path, baseline: LaunchResult) -> None:
    result = launch(tmp_path, "--nproc", "4", "--spares", "2", "--chaos", "kill:rank=2:step=6",
                    "--chaos", "kill:rank=0:step=6:at=recovery", steps=STEPS)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest
    assert sorted(f["rank"] for f in result.of("member_failed")) == [0, 2]
    assert sorted(s["rank"] for s in result.of("swap_completed")) == [0, 2]
    one_view_per_epoch(result)


def test_two_simultaneous_kills_with_two_spares(tmp_path: Path, baseline: LaunchResult) -> None:
    result = launch(tmp_path, "--nproc", "4", "--spares", "2", "--chaos", "kill:rank=1:step=6",
                    "--chaos", "kill:rank=3:step=6", steps=STEPS)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest
    assert sorted(s["rank"] for s in result.of("swap_completed")) == [1, 3]
    one_view_per_epoch(result)



def both_in_backward(step: int) -> tuple[str, ...]:
    """Kill seat 2 and its buddy, seat 3, in the same swap.

    Killed at the start of a step, seat 3 can lose the race: when seat 2's death is detected before
    seat 3 has passed that boundary (fast detection, or seat 3 descheduled on a loaded machine), seat
    3 pauses there, the view refilling seat 2 from seat 3's copy commits, and seat 3 dies only in the
    next round, with its own copy safe on seat 0: a correct in-memory recovery, not the loss this
    test is about. Killed in the step's backward, seat 2 dies a forward pass after both left the
    previous step's all-reduce together, by when seat 3 is past its boundary. The two deaths are
    tens of milliseconds apart: a view committed on early answers in between refills one seat, but
    nothing holds a copy of seat 2's state when the other dies (its replacement or its buddy had
    not taken one yet), so the job ends for the same reason either way.
    """
    return ("--chaos", f"kill:rank=2:step={step}:at=backward", "--chaos", f"kill:rank=3:step={step}:at=backward")

def test_rank_and_its_buddy_lost_stops_with_error_naming_the_seat(tmp_path: Path) -> None:
    # Seat 2's snapshot copy lives on seat 3: losing both loses seat 2's state. Both die in step 6's
    # backward (both_in_backward): seat 3 has passed its step boundary before seat 2's death can be known.
    result = launch(tmp_path, "--nproc", "4", "--spares", "2", *both_in_backward(6), steps=STEPS, timeout=120)
    assert result.returncode != 0
    failed = result.of("job_failed")
    assert len(failed) == 1
    # Usually no copy of seat 2's state survives anywhere. Where a view committed between the deaths refilled one of
    # them, the seats' copies can share no step: the reason names the step held for the most seats and a seat
    # it is missing for.
    reason = failed[0]["reason"]
    assert "seat 2" in reason and "no copy of its state survives" in reason or (
        "no snapshot step common" in reason and re.search(r"but seat\(s\) \[[23]", reason)), reason
    assert "job FAILED" in result.output


@pytest.mark.parametrize("point", ["boundary", "allreduce"])
def test_partitioned_member_cannot_split_the_brain(tmp_path: Path, baseline: LaunchResult, point: str) -> None:
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--no-fence-kill",
                    "--chaos", f"partition:rank=1:step=6:at={point}", steps=STEPS,
                    script_args=("--step-delay", "0.3"),  # the steps after the cut outlast the failure timeout
                    env={"DEADPOOL_VIEW_TIMEOUT": "10"})
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest
    one_view_per_epoch(result)
    cut = result.of("chaos_injected")[0]
    victim = cut["member"]
    assert [f["member"] for f in result.of("member_failed")] == [victim]
    # Its gloo sockets still work, and on one host its gate needs no message (its buddy maps its
    # slots and every snapshot is confirmed in place), so the cut member goes on training in
    # lockstep with the others until the coordinator declares it dead (failure_timeout) and the
    # others pause. Every step it finishes after the cut is in the epoch of the cut. At most one
    # of them was not finished by every seat: the step whose all-reduce the others abandoned when
    # they paused (gloo may complete it for the member alone). The others roll back to a step
    # before it, so that state is never used.
    after_cut = [e for e in result.of("step_finished") if e["member"] == victim and e["ts"] > cut["ts"]]
    assert {e["epoch"] for e in after_cut} <= {cut["epoch"]}, after_cut
    alone = []
    for late in after_cut:
        together = {e["member"] for e in result.of("step_finished")
                    if (e["epoch"], e["step"]) == (late["epoch"], late["step"])}
        if len(together) != 4:
            alone.append(late["step"])
    (resumed,) = {e["step"] for e in result.of("restored")}
    assert len(alone) <= 1 and all(step > resumed for step in alone), (alone, resumed)
    assert not [e for e in result.of("restored") if e["member"] == victim]


def test_coordinator_restart_rebuilds_view_and_handles_next_failure(tmp_path: Path, baseline: LaunchResult) -> None:
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deadpool", "launch", "--events", str(events), "--nproc", "4", "--spares", "1",
         "--chaos", "kill:rank=2:step=12", str(DEMO), "--steps", str(STEPS), *GPT_WORKLOAD, *SLOW],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        started = wait_for(events, lambda ev: any(e["event"] == "step_finished" and e["step"] >= 3 for e in ev), 120)
        coordinator = next(e for e in started if e["event"] == "coordinator_started")
        os.kill(coordinator["pid"], signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    result = LaunchResult(proc.returncode, output, read_events(events), 0.0)
    assert_no_survivors(result)
    assert result.returncode == 0, output[-4000:]
    assert result.digest == baseline.digest
    assert len(result.of("coordinator_started")) == 2 and result.of("coordinator_started")[1]["recovering"]
    adopted = result.of("view_adopted")
    assert adopted, "the restarted coordinator learned the view from the members"
    failed = result.of("member_failed")
    assert len(failed) == 1 and failed[0]["rank"] == 2 and failed[0]["ts"] > adopted[0]["ts"]
    assert result.of("swap_completed")


def test_spare_joins_running_job_and_is_adopted_later(tmp_path: Path, baseline: LaunchResult) -> None:
    events = tmp_path / "events.jsonl"
    env = {**os.environ, "DEADPOOL_SECRET": "joining-spare-secret"}
    job = subprocess.Popen(
        [sys.executable, "-m", "deadpool", "launch", "--events", str(events), "--nproc", "4", "--spares", "0",
         "--chaos", "kill:rank=1:step=13", str(DEMO), "--steps", str(STEPS), *GPT_WORKLOAD, "--step-delay", "0.6"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    extra = None
    try:
        started = wait_for(events, lambda ev: any(e["event"] == "step_finished" for e in ev), 120)
        address = next(e for e in started if e["event"] == "coordinator_started")["address"]
        extra = subprocess.Popen(
            [sys.executable, "-m", "deadpool", "launch", "--events", str(events), "--nproc", "0", "--spares", "1",
             "--coordinator", address, str(DEMO), "--steps", str(STEPS), *GPT_WORKLOAD, "--step-delay", "0.6"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
        joined = wait_for(events, lambda ev: any(e["event"] == "view_committed" and e["spares"] for e in ev), 120)
        joined_at_step = max(e["step"] for e in joined if e["event"] == "step_finished")
        assert joined_at_step < 13, "the spare must join before the failure for this test to mean anything"
        output, _ = job.communicate(timeout=240)
        extra_output, _ = extra.communicate(timeout=60)
    finally:
        for proc in (job, extra):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    result = LaunchResult(job.returncode, output, read_events(events), 0.0)
    assert_no_survivors(result)
    assert result.returncode == 0, output[-4000:]
    assert extra.returncode == 0, extra_output[-3000:]
    assert result.digest == baseline.digest
    swap = result.of("swap_completed")
    assert len(swap) == 1 and swap[0]["rank"] == 1 and ":spare0:" in swap[0]["new_member"]


def test_rank_and_its_buddy_lost_falls_back_to_disk_checkpoint(tmp_path: Path, baseline: LaunchResult) -> None:
    checkpoints = tmp_path / "checkpoints"
    result = launch(tmp_path, "--nproc", "4", "--spares", "2", "--checkpoint-dir", str(checkpoints),
                    "--checkpoint-every", "4", *both_in_backward(10), steps=STEPS)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest, "rolled back to disk, and still bit-identical"
    fallback = result.of("disk_fallback")
    assert len(fallback) == 1 and fallback[0]["resume_step"] == 7
    restored = result.of("restored")
    assert restored and all(r["source"] == "disk" and r["step"] == 7 for r in restored)
    assert {r["rank"] for r in restored} == {0, 1, 2, 3}
    assert sorted(s["rank"] for s in result.of("swap_completed")) == [2, 3]


def test_a_failed_job_relaunched_with_resume_goes_on_from_its_disk_checkpoint(
        tmp_path: Path, baseline: LaunchResult) -> None:
    checkpoints = ("--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "4")
    failed = launch(tmp_path, "--nproc", "4", "--spares", "0", *checkpoints, "--chaos", "kill:rank=1:step=10",
                    steps=STEPS)
    assert failed.returncode != 0 and "--resume" in failed.of("job_failed")[0]["reason"]
    again = launch(tmp_path, "--nproc", "4", "--spares", "0", *checkpoints, steps=STEPS)
    assert again.returncode != 0 and "from an earlier run" in again.of("job_failed")[0]["reason"], \
        "a run from step 0 never mixes its checkpoints with an earlier run's"
    resumed = launch(tmp_path, "--nproc", "4", "--spares", "0", *checkpoints, "--resume", steps=STEPS)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.digest == baseline.digest, "the failed run and its resumed relaunch: the run without failures"
    restored = resumed.of("restored")
    assert {r["rank"] for r in restored} == {0, 1, 2, 3} and {(r["source"], r["step"]) for r in restored} == {
        ("disk", 7)}
    assert min(e["step"] for e in resumed.of("step_finished")) == 8
