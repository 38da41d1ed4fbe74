"""The one reader of the events file: records in, typed facts and a job ``Summary`` out.

Every tool that reads events (``deadpool events``, the launcher's progress line and closing
summary, the coordinator's metrics) condenses them through here.  The records are the typed
lines of ``events.schema`` (``load`` reads and validates a file; the simulator's checks and the
determinism check read the same records).  ``parse`` turns one record into one fact by its
record type; ``SummaryBuilder`` folds facts record by record (a live reader feeds lines as they
arrive) into a frozen ``Summary``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from deadpool.events import schema
from deadpool.events.catalogue import Event

# The facts, re-exported: readers name them as summary.Restore, summary.Failure, ...
from deadpool.events.facts import (
    NO_RANK as NO_RANK,
)
from deadpool.events.facts import (
    UNKNOWN as UNKNOWN,
)
from deadpool.events.facts import (
    ChaosInjection as ChaosInjection,
)
from deadpool.events.facts import (
    ChaosNotFired as ChaosNotFired,
)
from deadpool.events.facts import (
    ChaosPointUnseen as ChaosPointUnseen,
)
from deadpool.events.facts import (
    CoordinatorStarted as CoordinatorStarted,
)
from deadpool.events.facts import (
    Fact as Fact,
)
from deadpool.events.facts import (
    Failure as Failure,
)
from deadpool.events.facts import (
    Fenced as Fenced,
)
from deadpool.events.facts import (
    GroupsAborted as GroupsAborted,
)
from deadpool.events.facts import (
    JobFailed as JobFailed,
)
from deadpool.events.facts import (
    JobFinished as JobFinished,
)
from deadpool.events.facts import (
    MemberJoined as MemberJoined,
)
from deadpool.events.facts import (
    Rejection as Rejection,
)
from deadpool.events.facts import (
    Restore as Restore,
)
from deadpool.events.facts import (
    SpareLost as SpareLost,
)
from deadpool.events.facts import (
    StepDone as StepDone,
)
from deadpool.events.facts import (
    Swap as Swap,
)
from deadpool.events.facts import (
    UntrackedRollback as UntrackedRollback,
)
from deadpool.events.facts import (
    ViewCommit as ViewCommit,
)

Record = schema.Line  # what the summary reads: one typed line of the file


def parse(record: Record, seats: Mapping[str, int] | None = None) -> Fact | None:
    """The fact one record states, or None for an event this reader keeps nothing of.

    ``seats`` (member -> seat) fills in the seat of a member a record names without one.
    """
    seats = seats if seats is not None else {}
    ts = record.ts
    match record:
        case schema.CoordinatorStarted():
            return CoordinatorStarted(ts, record.address)
        case schema.MemberJoined():
            return MemberJoined(ts, record.member or "", record.rank, record.role, record.source_process)
        case schema.MemberFailed():
            member, rank = _seated(record.member or "", record.rank, seats)
            return Failure(ts, member, rank, record.detected_by, record.reason, record.detection_s)
        case schema.SpareLost():
            member, rank = _seated(record.member or "", record.rank, seats)
            return SpareLost(ts, member, rank)
        case schema.ViewCommitted():
            return ViewCommit(ts, record.epoch, record.resume_step, tuple(record.seats), tuple(record.spares),
                              tuple(record.failed_seats), record.reason)
        case schema.Restored():
            return Restore(ts, record.member or "", record.rank, record.source, record.bytes, record.s, record.step)
        case schema.SwapCompleted():
            return Swap(ts, record.rank, record.old_member, record.new_member, record.recovery_s)
        case schema.StepFinished():
            return StepDone(ts, record.epoch, record.step, record.rank, record.member or "", record.loss,
                            record.tokens, record.tokens_per_s, record.step_s)
        case schema.ChaosInjected():
            member, rank = _seated(*record.target(), seats)
            return ChaosInjection(ts, record.action, member, rank, record.spec)
        case schema.Fenced():
            return Fenced(ts, record.member or "", record.rank, record.reason)
        case schema.Rejected():
            return Rejection(ts, record.member or "", record.rank, record.reason)
        case schema.TrainingFinished():
            caveat = record.untracked_rollback
            untracked = None if caveat is None else UntrackedRollback(caveat.loader or UNKNOWN, caveat.where,
                                                                      caveat.view, caveat.rank)
            return JobFinished(ts, record.member or "", record.rank, record.step, record.state_digest, untracked)
        case schema.JobFailed():
            if record.detail is None:
                return JobFailed(ts, record.member or "", record.rank, record.reason)
            # A stop with a machine cause (``reason: user_error``) carries its prose in ``detail``.
            return JobFailed(ts, record.member or "", record.rank, record.detail, record.reason, record.traceback,
                             record.raised_by)
        case schema.ChaosPointUnseen():
            return ChaosPointUnseen(ts, record.member or "", record.rank, record.step, record.spec,
                                    record.at or UNKNOWN, tuple(record.seen))
        case schema.ChaosNotFired():
            return ChaosNotFired(ts, record.spec, record.at or UNKNOWN, record.target_member, record.target_rank,
                                 record.last_step, tuple(record.seen), record.ended, record.why)
        case schema.GroupsAborted():
            return GroupsAborted(ts, record.member or "", record.rank, tuple(record.groups), record.reason, record.s)
    return None


def _seated(member: str, rank: int | None, seats: Mapping[str, int]) -> tuple[str, int | None]:
    """A member a record is about, and its seat: the record's, else the seat it was seen in elsewhere."""
    if rank is None or rank < 0:
        return member, seats.get(member)
    return member, rank


# ---------------------------------------------------------------------------
# The summary


@dataclass(frozen=True, slots=True)
class SpareChange:
    """The spare pool after one event changed it."""

    ts: float | None  # when the pool changed
    cause: str  # the event that changed it (member_joined, view_committed, spare_lost, ...)
    member: str  # the spare concerned ("" for a view that reset the pool)
    spares: int  # pool size after the change


@dataclass(frozen=True, slots=True)
class Summary:
    """What happened in a job, condensed from its events.

    A job's file mixes lines from every process, so the same fact may be
    written more than once (every survivor may report one death).  The summary
    keeps the first record of a failure per member, of a view per epoch, and of
    a swap per (old, new) member pair, so counts mean what a person expects.
    """

    events: int  # records read
    start_ts: float | None  # earliest timestamp in the file
    end_ts: float | None  # latest timestamp in the file
    steps_finished: int  # distinct step numbers some rank finished
    last_step: int | None  # highest step number finished
    replayed_steps: int  # step completions redone after a rollback to resume_step
    failures: tuple[Failure, ...]
    views: tuple[ViewCommit, ...]
    swaps: tuple[Swap, ...]
    restores: tuple[Restore, ...]
    spare_changes: tuple[SpareChange, ...]
    chaos: tuple[ChaosInjection, ...]
    fenced: int  # fenced events (zombies that woke up and were told to exit)
    rejected: int  # rejected events (messages or joins refused)
    finished: bool  # some rank wrote training_finished
    final_step: int | None  # from training_finished
    final_digest: str | None  # training_finished.state_digest
    job_failed: str | None  # the job_failed reason, None when the job did not fail
    unknown_events: tuple[str, ...]  # event names this reader keeps nothing of (shown generically)
    rejections: tuple[tuple[str, int], ...] = ()  # (reason, count), by reason
    steps: tuple[StepDone, ...] = ()  # per (epoch, step) the lowest rank's record, in time order
    job_failed_ts: float | None = None  # when the job failed
    chaos_unseen: tuple[ChaosPointUnseen, ...] = ()  # specs warned about at their member's first step
    chaos_not_fired: tuple[ChaosNotFired, ...] = ()  # specs a launcher found never fired
    untracked_rollback: UntrackedRollback | None = None  # from training_finished: the final state is not guaranteed

    @property
    def duration_s(self) -> float | None:
        """Seconds from the first to the last record."""
        if self.start_ts is None or self.end_ts is None:
            return None
        return self.end_ts - self.start_ts

    @property
    def outcome(self) -> str:
        """``failed``, ``finished`` or ``incomplete`` (no final event: crashed or still running)."""
        if self.job_failed is not None:
            return "failed"
        if self.finished:
            return "finished"
        return "incomplete"


def load(path: str | os.PathLike[str]) -> list[Record]:
    """Read every event of a file, in file order, each validated against its kind's schema.

    A last line cut off by a crash is skipped, so such a file still loads.

    Raises:
        OSError: the file cannot be opened (missing, unreadable).
        schema.SchemaError: a line does not match its kind's schema (the message names the line, kind and field).
    """
    return schema.read(path)


def summarize(events: Iterable[Record]) -> Summary:
    """Condense a whole file's events into a ``Summary`` (in time order)."""
    ordered_events = ordered(events)
    builder = SummaryBuilder(seat_map(ordered_events))
    for _, record in ordered_events:
        builder.feed(record)
    return builder.summary()


class SummaryBuilder:
    """Folds records into a ``Summary`` one at a time, in the order they are fed.

    ``seats`` seeds the member -> seat map (a whole file's, from ``seat_map``); the
    builder also learns seats from the views and steps it is fed, and a seat
    unknown when a failure was fed is filled in when the summary is taken.
    """

    def __init__(self, seats: Mapping[str, int] | None = None) -> None:
        self.seats: dict[str, int] = dict(seats or {})  # member -> seat, for records that do not say
        self._events = 0
        self._start_ts: float | None = None
        self._end_ts: float | None = None
        self._step_runs: set[tuple[int | None, int]] = set()  # (epoch, step) completions
        self._best: dict[tuple[int | None, int], StepDone] = {}  # (epoch, step) -> lowest rank's record
        self._failures: dict[str, Failure] = {}
        self._anonymous_failures: list[Failure] = []
        self._views: dict[int | None, ViewCommit] = {}
        self._swaps: dict[tuple[str, str], Swap] = {}
        self._restores: list[Restore] = []
        self._spares: list[str] = []
        self._spare_changes: list[SpareChange] = []
        self._chaos: list[ChaosInjection] = []
        self._fenced = 0
        self._rejections: dict[str, int] = {}
        self._final: tuple[int, JobFinished] | None = None  # (rank order, fact) of training_finished
        self._job_failed: JobFailed | None = None
        self._unseen: list[ChaosPointUnseen] = []
        self._not_fired: list[ChaosNotFired] = []
        self._unknown: dict[str, None] = {}

    def feed(self, record: Record) -> Fact | None:
        """Fold one record in; returns the fact it stated (None: an event kept as a name only)."""
        self._events += 1
        ts = record.ts
        if ts is not None:
            self._start_ts = ts if self._start_ts is None else min(self._start_ts, ts)
            self._end_ts = ts if self._end_ts is None else max(self._end_ts, ts)
        learn_seats(self.seats, record)
        fact = parse(record, self.seats)
        match fact:
            case None:
                self._unknown.setdefault(record.event, None)
            case CoordinatorStarted():
                pass
            case StepDone():
                self._on_step(fact)
            case Failure():
                self._on_failed(fact)
            case ViewCommit():
                self._on_view(fact)
            case Restore():
                self._restores.append(fact)
            case Swap():
                self._on_swap(fact)
            case MemberJoined():
                if fact.spare and fact.member and fact.member not in self._spares:
                    self._set_spares(fact.ts, Event.MEMBER_JOINED, fact.member, [*self._spares, fact.member])
            case SpareLost():
                self._on_spare_lost(fact)
            case ChaosInjection():
                self._chaos.append(fact)
            case Fenced():
                self._fenced += 1
            case Rejection():
                self._rejections[fact.reason] = self._rejections.get(fact.reason, 0) + 1
            case JobFinished():
                # Every rank may write one; the lowest rank's latest record speaks for the job.
                rank = fact.rank if fact.rank is not None and fact.rank >= 0 else NO_RANK
                if self._final is None or rank <= self._final[0]:
                    self._final = (rank, fact)
            case JobFailed():
                if self._job_failed is None:
                    self._job_failed = fact
            case ChaosPointUnseen():
                self._unseen.append(fact)
            case ChaosNotFired():
                self._not_fired.append(fact)
        return fact

    def _set_spares(self, ts: float | None, cause: str, member: str, spares: list[str]) -> None:
        if spares != self._spares:
            self._spares = spares
            self._spare_changes.append(SpareChange(ts, cause, member, len(spares)))

    def _on_step(self, fact: StepDone) -> None:
        if fact.step is None or fact.step < 0:
            return
        key = (fact.epoch, fact.step)
        self._step_runs.add(key)
        if fact.ts is not None and (key not in self._best or fact.order < self._best[key].order):
            self._best[key] = fact

    def _on_failed(self, fact: Failure) -> None:
        if not fact.member:
            self._anonymous_failures.append(fact)
        else:
            self._failures.setdefault(fact.member, fact)
        if fact.member and fact.member in self._spares:
            self._set_spares(fact.ts, Event.MEMBER_FAILED, fact.member, [m for m in self._spares if m != fact.member])

    def _on_view(self, fact: ViewCommit) -> None:
        if fact.epoch in self._views:
            return
        self._views[fact.epoch] = fact
        if fact.spares is not None:
            self._set_spares(fact.ts, Event.VIEW_COMMITTED, "", list(fact.spares))

    def _on_swap(self, fact: Swap) -> None:
        if fact.old_member or fact.new_member:
            self._swaps.setdefault((fact.old_member, fact.new_member), fact)
        else:
            self._swaps[(f"?{len(self._swaps)}", "")] = fact

    def _on_spare_lost(self, fact: SpareLost) -> None:
        if fact.member in self._spares:
            self._set_spares(fact.ts, Event.SPARE_LOST, fact.member, [m for m in self._spares if m != fact.member])
        elif self._spares:  # unnamed: the pool shrank by one, whoever it was
            self._set_spares(fact.ts, Event.SPARE_LOST, fact.member, self._spares[1:])

    def _seated(self, rank: int | None, member: str) -> int | None:
        return self.seats.get(member) if rank is None else rank

    def summary(self) -> Summary:
        """The summary of what was fed so far (feeding may go on)."""
        steps = {step for _, step in self._step_runs}
        failures = sorted([*self._failures.values(), *self._anonymous_failures], key=_ts_key)
        final = self._final[1] if self._final else None
        return Summary(
            events=self._events,
            start_ts=self._start_ts,
            end_ts=self._end_ts,
            steps_finished=len(steps),
            last_step=max(steps) if steps else None,
            replayed_steps=len(self._step_runs) - len(steps),
            failures=tuple(dataclasses.replace(f, rank=self._seated(f.rank, f.member)) for f in failures),
            views=tuple(self._views.values()),
            swaps=tuple(self._swaps.values()),
            restores=tuple(self._restores),
            spare_changes=tuple(self._spare_changes),
            chaos=tuple(dataclasses.replace(c, rank=self._seated(c.rank, c.member)) for c in self._chaos),
            fenced=self._fenced,
            rejected=sum(self._rejections.values()),
            finished=final is not None,
            final_step=final.step if final else None,
            final_digest=(final.digest or None) if final else None,
            job_failed=(self._job_failed.reason or "(no reason given)") if self._job_failed else None,
            unknown_events=tuple(self._unknown),
            rejections=tuple(sorted(self._rejections.items())),
            steps=tuple(sorted(self._best.values(), key=lambda p: p.ts or 0.0)),
            job_failed_ts=self._job_failed.ts if self._job_failed else None,
            chaos_unseen=tuple(self._unseen),
            chaos_not_fired=tuple(self._not_fired),
            untracked_rollback=final.untracked if final else None,
        )


# ---------------------------------------------------------------------------
# Order, seats and defensive field access


def ordered(events: Iterable[Record]) -> list[tuple[float | None, Record]]:
    """Records with their timestamp, sorted by time (stably, so ties keep file order).

    Lines from several hosts may be slightly out of order in the file.
    """
    out = sorted(enumerate(events), key=lambda item: (item[1].ts or 0.0, item[0]))
    return [(record.ts, record) for _, record in out]


def learn_seats(seats: dict[str, int], r: Record) -> None:
    """Add the member -> seat pairs one record shows (a committed view, a worker's step line).

    Member ids are never reused and a member keeps its seat once adopted, so
    the first seat seen for a member is its seat for the whole file.
    """
    match r:
        case schema.ViewCommitted():
            for seat, member in enumerate(r.seats):
                seats.setdefault(member, seat)
        case schema.StepFinished() if r.rank is not None and r.rank >= 0 and r.member:
            seats.setdefault(r.member, r.rank)


def seat_map(ordered_events: Iterable[tuple[float | None, Record]]) -> dict[str, int]:
    """Member id -> the seat it sat in, over a whole (time-ordered) file."""
    seats: dict[str, int] = {}
    for _, r in ordered_events:
        learn_seats(seats, r)
    return seats


def _ts_key(item: Failure) -> float:
    return item.ts if item.ts is not None else math.inf
