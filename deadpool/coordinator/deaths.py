"""Death handling, from each way a failure is detected to the round that replaces the lost seats.

A member is found dead by its silence (no heartbeat of its own and no host agent vouching for it),
by its agent reporting its process gone, by not answering a Prepare, or by its script raising; a
collective error that no death explains leads, after a wait, to a blind rebuild.  Each death is
fenced and reported on its own (a zombie that wakes up exits, and its agent kills it), but the seats
lost together are replaced by one round (:meth:`Rounds.start`: one spare choice, one Prepare to every
survivor), not one round each; spares lost while no round runs leave the pool in one view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from deadpool.config import Config
from deadpool.coordinator import decisions
from deadpool.coordinator.coverage import Coverage
from deadpool.coordinator.decisions import Raised, RaisedError, Suspicion, Trigger
from deadpool.coordinator.ending import Ending
from deadpool.coordinator.fanout import Fanout
from deadpool.coordinator.finishes import Finishes
from deadpool.coordinator.liveness import Liveness
from deadpool.coordinator.operator_chaos import OperatorChaos
from deadpool.coordinator.outbox import Outbox
from deadpool.coordinator.pools import Addresses
from deadpool.coordinator.records import Agent, MemberRecord
from deadpool.coordinator.rounds import Rounds
from deadpool.coordinator.swaps import Swaps
from deadpool.coordinator.views import Views
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import Detector
from deadpool.protocol.messages import CollectiveFailed, Fenced, FenceKill, ProcessExited, Role, UserException


class Deaths:
    """The fenced members, the scripts' exceptions reported so far, and the wait on an unexplained collective error."""

    def __init__(self, config: Config, events: EventLog, views: Views, rounds: Rounds, ending: Ending, swaps: Swaps,
                 chaos: OperatorChaos, fanout: Fanout, outbox: Outbox, members: Mapping[str, MemberRecord],
                 agents: Mapping[str, Agent], addrs: Addresses, fenced: dict[str, str], coverage: Coverage,
                 live: Liveness, finished: Finishes, unjoined_exits: set[str], wall: Callable[[], float],
                 lost_before_start: Callable[[int, str, str], None]) -> None:
        self._config = config
        self._events = events
        self._views = views
        self._rounds = rounds
        self._ending = ending
        self._swaps = swaps
        self._chaos = chaos
        self._fanout = fanout
        self._out = outbox
        self._members = members
        self._agents = agents
        self._addrs = addrs
        self._fenced = fenced  # member -> why (fenced forever); the service and the rounds read it
        self._coverage = coverage
        self._live = live
        self._finished = finished
        self._unjoined_exits = unjoined_exits  # filled here: processes that exited before they joined
        self._wall = wall
        self._lost_before_start = lost_before_start  # the first view gives the seat to a spare
        self._raised: list[RaisedError] = []  # the scripts' exceptions reported so far (one per member at most)
        self._suspect_since: float | None = None  # a collective failed with nobody dead: since when
        self._blind_rebuilds = 0  # rebuilds with nobody dead since the last finished step (bounded)

    # -- detection -----------------------------------------------------------------------------

    def silent(self, now: float) -> None:
        """Members heard neither directly nor through their host agent for the failure timeout are dead."""
        timeout, members = self._config.failure_timeout, self._members
        silent = self._coverage.silent(now, timeout, self._live,
                                       lambda m: members[m].last_seen if m in members else float("-inf"))
        for member in [m for m in silent if m in self._fenced or self._finished.by(m)]:
            self._live.forget(member)  # no longer watched
            self._coverage.forget(member)
            del silent[member]
        self.declare(now, decisions.silent_members(now, silent, timeout), Detector.HEARTBEAT)

    def exited(self, message: ProcessExited, now: float) -> None:
        """A host agent saw a process it started end: a member dead, a seat lost before it joined, or nothing."""
        if message.sender not in self._agents:
            self._events.emit(schema.Rejected(reason="unknown_agent", peer=message.sender))
            return
        record = self._members.get(message.member)
        if record is not None:
            record.exited = True
        else:
            self._unjoined_exits.add(message.member)
        how = f"signal {-message.returncode}" if message.returncode < 0 else f"exit code {message.returncode}"
        unjoined_active = record is None and message.seat_hint >= 0 and self._views.current is None
        if unjoined_active and message.returncode > 0:  # its script failed before deadpool.init(): a spare's would
            self._ending.fail(f"rank {message.seat_hint} ({message.member}) ended ({how}) before it joined the job, "
                              "so training cannot start (its output says why); relaunch the job")
        elif unjoined_active and message.returncode < 0:  # killed (a bad node found at start-up): a spare takes it
            self.declare(now, [(message.member, f"process ended ({how}) before it joined")], Detector.EXIT,
                         {message.member: message.seat_hint})
        elif message.returncode and message.member in self._members and not self._finished.by(message.member):
            self.declare(now, [(message.member, f"process ended ({how})")], Detector.EXIT)
        # A clean exit ends a finished seat or a released spare; an unfinished one's silence is caught by heartbeats.

    def unanswered(self, now: float) -> None:
        """The round's Prepare: resent directly where a relay may have been lost; survivors past its deadline are
        dead."""
        rnd = self._rounds.current
        if rnd is None or now < min(rnd.resend_at, rnd.deadline):  # listing the survivors is O(seats)
            return
        self._rounds.resend(now)
        unanswered = decisions.unanswered_prepare(now, rnd.deadline, self._rounds.survivors(), rnd.acks, rnd.epoch,
                                                  self._config.prepare_timeout)
        self.declare(now, unanswered, Detector.PREPARE_TIMEOUT)

    def raised(self, report: UserException, now: float) -> None:
        """The script raised in `report.sender`: replace the member once, or stop the job (``user_exception``)."""
        if any(r.member == report.sender for r in self._raised) or self._ending.outcome is not None:
            return
        view = self._views.current
        seat = view.seat_of(report.sender) if view else self._members[report.sender].seat_hint  # -1: a spare
        raised = RaisedError(report.sender, -1 if seat is None else seat, report.step, report.kind)
        verdict, why = decisions.user_exception(self._raised, raised)
        if view is None and self._members[report.sender].role == Role.ACTIVE:
            verdict, why = Raised.STOP, f"{why}; but training has not started, so no spare can take the seat"
        self._raised.append(raised)
        self._events.emit(schema.UserException(raised_by=report.sender, rank=raised.seat, step=report.step,
                          exception=report.kind, message=report.message, verdict=verdict, reason=why,
                          traceback=report.traceback))
        if verdict is Raised.STOP:
            message = report.message.splitlines()[0][:300] if report.message else ""
            self._ending.fail(
                f"{report.kind}: {message}. {why}. Stopped at once, the remaining spares unused; fix the script "
                "(its traceback is in the launcher's summary and the job_failed event) and relaunch.",
                cause="user_error", exception=report.kind, step=report.step, raised_by=report.sender,
                rank=raised.seat, traceback=report.traceback)
            return
        self.declare(now, [(report.sender, f"raised {report.kind} at step {report.step}")], Detector.EXCEPTION)

    def collective_failed(self, report: CollectiveFailed, now: float) -> None:
        """A member's collective failed: a death will likely explain it; if none does in time, rebuild blind."""
        if report.epoch < self._views.groups_epoch:  # about a group a later view replaced: nothing to rebuild
            self._events.emit(schema.Rejected(reason="stale_collective_report", peer=report.sender,
                              report_epoch=report.epoch, groups_epoch=self._views.groups_epoch))
            return
        self._events.emit(schema.CollectiveErrorReported(member=report.sender, step=report.step,
                          error=report.error[:300]))
        if self._rounds.current is None and self._suspect_since is None:
            self._suspect_since = now

    def unexplained(self, now: float) -> None:
        """A collective error no death explained within the wait: rebuild the groups with nobody replaced (or,
        after too many such rebuilds without a finished step, fail the job)."""
        if self._suspect_since is None or self._rounds.current is not None:
            return
        action, why = decisions.unexplained_failure(now, self._suspect_since, self._config.failure_timeout,
                                                    self._blind_rebuilds)
        if action is Suspicion.WAIT:
            return
        self._suspect_since = None
        if self._views.current is None:
            return
        self._blind_rebuilds += 1
        if action is Suspicion.FAIL:
            self._ending.fail(why)
            return
        self._start_round(now, {}, why, Trigger.BLIND_REBUILD)

    def step_finished(self) -> None:
        """A step finished under the new view: the last rebuild worked."""
        self._blind_rebuilds = 0

    # -- fencing and the round -----------------------------------------------------------------

    def declare(self, now: float, found: Iterable[tuple[str, str]], detected_by: Detector,
                hints: Mapping[str, int] | None = None, limit: int | None = None) -> None:
        """Fence each (member, why) of `found` forever; start or extend one view change for all of them.

        Before the first view a lost active's seat goes to a spare in it; `hints` gives the seat of a member that
        died before it joined (the RANK its agent started it with). `limit`: members found corrupt, whose round
        resumes from this step or an older one (``Round.limit``)."""
        lost: dict[int, str] = {}
        reasons: list[str] = []
        spares_lost: list[str] = []
        for member, detail in found:
            if member in self._fenced or self._ending.outcome is not None:
                continue
            record = self._members.get(member)
            hint = (hints or {}).get(member,
                                     record.seat_hint if record is not None and record.role == Role.ACTIVE else -1)
            seat = self._fence(member, detected_by, detail, hint)
            view, rnd = self._views.current, self._rounds.current
            if view is None:
                if hint >= 0:
                    self._lost_before_start(hint, member, f"{detected_by}: {detail}")
                continue
            if rnd is not None and member in rnd.replacements.values():
                reasons.append(f"spare {member} chosen for the swap failed; choosing again")
            elif member in view.spares:
                spares_lost.append(member)
                self._events.emit(schema.SpareLost(member=member,
                                  spares_left=len(view.spares) - len(spares_lost)))
            elif seat is not None:
                lost[seat] = member
                reasons.append(f"seat {seat} lost ({detected_by}: {detail})")
        view = self._views.current
        if view is None or self._ending.outcome is not None:
            return
        if reasons:  # a round drops the fenced spares when it commits
            trigger = Trigger.CORRUPTION if limit is not None else Trigger.SEAT_LOST if lost else Trigger.SPARE_FAILED
            self._start_round(now, lost, "; ".join(reasons), trigger, limit)
        elif spares_lost and self._rounds.current is None:
            gone = set(spares_lost)
            spares = [s for s in view.spares if s not in gone]
            new_view = decisions.next_view(view, view.epoch + 1, {}, spares, view.resume_step, self._addrs.host,
                                           self._addrs.bulk, rebuild=False, changed=self._addrs.changed)
            self._views.commit(new_view, f"spare {', '.join(spares_lost)} lost", failed={},
                               trigger=Trigger.SPARE_LOST)

    def _start_round(self, now: float, lost: dict[int, str], reason: str, trigger: Trigger,
                     limit: int | None = None) -> None:
        self._suspect_since = None  # a round rebuilds the groups: it answers any collective error reported so far
        self._rounds.start(now, lost, reason, trigger, limit=limit)

    def _fence(self, member: str, detected_by: Detector, detail: str, hint: int = -1) -> int | None:
        """Record `member` as dead, report it, tell it it is out and kill it through its agent; its seat, if any
        (before the first view: `hint`, the seat it was started for, -1 for a spare)."""
        self._fenced[member] = f"{detected_by}: {detail}"
        self._coverage.forget(member)
        seat = self._views.seat_of(member) if self._views.current else (hint if hint >= 0 else None)
        injected, wall = self._chaos.injected_at(member), self._wall()  # detection time is known only when injected
        self._swaps.failed(member, wall if injected is None else min(wall, injected))
        epoch = self._views.epoch()
        self._events.emit(schema.MemberFailed(member=member, rank=-1 if seat is None else seat,
                          detection_s=None if injected is None else round(wall - injected, 4),
                          detected_by=detected_by, reason=detail, epoch=epoch))
        record = self._members.get(member)
        if record is None:
            return seat
        self._out.send(record.control_addr, Fenced(member, epoch, self._fenced[member]))  # a zombie that wakes up exits
        if self._config.fence_by_kill and not record.exited:
            agent = self._agents.get(self._fanout.agent_id(member))  # the agent that started it
            if agent is not None and member in agent.members:
                self._out.send(agent.control_addr, FenceKill(member, epoch, detected_by))
        return seat
