"""The abort path, on the NCCL stand-in: a collective whose peer died hangs until its communicator is aborted.

With ``DEADPOOL_NCCL_STANDIN=1`` every group runs on gloo with NCCL's failure semantics
(``deadpool/worker/groups/standin.py``): nothing raises when a peer dies, so every repair below goes through
the abort of the communicators that held the lost seat, as on NCCL.  One kill inside a collective per
parallelism, each ending with the digest of the failure-free run on plain gloo; and the proof that the
stand-in hangs: with its aborts switched off, the survivors wait out the collective timeout.
(``pytest --nccl-standin`` runs every e2e test on the stand-in.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import References
from launch_util import DEMO, REFERENCE_STEPS, REPO, TINY, LaunchResult, launch

from deadpool.config import Config

JOB = ("--nproc", "4", "--spares", "1")
LLAMA = REPO / "demos" / "train_llama.py"
EXPERTS = REPO / "tests" / "fixtures" / "expert_train.py"
STANDIN = {"DEADPOOL_NCCL_STANDIN": "1"}


def assert_repaired_by_abort(result: LaunchResult, reference: LaunchResult, seat: int) -> None:
    assert result.returncode == 0, result.output[-4000:]
    assert [f["rank"] for f in result.of("member_failed")] == [seat], result.output[-3000:]
    assert result.digest == reference.digest, "a repair on the stand-in must end bit-identical to plain gloo's run"
    aborted = result.of("groups_aborted")
    assert aborted, "the survivors aborted the communicators that held the lost seat"
    assert all(e["s"] >= 0 and e["groups"] for e in aborted)


# (script, script arguments, steps, spec, the seat killed): one kill inside a collective per parallelism.
CASES = {
    "ddp-allreduce": (DEMO, (), REFERENCE_STEPS, "kill:rank=2:step=9:at=allreduce", 2),
    "zero-broadcast": (DEMO, ("--zero",), REFERENCE_STEPS, "kill:rank=1:step=8:at=broadcast", 1),
    "fsdp-allgather": (LLAMA, ("--size", "tiny", "--fsdp"), 16, "kill:rank=1:step=6:at=allgather", 1),
    "fsdp-tp-reducescatter": (LLAMA, ("--size", "tiny", "--fsdp", "--tp", "2"), 6,
                              "kill:rank=1:step=3:at=reducescatter", 1),
    "pipeline-p2p": (LLAMA, ("--size", "tiny", "--pp", "2", "--fsdp"), 12, "kill:rank=1:step=5:at=p2p", 1),
    "experts-alltoall": (EXPERTS, (), 10, "kill:rank=1:step=5:at=forward", 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_kill_inside_a_collective_is_repaired_through_the_abort(tmp_path: Path, references: References,
                                                                  case: str) -> None:
    script, script_args, steps, spec, seat = CASES[case]
    reference = references.get(script, JOB, script_args, steps)
    result = launch(tmp_path, *JOB, "--chaos", spec, script=script, steps=steps, script_args=script_args,
                    env=STANDIN)
    assert_repaired_by_abort(result, reference, seat)


def test_without_the_abort_the_survivors_wait_out_the_collective_timeout(tmp_path: Path,
                                                                         references: References) -> None:
    """The stand-in's hang is real: with its aborts doing nothing, the stuck all-reduce holds the device, and the
    survivors' first collective after the swap waits until the collective timeout ends it (on NCCL: forever, or
    until torch's watchdog kills the process); the run still ends bit-identical."""
    reference = references.get(TINY, ("--nproc", "3", "--spares", "1"), (), 6)
    result = launch(tmp_path, "--nproc", "3", "--spares", "1", "--chaos", "kill:rank=1:step=3:at=allreduce",
                    script=TINY, steps=6, env={**STANDIN, "DEADPOOL_NCCL_STANDIN_ABORT": "0"})
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == reference.digest
    [swap] = result.of("swap_completed")
    assert swap["recovery_s"] >= 0.9 * Config().pg_timeout, swap
