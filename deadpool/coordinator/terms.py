"""An active coordinator's term: its number, its standby, its lease, and the coordinators it superseded.

The ``Coordinator`` owns one ``Terms`` and asks it three things: which term to stamp
on what it sends, whether it may commit a view now (the lease: only while it hears
a majority of the hosts, once the job has a standby that could take over), and
whom to tell about the term (members and agents when the standby changes, older
coordinators until they stand down).  Why this makes at most one committed view
per epoch across terms is in docs/design/coordinator.md ("Coordinator failover").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from deadpool.coordinator import decisions
from deadpool.coordinator.records import Agent
from deadpool.protocol.messages import (
    CommitView,
    Coordinators,
    Fenced,
    FenceKill,
    Message,
    Prepare,
    Rejoin,
    SignalMember,
    Stop,
    ViewChunk,
    ViewDelta,
    Welcome,
)

# The messages that carry their sender's term; receivers drop those of a term older than the one they follow.
TERMED = (Welcome, CommitView, ViewDelta, ViewChunk, Prepare, Stop, Fenced, Rejoin, FenceKill, SignalMember)
TELL_SUPERSEDED_EVERY_S = 1.0  # an older coordinator is told of the newer term this often until it is gone
TELL_SUPERSEDED_FOR_S = 600.0  # ... for this long (a SIGSTOPped one may wake up late)
ASK_STANDBY_EVERY_S = 10.0  # a job that should have a standby and has none asks a host for one this often


def takeover_bound(failure_timeout: float) -> float:
    """How long a standby must miss the active coordinator before it asks the hosts about a takeover."""
    return max(3.0, 2 * failure_timeout)


@dataclasses.dataclass
class Terms:
    """The term side of one active coordinator (no I/O: the Coordinator sends what this decides)."""

    term: int  # this coordinator's term (1: the first coordinator of the job)
    address: str  # its control address ("" in the simulator: no failover there)
    store: str  # its TCPStore
    hosts: int  # hosts in the job (the majority is counted over them); 0: unknown, no lease
    failure_timeout: float
    standby: str = ""  # the standby's control address ("": none now)
    standby_seen: float = 0.0
    had_standby: bool = False  # a standby registered once: from then on a commit needs the lease
    superseded: dict[str, float] = dataclasses.field(default_factory=dict)  # older active -> when last told
    superseded_since: float = 0.0
    lost_standby: str = ""  # the last standby lost (its host is not asked to start the next one)
    standby_asked: float = 0.0  # when a host was last asked to start a standby

    @property
    def lease_window(self) -> float:
        return takeover_bound(self.failure_timeout) / 2

    def stamp(self, message: Message) -> Message:
        """`message` with this term, if it is a kind that carries one."""
        if isinstance(message, TERMED) and message.term != self.term:
            return dataclasses.replace(message, term=self.term)
        return message

    def coordinators(self) -> Coordinators:
        return Coordinators(self.term, self.address, self.standby, self.store)

    def standby_hello(self, now: float, standby: str) -> bool:
        """A StandbyHello from `standby`; True when it is a new standby (members and agents must hear of it)."""
        new = standby != self.standby
        self.standby, self.standby_seen, self.had_standby = standby, now, True
        return new

    def lose_standby(self, now: float) -> None:
        self.lost_standby, self.standby = self.standby, ""
        self.standby_asked = now - ASK_STANDBY_EVERY_S  # ask for the next one at once

    def standby_due(self, now: float) -> bool:
        """Should a host be asked for a standby now? (none now, where the job had one, or after a takeover)"""
        wanted = self.hosts >= 3 and (self.had_standby or self.term > 1)
        if self.standby or not wanted or now - self.standby_asked < ASK_STANDBY_EVERY_S:
            return False
        self.standby_asked = now
        return True

    def standby_silent(self, now: float) -> float | None:
        """Seconds the standby has been silent, once past the failure timeout (it is lost); else None."""
        if not self.standby or now - self.standby_seen <= self.failure_timeout:
            return None
        return now - self.standby_seen

    @property
    def verdict_window(self) -> float:
        """Hosts heard within this long let a coordinator fail the job; a cut-off one stands down instead.

        Shorter than a failure timeout: the silence that made members fail is, where its own host is
        cut off, also the hosts' silence, and is then longer than this.  Longer than an agent's hello
        period (1 s) at the default timeout, so an agent with no workers left still counts.
        """
        return min(self.lease_window, 0.75 * self.failure_timeout)

    def lease(self, now: float, agents: Mapping[str, Agent], window: float | None = None) -> tuple[bool, str]:
        """May this coordinator commit a view now (``decisions.holds_lease``, once the job has a standby)?"""
        if not self.had_standby or self.hosts < 3:
            return True, "no standby: no other coordinator can commit"
        return decisions.holds_lease(now, {a: r.seen for a, r in agents.items()}, self.hosts,
                                     self.lease_window if window is None else window)

    def supersede(self, now: float, old_active: str) -> None:
        """This coordinator took over from `old_active`: tell it of the new term until it is gone."""
        if old_active and old_active != self.address:
            self.superseded[old_active] = 0.0
            self.superseded_since = self.standby_asked = now  # the first standby of the term: once hosts re-joined

    def due(self, now: float) -> list[str]:
        """The older coordinators to tell of this term now."""
        if now - self.superseded_since > TELL_SUPERSEDED_FOR_S:
            return []
        due = [addr for addr, told in self.superseded.items() if now - told >= TELL_SUPERSEDED_EVERY_S]
        for addr in due:
            self.superseded[addr] = now
        return due
