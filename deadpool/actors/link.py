"""CoordinatorLink: which coordinator a worker talks to, and the newest term it follows.

One small value shared by the heartbeat and membership actors of a worker (both run
on the runtime thread's loop, so no lock).  It starts at the address the launcher
gave; a ``Coordinators`` message of a newer term moves it to that term's active
coordinator, and from then on every message of an older term is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass


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
