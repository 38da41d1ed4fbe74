"""Silent data corruption: a flipped bit in one seat's replicated state is found, the seat replaced, the run exact.

Real processes flip a real bit (``corrupt:`` chaos) in their live tensors after the optimizer step; nothing
crashes. The replica checks (on by default) find the seat whose checksum disagrees with the others', the
coordinator fences it, a spare takes its seat and every seat rolls back to the newest step whose checks
passed: the run ends with the failure-free digest. With no spare left the job stops naming the seat and the
step; with the checks off the same flip ends with another digest (the chaos is real). A local gradient
corrupted at every step from one on (a faulty chip), which every replica averages alike, is found by
``--audit``: the spare re-does the seats' steps in turn and finds the seat whose gradients differ.
"""

from __future__ import annotations

from pathlib import Path

from launch_util import REFERENCE_STEPS, LaunchResult, launch

JOB = ("--nproc", "4", "--no-progress")
FLIP_STEP = 6


def test_a_flipped_parameter_bit_is_found_the_seat_replaced_and_the_run_ends_bit_identical(
        tmp_path: Path, gpt_reference: LaunchResult) -> None:
    result = launch(tmp_path, *JOB, "--spares", "1", "--chaos", f"corrupt:rank=2:step={FLIP_STEP}:what=param",
                    steps=REFERENCE_STEPS)
    assert result.returncode == 0, result.output[-3000:]
    (flipped,) = result.of("chaos_injected")
    assert flipped["action"] == "corrupt" and flipped["tensor"] and flipped["step"] == FLIP_STEP
    (suspected,) = result.of("sdc_suspected")
    assert suspected["seats"] == [2] and suspected["detector"] == "replica_check"
    (confirmed,) = result.of("sdc_confirmed")
    assert confirmed["rank"] == 2 and FLIP_STEP <= confirmed["step"] <= FLIP_STEP + 1, confirmed
    # Half the replicated state is checked per step (the default): the part found bad was last seen good two
    # checked steps before the mismatch.
    assert confirmed["rollback_step"] == confirmed["step"] - 2, "the newest step whose checks passed on every seat"
    (failed,) = result.of("member_failed")
    assert failed["detected_by"] == "replica_check" and failed["rank"] == 2
    (commit,) = [v for v in result.of("view_committed") if v.get("trigger") == "corruption"]
    assert commit["resume_step"] == confirmed["rollback_step"] and commit["failed_seats"] == [2]
    assert result.digest == gpt_reference.digest, "the run must end as if the bit had never flipped"


def test_corruption_with_no_spare_left_stops_the_job_naming_the_seat_and_the_step(tmp_path: Path) -> None:
    result = launch(tmp_path, *JOB, "--spares", "0", "--chaos", f"corrupt:rank=1:step={FLIP_STEP}:what=optim",
                    steps=REFERENCE_STEPS)
    assert result.returncode != 0, "a run must never finish on corrupt state"
    (confirmed,) = result.of("sdc_confirmed")
    assert confirmed["rank"] == 1
    (failed,) = result.of("job_failed")
    reason = failed["reason"]
    assert "silent data corruption" in reason and "seat 1" in reason and f"step {confirmed['step']}" in reason
    assert not result.of("training_finished")


def test_with_the_checks_off_the_same_flip_ends_with_another_digest(tmp_path: Path,
                                                                   gpt_reference: LaunchResult) -> None:
    result = launch(tmp_path, *JOB, "--spares", "1", "--replica-checks", "0",
                    "--chaos", f"corrupt:rank=2:step={FLIP_STEP}:what=param", steps=REFERENCE_STEPS)
    assert result.returncode == 0, result.output[-3000:]
    assert result.of("chaos_injected") and not result.of("sdc_suspected") and not result.of("member_failed")
    assert result.digest and result.digest != gpt_reference.digest, "the flip is real: unchecked, it changes the run"


def test_an_audit_finds_a_seat_that_corrupts_its_gradients_at_every_step(tmp_path: Path,
                                                                         gpt_reference: LaunchResult) -> None:
    result = launch(tmp_path, *JOB, "--spares", "1", "--audit",
                    "--chaos", f"corrupt:rank=1:step={FLIP_STEP}:what=grad:every=1", steps=REFERENCE_STEPS)
    assert result.returncode == 0, result.output[-3000:]
    assert not [e for e in result.of("sdc_suspected") if e["detector"] != "audit"], "replicas agree: no check sees it"
    (confirmed,) = result.of("sdc_confirmed")
    assert confirmed["rank"] == 1 and confirmed["detector"] == "audit" and confirmed["step"] >= FLIP_STEP
    assert confirmed["rollback_step"] < FLIP_STEP, "back to the seat's last clean audit, before the fault began"
    (commit,) = [v for v in result.of("view_committed") if v.get("trigger") == "corruption"]
    assert commit["resume_step"] <= confirmed["rollback_step"] and commit["failed_seats"] == [1]
    assert result.digest == gpt_reference.digest, "the run must end as if the chip had never been faulty"
    print(f"found at step {confirmed['step']}, {confirmed['step'] - FLIP_STEP} step(s) after the fault began; "
          f"resumed from step {commit['resume_step']}")


def test_a_spare_that_audits_takes_a_dead_seat_at_once_and_the_run_ends_bit_identical(
        tmp_path: Path, gpt_reference: LaunchResult) -> None:
    result = launch(tmp_path, *JOB, "--spares", "1", "--audit", "--chaos", f"kill:rank=3:step={FLIP_STEP}",
                    steps=REFERENCE_STEPS)
    assert result.returncode == 0, result.output[-3000:]
    (failed,) = result.of("member_failed")
    assert failed["rank"] == 3 and failed["detected_by"] == "exit"
    assert not result.of("sdc_suspected"), "audits of clean steps find nothing"
    assert result.digest == gpt_reference.digest
