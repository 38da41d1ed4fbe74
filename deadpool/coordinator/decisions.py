"""The coordinator's decisions, as pure functions of (now, state, config).

Each returns its decision and a human-readable reason, so the event log says
*why*, and each is tested without sockets or clocks (``tests/test_decisions.py``)
and reused unchanged by the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deadpool.protocol.view import View, place_buddies

DISK = "@disk"  # restore_from value: read the seat's state from the disk checkpoint


@dataclass(frozen=True, slots=True)
class Snapshots:
    """What one survivor reported in its PrepareAck."""

    local_steps: Sequence[int]  # complete local snapshots
    ward_steps: Mapping[int, Sequence[int]]  # seat -> complete buddy copies held
    disk_steps: Sequence[int] = ()  # steps with complete disk checkpoints of every seat


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

    Spares on a host that just lost a seat come last: when a whole host goes,
    its members' heartbeats expire one tick apart, and its spare, not yet
    declared dead, would otherwise be seated and lost again within the swap.
    Next, a spare on another host than the failed seat's buddy is preferred,
    so the new member and the copy of its neighbour's state do not share a
    failure domain.  Ties go to the spare that joined first.
    """
    if len(spares) < len(failed_seats):
        return None, f"{len(failed_seats)} seat(s) lost but only {len(spares)} spare(s) left"
    available = list(spares)
    failed_hosts = {hosts.get(view.seats[seat], "") for seat in failed_seats} - {""}
    chosen: dict[int, str] = {}
    for seat in sorted(failed_seats):
        buddy_host = hosts.get(view.buddy_member(seat), "")
        # min() keeps the first of equals: join order within a preference class.
        spare = min(available, key=lambda s: (hosts.get(s, "") in failed_hosts, hosts.get(s, "") == buddy_host))
        available.remove(spare)
        chosen[seat] = spare
    reason = ", ".join(f"seat {seat} <- {spare}" for seat, spare in sorted(chosen.items()))
    return chosen, reason


def plan_restore(
    view: View, failed_seats: Sequence[int], reports: Mapping[str, Snapshots]
) -> tuple[int | None, dict[int, str], str]:
    """The newest step every seat can restore from memory, and where each seat gets it.

    A survivor restores from its own snapshots; a failed seat, or a survivor that
    holds nothing yet (a spare whose adoption was interrupted by this failure),
    restores from the copy its buddy keeps.  Returns the step (None when there is
    none, with the reason naming the seat), the seats that must fetch from a
    buddy (seat -> member), and the reason.
    """
    failed = set(failed_seats)
    per_seat: list[dict[int, str | None]] = []
    for seat, member in enumerate(view.seats):
        held: dict[int, str | None] = {}
        buddy_seat = view.buddies[seat]
        if buddy_seat not in failed and buddy_seat != seat:
            buddy_report = reports.get(view.seats[buddy_seat])
            for step in buddy_report.ward_steps.get(seat, ()) if buddy_report else ():
                held[step] = view.seats[buddy_seat]
        report = reports.get(member) if seat not in failed else None
        for step in report.local_steps if report else ():
            held[step] = None  # local beats a copy
        if not held:
            if seat in failed and (buddy_seat in failed or buddy_seat == seat):
                why = (f"seat {seat} and the seat holding its snapshot copy (seat {buddy_seat}) were both lost: "
                       "no copy of its state survives in memory")
            elif seat in failed:
                why = (f"seat {seat}'s snapshot copy was held by seat {buddy_seat}, which no longer has one "
                       "(its member changed or lost it): no copy of its state survives in memory")
            else:
                why = f"seat {seat} holds no snapshot and seat {buddy_seat} no copy of it"
            return None, {}, why
        per_seat.append(held)
    common = set(per_seat[0]).intersection(*per_seat[1:]) if per_seat else set()
    if not common:
        return None, {}, "no snapshot step common to every seat"
    best = max(common)
    sources = {seat: source for seat, held in enumerate(per_seat) if (source := held[best]) is not None}
    return best, sources, f"step {best} is the newest held by every seat"


def resume_step(
    view: View, failed_seats: Sequence[int], reports: Mapping[str, Snapshots]
) -> tuple[int | None, str]:
    """The newest step every seat can restore (see `plan_restore`), with the reason."""
    step, _, reason = plan_restore(view, failed_seats, reports)
    return step, reason


def disk_resume_step(reports: Mapping[str, Snapshots]) -> int | None:
    """The newest step with a complete disk checkpoint of every seat, as every survivor sees it."""
    common: set[int] | None = None
    for report in reports.values():
        steps = set(report.disk_steps)
        common = steps if common is None else common & steps
    return max(common) if common else None


def next_view(
    view: View,
    epoch: int,
    replacements: Mapping[int, str],
    spares: Sequence[str],
    resume: int,
    hosts: Mapping[str, str],
    bulk_addrs: Mapping[str, str],
    rebuild: bool,
    from_disk: bool = False,
    sources: Mapping[int, str] | None = None,
) -> View:
    """The view after a change: replacements seated, spares updated, buddies re-placed.

    Seats in `sources` (default: the replaced seats) fetch from the named member; with
    `from_disk`, every seat restores from the disk checkpoint (``restore_from`` = DISK).
    """
    seats = [replacements.get(seat, member) for seat, member in enumerate(view.seats)]
    members = set(seats) | set(spares)
    buddies, _ = place_buddies(seats, hosts)
    if sources is None:
        sources = {seat: view.buddy_member(seat) for seat in replacements}
    # A view that only changes the spare pool (a spare joined or was lost) keeps the pending restores:
    # a swap's spares may still be fetching from the sources named by the view it builds on, and every
    # member's SnapshotActor keeps ward copies only for its wards and for seats in `restore_from`.
    restore_from = dict(sources) if rebuild else dict(view.restore_from)
    if from_disk:
        restore_from = {seat: DISK for seat in range(len(seats))}
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
