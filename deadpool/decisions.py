"""The coordinator's decisions, as pure functions of (now, state, config).

Each returns its decision and a human-readable reason, so the event log says
*why*, and each is tested without sockets or clocks (``tests/test_decisions.py``)
and reused unchanged by the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deadpool.view import View, place_buddies


@dataclass(frozen=True, slots=True)
class Snapshots:
    """What one survivor reported in its PrepareAck."""

    local_steps: Sequence[int]  # complete local snapshots
    ward_steps: Mapping[int, Sequence[int]]  # seat -> complete buddy copies held


def silent_members(now: float, last_seen: Mapping[str, float], failure_timeout: float) -> list[tuple[str, str]]:
    """Members whose last heartbeat is older than `failure_timeout`, with the reason."""
    return [
        (member, f"no heartbeat for {now - seen:.2f}s (failure_timeout {failure_timeout:.2f}s)")
        for member, seen in sorted(last_seen.items())
        if now - seen > failure_timeout
    ]


def pick_spares(
    failed_seats: Sequence[int], view: View, spares: Sequence[str], hosts: Mapping[str, str]
) -> tuple[dict[int, str] | None, str]:
    """Choose a spare for every failed seat, or None when there are too few.

    A spare on another host than the failed seat's buddy is preferred, so the
    new member and the copy of its neighbour's state do not share a failure
    domain; otherwise spares are taken in the order they joined.
    """
    if len(spares) < len(failed_seats):
        return None, f"{len(failed_seats)} seat(s) lost but only {len(spares)} spare(s) left"
    available = list(spares)
    chosen: dict[int, str] = {}
    for seat in sorted(failed_seats):
        buddy_host = hosts.get(view.buddy_member(seat), "")
        preferred = [s for s in available if hosts.get(s, "") != buddy_host]
        spare = (preferred or available)[0]
        available.remove(spare)
        chosen[seat] = spare
    reason = ", ".join(f"seat {seat} <- {spare}" for seat, spare in sorted(chosen.items()))
    return chosen, reason


def resume_step(
    view: View, failed_seats: Sequence[int], reports: Mapping[str, Snapshots]
) -> tuple[int | None, str]:
    """The newest step every seat can restore: survivors from memory, failed seats from their buddy.

    Returns None (with the reason, naming the lost seat) when no common step exists.
    """
    failed = set(failed_seats)
    candidates: set[int] | None = None
    for seat, member in enumerate(view.seats):
        if seat in failed:
            buddy_seat = view.buddies[seat]
            if buddy_seat in failed or buddy_seat == seat:
                return None, (
                    f"seat {seat} and the seat holding its snapshot copy (seat {buddy_seat}) were both lost: "
                    "no copy of its state survives in memory"
                )
            report = reports.get(view.seats[buddy_seat])
            held = set(report.ward_steps.get(seat, ())) if report else set()
            if not held:
                return None, (
                    f"seat {seat}'s snapshot copy was held by seat {buddy_seat}, which no longer has one "
                    "(its member changed or lost it): no copy of its state survives in memory"
                )
            source = f"buddy seat {buddy_seat}"
        else:
            report = reports.get(member)
            held = set(report.local_steps) if report else set()
            source = f"seat {seat} (local)"
        candidates = held if candidates is None else candidates & held
        if not candidates:
            return None, f"no snapshot step common to every seat (ran out at {source})"
    if not candidates:
        return None, "no seats"
    best = max(candidates)
    return best, f"step {best} is the newest held by every seat"


def next_view(
    view: View,
    epoch: int,
    replacements: Mapping[int, str],
    spares: Sequence[str],
    resume: int,
    hosts: Mapping[str, str],
    bulk_addrs: Mapping[str, str],
    rebuild: bool,
) -> View:
    """The view after a change: replacements seated, spares updated, buddies re-placed."""
    seats = [replacements.get(seat, member) for seat, member in enumerate(view.seats)]
    members = set(seats) | set(spares)
    buddies, _ = place_buddies(seats, hosts)
    restore_from = {seat: view.buddy_member(seat) for seat in replacements} if rebuild else {}
    return View(
        epoch=epoch,
        seats=seats,
        spares=list(spares),
        resume_step=resume if rebuild else view.resume_step,
        store_prefix=f"epoch-{epoch}" if rebuild else view.store_prefix,
        store_addr=view.store_addr,
        bulk_addrs={m: a for m, a in bulk_addrs.items() if m in members},
        hosts={m: h for m, h in hosts.items() if m in members},
        buddies=buddies,
        restore_from=restore_from,
    )


def first_view(
    seat_members: Mapping[int, str],
    world_size: int,
    spares: Sequence[str],
    store_addr: str,
    hosts: Mapping[str, str],
    bulk_addrs: Mapping[str, str],
) -> tuple[View | None, str]:
    """The initial view, once every seat has a member; None (and what is missing) before that."""
    missing = [seat for seat in range(world_size) if seat not in seat_members]
    if missing:
        return None, f"waiting for seats {missing}"
    seats = [seat_members[seat] for seat in range(world_size)]
    members = set(seats) | set(spares)
    buddies, reason = place_buddies(seats, hosts)
    view = View(
        epoch=1,
        seats=seats,
        spares=list(spares),
        resume_step=-1,
        store_prefix="epoch-1",
        store_addr=store_addr,
        bulk_addrs={m: a for m, a in bulk_addrs.items() if m in members},
        hosts={m: h for m, h in hosts.items() if m in members},
        buddies=buddies,
        restore_from={},
    )
    return view, f"all {world_size} seats joined; {reason}"
