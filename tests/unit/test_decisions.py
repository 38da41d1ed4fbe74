"""The coordinator's decisions are pure functions: tested without sockets or clocks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from deadpool.coordinator import decisions
from deadpool.coordinator.decisions import NoSpare, Suspicion
from deadpool.protocol.messages import PrepareAck
from deadpool.protocol.view import View, place_buddies
from deadpool.protocol.viewsync import view_digest as digest


def resume_step(
    view: View, failed_seats: Sequence[int], reports: Mapping[str, PrepareAck]
) -> tuple[int | None, str]:
    """The newest step every seat can restore (`plan_restore` without the sources), with the reason."""
    step, _, reason = decisions.plan_restore(view, failed_seats, reports)
    return step, reason


def held(local_steps: list[int], ward_steps: dict[int, list[int]]) -> PrepareAck:
    """A survivor's answer naming the snapshots it holds (the rest of the PrepareAck does not matter here)."""
    return PrepareAck("survivor", 2, 0, local_steps, ward_steps)


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


def test_a_spare_already_told_its_seat_keeps_it_unless_copies_would_share_a_host() -> None:
    """A host's seats fail one tick apart: seat 5's spare (chosen first, told by its Prepare) keeps seat 5
    on one host; across hosts it gives way when keeping it leaves no placement with every copy elsewhere."""
    one_host, _ = decisions.pick_spares([0, 2], make_view(spares=["s0", "s1"]), ["s0", "s1"], {}, kept={2: "s0"})
    assert one_host == {0: "s1", 2: "s0"}, "kept (afresh, seat 0 would take s0)"
    hosts = {f"m{i}": f"host{i // 2}" for i in range(6)} | {f"s{h}": f"host{h}" for h in range(3)}
    view, _ = decisions.first_view({i: f"m{i}" for i in range(6)}, 6, ["s2", "s1", "s0"], "x:1", hosts, {})
    assert view is not None
    first, _ = decisions.pick_spares([5], view, ["s2", "s1", "s0"], hosts)
    assert first == {5: "s1"}
    # Keeping {5: s1} would seat s0 at 4: hosts [0, 0, 1, 1, 0, 1], which no ring offset crosses.
    both, _ = decisions.pick_spares([4, 5], view, ["s2", "s1", "s0"], hosts, kept=first)
    assert both == {4: "s1", 5: "s0"}


def test_pick_spares_refuses_when_too_few() -> None:
    chosen, reason = decisions.pick_spares([0, 2], make_view(), ["s0"], {})
    assert chosen is None and "only 1 spare" in reason


def test_resume_step_is_newest_common_step() -> None:
    view = make_view()  # seat 2's copy lives on seat 3
    reports = {
        "m0": held([18, 19], {3: [18, 19]}),
        "m1": held([19, 20], {0: [19]}),
        "m3": held([18, 19], {2: [18, 19]}),
    }
    step, reason = resume_step(view, [2], reports)
    assert step == 19 and "19" in reason


def test_resume_step_falls_back_when_buddy_lags() -> None:
    view = make_view()
    reports = {
        "m0": held([18, 19], {}),
        "m1": held([18, 19], {}),
        "m3": held([19, 20], {2: [17, 18]}),
    }
    # m3 no longer holds 18 locally; nothing is common: a clear refusal, not a guess.
    step, reason = resume_step(view, [2], reports)
    assert step is None and "no snapshot step common" in reason


def test_no_common_step_names_the_seat_whose_copy_was_lost() -> None:
    # Seat 2's replacement holds step 4 only; its copy of step 6 was on seat 3, lost in this round.
    view = make_view()
    reports = {
        "m0": held([5, 6], {3: [5, 6]}),
        "m1": held([5, 6], {0: [5, 6]}),
        "m2": held([4], {1: [5, 6]}),
    }
    step, reason = resume_step(view, [3], reports)
    assert step is None and "seat 2" in reason and "seat 3, which was lost" in reason
    assert "step 6" in reason and "no copy of its state survives" in reason


def test_interrupted_adoption_restores_from_the_buddy_again() -> None:
    # Seat 2's spare was adopted, but a second failure interrupted it before it restored anything.
    view = make_view()
    reports = {
        "m0": held([19], {3: [19]}),
        "m1": held([19], {0: [19]}),
        "m2": held([], {}),
        "m3": held([19], {2: [18, 19]}),
    }
    step, sources, _ = decisions.plan_restore(view, [], reports)
    assert step == 19 and sources == {2: "m3"}


def test_a_replacement_restores_from_the_buddy_of_an_earlier_view() -> None:
    """Seat 2's replacement failed to adopt (a blind rebuild follows); the committed view moved seat 2's buddy to
    seat 3, which holds no copy yet, but seat 0 (its buddy before, asked by the failed adoption) still does."""
    view = make_view()
    reports = {
        "m0": held([19], {3: [19], 2: [18, 19]}),
        "m1": held([19], {0: [19]}),
        "m2": held([], {}),
        "m3": held([19], {}),
    }
    step, sources, _ = decisions.plan_restore(view, [], reports)
    assert step == 19 and sources == {2: "m0"}
    reports["m3"] = held([19], {2: [19]})  # where both hold it, the buddy of the view serves
    assert decisions.plan_restore(view, [], reports)[1] == {2: "m3"}


def test_resume_step_names_seat_lost_with_its_buddy() -> None:
    view = make_view()
    step, reason = resume_step(
        view, [2, 3], {"m0": held([1], {}), "m1": held([1], {})}
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


def test_next_view_patches_the_addresses_it_changes_and_equals_looking_up_every_member() -> None:
    """Given the members whose entries changed since `view`, the next view's maps are `view`'s patched:
    the dead and the lost spares gone, joined spares and changed members taken anew; the same view as
    looking up every member."""
    hosts = {f"m{i}": f"h{i // 2}" for i in range(6)} | {"s0": "h0", "s1": "h1", "s2": "h2", "s3": "h3"}
    bulk = {m: f"tcp://{m}" for m in hosts}
    view, _ = decisions.first_view({i: f"m{i}" for i in range(6)}, 6, ["s0", "s1", "s2"], "x:1", hosts, bulk)
    assert view is not None
    bulk |= {"m3": "tcp://m3-again", "stranger": "tcp://z"}  # m3 re-joined elsewhere; one never in a view
    for changed in ({"m3"}, {"m3", "s3", "m0"}):
        patched = decisions.next_view(view, 2, {1: "s0", 4: "s1"}, ["s2", "s3"], 5, hosts, bulk, rebuild=True,
                                      changed=changed)
        full = decisions.next_view(view, 2, {1: "s0", 4: "s1"}, ["s2", "s3"], 5, hosts, bulk, rebuild=True)
        assert patched == full and digest(patched) == digest(full)
        assert "m1" not in patched.hosts and patched.bulk_addrs["s3"] == "tcp://s3"
        assert patched.bulk_addrs["m3"] == "tcp://m3-again" and "stranger" not in patched.bulk_addrs
    unchanged = decisions.next_view(view, 2, {}, ["s0"], 5, hosts, bulk, rebuild=False, changed=set())
    assert unchanged.bulk_addrs["m3"] == "tcp://m3", "a member not named as changed keeps the view's entry"
    assert set(unchanged.hosts) == {*view.seats, "s0"}


def test_first_view_waits_for_every_seat() -> None:
    view, reason = decisions.first_view({0: "a", 2: "c"}, 3, [], "h:1", {}, {})
    assert view is None and "[1]" in reason
    view, _ = decisions.first_view({0: "a", 1: "b", 2: "c"}, 3, ["s"], "h:1", {}, {})
    assert view is not None and view.epoch == 1 and view.seats == ["a", "b", "c"] and view.spares == ["s"]


def test_order_spares_puts_the_freshest_heartbeat_first_and_leaves_fenced_out() -> None:
    pool, _ = decisions.order_spares(["s0", "s1", "s2", "s3", "ghost"], {"s0": 5.0, "s1": 9.0, "s2": 5.0, "s3": 9.5},
                                     fenced={"s3"})
    assert pool == ["s1", "s0", "s2", "ghost"]  # equals keep join order; never heard from comes last


def test_unanswered_prepare_names_the_silent_survivors_after_the_deadline_only() -> None:
    assert decisions.unanswered_prepare(9.9, 10.0, ["a", "b"], {"a"}, 4, 10.0) == []
    late = decisions.unanswered_prepare(10.1, 10.0, ["a", "b", "c"], {"a"}, 4, 10.0)
    assert [m for m, _ in late] == ["b", "c"] and "Prepare(4)" in late[0][1]


def test_unexplained_failure_waits_a_grace_then_rebuilds_then_gives_up() -> None:
    assert decisions.unexplained_failure(10.5, 10.0, 2.0, 0)[0] is Suspicion.WAIT  # grace: min(1, 2/2) = 1 s
    action, reason = decisions.unexplained_failure(11.1, 10.0, 2.0, 0)
    assert action is Suspicion.REBUILD and "no member was found dead" in reason
    assert decisions.unexplained_failure(11.1, 10.0, 2.0, decisions.MAX_BLIND_REBUILDS - 1)[0] is Suspicion.REBUILD
    action, reason = decisions.unexplained_failure(11.1, 10.0, 2.0, decisions.MAX_BLIND_REBUILDS)
    assert action is Suspicion.FAIL and f"{decisions.MAX_BLIND_REBUILDS + 1} times in a row" in reason


def test_no_spare_stops_at_once_or_waits_until_the_timeout() -> None:
    lost, why = "rank 1 (m1)", "1 seat(s) lost but only 0 spare(s) left"
    action, reason = decisions.no_spare("stop", 5.0, 5.0, 60.0, lost, why, 4)
    assert action is NoSpare.STOP and "no spare is left" in reason and "world size 4" in reason
    action, reason = decisions.no_spare("wait", 64.0, 5.0, 60.0, lost, why, 4)
    assert action is NoSpare.WAIT and "waiting up to 60s" in reason
    action, reason = decisions.no_spare("wait", 65.5, 5.0, 60.0, lost, why, 4)
    assert action is NoSpare.STOP and "rank 1 (m1)" in reason and "no spare joined within 60s" in reason


def test_a_replacement_that_had_not_restored_loses_its_state_with_its_buddy() -> None:
    """Seat 2 was refilled from seat 3's copy; seat 3 dies before the replacement restored from it: seat 2's
    member reports nothing (it acked early, still taking the seat), and no copy of seat 2's state survives."""
    view = make_view()  # buddies ring: seat 2's copy is on seat 3
    reports = {m: held([5], {(i - 1) % 4: [5]}) for i, m in enumerate(view.seats) if i != 3}
    reports["m2"] = held([], {1: [5]})
    step, why = resume_step(view, [3], reports)
    assert step is None
    assert "seat 2" in why and "no copy of its state survives" in why and "seat 3" in why


def test_the_first_view_resumes_from_the_newest_disk_checkpoint_every_seat_holds() -> None:
    assert decisions.first_resume(True, [[3, 5, 7], [3, 5]]) == (5, "resuming from the disk checkpoint of step 5")
    assert decisions.first_resume(False, [[], []]) == (-1, "")
    step, why = decisions.first_resume(True, [[3], []])
    assert step is None and "no disk checkpoint" in why and "without --resume" in why
    step, why = decisions.first_resume(False, [[3, 5], [5]])
    assert step is None and "step 5 from an earlier run" in why and "--resume" in why, "never mixed with a new run's"
    view, _ = decisions.first_view({0: "a", 1: "b"}, 2, ["s"], "h:1", {}, {}, resume_step=5)
    assert view is not None and view.resume_step == 5
    assert view.restores_from_disk(0) and view.restores_from_disk(1) and not view.restores_from_disk(2)


def test_a_seat_lost_before_its_first_copy_resumes_everyone_from_the_initial_state() -> None:
    """Killed before its buddy confirmed its first snapshot: its replacement builds the initial state itself,
    the survivors that began no step report their live state as it (-1), and the job starts again."""
    view = make_view()
    reports = {"m0": held([-1], {}), "m2": held([], {}), "m3": held([-1], {})}
    reports["m2"] = held([-1], {1: []})
    step, sources, reason = decisions.plan_restore(view, [1], reports)
    assert step == -1 and sources == {} and "-1" in reason
    # Where the buddy holds the copy, it serves: the initial state as the lost seat had it.
    reports["m2"] = held([-1], {1: [-1]})
    assert decisions.plan_restore(view, [1], reports)[:2] == (-1, {1: "m2"})


def test_the_initial_state_is_no_way_out_once_a_survivor_moved_past_it() -> None:
    """A lost seat with no copy can only start again from the initial state: a survivor that no longer holds it
    (its snapshots are of later steps) leaves no step common to every seat, and the reason names the lost seat."""
    view = make_view()
    step, reason = resume_step(view, [1], {"m0": held([4, 5], {}), "m2": held([4, 5], {}), "m3": held([4, 5], {})})
    assert step is None and "seat 1" in reason
