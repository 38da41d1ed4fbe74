"""What a launch's exit status says beyond "training finished": did its chaos fire, is its final state guaranteed.

Two runs would otherwise end like a pass ("training finished", exit 0): one whose ``--chaos`` spec
never fired (a fault test whose fault never came tested nothing: ``at=backward`` on an FSDP2 script,
whose backward holds only all-gathers and reduce-scatters, say), and one in which a restore left a
data loader no snapshot holds where it was, so that its final state may differ from a failure-free
run's.  The first exits ``NOT_FIRED_STATUS``; the second is named in the closing lines, and exits
``NOT_GUARANTEED_STATUS`` under ``--strict``.  Everything here is a pure function of the events
file's facts (``deadpool.events.summary``), so the closing lines, the ``chaos_not_fired`` event,
the exit status and ``--check-determinism`` read them the same way.

``deadpool launch``'s exit statuses: 0 training finished; 1 the job failed; 2 misuse (refused before
anything started); 4 finished, but a chaos spec of this host never fired; 5 finished under
``--strict``, but the final state is not guaranteed to be a failure-free run's; 128+N stopped by
signal N (130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from deadpool.chaos import NOT_FIRED_STATUS, STARTUP, WHERE, ChaosPoint, ChaosSpec
from deadpool.chaos import parse as parse_spec
from deadpool.events.summary import (
    ChaosInjection,
    ChaosNotFired,
    ChaosPointUnseen,
    Fact,
    Failure,
    StepDone,
    UntrackedRollback,
    ViewCommit,
)

FINISHED_STATUS = 0
FAILED_STATUS = 1
NOT_GUARANTEED_STATUS = 5  # --strict: finished, but a restore left an untracked data loader where it was


class Ended(enum.StrEnum):
    """How the member a spec was for ended its run, as the events tell it (``chaos_not_fired``'s ``ended``)."""

    RAN = "ran"  # it ran to the end of the job without failing
    FAILED = "failed"  # it was declared dead first
    NO_STEP = "no_step"  # it finished no step at all
    SEATED = "seated"  # a spare taken into a seat (a spare's spec fires only while it waits)
    WAITING = "waiting"  # a spare still waiting when the job ended
    UNKNOWN = "unknown"  # the launcher did not know the member (nothing of its run was read)


@dataclass
class Trail:
    """What the events say one member did: its last finished step, its failure, the seat it took."""

    last_step: int = -1  # -1: none finished
    failure: str = ""  # how it was declared dead ("" not)
    seat: int = -1  # the seat a view gave it (-1: none)


@dataclass
class Trails:
    """The members' trails and the chaos facts of one events file, folded fact by fact (``follow``)."""

    members: dict[str, Trail] = field(default_factory=dict)  # only the members asked about
    fired: set[str] = field(default_factory=set)  # specs that fired, as ``str(ChaosSpec)`` writes them
    seen: dict[str, tuple[str, ...]] = field(default_factory=dict)  # spec -> the points its member's first step passed

    def follow(self, fact: Fact | None) -> None:
        """Fold one fact in (facts of members not asked about are skipped)."""
        match fact:
            case ChaosInjection(spec=spec) if spec:
                self.fired.add(spec)
            case ChaosPointUnseen(spec=spec, seen=seen):
                self.seen.setdefault(spec, seen)
            case StepDone(member=member, step=step) if member in self.members and step is not None:
                trail = self.members[member]
                trail.last_step = max(trail.last_step, step)
            case Failure(member=member) as failure if member in self.members:
                trail = self.members[member]
                trail.failure = trail.failure or f"declared dead ({failure.detected_by}: {failure.reason})"
            case ViewCommit(seats=seats) if seats is not None:
                for seat, member in enumerate(seats):
                    if member in self.members and self.members[member].seat < 0:
                        self.members[member].seat = seat


def trails_of(facts: Iterable[Fact | None], members: Iterable[str]) -> Trails:
    """The trails of `members` (and the chaos facts) over a file's facts."""
    trails = Trails({member: Trail() for member in members if member})
    for fact in facts:
        trails.follow(fact)
    return trails


def not_fired(specs: Sequence[str], targets: Mapping[str, str], trails: Trails) -> list[ChaosNotFired]:
    """The specs (as ``str(ChaosSpec)`` writes them) that never fired, each with why, as far as the events tell.

    `targets` maps a spec to the member it was for (the member a launcher started in that seat, or as
    that spare); a spec without one is still reported, with less to say.
    """
    found = []
    for text in specs:
        if text in trails.fired:
            continue
        spec = parse_spec(text)
        member = targets.get(text, "")
        trail = trails.members.get(member)
        seen = trails.seen.get(text, ())
        if trail is None:
            ended, why = Ended.UNKNOWN, "its member did not reach that point of that step, or was not running then"
        else:
            ended, why = _why(spec, trail, seen)
        found.append(ChaosNotFired(None, text, str(spec.at), member, spec.rank if spec.rank >= 0 else -1,
                                   trail.last_step if trail is not None else -1, seen, str(ended), why))
    return found


def _why(spec: ChaosSpec, trail: Trail, seen: tuple[str, ...]) -> tuple[Ended, str]:
    """How the member ended, and the sentence that says why its spec did not fire and what it reached."""
    if spec.spare >= 0:
        if trail.seat >= 0:
            return Ended.SEATED, (f"spare {spec.spare} took seat {trail.seat} before it had waited {spec.after:g} s "
                                  "(a spare's spec fires only while it waits for a seat)")
        return Ended.WAITING, f"the job ended before spare {spec.spare} had waited {spec.after:g} s"
    who = f"rank {spec.rank}'s member"
    reached = f"its last finished step was {trail.last_step}" if trail.last_step >= 0 else "it finished no step"
    ended = Ended.FAILED if trail.failure else Ended.RAN if trail.last_step >= 0 else Ended.NO_STEP
    if spec.at in STARTUP:
        return ended, f"{who} passed no {spec.at} point at start-up ({WHERE[spec.at]}); {reached}"
    if trail.last_step < spec.step:
        if trail.failure:
            return ended, f"{who} was {trail.failure} before step {spec.step}; {reached}"
        if trail.last_step < 0:
            return ended, f"{who} finished no step"
        return ended, (f"{who} never reached step {spec.step}: {reached} (is step {spec.step} beyond the script's "
                       "last step?)")
    if spec.at is ChaosPoint.RECOVERY:
        return ended, (f"no view change repaired a failure injected at step {spec.step} while {who} ran (it finished "
                       f"steps up to {trail.last_step}); at=recovery needs another spec's failure at that step")
    passed = f"; its first step passed {', '.join(seen)}" if seen else ""
    return ended, (f"{who} finished step {spec.step} (and steps up to {trail.last_step}) without passing a "
                   f"{spec.at} point, which is {WHERE[spec.at]}: this script's steps have none{passed}")


def not_fired_line(finding: ChaosNotFired) -> str:
    """The closing line for a spec that never fired."""
    return f"  chaos: {finding.spec} never fired: {finding.why}"


def untracked_line(rollback: UntrackedRollback) -> str:
    """The closing line for a run whose final state is not guaranteed to be a failure-free run's."""
    where = f"iterated at {rollback.where}, " if rollback.where else ""
    seat = f"rank {rollback.rank}" if rollback.rank is not None else "a seat"
    view = f"view {rollback.view}" if rollback.view is not None else "a view"
    return (f"  final state may differ from a failure-free run: an untracked {rollback.loader} ({where}{seat}) was "
            f"not rolled back at the swap of {view}; track it (torchdata's StatefulDataLoader, "
            "rt.track(data=loader)) or derive its position from the step (--strict makes such a run exit "
            f"{NOT_GUARANTEED_STATUS})")


def exit_status(code: int, unfired: Sequence[ChaosNotFired], untracked: UntrackedRollback | None,
                strict: bool) -> tuple[int, str]:
    """The launch's exit status given its job's own (`code`), and the reason when it is not `code`.

    Only a finished job's status changes: a failed or stopped one keeps its own.
    """
    if code != FINISHED_STATUS:
        return code, ""
    if unfired:
        specs = ", ".join(finding.spec for finding in unfired)
        return NOT_FIRED_STATUS, (f"exit status {NOT_FIRED_STATUS}: training finished, but chaos spec(s) {specs} "
                                  "never fired, so the run tested no recovery from them (why: above)")
    if strict and untracked is not None:
        return NOT_GUARANTEED_STATUS, (f"exit status {NOT_GUARANTEED_STATUS} (--strict): training finished, but "
                                       "its final state is not guaranteed to be a failure-free run's (why: above)")
    return code, ""
