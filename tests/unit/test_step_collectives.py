"""A step's collectives without a job: poisoning, interrupts told apart from failures, and chaos points.

The process group is a stand-in whose operations never complete (a SIGSTOPped peer) or raise
(a SIGKILLed one); the Handoff is the real one, bound to a recorder instead of the runtime thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from test_mesh import Sums  # the gloo stand-in of the mesh tests (tests/unit is on the import path)

from deadpool.actors.handoff import Handoff
from deadpool.actors.inbox import Drain
from deadpool.chaos import ChaosAction, ChaosPoint, ChaosSpec
from deadpool.config import WorkerEnv
from deadpool.errors import CollectiveAborted
from deadpool.events.log import EventLog
from deadpool.protocol.messages import ChaosInjected, CollectiveFailed, Prepare
from deadpool.protocol.view import DISK_SOURCE, View
from deadpool.worker.faults import FaultInjector
from deadpool.worker.groups.communicators import Communicators
from deadpool.worker.groups.hub import GroupCollectives
from deadpool.worker.groups.mesh import MeshDim, MeshGroup
from deadpool.worker.groups.waits import Waiter
from deadpool.worker.lost_step import AbandonableBackward
from deadpool.worker.step import StepState


class Pending:
    """A dist.Work that never completes."""

    def get_future(self) -> torch.futures.Future[object]:
        return torch.futures.Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert timeout is not None, "never completes: an untimed wait would never return"
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


class Group:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def allreduce(self, tensors: list[torch.Tensor]) -> Pending:
        if self.fail:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        return Pending()


def view(epoch: int = 1, world: int = 2) -> View:
    seats = [f"m{i}" for i in range(world)]
    return View(epoch, seats, [], -1, f"epoch-{epoch}", "127.0.0.1:1", {}, {}, [1, 0], {})


class Recorder:
    """Stands in for the runtime thread: records posts and hands every Drain marker at once."""

    def __init__(self) -> None:
        self.posted: list[Any] = []

    def __call__(self, message: Any) -> None:
        self.posted.append(message)
        if isinstance(message, Drain):
            message.done()


def make(chaos: tuple[ChaosSpec, ...] = (), gate: bool = True) -> tuple[GroupCollectives, StepState, Handoff, Recorder]:
    env = WorkerEnv.from_env({"DEADPOOL_COORDINATOR": "tcp://127.0.0.1:1", "DEADPOOL_MEMBER_ID": "m0", "RANK": "0"})
    env = dataclasses.replace(env, chaos=chaos)
    state = StepState(view=view(), rank=0, step=7)
    handoff, recorder = Handoff(), Recorder()
    handoff.bind(recorder)
    events = EventLog(None, member="m0", source="worker")
    injector = FaultInjector(env, state, handoff, events, partition=type("Switch", (), {"cut": False})())
    collectives = GroupCollectives("m0", state, handoff, events, injector, lambda: gate, timeout=5.0,
                                   bind_host="127.0.0.1", communicators=Communicators(events))
    return collectives, state, handoff, recorder


def test_a_failed_all_reduce_poisons_the_step_retires_the_group_and_is_reported() -> None:
    collectives, state, _, recorder = make()
    collectives.group = Group(fail=True)
    assert collectives.issue_allreduce(torch.zeros(4)) is None
    assert state.poison is not None and "Connection closed" in state.poison
    assert collectives.group is None, "a failed group is retired, never reused"
    [failed] = [m for m in recorder.posted if isinstance(m, CollectiveFailed)]
    assert (failed.sender, failed.epoch, failed.step) == ("m0", 1, 7)


def test_an_all_reduce_interrupted_by_a_prepare_poisons_the_step_without_a_report() -> None:
    collectives, state, handoff, recorder = make()
    collectives.group = Group()
    work = collectives.issue_allreduce(torch.zeros(4))
    assert work is not None
    threading.Timer(0.05, handoff.deliver, args=(Prepare(2, [1], "m1 died"),)).start()
    assert collectives.await_allreduces([work]) is False
    assert state.poison is not None and collectives.group is None
    assert not [m for m in recorder.posted if isinstance(m, CollectiveFailed)], "the coordinator asked: no report"


def test_nothing_is_issued_when_the_gate_refuses() -> None:
    collectives, state, _, _ = make(gate=False)
    collectives.group = Group()
    assert collectives.issue_allreduce(torch.zeros(4)) is None
    assert collectives.group is not None and state.poison is None  # the gate poisons, not the collective


def test_the_waiter_tells_an_interrupt_from_a_timeout() -> None:
    condition = threading.Condition()
    with pytest.raises(CollectiveAborted) as interrupted:
        Waiter(condition, lambda: True).wait(Pending(), "gradient all-reduce", 5.0)  # type: ignore[arg-type]
    assert interrupted.value.interrupted
    with pytest.raises(CollectiveAborted) as timed_out:
        Waiter(condition, lambda: False).wait(Pending(), "gradient all-reduce", 0.01)  # type: ignore[arg-type]
    assert not timed_out.value.interrupted


def test_without_chaos_a_point_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    collectives, _, _, recorder = make()
    monkeypatch.setattr("deadpool.chaos.inject", lambda spec, switch: pytest.fail("nothing may fire"))
    for point in ChaosPoint:
        collectives.fault_point(point)
    assert recorder.posted == []


def test_a_due_spec_is_reported_and_flushed_before_it_fires_once(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ChaosSpec(ChaosAction.KILL, rank=0, step=7, at=ChaosPoint.BACKWARD)
    collectives, _, _, recorder = make(chaos=(spec,))
    fired: list[tuple[ChaosSpec, list[Any]]] = []
    monkeypatch.setattr("deadpool.chaos.inject", lambda s, switch: fired.append((s, list(recorder.posted))))
    collectives.fault_point(ChaosPoint.ALLREDUCE)  # another point of the same step
    assert fired == []
    collectives.fault_point(ChaosPoint.BACKWARD)
    collectives.fault_point(ChaosPoint.BACKWARD)  # fired already
    [(what, before)] = fired
    assert what == spec
    assert [type(m) for m in before] == [ChaosInjected, Drain], "the report is handed over before the signal"


def test_the_disk_marker_is_the_views() -> None:
    disk = View(3, ["a", "b"], [], 10, "epoch-3", "h:1", {}, {}, [1, 0], {0: DISK_SOURCE, 1: DISK_SOURCE})
    assert disk.restores_from_disk(0) and disk.restores_from_disk(1)
    buddy = View(3, ["a", "b"], [], 10, "epoch-3", "h:1", {}, {}, [1, 0], {1: "a"})
    assert not buddy.restores_from_disk(1) and not buddy.restores_from_disk(0)


def backward_through(group: MeshGroup, prepare_after: int | None, handoff: Handoff) -> torch.Tensor:
    """A backward whose every node all-reduces its gradient on `group` (as DTensor's do); a Prepare comes after
    the `prepare_after`-th.  Returns the leaf, whose gradient says how far the backward ran."""
    x = torch.ones(2, requires_grad=True)
    y, seen = x, [0]
    for _ in range(3):
        y = y * 1.0

        def hook(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            group.allreduce([grad]).wait()
            seen[0] += 1
            if seen[0] == prepare_after:
                handoff.deliver(Prepare(2, [3], "m3 died"))
            return grad

        y.register_hook(hook)
    y.sum().backward()
    return x


@contextlib.contextmanager
def tp_seat(resets: list[int] | None = None) -> Iterator[tuple[GroupCollectives, StepState, Handoff, Sums, MeshDim,
                                                               MeshGroup]]:
    """Seat 0's tp group {0, 1} on a gloo stand-in that counts what it is given, with the wrapper around
    ``torch.autograd.backward`` installed (it appends the step to `resets` where FSDP2 would be reset)."""
    collectives, state, handoff, _ = make()
    backward = AbandonableBackward(None if resets is None else lambda: resets.append(state.step))
    backward.install()
    try:
        inner = Sums()
        dim = MeshDim("tp", "deadpool:tp:0", (0, 1), inner=inner, members=("a", "b"))
        yield collectives, state, handoff, inner, dim, MeshGroup(dim, collectives, 0)
    finally:
        backward.uninstall()


def test_a_step_lost_before_its_backward_stops_at_the_first_mesh_collective_and_issues_no_other() -> None:
    """The Prepare came during the forward (whose collectives were issued): the backward stops at its first
    collective, FSDP2's iteration is reset, and every later collective of the step, the clipping's after the
    backward too, completes locally without leaving the healthy group dirty.  The next step runs whole."""
    resets: list[int] = []
    with tp_seat(resets) as (_, state, handoff, inner, dim, group):
        group.allreduce([torch.ones(2)]).wait()  # the forward's
        handoff.deliver(Prepare(2, [3], "m3 died"))
        x = backward_through(group, None, handoff)
        assert x.grad is None and resets == [7], "the backward stopped at once, and FSDP2 was reset"
        assert state.abandoned and inner.issued == 1
        t = torch.ones(2)
        group.allreduce([t]).wait()  # the clipping's
        assert t.tolist() == [1.0, 1.0] and inner.issued == 1 and not dim.dirty and not dim.broken
        state.step, state.abandoned, state.backward_issued, state.poison = 8, False, False, None  # the next step
        state.view = view(epoch=2)
        x = backward_through(group, None, handoff)
        assert x.grad is not None and inner.issued == 4 and state.backward_issued and resets == [7]


def test_a_step_lost_after_its_backward_issued_a_collective_runs_to_its_end() -> None:
    """A seat of a healthy group that issued a backward collective before the Prepare came cannot know its peer
    stops before issuing it: it issues every later one (the peer that stopped ends its waits, ``PeerPaused``)."""
    with tp_seat() as (collectives, state, handoff, inner, _, group):
        x = backward_through(group, 1, handoff)
        assert collectives.step_lost() and not state.abandoned
        assert x.grad is not None and inner.issued == 3, "the backward ran whole"


def test_a_step_whose_forward_stopped_issues_nothing_more_and_stops_its_backward() -> None:
    """A mesh seat's lost forward stopped at a submodule (``AbandonableForward``): the step's later collectives
    outside a backward complete locally, the stand-in's backward stops at its first collective (FSDP2 reset),
    and the pause notice will say the forward stopped (peers end any wait of the step on this seat)."""
    resets: list[int] = []
    with tp_seat(resets) as (collectives, state, handoff, inner, dim, group):
        group.allreduce([torch.ones(2)]).wait()  # a forward collective before the Prepare
        handoff.deliver(Prepare(2, [3], "m3 died"))
        collectives.abandon_forward()
        assert collectives.abandoned() and state.forward_abandoned and not state.abandoned
        t = torch.ones(2)
        group.allreduce([t]).wait()  # a later one outside a backward (the root's, the clipping's)
        assert t.tolist() == [1.0, 1.0] and inner.issued == 1 and not dim.dirty
        x = backward_through(group, None, handoff)
        assert x.grad is None and resets == [7] and state.abandoned and inner.issued == 1
