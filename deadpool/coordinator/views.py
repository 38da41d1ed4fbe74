"""The view the coordinator committed last, and what it sends of it, member by member: a delta or the whole.

:class:`Views` holds the committed view that every other piece of the coordinator reads, and commits
the next one (the ``view_committed`` event and the broadcast).  A member that was in the previous view
gets a :class:`ViewDelta` against it (the size of the change); a new member, or one that asks
(``ViewRequest``), gets the whole view as one ``CommitView`` or in pieces (``protocol/viewsync.py``).
The digest of the view committed last (hashed again only in the runs of seats a commit changed), and
its seat of each member, are computed once here (:class:`ViewSender`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from deadpool.coordinator.decisions import Trigger
from deadpool.coordinator.fanout import CatchUp
from deadpool.coordinator.outbox import Outbox
from deadpool.coordinator.pools import Addresses
from deadpool.coordinator.records import MemberRecord
from deadpool.coordinator.terms import Terms
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol import viewsync
from deadpool.protocol.messages import CommitView, Message, ViewChunk
from deadpool.protocol.view import View


class Views:
    """The committed view (None before the first), the epoch whose groups are in use, and their sending."""

    def __init__(self, events: EventLog, terms: Terms, outbox: Outbox, addrs: Addresses, catch_up: CatchUp,
                 members: Mapping[str, MemberRecord], fenced: Mapping[str, str]) -> None:
        self.current: View | None = None
        self.groups_epoch = 0  # the view that built the groups in use: an older collective report is stale
        self._events = events
        self._terms = terms
        self._out = outbox
        self._addrs = addrs
        self._catch_up = catch_up
        self._members = members
        self._fenced = fenced
        self._sender = ViewSender()  # deltas for members that hold the previous view, the whole view for others

    def epoch(self) -> int:
        return self.current.epoch if self.current else 0

    def seat_of(self, member: str) -> int | None:
        """`member`'s seat in the committed view (None: a spare, a stranger, or no view yet)."""
        return self._sender.seat_of(self.current, member) if self.current else None

    def commit(self, view: View, reason: str, failed: dict[int, str], trigger: Trigger) -> None:
        """`view` is the job's view from now on: logged, and sent to its members (a delta where they hold the last)."""
        previous, self.current = self.current, view
        self._events.epoch = view.epoch
        changed = self._addrs.take_changed()  # the next view patches this one's addresses
        if previous is None or view.store_prefix != previous.store_prefix:
            self.groups_epoch = view.epoch
        self._events.emit(schema.ViewCommitted(epoch=view.epoch, resume_step=view.resume_step, seats=view.seats,
                          spares=view.spares, store_prefix=view.store_prefix, reason=reason,
                          rebuild_groups=view.rebuild_groups,
                          failed_seats=sorted(failed), buddies=view.buddies, trigger=trigger, term=self._terms.term))
        for members, messages in self._sender.commit(previous, view, self._terms.term, changed):
            self._out.broadcast(members, *messages)
        self._catch_up.committed(view.epoch, self._out.now)

    def adopt(self, view: View) -> None:
        """After a restart: `view`, the highest any member reported, is the job's view as it is (no new epoch)."""
        self.current = view
        self._events.epoch = view.epoch

    def resend(self, member: str, held: int) -> None:
        """`member` still holds view `held` a grace period after a newer commit (or asks): again, directly."""
        view = self.current
        if view is not None and member not in self._fenced and view.contains(member):
            for piece in self._sender.again(view, held, self._terms.term):
                self._out.send(self._members[member].control_addr, piece)


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
