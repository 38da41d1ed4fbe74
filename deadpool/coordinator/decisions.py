"""The coordinator's decisions, as pure functions of (now, state, config).

Each returns its decision and a human-readable reason, so the event log says
*why*; each is tested without sockets or clocks (``tests/unit/test_decisions.py``)
and reused unchanged by the simulator.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from deadpool.events.vocabulary import Raised as Raised
from deadpool.events.vocabulary import Trigger as Trigger
from deadpool.protocol.messages import PrepareAck
from deadpool.protocol.transport import address_host
from deadpool.protocol.view import DISK_SOURCE as DISK  # restore_from value: read the seat's state from disk
from deadpool.protocol.view import (
    FIRST_EPOCH,
    INITIAL_STEP,
    View,
    crosses_at,
    crossing_offset,
    hosts_by_seat,
    place_buddies,
)

MAX_BLIND_REBUILDS = 3  # rebuilds that fix nothing, in a row, before the job is failed with a reason


class Suspicion(enum.StrEnum):
    """What to do about a collective failure that names nobody dead (`unexplained_failure`)."""

    WAIT = "wait"  # within the grace: a member may yet be found dead
    REBUILD = "rebuild"  # rebuild the group with the same members
    FAIL = "fail"  # rebuilds keep fixing nothing: fail the job with the likely cause


class NoSpare(enum.StrEnum):
    """What to do when a lost seat finds no spare (`no_spare`)."""

    WAIT = "wait"  # no_spare_policy "wait": a spare may still join (``deadpool launch --nproc 0 --spares 1``)
    STOP = "stop"  # fail the job




@dataclass(frozen=True, slots=True)
class RaisedError:
    """One exception a member reported (a ``UserException``), as the coordinator remembers it."""

    member: str  # who raised it
    seat: int  # its seat then (-1: a spare)
    step: int  # the step in progress (-1: before the first step)
    kind: str  # the exception's type name


def silent_members(now: float, last_seen: Mapping[str, float], failure_timeout: float) -> list[tuple[str, str]]:
    """Members whose last heartbeat is older than `failure_timeout`, with the reason."""
    return [
        (member, f"no heartbeat for {now - seen:.2f}s (failure_timeout {failure_timeout:.2f}s)")
        for member, seen in sorted(last_seen.items())
        if now - seen > failure_timeout
    ]


def order_spares(
    spares: Sequence[str], last_seen: Mapping[str, float], fenced: Container[str]
) -> tuple[list[str], str]:
    """The pool `pick_spares` chooses from: fenced spares left out, the freshest heartbeat first.

    A spare that died silently (not yet detected) is then the last one chosen;
    equals keep their order (join order).  Spares never heard from come last.
    """
    pool = sorted((s for s in spares if s not in fenced), key=lambda s: -last_seen.get(s, 0.0))
    return pool, f"{len(pool)} spare(s) in the pool, freshest heartbeat first"


def pick_spares(
    failed_seats: Sequence[int], view: View, spares: Sequence[str], hosts: Mapping[str, str],
    kept: Mapping[int, str] | None = None,
) -> tuple[dict[int, str] | None, str]:
    """Choose a spare for every failed seat, or None when there are too few.

    `kept`: seats whose spare an earlier Prepare of the same swap already chose: they keep it
    (that spare may be wrapping its model for the seat) while it stands in `spares`, unless
    its host lost a seat and a spare elsewhere is left, or keeping it leaves no buddy
    placement with every copy on another host where choosing afresh has one (the copies'
    failure domains come first; a moved spare of a mesh job fences itself, and the swap
    chooses again).

    Spares on a host that just lost a seat come last: when a whole host goes,
    its members' heartbeats expire one tick apart, and its spare, not yet
    declared dead, would otherwise be seated and lost again within the swap.
    Next, a spare on another host than the failed seat's buddy is preferred,
    so the new member and the copy of its neighbour's state do not share a
    failure domain.  Ties go to the spare that joined first.
    """
    if len(spares) < len(failed_seats):
        return None, f"{len(failed_seats)} seat(s) lost but only {len(spares)} spare(s) left"
    failed_hosts = {hosts.get(view.seats[seat], "") for seat in failed_seats} - {""}
    elsewhere = any(hosts.get(spare, "") not in failed_hosts for spare in spares)
    failed, pool = set(failed_seats), set(spares)
    held = {seat: spare for seat, spare in (kept or {}).items() if seat in failed and spare in pool
            and not (elsewhere and hosts.get(spare, "") in failed_hosts)}
    chosen = _fill(failed_seats, view, spares, hosts, failed_hosts, held)
    if held:
        fresh = _fill(failed_seats, view, spares, hosts, failed_hosts, {})
        if fresh != chosen and not _copies_cross_hosts(view, chosen, hosts) and _copies_cross_hosts(view, fresh, hosts):
            chosen = fresh
    reason = ", ".join(f"seat {seat} <- {spare}" for seat, spare in sorted(chosen.items()))
    return chosen, reason


def _copies_cross_hosts(view: View, pick: Mapping[int, str], hosts: Mapping[str, str]) -> bool:
    """With `pick` seated, some buddy placement keeps every copy on another host than its seat.

    First the view's own ring offset, checked at the picked seats only (O(picked)) when the view
    crosses hosts with it (checked once per view); else every offset (O(seats) each).
    """
    world = len(view.seats)
    offset = (view.buddies[0] if world > 1 else 0) % max(world, 1)
    if offset and _crosses(view, hosts, offset):
        def host(seat: int) -> str:
            return hosts.get(pick.get(seat, view.seats[seat]), "")
        if all(host(s) != host((s + offset) % world) and host((s - offset) % world) != host(s) for s in pick):
            return True
    return crossing_offset([pick.get(seat, member) for seat, member in enumerate(view.seats)], hosts) is not None


_CROSSING: list[tuple[View, int, bool]] = []  # the last view checked: a pure memo (views never change)


def _crosses(view: View, hosts: Mapping[str, str], offset: int) -> bool:
    """Every seat of `view` has its copy on another host at ring `offset`."""
    if not _CROSSING or _CROSSING[0][0] is not view or _CROSSING[0][1] != offset:
        _CROSSING[:] = [(view, offset, crosses_at(hosts_by_seat(view.seats, hosts), offset))]
    return _CROSSING[0][2]


def _fill(failed_seats: Sequence[int], view: View, spares: Sequence[str], hosts: Mapping[str, str],
          failed_hosts: set[str], held: Mapping[int, str]) -> dict[int, str]:
    """`held`, and a spare for every other failed seat: away from failed hosts, then from the seat's buddy's host."""
    chosen, taken = dict(held), set(held.values())
    available = [spare for spare in spares if spare not in taken]
    for seat in sorted(set(failed_seats) - set(chosen)):
        buddy_host = hosts.get(view.buddy_member(seat), "")
        # The first of the best (join order within a preference class); stops at the first of the best class,
        # so a swap costs O(failed) with a large pool instead of O(failed x spares).
        spare, best = available[0], (True, True, True)
        for candidate in available:
            host = hosts.get(candidate, "")
            rank = (host in failed_hosts, host == buddy_host, False)
            if rank < best:
                spare, best = candidate, rank
                if rank == (False, False, False):
                    break
        available.remove(spare)
        chosen[seat] = spare
    return chosen


def plan_restore(
    view: View, failed_seats: Sequence[int], reports: Mapping[str, PrepareAck], limit: int | None = None,
) -> tuple[int | None, dict[int, str], str]:
    """The newest step every seat can restore from memory, and where each seat gets it.

    A survivor restores from its own snapshots; a failed seat, or a survivor that
    holds nothing yet (a spare whose adoption was interrupted by this failure),
    restores from the copy its buddy keeps, or one another surviving seat still
    keeps (its buddy in an earlier view).  The initial state (step -1, before the
    first step) is one more step a failed seat can always restore: its replacement
    builds it as the script does (a survivor that has not begun a step reports it
    among its own).  So a failure before every first snapshot is confirmed resumes
    from the start.  Returns the step (None when there is none, with the reason
    naming the seat), the seats that must fetch from a buddy (seat -> member), and
    the reason.

    O(seats) with a small constant (a commit at 131,072 members): a survivor whose own snapshots hold
    every step still in question costs one comparison; only the others' holdings are listed.
    """
    failed = set(failed_seats)
    seats, buddies = view.seats, view.buddies
    world = len(seats)
    answered: list[PrepareAck | None] = list(map(reports.get, seats))  # looked up in C; the failed answer nothing
    for seat in failed:
        if 0 <= seat < world:
            answered[seat] = None
    # Copies held by a surviving seat other than the buddy: the buddy of an earlier view, kept for a seat whose
    # replacement was still restoring from it (WardCopies.on_view) when this round began.
    others: dict[int, dict[int, str]] = {}
    for seat, report in enumerate(answered):
        for ward, steps in report.ward_steps.items() if report is not None and report.ward_steps else ():
            if 0 <= ward < world and ward != seat and buddies[ward] != seat:
                others.setdefault(ward, {}).update(dict.fromkeys(steps, seats[seat]))
    common: set[int] | None = None  # the steps every seat so far holds
    fetched: dict[int, dict[int, str | None]] = {}  # seat -> step -> source, for seats not covered locally
    covering: Sequence[int] = ()  # a survivor's own list of steps known to hold all of `common`
    unheld: tuple[int, int] | None = None  # the first failed seat with no copy anywhere, and its buddy seat
    for seat, report in enumerate(answered):
        if report is not None and report.local_steps and common is not None:
            local = report.local_steps
            if local == covering or common.issubset(local):
                covering = local
                continue  # its own snapshots hold every step in question: local beats a copy
        held: dict[int, str | None] = dict(others.get(seat, {}))
        buddy_seat = buddies[seat]
        buddy_report = answered[buddy_seat] if buddy_seat != seat else None
        for step in buddy_report.ward_steps.get(seat, ()) if buddy_report is not None else ():
            held[step] = seats[buddy_seat]  # the buddy's copy first
        for step in report.local_steps if report is not None else ():
            held[step] = None  # local beats a copy
        if seat in failed:
            if not held and unheld is None:
                unheld = (seat, buddy_seat)  # named if the job cannot resume from the start either
            held.setdefault(INITIAL_STEP, None)  # the replacement builds the initial state itself
        if not held:
            return None, {}, _nothing_held(seat, buddy_seat, failed)
        fetched[seat] = held
        common = set(held) if common is None else common.intersection(held)
    if common and limit is not None and not (common := {step for step in common if step <= limit}):
        return None, {}, (f"no snapshot at or before step {limit}, the newest step whose checks passed on every "
                          "seat, is held for every seat any more: the corruption was found too late to roll back "
                          "in memory")
    if not common:
        if unheld is not None:
            return None, {}, _nothing_held(*unheld, failed)
        holdings = [set(fetched[seat]) if seat in fetched else set(report.local_steps if report else ())
                    for seat, report in enumerate(answered)]
        return None, {}, _no_common_step(holdings, buddies, failed)
    best = max(common)
    sources = {seat: source for seat, held in fetched.items() if (source := held[best]) is not None}
    return best, sources, f"step {best} is the newest held by every seat"


def _no_common_step(holdings: Sequence[set[int]], buddies: Sequence[int], failed: set[int]) -> str:
    """Why no step is held for every seat: the step held for the most seats (the newest of those), and
    the seats it is missing for, with where their copy was."""
    counts: dict[int, int] = {}
    for held in holdings:
        for step in held:
            counts[step] = counts.get(step, 0) + 1
    best = max(counts, key=lambda step: (counts[step], step))
    short = [seat for seat, held in enumerate(holdings) if best not in held]
    reason = f"no snapshot step common to every seat: step {best} is held for every seat but seat(s) {short}"
    seat = short[0]
    buddy_seat = buddies[seat]
    if buddy_seat in failed and buddy_seat != seat:
        reason += (f"; seat {seat}'s copy of it was on seat {buddy_seat}, which was lost: "
                   f"no copy of its state survives in memory at step {best}")
    else:
        reason += f"; seat {seat}'s state survives in memory at steps {sorted(holdings[seat])} only"
    return reason


def _nothing_held(seat: int, buddy_seat: int, failed: set[int]) -> str:
    """Why `seat` can restore nothing from memory."""
    if seat in failed and (buddy_seat in failed or buddy_seat == seat):
        return (f"seat {seat} and the seat holding its snapshot copy (seat {buddy_seat}) were both lost: "
                "no copy of its state survives in memory")
    if seat in failed:
        return (f"seat {seat}'s snapshot copy was held by seat {buddy_seat}, which no longer has one "
                "(its member changed or lost it): no copy of its state survives in memory")
    if buddy_seat in failed:  # a replacement that had not restored yet: its state was only in the copy
        return (f"seat {seat}'s member holds no snapshot yet (it was still taking the seat) and the seat "
                f"holding its snapshot copy (seat {buddy_seat}) was lost: no copy of its state survives "
                "in memory")
    return f"seat {seat} holds no snapshot and seat {buddy_seat} no copy of it"


def check_moves(
    view: View, seats: Sequence[int], host: str, spare: str, hosts: Mapping[str, str], moving: Container[int],
    reserved: Container[str], round_running: bool, drained: Container[str],
) -> tuple[dict[int, str], str, int]:
    """The spare each of `seats` moves to (a planned move, or a drain of `host`), or why not.

    Returns (moves, reason, spares missing); moves is empty when the request is refused. A spare is free when
    no other move reserved it and its host is not drained (nor the host being drained). A seat moves to a
    spare on another host than its own where one is free, so a drain never seats a spare it is emptying.
    """
    world = view.world_size
    known = sorted({hosts.get(member, "") for member in (*view.seats, *view.spares)} - {""})
    if host and host not in known:
        return {}, f"no host {host!r} in the job (hosts: {', '.join(known)})", 0
    if host and host in drained:
        return {}, f"host {host} is drained already", 0
    if host and not seats:
        return {}, f"host {host} holds no seat: nothing to move", 0
    if host and len(seats) == world:
        return {}, f"host {host} holds every seat of the job: draining it would leave none", 0
    bad = [seat for seat in seats if not 0 <= seat < world]
    if bad:
        return {}, f"no rank {bad[0]} in the job (ranks 0..{world - 1})", 0
    busy = sorted(seat for seat in seats if seat in moving)
    if busy:
        return {}, f"rank {busy[0]} is already moving", 0
    pool = [s for s in view.spares if s not in reserved and hosts.get(s, "") not in drained
            and not (host and hosts.get(s, "") == host)]
    if spare:
        if spare not in pool:
            return {}, f"spare {spare} is not free in the pool (free: {', '.join(pool) or 'none'})", 0
        pool = [spare]
    if round_running:
        return {}, "a view change is in progress: ask again once it has committed", 0
    if len(pool) < len(seats):
        missing = len(seats) - len(pool)
        where = f" on hosts other than {host}" if host else ""
        return {}, (f"{len(seats)} seat(s) to move but {len(pool)} free spare(s){where}: {missing} spare(s) missing"), \
            missing
    chosen: dict[int, str] = {}
    for seat in seats:
        own = hosts.get(view.seats[seat], "")
        pick = next((s for s in pool if hosts.get(s, "") != own), pool[0])
        pool.remove(pick)
        chosen[seat] = pick
    return chosen, ", ".join(f"rank {seat} moves to {spare}" for seat, spare in sorted(chosen.items())), 0


def replica_verdict(digests: Mapping[int, int]) -> tuple[list[int] | None, str]:
    """Which seats' checksums of the replicated state disagree with the majority's (seat -> checksum, one step).

    Returns ([], why) when every seat agrees, (the minority seats, why) when more than half agree on one value,
    and (None, why) when no value has a majority (two seats disagreeing, or a split): then nobody can be named.
    """
    counts: dict[int, int] = {}
    for digest in digests.values():
        counts[digest] = counts.get(digest, 0) + 1
    if len(counts) <= 1:
        return [], f"{len(digests)} replicas agree"
    best = max(counts, key=counts.__getitem__)
    minority = sorted(seat for seat, digest in digests.items() if digest != best)
    if counts[best] * 2 <= len(digests):
        return None, (f"no majority among {len(digests)} replicas ({len(counts)} different checksums, the most "
                      f"common held by {counts[best]}): the corrupt seat cannot be named")
    return minority, (f"seat(s) {minority} disagree with the {counts[best]} other seat(s), which agree with each "
                      "other")


def slowness(computes: Mapping[int, float]) -> dict[int, float]:
    """Each seat's compute time (its step less its waits in collectives) over the median of the job's seats.

    1.0 is a typical seat; a seat that computes three times as long as the median scores 3.0. The others wait
    for it in every synchronous step, so its wait is the smallest and its compute time stands out. Seats that
    reported none yet are left out, and so is every seat while fewer than two reported.
    """
    known = {seat: value for seat, value in computes.items() if value > 0}
    if len(known) < 2:
        return {}
    middle = sorted(known.values())[(len(known) - 1) // 2]  # the lower median: a slow half cannot hide itself
    return {seat: round(value / middle, 3) for seat, value in known.items()}


def slow_move(score: float, compute_s: float, steps_left: int | None, move_cost_s: float, free_spares: int,
              reserve: int) -> tuple[bool, str]:
    """Whether moving a seat that computes `score` times the median pays, and why (or why not).

    The job's step waits for its slowest seat, so the seat costs about (score - 1) x the median compute time
    (`compute_s` / score) every step; over the `steps_left` (None: unknown, taken as 100) that is weighed
    against one move (`move_cost_s`). A move for slowness keeps `reserve` spares free for failures.
    """
    if free_spares <= reserve:
        return False, f"{free_spares} free spare(s), {reserve} kept for failures (--slow-reserve)"
    horizon = 100 if steps_left is None else max(0, steps_left)
    gain = (score - 1) * (compute_s / score) * horizon
    if gain <= move_cost_s:
        return False, (f"it costs about {gain:.2f} s over the {horizon} step(s) left, less than a move "
                       f"({move_cost_s:.2f} s)")
    return True, f"it costs about {gain:.2f} s over the {horizon} step(s) left; a move costs {move_cost_s:.2f} s"


def unanswered_prepare(
    now: float, deadline: float, survivors: Sequence[str], acked: Container[str], epoch: int,
    prepare_timeout: float,
) -> list[tuple[str, str]]:
    """Survivors that have not answered Prepare(`epoch`) by its deadline, with the reason."""
    if now <= deadline:
        return []
    why = f"no answer to Prepare({epoch}) within {prepare_timeout}s"
    return [(member, why) for member in survivors if member not in acked]


def unexplained_failure(
    now: float, suspect_since: float, failure_timeout: float, rebuilds_in_a_row: int
) -> tuple[Suspicion, str]:
    """A collective failed and nobody is dead yet: wait a short grace, then rebuild, or give up.

    The grace (half the failure timeout, at most a second) lets a death that
    caused the failure be detected first.  A rebuild that no finished step
    follows counts as one in a row; after `MAX_BLIND_REBUILDS` of them the ranks
    evidently cannot reach each other, and the job fails naming the likely cause.
    """
    if now - suspect_since <= min(1.0, failure_timeout / 2):
        return Suspicion.WAIT, "within the grace for a member to be found dead"
    rebuilds = rebuilds_in_a_row + 1
    if rebuilds > MAX_BLIND_REBUILDS:
        return Suspicion.FAIL, (
            f"collectives failed {rebuilds} times in a row with every member alive and no step "
            "finished in between: the ranks cannot reach each other over the process group's transport "
            "(check --bind-host / the addresses gloo uses, firewalls and the ports between hosts), or a rank's "
            "training thread is held in the script's own code past the collective timeout (its compute_late "
            "event shows where)")
    return Suspicion.REBUILD, "a collective failed but no member was found dead: rebuilding the group"


def no_spare(
    policy: str, now: float, waiting_since: float, spare_wait_timeout: float, lost: str, why: str, world_size: int,
    starting: int = 0,
) -> tuple[NoSpare, str]:
    """A lost seat has no spare: wait for one to join (policy "wait", or spares started but not joined yet,
    within the timeout), or stop.

    `lost` names the seats ("rank 3 (member)"), `why` is `pick_spares`' refusal,
    `waiting_since` is when the wait began (`now` on the first refusal), and `starting` counts
    the processes the hosts' launchers started that have neither joined nor exited (a spare still
    importing its script when a seat fails early): under either policy the seat waits for them.
    """
    cannot = (f"The other ranks' state is intact in memory but the job cannot continue at world size {world_size}. "
              "Relaunch with more --spares (with --checkpoint-dir, add --resume to go on from its newest checkpoint).")
    if starting and now - waiting_since <= spare_wait_timeout:
        return NoSpare.WAIT, (
            f"{lost} failed and no spare has joined yet ({why}): waiting up to {spare_wait_timeout:g}s for the "
            f"{starting} process(es) the launchers started that have not joined yet")
    if starting:
        return NoSpare.STOP, (
            f"{lost} failed and the {starting} process(es) the launchers started did not join within "
            f"{spare_wait_timeout:g}s to take the seat ({why}). {cannot}")
    if policy == "wait" and now - waiting_since <= spare_wait_timeout:
        return NoSpare.WAIT, (
            f"{lost} failed and no spare is left to take the seat ({why}): waiting up to "
            f"{spare_wait_timeout:g}s for a spare to join (no_spare_policy=wait; add one with "
            "`deadpool launch --nproc 0 --spares 1 --coordinator ADDRESS`)")
    if policy == "wait":
        return NoSpare.STOP, (
            f"{lost} failed and no spare joined within {spare_wait_timeout:g}s to take the seat "
            f"(no_spare_policy=wait; {why}). {cannot}")
    return NoSpare.STOP, f"{lost} failed and no spare is left to take the seat ({why}). {cannot}"


def user_exception(earlier: Sequence[RaisedError], new: RaisedError) -> tuple[Raised, str]:
    """Swap the member once, or stop the job: the rule for an exception raised by the training script.

    An exception of the same type at the same step, raised earlier by another process of this
    job (typically the member the reporter replaced, replaying the step from the same restored
    state), is the script's own deterministic error: another swap would raise it again and burn
    every spare, so the job stops.  Anything else (the first exception, another type, another
    step) may be a machine's fault surfacing as a Python error (a CUDA ECC error, a bad read):
    the member is replaced, as for a crash.  The message is not compared: it may carry a value
    that differs between processes (an address, a pid).
    """
    where = f"rank {new.seat}" if new.seat >= 0 else "a spare"
    at = f"step {new.step}" if new.step >= 0 else "start-up (before the first step)"
    for before in earlier:
        if before.member != new.member and before.kind == new.kind and before.step == new.step:
            was = f"rank {before.seat}" if before.seat >= 0 else "a spare"
            return Raised.STOP, (
                f"{new.member} ({where}) raised {new.kind} at {at}, as {before.member} ({was}) did before it: "
                "the same exception at the same step in another process is the training script's own error, "
                "and another swap would raise it again")
    return Raised.SWAP, (
        f"{new.member} ({where}) raised {new.kind} at {at}: the first such report counts as a failure of the "
        "member (a hardware fault can surface as a Python exception) and it is replaced once")


def disk_resume_step(reports: Mapping[str, PrepareAck]) -> int | None:
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
    dirty_groups: Sequence[str] = (),
    changed: Collection[str] | None = None,
) -> View:
    """The view after a change: replacements seated, spares updated, buddies re-placed.

    Seats in `sources` (default: the replaced seats) fetch from the named member; with
    `from_disk`, every seat restores from the disk checkpoint (``restore_from`` = DISK).
    `dirty_groups` (mesh groups some survivor did not finish a collective on) are rebuilt.
    The new view's `hosts` and `bulk_addrs` are those of its members; given `changed` (the
    members whose entries may differ from `view`'s), they are `view`'s, patched where members
    came, left or changed, instead of looked up member by member (131,072 of them).
    """
    seats = list(view.seats)
    for seat, member in replacements.items():
        seats[seat] = member
    members = [*seats, *spares]
    if changed is None:
        bulk, host = _entries_of(bulk_addrs, members), _entries_of(hosts, members)
    else:
        left, came = _moves(view, replacements, spares, members, changed)
        bulk, host = _patched(view.bulk_addrs, bulk_addrs, left, came), _patched(view.hosts, hosts, left, came)
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
        bulk_addrs=bulk,
        hosts=host,
        buddies=buddies,
        restore_from=restore_from,
        rebuild_groups=sorted(set(dirty_groups)) if rebuild else [],
    )


def _moves(view: View, replacements: Mapping[int, str], spares: Sequence[str], members: list[str],
           changed: Collection[str]) -> tuple[list[str], list[str]]:
    """Members of `view` the next one no longer holds, and members whose entries it takes anew (new ones and
    `changed` ones). A member can enter or leave only through a replaced seat or the spares: O(spares)."""
    gone = {view.seats[seat] for seat in replacements}.union(view.spares)
    kept = set(spares).union(replacements.values())
    came = [m for m in [*replacements.values(), *spares] if m not in gone]
    if changed:
        now_in = set(members)
        came += [m for m in changed if m in now_in]
    return [m for m in gone if m not in kept], came


def _patched(before: Mapping[str, str], entries: Mapping[str, str], left: list[str], came: list[str]) -> dict[str, str]:
    """`before` without the members that `left`, with `entries`' value (or none) for each one that `came`."""
    after = dict(before)
    for member in left:
        after.pop(member, None)
    for member in came:
        value = entries.get(member)
        if value is None:
            after.pop(member, None)
        else:
            after[member] = value
    return after


def _entries_of(entries: Mapping[str, str], members: list[str]) -> dict[str, str]:
    """`entries` of `members` only, in their order (one without an entry is left out): lookups in C."""
    values = list(map(entries.get, members))
    if None not in values:
        return dict(zip(members, cast(list[str], values), strict=True))
    return {member: value for member, value in zip(members, values, strict=True) if value is not None}


def first_resume(resume: bool, disk_steps: Sequence[Sequence[int]]) -> tuple[int | None, str]:
    """The step the first view resumes from: -1 (the initial state), or with `resume` the newest disk checkpoint
    every seat reported (`disk_steps`, one list per seat); None, with the reason, when the job cannot start:
    nothing to resume from, or checkpoints of an earlier run that a run from step 0 would mix with its own (a
    rollback to disk could then restore the earlier run's state)."""
    common = set(disk_steps[0]).intersection(*disk_steps[1:]) if disk_steps else set()
    newest = max(common, default=None)
    if resume and newest is None:
        return None, ("--resume: no disk checkpoint under --checkpoint-dir is complete for every seat of this "
                      "world (a run with --checkpoint-dir DIR --checkpoint-every N writes them); relaunch "
                      "without --resume to start from step 0")
    if resume:
        return newest, f"resuming from the disk checkpoint of step {newest}"
    if newest is not None:
        return None, (f"--checkpoint-dir holds a complete disk checkpoint of step {newest} from an earlier run: "
                      "relaunch with --resume to go on from it, or with another (or an emptied) --checkpoint-dir "
                      "to start from step 0")
    return -1, ""


def first_view(
    seat_members: Mapping[int, str],
    world_size: int,
    spares: Sequence[str],
    store_addr: str,
    hosts: Mapping[str, str],
    bulk_addrs: Mapping[str, str],
    resume_step: int = -1,
) -> tuple[View | None, str]:
    """The initial view, once every seat has a member; None (and what is missing) before that.

    From a `resume_step` of 0 or more (``--resume``) every seat restores that step's disk checkpoint.
    """
    missing = [seat for seat in range(world_size) if seat not in seat_members]
    if missing:
        return None, f"waiting for seats {missing}"
    seats = [seat_members[seat] for seat in range(world_size)]
    members = [*seats, *spares]
    buddies, reason = place_buddies(seats, hosts)
    view = View(
        epoch=FIRST_EPOCH,
        seats=seats,
        spares=list(spares),
        resume_step=resume_step,
        store_prefix=f"epoch-{FIRST_EPOCH}",
        store_addr=store_addr,
        bulk_addrs=_entries_of(bulk_addrs, members),
        hosts=_entries_of(hosts, members),
        buddies=buddies,
        restore_from=dict.fromkeys(range(world_size), DISK) if resume_step >= 0 else {},
    )
    return view, f"all {world_size} seats joined; {reason}"


def majority(hosts: int) -> int:
    """Hosts needed for a majority of the job's `hosts` (any two majorities share a host)."""
    return hosts // 2 + 1


def holds_lease(now: float, agents_seen: Mapping[str, float], hosts: int, window: float) -> tuple[bool, str]:
    """May an active coordinator that has a standby commit a view now? Only while it hears most hosts.

    A standby takes over only when a majority of the hosts' agents no longer hear the
    active; a coordinator that is cut off with a minority (its own host) therefore
    cannot commit a view while the other side's new term does: the two majorities
    would have to share a host that both hears and does not hear it.
    """
    heard = sum(1 for seen in agents_seen.values() if now - seen <= window)
    need = majority(hosts)
    if heard >= need:
        return True, f"{heard} of {hosts} hosts heard within {window:.1f}s"
    return False, f"only {heard} of {hosts} hosts heard within {window:.1f}s (a majority is {need})"


def takeover(silent_s: float, bound: float, reports: Mapping[str, float], hosts: int) -> tuple[bool, str]:
    """Should the standby take over? The active has been silent for `bound` AND most hosts confirm it.

    `reports`: agent -> seconds since the active coordinator last answered that agent.  An
    agent confirms when it, too, has not heard the active for `bound`/2 (agents hear it at least
    once a second); one that still hears it, or does not answer, does not confirm.  A cut between
    the standby and the active alone is thus no reason to take over.
    """
    if silent_s < bound:
        return False, f"the active coordinator is silent for {silent_s:.1f}s, under the bound of {bound:.1f}s"
    confirmed = sorted(agent for agent, silent in reports.items() if silent >= bound / 2)
    need = majority(hosts)
    if len(confirmed) < need:
        return False, (f"the active coordinator is silent for {silent_s:.1f}s here, but only {len(confirmed)} of "
                       f"{hosts} hosts confirm it ({need} needed): not taking over")
    return True, (f"the active coordinator is silent for {silent_s:.1f}s and {len(confirmed)} of {hosts} hosts "
                  f"confirm it: taking over")


def standby_host(lost: str, active: str, agents: Mapping[str, str]) -> str | None:
    """The agent asked to start a new standby: one on a host other than the active's and the lost standby's.

    Hosts are told apart by the address part of their control addresses (an agent listens on its
    host's address, as the coordinators do).  The lowest agent id wins, so repeated losses spread
    no further than needed; None when no such host is left.
    """
    taken = {address_host(lost), address_host(active)}
    free = sorted(agent for agent, addr in agents.items() if address_host(addr) not in taken)
    return free[0] if free else None
