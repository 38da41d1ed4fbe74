"""End to end, pipeline parallel: the Llama demo cut into two stages by torch.distributed.pipelining.

``demos/train_llama.py --pp 2 --fsdp`` on 4 seats: a (pp, dp, tp) = (2, 2, 1) mesh, stage 0 (the
embedding and the first block) on seats 0 and 1, stage 1 (the last block and the head) on seats 2
and 3, each stage sharded by FSDP2 over its data-parallel pair. Real processes, real gloo sends and
recvs between the stages, a real SIGKILL with one in flight and a real SIGSTOP; every run with a
failure must end with the failure-free run's digest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import References
from launch_util import REPO, LaunchResult, launch

LLAMA = REPO / "demos" / "train_llama.py"
STEPS = 12
PIPELINE = ("--size", "tiny", "--pp", "2", "--fsdp")
# The (pp, dp, tp) mesh [[[0], [1]], [[2], [3]]]: seat 1 runs stage 0 with seat 0 as its data-parallel peer and
# passes activations to seat 3.
GROUPS_OF_SEAT_1 = {"deadpool:pp:1-0", "deadpool:dp:0-0"}


def run(tmp_path: Path, *chaos: str) -> LaunchResult:
    args: list[str] = ["--nproc", "4", "--spares", "1"]
    for spec in chaos:
        args += ["--chaos", spec]
    return launch(tmp_path, *args, steps=STEPS, script=LLAMA, script_args=PIPELINE)


@pytest.fixture(scope="module")
def baseline(references: References) -> LaunchResult:
    return references.get(LLAMA, ("--nproc", "4", "--spares", "1"), PIPELINE, STEPS)


def test_the_last_stage_reports_the_loss_of_every_step(baseline: LaunchResult) -> None:
    by_rank: dict[int, list[int]] = {}
    for event in baseline.of("step_finished"):
        if "loss" in event:
            by_rank.setdefault(event["rank"], []).append(event["step"])
    assert by_rank == {2: list(range(STEPS)), 3: list(range(STEPS))}, "seats 2 and 3 run the last stage"


def test_a_kill_with_a_stages_send_in_flight_is_recovered_bit_identically(
    tmp_path: Path, baseline: LaunchResult,
) -> None:
    result = run(tmp_path, "kill:rank=1:step=5:at=p2p")
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest, "a pipelined run with a failure must end bit-identical"
    [injected] = result.of("chaos_injected")
    assert injected["at"] == "p2p" and injected["step"] == 5
    assert [f["rank"] for f in result.of("member_failed")] == [1]
    restored = {r["rank"]: r for r in result.of("restored")}
    assert restored[1]["source"] == "buddy", "the spare's stage comes from its buddy"
    rebuilt = {name for r in restored.values() for name in r.get("groups_rebuilt", [])}
    assert GROUPS_OF_SEAT_1 <= rebuilt
    assert "Traceback" not in result.output, "the user's loop never sees a traceback"


def test_a_hung_stage_is_fenced_and_replaced_bit_identically(tmp_path: Path, baseline: LaunchResult) -> None:
    result = run(tmp_path, "stop:rank=3:step=4")
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest
    [failed] = result.of("member_failed")
    assert failed["rank"] == 3
    assert "Traceback" not in result.output


def test_both_seats_of_one_pipeline_killed_are_replaced_bit_identically(
    tmp_path: Path, baseline: LaunchResult,
) -> None:
    """Seats 1 and 3 run the two stages of one pipeline (their copies live on seats 2 and 0): both die in step 5,
    in one swap or in two (the second during the replay's set-up), and two spares take their seats."""
    args = ["--nproc", "4", "--spares", "2", "--chaos", "kill:rank=1:step=5:at=p2p", "--chaos",
            "kill:rank=3:step=5:at=p2p"]
    result = launch(tmp_path, *args, steps=STEPS, script=LLAMA, script_args=PIPELINE)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest
    assert sorted(f["rank"] for f in result.of("member_failed")) == [1, 3]
    assert {r["rank"] for r in result.of("restored") if r["source"] == "buddy"} == {1, 3}
    assert "Traceback" not in result.output
