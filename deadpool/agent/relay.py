"""The host agent as a relay: its workers' heartbeats up in one message per interval, broadcasts down to them.

Each worker's ``HeartbeatActor`` sends its ``Heartbeat`` to the agent that
started it (``DEADPOOL_AGENT``) instead of to the coordinator; the agent keeps
the newest beat of each of its workers and, every heartbeat interval, forwards
those heard within the last :data:`HEARD_WITHIN` intervals as one
``HostHeartbeat`` (and at once when a beat brings a new replica check).
A hung worker stops beating and drops out of the message, which the
coordinator counts as silence from the last message that listed it
(``coordinator/coverage.py``); a worker whose agent is gone beats to the
coordinator itself (``actors/heartbeat.py``), so the agent is no single point
of failure for its host's seats.

Down, the coordinator sends a broadcast (a Prepare, a view) for a host's workers to
their agent once, as a ``Relay`` header and the message's own frame
(``coordinator/fanout.py``); :func:`pass_on` sends that frame, unchanged and still
authenticated by the coordinator (the header is too), to each worker the header names. Its
workers answer at nearly the same moment, and their answers go up together: an
:class:`AckBatcher` holds the first for :data:`ACK_WINDOW_S` and forwards whatever came by then
as one ``AckBatch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection

from deadpool.protocol import codec
from deadpool.protocol.link import CoordinatorLink
from deadpool.protocol.messages import AckBatch, Heartbeat, HostHeartbeat, PrepareAck, Relay
from deadpool.protocol.transport import Frame, Transport, TransportError

HEARD_WITHIN = 2.0  # intervals: a worker beating at the same period never misses a message by phase drift
ACK_WINDOW_S = 0.002  # a worker's answer to Prepare waits this long for its host's others (they come together)
CHECKS_WINDOW_S = 0.01  # a beat with a new replica check goes up this soon, with the host's others that came by then
HELLO_EVERY_S = 1.0  # a welcomed agent repeats its AgentHello this often (a restarted coordinator re-learns it)


class BeatRelay:
    """The newest heartbeat of each of this host's workers, and when it arrived."""

    def __init__(self, agent_id: str, members: Collection[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._agent_id = agent_id
        self._members = frozenset(members)
        self._clock = clock
        self._latest: dict[str, tuple[float, Heartbeat]] = {}
        self.refused = 0  # beats from processes this agent did not start
        self.checked = asyncio.Event()  # a beat brought a new replica check: ``forward`` sends without waiting

    def heard(self, beat: Heartbeat) -> bool:
        """Keep `beat` if it is from one of this agent's workers."""
        if beat.sender not in self._members:
            self.refused += 1
            return False
        previous = self._latest.get(beat.sender)
        if beat.checks and (previous is None or previous[1].checks != beat.checks):
            self.checked.set()
        self._latest[beat.sender] = (self._clock(), beat)
        return True

    def forget(self, member: str) -> None:
        """The worker exited (or was fenced): never vouch for it again."""
        self._latest.pop(member, None)

    def message(self, interval: float) -> HostHeartbeat | None:
        """The HostHeartbeat of the workers heard within the last HEARD_WITHIN intervals (None: nobody)."""
        since = self._clock() - HEARD_WITHIN * interval
        beats = [beat for heard, beat in self._latest.values() if heard >= since]
        if not beats:
            return None
        return HostHeartbeat(self._agent_id, [b.sender for b in beats], [b.epoch for b in beats],
                             [b.step for b in beats], [b.snapshot_step for b in beats],
                             [b.confirmed_step for b in beats], [b.control_addr for b in beats],
                             [b.stall_p99_s for b in beats], [b.compute_s for b in beats],
                             [b.checks for b in beats] if any(b.checks for b in beats) else [])


class AckBatcher:
    """This host's workers' answers to a Prepare, forwarded as one AckBatch (``AckBatch`` of the agent)."""

    def __init__(self, agent_id: str, members: Collection[str]) -> None:
        self._agent_id = agent_id
        self._members = frozenset(members)
        self._pending: list[PrepareAck] = []
        self.scheduled = False  # a flush will take the pending answers

    def add(self, ack: PrepareAck) -> bool:
        """Keep `ack` if it is from one of this agent's workers."""
        if ack.sender not in self._members:
            return False
        self._pending.append(ack)
        return True

    def take(self) -> AckBatch | None:
        """The pending answers as one message (None: none), and no flush scheduled any more."""
        pending, self._pending, self.scheduled = self._pending, [], False
        return AckBatch.of(self._agent_id, pending) if pending else None

    def put_back(self, batch: AckBatch) -> None:
        """`batch` could not be sent: its answers go with the next attempt."""
        self._pending[:0] = batch.answers()


async def forward(relay: BeatRelay, transport: Transport, link: CoordinatorLink, interval: float,
                  secret: bytes | None) -> None:
    """Send the relay's message to the active coordinator every `interval` until cancelled, and
    CHECKS_WINDOW_S after a worker's beat brought a new replica check (the coordinator compares the
    seats' checks as they come: a corruption found late may be past the snapshots kept to undo it).

    A send that fails (the coordinator is restarting, or its queue is full) is dropped: the next
    interval's message says the same and more.
    """
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(relay.checked.wait(), interval)
            await asyncio.sleep(CHECKS_WINDOW_S)  # the host's other seats check the same step at about the same time
        relay.checked.clear()
        message = relay.message(interval)
        if message is not None and link.active:
            with contextlib.suppress(TransportError):
                await transport.send(link.active, [codec.encode(message, secret)], interval)


async def pass_on(transport: Transport, header: Relay, frame: Frame, timeout: float) -> list[str]:
    """Send `frame` to each address `header` names, at once; returns the addresses not reached."""

    async def one(addr: str) -> bool:
        try:
            await transport.send(addr, [frame], timeout)
            return True
        except TransportError:
            return False
    sent = await asyncio.gather(*(one(addr) for addr in header.to))
    return [addr for addr, ok in zip(header.to, sent, strict=True) if not ok]
