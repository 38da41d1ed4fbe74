"""Audits: an idle spare re-does one seat's step after another, and a seat whose gradients differ is corrupt.

With ``--audit`` every step is an audit step of one seat, in turn (``audited_seat``): that seat digests
its local gradients before their reduction and sends the digest (``worker/runtime.py``); the others
compute nothing more. The coordinator asks a free spare to re-do the newest such step of the next seat
in turn from that seat's snapshot of the step before, with its collectives completing locally. Equal
digests: the seat computed that step right. Different ones: the seat is corrupt (silent data corruption
a replica check cannot see, such as a wrong local gradient, which the all-reduce averages into every
replica alike). It gets the same repair as a replica check's, resuming from the seat's last clean
audit: a faulty chip fails from some step on, and its last clean audit bounds that step. Why the
digests are taken where they are is argued in ``docs/design/corruption.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from deadpool.coordinator.outbox import Outbox
from deadpool.coordinator.records import MemberRecord
from deadpool.coordinator.replicas import Corruption
from deadpool.coordinator.views import Views
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import Detector
from deadpool.protocol.messages import Audit, AuditDigest
from deadpool.protocol.view import INITIAL_STEP

AUDIT_TIMEOUT_S = 60.0  # an audit the spare has not answered after this long is dropped (the spare was lost)
KEPT = 8  # the seats' digests kept per seat, newest first out (older steps are not audited any more)


def audit_verdict(seat: int, digest: int, redone: int) -> tuple[bool, str]:
    """Whether the seat's digest of its local gradients equals the spare's of the same step re-done; and why."""
    if digest == redone:
        return True, f"seat {seat}'s local gradients equal the spare's re-done ones"
    return False, (f"seat {seat}'s local gradients (checksum {digest:016x}) differ from those a spare computed "
                   f"re-doing the step from the seat's snapshot ({redone:016x})")


@dataclass(frozen=True, slots=True)
class InFlight:
    """One audit a spare was asked for."""

    seat: int
    member: str  # the seat's member when it digested the step
    digest: int  # the seat's own digest of the step
    spare: str  # the spare re-doing the step
    step: int
    groups: int  # the groups epoch it was asked under (a rebuild drops it)
    started: float


class Audits:
    """The audit in flight, each seat's last clean audit, and the counts for status."""

    def __init__(self, enabled: bool, events: EventLog, views: Views, members: Mapping[str, MemberRecord],
                 out: Outbox, free_spares: Callable[[], list[str]], settle: Callable[[], None],
                 round_running: Callable[[], bool]) -> None:
        self._enabled = enabled
        self._events = events
        self._views = views
        self._members = members
        self._out = out
        self._free_spares = free_spares  # spares no move reserved, on hosts not drained
        self._settle = settle  # the hosts' heartbeat columns into the records (the seats' steps)
        self._round_running = round_running
        self._flight: InFlight | None = None
        self._turn = 0  # the next seat audited is this one modulo the seats
        self._told: dict[int, dict[int, tuple[str, int]]] = {}  # seat -> step -> (member, digest), the seats' own
        self._groups = 0  # the groups epoch the digests in `_told` were taken under
        self._clean: dict[int, tuple[str, int]] = {}  # seat -> (member, step) of its newest clean audit
        self.done = 0  # audits with both digests equal
        self.missed = 0  # audits dropped (a step lost, a snapshot not there in time, the spare needed)
        self.why_missed = ""  # the newest reason a spare gave for not re-doing a step

    def tick(self, now: float) -> None:
        """Drop an audit that can no longer finish; ask a free spare for the next one when no round runs."""
        view = self._views.current
        if not self._enabled or view is None or self._round_running():
            return
        self._forget_older_groups()
        flight = self._flight
        if flight is not None:
            if now - flight.started < AUDIT_TIMEOUT_S and self._views.groups_epoch == flight.groups:
                return
            self._flight, self.missed = None, self.missed + 1
        spares = self._free_spares()
        seat = self._turn % view.world_size
        told = self._told.get(seat, {})
        if not spares or not told:
            return
        step = max(told)
        member, digest = told.pop(step)
        self._turn += 1
        spare = spares[self._turn % len(spares)]
        record = self._members.get(spare)
        if member != view.seats[seat] or record is None:
            return  # the seat changed hands since: its digest is of another member's step
        self._flight = InFlight(seat, member, digest, spare, step, self._views.groups_epoch, now)
        self._out.send(record.control_addr, Audit(spare, view.epoch, seat, step))

    def digest(self, message: AuditDigest) -> list[Corruption]:
        """A seat's digest of its audit step (kept), or a spare's of the step it re-did: the seat found corrupt,
        if its digest differs."""
        view = self._views.current
        flight = self._flight
        if view is None or not self._enabled:
            return []
        self._forget_older_groups()
        if 0 <= message.seat < view.world_size and view.seats[message.seat] == message.sender:
            if not message.missed and message.epoch >= self._groups:
                told = self._told.setdefault(message.seat, {})
                told[message.step] = (message.sender, message.digest)
                for step in sorted(told)[:-KEPT]:
                    del told[step]
            return []
        if flight is None or (message.sender, message.seat, message.step) != (flight.spare, flight.seat, flight.step):
            return []
        self._flight = None
        if message.missed:
            self.missed, self.why_missed = self.missed + 1, message.missed
            return []
        clean, why = audit_verdict(flight.seat, flight.digest, message.digest)
        if clean:
            self._clean[flight.seat] = (flight.member, flight.step)
            self.done += 1
            return []
        self._events.emit(schema.SdcSuspected(
            detector=Detector.AUDIT, step=flight.step, seats=[flight.seat], part="local gradients", reason=why,
            checksums={str(flight.seat): f"{flight.digest:016x}", "spare": f"{message.digest:016x}"}))
        member, last = self._clean.get(flight.seat, (flight.member, INITIAL_STEP))
        rollback = last if member == flight.member else INITIAL_STEP
        return [Corruption(flight.member, flight.seat, flight.step, f"audit at step {flight.step}: {why}", rollback,
                           Detector.AUDIT)]

    def _forget_older_groups(self) -> None:
        """A rebuild (a rollback, a seat refilled): the seats' digests of before it are of steps done again."""
        if self._views.groups_epoch != self._groups:
            self._groups, self._told = self._views.groups_epoch, {}

    def status(self) -> dict[str, object]:
        """For ``deadpool status``: the audits done and missed, and the one in flight."""
        if not self._enabled:
            return {}
        flight = self._flight
        return {"audits": {"clean": self.done, "missed": self.missed, "why_missed": self.why_missed,
                           "in_flight": None if flight is None else {"rank": flight.seat, "step": flight.step,
                                                                     "spare": flight.spare}}}
