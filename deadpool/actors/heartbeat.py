"""HeartbeatActor: tells the coordinator, every interval, that this member lives and how far it got.

Liveness only needs the loop to keep running; the compute thread's progress
rides along (read from ``Progress``, written by the compute thread with plain
attribute stores, which are atomic under the GIL).  A missed send (the
coordinator is down or slow) is logged once per outage and never blocks the
next beat: training goes on without the coordinator.

Started by ``deadpool launch``, a worker beats to its host agent instead
(``agent``: its address), which forwards its host's beats as one message per
interval (``agent/relay.py``).  The agent is the worker's parent process: once
it is gone (the worker was re-parented) or a send to it fails, the beat goes to
the coordinator directly, so a lost agent costs its host's seats nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

from deadpool.actors.handoff import Progress
from deadpool.protocol import codec
from deadpool.protocol.link import CoordinatorLink
from deadpool.protocol.messages import Heartbeat
from deadpool.protocol.transport import Transport, TransportClosed, TransportError

log = logging.getLogger("deadpool.actors.heartbeat")

STANDBY_SEND_TIMEOUT_S = 0.05  # a beat the standby's queue cannot take at once is dropped (it hears the next)


class HeartbeatActor:
    """Sends a Heartbeat every `interval` seconds until cancelled by its owner, and at once when a new snapshot's
    replica check is there (``nudge``; its host agent sends it on at once too, ``agent/relay.py``): a corruption is
    found while the snapshots from before it are still held."""

    def __init__(
        self,
        member: str,
        link: CoordinatorLink,
        transport: Transport,
        progress: Progress,
        interval: float,
        secret: bytes | None,
        control_addr: str,
        agent: str = "",
        agent_pid: int = 0,
    ) -> None:
        self._member = member
        self._agent, self._agent_pid = agent, agent_pid  # the host agent that relays beats ("": none)
        self._control_addr = control_addr
        self._link = link
        self._transport = transport
        self._progress = progress
        self._interval = interval
        self._secret = secret
        self._nudged = asyncio.Event()  # a new replica check to tell now
        self.sent = 0
        self.joined = asyncio.Event()  # set by the membership actor on Welcome: beats before that are noise
        self.reconnected = asyncio.Event()  # set after an outage: the coordinator may have restarted

    async def run(self) -> None:
        """Wait for the Welcome, then beat until the transport closes or the owner cancels."""
        await self._setup()
        try:
            await self._beat()
        finally:
            self._teardown()

    async def _setup(self) -> None:
        await self.joined.wait()

    def _teardown(self) -> None:
        log.debug("heartbeats stopped after %d sent", self.sent)

    def nudge(self) -> None:
        """A new replica check is in the progress counters: beat now (on the actor's loop)."""
        self._nudged.set()

    async def _beat(self) -> None:
        outage = False
        last: tuple[tuple[Any, ...], bytes] | None = None
        while True:
            p = self._progress
            fields = (p.epoch, p.step, p.snapshot_step, p.confirmed_step, p.stall_p99_s, p.compute_s, p.checks)
            if last is None or last[0] != fields:  # progress moves once per step; beats come several times a step
                beat = Heartbeat(self._member, p.epoch, p.step, p.snapshot_step, p.confirmed_step, p.stall_p99_s,
                                 self._control_addr, p.compute_s, [list(check) for check in p.checks])
                last = (fields, codec.encode(beat, self._secret))
            standby = self._link.standby
            if standby:  # the standby learns who is alive, and where, from the same beats, whatever the active does
                with contextlib.suppress(TransportError):
                    await self._transport.send(standby, [last[1]], STANDBY_SEND_TIMEOUT_S)
            if await self.via_agent(last[1]):
                self.sent += 1
            else:
                try:
                    await self._transport.send(self._link.active, [last[1]], self._interval)
                    self.sent += 1
                    if outage:
                        log.info("coordinator reachable again")
                        self.reconnected.set()
                    outage = False
                except TransportClosed:
                    return  # shutting down
                except TransportError as err:
                    if not outage:
                        log.warning("heartbeat not sent (%s); training goes on, retrying every beat", err)
                    outage = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), self._interval)
            self._nudged.clear()

    async def via_agent(self, frame: bytes) -> bool:
        """Hand a frame (a beat, or an answer to Prepare) to the host agent; False when there is none, it is
        gone, or it does not take it."""
        if not self._agent or os.getppid() != self._agent_pid:
            return False
        try:
            await self._transport.send(self._agent, [frame], self._interval)
        except TransportError:
            return False
        return True
