"""View: who sits where, and where each seat's snapshot copy lives (deadpool/protocol/view.py).

Pure logic: the seat and buddy helpers of a `View`, and `place_buddies`, checked on named
layouts and, exhaustively, against its specification on every small host assignment.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from deadpool.protocol.view import View, place_buddies


def make_view(seats: list[str], spares: list[str] | None = None, buddies: list[int] | None = None) -> View:
    return View(
        epoch=3,
        seats=seats,
        spares=spares or [],
        resume_step=41,
        store_prefix="pg3",
        store_addr="127.0.0.1:29500",
        bulk_addrs={m: f"tcp://127.0.0.1:{6000 + i}" for i, m in enumerate(seats)},
        hosts={m: "h0" for m in seats},
        buddies=buddies if buddies is not None else [(s + 1) % len(seats) for s in range(len(seats))],
        restore_from={},
    )


# --- the View helpers --------------------------------------------------------------------------


def test_world_size_counts_seats_not_spares() -> None:
    assert make_view(["a", "b", "c"], spares=["s1", "s2"]).world_size == 3


def test_seat_of_finds_seated_members_only() -> None:
    view = make_view(["a", "b", "c"], spares=["s1"])
    assert [view.seat_of(m) for m in ("a", "b", "c")] == [0, 1, 2]
    assert view.seat_of("s1") is None  # a spare has no seat
    assert view.seat_of("stranger") is None


def test_contains_seats_and_spares_but_not_strangers() -> None:
    view = make_view(["a", "b"], spares=["s1"])
    assert view.contains("a") and view.contains("b") and view.contains("s1")
    assert not view.contains("stranger")
    assert not view.contains("")


def test_buddy_member_follows_the_buddy_seat() -> None:
    view = make_view(["a", "b", "c"], buddies=[2, 0, 1])
    assert [view.buddy_member(s) for s in range(3)] == ["c", "a", "b"]


def test_wards_of_inverts_the_buddy_map() -> None:
    view = make_view(["a", "b", "c", "d"], buddies=[1, 2, 3, 0])
    assert [view.wards_of(s) for s in range(4)] == [[3], [0], [1], [2]]
    # an uneven map: seat 0 keeps two copies, seat 3 none
    uneven = make_view(["a", "b", "c", "d"], buddies=[1, 0, 0, 2])
    assert uneven.wards_of(0) == [1, 2]
    assert uneven.wards_of(1) == [0]
    assert uneven.wards_of(2) == [3]
    assert uneven.wards_of(3) == []


def test_a_lone_seat_is_nobody_s_ward() -> None:
    view = make_view(["a"], buddies=[0])
    assert view.buddy_member(0) == "a"  # its own copy: snapshots are local only
    assert view.wards_of(0) == []  # a seat is never its own ward


def test_view_is_frozen() -> None:
    view = make_view(["a", "b"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.epoch = 4  # type: ignore[misc]
    assert not hasattr(view, "__dict__")  # slotted


# --- place_buddies on named layouts ------------------------------------------------------------


def test_one_seat_has_no_buddy() -> None:
    placement, reason = place_buddies(["a"], {"a": "h0"})
    assert placement == [0]
    assert reason == "one seat: no buddy, snapshots are local only"


def test_one_host_uses_the_next_seat() -> None:
    seats = ["a", "b", "c", "d"]
    placement, reason = place_buddies(seats, dict.fromkeys(seats, "h0"))
    assert placement == [1, 2, 3, 0]
    assert reason == "ring offset 1: one host, copies on the next seat"


def test_two_seats_on_two_hosts_keep_each_other() -> None:
    placement, reason = place_buddies(["a", "b"], {"a": "h0", "b": "h1"})
    assert placement == [1, 0]
    assert reason == "ring offset 1: every copy on another host"


def test_interleaved_hosts_take_offset_one() -> None:
    seats = ["a", "b", "c", "d"]
    placement, reason = place_buddies(seats, {"a": "h0", "b": "h1", "c": "h0", "d": "h1"})
    assert placement == [1, 2, 3, 0]
    assert reason == "ring offset 1: every copy on another host"


def test_blocked_hosts_take_the_smallest_offset_that_crosses() -> None:
    seats = ["a", "b", "c", "d"]  # h0 h0 h1 h1: offset 1 keeps a->b on h0
    placement, reason = place_buddies(seats, {"a": "h0", "b": "h0", "c": "h1", "d": "h1"})
    assert placement == [2, 3, 0, 1]
    assert reason == "ring offset 2: every copy on another host"


def test_three_hosts_of_two_seats_take_offset_two() -> None:
    seats = ["a", "b", "c", "d", "e", "f"]
    hosts = {"a": "h0", "b": "h0", "c": "h1", "d": "h1", "e": "h2", "f": "h2"}
    placement, reason = place_buddies(seats, hosts)
    assert placement == [2, 3, 4, 5, 0, 1]
    assert reason.startswith("ring offset 2:")


def test_hosts_too_uneven_to_cross_fall_back_to_the_next_seat() -> None:
    seats = ["a", "b", "c", "d"]  # three seats on h0: every offset pairs two of them
    placement, reason = place_buddies(seats, {"a": "h0", "b": "h0", "c": "h0", "d": "h1"})
    assert placement == [1, 2, 3, 0]
    assert reason.startswith("ring offset 1:")
    assert "every copy on another host" not in reason


def test_members_without_a_host_share_one_unnamed_host() -> None:
    seats = ["a", "b", "c"]
    placement, _ = place_buddies(seats, {})
    assert placement == [1, 2, 0]
    # one member with a host among hostless ones: a->b would pair two hostless members
    placement, reason = place_buddies(["a", "b"], {"a": "h0"})
    assert placement == [1, 0]
    assert reason == "ring offset 1: every copy on another host"


def test_placement_reads_back_through_the_view() -> None:
    seats = ["a", "b", "c", "d"]
    hosts = {"a": "h0", "b": "h0", "c": "h1", "d": "h1"}
    placement, _ = place_buddies(seats, hosts)
    view = dataclasses.replace(make_view(seats), hosts=hosts, buddies=placement)
    assert [view.buddy_member(s) for s in range(4)] == ["c", "d", "a", "b"]
    assert all(hosts[view.buddy_member(s)] != hosts[seats[s]] for s in range(4))
    assert [view.wards_of(s) for s in range(4)] == [[2], [3], [0], [1]]


# --- place_buddies against its specification, on every small layout --------------------------


def _crosses(host_of: tuple[str, ...], offset: int) -> bool:
    world = len(host_of)
    return all(host_of[s] != host_of[(s + offset) % world] for s in range(world))


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6])
def test_placement_is_the_smallest_crossing_ring_offset(world: int) -> None:
    seats = [f"m{s}" for s in range(world)]
    for host_of in itertools.product(("h0", "h1", "h2"), repeat=world):
        placement, reason = place_buddies(seats, dict(zip(seats, host_of, strict=True)))
        offset = placement[0]
        # a uniform ring: every seat keeps exactly one ward, and never itself
        assert placement == [(s + offset) % world for s in range(world)], host_of
        assert 1 <= offset < world, host_of
        crossing = [k for k in range(1, world) if _crosses(host_of, k)]
        if crossing:
            assert offset == crossing[0], host_of
            assert reason == f"ring offset {offset}: every copy on another host", host_of
        else:
            assert offset == 1, host_of
            assert reason.startswith("ring offset 1:") and "another host" not in reason, host_of
