"""End to end: a training script written the usual way survives kills and hangs bit-identically.

The script (tests/fixtures/cnn_train.py) is a BatchNorm + Dropout CNN fed by a
``StatefulDataLoader`` over a ``DistributedSampler`` with ``set_epoch`` at each epoch start,
OneCycleLR, gradient clipping and 2-step accumulation under ``no_sync()``.  An epoch is 4 steps,
so rollbacks cross epoch ends; each run ends with the digest of its failure-free run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import References
from launch_util import REPO, LaunchResult, launch

pytest.importorskip("torchdata.stateful_dataloader")

SCRIPT = REPO / "tests" / "fixtures" / "cnn_train.py"
STEPS = 12
SPARES = ("--nproc", "2", "--spares", "1")


def run(tmp_path: Path, *chaos: str, num_workers: int = 0, sampler: str = "torch") -> LaunchResult:
    args = [*SPARES]
    for spec in chaos:
        args += ["--chaos", spec]
    return launch(tmp_path, *args, steps=STEPS, script=SCRIPT,
                  script_args=("--num-workers", str(num_workers), "--sampler", sampler), timeout=180)


def _reference(references: References, num_workers: int) -> LaunchResult:
    result = references.get(SCRIPT, SPARES, ("--num-workers", str(num_workers), "--sampler", "torch"), STEPS)
    assert not result.of("data_loader_untracked"), "a tracked StatefulDataLoader must not be warned about"
    return result


@pytest.fixture(scope="module")
def reference0(references: References) -> LaunchResult:
    return _reference(references, 0)


@pytest.fixture(scope="module")
def reference2(references: References) -> LaunchResult:
    return _reference(references, 2)


def assert_recovered(result: LaunchResult, reference: LaunchResult, seat: int) -> None:
    assert result.returncode == 0, result.output[-4000:]
    assert [f["rank"] for f in result.of("member_failed")] == [seat], result.output[-3000:]
    assert [s["rank"] for s in result.of("swap_completed")] == [seat]
    assert [r["rank"] for r in result.of("restored") if r["source"] == "buddy"] == [seat]
    assert result.digest == reference.digest, "a run with a failure must end bit-identical to its failure-free run"


def test_actives_know_their_seat_before_the_loop(reference0: LaunchResult) -> None:
    """rt.rank / rt.is_spare before rt.steps(): each active its initial seat, the spare -1 / True."""
    assert "[rank0] cnn: seat 0 of 2" in reference0.output
    assert "[rank1] cnn: seat 1 of 2" in reference0.output
    assert "[spare0] cnn: spare" in reference0.output


def test_kill_at_an_epoch_end_boundary(tmp_path: Path, reference0: LaunchResult) -> None:
    """Killed before step 4: the restored step 3 is the last of epoch 0, the loader's pass exhausted."""
    assert_recovered(run(tmp_path, "kill:rank=1:step=4"), reference0, seat=1)


def test_kill_during_backward(tmp_path: Path, reference0: LaunchResult) -> None:
    """Killed inside step 6's backward, after the survivor drew step 6's batches and dropout masks."""
    assert_recovered(run(tmp_path, "kill:rank=1:step=6:at=backward"), reference0, seat=1)


def test_kill_of_rank_0_at_an_odd_step(tmp_path: Path, reference0: LaunchResult) -> None:
    assert_recovered(run(tmp_path, "kill:rank=0:step=7"), reference0, seat=0)


def test_sigstop_is_fenced_and_swapped(tmp_path: Path, reference0: LaunchResult) -> None:
    result = run(tmp_path, "stop:rank=1:step=9")
    assert_recovered(result, reference0, seat=1)
    assert [f["detected_by"] for f in result.of("member_failed")] == ["heartbeat"]


def test_kill_with_two_loader_workers(tmp_path: Path, reference2: LaunchResult) -> None:
    """num_workers=2: the workers' base seed and their position come back from the snapshot. The sampler is
    rt.distributed_sampler's here, torch's own in the reference: the same batches."""
    result = run(tmp_path, "kill:rank=1:step=6", num_workers=2, sampler="deadpool")
    assert_recovered(result, reference2, seat=1)
    # The agent reports the exit although the dead worker's DataLoader workers still hold its output pipe.
    assert [f["detected_by"] for f in result.of("member_failed")] == ["exit"]


@pytest.mark.parametrize("chaos", [(), ("--chaos", "kill:rank=1:step=3")], ids=["failure-free", "kill"])
def test_an_unseeded_model_starts_every_replica_as_seat_0s(tmp_path: Path, chaos: tuple[str, ...]) -> None:
    # torch's DDP broadcasts rank 0's parameters and buffers when it wraps a model; rt.ddp does it at the first
    # view (and at any view that resumes from the initial state), so the replicas, and the replacement, agree.
    result = launch(tmp_path, "--nproc", "3", "--spares", "1", *chaos, steps=6,
                    script=REPO / "tests" / "fixtures" / "unseeded_train.py", timeout=120)
    assert result.returncode == 0, result.output[-3000:]
    digests = dict(line.split()[-2:] for line in result.output.splitlines() if " params " in line and "-1" not in line)
    assert sorted(digests) == ["0", "1", "2"] and len(set(digests.values())) == 1, digests
    assert [s["rank"] for s in result.of("swap_completed")] == ([1] if chaos else [])
