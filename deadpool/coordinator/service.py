"""The membership service's state machine: heartbeats in, numbered views out.

Sans-I/O: :meth:`Coordinator.handle` and :meth:`Coordinator.tick` change state
and return the messages to send (:class:`~deadpool.coordinator.records.Send`);
nothing here waits on a socket or reads a clock.  The process entry point
(``main.py``) and the simulator (``deadpool simulate``) drive the same code,
one on real time and sockets, the other on a virtual clock.  The service routes
each message to the piece that owns what it changes (deaths, rounds, views, host
beats, operator chaos, the job's end) and keeps membership itself: joins, agents,
spares pooling, the first view and the term.  Policy lives in the pure functions
of ``decisions.py``; docs/design/coordinator.md walks through a swap.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from deadpool.config import Config
from deadpool.coordinator import decisions, fanout
from deadpool.coordinator.audits import Audits
from deadpool.coordinator.deaths import Deaths
from deadpool.coordinator.decisions import Trigger
from deadpool.coordinator.ending import Ending
from deadpool.coordinator.finishes import Finishes
from deadpool.coordinator.first_view import FirstSeats, Outcome
from deadpool.coordinator.hostbeats import HostBeats
from deadpool.coordinator.liveness import Liveness
from deadpool.coordinator.moves import Moves
from deadpool.coordinator.operator_chaos import OperatorChaos
from deadpool.coordinator.outbox import Outbox
from deadpool.coordinator.pools import Addresses, JoiningSpares, RejoinAsks
from deadpool.coordinator.ratelimit import RateLimit
from deadpool.coordinator.records import Agent, MemberRecord, Round, Send
from deadpool.coordinator.replicas import Corruption, ReplicaChecks
from deadpool.coordinator.rounds import Rounds
from deadpool.coordinator.slowness import Slowness
from deadpool.coordinator.status import Status
from deadpool.coordinator.swaps import Swaps
from deadpool.coordinator.terms import Terms
from deadpool.coordinator.views import Views
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import Detector, RejectReason
from deadpool.protocol.link import StandDown
from deadpool.protocol.messages import (
    AckBatch,
    AgentHello,
    AuditDigest,
    ChaosCommand,
    ChaosInjected,
    CollectiveFailed,
    Coordinators,
    Fenced,
    Finished,
    Heartbeat,
    HeartbeatBatch,
    Holding,
    HostHeartbeat,
    Join,
    LeaveAt,
    Leaving,
    Message,
    MoveCommand,
    PrepareAck,
    ProcessExited,
    Recovered,
    Rejoin,
    Role,
    StandbyHello,
    StartStandby,
    StatusReply,
    StatusRequest,
    StepReport,
    UserException,
    ViewReport,
    ViewRequest,
    Welcome,
)
from deadpool.protocol.view import View

log = logging.getLogger("deadpool.coordinator.service")

# Handled by kind (an agent's, an operator tool's, a coordinator's, a Join); any other message is a member's own.
# A set of the exact classes (messages are final): one hash lookup per message, not ten isinstance tests.
_NOT_A_MEMBERS_OWN = frozenset({HostHeartbeat, HeartbeatBatch, AckBatch, Join, AgentHello, StandbyHello, Coordinators,
                                ChaosCommand, MoveCommand, StatusRequest, ProcessExited})


class Coordinator:
    """State and message handling of the membership service; every call returns what to send."""

    def __init__(self, config: Config, world_size: int, store_addr: str, events: EventLog, started: float = 0.0,
                 wall_clock: Callable[[], float] = time.time, recovering: bool = False,
                 terms: Terms | None = None) -> None:
        self._config = config
        self.world_size = world_size  # seats: fixed for the job's life (a hot-swap keeps the mesh)
        self._store_addr = store_addr
        self.events = events
        # members, agents and fenced are shared with the pieces below: changed in place, never rebound.
        self.members: dict[str, MemberRecord] = {}  # stored through self._addrs.keep (its maps follow)
        self._addrs = Addresses()  # member -> host, bulk and control address: what views and broadcasts read
        self.agents: dict[str, Agent] = {}
        self.fenced: dict[str, str] = {}  # member -> reason (Deaths fences; everyone else reads)
        self.terms = terms or Terms(1, "", store_addr, 0, config.failure_timeout)
        self.fanout = fanout.Fanout(config.heartbeat_interval, config.relay_broadcasts)  # through host agents
        self._out = Outbox(self.terms, self.fanout, self._addrs, self.agents, started)  # drained by handle() and tick()
        self._views = Views(events, self.terms, self._out, self._addrs, self.fanout.catch_up, self.members, self.fenced)
        self._finished = Finishes()  # the seats' Finished reports
        self._ending = Ending(events, self.terms, self._out, self.members, self.agents, self.fenced, self._finished)
        self._chaos = OperatorChaos(events, self._views, self.members, self.agents, self._out, wall_clock)
        self._rate = RateLimit(events)
        self._live = Liveness()  # members by when they were last heard from directly, for the silence check
        self._hostbeats = HostBeats(events, self._views, self.members, self.agents, self.fenced, self._chaos,
                                    self._out, self.ask_to_rejoin)
        self._swaps = Swaps(events, wall_clock)
        unjoined_exits: set[str] = set()  # processes a launcher started that exited before they joined
        self._rounds = Rounds(config, world_size, events, self._views, self._out, self._ending, self.terms,
                              self._swaps, self._chaos, self.fanout, self.members, self.agents, self._addrs,
                              self.fenced, self._hostbeats.coverage, self._live, self._rate, unjoined_exits)
        self._deaths = Deaths(config, events, self._views, self._rounds, self._ending, self._swaps, self._chaos,
                              self.fanout, self._out, self.members, self.agents, self._addrs, self.fenced,
                              self._hostbeats.coverage, self._live, self._finished, unjoined_exits, wall_clock,
                              self.seat_lost_before_start)
        self._moves = Moves(events, self._views, self._rounds, self._swaps, self._out, self.members, self._addrs,
                            self.fenced, self._hostbeats.coverage, wall_clock)
        self._slowness = Slowness(config, events, self._views, self.members, self._moves, self._hostbeats.settle,
                                  lambda: self._swaps.last_recovery_s)
        self._replicas = ReplicaChecks(config.replica_checks, config.snapshot_every, events, self._views,
                                       self._ending.fail)
        self._audits = Audits(config.audit, events, self._views, self.members, self._out, self._moves.free_pool,
                              self._hostbeats.settle, lambda: self._rounds.current is not None)
        self._first = FirstSeats()  # the seats before the first view: joined, or lost
        self._joining = JoiningSpares()  # spares that joined the running job, pooled by one view at a time
        self._rejoins = RejoinAsks()  # when we last sent each unreachable member a Rejoin
        self._recovering = recovering  # restarted: the highest view members report, or a first view after the deadline
        self._ticked = started
        self._lease_lost_since: float | None = None
        self.handed_finished: list[Finished] = []  # a takeover: the seats' Finished that the standby heard
        self.handed_silence: dict[str, float] = {}  # ... and how long it had not heard each member then
        self._recover_deadline = started + max(3.0, 2 * config.failure_timeout) if recovering else 0.0
        self._status = Status(events, world_size, self._views, self._rounds, self._ending, self.terms, self.members,
                              self.fenced, self._hostbeats.coverage)  # `deadpool status`, with the newest events

    @property
    def view(self) -> View | None:
        """The view committed last (None before the first)."""
        return self._views.current

    @property
    def round(self) -> Round | None:
        """The view change in progress, if any."""
        return self._rounds.current

    @property
    def outcome(self) -> tuple[bool, str] | None:
        """(ok, reason) once the job ended."""
        return self._ending.outcome

    @property
    def stood_down(self) -> StandDown | None:
        """Why this coordinator stopped acting (a newer term runs the job, or it is cut off); None while it acts."""
        return self._ending.stood_down

    # -- the interface: state changes that return what to send ----------------------------------

    def handle(self, now: float, message: Message) -> list[Send]:
        """Apply one decoded message received at `now`; returns the messages to send because of it."""
        self._out.now = now
        self._handle(now, message)
        return self._out.drain()

    def tick(self, now: float) -> list[Send]:
        """Periodic checks (silent members, round deadlines, unexplained collective failures, the spare wait)."""
        self._out.now = now
        self._tick(now)
        return self._out.drain()

    def declare_dead(self, now: float, member: str, detected_by: Detector, detail: str) -> list[Send]:
        """Fence `member` forever and start (or extend) the view change that replaces it."""
        self._deaths.declare(now, [(member, detail)], detected_by)
        return self._out.drain()

    # -- message handling ---------------------------------------------------------------------

    def _handle(self, now: float, message: Message) -> None:
        if type(message) not in _NOT_A_MEMBERS_OWN:  # a member's own (or relayed): the most frequent, first
            sender = getattr(message, "sender", None)
            if not isinstance(sender, str) or sender not in self.members:
                self.events.emit(schema.Rejected(reason="unknown_peer",
                                 detail=f"{type(message).__name__} from {sender}"))
                if isinstance(message, Heartbeat):
                    self.ask_to_rejoin(message.sender, message.control_addr, now)
                return
            if sender in self.fenced:
                self.events.emit(schema.Rejected(reason=RejectReason.FENCED_PEER, peer=sender,
                                                 kind=type(message).__name__))
                fenced = Fenced(sender, self._views.epoch(), self.fenced[sender])
                self._out.send(self.members[sender].control_addr, fenced)
                return
            if not self._rate.allow(sender, now):
                return
            self.members[sender].last_seen = now
            self._live.seen(sender, now)
            self._on_member_message(message, sender, now)
        elif isinstance(message, HostHeartbeat):  # one host's beats (hostbeats.py, coverage.py)
            self._hostbeats.host_heartbeat(message, now)
            for member, checks in self._hostbeats.checks(message):
                self._corrupt(self._replicas.told(member, checks), now)
        elif isinstance(message, AgentHello):
            # Agents repeat their hello every second, so a restarted coordinator re-learns who owns which pid;
            # the Welcome tells the agent this coordinator is alive (a standby asks agents how long it was silent).
            agent = self.agents.get(message.sender)
            if agent is not None and (agent.hello is message or agent.hello == message):
                agent.seen = now
            else:
                agent = self.agents[message.sender] = Agent(message.sender, message.host, message.control_addr,
                                                            dict(message.members), now, message)
                self.fanout.hello(message.sender, message.members)
            if message.control_addr:
                self._out.send_again(message.control_addr, self._welcome(agent))
        elif isinstance(message, Join):
            self._on_join(message, now)
        elif isinstance(message, AckBatch):  # answers to a Prepare, in columns (rounds.py)
            self._rounds.answers(message, now, self._handle)
        elif isinstance(message, HeartbeatBatch):  # each as if its member had sent it
            self._hostbeats.relay(message, now, self._handle)
        elif isinstance(message, StandbyHello):
            if self.terms.standby_hello(now, message.sender):
                self.events.emit(schema.StandbyJoined(standby=message.sender, term=self.terms.term))
                self._tell_coordinators()
            self._out.send(message.sender, self.terms.coordinators())
        elif isinstance(message, Coordinators):
            if message.term > self.terms.term:
                self._ending.stand_down(StandDown.SUPERSEDED,
                                        f"the coordinator at {message.active} took over with term {message.term}")
        elif isinstance(message, ChaosCommand):
            self._hostbeats.settle()  # a command for a later step compares the target's step with it
            self._chaos.command(message)
        elif isinstance(message, MoveCommand):
            self._moves.command(message, now)
        elif isinstance(message, StatusRequest):
            self._out.send(message.reply_to, StatusReply(message.nonce, json.dumps(self.status(now))))
        elif isinstance(message, ProcessExited):
            self._deaths.exited(message, now)

    def _corrupt(self, found: list[Corruption], now: float) -> None:
        """Seats found corrupt by the replica checks: fence and replace each, every seat rolling back to the newest
        step whose checks passed; with no spare free, stop the job naming the seat and the step."""
        for corruption in found:
            self.events.emit(schema.SdcConfirmed(member=corruption.member, rank=corruption.seat, step=corruption.step,
                                                 detector=corruption.detector, reason=corruption.reason,
                                                 rollback_step=corruption.rollback_step))
            if self.outcome is not None:
                return
            if not self._moves.free_spares():
                self._ending.fail(
                    f"silent data corruption: seat {corruption.seat} ({corruption.member}) found corrupt at step "
                    f"{corruption.step} ({corruption.reason}), and no spare is free to take its seat. Stopped rather "
                    "than train on corrupt state; relaunch with more --spares (the newest step known good is "
                    f"{corruption.rollback_step})")
                return
            self._deaths.declare(now, [(corruption.member, corruption.reason)], corruption.detector,
                                 limit=corruption.rollback_step)

    def _welcome(self, agent: Agent) -> Welcome:
        """The answer to `agent`'s hello: the Welcome object sent last time while it says the same (its frame is
        kept, see ``Send.again``), with the term it is sent with (no copy to stamp one)."""
        welcome, epoch, term, standby = agent.welcome, self._views.epoch(), self.terms.term, self.terms.standby
        if welcome is None or welcome.epoch != epoch or welcome.term != term or welcome.standby != standby:
            welcome = agent.welcome = Welcome(epoch, agent.agent_id, self.world_size, term, standby)
        return welcome

    def _on_member_message(self, message: Message, sender: str, now: float) -> None:
        record = self.members[sender]
        if isinstance(message, Heartbeat):
            if not record.control_addr:
                self.ask_to_rejoin(message.sender, message.control_addr, now)  # known only from a reported view
            record.step, record.epoch = message.step, message.epoch
            record.snapshot_step, record.confirmed_step = message.snapshot_step, message.confirmed_step
            record.stall_p99_s, record.compute_s = message.stall_p99_s, message.compute_s
            self._chaos.fire_armed(record)
            self.fanout.catch_up.check(now, sender, message.epoch, self._views.resend)
            if message.checks:
                self._corrupt(self._replicas.told(sender, message.checks), now)
        elif isinstance(message, PrepareAck):
            self._rounds.answer(message)
        elif isinstance(message, CollectiveFailed):
            self._deaths.collective_failed(message, now)
        elif isinstance(message, Recovered):
            self._on_recovered(message)
        elif isinstance(message, AuditDigest):
            self._corrupt(self._audits.digest(message), now)
        elif isinstance(message, Finished):
            self._on_finished(message)
        elif isinstance(message, ChaosInjected):
            self._chaos.injected(message)
        elif isinstance(message, StepReport):
            record.step = message.step
            self._chaos.fire_armed(record)
        elif isinstance(message, ViewReport):
            record.step = message.step
            self._adopt_reported_view(message, now)
        elif isinstance(message, UserException):
            self._deaths.raised(message, now)
        elif isinstance(message, LeaveAt):
            self._moves.leave_at(message)
        elif isinstance(message, Holding):
            self._moves.holding(message, now)
        elif isinstance(message, Leaving):
            self._moves.leaving(message, now)
        elif isinstance(message, ViewRequest) and self.view is not None and message.epoch <= self.view.epoch:
            self._views.resend(sender, -1)  # it missed a delta's base: the whole view
        else:
            self.events.emit(schema.Rejected(reason="unexpected_type", detail=type(message).__name__))

    def _on_join(self, join: Join, now: float) -> None:
        if join.sender in self.fenced:
            self._out.send(join.control_addr, Fenced(join.sender, self._views.epoch(), self.fenced[join.sender]))
            return
        if join.world_size != self.world_size and not (join.role == Role.SPARE and join.world_size == 0):
            self.events.emit(schema.Rejected(reason="wrong_world_size", peer=join.sender,
                             detail=f"member has WORLD_SIZE={join.world_size}, job has {self.world_size}"))
            return
        known = join.sender in self.members
        self._addrs.keep(self.members, MemberRecord(join.sender, join.role, join.host, join.pid, join.control_addr,
                                                    join.bulk_addr, join.seat_hint, now, now))
        self._live.seen(join.sender, now)
        if join.role == Role.ACTIVE:
            self._first.joined(join.seat_hint, join.sender, join.disk_steps if self.view is None else [])
        self._out.send(join.control_addr, Welcome(self._views.epoch(), join.sender, self.world_size, self.terms.term,
                                                  self.terms.standby))  # with its term: no copy to stamp one
        self._rounds.rejoined(join.sender, join.control_addr)  # a re-join during a round needs its Prepare
        if known:
            return
        self.events.emit(schema.MemberJoined(member=join.sender, role=join.role, host=join.host, pid=join.pid,
                         seat_hint=join.seat_hint))
        if self.view is None:
            if not self._recovering:
                self._maybe_first_view()
        elif not self.view.contains(join.sender):
            self._add_spare(join.sender, now)

    def ask_to_rejoin(self, member: str, control_addr: str, now: float) -> None:
        """A member we cannot reach is alive: ask it for its Join (once a second, not every beat).

        After a restart on the same address its heartbeats may never have failed, so it does not know to
        re-join (a Prepare could not reach it); after a takeover it may still follow the lost term: told ours.
        """
        if self._rejoins.due(member, control_addr, now):
            self.events.emit(schema.RejoinAsked(member=member))
            if self.terms.term > 1:
                self._out.send(control_addr, self.terms.coordinators())
            self._out.send(control_addr, Rejoin(self._views.epoch(), member))

    def _adopt_reported_view(self, report: ViewReport, now: float) -> None:
        """After a restart: take the highest-epoch view any member holds, as it is (no new epoch)."""
        reported = report.view
        if reported is None or (self.view is not None and reported.epoch <= self.view.epoch):
            return
        self._views.adopt(dataclasses.replace(reported, store_addr=self._store_addr))  # the old store died with us
        self._recovering = False
        for seat_hint, member in [*enumerate(reported.seats), *((-1, m) for m in reported.spares)]:
            if member not in self.members:
                # Placeholder until the member re-joins; one that never does is found silent and swapped (after
                # a takeover, counting the silence the standby had seen).
                self._addrs.keep(self.members, MemberRecord(
                    member, Role.ACTIVE if seat_hint >= 0 else Role.SPARE, reported.hosts.get(member, ""), 0, "",
                    reported.bulk_addrs.get(member, ""), seat_hint, now, now - self.handed_silence.get(member, 0.0)))
                self._live.seen(member, self.members[member].last_seen)
        self.events.emit(schema.ViewAdopted(epoch=reported.epoch, seats=reported.seats, spares=reported.spares,
                         resume_step=reported.resume_step, reported_by=report.sender))
        for finished in self.handed_finished:  # seats that finished while the old term's coordinator was lost
            self._on_finished(finished)

    def seat_lost_before_start(self, seat: int, member: str, why: str) -> None:
        """`member`, started for `seat`, died before the first view: a spare takes the seat in it."""
        self._first.lost(seat, member, why)
        if not self._recovering:
            self._maybe_first_view()

    def _maybe_first_view(self) -> None:
        if self.view is not None or self.outcome is not None or not self._first.complete(self.world_size):
            return
        actives = {r.seat_hint: r.member for r in self.members.values()
                   if r.role == Role.ACTIVE and r.member not in self.fenced}
        spares = [r.member for r in self.members.values() if r.role == Role.SPARE and r.member not in self.fenced]
        plan = self._first.plan(self.world_size, actives, spares, self._rounds.starting(), self._config.resume,
                                self._store_addr, self._addrs.host, self._addrs.bulk)
        if plan.view is None:
            if plan.outcome is Outcome.FAIL:
                self._ending.fail(plan.reason)
            return  # WAIT: a spare still starting takes the lost seat once it joins
        for seat, (lost, spare) in plan.refilled.items():
            self._swaps.seated(seat, lost, spare, plan.view.epoch)
        self._views.commit(plan.view, plan.reason, failed={seat: lost for seat, (lost, _) in plan.refilled.items()},
                           trigger=Trigger.FIRST_VIEW)

    def _add_spare(self, member: str, now: float) -> None:
        self._joining.waiting.append(member)
        if self.round is not None or self._joining.due(now):
            self._pool_spares(now)  # else the tick pools them: one view for a storm of joins, not one each

    def _pool_spares(self, now: float) -> None:
        assert self.view is not None
        joining, names = self._joining.take(self.fenced)
        if self._rounds.take_spares(now, joining, names) or not joining:
            return
        self._joining.pooled_at = now
        view = decisions.next_view(self.view, self.view.epoch + 1, {}, [*self.view.spares, *joining],
                                   self.view.resume_step, self._addrs.host, self._addrs.bulk, rebuild=False,
                                   changed=self._addrs.changed)
        self._views.commit(view, f"spare {names} joined the pool", failed={}, trigger=Trigger.SPARE_JOINED)

    def _on_recovered(self, message: Recovered) -> None:
        self._deaths.step_finished()
        self._swaps.completed(message)

    def _on_finished(self, message: Finished) -> None:
        if self.view is None or self._views.seat_of(message.sender) != message.seat:
            return
        self._finished.record(message)
        if not self._finished.complete(self.world_size):
            return
        digest, why = self._finished.digest()
        if digest is None:
            self._ending.fail(why)
            return
        self.events.emit(schema.TrainingFinished(step=message.step, state_digest=digest, epoch=self.view.epoch,
                         untracked_rollback=self._finished.untracked_rollback()))
        self._ending.end(True, f"training finished at step {message.step}; final state digest {digest}")

    def _tell_coordinators(self) -> None:
        """Every member and agent hears who coordinates this term (the standby changed)."""
        self._out.broadcast(list(self.members), self.terms.coordinators())
        for agent in self.agents.values():
            self._out.send(agent.control_addr, self.terms.coordinators())

    def _tick_terms(self, now: float) -> None:
        """The standby's silence, the older coordinators still to tell, and the lease."""
        silent = self.terms.standby_silent(now)
        if silent is not None:
            self.events.emit(schema.StandbyLost(standby=self.terms.standby, silent_s=round(silent, 3),
                             term=self.terms.term))
            self.terms.lose_standby(now)
            self._tell_coordinators()
        if self.terms.standby_due(now):
            host = decisions.standby_host(self.terms.lost_standby, self.terms.address,
                                          {a.agent_id: a.control_addr for a in self.agents.values()})
            if host is not None:
                why = f"standby {self.terms.lost_standby} lost" if self.terms.lost_standby else "no standby"
                self._out.send(self.agents[host].control_addr, StartStandby(self.terms.term, why))
        for old in self.terms.due(now):
            self._out.send(old, self.terms.coordinators())
        held, why = self.terms.lease(now, self.agents)
        if held:
            self._lease_lost_since = None
            self._rounds.try_commit()
            return
        self._lease_lost_since = self._lease_lost_since if self._lease_lost_since is not None else now
        if now - self._lease_lost_since > self._config.view_timeout:
            lost_for = now - self._lease_lost_since
            self._ending.stand_down(StandDown.CUT_OFF, f"cut off: {why} for {lost_for:.0f}s (view timeout "
                                    f"{self._config.view_timeout:.0f}s); the hosts that still hear each other go on")

    # -- time ---------------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        if self.outcome is not None:
            return
        if now - self._ticked > self._config.failure_timeout:  # this process did not run (SIGSTOP, starved):
            log.warning("no tick for %.1fs: silence is judged from now on", now - self._ticked)
            for record in self.members.values():  # nobody's silence is known
                record.last_seen = now
            self._live.all_seen(now)
            self._hostbeats.coverage.all_seen(now)
            for agent in self.agents.values():
                agent.seen = now
        self._ticked = now
        self._tick_terms(now)
        if self.outcome is not None:
            return
        if self._recovering and now > self._recover_deadline:
            self._recovering = False  # nobody reported a view: every seat finished, or the job had not started
            done = {f.seat: f for f in self.handed_finished}
            if len(done) == self.world_size:
                self._views.current = View(max(f.epoch for f in done.values()),
                                           [f.sender for _, f in sorted(done.items())],
                                           [], -1, "", "", {}, {}, [], {})  # the finished seats, only to count them
                self._finished.clear()
                for finished in done.values():
                    self._on_finished(finished)
                return
            self._maybe_first_view()
        self._moves.tick(now)  # preemption notices whose window passed
        self._slowness.check(now)  # fail-slow seats
        self._audits.tick(now)  # --audit: a spare re-does a seat's step
        self._deaths.silent(now)  # heartbeats and host beats
        if self.view is not None and self._joining.due(now):
            self._pool_spares(now)
        if not self._rounds.wait_for_spare(now):
            return
        self._deaths.unanswered(now)  # the round's Prepare
        self._deaths.unexplained(now)  # a collective error that no death explained

    # -- views for operators ------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        """The live state at `now` as a JSON-able document (``deadpool status``)."""
        self._hostbeats.settle()
        document = self._status.document(now)
        for seat in document["seats"]:
            seat["slowness"] = self._slowness.scores.get(seat["rank"])
        return {**document, **self._moves.status(), **self._replicas.status(), **self._audits.status()}
