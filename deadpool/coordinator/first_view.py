"""The job's first view: which seats have a member, which lost theirs before it formed, and who takes those.

The first view forms once every seat was either joined by the active member started for it or lost
(that member died first: a bad node found at start-up).  A lost seat is taken by a spare in the
first view itself, from the initial state like every seat; with no spare joined yet it waits for
one still starting, and with none at all the job stops, naming the seat.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from deadpool.coordinator import decisions
from deadpool.protocol.view import View


class Outcome(enum.StrEnum):
    FORM = "form"  # the first view can be formed
    WAIT = "wait"  # a lost seat waits for a spare still starting
    FAIL = "fail"  # a lost seat has no spare: the job stops


@dataclass(frozen=True, slots=True)
class Plan:
    """What the first view seats, or why it cannot yet."""

    outcome: Outcome
    seats: dict[int, str] = field(default_factory=dict)  # seat -> member (FORM)
    spares: list[str] = field(default_factory=list)  # the spares left in the pool (FORM)
    refilled: dict[int, tuple[str, str]] = field(default_factory=dict)  # seat -> (lost member, spare seated)
    reason: str = ""  # FAIL: why; FORM: the view's reason
    view: View | None = None  # FORM: the first view


class FirstSeats:
    """The seats of the job before its first view: joined, or lost with the member and why."""

    def __init__(self) -> None:
        self._joined: set[int] = set()
        self._lost: dict[int, tuple[str, str]] = {}  # seat -> (member, why)
        self._disk_steps: dict[str, list[int]] = {}  # active -> the disk checkpoints it saw at its Join

    def joined(self, seat: int, member: str, disk_steps: list[int]) -> None:
        self._joined.add(seat)
        self._disk_steps[member] = disk_steps

    def lost(self, seat: int, member: str, why: str) -> None:
        self._lost[seat] = (member, why)

    def complete(self, world: int) -> bool:
        """Every seat was joined or lost (building the view on every Join before that made start-up
        O(members^2))."""
        return len(self._joined | self._lost.keys()) >= world

    def plan(self, world: int, actives: Mapping[int, str], spares: Sequence[str], starting: int, resume: bool,
             store_addr: str, hosts: Mapping[str, str], bulk_addrs: Mapping[str, str]) -> Plan:
        """The first view: `actives` (seat -> its live active member) in their seats and a spare in each other
        seat, in `spares`' order; `starting`: processes started but not joined (a spare among them may still
        take a seat); `resume`: ``--resume`` (every seat from the newest disk checkpoint all of them saw)."""
        seats, pool, refilled = dict(actives), list(spares), {}
        for seat in sorted(set(range(world)) - seats.keys()):
            lost, why = self._lost.get(seat, ("?", "it left before the first view"))
            if not pool:
                if starting:
                    return Plan(Outcome.WAIT)
                return Plan(Outcome.FAIL, reason=f"rank {seat} ({lost}) failed before training started ({why}) and "
                                                 "no spare is left to take its seat; relaunch the job (with more "
                                                 "--spares)")
            seats[seat] = pool.pop(0)
            refilled[seat] = (lost, seats[seat])
        step, said = decisions.first_resume(resume, [self._disk_steps.get(member, []) for member in seats.values()])
        self._disk_steps.clear()
        if step is None:
            return Plan(Outcome.FAIL, reason=said)
        view, why = decisions.first_view(seats, world, pool, store_addr, hosts, bulk_addrs, step)
        if view is None:
            return Plan(Outcome.WAIT, reason=why)
        refills = [f"seat {seat} taken by spare {spare} (its member failed before the first view)"
                   for seat, (_, spare) in refilled.items()]
        return Plan(Outcome.FORM, seats, pool, refilled, "; ".join([why, *refills, *([said] if step >= 0 else [])]),
                    view)
