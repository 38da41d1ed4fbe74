"""How the coordinator ends a job: finished, failed, or standing down for a newer term or a cut-off host.

A finished or failed job stops every live member, every host agent and the standby (``Stop``). A
failure is declared only while this coordinator hears most hosts: one that hears too few cannot tell
a failed job from its own host being cut off, so it stands down instead (commits nothing, sends
nothing) and leaves the job to the hosts that still hear each other.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from deadpool.coordinator.finishes import Finishes
from deadpool.coordinator.outbox import Outbox
from deadpool.coordinator.records import Agent, MemberRecord
from deadpool.coordinator.terms import Terms
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.link import StandDown
from deadpool.protocol.messages import Stop

log = logging.getLogger("deadpool.coordinator.ending")


class Ending:
    """The job's outcome once it ended, and whether this coordinator stood down."""

    def __init__(self, events: EventLog, terms: Terms, outbox: Outbox, members: Mapping[str, MemberRecord],
                 agents: Mapping[str, Agent], fenced: Mapping[str, str], finished: Finishes) -> None:
        self.outcome: tuple[bool, str] | None = None  # (ok, reason) once the job ended
        self.stood_down: StandDown | None = None  # it stopped acting: a newer term runs the job, or it is cut off
        self._events = events
        self._terms = terms
        self._out = outbox
        self._members = members
        self._agents = agents
        self._fenced = fenced
        self._finished = finished

    def fail(self, reason: str, cause: str = "", **fields: Any) -> None:
        """End the job as failed; `reason` is the prose, `cause` (if any) the machine field (``user_error``).

        Only while most hosts were heard within ``Terms.verdict_window`` (under a failure timeout): a
        coordinator that hears too few cannot tell a failed job from its own host being cut off (the
        other side may run the job on), so it stands down instead.
        """
        held, why = self._terms.lease(self._out.now, self._agents, self._terms.verdict_window)
        if not held:
            self.stand_down(StandDown.CUT_OFF, f"{why}; the job may go on without this host ({reason})")
            return
        if cause:
            self._events.emit(schema.JobFailed(reason=cause, detail=reason, **fields))
        else:
            self._events.emit(schema.JobFailed(reason=reason))
        log.error("%s", reason)
        self.end(False, reason)

    def end(self, ok: bool, reason: str) -> None:
        """Stop the live members, the host agents and the standby (once)."""
        if self.outcome is not None:
            return
        self.outcome = (ok, reason)
        live = [m for m in self._members if m not in self._fenced and not self._finished.by(m)]
        self._out.broadcast(live, Stop(ok, reason), relay=False)  # not through agents: their own Stop ends them
        for agent in self._agents.values():
            self._out.send(agent.control_addr, Stop(ok, reason))
        self._out.send(self._terms.standby, Stop(ok, reason))

    def stand_down(self, kind: StandDown, why: str) -> None:
        """Stop acting for good: commit nothing, send nothing (the newer term's coordinator runs the job)."""
        if self.outcome is not None:
            return
        self.stood_down = kind
        self._events.emit(schema.CoordinatorStoodDown(term=self._terms.term, kind=kind, reason=why))
        log.warning("standing down: %s", why)
        self.outcome = (False, why)
