"""The membership service (consensus-lite): heartbeats in, numbered views out.

One process per job, never a worker (a worker can die).  It also hosts the
TCPStore on which every view's process group rendezvouses, under the prefix
``epoch-{E}``.

A swap, as the coordinator drives it:

1. **Detect**: a member's heartbeats stop for ``failure_timeout``, its host
   agent reports the process exited, or a worker reports a failed collective
   (then, if nobody is found dead within a short grace, the group is rebuilt
   anyway).  The dead member is fenced forever and, where its agent is
   reachable, killed (a hang becomes a crash, releasing blocked peers).
2. **Prepare**: pick a spare per lost seat, send ``Prepare(E+1)`` to every
   survivor; each answers with the snapshots it holds.  Another failure before
   the commit restarts this phase with a higher epoch.
3. **Commit**: ``resume_step`` is the newest step every seat can restore; the
   view is committed to every member of it.
4. The adopted spare reports its first finished step: ``swap_completed``.

Decisions are the pure functions of ``decisions.py``; this module is the I/O
around them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from deadpool.config import Config, raise_priority
from deadpool.coordinator import decisions
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import (
    AgentHello,
    ChaosCommand,
    ChaosInjected,
    ChaosResult,
    CollectiveFailed,
    CommitView,
    Fenced,
    FenceKill,
    Finished,
    Heartbeat,
    HeartbeatBatch,
    Join,
    Message,
    Prepare,
    PrepareAck,
    ProcessExited,
    Recovered,
    Rejoin,
    Role,
    SignalMember,
    StatusReply,
    StatusRequest,
    StepReport,
    Stop,
    ViewReport,
    Welcome,
)
from deadpool.protocol.transport import CONTROL_LIMITS, Transport, TransportError, new_event_loop, open_transport
from deadpool.protocol.view import View

log = logging.getLogger("deadpool.coordinator.service")

MAX_BLIND_REBUILDS = 3  # rebuilds that fix nothing, in a row, before the job is failed with a reason
RATE_PER_S = 200.0  # sustained messages per member per second (heartbeats are 4/s)
RATE_BURST = 400.0  # short bursts allowed above that (a swap's acks and reports)

REJOIN_ASK_INTERVAL_S = 1.0  # a member we cannot reach is asked for its Join at most this often
MAX_REJOIN_ASKS = 4096  # members remembered as asked, before the memory is cleared
RECENT_EVENTS = 20  # events kept for `deadpool status`

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

    from deadpool.coordinator.metrics import CoordinatorMetrics


@dataclass
class MemberRecord:
    """What the coordinator knows of one member."""

    member: str
    role: Role
    host: str
    pid: int
    control_addr: str
    bulk_addr: str
    seat_hint: int
    joined: float
    last_seen: float
    step: int = -1
    snapshot_step: int = -2
    confirmed_step: int = -2
    stall_p99_s: float = 0.0
    epoch: int = 0
    exited: bool = False


@dataclass
class Round:
    """A view change in progress (between Prepare and Commit)."""

    epoch: int
    failed: dict[int, str]  # seat -> dead member
    replacements: dict[int, str]  # seat -> spare chosen
    acks: dict[str, decisions.Snapshots]
    deadline: float
    reason: str


@dataclass
class PendingSwap:
    seat: int
    old_member: str
    new_member: str
    failed_at: float  # wall clock of the first evidence of the failure
    epoch: int


@dataclass
class Agent:
    agent_id: str
    host: str
    control_addr: str
    members: dict[str, int] = field(default_factory=dict)


class Coordinator:
    """State and message handling of the membership service."""

    def __init__(
        self,
        transport: Transport,
        config: Config,
        world_size: int,
        store_addr: str,
        events: EventLog,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        recovering: bool = False,
    ) -> None:
        self._clock = clock  # injected: the simulator runs the coordinator on a virtual clock
        self._wall = wall_clock
        self._transport = transport
        self._config = config
        self._secret = config.secret.encode() or None
        self._world_size = world_size
        self._store_addr = store_addr
        self.events = events
        self.members: dict[str, MemberRecord] = {}
        self.agents: dict[str, Agent] = {}
        self.fenced: dict[str, str] = {}  # member -> reason
        self.view: View | None = None
        self.round: Round | None = None
        self._swaps: list[PendingSwap] = []
        self._failure_wall: dict[str, float] = {}
        self._suspect_since: float | None = None
        self._finished: dict[int, Finished] = {}
        self._chaos_ts: dict[str, float] = {}
        self._chaos_armed: list[tuple[ChaosCommand, str]] = []  # (command, target member) waiting for a step
        self.outcome: tuple[bool, str] | None = None  # (ok, reason) once the job ended
        self._done = asyncio.Event()
        self._senders: asyncio.TaskGroup | None = None
        self._buckets: dict[str, tuple[float, float]] = {}  # member -> (tokens, last refill)
        self._blind_rebuilds = 0  # rebuilds with nobody dead since the last finished step (bounded)
        self._rate_limited: dict[str, int] = {}
        self._rejoin_asked: dict[str, float] = {}  # member -> when we last sent it a Rejoin
        # A restarted coordinator knows nobody: it learns the view from the members (highest epoch wins)
        # instead of forming a first view, until this deadline passes with no member holding a view.
        self._recovering = recovering
        self._recover_deadline = clock() + max(3.0, 2 * config.failure_timeout) if recovering else 0.0
        # The newest events, compacted, for `deadpool status` (bounded: a flood of rejections cannot grow it).
        self.recent_events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        events.listeners.append(self._remember)

    # -- main loop ----------------------------------------------------------------------------

    async def serve(self) -> tuple[bool, str]:
        """Handle messages and time until the job ends; sends run as tasks owned here."""
        # Silence is judged to a tenth of failure_timeout (0.2 s by default): the periodic checks are about
        # timeouts of seconds, and everything else here is driven by messages, not by this tick.
        tick = min(self._config.heartbeat_interval, self._config.failure_timeout / 10)
        async with asyncio.TaskGroup() as senders:
            self._senders = senders
            while not self._done.is_set():
                try:
                    frames: list[memoryview] | None = await asyncio.wait_for(self._transport.recv(), tick)
                except TimeoutError:
                    frames = None
                while frames is not None:
                    await self._on_frames(frames)
                    # Drain what is queued before judging silence: a heartbeat waiting in our own
                    # inbox is not a missed heartbeat.
                    frames = await self._transport.recv() if self._transport.pending() else None
                await self.tick(self._clock())
        # Every send was handed to the transport when the group above closed; the last ones (Stop) leave
        # when the process closes its transport with a linger (see _amain).
        assert self.outcome is not None
        return self.outcome

    async def _on_frames(self, frames: list[memoryview]) -> None:
        decoded = codec.decode(frames[0], self._secret, CONTROL_LIMITS.max_frame_bytes)
        if isinstance(decoded, codec.DecodeError):
            self.events.emit(Event.REJECTED, reason=decoded.reason, detail=decoded.detail)
        elif len(frames) != 1:
            self.events.emit(Event.REJECTED, reason="unexpected_frames", detail=type(decoded).__name__)
        else:
            await self.handle(decoded)

    async def _send(self, addr: str, message: Message, frame: bytes | None = None) -> None:
        """Queue a send; it never blocks the coordinator (a dead peer costs a timed-out task, not a stall)."""
        if not addr:
            return  # a member known only from a reported view has not re-joined yet
        frame = codec.encode(message, self._secret) if frame is None else frame

        async def deliver() -> None:
            try:
                await self._transport.send(addr, [frame], self._config.send_timeout)
            except TransportError as err:
                log.info("could not send %s to %s: %s", type(message).__name__, addr, err)

        if self._senders is None:
            await deliver()
        else:
            self._senders.create_task(deliver())

    async def _broadcast(self, members: list[str], message: Message) -> None:
        # Encode once for every recipient: a CommitView grows with the job, so encoding it per
        # recipient made each commit O(members^2) (minutes of CPU at 4,096 members; simulate.py).
        frame = codec.encode(message, self._secret)
        for member in members:
            if member in self.members:
                await self._send(self.members[member].control_addr, message, frame)

    # -- message handling ---------------------------------------------------------------------

    async def handle(self, message: Message) -> None:
        now = self._clock()
        if isinstance(message, Join):
            await self._on_join(message, now)
        elif isinstance(message, AgentHello):
            # Agents repeat their hello every second, so a restarted coordinator re-learns who owns which pid.
            self.agents[message.sender] = Agent(message.sender, message.host, message.control_addr,
                                                dict(message.members))
            await self._send(message.control_addr, Welcome(self.view.epoch if self.view else 0, message.sender,
                                                           self._world_size))
        elif isinstance(message, ChaosCommand):
            await self._on_chaos(message)
        elif isinstance(message, StatusRequest):
            await self._send(message.reply_to, StatusReply(message.nonce, json.dumps(self.status())))
        elif isinstance(message, ProcessExited):
            if message.sender not in self.agents:
                self.events.emit(Event.REJECTED, reason="unknown_agent", peer=message.sender)
                return
            record = self.members.get(message.member)
            if record is not None:
                record.exited = True
            if message.returncode == 0:
                # A clean exit is how a finished seat or a released spare ends; its Finished may still be on
                # the way. If it was not finished, its silence is caught by the heartbeat timeout.
                return
            if message.member in self.members and not self._seat_finished(message.member):
                how = f"signal {-message.returncode}" if message.returncode < 0 else f"exit code {message.returncode}"
                await self.declare_dead(message.member, "exit", f"process ended ({how})")
        elif isinstance(message, HeartbeatBatch):
            # Hierarchical aggregation: one message per host agent per interval instead of one per
            # member (164k -> 20k messages/s at 16,384 members; simulate.py).  Each beat is handled
            # exactly as if its member had sent it (unknown and fenced members are rejected there),
            # and an agent vouches only for the members it registered in its AgentHello.
            agent = self.agents.get(message.sender)
            if agent is None:
                self.events.emit(Event.REJECTED, reason="unknown_agent", peer=message.sender)
                return
            for beat in message.beats:
                if beat.sender in agent.members:
                    await self.handle(beat)
                else:
                    self.events.emit(Event.REJECTED, reason="not_agents_member", peer=message.sender,
                                     detail=beat.sender)
        else:
            sender = getattr(message, "sender", None)
            if not isinstance(sender, str) or sender not in self.members:
                self.events.emit(Event.REJECTED, reason="unknown_peer",
                                 detail=f"{type(message).__name__} from {sender}")
                if isinstance(message, Heartbeat):
                    await self._ask_to_rejoin(message, now)
                return
            if sender in self.fenced:
                self.events.emit(Event.REJECTED, reason="fenced_peer", peer=sender, kind=type(message).__name__)
                await self._send(self.members[sender].control_addr,
                                 Fenced(sender, self.view.epoch if self.view else 0, self.fenced[sender]))
                return
            if not self._allow(sender, now):
                return
            self.members[sender].last_seen = now
            await self._on_member_message(message, sender, now)

    def _allow(self, sender: str, now: float) -> bool:
        """Per-member rate limit (token bucket): a runaway or hostile member cannot flood the coordinator."""
        tokens, last = self._buckets.get(sender, (RATE_BURST, now))
        tokens = min(RATE_BURST, tokens + (now - last) * RATE_PER_S)
        if tokens < 1.0:
            self._buckets[sender] = (tokens, now)
            self._rate_limited[sender] = self._rate_limited.get(sender, 0) + 1
            count = self._rate_limited[sender]
            if count <= 5 or count % 1000 == 0:
                self.events.emit(Event.REJECTED, reason="rate_limited", peer=sender, count=count,
                                 detail=f"more than {RATE_PER_S:.0f} messages/s sustained")
            return False
        self._buckets[sender] = (tokens - 1.0, now)
        return True

    async def _on_member_message(self, message: Message, sender: str, now: float) -> None:
        record = self.members[sender]
        if isinstance(message, Heartbeat):
            if not record.control_addr:
                await self._ask_to_rejoin(message, now)  # known only from a reported view
            record.step, record.epoch = message.step, message.epoch
            record.snapshot_step, record.confirmed_step = message.snapshot_step, message.confirmed_step
            record.stall_p99_s = message.stall_p99_s
            await self._fire_armed_chaos(record)
        elif isinstance(message, PrepareAck):
            rnd = self.round
            if rnd is None or message.epoch != rnd.epoch:
                self.events.emit(Event.REJECTED, reason="stale_ack", peer=message.sender, ack_epoch=message.epoch)
                return
            rnd.acks[message.sender] = decisions.Snapshots(message.local_steps, message.ward_steps,
                                                           message.disk_steps)
            await self._maybe_commit()
        elif isinstance(message, CollectiveFailed):
            self.events.emit(Event.COLLECTIVE_ERROR_REPORTED, member=message.sender, step=message.step,
                             error=message.error[:300])
            if self.round is None and self._suspect_since is None:
                self._suspect_since = now
        elif isinstance(message, Recovered):
            await self._on_recovered(message)
        elif isinstance(message, Finished):
            await self._on_finished(message)
        elif isinstance(message, ChaosInjected):
            self._chaos_ts[message.sender] = message.ts
        elif isinstance(message, StepReport):
            record.step = message.step
            await self._fire_armed_chaos(record)
        elif isinstance(message, ViewReport):
            record.step = message.step
            self._adopt_reported_view(message)
        else:
            self.events.emit(Event.REJECTED, reason="unexpected_type", detail=type(message).__name__)

    async def _on_join(self, join: Join, now: float) -> None:
        if join.sender in self.fenced:
            await self._send(join.control_addr, Fenced(join.sender, self.view.epoch if self.view else 0,
                                                       self.fenced[join.sender]))
            return
        if join.world_size != self._world_size and not (join.role == Role.SPARE and join.world_size == 0):
            self.events.emit(Event.REJECTED, reason="wrong_world_size", peer=join.sender,
                             detail=f"member has WORLD_SIZE={join.world_size}, job has {self._world_size}")
            return
        known = join.sender in self.members
        self.members[join.sender] = MemberRecord(
            join.sender, join.role, join.host, join.pid, join.control_addr, join.bulk_addr, join.seat_hint,
            now, now,
        )
        await self._send(join.control_addr, Welcome(self.view.epoch if self.view else 0, join.sender,
                                                    self._world_size))
        if known:
            return
        self.events.emit(Event.MEMBER_JOINED, member=join.sender, role=join.role, host=join.host, pid=join.pid,
                         seat_hint=join.seat_hint)
        if self.view is None:
            if not self._recovering:
                await self._maybe_first_view()
        elif not self.view.contains(join.sender):
            await self._add_spare(join.sender)

    async def _ask_to_rejoin(self, beat: Heartbeat, now: float) -> None:
        """A member we cannot reach is alive: ask it for its Join (once a second, not every beat).

        After a restart on the same address a member's heartbeats may never have failed, so it
        does not know to re-join; without its Join a Prepare could not reach it (prepare_timeout).
        """
        if not beat.control_addr or now - self._rejoin_asked.get(beat.sender, -1e9) < REJOIN_ASK_INTERVAL_S:
            return
        if len(self._rejoin_asked) >= MAX_REJOIN_ASKS:
            self._rejoin_asked.clear()  # bounded: strangers cannot grow it
        self._rejoin_asked[beat.sender] = now
        self.events.emit(Event.REJOIN_ASKED, member=beat.sender)
        await self._send(beat.control_addr, Rejoin(self.view.epoch if self.view else 0, beat.sender))

    def _adopt_reported_view(self, report: ViewReport) -> None:
        """After a restart: take the highest-epoch view any member holds, as it is (no new epoch)."""
        reported = report.view
        if reported is None or (self.view is not None and reported.epoch <= self.view.epoch):
            return
        self.view = dataclasses.replace(reported, store_addr=self._store_addr)  # the old store died with us
        self.events.epoch = reported.epoch
        self._recovering = False
        now = self._clock()
        for seat_hint, member in [*enumerate(reported.seats), *((-1, m) for m in reported.spares)]:
            if member not in self.members:
                # Placeholder until the member re-joins; one that never does is found silent and swapped.
                self.members[member] = MemberRecord(
                    member, Role.ACTIVE if seat_hint >= 0 else Role.SPARE, reported.hosts.get(member, ""), 0, "",
                    reported.bulk_addrs.get(member, ""), seat_hint, now, now)
        self.events.emit(Event.VIEW_ADOPTED, epoch=reported.epoch, seats=reported.seats, spares=reported.spares,
                         resume_step=reported.resume_step, reported_by=report.sender)

    async def _maybe_first_view(self) -> None:
        if len(self.members) < self._world_size:
            return  # seats cannot all be filled yet (building the view on every Join made startup O(members^2))
        seat_members = {r.seat_hint: r.member for r in self.members.values()
                        if r.role == Role.ACTIVE and r.member not in self.fenced}
        spares = [r.member for r in self.members.values() if r.role == Role.SPARE and r.member not in self.fenced]
        view, reason = decisions.first_view(seat_members, self._world_size, spares, self._store_addr,
                                            self._hosts(), self._bulk_addrs())
        if view is not None:
            await self._commit(view, reason, failed={})

    async def _add_spare(self, member: str) -> None:
        assert self.view is not None
        spares = [*self.view.spares, member]
        if self.round is not None:
            return  # picked up when the round commits (it reads the pool then)
        view = decisions.next_view(self.view, self.view.epoch + 1, {}, spares, self.view.resume_step,
                                   self._hosts(), self._bulk_addrs(), rebuild=False)
        await self._commit(view, f"spare {member} joined the pool", failed={})

    # -- operator chaos -----------------------------------------------------------------------

    async def _on_chaos(self, command: ChaosCommand) -> None:
        """An operator's kill/stop/cont: carried out by the target's host agent, logged as an event."""
        view = self.view
        target = command.member
        if not target and view is not None and 0 <= command.seat < view.world_size:
            target = view.seats[command.seat]
        if command.action not in ("kill", "stop", "cont"):
            detail = f"unknown action {command.action!r}: use kill, stop or cont"
        elif not target or target not in self.members:
            detail = f"no such member or seat (member={command.member!r}, rank={command.seat})"
        elif not any(target in agent.members for agent in self.agents.values()):
            detail = f"no agent owns {target}: it was not started by a `deadpool launch` this coordinator knows"
        else:
            detail = ""
        if detail:
            await self._send(command.reply_to, ChaosResult(command.nonce, False, detail))
            return
        if command.at_step >= 0 and self.members[target].step < command.at_step:
            self._chaos_armed.append((command, target))
            await self._send(command.reply_to, ChaosResult(
                command.nonce, True, f"armed: {command.action} {target} when it finishes step {command.at_step}"))
            return
        await self._signal(command, target)
        await self._send(command.reply_to, ChaosResult(command.nonce, True, f"{command.action} sent to {target}"))

    async def _fire_armed_chaos(self, record: MemberRecord) -> None:
        for command, target in [item for item in self._chaos_armed if item[1] == record.member]:
            if record.step >= command.at_step:
                self._chaos_armed.remove((command, target))
                await self._signal(command, target)

    async def _signal(self, command: ChaosCommand, target: str) -> None:
        seat = self.view.seat_of(target) if self.view else None
        if command.action == "kill":
            self._chaos_ts[target] = self._wall()
        self.events.emit(Event.CHAOS_INJECTED, action=command.action, target_member=target,
                         target_rank=-1 if seat is None else seat, at_step=command.at_step,
                         target_step=self.members[target].step, via="operator")
        for agent in self.agents.values():
            if target in agent.members:
                await self._send(agent.control_addr, SignalMember(target, command.action, "operator chaos"))

    # -- failures and rounds ------------------------------------------------------------------

    async def declare_dead(self, member: str, detected_by: str, detail: str) -> None:
        """Fence `member` forever and start (or extend) the view change that replaces it."""
        if member in self.fenced or self.outcome is not None:
            return
        self.fenced[member] = f"{detected_by}: {detail}"
        record = self.members.get(member)
        seat = self.view.seat_of(member) if self.view else None
        self._failure_wall[member] = min(self._wall(), self._chaos_ts.get(member, float("inf")))
        injected = self._chaos_ts.get(member)  # detection time is known only for injected failures
        self.events.emit(Event.MEMBER_FAILED, member=member, failed_member=member, rank=-1 if seat is None else seat,
                         detection_s=None if injected is None else round(self._wall() - injected, 4),
                         failed_rank=-1 if seat is None else seat, detected_by=detected_by, reason=detail,
                         epoch=self.view.epoch if self.view else 0)
        if record is not None:
            await self._fence(record, detected_by)
        if self.view is None:
            if record is not None and record.role == Role.ACTIVE:
                await self._fail_job(f"member {member} (rank {record.seat_hint}) failed before training started "
                                     f"({detail}); relaunch the job")
            return
        if self.round is not None and member in self.round.replacements.values():
            await self._start_round({}, f"spare {member} chosen for the swap failed; choosing again")
            return
        if member in self.view.spares:
            spares = [s for s in self.view.spares if s != member]
            self.events.emit(Event.SPARE_LOST, member=member, lost_member=member, spares_left=len(spares))
            if self.round is None:
                view = decisions.next_view(self.view, self.view.epoch + 1, {}, spares, self.view.resume_step,
                                           self._hosts(), self._bulk_addrs(), rebuild=False)
                await self._commit(view, f"spare {member} lost", failed={})
            return
        if seat is not None:
            await self._start_round({seat: member}, f"seat {seat} lost ({detected_by}: {detail})")

    async def _fence(self, record: MemberRecord, detected_by: str) -> None:
        """Tell the member it is out (a zombie that wakes up exits), and kill it through its agent."""
        epoch = self.view.epoch if self.view else 0
        await self._send(record.control_addr, Fenced(record.member, epoch, self.fenced[record.member]))
        if not self._config.fence_by_kill or record.exited:
            return
        for agent in self.agents.values():
            if record.member in agent.members:
                await self._send(agent.control_addr, FenceKill(record.member, epoch, detected_by))

    async def _start_round(self, newly_failed: dict[int, str], reason: str) -> None:
        assert self.view is not None
        failed = dict(self.round.failed) if self.round else {}
        failed.update(newly_failed)
        # Freshest heartbeat first: a spare that died silently (not yet detected) is the last one chosen.
        pool = sorted((s for s in self.view.spares if s not in self.fenced),
                      key=lambda s: -self.members[s].last_seen if s in self.members else 0.0)
        replacements, why = decisions.pick_spares(sorted(failed), self.view, pool, self._hosts())
        if replacements is None:
            lost = ", ".join(f"rank {seat} ({member})" for seat, member in sorted(failed.items()))
            await self._fail_job(
                f"{lost} failed and no spare is left to take the seat ({why}). "
                f"The other ranks' state is intact in memory but the job cannot continue at world size "
                f"{self._world_size}. Relaunch with more --spares (or from a disk checkpoint)."
            )
            return
        epoch = max(self.view.epoch, self.round.epoch if self.round else 0) + 1
        self.round = Round(epoch, failed, replacements, {}, self._clock() + self._config.prepare_timeout,
                           f"{reason}; {why}")
        self._suspect_since = None
        survivors = self._survivors()
        self.events.emit(Event.VIEW_PREPARED, epoch=epoch, failed_seats=sorted(failed), reason=self.round.reason,
                         replacements={str(k): v for k, v in replacements.items()})
        await self._broadcast(survivors, Prepare(epoch, sorted(failed), self.round.reason))
        await self._maybe_commit()

    def _survivors(self) -> list[str]:
        assert self.view is not None
        failed = set(self.round.failed) if self.round else set()
        return [m for seat, m in enumerate(self.view.seats) if seat not in failed and m not in self.fenced]

    async def _maybe_commit(self) -> None:
        rnd, view = self.round, self.view
        if rnd is None or view is None:
            return
        # Cheap bound first: survivors >= seats - failed - fenced, so fewer acks cannot cover them all.
        # Listing the survivors on every ack made a round O(seats^2) (simulate.py: ~1 s of CPU per round
        # at 4,096 members).
        if len(rnd.acks) < len(view.seats) - len(rnd.failed) - len(self.fenced):
            return
        survivors = self._survivors()
        if any(member not in rnd.acks for member in survivors):
            return
        resume, sources, why = decisions.plan_restore(view, sorted(rnd.failed), rnd.acks)
        from_disk = False
        if resume is None:
            resume = decisions.disk_resume_step(rnd.acks)
            if resume is None:
                await self._fail_job(f"cannot restore the job in memory: {why}. No disk checkpoint is configured "
                                     "or complete (--checkpoint-dir/--checkpoint-every); relaunch from one.")
                return
            from_disk = True
            why = f"{why}; every seat rolls back to the disk checkpoint of step {resume}"
            self.events.emit(Event.DISK_FALLBACK, resume_step=resume, reason=why)
        spares = [s for s in view.spares if s not in rnd.replacements.values() and s not in self.fenced]
        new_view = decisions.next_view(view, rnd.epoch, rnd.replacements, spares, resume, self._hosts(),
                                       self._bulk_addrs(), rebuild=True, from_disk=from_disk, sources=sources)
        failed_at = {seat: self._failure_wall.get(member, self._wall()) for seat, member in rnd.failed.items()}
        for seat, member in rnd.failed.items():
            self._swaps.append(PendingSwap(seat, member, rnd.replacements[seat], failed_at[seat], rnd.epoch))
        self.round = None
        await self._commit(new_view, f"{rnd.reason}; resume: {why}", failed=rnd.failed)

    async def _commit(self, view: View, reason: str, failed: dict[int, str]) -> None:
        self.view = view
        self.events.epoch = view.epoch
        self.events.emit(Event.VIEW_COMMITTED, epoch=view.epoch, resume_step=view.resume_step, seats=view.seats,
                         spares=view.spares, store_prefix=view.store_prefix, reason=reason,
                         failed_seats=sorted(failed), buddies=view.buddies)
        await self._broadcast([*view.seats, *view.spares], CommitView(view))

    async def _on_recovered(self, message: Recovered) -> None:
        self._blind_rebuilds = 0  # a step finished under the new view: the last rebuild worked
        for swap in [s for s in self._swaps if s.new_member == message.sender and message.epoch >= s.epoch]:
            self._swaps.remove(swap)
            recovery = message.ts - swap.failed_at
            self.events.emit(Event.SWAP_COMPLETED, rank=swap.seat, old_member=swap.old_member,
                             new_member=swap.new_member, recovery_s=round(recovery, 4), step=message.step,
                             epoch=message.epoch, member=message.sender)

    async def _on_finished(self, message: Finished) -> None:
        if self.view is None or self.view.seat_of(message.sender) != message.seat:
            return
        self._finished[message.seat] = message
        if len(self._finished) < self._world_size:
            return
        digests = {f.digest for f in self._finished.values()}
        if len(digests) != 1:
            await self._fail_job(f"seats disagree on the final state digest: {sorted(digests)}")
            return
        digest = digests.pop()
        self.events.emit(Event.TRAINING_FINISHED, step=message.step, state_digest=digest, epoch=self.view.epoch)
        await self._end(True, f"training finished at step {message.step}; final state digest {digest}")

    def _seat_finished(self, member: str) -> bool:
        return any(f.sender == member for f in self._finished.values())

    async def _fail_job(self, reason: str) -> None:
        self.events.emit(Event.JOB_FAILED, reason=reason)
        log.error("%s", reason)
        await self._end(False, reason)

    async def _end(self, ok: bool, reason: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = (ok, reason)
        live = [m for m in self.members if m not in self.fenced and not self._seat_finished(m)]
        await self._broadcast(live, Stop(ok, reason))
        for agent in self.agents.values():
            await self._send(agent.control_addr, Stop(ok, reason))
        self._done.set()

    # -- time ---------------------------------------------------------------------------------

    async def tick(self, now: float) -> None:
        """Periodic checks: silent members, round deadlines, unexplained collective failures."""
        if self.outcome is not None:
            return
        if self._recovering and now > self._recover_deadline:
            self._recovering = False  # nobody held a view: the job had not started; form the first view
            await self._maybe_first_view()
        watched = {m: r.last_seen for m, r in self.members.items()
                   if m not in self.fenced and not self._seat_finished(m)}
        for member, why in decisions.silent_members(now, watched, self._config.failure_timeout):
            await self.declare_dead(member, "heartbeat", why)
        rnd = self.round
        if rnd is not None and now > rnd.deadline:
            for member in self._survivors():
                if member not in rnd.acks:
                    await self.declare_dead(member, "prepare_timeout",
                                            f"no answer to Prepare({rnd.epoch}) within {self._config.prepare_timeout}s")
        grace = min(1.0, self._config.failure_timeout / 2)
        if self._suspect_since is not None and self.round is None and now - self._suspect_since > grace:
            self._suspect_since = None
            if self.view is None:
                return
            self._blind_rebuilds += 1
            if self._blind_rebuilds > MAX_BLIND_REBUILDS:
                await self._fail_job(
                    f"collectives failed {self._blind_rebuilds} times in a row with every member alive and no step "
                    "finished in between: the ranks cannot reach each other over the process group's transport "
                    "(check --bind-host / the addresses gloo uses, firewalls and the ports between hosts)")
                return
            await self._start_round({}, "a collective failed but no member was found dead: rebuilding the group")

    # -- views for operators ------------------------------------------------------------------

    def _hosts(self) -> dict[str, str]:
        return {m: r.host for m, r in self.members.items()}

    def _bulk_addrs(self) -> dict[str, str]:
        return {m: r.bulk_addr for m, r in self.members.items()}

    def _remember(self, record: dict[str, Any]) -> None:
        """Keep an event for status, scalars only: a view's seat lists would grow the reply with the job."""
        self.recent_events.append({k: v[:200] if isinstance(v, str) else v for k, v in record.items()
                                   if v is None or isinstance(v, (str, int, float, bool))})

    def status(self) -> dict[str, Any]:
        """The live state as a JSON-able document (``deadpool status``)."""
        now = self._clock()
        view = self.view
        seats = []
        if view is not None:
            for seat, member in enumerate(view.seats):
                r = self.members.get(member)
                buddy = view.buddy_member(seat) if view.world_size > 1 else ""
                seats.append({
                    "rank": seat, "member": member, "host": r.host if r else "", "pid": r.pid if r else 0,
                    "state": "dead" if member in self.fenced else "active",
                    "step": r.step if r else -1, "snapshot_step": r.snapshot_step if r else -2,
                    "confirmed_step": r.confirmed_step if r else -2, "copy_on": buddy,
                    "heartbeat_age_s": round(now - r.last_seen, 3) if r else None,
                    "stall_p99_s": r.stall_p99_s if r else 0.0,
                })
        spares = [{"member": m, "host": self.members[m].host, "pid": self.members[m].pid,
                   "heartbeat_age_s": round(now - self.members[m].last_seen, 3)}
                  for m in (view.spares if view else []) if m in self.members]
        return {
            "epoch": view.epoch if view else 0, "world_size": self._world_size,
            "resume_step": view.resume_step if view else -1, "store_prefix": view.store_prefix if view else "",
            "seats": seats, "spares": spares, "fenced": sorted(self.fenced),
            "round": None if self.round is None else {"epoch": self.round.epoch,
                                                       "failed_seats": sorted(self.round.failed)},
            "outcome": None if self.outcome is None else {"ok": self.outcome[0], "reason": self.outcome[1]},
            "recent_events": list(self.recent_events),
        }


# -- process entry point ------------------------------------------------------------------------

def _listen(host: str, port: int) -> socket.socket:
    """The store's listening socket, bound before torch is imported (see ``_start_store``).

    Raises:
        OSError: the address cannot be bound (the port is in use, the host is not this machine's).
    """
    if host:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=1024)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, backlog=1024, dualstack_ipv6=True)
    return socket.create_server(("", port), backlog=1024)


def _start_store(host: str, listener: socket.socket) -> TCPStore:
    """Serve the TCPStore on a socket that already listens.

    Workers start when the coordinator has printed its addresses; importing torch
    for the store (about a CPU-second) happens after that, beside their own imports,
    instead of before them.  A client that connects meanwhile waits in the listen
    backlog; none does before the first view, which needs the store served.  The
    socket is bound to the coordinator's address, not every interface (a TCPStore
    binds the wildcard address when it binds itself).
    """
    from torch._C._distributed_c10d import TCPStore

    port = listener.getsockname()[1]
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300),
                    master_listen_fd=listener.detach(), use_libuv=True)


async def _amain(args: argparse.Namespace) -> int:
    config = Config.from_env()
    host = args.bind.split("://", 1)[1].rsplit(":", 1)[0] if "://" in args.bind else "127.0.0.1"
    if args.bind.startswith("tcp://") and host not in ("127.0.0.1", "localhost", "::1") and not config.secret:
        print("deadpool coordinator: refusing to bind a non-loopback address without a shared secret; "
              "set DEADPOOL_SECRET (the same value on every host) and retry.", file=sys.stderr)
        return 2
    exporter = _start_metrics(args)
    if isinstance(exporter, str):
        print(f"deadpool coordinator: {exporter}", file=sys.stderr)
        return 2
    store_bind = host if host != "0.0.0.0" else ""
    try:
        listener = _listen(store_bind, args.store_port)
    except OSError as err:
        print(f"deadpool coordinator: cannot listen for the TCPStore on {store_bind or '*'}:{args.store_port} "
              f"({err}); free the port or choose another (--master-port) and retry.", file=sys.stderr)
        return 2
    store_host = args.advertise or (host if host not in ("0.0.0.0", "") else socket.gethostname())
    store_addr = f"{store_host}:{listener.getsockname()[1]}"
    transport = open_transport(args.bind, CONTROL_LIMITS)
    events = EventLog(args.events or None, member="coordinator", source="coordinator")
    address = transport.address
    metrics_url = ""
    if exporter is not None:
        events.listeners.append(exporter.on_event)
        metrics_url = exporter.url
    events.emit(Event.COORDINATOR_STARTED, address=address, store=store_addr, pid=os.getpid(),
                recovering=args.recover,
                world_size=args.world_size, metrics=metrics_url)
    print(json.dumps({"control": address, "store": store_addr, "metrics": metrics_url}), flush=True)
    # Members' first messages wait in the bound control socket until serve() reads them.
    store = _start_store(store_bind, listener)
    coordinator = Coordinator(transport, config, args.world_size, store_addr, events, recovering=args.recover)
    try:
        async with asyncio.TaskGroup() as tasks:
            reader = tasks.create_task(transport.run())
            refresher = tasks.create_task(exporter.refresh_forever(coordinator.status)) if exporter else None
            ok, _ = await coordinator.serve()
            await transport.close(linger=config.send_timeout)  # returns once the Stops have left
            reader.cancel()
            if refresher is not None:
                refresher.cancel()
    finally:
        events.close()
        if exporter is not None:
            exporter.stop()
    del store
    return 0 if ok else 1


def _start_metrics(args: argparse.Namespace) -> CoordinatorMetrics | str | None:
    """The Prometheus exporter serving when --metrics-port is given, None when not, or why it cannot serve."""
    if args.metrics_port < 0:
        return None
    try:
        from deadpool.coordinator.metrics import CoordinatorMetrics
    except ImportError as err:
        return f"--metrics-port needs prometheus-client ({err}); install it: pip install 'deadpool[metrics]'"
    exporter = CoordinatorMetrics()
    try:
        exporter.start(args.metrics_host, args.metrics_port)
    except OSError as err:
        return f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {err}"
    return exporter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deadpool coordinator", description="DeadPool's membership service")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="control address (port 0: pick a free one)")
    parser.add_argument("--world-size", type=int, required=True, help="number of seats in the job")
    parser.add_argument("--store-port", type=int, default=0, help="TCPStore port (0: pick a free one)")
    parser.add_argument("--advertise", default="", help="host name workers use to reach the store")
    parser.add_argument("--events", default="", help="append JSON-lines events to this file")
    parser.add_argument("--recover", action="store_true",
                        help="a restart: learn the view from the members instead of forming a first one")
    parser.add_argument("--metrics-port", type=int, default=-1,
                        help="serve Prometheus metrics on this port (0: pick a free one; default: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="[coordinator] %(levelname)s %(message)s")
    raise_priority()
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_amain(args))
    finally:
        loop.close()


if __name__ == "__main__":
    status = main()
    # Everything is closed (events file, sockets, the store); the interpreter's teardown of torch's
    # modules (0.5-1 s on a busy host) would only hold up the launcher, which waits for this exit.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)
