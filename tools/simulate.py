"""Deterministic simulation of a large job around the real coordinator (``deadpool simulate``).

What it is for: to show, for thousands of members and a seeded schedule of
failures, that the membership protocol keeps its invariants (DESIGN.md
section 2 and section 8.2), and to measure what one coordinator costs at that
scale: messages per second, CPU per virtual second, detection time and
view-change time.  It is the middle test tier of STYLE.md: the protocol
without processes, sockets or real time.

What is real and what is simulated:

- The coordinator is the real :class:`~deadpool.coordinator.service.Coordinator`,
  with its decisions (``decisions.py``), on a virtual clock (its injected
  ``clock`` and ``wall_clock``), its event log kept in memory.
- Every message is a real protocol message encoded and decoded by the real
  codec, with the control-frame size limit the workers enforce
  (``CONTROL_LIMITS``, overridable to explore bigger views).
- Members, host agents and the training they run are small state machines
  here: they join, beat, answer ``Prepare`` with the snapshots they hold (their
  last two steps, and their wards' last two as copies lagging one step), adopt
  views, restore, and report ``Recovered`` after their first step.

Design choice: direct dispatch, not the in-process transport.  Every frame a
member sends is decoded here and passed to ``Coordinator.handle()``; the
coordinator's sends are captured by :class:`CapturingTransport`, a small
object implementing the :class:`~deadpool.protocol.transport.Transport` protocol, and
delivered to the simulated members one tick later.  ``transports/inproc.py``
costs about 17 us per message end to end (``bench/transport.py``: an
``asyncio.wait_for`` per send, a queue round trip, a frame copy): at 16,384
members and 100 ms heartbeats, ~164k messages per virtual second, that is
~3 real seconds per virtual second before the coordinator does any work, and
its cost would be mixed into the coordinator's.  Direct dispatch keeps the
run deterministic without depending on asyncio scheduling order, and lets
the simulator time exactly what the coordinator process spends on decode +
``handle()`` per message and on ``tick()`` (the ``cpu_*`` metrics, from
``time.process_time``); the transport's share is measured separately by
``bench/transport.py``.  The event loop runs, but time is driven by hand in
fixed ticks (10 ms by default) and nothing sleeps.

Failures come from the seed: members die at random virtual times as a crash
(the host agent reports the exit; the dead seat's ring neighbours see their
collective fail), a hang (silent; killed by the agent on ``FenceKill``) or a
zombie (silent and unkillable; it wakes later and sends stale messages that
must be rejected).  They include spares, and a second failure that strikes
while the first view change is in progress.

Invariants are checked every tick and counted in ``invariant_violations``:
at most one committed view per epoch, epochs strictly increasing, no fenced
member seated (or spare) in a committed view, no message from a fenced
member changing coordinator state, and by the end every failure swapped or
reported as a job failure.

Metrics whose names are in :data:`REAL_TIME_KEYS` are real-time measurements;
every other metric is a deterministic function of the configuration and seed.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import heapq
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deadpool.config import Config
from deadpool.coordinator.service import Coordinator
from deadpool.errors import MisuseError
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import (
    AgentHello,
    CollectiveFailed,
    CommitView,
    Fenced,
    FenceKill,
    Heartbeat,
    HeartbeatBatch,
    Join,
    Message,
    Prepare,
    PrepareAck,
    ProcessExited,
    Recovered,
    Role,
    Stop,
    Welcome,
)
from deadpool.protocol.transport import CONTROL_LIMITS, Frame, TransportError
from deadpool.protocol.view import View

REAL_TIME_KEYS: tuple[str, ...] = (
    "wall_s",
    "cpu_handle_s_per_s",
    "cpu_tick_s_per_s",
    "cpu_tick_ms",
    "cpu_startup_s",
    "cpu_stall_s_max",
    "cpu_view_change_s_max",
    "cpu_total_s",
)
"""Metrics measured in real time: they differ between runs of the same seed."""

MAX_VIOLATIONS_LISTED = 20
COORDINATOR_ADDR = "inproc://sim-coordinator"
CRASH, HANG, ZOMBIE = "crash", "hang", "zombie"  # failure kinds
RUNNING, FROZEN, DEAD = "running", "frozen", "dead"  # member process states


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated job: its size, its failures and its clocks (virtual seconds)."""

    members: int = 1024  # seats + spares
    failures: int = 4  # members that die during the run
    seed: int = 0  # everything random derives from this
    heartbeat_interval: float = 0.1  # 2.5x Config's default rate: the load the scale figures were measured at
    duration: float = 10.0  # failures fall before this; the run then goes on (bounded) until all are resolved
    aggregate: bool = False  # host agents batch their members' heartbeats (HeartbeatBatch)
    tick: float = 0.01  # virtual time step; coordinator.tick() runs once per tick
    spare_fraction: float = 0.05  # spares = max(1, round(members * spare_fraction))
    members_per_host: int = 8  # one host agent per this many members
    step_s: float = 1.0  # one training step, in virtual seconds
    restore_s: float = 0.1  # restore + group rebuild after adopting a view
    join_s: float = 0.5  # members join at random times in [0, join_s)
    steady_s: float = 1.0  # steady-state window measured before the first failure
    failure_timeout: float = 0.0  # 0: Config's default (2 s), or 5 heartbeat intervals if that is longer
    prepare_timeout: float = 10.0  # Config's default
    max_frame_bytes: int = CONTROL_LIMITS.max_frame_bytes  # members drop larger frames, as workers do

    @property
    def spares(self) -> int:
        return max(1, round(self.members * self.spare_fraction))

    @property
    def seats(self) -> int:
        return self.members - self.spares

    def coordinator_config(self) -> Config:
        """The coordinator's Config: defaults, with this run's heartbeat interval and timeouts."""
        timeout = self.failure_timeout or max(Config().failure_timeout, 5 * self.heartbeat_interval)
        return Config(heartbeat_interval=self.heartbeat_interval, failure_timeout=timeout,
                      prepare_timeout=self.prepare_timeout).validate()

    def validate(self) -> SimConfig:
        """Check the values for sense.

        Raises:
            MisuseError: a value is out of range, with the name of the setting.
        """
        if self.members < 3:
            raise MisuseError(f"members must be at least 3 (two seats and a spare), got {self.members}")
        if self.seats < 2:
            raise MisuseError(f"spare_fraction {self.spare_fraction} leaves fewer than two seats")
        if self.failures < 0 or self.failures > self.members:
            raise MisuseError(f"failures must be between 0 and members ({self.members}), got {self.failures}")
        for name in ("heartbeat_interval", "duration", "tick", "step_s", "restore_s", "join_s", "steady_s"):
            if not getattr(self, name) > 0:
                raise MisuseError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_interval < self.tick:
            raise MisuseError(f"heartbeat_interval ({self.heartbeat_interval}s) is shorter than a tick ({self.tick}s)")
        if self.members_per_host < 1 or self.max_frame_bytes < 1:
            raise MisuseError("members_per_host and max_frame_bytes must be at least 1")
        config = self.coordinator_config()  # raises MisuseError for inconsistent timeouts
        if self.duration < self.join_s + 0.5 + self.steady_s + config.failure_timeout:
            raise MisuseError(
                f"duration {self.duration}s leaves no room for failures: it must exceed join, steady window "
                f"and failure_timeout ({self.join_s + 0.5 + self.steady_s + config.failure_timeout:.1f}s)"
            )
        return self


class CapturingTransport:
    """The coordinator's transport in the simulation: sends are captured, nothing is received.

    Implements :class:`deadpool.protocol.transport.Transport`; the simulator calls
    ``Coordinator.handle()`` itself, so ``recv`` is never used.
    """

    def __init__(self) -> None:
        self.outbox: list[tuple[str, bytes]] = []
        self.bytes_sent = 0

    @property
    def address(self) -> str:
        return COORDINATOR_ADDR

    async def run(self) -> None:
        """Nothing to read: the simulator delivers messages by calling ``handle()``."""

    async def recv(self) -> list[memoryview]:
        """Never used by the simulator.

        Raises:
            TransportError: always; messages reach the coordinator through ``handle()``.
        """
        raise TransportError("the simulator delivers messages by calling Coordinator.handle()")

    def pending(self) -> int:
        return 0

    async def send(self, address: str, frames: Sequence[Frame], timeout: float) -> None:
        frame = frames[0]
        data = frame if isinstance(frame, bytes) else bytes(frame)
        self.outbox.append((address, data))
        self.bytes_sent += len(data)

    def forget(self, address: str) -> None:
        """Nothing is kept per peer."""

    def dropped(self) -> int:
        return 0

    async def close(self, linger: float = 0.0) -> None:
        """Nothing to close (sends land in the outbox at once)."""


@dataclass(slots=True)
class _ViewInfo:
    """Lookups over one view, built once and shared by every member (a view is O(members))."""

    view: View
    seat_of: dict[str, int]
    spares: frozenset[str]
    wards: dict[int, list[int]]  # seat -> seats whose snapshot copies it keeps


def _view_info(view: View) -> _ViewInfo:
    wards: dict[int, list[int]] = {}
    for ward, buddy in enumerate(view.buddies):
        if ward != buddy:
            wards.setdefault(buddy, []).append(ward)
    return _ViewInfo(view, {member: seat for seat, member in enumerate(view.seats)}, frozenset(view.spares), wards)


@dataclass(slots=True)
class _Failure:
    """One scheduled failure; its victim is chosen when it fires."""

    kind: str  # CRASH, HANG or ZOMBIE
    at_tick: int  # when it may fire
    during_round: bool  # waits for a view change in progress (a second failure close to the first)
    deadline_tick: int  # a during_round failure fires by then even without a view change
    spare: bool  # strike a spare
    member: str = ""  # the victim, once fired
    fired_tick: int = -1


class _Member:
    """One simulated worker: what the runtime does, reduced to the protocol and a step counter."""

    __slots__ = (
        "agent", "bulk_addr", "control_addr", "hb_frame", "hb_key", "hb_obj", "host", "member", "paused_step",
        "pid", "prep_acked", "restore_base", "role", "run_from", "run_step", "seat", "seat_hint", "state",
        "view", "welcomed",
    )

    def __init__(self, member: str, host: str, role: Role, seat_hint: int, pid: int, bulk_addr: str,
                 agent: _Agent) -> None:
        self.member, self.host, self.role, self.seat_hint, self.pid = member, host, role, seat_hint, pid
        self.control_addr = f"inproc://sim-member/{member}"
        self.bulk_addr = bulk_addr
        self.agent = agent
        self.state = RUNNING
        self.welcomed = False
        self.view: _ViewInfo | None = None
        self.seat: int | None = None
        self.run_step = -1  # the step the live state holds when run_from is reached
        self.run_from = 0  # tick from which steps finish again (after a restore)
        self.restore_base = -1  # resume step of the last restore: no older snapshot survives it
        self.paused_step: int | None = None  # frozen step while a view change is in progress
        self.prep_acked = 0  # highest Prepare epoch answered
        self.hb_key: tuple[int, int] = (-1, -2)
        self.hb_obj: Heartbeat | None = None
        self.hb_frame = b""

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def step(self, sim: Simulation) -> int:
        """Last finished step: one per step_s, none while paused or while a stopped peer blocks the group."""
        if self.seat is None or self.view is None:
            return -1
        if self.paused_step is not None:
            return self.paused_step
        end = sim.tick if sim.stall_tick is None else min(sim.tick, sim.stall_tick)
        if end <= self.run_from:
            return self.run_step
        return self.run_step + (end - self.run_from) // sim.step_ticks

    def heartbeat(self, sim: Simulation) -> Heartbeat:
        """This member's heartbeat now; object and frame reused while nothing in it changed."""
        epoch = self.view.view.epoch if self.view else 0
        step = self.step(sim)
        if self.hb_obj is None or self.hb_key != (epoch, step):
            seated = self.seat is not None
            snapshot = step if seated else -2
            confirmed = max(self.restore_base, step - 1) if seated else -2
            self.hb_key, self.hb_obj = (epoch, step), Heartbeat(self.member, epoch, step, snapshot, confirmed, 0.0,
                                                            self.control_addr)
            self.hb_frame = codec.encode(self.hb_obj)
        return self.hb_obj

    def receive(self, message: Message, sim: Simulation) -> None:
        """A message from the coordinator, handled as the membership actor and the runtime do."""
        held = self.view.view.epoch if self.view else 0
        if isinstance(message, Welcome):
            self.welcomed = True
        elif isinstance(message, CommitView):
            if message.view.epoch > held:
                self._adopt(sim.view_info(message.view), sim)
        elif isinstance(message, Prepare):
            # Only a seated member holding a view answers; one waiting for its first view ignores it.
            if self.seat is not None and message.epoch > held and message.epoch > self.prep_acked:
                if self.paused_step is None:
                    self.paused_step = self.step(sim)
                self.prep_acked = message.epoch
                sim.send(self._ack(message.epoch))
        elif isinstance(message, Fenced):
            sim.stop_member(self, DEAD, returncode=1)  # a fenced member exits touching nothing
        elif isinstance(message, Stop):
            sim.stop_member(self, DEAD, returncode=None)

    def _adopt(self, info: _ViewInfo, sim: Simulation) -> None:
        seat = info.seat_of.get(self.member)
        if seat is None and self.member not in info.spares:
            sim.stop_member(self, DEAD, returncode=1)  # left out of the view: the runtime exits as fenced
            return
        rebuild = self.view is None or info.view.store_prefix != self.view.view.store_prefix
        self.view, self.seat = info, seat
        if seat is not None and rebuild:
            self.run_step = self.restore_base = info.view.resume_step
            self.run_from = sim.tick + sim.restore_ticks
            self.paused_step = None

    def _ack(self, epoch: int) -> PrepareAck:
        """The snapshots held: the last two local steps, and each ward's copies one step behind."""
        assert self.view is not None and self.seat is not None and self.paused_step is not None
        step, base = self.paused_step, self.restore_base
        local = sorted({max(base, step - 1), step})
        copies = sorted({max(base, step - 2), max(base, step - 1)})
        wards = {ward: list(copies) for ward in self.view.wards.get(self.seat, [])}
        return PrepareAck(self.member, epoch, step, local, wards)


class _Agent:
    """One host's launcher: registers its workers, reports exits, fences by kill, batches heartbeats."""

    __slots__ = ("agent_id", "batch_frame", "batch_key", "control_addr", "host", "members")

    def __init__(self, agent_id: str, host: str) -> None:
        self.agent_id, self.host = agent_id, host
        self.control_addr = f"inproc://sim-agent/{host}"
        self.members: list[_Member] = []
        self.batch_key: list[Heartbeat] = []
        self.batch_frame = b""

    def batch(self, sim: Simulation) -> bytes:
        """The HeartbeatBatch frame for this interval: only members that beat since the last one ("" if none)."""
        beats = [m.heartbeat(sim) for m in self.members if m.running and m.welcomed]
        if not beats:
            return b""
        if len(beats) != len(self.batch_key) or any(a is not b for a, b in zip(beats, self.batch_key, strict=True)):
            self.batch_key = beats
            self.batch_frame = codec.encode(HeartbeatBatch(self.agent_id, beats))
        return self.batch_frame

    def receive(self, message: Message, sim: Simulation) -> None:
        if isinstance(message, FenceKill):
            sim.fence_kill(message.member)
        # Welcome and Stop need nothing from a simulated agent.


class Simulation:
    """One seeded run: the real coordinator, simulated members and agents, a virtual clock, the checks."""

    def __init__(self, config: SimConfig) -> None:
        self.config = cfg = config.validate()
        self.coordinator_config = cfg.coordinator_config()
        self.tick = 0
        self.step_ticks = self._ticks(cfg.step_s)
        self.restore_ticks = self._ticks(cfg.restore_s)
        self.stall_tick: int | None = None  # a seated member stopped: the others' collectives block from here
        self._hb_ticks = self._ticks(cfg.heartbeat_interval)
        self._rng = random.Random(cfg.seed)
        self._transport = CapturingTransport()
        self._events = EventLog(None, member="coordinator", source="coordinator", clock=self._now)
        self._events.records = []
        self._events.listeners.append(self._on_event)
        self.coordinator = Coordinator(self._transport, self.coordinator_config, cfg.seats, "sim-store:29400",
                                       self._events, clock=self._now, wall_clock=self._now)
        self._inbound: list[bytes] = []
        self._timers: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._decoded: dict[int, tuple[bytes, Message]] = {}  # id(frame) -> decoded, for this tick's sends
        self._infos: dict[int, _ViewInfo] = {}  # epoch -> lookups over the view delivered for it
        self._current: _ViewInfo | None = None  # newest view delivered to the members
        self._quiet_after = 0  # tick after which the newest rebuilt view has reported its first step
        self._settle_view: tuple[View, set[str]] | None = None  # the coordinator's view and its members
        self._agents: list[_Agent] = []
        self._members: list[_Member] = []
        self._by_id: dict[str, _Member] = {}
        self._by_addr: dict[str, _Member | _Agent] = {}
        self._member_buckets: list[list[_Member]] = [[] for _ in range(self._hb_ticks)]  # by heartbeat phase
        self._agent_buckets: list[list[_Agent]] = [[] for _ in range(self._hb_ticks)]
        self._build_cluster()
        failures_from = self._ticks(cfg.join_s + 0.5 + cfg.steady_s)
        self._steady = (self._ticks(cfg.join_s + 0.5), failures_from)  # ticks measured as steady state
        self._failures = self._schedule_failures(failures_from)
        self._victims: dict[str, _Failure] = {}
        # checks and metrics
        self.violations: list[str] = []
        self._violation_count = 0
        self._commits: list[tuple[int, int, list[str], list[str]]] = []  # (epoch, tick, seats, spares)
        self._view_digests: dict[int, bytes] = {}
        self._failed_tick: dict[str, int] = {}
        self._false_positives = 0
        self._fenced_rejections = 0
        self._spurious_rebuilds = 0
        self._swaps = 0
        self._dropped_oversize = 0
        self._view_frame_bytes = 0
        self._steady_msgs = 0
        self._steady_handle_cpu = 0.0
        self._steady_tick_cpu = 0.0
        self._cpu_total = 0.0
        self._cpu_stall_max = 0.0
        self._cpu_startup: float | None = None  # coordinator CPU until the first view was committed
        self._view_change_tick = False  # this tick prepared or committed a view
        self._cpu_view_change_max = 0.0

    # -- set up ---------------------------------------------------------------------------------

    def _ticks(self, seconds: float) -> int:
        return max(1, round(seconds / self.config.tick))

    def _now(self) -> float:
        return round(self.tick * self.config.tick, 9)

    def _build_cluster(self) -> None:
        """Members on hosts of members_per_host, seats first and spares last; joins at seeded random times."""
        cfg, rng = self.config, self._rng
        join_ticks = self._ticks(cfg.join_s)
        joins: list[tuple[int, _Member]] = []
        for index in range(cfg.members):
            h = index // cfg.members_per_host
            host = f"node{h:05d}"
            if h == len(self._agents):
                agent = _Agent(f"agent-{host}-{rng.getrandbits(16):04x}", host)
                self._agents.append(agent)
                self._by_addr[agent.control_addr] = agent
                self._agent_buckets[rng.randrange(self._hb_ticks)].append(agent)
            agent = self._agents[h]
            seated = index < cfg.seats
            label = f"rank{index}" if seated else f"spare{index - cfg.seats}"
            member = _Member(f"{host}:{label}:{rng.getrandbits(24):06x}", host, Role.ACTIVE if seated else Role.SPARE,
                             index if seated else -1, 10_000 + index,
                             f"tcp://10.{(h >> 8) & 255}.{h & 255}.1:{29600 + index % cfg.members_per_host}", agent)
            agent.members.append(member)
            self._members.append(member)
            self._by_id[member.member] = member
            self._by_addr[member.control_addr] = member
            joined = rng.randrange(join_ticks)
            self._member_buckets[joined % self._hb_ticks].append(member)
            joins.append((joined, member))
        rng.shuffle(joins)  # within a tick too, seats and spares join in random order
        for joined, member in joins:
            self._at(joined, functools.partial(self._join, member))
        for agent in self._agents:
            hello = AgentHello(agent.agent_id, agent.host, agent.control_addr, {m.member: m.pid for m in agent.members})
            self._at(0, functools.partial(self.send, hello))

    def _schedule_failures(self, start: int) -> list[_Failure]:
        """K failures: kinds rotate, the second waits for a view change, the third hits a spare."""
        cfg, rng = self.config, self._rng
        end = max(start, self._ticks(cfg.duration - self.coordinator_config.failure_timeout - 1.0))
        kinds = [HANG, CRASH, ZOMBIE]
        rng.shuffle(kinds)
        failures = []
        for k in range(cfg.failures):
            during_round = k == 1
            failures.append(_Failure(kinds[k % 3], start if during_round else rng.randint(start, end),
                                     during_round, end, spare=k == 2))
        failures.sort(key=lambda f: f.at_tick)
        return failures

    def _at(self, tick: int, action: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (tick, next(self._seq), action))

    # -- what members and agents do -------------------------------------------------------------

    def send(self, message: Message) -> None:
        """A member or agent sends to the coordinator; it is handled in this tick."""
        self._inbound.append(codec.encode(message))

    def view_info(self, view: View) -> _ViewInfo:
        info = self._infos.get(view.epoch)
        if info is None or info.view is not view:
            info = self._infos[view.epoch] = _view_info(view)
        return info

    def _join(self, member: _Member) -> None:
        if member.running:
            self.send(Join(member.member, member.role, member.seat_hint, self.config.seats, member.pid,
                           member.host, member.control_addr, member.bulk_addr))

    def stop_member(self, member: _Member, state: str, returncode: int | None, delay: int = 1) -> None:
        """A member stops running (dies or freezes); its agent reports a process exit after `delay` ticks."""
        if member.state == DEAD or (member.state == state):
            return
        was_running = member.running
        member.state = state
        current = self._current
        if was_running and current is not None and member.member in current.seat_of and self.stall_tick is None:
            self.stall_tick = self.tick
        if returncode is not None and self.coordinator.outcome is None:
            self._at(self.tick + delay, lambda: self.send(ProcessExited(member.agent.agent_id, member.member,
                                                                        returncode)))

    def fence_kill(self, member_id: str) -> None:
        """The agent's fence by kill: lands on a hung or live process, not on an unreachable zombie."""
        member = self._by_id.get(member_id)
        failure = self._victims.get(member_id)
        if member is None or member.state == DEAD or (failure is not None and failure.kind == ZOMBIE):
            return
        self.stop_member(member, DEAD, returncode=-9)

    def _collective_failed(self, victim: _Member, neighbours: list[str], epoch: int) -> None:
        """The dead seat's ring neighbours see their collective fail (gloo: 15-100 ms after a SIGKILL).

        Only a neighbour still blocked in that view's collective reports it: one that has already
        answered a Prepare aborted the collective, and the report would have reached the coordinator
        before its PrepareAck (one ordered channel per member).
        """
        for member_id in neighbours:
            member = self._by_id[member_id]
            if (member.running and member.view is not None and member.view.view.epoch == epoch
                    and member.paused_step is None):
                self.send(CollectiveFailed(member.member, epoch, member.step(self),
                                           f"Connection reset by peer ({victim.member})"))

    def _wake(self, member: _Member) -> None:
        """A zombie resumes with stale state: its messages must be rejected and it must learn it is fenced."""
        if member.state == FROZEN and self.coordinator.outcome is None:
            member.state = RUNNING
            epoch = member.view.view.epoch if member.view else 0
            self.send(CollectiveFailed(member.member, epoch, member.step(self), "woke up: the collective timed out"))

    def _strike(self, failure: _Failure) -> None:
        """Kill the victim the seed picks now, as a crash, a hang or a zombie."""
        member = self._pick_victim(failure)
        if member is None:
            return
        failure.member, failure.fired_tick = member.member, self.tick
        self._victims[member.member] = failure
        current = self._current
        seat = current.seat_of.get(member.member) if current else None
        if failure.kind == CRASH:
            self.stop_member(member, DEAD, returncode=-9, delay=self._rng.randint(1, 5))
            if current is not None and seat is not None and self.stall_tick == self.tick:
                neighbours = [current.view.seats[s] for s in [current.view.buddies[seat], *current.wards.get(seat, [])]
                              if s != seat]
                epoch = current.view.epoch
                self._at(self.tick + self._rng.randint(2, 10),
                         lambda: self._collective_failed(member, neighbours, epoch))
        else:
            self.stop_member(member, FROZEN, returncode=None)
            if failure.kind == ZOMBIE:
                wake = self._ticks(2 * self.coordinator_config.failure_timeout + 1.0)
                self._at(self.tick + wake, lambda: self._wake(member))

    def _pick_victim(self, failure: _Failure) -> _Member | None:
        """A running member, never the buddy or ward of a seat awaiting its swap (that would lose the seat's state)."""
        view = self.coordinator.view
        if view is None:
            candidates = [m.member for m in self._members if m.running]
        else:
            protected: set[int] = set()
            pending = [view.seat_of(m) for m, f in self._victims.items() if f.fired_tick >= 0]
            rnd = self.coordinator.round
            for seat in [*(s for s in pending if s is not None), *(rnd.failed if rnd else ())]:
                protected.update((view.buddies[seat], *(w for w, b in enumerate(view.buddies) if b == seat)))
            seats = [m for s, m in enumerate(view.seats) if s not in protected]
            if failure.spare:
                candidates = list(view.spares) or seats
            elif failure.during_round:
                candidates = seats
            else:
                candidates = [*seats, *view.spares]
            candidates = [m for m in candidates if self._by_id[m].running and m not in self._victims]
        return self._by_id[self._rng.choice(candidates)] if candidates else None

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Run to the end (bounded), checking the invariants every tick; returns the metrics."""
        cfg = self.config
        started = time.perf_counter()
        duration = self._ticks(cfg.duration)
        timeouts = 2 * self.coordinator_config.failure_timeout + self.coordinator_config.prepare_timeout + 5.0
        last_tick = duration + self._ticks(timeouts)
        for tick in range(last_tick + 1):
            self.tick = tick
            self._fire(tick)
            self._deliver()
            self._beat(tick)
            await self._coordinator_turn(tick)
            self._check_sends()
            if self.coordinator.outcome is not None or (tick >= duration and self._settled()):
                break
        return self._metrics(time.perf_counter() - started)

    def _fire(self, tick: int) -> None:
        while self._timers and self._timers[0][0] <= tick:
            heapq.heappop(self._timers)[2]()
        for failure in self._failures:
            if failure.fired_tick >= 0 or tick < failure.at_tick or self.coordinator.outcome is not None:
                continue
            if not failure.during_round or self.coordinator.round is not None or tick >= failure.deadline_tick:
                self._strike(failure)
                if failure.fired_tick < 0:
                    failure.fired_tick = tick  # nobody left to strike: counted as not injected
                    failure.member = ""

    def _deliver(self) -> None:
        """The coordinator's sends of the previous tick reach their (running) recipients."""
        outbox, self._transport.outbox = self._transport.outbox, []
        decoded, self._decoded = self._decoded, {}
        limit = self.config.max_frame_bytes
        for address, frame in outbox:
            target = self._by_addr.get(address)
            if target is None or (isinstance(target, _Member) and not target.running):
                continue  # a dead or frozen process reads nothing
            if len(frame) > limit:
                self._dropped_oversize += 1  # the worker's transport refuses it, as CONTROL_LIMITS says
                continue
            cached = decoded.get(id(frame))
            message = cached[1] if cached is not None and cached[0] is frame else self._decode(frame)
            if isinstance(message, CommitView) and (self._current is None
                                                    or message.view.epoch > self._current.view.epoch):
                self._view_delivered(self.view_info(message.view))
            target.receive(message, self)

    def _view_delivered(self, info: _ViewInfo) -> None:
        """A newer view reaches the members: after a rebuild the group runs again unless a seat is still down."""
        previous, self._current = self._current, info
        if previous is not None and previous.view.store_prefix == info.view.store_prefix:
            return
        down = any(not self._by_id[m].running for m in info.view.seats)
        self.stall_tick = self.tick if down else None
        first_step = self.tick + self.restore_ticks + self.step_ticks
        if previous is not None:
            self._at(first_step, lambda: self._recovered(info))
            self._quiet_after = first_step + 1  # run on until the swap is reported complete

    def _recovered(self, info: _ViewInfo) -> None:
        """Every seat that finished its first step under a rebuilt view reports it (swap_completed)."""
        if self._current is not info:
            return
        for member_id in info.view.seats:
            member = self._by_id[member_id]
            if member.running and member.view is info and member.step(self) > info.view.resume_step:
                self.send(Recovered(member.member, info.view.epoch, info.view.resume_step + 1, self._now()))

    def _beat(self, tick: int) -> None:
        bucket = tick % self._hb_ticks
        if self.config.aggregate:
            for agent in self._agent_buckets[bucket]:
                frame = agent.batch(self)
                if frame:
                    self._inbound.append(frame)
        else:
            for member in self._member_buckets[bucket]:
                if member.running and member.welcomed:
                    member.heartbeat(self)
                    self._inbound.append(member.hb_frame)

    async def _coordinator_turn(self, tick: int) -> None:
        """What the coordinator process does in one tick: decode and handle every message, then tick()."""
        coordinator = self.coordinator
        limit = CONTROL_LIMITS.max_frame_bytes
        inbound, self._inbound = self._inbound, []
        had_view = coordinator.view is not None  # the tick that forms the first view is startup, not a change
        t0 = time.process_time()
        for frame in inbound:
            message = codec.decode(frame, None, limit)
            if isinstance(message, codec.DecodeError):
                self._events.emit(Event.REJECTED, reason=message.reason, detail=message.detail)
                continue
            fenced = self._fenced_state(message) if coordinator.fenced else None
            await coordinator.handle(message)
            if fenced:
                self._check_fenced(fenced)
        t1 = time.process_time()
        await coordinator.tick(self._now())
        t2 = time.process_time()
        spent = t2 - t0
        self._cpu_total += spent
        self._cpu_stall_max = max(self._cpu_stall_max, spent)
        if self._cpu_startup is None and coordinator.view is not None:
            self._cpu_startup = self._cpu_total
        if self._steady[0] <= tick < self._steady[1]:
            self._steady_msgs += len(inbound)
            self._steady_handle_cpu += t1 - t0
            self._steady_tick_cpu += t2 - t1
        if self._view_change_tick and had_view:
            self._cpu_view_change_max = max(self._cpu_view_change_max, spent)
        self._view_change_tick = False

    def _settled(self) -> bool:
        """Every failure fired and resolved, no view change in progress, swaps reported, zombies woken and gone."""
        if (self.coordinator.round is not None or self.tick <= self._quiet_after
                or any(f.fired_tick < 0 or (f.kind == ZOMBIE and f.member and self._by_id[f.member].state != DEAD)
                       for f in self._failures)):
            return False
        view = self.coordinator.view
        if view is None:
            return False
        if self._settle_view is None or self._settle_view[0] is not view:
            self._settle_view = (view, {*view.seats, *view.spares})
        in_view = self._settle_view[1]
        return all(f.member in self.coordinator.fenced and f.member not in in_view for f in self._failures if f.member)

    # -- invariants -----------------------------------------------------------------------------

    def _violation(self, text: str) -> None:
        self._violation_count += 1
        if len(self.violations) < MAX_VIOLATIONS_LISTED:
            self.violations.append(f"t={self._now():.2f}s {text}")

    def _on_event(self, record: dict[str, Any]) -> None:
        """Coordinator events, seen the moment they are emitted (state is exactly as it was then)."""
        event = record["event"]
        if event in ("view_prepared", "view_committed"):
            self._view_change_tick = True
        if event == "view_committed":
            self._check_commit(record["epoch"], record["seats"], record["spares"])
        elif event == "member_failed":
            member = record["failed_member"]
            self._failed_tick.setdefault(member, self.tick)
            sim_member = self._by_id.get(member)
            if member not in self._victims and sim_member is not None and sim_member.running:
                self._false_positives += 1  # declared dead while it was healthy
        elif event == "rejected" and record.get("reason") == "fenced_peer":
            self._fenced_rejections += 1
        elif event == "swap_completed":
            self._swaps += 1
        elif event == "view_prepared" and str(record.get("reason", "")).startswith("a collective failed but no"):
            self._spurious_rebuilds += 1  # the coordinator's reason when a CollectiveFailed names nobody dead

    def _check_commit(self, epoch: int, seats: list[str], spares: list[str]) -> None:
        """One view per epoch, epochs growing, nobody fenced in it (checked at the moment of the commit)."""
        if any(epoch == e for e, *_ in self._commits):
            self._violation(f"epoch {epoch} committed twice")
        elif self._commits and epoch <= self._commits[-1][0]:
            self._violation(f"epoch {epoch} committed after epoch {self._commits[-1][0]}")
        fenced = self.coordinator.fenced
        bad = [m for m in [*seats, *spares] if m in fenced]
        if bad:
            self._violation(f"view {epoch} contains fenced member(s) {bad[:3]}")
        self._commits.append((epoch, self.tick, seats, spares))

    def _check_sends(self) -> None:
        """Every CommitView sent this tick carries the one view committed for its epoch."""
        last: bytes | None = None
        for _, frame in self._transport.outbox:
            if frame is last:
                continue
            last = frame
            message = self._decode(frame)
            self._decoded[id(frame)] = (frame, message)
            if not isinstance(message, CommitView):
                continue
            epoch = message.view.epoch
            self._view_frame_bytes = max(self._view_frame_bytes, len(frame))
            digest = hashlib.blake2b(frame, digest_size=16).digest()
            if self._view_digests.setdefault(epoch, digest) != digest:
                self._violation(f"two different views sent for epoch {epoch}")
            if not any(epoch == e for e, *_ in self._commits):
                self._violation(f"CommitView for epoch {epoch}, which was never committed")

    def _fenced_state(self, message: Message) -> list[tuple[str, tuple[Any, ...]]]:
        """For each fenced member a message speaks for: the coordinator state it must not change."""
        if isinstance(message, HeartbeatBatch):
            senders = [beat.sender for beat in message.beats]
        else:
            sender = getattr(message, "sender", None)
            senders = [sender] if isinstance(sender, str) else []
        fenced = self.coordinator.fenced
        return [(m, self._member_state(m)) for m in senders if m in fenced]

    def _member_state(self, member: str) -> tuple[Any, ...]:
        record = self.coordinator.members.get(member)
        rnd = self.coordinator.round
        acked = rnd is not None and member in rnd.acks
        if record is None:
            return (None, acked)
        return (record.last_seen, record.step, record.epoch, record.snapshot_step, acked)

    def _check_fenced(self, before: list[tuple[str, tuple[Any, ...]]]) -> None:
        for member, state in before:
            if self._member_state(member) != state:
                self._violation(f"a message from fenced member {member} changed coordinator state")

    @staticmethod
    def _decode(frame: bytes) -> Message:
        message = codec.decode(frame, None, max(len(frame), 1))
        if isinstance(message, codec.DecodeError):  # the coordinator encoded it: cannot happen
            raise AssertionError(f"the coordinator sent an undecodable frame: {message}")
        return message

    # -- results --------------------------------------------------------------------------------

    def _metrics(self, wall_s: float) -> dict[str, Any]:
        cfg, tick_s = self.config, self.config.tick
        outcome = self.coordinator.outcome
        fired = [f for f in self._failures if f.member]
        detect: list[float] = []
        change: list[float] = []
        for failure in fired:
            failed = self._failed_tick.get(failure.member)
            if failed is None:
                if outcome is None or outcome[0]:
                    self._violation(f"failure of {failure.member} was never detected")
                continue
            detect.append((failed - failure.fired_tick) * tick_s)
            removed = next((t for _, t, seats, spares in self._commits
                            if t >= failed and failure.member not in seats and failure.member not in spares), None)
            if removed is not None:
                change.append((removed - failed) * tick_s)
            elif outcome is None or outcome[0]:
                self._violation(f"failure of {failure.member} was neither swapped nor reported as a job failure")
        steady_s = (self._steady[1] - self._steady[0]) * tick_s
        steady_ticks = self._steady[1] - self._steady[0]
        return {
            "members": cfg.members,
            "seats": cfg.seats,
            "spares": cfg.spares,
            "failures": cfg.failures,
            "failures_injected": len(fired),
            "seed": cfg.seed,
            "aggregate": cfg.aggregate,
            "heartbeat_interval": cfg.heartbeat_interval,
            "failure_timeout": self.coordinator_config.failure_timeout,
            "virtual_s": round(self.tick * tick_s, 3),
            "views_committed": len(self._commits),
            "invariant_violations": self._violation_count,
            "violations": list(self.violations),
            "detect_s_p50": _p50(detect),
            "detect_s_max": _round(max(detect, default=None)),
            "view_change_s_p50": _p50(change),
            "view_change_s_max": _round(max(change, default=None)),
            "swaps_completed": self._swaps,
            "job": "running" if outcome is None else ("finished" if outcome[0] else "failed"),
            "job_failure_reason": "" if outcome is None or outcome[0] else _shorten(outcome[1]),
            "false_positives": self._false_positives,
            "fenced_rejections": self._fenced_rejections,
            "spurious_rebuilds": self._spurious_rebuilds,
            "coordinator_msgs_per_s": round(self._steady_msgs / steady_s, 1),
            "coordinator_bytes_out": self._transport.bytes_sent,
            "view_frame_bytes": self._view_frame_bytes,
            "frames_dropped_oversize": self._dropped_oversize,
            "cpu_handle_s_per_s": round(self._steady_handle_cpu / steady_s, 4),
            "cpu_tick_s_per_s": round(self._steady_tick_cpu / steady_s, 4),
            "cpu_tick_ms": round(1000 * self._steady_tick_cpu / steady_ticks, 3),
            "cpu_startup_s": round(self._cpu_startup or 0.0, 3),
            "cpu_stall_s_max": round(self._cpu_stall_max, 4),
            "cpu_view_change_s_max": round(self._cpu_view_change_max, 4),
            "cpu_total_s": round(self._cpu_total, 3),
            "wall_s": round(wall_s, 3),
        }


def adaptive_interval(members: int, beats_per_s: float = 65_536.0, base: float = 0.1) -> float:
    """The heartbeat interval that keeps the coordinator under `beats_per_s` heartbeats per second.

    The fix for large jobs, with host aggregation: the interval grows with the
    job (``base`` up to 6,553 members, 0.25 s at 16,384) while ``failure_timeout``
    stays at its default, so detection does not slow down until it reaches five
    intervals.  ``deadpool launch`` knows the world size when it writes
    ``DEADPOOL_HEARTBEAT_INTERVAL``, so no protocol change is needed.
    """
    return max(base, round(members / beats_per_s, 3))


def _shorten(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _p50(values: list[float]) -> float | None:
    """The median (nearest rank, low), or None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[(len(ordered) - 1) // 2], 4)


def simulate(config: SimConfig) -> dict[str, Any]:
    """Run one simulation on a fresh event loop and return its metrics (see the module docstring).

    Raises:
        MisuseError: the configuration is out of range.
    """
    return asyncio.run(Simulation(config).run())


def format_table(result: dict[str, Any]) -> str:
    """The metrics as a short two-column table for people (``deadpool simulate`` without ``--json``)."""
    rows = [(key, value) for key, value in result.items() if key != "violations"]
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    lines += [f"  violation: {text}" for text in result.get("violations", [])]
    if result.get("frames_dropped_oversize"):
        lines.append(
            f"note: a CommitView of {result['view_frame_bytes']:,} bytes is over the members' control-frame limit, "
            "so every member dropped it, as real workers would; to study the protocol past that point, rerun "
            "with a larger --max-frame-bytes."
        )
    return "\n".join(lines)
