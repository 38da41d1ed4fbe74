"""A seat lost during start-up, before any snapshot of it is confirmed, is repaired like any other.

The points: before the member joins (the first view seats the spare), while the first view's groups form
(``rt.device_mesh``'s before the loop, on a mesh), once the initial state's snapshot is taken but before the
buddy confirmed it, and an operator's ``deadpool chaos kill`` sent as soon as ``deadpool status`` first lists
the seats.  Each run ends with the failure-free digest: every seat starts from the initial state.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import References
from deadpool.tools import request
from deadpool.tools.chaos import send_chaos
from launch_util import REPO, TINY, LaunchResult, launch

from deadpool.agent import jobfile

LLAMA = REPO / "demos" / "train_llama.py"
DDP_JOB = ("--nproc", "3", "--spares", "1")
MESH_JOB = ("--nproc", "4", "--spares", "1")
MESH_ARGS = ("--size", "tiny", "--fsdp", "--tp", "2")
STEPS = 6


@pytest.fixture(scope="module")
def ddp_reference(references: References) -> LaunchResult:
    return references.get(TINY, DDP_JOB, (), STEPS)


@pytest.fixture(scope="module")
def mesh_reference(references: References) -> LaunchResult:
    return references.get(LLAMA, MESH_JOB, MESH_ARGS, STEPS)


def assert_started_again(result: LaunchResult, reference: LaunchResult, seat: int) -> None:
    """Seat `seat` failed before any step, a spare took it, and every seat began from the initial state."""
    assert result.returncode == 0, result.output[-4000:]
    assert [f["rank"] for f in result.of("member_failed")] == [seat], result.output[-3000:]
    assert [s["rank"] for s in result.of("swap_completed")] == [seat]
    assert {v["resume_step"] for v in result.of("view_committed")} == {-1}, "nothing was trained before the kill"
    # The spare builds the seat's initial state itself, or takes its copy where the buddy confirmed one first.
    assert [r["source"] for r in result.of("restored") if r["rank"] == seat] in (["initial"], ["buddy"])
    assert result.digest == reference.digest, "a start-up failure must end bit-identical to the failure-free run"


@pytest.mark.parametrize("point", ["join", "groups", "snapshot"])
def test_a_seat_killed_at_a_start_up_point_is_repaired(tmp_path: Path, ddp_reference: LaunchResult,
                                                       point: str) -> None:
    result = launch(tmp_path, *DDP_JOB, "--chaos", f"kill:rank=1:at={point}", script=TINY, steps=STEPS)
    assert_started_again(result, ddp_reference, 1)
    injected = result.of("chaos_injected")
    assert [(e["at"], e["step"]) for e in injected] == [(point, -1)]
    if point == "join":  # it never joined: the first view seats the spare
        first = result.of("view_committed")[0]
        assert first["epoch"] == 1 and first["failed_seats"] == [1]


def test_a_mesh_seat_killed_while_the_first_groups_form_is_repaired(tmp_path: Path,
                                                                    mesh_reference: LaunchResult) -> None:
    """FSDP2 x TP: rank 1 dies in rt.device_mesh, before the loop, while the others build the mesh's groups with
    it; they wrap their models on groups that complete locally, and the spare wraps for seat 1 the same way."""
    result = launch(tmp_path, *MESH_JOB, "--chaos", "kill:rank=1:at=groups", script=LLAMA, steps=STEPS,
                    script_args=MESH_ARGS)
    assert_started_again(result, mesh_reference, 1)


def kill_when_status_lists_the_seats(tmp_path: Path, launch_args: tuple[str, ...], script: Path,
                                     script_args: tuple[str, ...]) -> LaunchResult:
    """Launch a job and, as soon as ``deadpool status`` first lists its seats, ``deadpool chaos kill --rank 1``."""

    def kill_when_listed(_: Path) -> None:
        listed = None
        deadline = time.monotonic() + 120
        while listed is None and time.monotonic() < deadline:
            try:
                status = asyncio.run(request.fetch_status(jobfile.resolve(), timeout=1.0))
            except Exception:  # not up yet: no job file, or the coordinator not listening
                time.sleep(0.02)
                continue
            if status.get("seats"):
                listed = status["seats"]
        assert listed is not None, "deadpool status never listed the seats"
        assert all(seat["step"] == -1 for seat in listed), listed  # no step begun: start-up
        # In this process: a `deadpool chaos kill` of its own would spend the start-up importing itself.
        result = asyncio.run(send_chaos(jobfile.resolve(), "kill", rank=1))
        assert result.ok, result.detail

    return launch(tmp_path, "--no-progress", *launch_args, script=script, steps=STEPS, script_args=script_args,
                  during=kill_when_listed)


def test_an_operators_kill_as_status_first_lists_the_seats_is_repaired(tmp_path: Path,
                                                                       ddp_reference: LaunchResult) -> None:
    result = kill_when_status_lists_the_seats(tmp_path, DDP_JOB, TINY, ())
    assert_started_again(result, ddp_reference, 1)


@pytest.mark.full_matrix
def test_an_operators_kill_of_a_mesh_seat_as_status_first_lists_the_seats_is_repaired(
        tmp_path: Path, mesh_reference: LaunchResult) -> None:
    result = kill_when_status_lists_the_seats(tmp_path, MESH_JOB, LLAMA, MESH_ARGS)
    assert_started_again(result, mesh_reference, 1)
