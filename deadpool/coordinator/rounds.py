"""A view change in progress: the Prepare that starts it, the survivors' answers, and the commit that ends it.

A round starts when seats are lost (:mod:`~deadpool.coordinator.deaths` starts it): a spare is chosen for
each lost seat and every survivor and chosen spare is told to pause (``Prepare``); a round that grows
keeps the answers it has and asks only the survivors still to answer.  Answers come one by one or in a
host agent's ``AckBatch``: the usual batch (a registered agent's, every member known and not fenced,
each a full answer to this round) is taken in one pass, any other answer by answer as if each member
had sent its own.  Once every survivor answered and the lease holds, the next view is committed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping

from deadpool.config import Config
from deadpool.coordinator import decisions
from deadpool.coordinator.coverage import Coverage
from deadpool.coordinator.decisions import NoSpare, Trigger
from deadpool.coordinator.ending import Ending
from deadpool.coordinator.fanout import Fanout
from deadpool.coordinator.liveness import Liveness
from deadpool.coordinator.operator_chaos import OperatorChaos
from deadpool.coordinator.outbox import Outbox
from deadpool.coordinator.pools import Addresses, SparePool, Survivors
from deadpool.coordinator.ratelimit import RateLimit
from deadpool.coordinator.records import Agent, MemberRecord, Round
from deadpool.coordinator.swaps import Swaps
from deadpool.coordinator.terms import Terms
from deadpool.coordinator.views import Views
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.messages import AckBatch, Message, Prepare, PrepareAck

_LAST_SEEN = operator.attrgetter("last_seen")


class Rounds:
    """The running round (None between view changes), its survivors and the spares it may choose."""

    def __init__(self, config: Config, world_size: int, events: EventLog, views: Views, outbox: Outbox,
                 ending: Ending, terms: Terms, swaps: Swaps, chaos: OperatorChaos, fanout: Fanout,
                 members: Mapping[str, MemberRecord], agents: Mapping[str, Agent], addrs: Addresses,
                 fenced: dict[str, str], coverage: Coverage, live: Liveness, rate: RateLimit,
                 unjoined_exits: set[str]) -> None:
        self.current: Round | None = None
        self._config = config
        self._world_size = world_size
        self._events = events
        self._views = views
        self._out = outbox
        self._ending = ending
        self._terms = terms
        self._swaps = swaps
        self._chaos = chaos
        self._fanout = fanout
        self._members = members
        self._agents = agents
        self._addrs = addrs
        self._fenced = fenced
        self._coverage = coverage
        self._live = live
        self._rate = rate
        self._unjoined_exits = unjoined_exits  # processes a launcher started that exited before they joined
        self._survivors = Survivors()
        self._spare_pool = SparePool(config.heartbeat_interval)  # the order spares are chosen in, kept briefly

    # -- starting (and growing) a round --------------------------------------------------------

    def start(self, now: float, newly_failed: dict[int, str], reason: str, trigger: Trigger,
              preferred: dict[int, str] | None = None, wanted: int = -2, limit: int | None = None) -> None:
        """Replace the seats of `newly_failed` (with those of the running round, if any): choose spares, tell the
        survivors and the chosen spares to pause (Prepare), and commit at once if nobody is left to answer.
        `preferred`: a spare reserved for a seat (a planned move's), kept like one an earlier Prepare chose;
        `wanted`: the step a moving seat left after (``Round.wanted``); `limit`: a corruption's newest step to resume
        from (``Round.limit``, the older of the round's)."""
        view = self._views.current
        assert view is not None
        previous = self.current
        failed = {**(previous.failed if previous else {}), **newly_failed}
        joined = list(previous.joined) if previous else []
        kept = {**(previous.replacements if previous else {}), **(preferred or {})}
        replacements, why = self._pick_spares(failed, joined, kept)
        waiting_since = None
        if replacements is None:
            waiting_since = previous.waiting_since if previous and previous.waiting_since is not None else now
            action, why = self._no_spare(now, failed, waiting_since, why)
            if action is NoSpare.STOP:
                self._ending.fail(why)
                return
            replacements = {}  # the survivors pause (Prepare) while the seat waits for a spare to join
        epoch = max(view.epoch, previous.epoch if previous else 0) + 1
        acks = previous.acks if previous else {}  # kept (the same dict): a survivor's state does not change paused
        rnd = self.current = Round(epoch, failed, replacements, acks, now + self._config.prepare_timeout,
                                   f"{reason}; {why}", trigger, joined, waiting_since,
                                   first_epoch=previous.first_epoch if previous else epoch,
                                   wanted=max(wanted, previous.wanted if previous else -2),
                                   limit=min((s for s in (limit, previous.limit if previous else None)
                                              if s is not None), default=None))
        planned = trigger is Trigger.MOVE and (previous is None or previous.prepare is None or previous.prepare.planned)
        prepare = Prepare(epoch, sorted(failed), rnd.reason, dict(replacements), reanswer=previous is None,
                          failure_step=self._chaos.failure_step(failed.values()), planned=planned,
                          left_after=rnd.wanted if planned else -2)
        # The chosen spares hear it too: one that wraps its model for its seat (rt.device_mesh) does it now,
        # while the survivors finish their step, instead of after the commit. A grown round skips the survivors
        # whose full answer it keeps: they stopped at the boundary and learn the outcome from the commit.
        told = self.survivors() if previous is None else self._survivors.unanswered(view, rnd, self._fenced)
        chosen = {*replacements.values(), *(previous.replacements.values() if previous else ())}
        plan = self._out.broadcast([*told, *chosen], prepare)
        rnd.prepare, rnd.resend_at = prepare, now + self._fanout.grace if plan.relays else float("inf")
        self._events.emit(schema.ViewPrepared(epoch=epoch, failed_seats=sorted(failed), reason=rnd.reason,
                          replacements={str(k): v for k, v in replacements.items()}, trigger=trigger,
                          told=plan.count, through_agents=plan.relayed))
        self.try_commit()

    def take_spares(self, now: float, joining: list[str], names: str) -> bool:
        """Spares that joined: pooled when the running round commits, and a seat waiting for one takes it now.
        False when no round runs (the service pools them in a view of their own)."""
        rnd = self.current
        if rnd is None:
            return False
        rnd.joined.extend(joining)  # pooled when the round commits
        if rnd.waiting_since is not None and joining:  # a seat has been waiting for exactly this
            self.start(now, {}, f"spare {names} joined", Trigger.SPARE_JOINED)
        return True

    def wait_for_spare(self, now: float) -> bool:
        """A round waiting for a spare to join goes on waiting; False when the no-spare policy ended the job."""
        rnd = self.current
        if rnd is None or rnd.waiting_since is None:
            return True
        refusal = self._pick_spares(rnd.failed, rnd.joined)[1]
        waited, why = self._no_spare(now, rnd.failed, rnd.waiting_since, refusal)
        if waited is NoSpare.STOP:
            self._ending.fail(why)
            return False
        return True

    def resend(self, now: float) -> None:
        """The Prepare went partly through agents and its grace passed: again, directly, where no agent is heard."""
        rnd = self.current
        if rnd is not None:
            self._out.extend(self._fanout.resend(rnd, now, self.survivors(), self._members, self._agents))

    def rejoined(self, member: str, control_addr: str) -> None:
        """`member` joined again during the round (after a takeover the Prepare went out before its address was
        known again): a survivor or chosen spare needs the Prepare to pause and answer."""
        rnd, view = self.current, self._views.current
        if rnd is not None and view is not None and (member in self._survivors.set_of(view, rnd, self._fenced)
                                                     or member in rnd.replacements.values()):
            self._out.send(control_addr, Prepare(rnd.epoch, sorted(rnd.failed), rnd.reason, dict(rnd.replacements),
                                                 failure_step=self._chaos.failure_step(rnd.failed.values())))

    def survivors(self) -> list[str]:
        """The seated members the round counts on: not failed in it, not fenced."""
        assert self._views.current is not None
        return self._survivors.of(self._views.current, self.current, self._fenced)

    def _pick_spares(self, failed: dict[int, str], joined: list[str],
                     kept: dict[int, str] | None = None) -> tuple[dict[int, str] | None, str]:
        view = self._views.current
        assert view is not None
        pool = self._spare_pool.ordered(self._out.now, view, joined, self._fenced, self._order_spares)
        return decisions.pick_spares(sorted(failed), view, pool, self._addrs.host, kept)

    def _order_spares(self, candidates: list[str]) -> list[str]:
        known = list(filter(self._members.__contains__, candidates))
        direct = map(_LAST_SEEN, map(self._members.__getitem__, known))
        heard = dict(zip(known, map(max, direct, self._coverage.vouched_times(known)), strict=True))
        return decisions.order_spares(candidates, heard, self._fenced)[0]

    def _no_spare(self, now: float, failed: dict[int, str], waiting_since: float, why: str) -> tuple[NoSpare, str]:
        lost = ", ".join(f"rank {seat} ({member})" for seat, member in sorted(failed.items()))
        return decisions.no_spare(self._config.no_spare_policy, now, waiting_since, self._config.spare_wait_timeout,
                                  lost, why, self._world_size, self.starting())

    def starting(self) -> int:
        """Processes the hosts' launchers started that have neither joined nor exited: spares still starting."""
        return sum(member not in self._members and member not in self._unjoined_exits
                   for agent in self._agents.values() for member in agent.members)

    # -- answers -------------------------------------------------------------------------------

    def answer(self, ack: PrepareAck) -> None:
        """A member's answer (its sender known, not fenced, heard): kept for the round it answers, if any."""
        rnd = self.current
        if rnd is None or not rnd.first_epoch <= ack.epoch <= rnd.epoch:  # or a full answer after an early one
            if rnd is not None or ack.epoch != self._views.epoch():
                self._events.emit(schema.Rejected(reason="stale_ack", peer=ack.sender, ack_epoch=ack.epoch))
            return
        held = rnd.acks.get(ack.sender)
        if ack.early and held is not None and not held.early:
            return  # a full answer (kept from an earlier Prepare of the round) beats a later early one
        rnd.acks[ack.sender] = ack
        self._survivors.answered(rnd, ack.sender, ack.early)
        self.try_commit()

    def answers(self, batch: AckBatch, now: float, handle: Callable[[float, Message], None]) -> None:
        """An agent's answers: the usual batch in one pass, any other one by one through `handle`.

        An answer is the member's own word, which the agent only carries: a batch from an agent the
        coordinator does not know (one that has just taken over) still counts, answer by answer.
        """
        count = len(batch.members)
        if not (count == len(batch.epochs) == len(batch.steps) == len(batch.local_steps) == len(batch.ward_steps)
                == len(batch.disk_steps) == len(batch.dirty_groups) == len(batch.early)):  # no generator per batch
            self._events.emit(schema.Rejected(reason="bad_field", peer=batch.sender,
                              detail="AckBatch columns of different lengths"))
            return
        agent, rnd, records = self._agents.get(batch.sender), self.current, self._members
        if agent is not None:
            agent.seen = now
        answers = batch.answers()
        try:
            heard = list(map(records.__getitem__, batch.members))
        except KeyError:  # someone the coordinator does not know: answer by answer, which rejects it
            heard = []
        if (agent is None or rnd is None or not count or len(heard) != count or True in batch.early
                or not rnd.first_epoch <= min(batch.epochs) <= max(batch.epochs) <= rnd.epoch
                or not self._fenced.keys().isdisjoint(batch.members)):
            for answer in answers:
                handle(now, answer)
            return
        if not self._rate.allow(batch.sender, now):  # the agent's batch counts as one message of the agent's
            return
        for record in heard:
            record.last_seen = now
        self._live.seen_all(batch.members, now)
        rnd.acks.update(zip(batch.members, answers, strict=True))
        self._survivors.all_answered(rnd, batch.members)
        self.try_commit()

    # -- the commit ----------------------------------------------------------------------------

    def try_commit(self) -> None:
        """Commit the next view if every survivor answered and the lease holds: resume step, spares seated."""
        rnd, view = self.current, self._views.current
        if rnd is None or view is None or rnd.waiting_since is not None:
            return
        # Cheap bound first (survivors >= seats - failed - fenced): listing them on every ack is O(seats^2).
        if len(rnd.acks) < len(view.seats) - len(rnd.failed) - len(self._fenced):
            return
        if self._survivors.first_unanswered(view, rnd, self._fenced):
            return
        held, why = self._terms.lease(self._out.now, self._agents)
        if not held:
            if not rnd.withheld:
                rnd.withheld = True
                self._events.emit(schema.CommitWithheld(epoch=rnd.epoch, reason=why))
            return  # tick retries while the lease comes back
        resume, sources, why = decisions.plan_restore(view, sorted(rnd.failed), rnd.acks, rnd.limit)
        from_disk = False
        if any(ack.early for ack in rnd.acks.values()) and (resume is None or set(sources) - rnd.failed.keys()
                                                              or resume < rnd.wanted):
            return  # early answers name only the newest snapshots: the full ones may find a step, or a local copy
        if resume is None:
            resume = decisions.disk_resume_step(rnd.acks)
            if resume is None:
                self._ending.fail(f"cannot restore the job in memory: {why}. No disk checkpoint is configured "
                                  "or complete (--checkpoint-dir/--checkpoint-every); relaunch from one.")
                return
            from_disk = True
            why = f"{why}; every seat rolls back to the disk checkpoint of step {resume}"
            self._events.emit(schema.DiskFallback(resume_step=resume, reason=why))
        seated = {*rnd.replacements.values(), *self._fenced}  # a set: a dict's values are searched one by one
        spares = [s for s in [*view.spares, *rnd.joined] if s not in seated]
        new_view = decisions.next_view(view, rnd.epoch, rnd.replacements, spares, resume, self._addrs.host,
                                       self._addrs.bulk, rebuild=True, from_disk=from_disk, sources=sources,
                                       dirty_groups=[g for ack in rnd.acks.values() for g in ack.dirty_groups],
                                       changed=self._addrs.changed)
        for seat, member in rnd.failed.items():
            self._swaps.seated(seat, member, rnd.replacements[seat], rnd.epoch)
        self.current = None
        self._views.commit(new_view, f"{rnd.reason}; resume: {why}", failed=rnd.failed, trigger=rnd.trigger)
