"""Seats refilled by spares, timed from the failure's first evidence to the new member's first finished step.

Fencing a member records when it failed (the wall clock, or the injection time of a chaos kill,
whichever came first); a view that seats a spare in its place opens a swap; the spare's
``Recovered`` report closes it with a ``swap_completed`` event that carries the recovery time.
"""

from __future__ import annotations

from collections.abc import Callable

from deadpool.coordinator.records import PendingSwap
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.messages import Recovered


class Swaps:
    """When each fenced member failed, and the swaps still waiting for their spare's first step."""

    def __init__(self, events: EventLog, wall: Callable[[], float]) -> None:
        self._events = events
        self._wall = wall
        self._failed_at: dict[str, float] = {}  # member -> wall clock of the first evidence of its failure
        self._pending: list[PendingSwap] = []
        self.last_recovery_s: float | None = None  # the newest swap's time, failure to the new member's first step

    def failed(self, member: str, at: float) -> None:
        """`member` was found dead; `at` is the wall clock of the first evidence."""
        self._failed_at[member] = at

    def seated(self, seat: int, old_member: str, new_member: str, epoch: int) -> None:
        """View `epoch` seats `new_member` in `seat`, in place of `old_member`."""
        failed_at = self._failed_at.get(old_member, self._wall())
        self._pending.append(PendingSwap(seat, old_member, new_member, failed_at, epoch))

    def completed(self, message: Recovered) -> None:
        """A member finished its first step under a view: the swaps that seated it are done."""
        for swap in [s for s in self._pending if s.new_member == message.sender and message.epoch >= s.epoch]:
            self._pending.remove(swap)
            self.last_recovery_s = message.ts - swap.failed_at
            self._events.emit(schema.SwapCompleted(rank=swap.seat, old_member=swap.old_member,
                              new_member=swap.new_member, recovery_s=round(message.ts - swap.failed_at, 4),
                              step=message.step, epoch=message.epoch,
                              groups_rebuilt=message.groups_rebuilt, group_s=round(message.group_s, 6)))
