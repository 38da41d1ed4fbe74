"""The coordinator's decisions are pure functions: tested without sockets or clocks."""

from __future__ import annotations

from deadpool.coordinator import decisions
from deadpool.protocol.view import View, place_buddies


def make_view(world: int = 4, spares: list[str] | None = None, hosts: dict[str, str] | None = None) -> View:
    seats = [f"m{i}" for i in range(world)]
    hosts = hosts or {}
    buddies, _ = place_buddies(seats, hosts)
    return View(1, seats, spares or [], -1, "epoch-1", "127.0.0.1:1", {}, hosts, buddies, {})


def test_silent_members_uses_the_injected_clock() -> None:
    dead = decisions.silent_members(10.0, {"a": 9.5, "b": 7.9, "c": 8.0}, failure_timeout=2.0)
    assert [m for m, _ in dead] == ["b"]
    assert "2.10s" in dead[0][1]


def test_buddies_ring_on_one_host_and_across_hosts() -> None:
    assert place_buddies(["a", "b", "c", "d"], {})[0] == [1, 2, 3, 0]
    hosts = {"a": "h0", "b": "h0", "c": "h1", "d": "h1", "e": "h2", "f": "h2"}
    buddies, reason = place_buddies(list("abcdef"), hosts)
    assert all(hosts["abcdef"[seat]] != hosts["abcdef"[b]] for seat, b in enumerate(buddies))
    assert sorted(buddies) == list(range(6)), "every seat holds exactly one ward"
    assert "another host" in reason
    assert place_buddies(["solo"], {})[0] == [0]


def test_pick_spares_prefers_another_host_than_the_buddy() -> None:
    hosts = {"m0": "h0", "m1": "h0", "m2": "h1", "m3": "h1", "s-h1": "h1", "s-h2": "h2"}
    view = make_view(hosts=hosts)
    chosen, reason = decisions.pick_spares([1], view, ["s-h1", "s-h2"], hosts)
    buddy_host = hosts[view.buddy_member(1)]
    assert chosen == {1: "s-h2" if buddy_host == "h1" else "s-h1"}
    assert "seat 1" in reason


def test_pick_spares_refuses_when_too_few() -> None:
    chosen, reason = decisions.pick_spares([0, 2], make_view(), ["s0"], {})
    assert chosen is None and "only 1 spare" in reason


def test_resume_step_is_newest_common_step() -> None:
    view = make_view()  # seat 2's copy lives on seat 3
    reports = {
        "m0": decisions.Snapshots([18, 19], {3: [18, 19]}),
        "m1": decisions.Snapshots([19, 20], {0: [19]}),
        "m3": decisions.Snapshots([18, 19], {2: [18, 19]}),
    }
    step, reason = decisions.resume_step(view, [2], reports)
    assert step == 19 and "19" in reason


def test_resume_step_falls_back_when_buddy_lags() -> None:
    view = make_view()
    reports = {
        "m0": decisions.Snapshots([18, 19], {}),
        "m1": decisions.Snapshots([18, 19], {}),
        "m3": decisions.Snapshots([19, 20], {2: [17, 18]}),
    }
    # m3 no longer holds 18 locally; nothing is common: a clear refusal, not a guess.
    step, reason = decisions.resume_step(view, [2], reports)
    assert step is None and "no snapshot step common" in reason


def test_interrupted_adoption_restores_from_the_buddy_again() -> None:
    # Seat 2's spare was adopted, but a second failure interrupted it before it restored anything.
    view = make_view()
    reports = {
        "m0": decisions.Snapshots([19], {3: [19]}),
        "m1": decisions.Snapshots([19], {0: [19]}),
        "m2": decisions.Snapshots([], {}),
        "m3": decisions.Snapshots([19], {2: [18, 19]}),
    }
    step, sources, _ = decisions.plan_restore(view, [], reports)
    assert step == 19 and sources == {2: "m3"}


def test_resume_step_names_seat_lost_with_its_buddy() -> None:
    view = make_view()
    step, reason = decisions.resume_step(
        view, [2, 3], {"m0": decisions.Snapshots([1], {}), "m1": decisions.Snapshots([1], {})}
    )
    assert step is None and "seat 2" in reason and "seat 3" in reason


def test_next_view_seats_the_spare_and_restores_from_old_buddy() -> None:
    view = make_view(spares=["s0", "s1"])
    new = decisions.next_view(view, 5, {2: "s0"}, ["s1"], 19, {}, {"s0": "tcp://x", "m0": "tcp://y"}, rebuild=True)
    assert new.seats == ["m0", "m1", "s0", "m3"] and new.spares == ["s1"]
    assert new.store_prefix == "epoch-5" and new.resume_step == 19
    assert new.restore_from == {2: "m3"}
    assert new.bulk_addrs == {"s0": "tcp://x", "m0": "tcp://y"}
    same = decisions.next_view(view, 6, {}, ["s0"], 0, {}, {}, rebuild=False)
    assert same.store_prefix == view.store_prefix and same.restore_from == {}


def test_first_view_waits_for_every_seat() -> None:
    view, reason = decisions.first_view({0: "a", 2: "c"}, 3, [], "h:1", {}, {})
    assert view is None and "[1]" in reason
    view, _ = decisions.first_view({0: "a", 1: "b", 2: "c"}, 3, ["s"], "h:1", {}, {})
    assert view is not None and view.epoch == 1 and view.seats == ["a", "b", "c"] and view.spares == ["s"]
