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
from collections.abc import Sequence

import pytest

from deadpool.actors.handoff import Handoff
from deadpool.actors.membership import Inbound, MembershipActor, Outbound
from deadpool.config import Config
from deadpool.coordinator.pools import REJOIN_ASK_INTERVAL_S
from deadpool.coordinator.records import Send
from deadpool.coordinator.service import Coordinator
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.link import CoordinatorLink
from deadpool.protocol.messages import Heartbeat, Join, Message, Rejoin, ViewReport, Welcome
from deadpool.protocol.transport import Frame, TransportError
from deadpool.protocol.view import View

pytestmark = [pytest.mark.timeout(30)]


def beat(member: str, control_addr: str) -> Heartbeat:
    return Heartbeat(member, 1, 5, 5, 4, 0.0, control_addr)


def join(member: str, seat: int) -> Join:
    return Join(member, "active", seat, 2, 100 + seat, "h0", f"inproc://{member}", f"tcp://h0:{seat}")


class CapturingTransport:
    """A member's transport in this test: sends are kept, nothing is received."""

    def __init__(self) -> None:
        self.outbox: list[tuple[str, bytes]] = []

    @property
    def address(self) -> str:
        return "inproc://test-member"

    async def run(self) -> None:
        """Nothing to read."""

    async def recv(self) -> list[memoryview]:
        raise TransportError("this test delivers messages through the actor's inbox")

    def pending(self) -> int:
        return 0

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        self.outbox.append((address, bytes(frames[0])))

    def forget(self, address: str) -> None:
        """Nothing is kept per peer."""

    def dropped(self) -> int:
        return 0

    async def close(self, linger: float = 0.0) -> None:
        """Nothing to close."""


def sent_to(transport: CapturingTransport, address: str) -> list[Message]:
    decoded = [codec.decode(frame) for to, frame in transport.outbox if to == address]
    return [message for message in decoded if not isinstance(message, codec.DecodeError)]


def test_a_restarted_coordinator_asks_members_it_cannot_reach_to_rejoin() -> None:
    now = [10.0]
    events = EventLog(None, clock=lambda: now[0])
    events.records = []
    coordinator = Coordinator(Config(), 2, "store:1", events, started=now[0], recovering=True,
                              wall_clock=lambda: now[0])
    sent: list[Send] = []

    def handle(message: Message) -> None:
        sent.extend(coordinator.handle(now[0], message))

    def sent_to_member(address: str) -> list[Message]:
        return [send.message for send in sent if send.address == address]

    # m0 re-joined after a failed heartbeat and reports the view it holds: m1 becomes a placeholder.
    view = View(1, ["m0", "m1"], [], 3, "epoch-1", "store:0", {"m0": "tcp://h0:0", "m1": "tcp://h0:1"},
                {"m0": "h0", "m1": "h0"}, [1, 0], {})
    handle(join("m0", 0))
    handle(ViewReport("m0", "active", "h0", 100, "inproc://m0", "tcp://h0:0", 5, view))
    assert coordinator.view is not None and coordinator.view.epoch == 1
    assert coordinator.members["m1"].control_addr == ""

    # m1's heartbeats never failed, so it does not know to re-join: its heartbeat gets it asked.
    handle(beat("m1", "inproc://m1"))
    assert sent_to_member("inproc://m1") == [Rejoin(1, "m1", term=1)]
    now[0] += 0.1
    handle(beat("m1", "inproc://m1"))
    assert len(sent_to_member("inproc://m1")) == 1, "asked again within a second: one ask per beat floods"
    now[0] += REJOIN_ASK_INTERVAL_S
    handle(beat("m1", "inproc://m1"))
    assert len(sent_to_member("inproc://m1")) == 2, "a lost Join is asked for again"

    # Its Join makes it reachable; from then on heartbeats ask nothing.
    handle(join("m1", 1))
    assert coordinator.members["m1"].control_addr == "inproc://m1"
    sent.clear()
    now[0] += 5.0
    handle(beat("m1", "inproc://m1"))
    assert sent_to_member("inproc://m1") == []

    # A member it has never heard of (not even in a reported view) is asked too; one with no address is not.
    handle(beat("m9", "inproc://m9"))
    handle(beat("m8", ""))
    assert sent_to_member("inproc://m9") == [Rejoin(1, "m9", term=1)]
    written = [record.fields() for record in events.records]
    assert [e["member"] for e in written if e["event"] == "rejoin_asked"] == ["m1", "m1", "m9"]
    assert sum(e.get("reason") == "unknown_peer" for e in written) == 2  # still logged as unknown


@pytest.mark.asyncio
async def test_a_member_asked_to_rejoin_sends_its_join_and_then_its_view() -> None:
    transport = CapturingTransport()
    events = EventLog(None)
    events.records = []
    joined, reconnected = asyncio.Event(), asyncio.Event()
    actor = MembershipActor("m1", CoordinatorLink("inproc://coordinator"), transport, Handoff(), events,
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
    written = [record.fields() for record in events.records]
    assert [e["reason"] for e in written if e["event"] == "rejected"] == ["misaddressed"]
