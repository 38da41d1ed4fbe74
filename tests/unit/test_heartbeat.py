"""HeartbeatActor with a scripted transport: when it beats, what a beat carries, outages and shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from deadpool.actors.handoff import Progress
from deadpool.actors.heartbeat import HeartbeatActor
from deadpool.protocol import codec
from deadpool.protocol.link import CoordinatorLink
from deadpool.protocol.messages import Heartbeat
from deadpool.protocol.transport import Frame, TransportClosed, TransportError

pytestmark = pytest.mark.timeout(20)

INTERVAL = 0.01


class ScriptedTransport:
    """Records what is sent; `failure` (an exception) makes every send raise it until cleared."""

    address = "inproc://member"

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.failure: Exception | None = None
        self.attempts = 0

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        self.attempts += 1
        if self.failure is not None:
            raise self.failure
        assert timeout == INTERVAL, "a beat never waits longer than one interval"
        self.sent.append((address, bytes(frames[0])))

    def beats(self) -> list[Heartbeat]:
        decoded = [codec.decode(frame, b"k") for _, frame in self.sent]
        assert all(isinstance(m, Heartbeat) for m in decoded)
        return [m for m in decoded if isinstance(m, Heartbeat)]


def _actor(transport: ScriptedTransport, progress: Progress) -> HeartbeatActor:
    return HeartbeatActor("m1", CoordinatorLink("inproc://coordinator"), transport, progress, INTERVAL, b"k",  # type: ignore[arg-type]
                          "inproc://m1-control")


async def until(predicate: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


async def test_no_beat_before_welcome_then_beats_carry_the_progress() -> None:
    transport, progress = ScriptedTransport(), Progress()
    actor = _actor(transport, progress)
    task = asyncio.create_task(actor.run())
    try:
        await asyncio.sleep(5 * INTERVAL)
        assert transport.attempts == 0, "beats before the Welcome are noise"
        actor.joined.set()
        await until(lambda: len(transport.sent) >= 2)
        first = transport.beats()[0]
        assert (first.sender, first.epoch, first.step) == ("m1", 0, -1)
        assert (first.snapshot_step, first.confirmed_step) == (-2, -2)
        assert first.control_addr == "inproc://m1-control"
        assert {address for address, _ in transport.sent} == {"inproc://coordinator"}
        progress.epoch, progress.step, progress.snapshot_step, progress.confirmed_step = 3, 41, 41, 40
        progress.stall_p99_s = 0.25
        await until(lambda: transport.beats()[-1].step == 41)
        last = transport.beats()[-1]
        assert (last.epoch, last.snapshot_step, last.confirmed_step, last.stall_p99_s) == (3, 41, 40, 0.25)
        assert actor.sent == len(transport.sent)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_outage_is_survived_and_its_end_announced_once(caplog: pytest.LogCaptureFixture) -> None:
    transport, progress = ScriptedTransport(), Progress()
    actor = _actor(transport, progress)
    actor.joined.set()
    task = asyncio.create_task(actor.run())
    try:
        await until(lambda: len(transport.sent) >= 1)
        transport.failure = TransportError("not accepted within 0.01s")
        attempts = transport.attempts
        await until(lambda: transport.attempts >= attempts + 5)
        assert not task.done(), "a failed beat never ends the actor"
        warnings = [r for r in caplog.records if "heartbeat not sent" in r.getMessage()]
        assert len(warnings) == 1, "an outage is logged once, not once per beat"
        assert not actor.reconnected.is_set()
        sent = len(transport.sent)
        transport.failure = None
        await until(actor.reconnected.is_set)
        assert len(transport.sent) > sent
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_closed_transport_ends_the_actor_quietly() -> None:
    transport, progress = ScriptedTransport(), Progress()
    actor = _actor(transport, progress)
    actor.joined.set()
    transport.failure = TransportClosed("transport is closed")
    await asyncio.wait_for(actor.run(), 2.0)  # returns, raises nothing
    assert transport.attempts == 1 and actor.sent == 0
