"""The seats' ``Finished`` reports: the job ends once every seat sent one, and only if their digests agree.

Each seat reports its final state digest when its loop is done; the job is finished when every seat
of the view has, with one digest.  A seat's report may also say that a restore left a data loader
no snapshot holds where it was: ``training_finished`` then says the final state may differ from a
failure-free run's (``untracked_rollback``).
"""

from __future__ import annotations

from deadpool.events.schema import UntrackedRollback
from deadpool.protocol.messages import Finished


class Finishes:
    """The Finished report of each seat that sent one (a seat's newest)."""

    def __init__(self) -> None:
        self._by_seat: dict[int, Finished] = {}

    def record(self, message: Finished) -> None:
        self._by_seat[message.seat] = message

    def clear(self) -> None:
        self._by_seat.clear()

    def complete(self, world: int) -> bool:
        return len(self._by_seat) >= world

    def by(self, member: str) -> bool:
        """`member` reported its seat finished."""
        return any(f.sender == member for f in self._by_seat.values())

    def digest(self) -> tuple[str | None, str]:
        """The job's final state digest, or None and why (the seats disagree)."""
        digests = {f.digest for f in self._by_seat.values()}
        if len(digests) != 1:
            return None, f"seats disagree on the final state digest: {sorted(digests)}"
        return digests.pop(), ""

    def untracked_rollback(self) -> UntrackedRollback | None:
        """``training_finished``'s ``untracked_rollback``, from the lowest seat whose restore left a data loader no
        snapshot holds where it was (nothing when none did): the final state may differ from a failure-free run's."""
        for seat in sorted(self._by_seat):
            f = self._by_seat[seat]
            if f.untracked_loader:
                return UntrackedRollback(loader=f.untracked_loader, where=f.untracked_where, view=f.untracked_view,
                                         rank=seat)
        return None
