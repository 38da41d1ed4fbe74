"""What ``deadpool status`` shows of a coordinator: a JSON-able document of its live state."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from deadpool.coordinator.coverage import Coverage
from deadpool.coordinator.ending import Ending
from deadpool.coordinator.records import MemberRecord
from deadpool.coordinator.rounds import Rounds
from deadpool.coordinator.terms import Terms
from deadpool.coordinator.views import Views
from deadpool.events.log import EventLog
from deadpool.events.schema import EventRecord

RECENT_EVENTS = 20  # events kept for `deadpool status`


class Status:
    """The newest events, and the document built from the coordinator's pieces when an operator asks."""

    def __init__(self, events: EventLog, world_size: int, views: Views, rounds: Rounds, ending: Ending, terms: Terms,
                 members: Mapping[str, MemberRecord], fenced: Mapping[str, str], coverage: Coverage) -> None:
        self._world_size = world_size
        self._views = views
        self._rounds = rounds
        self._ending = ending
        self._terms = terms
        self._members = members
        self._fenced = fenced
        self._coverage = coverage
        # The newest events, compacted when asked for (bounded: floods of joins or rejections).
        self.recent_events: deque[EventRecord] = deque(maxlen=RECENT_EVENTS)
        events.listeners.append(self.recent_events.append)

    def document(self, now: float) -> dict[str, Any]:
        """The live state at `now`: term, view, every seat's progress and heartbeat age, spares, recent events."""
        view, members, fenced = self._views.current, self._members, self._fenced
        listed = [*view.seats, *view.spares] if view else []
        # Heard last: its own message, or its agent's batch that listed it (the steady state of a large job).
        heard = dict(zip(listed, self._coverage.vouched_times(listed), strict=True))
        seats = []
        if view is not None:
            for seat, member in enumerate(view.seats):
                r = members.get(member)
                buddy = view.buddy_member(seat) if view.world_size > 1 else ""
                seats.append({
                    "rank": seat, "member": member, "host": r.host if r else "", "pid": r.pid if r else 0,
                    "state": "dead" if member in fenced else "active",
                    "step": r.step if r else -1, "snapshot_step": r.snapshot_step if r else -2,
                    "confirmed_step": r.confirmed_step if r else -2, "copy_on": buddy,
                    "heartbeat_age_s": round(now - max(r.last_seen, heard[member]), 3) if r else None,
                    "stall_p99_s": r.stall_p99_s if r else 0.0,
                })
        spares = [{"member": m, "host": members[m].host, "pid": members[m].pid,
                   "heartbeat_age_s": round(now - max(members[m].last_seen, heard[m]), 3)}
                  for m in (view.spares if view else []) if m in members]
        rnd, outcome = self._rounds.current, self._ending.outcome
        return {
            "role": "active", "term": self._terms.term, "standby": self._terms.standby,
            "epoch": view.epoch if view else 0, "world_size": self._world_size,
            "resume_step": view.resume_step if view else -1, "store_prefix": view.store_prefix if view else "",
            "seats": seats, "spares": spares, "fenced": sorted(fenced),
            "round": None if rnd is None else {"epoch": rnd.epoch, "failed_seats": sorted(rnd.failed)},
            "outcome": None if outcome is None else {"ok": outcome[0], "reason": outcome[1]},
            "recent_events": [compact(record.fields()) for record in self.recent_events],
        }


def compact(record: dict[str, Any]) -> dict[str, Any]:
    """An event as `deadpool status` keeps it: scalars only (a view's seat lists would grow the reply)."""
    return {k: v[:200] if isinstance(v, str) else v for k, v in record.items()
            if v is None or isinstance(v, (str, int, float, bool))}
