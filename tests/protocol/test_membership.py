"""MembershipActor in one process: which coordinator messages it takes, in which order it hands them on,
and how its inbox keeps the compute thread's messages (and drain markers) in order and never drops one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import pytest_asyncio

from deadpool.actors.handoff import LEAVE_MARGIN, Handoff, leave_step
from deadpool.actors.inbox import Drain, Inbound, Outbound, PrepareArrived, ViewChanged
from deadpool.actors.membership import MembershipActor
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.link import CoordinatorLink
from deadpool.protocol.messages import (
    CommitView,
    Fenced,
    Finished,
    Hold,
    Holding,
    Leave,
    LeaveAt,
    Message,
    Prepare,
    PrepareAck,
    Recovered,
    Role,
    Stop,
    Takeover,
)
from deadpool.protocol.transport import Frame
from deadpool.protocol.view import View

pytestmark = pytest.mark.timeout(20)

ME, COORDINATOR = "m1", "inproc://coordinator"


def _view(epoch: int) -> View:
    return View(epoch, ["m0", ME], [], -1, f"epoch-{epoch}", "127.0.0.1:1", {}, {}, [1, 0], {})


class GatedTransport:
    """Records what is sent to the coordinator; while `gate` is clear, sends wait (a slow link)."""

    address = "inproc://m1"

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        assert address == COORDINATOR
        await self.gate.wait()
        message = codec.decode(bytes(frames[0]), None)
        assert not isinstance(message, codec.DecodeError)
        self.sent.append(message)


class Member:
    def __init__(self, agent_takes: bool = False) -> None:
        self.transport = GatedTransport()
        self.via_agent: list[Message] = []  # what the host agent took

        async def via_agent(frame: bytes) -> bool:
            if agent_takes:
                decoded = codec.decode(frame, None)
                assert not isinstance(decoded, codec.DecodeError)
                self.via_agent.append(decoded)
            return agent_takes

        self.handoff = Handoff()
        self.events = EventLog(None, member=ME)
        self.events.records = []
        self.to_snapshots: list[ViewChanged] = []
        self.order: list[str] = []  # what reached the snapshot side and the compute thread, in order
        original = self.handoff.deliver

        def deliver(command: Any) -> None:
            self.order.append(f"compute:{type(command).__name__}")
            original(command)

        self.handoff.deliver = deliver  # type: ignore[method-assign]

        def to_snapshots(item: ViewChanged | PrepareArrived) -> None:
            if not isinstance(item, ViewChanged):
                return  # the snapshot side's notice of a Prepare: not what these tests order
            self.order.append(f"snapshots:{item.view.epoch}")
            self.to_snapshots.append(item)

        self.actor = MembershipActor(ME, CoordinatorLink(COORDINATOR), self.transport, self.handoff, self.events,  # type: ignore[arg-type]
                                     to_snapshots, None, 1.0, asyncio.Event(), asyncio.Event(),
                                     (Role.ACTIVE, "h0", 101, "inproc://m1", "inproc://m1-bulk"), via_agent)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.actor.run())

    def rejected(self) -> list[str]:
        assert self.events.records is not None
        return [r["reason"] for r in (line.fields() for line in self.events.records) if r["event"] == "rejected"]


@pytest_asyncio.fixture
async def member() -> AsyncIterator[Member]:
    m = Member()
    yield m
    if m.task is not None:
        m.task.cancel()
        await asyncio.gather(m.task, return_exceptions=True)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


async def test_a_newer_view_reaches_the_snapshot_actor_before_the_compute_thread(member: Member) -> None:
    member.start()
    await member.actor.inbox.put(Inbound(CommitView(_view(2))))
    await until(lambda: member.handoff.poll() is not None)
    assert member.order == ["snapshots:2", "compute:CommitView"], (
        "a snapshot taken in the new view must never reach the snapshot actor before the view itself")
    assert member.actor.view == _view(2)


async def test_stale_views_and_prepares_are_refused_and_logged(member: Member) -> None:
    member.start()
    for message in (CommitView(_view(3)), CommitView(_view(3)), CommitView(_view(2)), Prepare(3, [0], "old"),
                    Prepare(4, [0], "m0 died")):
        await member.actor.inbox.put(Inbound(message))
    await until(lambda: len(member.order) >= 3 and len(member.rejected()) == 3)
    assert member.rejected() == ["stale_view", "stale_view", "stale_prepare"]
    assert member.order == ["snapshots:3", "compute:CommitView", "compute:Prepare"]
    assert [v.view.epoch for v in member.to_snapshots] == [3]


async def test_a_fence_for_someone_else_is_refused_and_ours_silences_the_member(member: Member) -> None:
    member.start()
    await member.actor.inbox.put(Inbound(Fenced("m0", 2, "declared dead")))
    await until(lambda: member.rejected() == ["misaddressed"])
    assert member.handoff.terminal is None
    await member.actor.inbox.put(Inbound(Fenced(ME, 2, "missed heartbeats")))
    await until(lambda: member.handoff.terminal is not None)
    member.actor.inbox.post(Outbound(Recovered(ME, 2, 7, 0.0)))
    done: list[bool] = []
    member.actor.inbox.post(Drain(lambda: done.append(True)))
    await until(lambda: bool(done))
    assert member.transport.sent == [], "a fenced member sends nothing more"


async def test_a_leave_is_answered_with_the_step_it_leaves_after_and_a_hold_stops_the_seat_there(
        member: Member) -> None:
    """The member leaves after the step its compute thread is in (the next one, if it is between two), and says
    which at once; a seat told to hold stops at that step's end only if it has not ended it, and a Prepare (a
    failure elsewhere) ends the hold."""
    member.start()
    handoff = member.handoff
    handoff.begin_step(5)
    await member.actor.inbox.put(Inbound(Leave("m0", 2, "operator move")))
    await until(lambda: member.rejected() == ["misaddressed"])
    await member.actor.inbox.put(Inbound(Leave(ME, 2, "operator move")))
    await until(lambda: bool(member.transport.sent))
    assert member.transport.sent == [LeaveAt(ME, 2, 5)]
    assert handoff.at_boundary(5)[0] == Leave(ME, 2, "operator move")
    await member.actor.inbox.put(Inbound(Hold(ME, 2, 5, "m0")))  # step 5 has ended here: too late to hold there
    await until(lambda: len(member.transport.sent) == 2)
    assert member.transport.sent[1] == Holding(ME, 2, 5), "the coordinator need not wait for this seat"
    assert member.events.records is not None
    assert [(r["step"], r["late"]) for r in (line.fields() for line in member.events.records)
            if r["event"] == "seat_held"] == [(5, True)]

    held = Handoff()  # another seat, told to hold
    held.begin_step(5)
    held.request_hold(Hold("m0", 2, 4, ME))
    assert held.at_boundary(5) == (None, False), "too late for step 4: it pauses inside step 6 instead"
    held.request_hold(Hold("m0", 2, 6, ME))
    assert held.at_boundary(6) == (None, True)
    assert held.at_boundary(7) == (None, False), "a hold is for one boundary"
    held.request_hold(Hold("m0", 2, 9, ME))
    held.deliver(Prepare(3, [0], "m0 died"))
    assert held.at_boundary(9) == (None, False), "a Prepare came first: the seat stopped for it"


def test_a_leave_that_comes_near_the_end_of_a_step_is_for_the_next_one() -> None:
    """The step a moving seat leaves after is the one in progress unless that step is expected to end within the
    margin: the other seats, a little ahead, would be told to hold too late and abandon the step they began."""
    assert leave_step(4, 0.0, None) == (5, "the step in progress (no step timed yet)")
    assert leave_step(4, 0.1, 1.0)[0] == 5
    assert leave_step(4, (1 - LEAVE_MARGIN) * 1.0 - 0.01, 1.0)[0] == 5
    step, why = leave_step(4, (1 - LEAVE_MARGIN) * 1.0 + 0.01, 1.0)
    assert step == 6 and "too close to its end" in why

    now = [0.0]
    handoff = Handoff(clock=lambda: now[0])
    for step in range(3):  # steps timed by the compute thread: each takes 0.2 s here
        handoff.begin_step(step)
        now[0] += 0.2
        handoff.at_boundary(step)
    handoff.begin_step(3)
    now[0] += 0.18
    assert handoff.request_leave(Leave(ME, 2, "operator move"))[0] == 4, "0.18 s into a 0.2 s step: the next"
    assert handoff.at_boundary(3) == (None, False), "not after the step it was in"
    handoff.begin_step(4)
    assert handoff.at_boundary(4)[0] == Leave(ME, 2, "operator move")
    handoff.begin_step(5)
    now[0] += 0.01
    assert handoff.request_leave(Leave(ME, 2, "operator move"))[0] == 5, "just begun: the step in progress"
    handoff.at_boundary(5)
    assert handoff.request_leave(Leave(ME, 2, "operator move"))[0] == 6, "between two steps: the next"
    handoff.begin_step(6)
    now[0] += 0.19
    assert handoff.request_leave(Leave(ME, 2, "operator move"))[0] == 7
    handoff.deliver(Prepare(3, [0], "m0 died"))
    assert handoff.at_boundary(6)[0] is not None, "after a failure's repair it leaves at the first boundary"


async def test_a_takeover_for_this_spare_reaches_its_compute_thread_and_one_for_another_is_refused(
        member: Member) -> None:
    member.start()
    await member.actor.inbox.put(Inbound(Takeover("m0", 2, 7, "m3")))
    await until(lambda: member.rejected() == ["misaddressed"])
    assert member.handoff.poll() is None
    await member.actor.inbox.put(Inbound(Takeover(ME, 2, 7, "m3")))
    await until(lambda: member.handoff.pending())
    assert member.handoff.poll() == Takeover(ME, 2, 7, "m3")


async def test_a_drain_marker_runs_only_after_every_earlier_message_was_handed_to_the_transport(
    member: Member,
) -> None:
    member.transport.gate.clear()  # the first send waits
    member.start()
    reports = [Recovered(ME, 1, step, 0.0) for step in range(3)]
    for report in reports:
        member.actor.inbox.post(Outbound(report))
    done: list[bool] = []
    member.actor.inbox.post(Drain(lambda: done.append(True)))
    await asyncio.sleep(0.05)
    assert not done, "the marker passed a message that was not sent yet"
    member.transport.gate.set()
    await until(lambda: bool(done))
    assert member.transport.sent == reports


async def test_the_compute_threads_messages_are_not_dropped_or_delayed_behind_a_full_peer_lane(
    member: Member,
) -> None:
    flood = [Inbound(Stop(True, f"noise {n}")) for n in range(256)]  # what a coordinator could queue up
    for item in flood:
        await member.actor.inbox.put(item)
    finished = Finished(ME, 1, 1, 39, "ab" * 32)
    member.actor.inbox.post(Outbound(finished))  # the peer lane is full: this must still be taken
    member.start()
    await until(lambda: bool(member.transport.sent))
    assert member.transport.sent == [finished]
    await until(lambda: member.actor.inbox.qsize() == (0, 0))
    assert member.order.count("compute:Stop") == 256


async def test_a_prepare_sent_again_directly_after_its_relay_reaches_the_compute_thread_once(member: Member) -> None:
    member.start()
    await member.actor.inbox.put(Inbound(CommitView(_view(3))))
    for message in (Prepare(4, [0], "m0 died", term=1), Prepare(4, [0], "m0 died", term=1),
                    Prepare(4, [0], "m0 died", term=2), Prepare(5, [0, 1], "grown", term=2)):
        await member.actor.inbox.put(Inbound(message))
    await until(lambda: len(member.order) >= 4)
    await asyncio.sleep(0.05)
    # The repeat is dropped; a newer term's Prepare of the same epoch (a takeover) and a grown round are not.
    assert member.order == ["snapshots:3", "compute:CommitView", "compute:Prepare", "compute:Prepare",
                            "compute:Prepare"]


async def test_answers_go_through_the_agent_and_again_directly_when_the_prepare_comes_again() -> None:
    member = Member(agent_takes=True)
    member.start()
    try:
        await member.actor.inbox.put(Inbound(CommitView(_view(3))))
        await member.actor.inbox.put(Inbound(Prepare(4, [0], "m0 died", term=1)))
        await until(lambda: "compute:Prepare" in member.order)  # answered once the compute side has it
        answer = PrepareAck(ME, 4, 7, [7], {0: [6]}, early=True)
        member.actor.inbox.post(Outbound(answer))
        member.actor.inbox.post(Outbound(Recovered(ME, 3, 7, 0.0)))  # not an answer: straight to the coordinator
        await until(lambda: len(member.transport.sent) == 1)
        assert member.via_agent == [answer] and isinstance(member.transport.sent[0], Recovered)
        # The coordinator lost the agent and sends the Prepare again, directly: the answer goes again, directly.
        await member.actor.inbox.put(Inbound(Prepare(4, [0], "m0 died", term=1)))
        await until(lambda: len(member.transport.sent) == 2)
        assert member.transport.sent[1] == answer and member.via_agent == [answer]
    finally:
        assert member.task is not None
        member.task.cancel()
        await asyncio.gather(member.task, return_exceptions=True)
