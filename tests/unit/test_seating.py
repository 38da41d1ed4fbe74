"""A spare's seat before its view: the Prepare that chooses it tells rt.device_mesh where it sits."""

from __future__ import annotations

import types
from typing import Any

import pytest

from deadpool.actors.handoff import Fetch, Fetched, Handoff, PrepareReady, Progress
from deadpool.config import WorkerEnv
from deadpool.errors import CollectiveAborted, JobStopped
from deadpool.events.log import EventLog
from deadpool.protocol.messages import CollectiveFailed, CommitView, Prepare, Stop
from deadpool.protocol.view import View
from deadpool.snapshot.statetree import Manifest
from deadpool.worker.faults import FaultInjector
from deadpool.worker.recovery import Recovery, Seating
from deadpool.worker.step import StepState


def view(epoch: int, seats: list[str], spares: list[str]) -> View:
    return View(epoch, seats, spares, 7, f"epoch-{epoch}", "127.0.0.1:1", {}, {}, [1, 2, 3, 0], {})


def member(member_id: str, role: str, posted: list[Any] | None = None, state: StepState | None = None,
           progress: Progress | None = None, snapshots: Any = None) -> tuple[Recovery, Handoff]:
    """A member's Recovery; what a test leaves out it never touches (disk, collectives: none of either)."""
    env = WorkerEnv.from_env({"DEADPOOL_COORDINATOR": "tcp://127.0.0.1:1", "DEADPOOL_MEMBER_ID": member_id,
                              "DEADPOOL_ROLE": role})
    state, handoff = state or StepState(), Handoff()
    events = EventLog(None, member=member_id, source="worker")
    faults = FaultInjector(env, state, handoff, events, partition=type("Switch", (), {"cut": False})())
    unused: Any = None  # the tracked state and the samplers
    recovery = Recovery(env, state, handoff, progress or Progress(), events, snapshots,
                        types.SimpleNamespace(enabled=False), types.SimpleNamespace(subgroups=None), faults, unused,
                        unused)
    handoff.bind(posted.append if posted is not None else None)  # what the runtime thread would be handed
    return recovery, handoff


def spare(posted: list[Any] | None = None) -> tuple[Recovery, Handoff]:
    return member("s0", "spare", posted)


def test_the_prepare_that_chooses_a_spare_seats_it_before_the_view_commits() -> None:
    posted: list[Any] = []
    recovery, handoff = spare(posted)
    held = view(1, ["m0", "m1", "m2", "m3"], ["s0", "s1"])
    handoff.deliver(CommitView(held))  # a spare sits in the view's spares
    handoff.deliver(Prepare(2, [3], "seat 3 lost", {3: "s1"}))  # another spare chosen: not ours
    handoff.deliver(Prepare(3, [1, 3], "seat 1 lost too", {1: "s0", 3: "s1"}))
    assert recovery.wait_for_offer() == Seating(held, 1, first=False)
    assert recovery.wait_for_offer() == Seating(held, 1, first=False), "asked again: the same seat, nothing taken"
    # ... and it asked for the newest copies the view that seats it will most likely restore: seat 1's own
    # from its buddy (seat 2), the other seats' slices from their members, or, for the lost seat 3, its buddy's.
    # The slices are asked for once the copy says which step it is of (the seats may hold a newer one).
    fetches = [f for f in posted if isinstance(f, Fetch)]
    assert [(f.seat, f.part.value, f.member, f.newest) for f in fetches] == [(1, "held", "m2", True)]
    fetches[0].future.set_result(Fetched(6, Manifest(b"", (), 0), []))
    fetches = [f for f in posted if isinstance(f, Fetch)][1:]
    assert [(f.seat, f.part.value, f.member, f.step, f.newest) for f in fetches] == [
        (0, "slice", "m0", 6, False), (2, "slice", "m2", 6, False), (3, "slice", "m0", 6, False)]


def test_a_committed_view_that_seats_the_spare_is_its_offer_as_before() -> None:
    recovery, handoff = spare()
    seated = view(2, ["m0", "s0", "m2", "m3"], [])
    handoff.deliver(CommitView(seated))
    assert recovery.wait_for_offer() == Seating(seated, 1, first=False)


def test_an_adoption_a_newer_view_interrupted_is_not_reported_as_a_failure() -> None:
    """Reported, the coordinator would rebuild once more, interrupting the next adoption, and so on until it
    gave the job up; a failed adoption (a group that did not form) is reported."""
    posted: list[Any] = []
    recovery, _ = spare(posted)
    seated = view(2, ["m0", "s0", "m2", "m3"], [])

    def adopt(error: Exception) -> None:
        def raising(_view: View) -> int:
            raise error
        recovery._adopt = raising  # type: ignore[method-assign]
        assert recovery._adopt_with_retry(seated) is None

    adopt(CollectiveAborted("building group epoch-2", "interrupted by a newer view", interrupted=True))
    assert not [m for m in posted if isinstance(m, CollectiveFailed)]
    adopt(CollectiveAborted("process group epoch-2 (rank 1 of 4)", "did not form within 10s"))
    reports = [m for m in posted if isinstance(m, CollectiveFailed)]
    assert len(reports) == 1 and reports[0].epoch == 2 and "did not form" in reports[0].error


@pytest.mark.parametrize(("lost", "begun"), [(False, 19), (True, 20)])
def test_a_pause_tells_mesh_peers_the_last_step_it_began(lost: bool, begun: int) -> None:
    """Taken at the boundary after step 19, a Prepare leaves step 20 unbegun: no collective of it will come,
    and peers waiting in step 20 must hear so.  After the lost step 20 ran to its end, step 20 was begun."""
    state, progress = StepState(), Progress()
    state.view, state.step = view(1, ["m0", "m1", "m2", "m3"], ["s0"]), 20 if lost else 19
    progress.step = 19  # the last step it finished
    snapshots = types.SimpleNamespace(wait_copy=lambda timeout: 0.0, complete_steps=lambda: [18, 19])
    posted: list[Any] = []
    recovery, handoff = member("m3", "active", posted, state, progress, snapshots)
    handoff.deliver(Prepare(2, [2], "seat 2 lost", {2: "s0"}))
    handoff.deliver(Stop(False, "the test ends here"))
    with pytest.raises(JobStopped):
        recovery.recover()
    ready = [m for m in posted if isinstance(m, PrepareReady)]
    assert [(r.epoch, r.step, r.begun) for r in ready] == [(2, 19, begun)]
