"""Members declared dead, as the coordinator acts on it: fence each, then replace the lost seats together.

One tick's silence check may find many members dead at once (a host's workers, a burst of hangs).
Each is fenced and reported on its own, but the seats they held are replaced by one round (one
spare choice, one Prepare to every survivor), not one round each: a round plans its broadcast
over every survivor still to answer, so a round per death made a burst cost deaths x members.
Spares lost while no round runs leave the pool in one view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from deadpool.config import Config
from deadpool.coordinator import decisions
from deadpool.coordinator.coverage import Coverage
from deadpool.coordinator.decisions import Trigger
from deadpool.coordinator.fanout import Fanout
from deadpool.coordinator.operator_chaos import OperatorChaos
from deadpool.coordinator.pools import Addresses
from deadpool.coordinator.records import Agent, MemberRecord, Round
from deadpool.coordinator.views import ViewSender
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.messages import Fenced, FenceKill, Message, Role
from deadpool.protocol.view import View


class Coordinator(Protocol):
    """What declaring deaths reads and changes of the coordinator (``service.Coordinator``)."""

    view: View | None
    round: Round | None
    members: dict[str, MemberRecord]
    agents: dict[str, Agent]
    fenced: dict[str, str]
    outcome: tuple[bool, str] | None
    events: EventLog
    chaos: OperatorChaos
    coverage: Coverage
    fanout: Fanout
    _config: Config
    _addrs: Addresses
    _views: ViewSender
    _failure_wall: dict[str, float]
    wall: Callable[[], float]

    def send(self, addr: str, message: Message) -> None: ...

    def _epoch(self) -> int: ...

    def _fail_job(self, reason: str, cause: str = "", **fields: Any) -> None: ...

    def seat_lost_before_start(self, seat: int, member: str, why: str) -> None: ...

    def _start_round(self, now: float, newly_failed: dict[int, str], reason: str, trigger: Trigger) -> None: ...

    def _commit(self, view: View, reason: str, failed: dict[int, str], trigger: Trigger) -> None: ...


def declare(c: Coordinator, now: float, found: Iterable[tuple[str, str]], detected_by: str,
            hints: Mapping[str, int] | None = None) -> None:
    """Fence each (member, why) of `found` forever; start or extend one view change for all of them.

    Before the first view a lost active's seat goes to a spare in it; `hints` gives the seat of a member that
    died before it joined (the RANK its agent started it with)."""
    lost: dict[int, str] = {}
    reasons: list[str] = []
    spares_lost: list[str] = []
    for member, detail in found:
        if member in c.fenced or c.outcome is not None:
            continue
        record = c.members.get(member)
        hint = (hints or {}).get(member, record.seat_hint if record is not None and record.role == Role.ACTIVE else -1)
        seat = _fence(c, member, detected_by, detail, hint)
        view, rnd = c.view, c.round
        if view is None:
            if hint >= 0:
                c.seat_lost_before_start(hint, member, f"{detected_by}: {detail}")
            continue
        if rnd is not None and member in rnd.replacements.values():
            reasons.append(f"spare {member} chosen for the swap failed; choosing again")
        elif member in view.spares:
            spares_lost.append(member)
            c.events.emit(Event.SPARE_LOST, member=member, lost_member=member,
                          spares_left=len(view.spares) - len(spares_lost))
        elif seat is not None:
            lost[seat] = member
            reasons.append(f"seat {seat} lost ({detected_by}: {detail})")
    view = c.view
    if view is None or c.outcome is not None:
        return
    if reasons:  # a round drops the fenced spares when it commits
        c._start_round(now, lost, "; ".join(reasons), Trigger.SEAT_LOST if lost else Trigger.SPARE_FAILED)
    elif spares_lost and c.round is None:
        gone = set(spares_lost)
        spares = [s for s in view.spares if s not in gone]
        new_view = decisions.next_view(view, view.epoch + 1, {}, spares, view.resume_step, c._addrs.host,
                                       c._addrs.bulk, rebuild=False, changed=c._addrs.changed)
        c._commit(new_view, f"spare {', '.join(spares_lost)} lost", failed={}, trigger=Trigger.SPARE_LOST)


def _fence(c: Coordinator, member: str, detected_by: str, detail: str, hint: int = -1) -> int | None:
    """Record `member` as dead, report it, tell it it is out and kill it through its agent; its seat, if any
    (before the first view: `hint`, the seat it was started for, -1 for a spare)."""
    c.fenced[member] = f"{detected_by}: {detail}"
    c.coverage.forget(member)
    seat = c._views.seat_of(c.view, member) if c.view else (hint if hint >= 0 else None)
    injected, wall = c.chaos.injected_at.get(member), c.wall()  # detection time is known only for injected failures
    c._failure_wall[member] = wall if injected is None else min(wall, injected)
    epoch = c._epoch()
    c.events.emit(Event.MEMBER_FAILED, member=member, failed_member=member, rank=-1 if seat is None else seat,
                  detection_s=None if injected is None else round(wall - injected, 4),
                  failed_rank=-1 if seat is None else seat, detected_by=detected_by, reason=detail, epoch=epoch)
    record = c.members.get(member)
    if record is None:
        return seat
    c.send(record.control_addr, Fenced(member, epoch, c.fenced[member]))  # a zombie that wakes up exits
    if c._config.fence_by_kill and not record.exited:
        agent = c.agents.get(c.fanout.agent_id(member))  # the agent that started it
        if agent is not None and member in agent.members:
            c.send(agent.control_addr, FenceKill(member, epoch, detected_by))
    return seat
