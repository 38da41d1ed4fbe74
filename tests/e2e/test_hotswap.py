"""End to end: real processes, real gloo groups, real ZeroMQ sockets, real SIGKILLs.

The strongest test we have: a run with injected failures ends with the same
final state digest as the same run without failures.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch
from conftest import References
from launch_util import DEMO, REFERENCE_STEPS, TINY, TINY_JOB, LaunchResult, launch

from deadpool.snapshot import shm

STEPS = REFERENCE_STEPS  # kills land in step 8, half way, with snapshots of every earlier step taken


@pytest.fixture(scope="module")
def baseline(gpt_reference: LaunchResult) -> LaunchResult:
    return gpt_reference


def assert_swapped(result: LaunchResult, baseline: LaunchResult, seat: int) -> None:
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest, "a run with a failure must end bit-identical"
    failed = result.of("member_failed")
    assert [f["rank"] for f in failed] == [seat]
    assert failed[0]["detected_by"] in ("exit", "heartbeat", "collective_error")
    swaps = [v for v in result.of("view_committed") if v.get("failed_seats")]
    assert len(swaps) == 1 and swaps[0]["failed_seats"] == [seat]
    assert ":spare0:" in swaps[0]["seats"][seat], "the spare sits in the dead rank's seat"
    restored = [r for r in result.of("restored") if r["source"] == "buddy"]
    assert len(restored) == 1 and restored[0]["rank"] == seat and restored[0]["bytes"] > 1_000_000
    completed = result.of("swap_completed")
    assert len(completed) == 1 and completed[0]["rank"] == seat
    assert 0 < completed[0]["recovery_s"] < 60
    finished = result.of("training_finished")
    assert finished and finished[0]["step"] == STEPS - 1
    # Every step of the job was finished by the member sitting in seat `seat` at the end.
    last_member = swaps[0]["seats"][seat]
    steps_by_spare = {e["step"] for e in result.of("step_finished") if e["member"] == last_member}
    assert max(steps_by_spare) == STEPS - 1


def test_kill_at_step_boundary_swaps_spare_in_bit_identical(tmp_path: Path, baseline: LaunchResult) -> None:
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--chaos", "kill:rank=2:step=8", steps=STEPS)
    assert_swapped(result, baseline, seat=2)
    assert "swap: rank 2 back in" in result.output
    assert result.of("chaos_injected")[0]["step"] == 8


def _shm_files_left(result: LaunchResult) -> list[str]:
    """Snapshot slot files of this job's workers still in /dev/shm (their agent removes them)."""
    joined = [e for e in result.of("member_joined") if e.get("source_process") == "worker"]
    return [path for e in joined
            for path in glob.glob(shm.slot_path("/dev/shm", e["member"], int(e["pid"]), 0)[:-1] + "*")]


def test_kill_with_buddy_copies_over_tcp_on_one_host_is_bit_identical(tmp_path: Path, baseline: LaunchResult) -> None:
    """`--shm-dir ""` forces the TCP path on one host; the baseline's buddies mapped their wards' slots."""
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--shm-dir", "", "--chaos", "kill:rank=2:step=8",
                    steps=STEPS)
    assert_swapped(result, baseline, seat=2)
    over_tcp = result.of("snapshot_memory")
    assert len(over_tcp) == 4
    assert all(m["buddy_copies_shared_bytes"] == 0 and m["buddy_copies_bytes"] > 0 for m in over_tcp)
    if os.path.isdir("/dev/shm"):
        shared = baseline.of("snapshot_memory")
        assert len(shared) == 4
        assert all(m["buddy_copies_shared_bytes"] > 0 and m["buddy_copies_bytes"] == 0 for m in shared)
        assert not _shm_files_left(baseline)
    assert not _shm_files_left(result)


def test_kill_mid_backward_is_bit_identical(tmp_path: Path, baseline: LaunchResult) -> None:
    result = launch(
        tmp_path, "--nproc", "4", "--spares", "1", "--chaos", "kill:rank=2:step=8:at=backward", steps=STEPS
    )
    assert_swapped(result, baseline, seat=2)


def test_kill_rank0_during_allreduce_is_bit_identical(tmp_path: Path, baseline: LaunchResult) -> None:
    result = launch(
        tmp_path, "--nproc", "4", "--spares", "1", "--chaos", "kill:rank=0:step=8:at=allreduce", steps=STEPS
    )
    assert_swapped(result, baseline, seat=0)


def test_killed_spare_shrinks_pool_and_training_goes_on(tmp_path: Path, baseline: LaunchResult) -> None:
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--chaos", "kill:spare=0:after=2", steps=STEPS)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest
    failed = result.of("member_failed")
    assert len(failed) == 1 and ":spare0:" in failed[0]["member"]
    assert result.of("spare_lost")
    assert not [v for v in result.of("view_committed") if v.get("failed_seats")], "no seat changed"
    assert result.of("view_committed")[-1]["spares"] == []


def test_no_spare_left_stops_with_clear_error(tmp_path: Path) -> None:
    result = launch(
        tmp_path, "--nproc", "4", "--spares", "0", "--chaos", "kill:rank=1:step=5", steps=STEPS, timeout=120
    )
    assert result.returncode != 0
    assert "no spare is left" in result.output
    assert "job FAILED" in result.output
    failed = result.of("job_failed")
    assert len(failed) == 1 and "rank 1" in failed[0]["reason"]
    assert not result.of("training_finished")


@pytest.fixture(scope="module")
def zero_baseline(references: References) -> LaunchResult:
    return references.get(DEMO, ("--nproc", "4", "--spares", "1"), ("--zero",), STEPS)


@pytest.mark.parametrize("chaos", ["kill:rank=2:step=8", "kill:rank=1:step=8:at=broadcast"])
def test_zero_sharded_optimizer_state_comes_back_from_the_buddy(
    tmp_path: Path, baseline: LaunchResult, zero_baseline: LaunchResult, chaos: str,
) -> None:
    """With ZeroRedundancyOptimizer the dead seat's optimizer shard exists only in its buddy's copy."""
    seat = int(chaos.split("rank=")[1].split(":")[0])
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--chaos", chaos, steps=STEPS, script_args=("--zero",))
    assert_swapped(result, zero_baseline, seat=seat)
    restored = [r for r in result.of("restored") if r["source"] == "buddy"][0]
    full = [r for r in baseline.of("snapshot_memory") if r["rank"] == seat][0]["snapshot_bytes"]
    # The seat's snapshot is its parameters plus a quarter of the Adam state: about half the replicated one.
    assert restored["bytes"] < 0.6 * full


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the GPU snapshot path is covered by tests/test_snapshot_gpu_path.py's fakes",
)
GPU_ARGS = ("--device", "cuda")


@pytest.fixture(scope="module")
def gpu_baseline(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    result = launch(tmp_path_factory.mktemp("gpu"), "--nproc", "4", "--spares", "1", steps=STEPS,
                    script_args=GPU_ARGS)
    assert result.returncode == 0, result.output[-3000:]
    assert result.digest, result.output[-3000:]
    return result


@needs_cuda
@pytest.mark.parametrize("chaos", ["kill:rank=2:step=8", "kill:rank=1:step=8:at=allreduce"])
def test_gpu_kill_is_bit_identical(tmp_path: Path, gpu_baseline: LaunchResult, chaos: str) -> None:
    """The demo on the GPU (every worker on GPU LOCAL_RANK % count, deterministic kernels): snapshots
    go through the side stream into pinned memory, the spare restores onto its GPU."""
    seat = int(chaos.split("rank=")[1].split(":")[0])
    result = launch(tmp_path, "--nproc", "4", "--spares", "1", "--chaos", chaos, steps=STEPS, script_args=GPU_ARGS)
    assert_swapped(result, gpu_baseline, seat=seat)


def test_a_seat_lost_before_its_spare_joined_waits_for_the_spare(tmp_path: Path, references: References) -> None:
    # The spare is still starting (a slow import) when rank 1 dies: its launcher started it, so the seat
    # waits for it to join instead of failing the job for want of a spare.
    reference = references.get(TINY, TINY_JOB, (), 8)
    result = launch(tmp_path, "--nproc", "2", "--spares", "1", "--chaos", "kill:rank=1:step=2", steps=8,
                    script=TINY, script_args=("--spare-start-delay", "4"), timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == reference.digest
    failed, joined = result.of("member_failed")[0], [j for j in result.of("member_joined") if ":spare" in j["member"]]
    assert joined and joined[0]["ts"] > failed["ts"], "the spare joined after the failure"
    assert [s["rank"] for s in result.of("swap_completed")] == [1]
