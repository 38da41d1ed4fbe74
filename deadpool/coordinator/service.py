"""The membership service's state machine: heartbeats in, numbered views out.

Sans-I/O: :meth:`Coordinator.handle` and :meth:`Coordinator.tick` change state
and return the messages to send (:class:`~deadpool.coordinator.records.Send`);
nothing here waits on a socket or reads a clock.  The process entry point
(``main.py``) and the simulator (``deadpool simulate``) drive the same code,
one on real time and sockets, the other on a virtual clock.  Policy lives in
the pure functions of ``decisions.py``; docs/architecture.md walks through a swap.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import operator
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from deadpool.config import Config
from deadpool.coordinator import answers, deaths, decisions, fanout, hostbeats, raised
from deadpool.coordinator.coverage import Coverage
from deadpool.coordinator.decisions import NoSpare, RaisedError, Suspicion, Trigger
from deadpool.coordinator.finishes import Finishes
from deadpool.coordinator.first_view import FirstSeats, Outcome
from deadpool.coordinator.liveness import Liveness
from deadpool.coordinator.operator_chaos import OperatorChaos
from deadpool.coordinator.pools import Addresses, JoiningSpares, RejoinAsks, SparePool, Survivors
from deadpool.coordinator.ratelimit import RateLimit
from deadpool.coordinator.records import Agent, MemberRecord, PendingSwap, Round, Send
from deadpool.coordinator.status import status_document
from deadpool.coordinator.terms import Terms
from deadpool.coordinator.views import ViewSender
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.link import StandDown
from deadpool.protocol.messages import (
    AckBatch,
    AgentHello,
    ChaosCommand,
    ChaosInjected,
    CollectiveFailed,
    Coordinators,
    Fenced,
    Finished,
    Heartbeat,
    HeartbeatBatch,
    HostHeartbeat,
    Join,
    Message,
    Prepare,
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
    Stop,
    UserException,
    ViewReport,
    ViewRequest,
    Welcome,
)
from deadpool.protocol.view import View

log = logging.getLogger("deadpool.coordinator.service")

RECENT_EVENTS = 20  # events kept for `deadpool status`
_LAST_SEEN = operator.attrgetter("last_seen")


# Handled by kind (an agent's, an operator tool's, a coordinator's, a Join); any other message is a member's own.
# A set of the exact classes (messages are final): one hash lookup per message, not ten isinstance tests.
_NOT_A_MEMBERS_OWN = frozenset({HostHeartbeat, HeartbeatBatch, AckBatch, Join, AgentHello, StandbyHello, Coordinators,
                                ChaosCommand, StatusRequest, ProcessExited})


class Coordinator:
    """State and message handling of the membership service; every call returns what to send."""

    def __init__(self, config: Config, world_size: int, store_addr: str, events: EventLog, started: float = 0.0,
                 wall_clock: Callable[[], float] = time.time, recovering: bool = False,
                 terms: Terms | None = None) -> None:
        self.wall = wall_clock  # injected: the simulator runs on a virtual clock
        self._config = config
        self.world_size = world_size  # seats: fixed for the job's life (a hot-swap keeps the mesh)
        self._store_addr = store_addr
        self.events = events
        self.members: dict[str, MemberRecord] = {}  # stored through self._addrs.keep (its maps follow)
        self._addrs = Addresses()  # member -> host, bulk and control address: what views and broadcasts read
        self.agents: dict[str, Agent] = {}
        self.fenced: dict[str, str] = {}  # member -> reason
        self.view: View | None = None
        self.round: Round | None = None
        self._outbox: list[Send] = []  # what this call has to send; drained by handle() and tick()
        self._swaps: list[PendingSwap] = []
        self._failure_wall: dict[str, float] = {}
        self._suspect_since: float | None = None
        self._groups_epoch = 0  # the view that built the groups in use: an older collective report is stale
        self._finished = Finishes()  # the seats' Finished reports
        self.chaos = OperatorChaos()
        self.outcome: tuple[bool, str] | None = None  # (ok, reason) once the job ended
        self._rate = RateLimit(events)
        self._live = Liveness()  # members by when they were last heard from directly, for the silence check
        self.coverage = Coverage()  # members their host agent vouches for (HostHeartbeat)
        self._views = ViewSender()  # deltas for members that hold the previous view, the whole view for others
        self.fanout = fanout.Fanout(config.heartbeat_interval, config.relay_broadcasts)  # through host agents
        self._first = FirstSeats()  # the seats before the first view: joined, or lost
        self._joining = JoiningSpares()  # spares that joined the running job, pooled by one view at a time
        self._survivors_cache = Survivors()
        self._spare_pool = SparePool(config.heartbeat_interval)  # the order spares are chosen in, kept briefly
        self._blind_rebuilds = 0  # rebuilds with nobody dead since the last finished step (bounded)
        self._rejoins = RejoinAsks()  # when we last sent each unreachable member a Rejoin
        self._raised: list[RaisedError] = []  # the scripts' exceptions reported so far (one per member at most)
        self._gone_unjoined: set[str] = set()  # processes a launcher started that exited before they joined
        self._recovering = recovering  # restarted: the highest view members report, or a first view after the deadline
        self.terms = terms or Terms(1, "", store_addr, 0, config.failure_timeout)
        self.stood_down: StandDown | None = None  # it stopped acting: a newer term runs the job, or it is cut off
        self._now = self._ticked = started
        self._lease_lost_since: float | None = None
        self.handed_finished: list[Finished] = []  # a takeover: the seats' Finished that the standby heard
        self.handed_silence: dict[str, float] = {}  # ... and how long it had not heard each member then
        self._recover_deadline = started + max(3.0, 2 * config.failure_timeout) if recovering else 0.0
        # The newest events for `deadpool status`, compacted when asked for (bounded: floods of joins or rejections).
        self.recent_events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        events.listeners.append(self.recent_events.append)

    # -- the interface: state changes that return what to send ----------------------------------

    def handle(self, now: float, message: Message) -> list[Send]:
        """Apply one decoded message received at `now`; returns the messages to send because of it."""
        self._now = now
        self._handle(now, message)
        return self._drain()

    def tick(self, now: float) -> list[Send]:
        """Periodic checks (silent members, round deadlines, unexplained collective failures, the spare wait)."""
        self._now = now
        self._tick(now)
        return self._drain()

    def declare_dead(self, now: float, member: str, detected_by: str, detail: str) -> list[Send]:
        """Fence `member` forever and start (or extend) the view change that replaces it."""
        self._declare_dead(now, member, detected_by, detail)
        return self._drain()

    def _drain(self) -> list[Send]:
        sends, self._outbox = self._outbox, []
        return sends

    def send(self, addr: str, message: Message) -> None:
        """Queue `message` for `addr` (stamped with this term); handle() and tick() return the queue."""
        if addr:  # "": a member known only from a reported view has not re-joined yet
            self._outbox.append(Send(addr, self.terms.stamp(message)))

    def _broadcast(self, members: list[str], *messages: Message, relay: bool = True) -> fanout.Plan:
        """Each message object to every recipient (encoded once), through their host agents where heard (fanout.py)."""
        plan = self.fanout.plan(members, self._addrs.control, self.agents, self._now, self.terms.term, relay)
        for message in messages:  # a whole view's pieces share one plan
            self._outbox += plan.sends(self.terms.stamp(message))
        return plan

    def _epoch(self) -> int:
        return self.view.epoch if self.view else 0

    # -- message handling ---------------------------------------------------------------------

    def _handle(self, now: float, message: Message) -> None:
        if type(message) not in _NOT_A_MEMBERS_OWN:  # a member's own (or relayed): the most frequent, first
            sender = getattr(message, "sender", None)
            if not isinstance(sender, str) or sender not in self.members:
                self.events.emit(Event.REJECTED, reason="unknown_peer",
                                 detail=f"{type(message).__name__} from {sender}")
                if isinstance(message, Heartbeat):
                    self.ask_to_rejoin(message.sender, message.control_addr, now)
                return
            if sender in self.fenced:
                self.events.emit(Event.REJECTED, reason="fenced_peer", peer=sender, kind=type(message).__name__)
                self.send(self.members[sender].control_addr, Fenced(sender, self._epoch(), self.fenced[sender]))
                return
            if not self._rate.allow(sender, now):
                return
            self.members[sender].last_seen = now
            self._live.seen(sender, now)
            self._on_member_message(message, sender, now)
        elif isinstance(message, HostHeartbeat):  # one host's beats (coverage.py)
            hostbeats.on_host_heartbeat(self, message, now)
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
                self._outbox.append(Send(message.control_addr, self._welcome(agent), None, True))
        elif isinstance(message, Join):
            self._on_join(message, now)
        elif isinstance(message, AckBatch):  # answers to a Prepare, in columns (answers.py)
            answers.on_batch(self, message, now, self._handle)
        elif isinstance(message, HeartbeatBatch):  # each as if its member had sent it
            hostbeats.relay(self, message, now, self._handle)
        elif isinstance(message, StandbyHello):
            if self.terms.standby_hello(now, message.sender):
                self.events.emit(Event.STANDBY_JOINED, standby=message.sender, term=self.terms.term)
                self._tell_coordinators()
            self.send(message.sender, self.terms.coordinators())
        elif isinstance(message, Coordinators):
            if message.term > self.terms.term:
                self._stand_down(StandDown.SUPERSEDED,
                                 f"the coordinator at {message.active} took over with term {message.term}")
        elif isinstance(message, ChaosCommand):
            hostbeats.settle(self)  # a command for a later step compares the target's step with it
            self.chaos.command(self, message)
        elif isinstance(message, StatusRequest):
            self.send(message.reply_to, StatusReply(message.nonce, json.dumps(self.status(now))))
        elif isinstance(message, ProcessExited):
            self._on_exit(message, now)

    def _welcome(self, agent: Agent) -> Welcome:
        """The answer to `agent`'s hello: the Welcome object sent last time while it says the same (its frame is
        kept, see ``Send.again``), with the term it is sent with (no copy to stamp one)."""
        welcome, epoch, term, standby = agent.welcome, self._epoch(), self.terms.term, self.terms.standby
        if welcome is None or welcome.epoch != epoch or welcome.term != term or welcome.standby != standby:
            welcome = agent.welcome = Welcome(epoch, agent.agent_id, self.world_size, term, standby)
        return welcome

    def _on_exit(self, message: ProcessExited, now: float) -> None:
        if message.sender not in self.agents:
            self.events.emit(Event.REJECTED, reason="unknown_agent", peer=message.sender)
            return
        record = self.members.get(message.member)
        if record is not None:
            record.exited = True
        else:
            self._gone_unjoined.add(message.member)
        how = f"signal {-message.returncode}" if message.returncode < 0 else f"exit code {message.returncode}"
        unjoined_active = record is None and message.seat_hint >= 0 and self.view is None
        if unjoined_active and message.returncode > 0:  # its script failed before deadpool.init(): a spare's would
            self._fail_job(f"rank {message.seat_hint} ({message.member}) ended ({how}) before it joined the job, "
                           "so training cannot start (its output says why); relaunch the job")
        elif unjoined_active and message.returncode < 0:  # killed (a bad node found at start-up): a spare takes it
            deaths.declare(self, now, [(message.member, f"process ended ({how}) before it joined")], "exit",
                           {message.member: message.seat_hint})
        elif message.returncode and message.member in self.members and not self._finished.by(message.member):
            self._declare_dead(now, message.member, "exit", f"process ended ({how})")
        # A clean exit ends a finished seat or a released spare; an unfinished one's silence is caught by heartbeats.

    def _on_member_message(self, message: Message, sender: str, now: float) -> None:
        record = self.members[sender]
        if isinstance(message, Heartbeat):
            if not record.control_addr:
                self.ask_to_rejoin(message.sender, message.control_addr, now)  # known only from a reported view
            record.step, record.epoch = message.step, message.epoch
            record.snapshot_step, record.confirmed_step = message.snapshot_step, message.confirmed_step
            record.stall_p99_s = message.stall_p99_s
            self.chaos.fire_armed(self, record)
            self.fanout.catch_up.check(now, sender, message.epoch, self.resend_view)
        elif isinstance(message, PrepareAck):
            answers.on_ack(self, message)
        elif isinstance(message, CollectiveFailed):
            if message.epoch < self._groups_epoch:  # about a group a later view replaced: nothing to rebuild
                self.events.emit(Event.REJECTED, reason="stale_collective_report", peer=message.sender,
                                 report_epoch=message.epoch, groups_epoch=self._groups_epoch)
                return
            self.events.emit(Event.COLLECTIVE_ERROR_REPORTED, member=message.sender, step=message.step,
                             error=message.error[:300])
            if self.round is None and self._suspect_since is None:
                self._suspect_since = now
        elif isinstance(message, Recovered):
            self._on_recovered(message)
        elif isinstance(message, Finished):
            self._on_finished(message)
        elif isinstance(message, ChaosInjected):
            self.chaos.injected_at[message.sender] = message.ts
            self.chaos.injected_step[message.sender] = message.step
        elif isinstance(message, StepReport):
            record.step = message.step
            self.chaos.fire_armed(self, record)
        elif isinstance(message, ViewReport):
            record.step = message.step
            self._adopt_reported_view(message, now)
        elif isinstance(message, UserException):
            raised.on_user_exception(self, message, now)
        elif isinstance(message, ViewRequest) and self.view is not None and message.epoch <= self.view.epoch:
            self.resend_view(sender, -1)  # it missed a delta's base: the whole view
        else:
            self.events.emit(Event.REJECTED, reason="unexpected_type", detail=type(message).__name__)

    def _on_join(self, join: Join, now: float) -> None:
        if join.sender in self.fenced:
            self.send(join.control_addr, Fenced(join.sender, self._epoch(), self.fenced[join.sender]))
            return
        if join.world_size != self.world_size and not (join.role == Role.SPARE and join.world_size == 0):
            self.events.emit(Event.REJECTED, reason="wrong_world_size", peer=join.sender,
                             detail=f"member has WORLD_SIZE={join.world_size}, job has {self.world_size}")
            return
        known = join.sender in self.members
        self._addrs.keep(self.members, MemberRecord(join.sender, join.role, join.host, join.pid, join.control_addr,
                                                    join.bulk_addr, join.seat_hint, now, now))
        self._live.seen(join.sender, now)
        if join.role == Role.ACTIVE:
            self._first.joined(join.seat_hint, join.sender, join.disk_steps if self.view is None else [])
        self.send(join.control_addr, Welcome(self._epoch(), join.sender, self.world_size, self.terms.term,
                                              self.terms.standby))  # with its term: no copy to stamp one
        rnd, view = self.round, self.view
        if rnd is not None and view is not None and (join.sender in self._survivors_cache.set_of(view, rnd, self.fenced)
                                                     or join.sender in rnd.replacements.values()):
            # A re-join during a round (after a takeover the Prepare went out before this member's address was
            # known again): it needs the Prepare to pause and answer.
            self.send(join.control_addr, Prepare(rnd.epoch, sorted(rnd.failed), rnd.reason, dict(rnd.replacements),
                                                 failure_step=self.chaos.failure_step(rnd.failed.values())))
        if known:
            return
        self.events.emit(Event.MEMBER_JOINED, member=join.sender, role=join.role, host=join.host, pid=join.pid,
                         seat_hint=join.seat_hint)
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
            self.events.emit(Event.REJOIN_ASKED, member=member)
            if self.terms.term > 1:
                self.send(control_addr, self.terms.coordinators())
            self.send(control_addr, Rejoin(self._epoch(), member))

    def resend_view(self, member: str, held: int) -> None:
        """`member` still holds view `held` a grace period after a newer commit (or asks): again, directly."""
        if self.view is not None and member not in self.fenced and self.view.contains(member):
            for piece in self._views.again(self.view, held, self.terms.term):
                self.send(self.members[member].control_addr, piece)

    def _adopt_reported_view(self, report: ViewReport, now: float) -> None:
        """After a restart: take the highest-epoch view any member holds, as it is (no new epoch)."""
        reported = report.view
        if reported is None or (self.view is not None and reported.epoch <= self.view.epoch):
            return
        self.view = dataclasses.replace(reported, store_addr=self._store_addr)  # the old store died with us
        self.events.epoch = reported.epoch
        self._recovering = False
        for seat_hint, member in [*enumerate(reported.seats), *((-1, m) for m in reported.spares)]:
            if member not in self.members:
                # Placeholder until the member re-joins; one that never does is found silent and swapped (after
                # a takeover, counting the silence the standby had seen).
                self._addrs.keep(self.members, MemberRecord(
                    member, Role.ACTIVE if seat_hint >= 0 else Role.SPARE, reported.hosts.get(member, ""), 0, "",
                    reported.bulk_addrs.get(member, ""), seat_hint, now, now - self.handed_silence.get(member, 0.0)))
                self._live.seen(member, self.members[member].last_seen)
        self.events.emit(Event.VIEW_ADOPTED, epoch=reported.epoch, seats=reported.seats, spares=reported.spares,
                         resume_step=reported.resume_step, reported_by=report.sender)
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
        plan = self._first.plan(self.world_size, actives, spares, self._starting(), self._config.resume,
                                self._store_addr, self._addrs.host, self._addrs.bulk)
        if plan.view is None:
            if plan.outcome is Outcome.FAIL:
                self._fail_job(plan.reason)
            return  # WAIT: a spare still starting takes the lost seat once it joins
        for seat, (lost, spare) in plan.refilled.items():
            failed_at = self._failure_wall.get(lost, self.wall())
            self._swaps.append(PendingSwap(seat, lost, spare, failed_at, plan.view.epoch))
        self._commit(plan.view, plan.reason, failed={seat: lost for seat, (lost, _) in plan.refilled.items()},
                     trigger=Trigger.FIRST_VIEW)

    def _add_spare(self, member: str, now: float) -> None:
        self._joining.waiting.append(member)
        if self.round is not None or self._joining.due(now):
            self._pool_spares(now)  # else the tick pools them: one view for a storm of joins, not one each

    def _pool_spares(self, now: float) -> None:
        assert self.view is not None
        joining, names = self._joining.take(self.fenced)
        rnd = self.round
        if rnd is not None:
            rnd.joined.extend(joining)  # pooled when the round commits
            if rnd.waiting_since is not None and joining:  # a seat has been waiting for exactly this
                self._start_round(now, {}, f"spare {names} joined", Trigger.SPARE_JOINED)
            return
        if not joining:
            return
        self._joining.pooled_at = now
        view = decisions.next_view(self.view, self.view.epoch + 1, {}, [*self.view.spares, *joining],
                                   self.view.resume_step, self._addrs.host, self._addrs.bulk, rebuild=False,
                                   changed=self._addrs.changed)
        self._commit(view, f"spare {names} joined the pool", failed={}, trigger=Trigger.SPARE_JOINED)

    # -- failures and rounds ------------------------------------------------------------------

    def _declare_dead(self, now: float, member: str, detected_by: str, detail: str) -> None:
        deaths.declare(self, now, [(member, detail)], detected_by)

    def _start_round(self, now: float, newly_failed: dict[int, str], reason: str, trigger: Trigger) -> None:
        assert self.view is not None
        previous = self.round
        failed = {**(previous.failed if previous else {}), **newly_failed}
        joined = list(previous.joined) if previous else []
        replacements, why = self._pick_spares(failed, joined, previous.replacements if previous else {})
        waiting_since = None
        if replacements is None:
            waiting_since = previous.waiting_since if previous and previous.waiting_since is not None else now
            action, why = self._no_spare(now, failed, waiting_since, why)
            if action is NoSpare.STOP:
                self._fail_job(why)
                return
            replacements = {}  # the survivors pause (Prepare) while the seat waits for a spare to join
        epoch = max(self.view.epoch, previous.epoch if previous else 0) + 1
        acks = previous.acks if previous else {}  # kept (the same dict): a survivor's state does not change paused
        self.round = Round(epoch, failed, replacements, acks, now + self._config.prepare_timeout, f"{reason}; {why}",
                           trigger, joined, waiting_since, first_epoch=previous.first_epoch if previous else epoch)
        self._suspect_since = None
        prepare = Prepare(epoch, sorted(failed), self.round.reason, dict(replacements), reanswer=previous is None,
                          failure_step=self.chaos.failure_step(failed.values()))
        # The chosen spares hear it too: one that wraps its model for its seat (rt.device_mesh) does it now,
        # while the survivors finish their step, instead of after the commit. A grown round skips the survivors
        # whose full answer it keeps: they stopped at the boundary and learn the outcome from the commit.
        told = self._survivors() if previous is None else self._survivors_cache.unanswered(self.view, self.round,
                                                                                          self.fenced)
        chosen = {*replacements.values(), *(previous.replacements.values() if previous else ())}
        plan = self._broadcast([*told, *chosen], prepare)
        self.round.prepare, self.round.resend_at = prepare, now + self.fanout.grace if plan.relays else float("inf")
        self.events.emit(Event.VIEW_PREPARED, epoch=epoch, failed_seats=sorted(failed), reason=self.round.reason,
                         replacements={str(k): v for k, v in replacements.items()}, trigger=trigger,
                         told=plan.count, through_agents=plan.relayed)
        self._maybe_commit()

    def _pick_spares(self, failed: dict[int, str], joined: list[str],
                     kept: dict[int, str] | None = None) -> tuple[dict[int, str] | None, str]:
        assert self.view is not None
        pool = self._spare_pool.ordered(self._now, self.view, joined, self.fenced, self._order_spares)
        return decisions.pick_spares(sorted(failed), self.view, pool, self._addrs.host, kept)

    def _order_spares(self, candidates: list[str]) -> list[str]:
        known = list(filter(self.members.__contains__, candidates))
        direct = map(_LAST_SEEN, map(self.members.__getitem__, known))
        heard = dict(zip(known, map(max, direct, self.coverage.vouched_times(known)), strict=True))
        return decisions.order_spares(candidates, heard, self.fenced)[0]

    def _no_spare(self, now: float, failed: dict[int, str], waiting_since: float, why: str) -> tuple[NoSpare, str]:
        lost = ", ".join(f"rank {seat} ({member})" for seat, member in sorted(failed.items()))
        return decisions.no_spare(self._config.no_spare_policy, now, waiting_since, self._config.spare_wait_timeout,
                                  lost, why, self.world_size, self._starting())

    def _starting(self) -> int:
        """Processes the hosts' launchers started that have neither joined nor exited: spares still starting."""
        return sum(member not in self.members and member not in self._gone_unjoined
                   for agent in self.agents.values() for member in agent.members)

    def _survivors(self) -> list[str]:
        assert self.view is not None
        return self._survivors_cache.of(self.view, self.round, self.fenced)

    def _maybe_commit(self) -> None:
        rnd, view = self.round, self.view
        if rnd is None or view is None or rnd.waiting_since is not None:
            return
        # Cheap bound first (survivors >= seats - failed - fenced): listing them on every ack is O(seats^2).
        if len(rnd.acks) < len(view.seats) - len(rnd.failed) - len(self.fenced):
            return
        if self._survivors_cache.first_unanswered(view, rnd, self.fenced):
            return
        held, why = self.terms.lease(self._now, self.agents)
        if not held:
            if not rnd.withheld:
                rnd.withheld = True
                self.events.emit(Event.COMMIT_WITHHELD, epoch=rnd.epoch, reason=why)
            return  # tick retries while the lease comes back
        resume, sources, why = decisions.plan_restore(view, sorted(rnd.failed), rnd.acks)
        from_disk = False
        if any(ack.early for ack in rnd.acks.values()) and (resume is None or set(sources) - rnd.failed.keys()):
            return  # early answers name only the newest snapshots: the full ones may find a step, or a local copy
        if resume is None:
            resume = decisions.disk_resume_step(rnd.acks)
            if resume is None:
                self._fail_job(f"cannot restore the job in memory: {why}. No disk checkpoint is configured "
                               "or complete (--checkpoint-dir/--checkpoint-every); relaunch from one.")
                return
            from_disk = True
            why = f"{why}; every seat rolls back to the disk checkpoint of step {resume}"
            self.events.emit(Event.DISK_FALLBACK, resume_step=resume, reason=why)
        seated = {*rnd.replacements.values(), *self.fenced}  # a set: a dict's values are searched one by one
        spares = [s for s in [*view.spares, *rnd.joined] if s not in seated]
        new_view = decisions.next_view(view, rnd.epoch, rnd.replacements, spares, resume, self._addrs.host,
                                       self._addrs.bulk, rebuild=True, from_disk=from_disk, sources=sources,
                                       dirty_groups=[g for ack in rnd.acks.values() for g in ack.dirty_groups],
                                       changed=self._addrs.changed)
        failed_at = {seat: self._failure_wall.get(member, self.wall()) for seat, member in rnd.failed.items()}
        for seat, member in rnd.failed.items():
            self._swaps.append(PendingSwap(seat, member, rnd.replacements[seat], failed_at[seat], rnd.epoch))
        self.round = None
        self._commit(new_view, f"{rnd.reason}; resume: {why}", failed=rnd.failed, trigger=rnd.trigger)

    def _commit(self, view: View, reason: str, failed: dict[int, str], trigger: Trigger) -> None:
        previous, self.view = self.view, view
        self.events.epoch = view.epoch
        changed, self._addrs.changed = self._addrs.changed, set()  # the next view patches this one's addresses
        if previous is None or view.store_prefix != previous.store_prefix:
            self._groups_epoch = view.epoch
        self.events.emit(Event.VIEW_COMMITTED, epoch=view.epoch, resume_step=view.resume_step, seats=view.seats,
                         spares=view.spares, store_prefix=view.store_prefix, reason=reason,
                         rebuild_groups=view.rebuild_groups,
                         failed_seats=sorted(failed), buddies=view.buddies, trigger=trigger, term=self.terms.term)
        for members, messages in self._views.commit(previous, view, self.terms.term, changed):
            self._broadcast(members, *messages)
        self.fanout.catch_up.committed(view.epoch, self._now)

    def _on_recovered(self, message: Recovered) -> None:
        self._blind_rebuilds = 0  # a step finished under the new view: the last rebuild worked
        for swap in [s for s in self._swaps if s.new_member == message.sender and message.epoch >= s.epoch]:
            self._swaps.remove(swap)
            self.events.emit(Event.SWAP_COMPLETED, rank=swap.seat, old_member=swap.old_member,
                             new_member=swap.new_member, recovery_s=round(message.ts - swap.failed_at, 4),
                             step=message.step, epoch=message.epoch, member=message.sender,
                             groups_rebuilt=message.groups_rebuilt, group_s=round(message.group_s, 6))

    def _on_finished(self, message: Finished) -> None:
        if self.view is None or self._views.seat_of(self.view, message.sender) != message.seat:
            return
        self._finished.record(message)
        if not self._finished.complete(self.world_size):
            return
        digest, why = self._finished.digest()
        if digest is None:
            self._fail_job(why)
            return
        self.events.emit(Event.TRAINING_FINISHED, step=message.step, state_digest=digest, epoch=self.view.epoch,
                         **self._finished.untracked_rollback())
        self._end(True, f"training finished at step {message.step}; final state digest {digest}")

    def _fail_job(self, reason: str, cause: str = "", **fields: Any) -> None:
        """End the job as failed; `reason` is the prose, `cause` (if any) the machine field (``user_error``).

        Only while most hosts were heard within ``Terms.verdict_window`` (under a failure timeout): a
        coordinator that hears too few cannot tell a failed job from its own host being cut off (the
        other side may run the job on), so it stands down instead.
        """
        held, why = self.terms.lease(self._now, self.agents, self.terms.verdict_window)
        if not held:
            self._stand_down(StandDown.CUT_OFF, f"{why}; the job may go on without this host ({reason})")
            return
        if cause:
            self.events.emit(Event.JOB_FAILED, reason=cause, detail=reason, **fields)
        else:
            self.events.emit(Event.JOB_FAILED, reason=reason)
        log.error("%s", reason)
        self._end(False, reason)

    def _end(self, ok: bool, reason: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = (ok, reason)
        live = [m for m in self.members if m not in self.fenced and not self._finished.by(m)]
        self._broadcast(live, Stop(ok, reason), relay=False)  # not through agents: their own Stop ends them
        for agent in self.agents.values():
            self.send(agent.control_addr, Stop(ok, reason))
        self.send(self.terms.standby, Stop(ok, reason))

    def _stand_down(self, kind: StandDown, why: str) -> None:
        """Stop acting for good: commit nothing, send nothing (the newer term's coordinator runs the job)."""
        if self.outcome is not None:
            return
        self.stood_down = kind
        self.events.emit(Event.COORDINATOR_STOOD_DOWN, term=self.terms.term, kind=kind, reason=why)
        log.warning("standing down: %s", why)
        self.outcome = (False, why)

    def _tell_coordinators(self) -> None:
        """Every member and agent hears who coordinates this term (the standby changed)."""
        self._broadcast(list(self.members), self.terms.coordinators())
        for agent in self.agents.values():
            self.send(agent.control_addr, self.terms.coordinators())

    def _tick_terms(self, now: float) -> None:
        """The standby's silence, the older coordinators still to tell, and the lease."""
        silent = self.terms.standby_silent(now)
        if silent is not None:
            self.events.emit(Event.STANDBY_LOST, standby=self.terms.standby, silent_s=round(silent, 3),
                             term=self.terms.term)
            self.terms.lose_standby(now)
            self._tell_coordinators()
        if self.terms.standby_due(now):
            host = decisions.standby_host(self.terms.lost_standby, self.terms.address,
                                          {a.agent_id: a.control_addr for a in self.agents.values()})
            if host is not None:
                why = f"standby {self.terms.lost_standby} lost" if self.terms.lost_standby else "no standby"
                self.send(self.agents[host].control_addr, StartStandby(self.terms.term, why))
        for old in self.terms.due(now):
            self.send(old, self.terms.coordinators())
        held, why = self.terms.lease(now, self.agents)
        if held:
            self._lease_lost_since = None
            self._maybe_commit()
            return
        self._lease_lost_since = self._lease_lost_since if self._lease_lost_since is not None else now
        if now - self._lease_lost_since > self._config.view_timeout:
            self._stand_down(StandDown.CUT_OFF, f"cut off: {why} for {now - self._lease_lost_since:.0f}s (view timeout "
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
            self.coverage.all_seen(now)
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
                self.view = View(max(f.epoch for f in done.values()), [f.sender for _, f in sorted(done.items())],
                                 [], -1, "", "", {}, {}, [], {})  # the finished seats, only to count them
                self._finished.clear()
                for finished in done.values():
                    self._on_finished(finished)
                return
            self._maybe_first_view()
        silent = self.coverage.silent(now, self._config.failure_timeout, self._live,
                                     lambda m: self.members[m].last_seen if m in self.members else float("-inf"))
        for member in [m for m in silent if m in self.fenced or self._finished.by(m)]:
            self._live.forget(member)  # no longer watched
            self.coverage.forget(member)
            del silent[member]
        deaths.declare(self, now, decisions.silent_members(now, silent, self._config.failure_timeout), "heartbeat")
        if self.view is not None and self._joining.due(now):
            self._pool_spares(now)
        rnd = self.round
        if rnd is not None and rnd.waiting_since is not None:
            refusal = self._pick_spares(rnd.failed, rnd.joined)[1]
            waited, why = self._no_spare(now, rnd.failed, rnd.waiting_since, refusal)
            if waited is NoSpare.STOP:
                self._fail_job(why)
                return
        if rnd is not None and now >= min(rnd.resend_at, rnd.deadline):  # listing the survivors is O(seats)
            self._outbox += self.fanout.resend(rnd, now, self._survivors(), self.members, self.agents)
            deaths.declare(self, now, decisions.unanswered_prepare(now, rnd.deadline, self._survivors(), rnd.acks,
                                                                   rnd.epoch, self._config.prepare_timeout),
                           "prepare_timeout")
        if self._suspect_since is None or self.round is not None:
            return
        action, why = decisions.unexplained_failure(now, self._suspect_since, self._config.failure_timeout,
                                                    self._blind_rebuilds)
        if action is Suspicion.WAIT:
            return
        self._suspect_since = None
        if self.view is None:
            return
        self._blind_rebuilds += 1
        if action is Suspicion.FAIL:
            self._fail_job(why)
            return
        self._start_round(now, {}, why, Trigger.BLIND_REBUILD)

    # -- views for operators ------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        """The live state at `now` as a JSON-able document (``deadpool status``)."""
        hostbeats.settle(self)
        return status_document(self, now)

