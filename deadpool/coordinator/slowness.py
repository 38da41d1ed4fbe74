"""Fail-slow seats: each seat's compute time against the job's median, and what to do about one that stays slow.

Every worker measures, per step, its step time less the time it waited in collectives (the seat the
others wait for waits least) and sends the median of its recent steps with its heartbeats. Every
two seconds this piece scores every seat against the job's median (``decisions.slowness``); a seat that
stays at ``slow_threshold`` or above for ``slow_steps`` steps is reported once (``seat_slow``), and
with ``replace_slow`` moved to a spare when ``decisions.slow_move`` says it pays (the slowness over
the steps left against a move's measured cost), keeping ``slow_reserve`` spares for failures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from deadpool.config import Config
from deadpool.coordinator import decisions
from deadpool.coordinator.moves import Moves
from deadpool.coordinator.records import MemberRecord
from deadpool.coordinator.views import Views
from deadpool.events import schema
from deadpool.events.log import EventLog

CHECK_EVERY_S = 2.0  # the scores are computed this often (each check settles the hosts' heartbeat columns: O(members))
DEFAULT_MOVE_COST_S = 3.0  # what a move costs before one was measured in this job


class Slowness:
    """The seats' newest scores, since when each slow member has been slow, and those reported."""

    def __init__(self, config: Config, events: EventLog, views: Views, members: Mapping[str, MemberRecord],
                 moves: Moves, settle: Callable[[], None], move_cost: Callable[[], float | None]) -> None:
        self._config = config
        self._events = events
        self._views = views
        self._members = members
        self._moves = moves
        self._settle = settle  # the hosts' heartbeat columns into the records (HostBeats.settle)
        self._move_cost = move_cost  # the newest swap's measured time, if any
        self.scores: dict[int, float] = {}  # seat -> compute time over the median, at the last check
        self._since: dict[str, int] = {}  # member -> the step at which it was first seen slow
        self._reported: set[str] = set()
        self._checked = float("-inf")

    def check(self, now: float) -> None:
        """Score the seats (at most once a second); report a seat slow for long enough, and move it if it pays."""
        view = self._views.current
        if view is None or now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        self._settle()
        records = {seat: record for seat, member in enumerate(view.seats)
                   if (record := self._members.get(member)) is not None}
        self.scores = decisions.slowness({seat: record.compute_s for seat, record in records.items()})
        config = self._config
        for seat, score in self.scores.items():
            record = records[seat]
            if score < config.slow_threshold:
                self._since.pop(record.member, None)
                continue
            since = self._since.setdefault(record.member, record.step)
            if record.step - since < config.slow_steps or record.member in self._reported:
                continue
            self._reported.add(record.member)
            moved, why = False, "--replace-slow is off"
            if config.replace_slow:
                left = config.total_steps - record.step - 1 if config.total_steps else None
                cost = self._move_cost() or DEFAULT_MOVE_COST_S
                moved, why = decisions.slow_move(score, record.compute_s, left, cost, self._moves.free_spares(),
                                                 config.slow_reserve)
                if moved:
                    refused = self._moves.start_slow(seat, f"slow: {score:.2f}x the median compute time", now)
                    moved, why = not refused, refused or why
            self._events.emit(schema.SeatSlow(member=record.member, rank=seat, step=record.step, score=score,
                                              threshold=config.slow_threshold, steps=record.step - since,
                                              moved=moved, reason=why))
