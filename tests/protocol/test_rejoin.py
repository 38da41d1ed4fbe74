"""A restarted coordinator asks the members it hears but cannot reach to join again.

A coordinator restarted on the same address knows nobody.  A member re-joins on
its own only after a heartbeat failed to send, and a restart can be quick enough
that none does; a member the coordinator knows only from another member's view
report then has no control address, and the next Prepare cannot reach it (the
job stopped on ``prepare_timeout`` in CI).  Heartbeats carry the control address,
so the coordinator asks (``Rejoin``), and the member answers with its Join.
"""

from __future__ import annotations

import asyncio

import pytest
from deadpool.tools.simulate import CapturingTransport

from deadpool.actors.handoff import Handoff
from deadpool.actors.membership import Inbound, MembershipActor, Outbound
from deadpool.config import Config
from deadpool.coordinator.service import REJOIN_ASK_INTERVAL_S, Coordinator
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import Heartbeat, Join, Message, Rejoin, ViewReport, Welcome
from deadpool.protocol.view import View

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def beat(member: str, control_addr: str) -> Heartbeat:
    return Heartbeat(member, 1, 5, 5, 4, 0.0, control_addr)


def join(member: str, seat: int) -> Join:
    return Join(member, "active", seat, 2, 100 + seat, "h0", f"inproc://{member}", f"tcp://h0:{seat}")


def sent_to(transport: CapturingTransport, address: str) -> list[Message]:
    decoded = [codec.decode(frame) for to, frame in transport.outbox if to == address]
    return [message for message in decoded if not isinstance(message, codec.DecodeError)]


async def test_a_restarted_coordinator_asks_members_it_cannot_reach_to_rejoin() -> None:
    now = [10.0]
    transport = CapturingTransport()
    events = EventLog(None, clock=lambda: now[0])
    events.records = []
    coordinator = Coordinator(transport, Config(), 2, "store:1", events, recovering=True,
                              clock=lambda: now[0], wall_clock=lambda: now[0])

    # m0 re-joined after a failed heartbeat and reports the view it holds: m1 becomes a placeholder.
    view = View(1, ["m0", "m1"], [], 3, "epoch-1", "store:0", {"m0": "tcp://h0:0", "m1": "tcp://h0:1"},
                {"m0": "h0", "m1": "h0"}, [1, 0], {})
    await coordinator.handle(join("m0", 0))
    await coordinator.handle(ViewReport("m0", "active", "h0", 100, "inproc://m0", "tcp://h0:0", 5, view))
    assert coordinator.view is not None and coordinator.view.epoch == 1
    assert coordinator.members["m1"].control_addr == ""

    # m1's heartbeats never failed, so it does not know to re-join: its heartbeat gets it asked.
    await coordinator.handle(beat("m1", "inproc://m1"))
    assert sent_to(transport, "inproc://m1") == [Rejoin(1, "m1")]
    now[0] += 0.1
    await coordinator.handle(beat("m1", "inproc://m1"))
    assert len(sent_to(transport, "inproc://m1")) == 1, "asked again within a second: one ask per beat floods"
    now[0] += REJOIN_ASK_INTERVAL_S
    await coordinator.handle(beat("m1", "inproc://m1"))
    assert len(sent_to(transport, "inproc://m1")) == 2, "a lost Join is asked for again"

    # Its Join makes it reachable; from then on heartbeats ask nothing.
    await coordinator.handle(join("m1", 1))
    assert coordinator.members["m1"].control_addr == "inproc://m1"
    transport.outbox.clear()
    now[0] += 5.0
    await coordinator.handle(beat("m1", "inproc://m1"))
    assert sent_to(transport, "inproc://m1") == []

    # A member it has never heard of (not even in a reported view) is asked too; one with no address is not.
    await coordinator.handle(beat("m9", "inproc://m9"))
    await coordinator.handle(beat("m8", ""))
    assert sent_to(transport, "inproc://m9") == [Rejoin(1, "m9")]
    assert [e["member"] for e in events.records if e["event"] == "rejoin_asked"] == ["m1", "m1", "m9"]
    assert sum(e.get("reason") == "unknown_peer" for e in events.records) == 2  # still logged as unknown


async def test_a_member_asked_to_rejoin_sends_its_join_and_then_its_view() -> None:
    transport = CapturingTransport()
    events = EventLog(None)
    events.records = []
    joined, reconnected = asyncio.Event(), asyncio.Event()
    actor = MembershipActor("m1", "inproc://coordinator", transport, Handoff(), events,
                            asyncio.Queue(maxsize=8), None, 1.0, joined, reconnected,
                            ("active", "h0", 101, "inproc://m1", "tcp://h0:1"))
    view = View(4, ["m0", "m1"], [], 3, "epoch-4", "store:0", {}, {}, [1, 0], {})
    actor.view = view  # it held view 4 when the coordinator restarted
    own_join = join("m1", 1)
    running = asyncio.create_task(actor.run())
    try:
        await actor.inbox.put(Outbound(own_join))
        await actor.inbox.put(Inbound(Welcome(4, "m1", 2)))  # the first coordinator's welcome
        await actor.inbox.put(Inbound(Rejoin(0, "m0")))  # not for us: refused
        await actor.inbox.put(Inbound(Rejoin(0, "m1")))  # the restarted coordinator asks
        await actor.inbox.put(Inbound(Welcome(0, "m1", 2)))  # ... and welcomes the Join at epoch 0
        for _ in range(100):
            if any(isinstance(m, ViewReport) for m in sent_to(transport, "inproc://coordinator")):
                break
            await asyncio.sleep(0.01)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    sent = sent_to(transport, "inproc://coordinator")
    assert sent[:2] == [own_join, own_join]
    report = sent[2]
    assert isinstance(report, ViewReport) and report.view == view and report.control_addr == "inproc://m1"
    assert [e["reason"] for e in events.records if e["event"] == "rejected"] == ["misaddressed"]
