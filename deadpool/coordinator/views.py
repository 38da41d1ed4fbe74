"""What the coordinator sends of a committed view, member by member: a delta or the whole view.

A member that was in the previous view gets a :class:`ViewDelta` against it (the
size of the change); a new member, or one that asks (``ViewRequest``), gets the
whole view as one ``CommitView`` or in pieces (``protocol/viewsync.py``). The
digest of the view committed last (hashed again only in the runs of seats a commit changed), and its seat of
each member, are computed once here.
"""

from __future__ import annotations

from collections.abc import Collection

from deadpool.protocol import viewsync
from deadpool.protocol.messages import CommitView, Message, ViewChunk
from deadpool.protocol.view import View


class ViewSender:
    """The newest view's digest and whole form, and its delta from the one before."""

    def __init__(self) -> None:
        self._view: View | None = None
        self._digest = b""
        self._runs: list[viewsync.SeatRun] = []  # its seat runs (viewsync.seat_runs): the next commit's start
        self._whole: list[CommitView | ViewChunk] = []
        self._term = -1
        self._seats: tuple[View | None, dict[str, int]] = (None, {})
        self._delta: Message | None = None  # the newest view's delta, and the epoch it applies to
        self._delta_base = -1

    def seat_of(self, view: View, member: str) -> int | None:
        """`member`'s seat in `view` (None: a spare or a stranger), from an index built once per view."""
        if self._seats[0] is not view:
            self._seats = (view, {m: seat for seat, m in enumerate(view.seats)})
        return self._seats[1].get(member)

    def digest(self, view: View, changed: Collection[str] | None = None) -> bytes:
        """`view`'s digest; `changed` (as ``viewsync.seat_runs``'s) where `view` follows the view digested last."""
        if view is not self._view:
            runs = viewsync.seat_runs(view, self._view, self._runs, changed)
            self._view, self._runs, self._digest, self._whole = view, runs, viewsync.view_digest(view, runs), []
        return self._digest

    def commit(self, previous: View | None, view: View, term: int,
               changed: Collection[str] | None = None) -> list[tuple[list[str], list[Message]]]:
        """What to send of the newly committed `view` to whom: a delta to the members of `previous`, the whole
        (one message, or its pieces) to the others. `changed`: as ``viewsync.make_delta``'s."""
        base_digest = self.digest(previous) if previous is not None else b""
        delta = (viewsync.make_delta(previous, view, base_digest, self.digest(view, changed), changed)
                 if previous is not None else None)
        members = [*view.seats, *view.spares]
        self._delta, self._delta_base = delta, previous.epoch if previous is not None and delta is not None else -1
        if previous is None or delta is None:
            return [(members, self.whole(view, term))]
        # Only a member the delta seats or adds as a spare can be new to the job: O(changed) to find them.
        spares_before = set(previous.spares)
        newcomers = [m for m in [*delta.seats.values(), *delta.spares_new]
                     if m not in spares_before and self.seat_of(previous, m) is None]
        if not newcomers:
            return [(members, [delta])]
        new = set(newcomers)
        return [([m for m in members if m not in new], [delta]), (newcomers, self.whole(view, term))]

    def whole(self, view: View, term: int) -> list[Message]:
        """The whole view, encoded once per view and term however many members ask."""
        self.digest(view)
        if not self._whole or self._term != term:
            self._whole, self._term = viewsync.whole(view, self._digest, term), term
        return list(self._whole)

    def again(self, view: View, held: int, term: int) -> list[Message]:
        """What a member holding epoch `held` needs of `view` once more: the delta where it applies, else the whole."""
        if self._view is view and self._delta is not None and held == self._delta_base:
            return [self._delta]
        return self.whole(view, term)
