"""What ``deadpool status`` shows of a coordinator: a JSON-able document of its live state."""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from deadpool.coordinator.coverage import Coverage
from deadpool.coordinator.records import MemberRecord, Round
from deadpool.coordinator.terms import Terms
from deadpool.protocol.view import View


class Coordinator(Protocol):
    """What the document reads of the coordinator (``service.Coordinator``)."""

    view: View | None
    members: dict[str, MemberRecord]
    fenced: dict[str, str]
    round: Round | None
    outcome: tuple[bool, str] | None
    terms: Terms
    recent_events: deque[dict[str, Any]]
    coverage: Coverage

    @property
    def world_size(self) -> int: ...


def status_document(coordinator: Coordinator, now: float) -> dict[str, Any]:
    """The live state at `now`: term, view, every seat's progress and heartbeat age, spares, recent events."""
    view = coordinator.view
    listed = [*view.seats, *view.spares] if view else []
    # Heard last: its own message, or its agent's batch that listed it (the steady state of a large job).
    heard = dict(zip(listed, coordinator.coverage.vouched_times(listed), strict=True))
    seats = []
    if view is not None:
        for seat, member in enumerate(view.seats):
            r = coordinator.members.get(member)
            buddy = view.buddy_member(seat) if view.world_size > 1 else ""
            seats.append({
                "rank": seat, "member": member, "host": r.host if r else "", "pid": r.pid if r else 0,
                "state": "dead" if member in coordinator.fenced else "active",
                "step": r.step if r else -1, "snapshot_step": r.snapshot_step if r else -2,
                "confirmed_step": r.confirmed_step if r else -2, "copy_on": buddy,
                "heartbeat_age_s": round(now - max(r.last_seen, heard[member]), 3) if r else None,
                "stall_p99_s": r.stall_p99_s if r else 0.0,
            })
    spares = [{"member": m, "host": coordinator.members[m].host, "pid": coordinator.members[m].pid,
               "heartbeat_age_s": round(now - max(coordinator.members[m].last_seen, heard[m]), 3)}
              for m in (view.spares if view else []) if m in coordinator.members]
    rnd, outcome = coordinator.round, coordinator.outcome
    return {
        "role": "active", "term": coordinator.terms.term, "standby": coordinator.terms.standby,
        "epoch": view.epoch if view else 0, "world_size": coordinator.world_size,
        "resume_step": view.resume_step if view else -1, "store_prefix": view.store_prefix if view else "",
        "seats": seats, "spares": spares, "fenced": sorted(coordinator.fenced),
        "round": None if rnd is None else {"epoch": rnd.epoch, "failed_seats": sorted(rnd.failed)},
        "outcome": None if outcome is None else {"ok": outcome[0], "reason": outcome[1]},
        "recent_events": [compact(record) for record in coordinator.recent_events],
    }


def compact(record: dict[str, Any]) -> dict[str, Any]:
    """An event as `deadpool status` keeps it: scalars only (a view's seat lists would grow the reply)."""
    return {k: v[:200] if isinstance(v, str) else v for k, v in record.items()
            if v is None or isinstance(v, (str, int, float, bool))}
