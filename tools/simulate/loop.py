"""The simulation loop: the real coordinator driven by a virtual clock, its sends routed to simulated members.

Each tick, in order: timers and scheduled failures fire, the coordinator's sends
of the previous tick reach their recipients, members (or their agents) beat,
and the coordinator handles every message that arrived and then ticks.  Every
message crosses the real codec both ways; nothing sleeps and no event loop runs.
"""

from __future__ import annotations

import functools
import gc
import heapq
import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from deadpool.agent.relay import HELLO_EVERY_S
from deadpool.config import FreezeOnCommit, relax_gc
from deadpool.coordinator import fanout
from deadpool.coordinator.records import Send
from deadpool.coordinator.service import Coordinator
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol import codec, viewsync
from deadpool.protocol.messages import (
    AgentHello,
    CollectiveFailed,
    CommitView,
    Join,
    Message,
    PrepareAck,
    ProcessExited,
    Recovered,
    Relay,
    Role,
    ViewChunk,
    ViewDelta,
)
from deadpool.protocol.transport import CONTROL_LIMITS
from deadpool.protocol.view import View

from .checks import Checker, Costs
from .cluster import Failure, FailureKind, ProcessState, SimAgent, SimConfig, SimMember, ViewInfo, view_info

_A = TypeVar("_A")
_R = TypeVar("_R")


class Simulation:
    """One seeded run: the real coordinator, simulated members and agents, a virtual clock, the checks."""

    def __init__(self, config: SimConfig, coordinator_class: type[Coordinator] = Coordinator) -> None:
        self.config = cfg = config.validate()
        self.coordinator_config = cfg.coordinator_config()
        self.tick = 0
        self.step_ticks = self._ticks(cfg.step_s)
        self.restore_ticks = self._ticks(cfg.restore_s)
        self.stall_tick: int | None = None  # a seated member stopped: the others' collectives block from here
        self._hb_ticks = self._ticks(cfg.heartbeat_interval)
        self._rng = random.Random(cfg.seed)
        self.checker = Checker(self)
        self.costs = Costs()
        self._events = EventLog(None, member="coordinator", source="coordinator", clock=self.now)
        # The checks read each line as written, through the event schema (as ``deadpool events`` reads a file).
        self._events.listeners.append(lambda record: self._checked(self.checker.on_line, schema.encode(record)))
        self._checking = 0.0  # this tick's CPU of the checker inside the coordinator's calls: not the coordinator's
        self.coordinator = coordinator_class(self.coordinator_config, cfg.seats, "sim-store:29400", self._events,
                                             started=self.now(), wall_clock=self.now)
        self._inbound: list[bytes] = []
        self._answering: list[SimAgent] = []  # agents holding their members' answers of this tick
        # The coordinator's encoded sends of this tick: (address, frame, the Relay header's frame when relayed).
        self._outbox: list[tuple[str, bytes, bytes]] = []
        self._headers: dict[str, tuple[Relay, bytes]] = {}  # the coordinator process's encoded Relay headers
        self._kept: dict[str, tuple[Message, bytes]] = {}  # ... and its agents' Welcomes (Send.again)
        self._frozen = FreezeOnCommit()
        self._timers: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._decoded: dict[int, tuple[bytes, Message]] = {}  # id(frame) -> decoded, for this tick's sends
        self._infos: dict[int, ViewInfo] = {}  # epoch -> lookups over the view delivered for it
        self._deltas: dict[tuple[int, bytes], tuple[ViewInfo, ViewInfo | None]] = {}  # (base, digest) -> applied
        self._digests: dict[int, tuple[View, bytes]] = {}  # id(view) -> its digest
        self._assembly: dict[bytes, viewsync.Reassembly] = {}  # digest -> pieces of a chunked view so far
        self._pieces: dict[bytes, View] = {}  # digest -> the chunked view, once every piece was sent
        self._current: ViewInfo | None = None  # newest view delivered to the members
        self._not_running: set[str] = set()  # members stopped (dead or frozen), for picking victims
        self._coordinator_info: ViewInfo | None = None  # lookups over the coordinator's view, for picking victims
        self._quiet_after = 0  # tick after which the newest rebuilt view has reported its first step
        self._settle_view: tuple[View, set[str]] | None = None  # the coordinator's view and its members
        self._agents: list[SimAgent] = []
        self._members: list[SimMember] = []
        self._by_id: dict[str, SimMember] = {}
        self._by_addr: dict[str, SimMember | SimAgent] = {}
        self._member_buckets: list[list[SimMember]] = [[] for _ in range(self._hb_ticks)]  # by heartbeat phase
        self._agent_buckets: list[list[SimAgent]] = [[] for _ in range(self._hb_ticks)]
        self._hello_ticks = self._ticks(HELLO_EVERY_S)
        self._hello_buckets: list[list[bytes]] = [[] for _ in range(self._hello_ticks)]  # agents' hello frames
        self._recent = codec.Recent(None, CONTROL_LIMITS.max_frame_bytes)  # as the coordinator process decodes
        self._build_cluster()
        failures_from = self._ticks(cfg.join_s + 0.5 + cfg.steady_s)
        self._steady = (self._ticks(cfg.join_s + 0.5), failures_from)  # ticks measured as steady state
        self._failures = self._schedule_failures(failures_from)
        self._victims: dict[str, Failure] = {}

    # -- set up ---------------------------------------------------------------------------------

    def _ticks(self, seconds: float) -> int:
        return max(1, round(seconds / self.config.tick))

    def now(self) -> float:
        """Virtual seconds: the coordinator's clock and wall clock both."""
        return round(self.tick * self.config.tick, 9)

    def healthy(self, member: str) -> bool:
        sim_member = self._by_id.get(member)
        return member not in self._victims and sim_member is not None and sim_member.running

    def _build_cluster(self) -> None:
        """Members on hosts of members_per_host, seats first and spares last; joins at seeded random times."""
        cfg, rng = self.config, self._rng
        join_ticks = self._ticks(cfg.join_s)
        joins: list[tuple[int, SimMember]] = []
        for index in range(cfg.members):
            h = index // cfg.members_per_host
            host = f"node{h:05d}"
            if h == len(self._agents):
                agent = SimAgent(f"agent-{host}-{rng.getrandbits(16):04x}", host)
                self._agents.append(agent)
                self._by_addr[agent.control_addr] = agent
                self._agent_buckets[rng.randrange(self._hb_ticks)].append(agent)
            agent = self._agents[h]
            seated = index < cfg.seats
            label = f"rank{index}" if seated else f"spare{index - cfg.seats}"
            member = SimMember(f"{host}:{label}:{rng.getrandbits(24):06x}", host,
                               Role.ACTIVE if seated else Role.SPARE, index if seated else -1, 10_000 + index,
                               f"tcp://10.{(h >> 8) & 255}.{h & 255}.1:{29600 + index % cfg.members_per_host}",
                               agent)
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
        # A hello at the start, and again every HELLO_EVERY_S (deadpool/agent/launch.py), hosts spread over the ticks.
        for h, agent in enumerate(self._agents):
            hello = codec.encode(AgentHello(agent.agent_id, agent.host, agent.control_addr,
                                            {m.member: m.pid for m in agent.members}))
            self._at(0, functools.partial(self._inbound.append, hello))
            self._hello_buckets[h % self._hello_ticks].append(hello)

    def _schedule_failures(self, start: int) -> list[Failure]:
        """K failures: kinds rotate, the second waits for a view change, the third hits a spare."""
        cfg, rng = self.config, self._rng
        end = max(start, self._ticks(cfg.duration - self.coordinator_config.failure_timeout - 1.0))
        kinds = [FailureKind.HANG, FailureKind.CRASH, FailureKind.ZOMBIE]
        rng.shuffle(kinds)
        failures = []
        for k in range(cfg.failures):
            during_round = k == 1
            failures.append(Failure(kinds[k % 3], start if during_round else rng.randint(start, end),
                                    during_round, end, spare=k == 2))
        failures.sort(key=lambda f: f.at_tick)
        return failures

    def _at(self, tick: int, action: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (tick, next(self._seq), action))

    # -- what members and agents do (the World a member sees) -----------------------------------

    def send(self, message: Message) -> None:
        """A member or agent sends to the coordinator; it is handled in this tick."""
        self._inbound.append(codec.encode(message))

    def answer(self, member: SimMember, ack: PrepareAck) -> None:
        """Batched, an answer goes with its host's others of this tick (as an agent's window, agent/relay.py)."""
        if not self.config.aggregate:
            self.send(ack)
            return
        if not member.agent.acks:
            self._answering.append(member.agent)
        member.agent.acks.append(ack)

    def _answers(self) -> None:
        """Each agent that its members answered through this tick sends them as one AckBatch."""
        answering, self._answering = self._answering, []
        for agent in answering:
            batch = agent.answers()
            if batch is not None:
                self.send(batch)

    def view_info(self, view: View) -> ViewInfo:
        info = self._infos.get(view.epoch)
        if info is None or info.view is not view:
            info = self._infos[view.epoch] = view_info(view)
        return info

    def apply_delta(self, held: ViewInfo, delta: ViewDelta) -> ViewInfo | None:
        key = (id(held.view), delta.digest)
        cached = self._deltas.get(key)
        if cached is None:
            view, _ = viewsync.apply_delta(held.view, self._digest(held.view), delta)
            cached = self._deltas[key] = (held, None if view is None else self.view_info(view))
        return cached[1]

    def chunked_view(self, last: ViewChunk) -> ViewInfo:
        return self.view_info(self._pieces[last.digest])  # reassembled once, when sent: every member got its pieces

    def adopted(self, info: ViewInfo) -> None:
        if self._current is None or info.view.epoch > self._current.view.epoch:
            self._view_delivered(info)

    def _digest(self, view: View) -> bytes:
        digest = self._digests.get(id(view))
        if digest is None or digest[0] is not view:
            digest = self._digests[id(view)] = (view, viewsync.view_digest(view))
        return digest[1]

    def _join(self, member: SimMember) -> None:
        if member.running:
            self.send(Join(member.member, member.role, member.seat_hint, self.config.seats, member.pid,
                           member.host, member.control_addr, member.bulk_addr))

    def stop_member(self, member: SimMember, state: ProcessState, returncode: int | None, delay: int = 1) -> None:
        """A member stops running (dies or freezes); its agent reports a process exit after `delay` ticks."""
        if member.state == ProcessState.DEAD or (member.state == state):
            return
        was_running = member.running
        member.state = state
        self._not_running.add(member.member)
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
        if member is None or member.state == ProcessState.DEAD or (
                failure is not None and failure.kind == FailureKind.ZOMBIE):
            return
        self.stop_member(member, ProcessState.DEAD, returncode=-9)

    def _collective_failed(self, victim: SimMember, neighbours: list[str], epoch: int) -> None:
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

    def _wake(self, member: SimMember) -> None:
        """A zombie resumes with stale state: its messages must be rejected and it must learn it is fenced."""
        if member.state == ProcessState.FROZEN and self.coordinator.outcome is None:
            member.state = ProcessState.RUNNING
            self._not_running.discard(member.member)
            epoch = member.view.view.epoch if member.view else 0
            self.send(CollectiveFailed(member.member, epoch, member.step(self), "woke up: the collective timed out"))

    def _strike(self, failure: Failure) -> None:
        """Kill the victim the seed picks now, as a crash, a hang or a zombie."""
        member = self._pick_victim(failure)
        if member is None:
            return
        failure.member, failure.fired_tick = member.member, self.tick
        self._victims[member.member] = failure
        current = self._current
        seat = current.seat_of.get(member.member) if current else None
        failure.on_spare = current is not None and seat is None
        if failure.kind == FailureKind.CRASH:
            self.stop_member(member, ProcessState.DEAD, returncode=-9, delay=self._rng.randint(1, 5))
            if current is not None and seat is not None and self.stall_tick == self.tick:
                neighbours = [current.view.seats[s] for s in [current.view.buddies[seat], *current.wards.get(seat, [])]
                              if s != seat]
                epoch = current.view.epoch
                self._at(self.tick + self._rng.randint(2, 10),
                         lambda: self._collective_failed(member, neighbours, epoch))
        else:
            self.stop_member(member, ProcessState.FROZEN, returncode=None)
            if failure.kind == FailureKind.ZOMBIE:
                wake = self._ticks(2 * self.coordinator_config.failure_timeout + 1.0)
                self._at(self.tick + wake, lambda: self._wake(member))

    def _pick_victim(self, failure: Failure) -> SimMember | None:
        """A running member, never the buddy or ward of a seat awaiting its swap (that would lose the seat's state)."""
        view = self.coordinator.view
        if view is None:
            candidates = [m.member for m in self._members if m.running]
        else:
            protected: set[int] = set()
            if self._coordinator_info is None or self._coordinator_info.view is not view:
                self._coordinator_info = view_info(view)  # the coordinator's own copy: not the members' cache
            info = self._coordinator_info
            pending = [info.seat_of.get(m) for m, f in self._victims.items() if f.fired_tick >= 0]
            rnd = self.coordinator.round
            for seat in [*(s for s in pending if s is not None), *(rnd.failed if rnd else ())]:
                protected.update((view.buddies[seat], *info.wards.get(seat, ())))
            seats = [m for s, m in enumerate(view.seats) if s not in protected]
            if failure.spare:
                candidates = list(view.spares) or seats
            elif failure.during_round:
                candidates = seats
            else:
                candidates = [*seats, *view.spares]
            out = self._not_running.union(self._victims)  # a handful: filtering by it keeps a pick O(members) cheap
            candidates = [m for m in candidates if m not in out]
        return self._by_id[self._rng.choice(candidates)] if candidates else None

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run to the end (bounded), checking the invariants every tick; returns the metrics.

        The process collects garbage as a coordinator's does (``relax_gc``, ``FreezeOnCommit``), for the run only.
        """
        previous = relax_gc()
        try:
            return self._run()
        finally:
            gc.unfreeze()
            gc.set_threshold(*previous)

    def _run(self) -> dict[str, Any]:
        cfg = self.config
        started = time.perf_counter()
        duration = self._ticks(cfg.duration)
        timeouts = 2 * self.coordinator_config.failure_timeout + self.coordinator_config.prepare_timeout + 5.0
        last_tick = duration + self._ticks(timeouts)
        for tick in range(last_tick + 1):
            self.tick = tick
            self._fire(tick)
            self._deliver()
            self._answers()
            self._beat(tick)
            self._coordinator_turn(tick)
            self._check_sends()
            if self.coordinator.outcome is not None or (tick >= duration and self._settled()):
                break
        return self.checker.metrics(cfg, self.coordinator_config, self._failures, self.costs, self._steady,
                                    time.perf_counter() - started)

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
        outbox, self._outbox = self._outbox, []
        decoded, self._decoded = self._decoded, {}
        limit = self.config.max_frame_bytes
        for address, frame, header in outbox:
            target = self._by_addr.get(address)
            if target is None or (isinstance(target, SimMember) and not target.running):
                continue  # a dead or frozen process reads nothing
            if len(frame) > limit:
                self.costs.dropped_oversize += 1  # the worker's transport refuses it, as CONTROL_LIMITS says
                continue
            cached = decoded.get(id(frame))
            message = cached[1] if cached is not None and cached[0] is frame else _decode(frame)
            if not header:
                target.receive(message, self)
                continue
            relay = decoded.get(id(header))
            to = relay[1] if relay is not None and relay[0] is header else _decode(header)
            assert isinstance(target, SimAgent) and isinstance(to, Relay), f"a relay to {address}"
            for addr in to.to:  # the agent passes the frame on to its workers (agent/relay.py)
                member = self._by_addr.get(addr)
                if isinstance(member, SimMember) and member.running and member.agent is target:
                    member.receive(message, self)

    def _view_delivered(self, info: ViewInfo) -> None:
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

    def _recovered(self, info: ViewInfo) -> None:
        """The first step finished under a rebuilt view is reported, by seat 0 and by spares new to a seat."""
        if self._current is not info:
            return
        for seat, member_id in enumerate(info.view.seats):
            member = self._by_id[member_id]
            if seat != 0 and (member.role is not Role.SPARE or member.swap_reported):
                continue  # as a worker's Recovery: a spare new to its seat, and seat 0, report
            if member.running and member.view is info and member.step(self) > info.view.resume_step:
                member.swap_reported = member.role is Role.SPARE
                self.send(Recovered(member.member, info.view.epoch, info.view.resume_step + 1, self.now()))

    def _beat(self, tick: int) -> None:
        if tick:
            self._inbound += self._hello_buckets[tick % self._hello_ticks]
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

    def _coordinator_turn(self, tick: int) -> None:
        """What the coordinator process does in one tick: decode, handle and encode every message, then tick."""
        coordinator, checker, costs, now = self.coordinator, self.checker, self.costs, self.now()
        inbound, self._inbound = self._inbound, []
        kinds = costs.inbound
        had_view = coordinator.view is not None  # the tick that forms the first view is startup, not a change
        self._checking = 0.0
        handled: list[type[Message]] = []  # counted after the turn: the simulator's own books, not timed
        t0 = time.process_time()
        for frame in inbound:
            message = self._recent.decode(frame)
            if isinstance(message, codec.DecodeError):
                self._events.emit(schema.Rejected(reason=message.reason, detail=message.detail))
                continue
            handled.append(type(message))  # the kind only: the message must die when handled, as it does there
            fenced = self._checked(checker.fenced_state, message) if coordinator.fenced else None
            self._encode(coordinator.handle(now, message))
            if fenced:
                self._checked(checker.check_fenced, fenced)
        t1, handling_checked = time.process_time(), self._checking
        self._encode(coordinator.tick(now))
        self._frozen.committed(coordinator.events.epoch)  # as the coordinator process does (coordinator/main.py)
        t2 = time.process_time()
        for kind in handled:
            kinds[kind] = kinds.get(kind, 0) + 1
        spent = t2 - t0 - self._checking
        costs.total_cpu += spent
        costs.stall_cpu_max = max(costs.stall_cpu_max, spent)
        if costs.startup_cpu is None and coordinator.view is not None:
            costs.startup_cpu = costs.total_cpu
        if self._steady[0] <= tick < self._steady[1]:
            costs.steady_msgs += len(inbound)
            costs.steady_handle_cpu += t1 - t0 - handling_checked
            costs.steady_tick_cpu += t2 - t1 - (self._checking - handling_checked)
        if checker.view_change_tick and had_view:
            costs.view_change_cpu_max = max(costs.view_change_cpu_max, spent)
        checker.view_change_tick = False

    def _checked(self, check: Callable[[_A], _R], argument: _A) -> _R:
        """One of the checker's looks inside the coordinator's calls (an event as emitted, a fenced member's
        state): its time is the simulator's, taken out of the coordinator's CPU."""
        started = time.perf_counter()
        try:
            return check(argument)
        finally:
            self._checking += time.perf_counter() - started

    def _encode(self, sends: Sequence[Send]) -> None:
        """The coordinator process's share of a send: encoding, once per message object (a broadcast)."""
        if not sends:
            return
        for send, frames in fanout.encoded(sends, None, self._headers, self._kept):
            header = frames[0] if len(frames) == 2 else b""
            self._outbox.append((send.address, frames[-1], header))
            self.costs.bytes_out += len(frames[-1]) + len(header)

    def _check_sends(self) -> None:
        """Every distinct frame sent this tick is decoded once (members read the decoded copy); views checked."""
        last: bytes | None = None
        for _, frame, header in self._outbox:
            if header and id(header) not in self._decoded:
                self._decoded[id(header)] = (header, _decode(header))
                self.costs.max_frame_bytes = max(self.costs.max_frame_bytes, len(header))
            if frame is last:
                continue
            last = frame
            message = _decode(frame)
            self._decoded[id(frame)] = (frame, message)
            self.costs.max_frame_bytes = max(self.costs.max_frame_bytes, len(frame))
            if isinstance(message, CommitView):
                self.costs.view_frame_bytes = max(self.costs.view_frame_bytes, len(frame))
                self.checker.check_view_sent(message.view.epoch, self._digest(message.view))
            elif isinstance(message, ViewDelta):
                self.checker.check_view_sent(message.epoch, message.digest)
                view = self.coordinator.view  # the coordinator hashes only the seat runs a commit changed
                if view is not None and view.epoch == message.epoch and self._digest(view) != message.digest:
                    self.checker.violation(f"the delta to view {message.epoch} carries another digest than the view's")
            elif isinstance(message, ViewChunk):
                self.checker.check_view_sent(message.epoch, message.digest)
                if message.digest not in self._pieces:
                    view, why = self._assembly.setdefault(message.digest, viewsync.Reassembly()).add(message)
                    if view is not None:
                        self._pieces[message.digest] = view
                    elif why:
                        self.checker.violation(f"the coordinator sent a bad piece of view {message.epoch}: {why}")

    def _settled(self) -> bool:
        """Every failure fired and resolved, no view change in progress, swaps reported, zombies woken and gone."""
        if (self.coordinator.round is not None or self.tick <= self._quiet_after
                or any(f.fired_tick < 0 or (f.kind == FailureKind.ZOMBIE and f.member
                                            and self._by_id[f.member].state != ProcessState.DEAD)
                       for f in self._failures)):
            return False
        view = self.coordinator.view
        if view is None:
            return False
        if self._settle_view is None or self._settle_view[0] is not view:
            self._settle_view = (view, {*view.seats, *view.spares})
        in_view = self._settle_view[1]
        return all(f.member in self.coordinator.fenced and f.member not in in_view for f in self._failures if f.member)


def _decode(frame: bytes) -> Message:
    message = codec.decode(frame, None, max(len(frame), 1))
    if isinstance(message, codec.DecodeError):  # the coordinator encoded it: cannot happen
        raise AssertionError(f"the coordinator sent an undecodable frame: {message}")
    return message


def simulate(config: SimConfig, coordinator_class: type[Coordinator] = Coordinator) -> dict[str, Any]:
    """Run one simulation and return its metrics (`coordinator_class`: the coordinator under test).

    Raises:
        MisuseError: the configuration is out of range.
    """
    return Simulation(config, coordinator_class).run()


AGGREGATE_FROM = 4096  # members from which the simulated host agents batch heartbeats by default
HOST_MESSAGES_PER_S = 32_768.0  # HostHeartbeats per second the default interval of a batched job allows


def scaled(members: int, failures: int, seed: int, duration: float = 10.0, aggregate: bool | None = None,
           heartbeat_interval: float = 0.0) -> SimConfig:
    """The configuration ``deadpool simulate`` runs: batching from AGGREGATE_FROM members, the interval scaled.

    Unbatched, one Heartbeat per member per interval (``adaptive_interval`` over members); batched,
    one HostHeartbeat per host per interval, the interval growing once the hosts would send more than
    HOST_MESSAGES_PER_S (0.5 s at 16,384 hosts, that is 131,072 members).  ``failure_timeout`` stays
    at its default while it spans at least four intervals.
    """
    batched = members >= AGGREGATE_FROM if aggregate is None else aggregate
    if not heartbeat_interval:
        hosts = -(-members // SimConfig().members_per_host)
        heartbeat_interval = (adaptive_interval(hosts, HOST_MESSAGES_PER_S) if batched
                              else adaptive_interval(members))
    return SimConfig(members=members, failures=failures, seed=seed, duration=duration, aggregate=batched,
                     heartbeat_interval=heartbeat_interval)


def adaptive_interval(members: int, beats_per_s: float = 65_536.0, base: float = 0.1) -> float:
    """The heartbeat interval that keeps the coordinator under `beats_per_s` heartbeats per second.

    The fix for large jobs, with host aggregation: the interval grows with the
    job (``base`` up to 6,553 members, 0.25 s at 16,384) while ``failure_timeout``
    stays at its default, so detection does not slow down until it reaches five
    intervals.  ``deadpool launch`` knows the world size when it writes
    ``DEADPOOL_HEARTBEAT_INTERVAL``, so no protocol change is needed.
    """
    return max(base, round(members / beats_per_s, 3))
