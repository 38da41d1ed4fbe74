"""Terms as a worker or agent sees them: which coordinator to talk to, and what a coordinator's exit says.

``CoordinatorLink`` is one small value shared by a worker's heartbeat and membership
actors (both on the runtime thread's loop, so no lock), and held by each agent.  It
starts at the address the launcher gave; a ``Coordinators`` message of a newer term
moves it to that term's active coordinator, and from then on every message of an
older term is dropped.  ``EXIT_CODES`` is the contract between a coordinator process
and the agent that started it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StandDown(enum.StrEnum):
    """Why a coordinator stopped acting (its process then exits with ``EXIT_CODES[...]``)."""

    SUPERSEDED = "superseded"  # a newer term's coordinator runs the job
    CUT_OFF = "cut_off"  # it heard too few hosts for the view timeout: its own host is cut off


# A coordinator process's exit status: 0 and 1 are the job's outcome; these say it ended without one.
EXIT_CODES = {StandDown.SUPERSEDED: 3, StandDown.CUT_OFF: 4}


@dataclass
class CoordinatorLink:
    """The active coordinator's address, its standby's, and the highest term seen."""

    active: str
    standby: str = ""
    term: int = 0

    def stale(self, term: int) -> bool:
        """A message of `term` comes from a superseded coordinator (0: a sender without terms, never stale)."""
        return 0 < term < self.term

    def follow(self, term: int, active: str, standby: str) -> bool:
        """Take the coordinators of `term` if it is not older than ours; True when the active one changed."""
        if term < self.term:
            return False
        moved = active != self.active
        self.term, self.active, self.standby = term, active, standby
        return moved
