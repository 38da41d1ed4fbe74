"""The host agent's heartbeat relay (agent/relay.py) and the worker's choice of path (actors/heartbeat.py)."""

from __future__ import annotations

import asyncio
import os

from deadpool.actors.handoff import Progress
from deadpool.actors.heartbeat import HeartbeatActor
from deadpool.agent.relay import BeatRelay
from deadpool.protocol import codec
from deadpool.protocol.link import CoordinatorLink
from deadpool.protocol.messages import Heartbeat, HostHeartbeat


def beat(member: str, step: int) -> Heartbeat:
    return Heartbeat(member, 2, step, step, step - 1, 0.0, f"tcp://h:{step}")


def test_the_relay_forwards_its_workers_heard_recently_in_columns() -> None:
    now = [0.0]
    relay = BeatRelay("agent-a", ["w0", "w1", "w2"], clock=lambda: now[0])
    assert relay.message(0.25) is None
    assert relay.heard(beat("w0", 3)) and relay.heard(beat("w1", 4))
    assert not relay.heard(beat("stranger", 1)) and relay.refused == 1
    assert relay.message(0.25) == HostHeartbeat("agent-a", ["w0", "w1"], [2, 2], [3, 4], [3, 4], [2, 3],
                                                ["tcp://h:3", "tcp://h:4"], [0.0, 0.0], [0.0, 0.0])
    now[0] = 0.4
    relay.heard(beat("w1", 5))
    message = relay.message(0.25)  # w0 last beat 0.4 s ago: within two intervals, still listed
    assert message is not None and message.members == ["w0", "w1"] and message.steps == [3, 5]
    now[0] = 0.6  # w0 silent for 0.6 s: a hung worker drops out
    message = relay.message(0.25)
    assert message is not None and message.members == ["w1"]
    relay.forget("w1")
    assert relay.message(0.25) is None


class Recorder:
    """A transport that records where each frame went."""

    def __init__(self, refuse: set[str] | None = None) -> None:
        self.sent: list[tuple[str, Heartbeat]] = []
        self.refuse = refuse or set()

    async def send(self, addr: str, frames: list[bytes], timeout: float) -> None:
        from deadpool.protocol.transport import TransportError

        if addr in self.refuse:
            raise TransportError(f"{addr} refused")
        message = codec.decode(frames[0])
        assert isinstance(message, Heartbeat)
        self.sent.append((addr, message))


async def beats(agent_pid: int, refuse: set[str] | None = None) -> list[str]:
    transport = Recorder(refuse)
    actor = HeartbeatActor("w0", CoordinatorLink("tcp://coordinator"), transport, Progress(), 0.01, None,  # type: ignore[arg-type]
                           "tcp://w0", agent="tcp://agent", agent_pid=agent_pid)
    actor.joined.set()
    task = asyncio.create_task(actor.run())
    await asyncio.sleep(0.05)
    task.cancel()
    return sorted({addr for addr, _ in transport.sent})


async def test_a_worker_beats_to_its_agent_and_to_the_coordinator_once_the_agent_is_gone() -> None:
    assert await beats(os.getppid()) == ["tcp://agent"]  # its parent is the agent: the relay path
    assert await beats(os.getppid() + 100_000) == ["tcp://coordinator"]  # re-parented: the agent is gone
    assert await beats(os.getppid(), refuse={"tcp://agent"}) == ["tcp://coordinator"]  # the agent refuses
