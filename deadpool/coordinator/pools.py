"""Small pieces of the coordinator's state that keep its per-view work O(members), and its asks bounded.

:class:`Survivors` lists the seated members a round still counts on; building the
list is O(seats), so it is built once per (view, round, fenced count) instead of
on every acknowledgement.  :class:`JoiningSpares` pools spares that join a
running job: one view for a storm of joins (131,072 members start within a
second), not one O(members) view per spare.  :class:`SparePool` keeps the order spares are
chosen in for a heartbeat interval.  :class:`Addresses` keeps every member's
addresses in plain dicts that views and broadcasts read whole.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Container, Mapping

from deadpool.coordinator.records import MemberRecord, Round
from deadpool.protocol.view import View

SPARE_BATCH_S = 0.2  # spares joining a running job are pooled by at most one view this often


class Survivors:
    """The members seated in `view`, not failed in `round` and not fenced: a list and a set, cached; and
    those of them a round still waits on, kept as answers come.

    A grown round keeps its predecessor's answers (the same dict), so what it still waits on is the
    predecessor's wait less the newly failed: a round that grows with each of 100 failures costs
    O(changed) per growth, not O(seats).
    """

    def __init__(self) -> None:
        self._key: tuple[View | None, Round | None, int] = (None, None, -1)
        self._list: list[str] = []
        self._set: set[str] | None = None  # built on first use: most rounds never ask
        # For one view and answers dict: the survivors without an answer (in seat order), and the members
        # whose answer is early (asked again when the round grows).
        self._wait_key: tuple[View | None, object] = (None, None)
        self._synced: tuple[Round | None, int] = (None, -1)  # the round and fenced count last taken out
        self._pending: dict[str, None] = {}
        self._early: set[str] = set()

    def _build(self, view: View, rnd: Round | None, fenced: Mapping[str, str], fenced_count: int) -> None:
        if self._key[0] is view and self._key[1] is rnd and self._key[2] == fenced_count:
            return
        # A handful of members left out of 131,072 seats: filtered in C (a Python loop costs 40 ms per round).
        out = {*(rnd.failed.values() if rnd else ()), *fenced}
        self._list = list(itertools.filterfalse(out.__contains__, view.seats)) if out else list(view.seats)
        self._set = None
        self._key = (view, rnd, fenced_count)

    def of(self, view: View, rnd: Round | None, fenced: dict[str, str]) -> list[str]:
        self._build(view, rnd, fenced, len(fenced))  # fenced only grows: its size tells a change
        return self._list

    def set_of(self, view: View, rnd: Round | None, fenced: dict[str, str]) -> set[str]:
        self._build(view, rnd, fenced, len(fenced))
        if self._set is None:
            self._set = set(self._list)
        return self._set

    def _waiting(self, view: View, rnd: Round, fenced: dict[str, str]) -> dict[str, None]:
        """The survivors `rnd` has no answer from, brought up to date with its failed and the fenced."""
        if self._wait_key[0] is not view or self._wait_key[1] is not rnd.acks:
            acks = rnd.acks
            self._pending = dict.fromkeys(itertools.filterfalse(acks.__contains__, self.of(view, rnd, fenced)))
            self._early = {member for member, ack in acks.items() if ack.early}
            self._wait_key = (view, acks)
        elif self._synced != (rnd, len(fenced)):  # the round grew, or someone was fenced: O(failures)
            for member in [*rnd.failed.values(), *fenced]:
                self._pending.pop(member, None)
        self._synced = (rnd, len(fenced))
        return self._pending

    def answered(self, rnd: Round, member: str, early: bool) -> None:
        """`member`'s answer was just stored in `rnd.acks` (an early one is asked again when the round grows)."""
        if self._wait_key[1] is rnd.acks:
            self._pending.pop(member, None)
            if early:
                self._early.add(member)
            else:
                self._early.discard(member)

    def all_answered(self, rnd: Round, members: list[str]) -> None:
        """Full answers of `members` were just stored in `rnd.acks` (an agent's batch): in C, not one by one."""
        if self._wait_key[1] is rnd.acks:
            collections.deque(map(self._pending.pop, members, itertools.repeat(None)), maxlen=0)
            self._early.difference_update(members)

    def unanswered(self, view: View, rnd: Round, fenced: dict[str, str]) -> list[str]:
        """The survivors without a full answer in `rnd` (none, or an early one): a grown round asks them again."""
        pending = self._waiting(view, rnd, fenced)
        if not self._early:
            return list(pending)
        seated = self.set_of(view, rnd, fenced)
        return [*pending, *(m for m in self._early if m in seated)]

    def first_unanswered(self, view: View, rnd: Round, fenced: dict[str, str]) -> str:
        """A survivor `rnd` has no answer from ("": none)."""
        return next(iter(self._waiting(view, rnd, fenced)), "")


class JoiningSpares:
    """Spares that joined since the last view that pooled them."""

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.pooled_at = float("-inf")  # when the last view pooling joined spares was committed

    def due(self, now: float) -> bool:
        """A view pooling the waiting spares may be committed now."""
        return bool(self.waiting) and now - self.pooled_at >= SPARE_BATCH_S

    def take(self, fenced: Container[str]) -> tuple[list[str], str]:
        """The waiting spares still alive (the rest are dropped), and how to name them in a reason."""
        joining, self.waiting = [m for m in self.waiting if m not in fenced], []
        return joining, joining[0] if len(joining) == 1 else f"{len(joining)} spares"


class SparePool:
    """The spares a swap chooses from, in the order ``decisions.order_spares`` gives, kept for one interval.

    Ordering reads every spare's last-heard times: about 10 ms for 6,554 spares at 131,072 members, and a
    round that grows with each of a burst of failures chooses again every time. The order is kept for one
    heartbeat interval (less the members fenced since): a spare that dies silently falls behind the others
    no sooner than its next missed heartbeat anyway.
    """

    def __init__(self, fresh_for: float) -> None:
        self._fresh_for = fresh_for
        self._key: tuple[View | None, list[str], int] = (None, [], -1)  # (view, joined, fenced count) ordered for
        self._at = float("-inf")
        self._pool: list[str] = []

    def ordered(self, now: float, view: View, joined: list[str], fenced: Mapping[str, str],
                order: Callable[[list[str]], list[str]]) -> list[str]:
        """`order` of the view's spares and `joined`, or the kept one, without the members fenced since."""
        seen, kept_joined, fenced_count = self._key
        if seen is not view or kept_joined != joined or now - self._at > self._fresh_for:
            self._pool, self._at = order([*view.spares, *joined]), now
        elif fenced_count != len(fenced):  # fenced only grows: its size tells a change
            self._pool = list(itertools.filterfalse(fenced.__contains__, self._pool))
        self._key = (view, list(joined), len(fenced))
        return self._pool


REJOIN_ASK_INTERVAL_S = 1.0  # a member we cannot reach is asked for its Join at most this often
MAX_REJOIN_ASKS = 4096  # members remembered as asked, before the memory is cleared


class RejoinAsks:
    """When each member we could not reach was last asked for its Join (bounded: strangers cannot grow it)."""

    def __init__(self) -> None:
        self._asked: dict[str, float] = {}

    def due(self, member: str, control_addr: str, now: float) -> bool:
        """Ask `member` now (and remember it): it gave an address and was not asked within the interval."""
        if not control_addr or now - self._asked.get(member, -1e9) < REJOIN_ASK_INTERVAL_S:
            return False
        if len(self._asked) >= MAX_REJOIN_ASKS:
            self._asked.clear()
        self._asked[member] = now
        return True


class Addresses:
    """member -> host, bulk address and control address, filled as member records are stored.

    Plain dicts, read whole by each view and broadcast: their lookups run in C over 131,072 members,
    without a copy of every record's field per decision.
    """

    def __init__(self) -> None:
        self.host: dict[str, str] = {}
        self.bulk: dict[str, str] = {}
        self.control: dict[str, str] = {}  # "": known only from a reported view, until it re-joins
        self.changed: set[str] = set()  # members whose host or bulk address was stored anew since the last view

    def keep(self, records: dict[str, MemberRecord], record: MemberRecord) -> None:
        """Store `record` in `records` (the coordinator's), and its addresses here."""
        member = record.member
        records[member] = record
        if self.host.get(member) != record.host or self.bulk.get(member) != record.bulk_addr:
            self.host[member], self.bulk[member] = record.host, record.bulk_addr
            self.changed.add(member)
        self.control[member] = record.control_addr

    def take_changed(self) -> set[str]:
        """The members whose addresses changed since the last call (a view patches those), and start afresh."""
        changed, self.changed = self.changed, set()
        return changed
