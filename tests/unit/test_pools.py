"""The coordinator's survivor bookkeeping: what a round still waits on, kept as answers come and the round grows."""

from __future__ import annotations

from deadpool.coordinator.pools import SparePool, Survivors
from deadpool.coordinator.records import Round
from deadpool.protocol.messages import PrepareAck
from deadpool.protocol.view import View


def _view(seats: int) -> View:
    members = [f"m{i}" for i in range(seats)]
    return View(1, members, ["s0", "s1"], 3, "epoch-1", "store:1", {}, {}, [(i + 1) % seats for i in range(seats)], {})


def _answer(survivors: Survivors, rnd: Round, member: str, early: bool = False) -> None:
    rnd.acks[member] = PrepareAck(member, 2, 3, [3], {}, early=early)  # stored as it came, then the cache told
    survivors.answered(rnd, member, early)


def test_a_round_waits_on_the_survivors_without_an_answer_and_a_grown_round_keeps_the_answers() -> None:
    view, fenced = _view(6), {}
    cache = Survivors()
    first = Round(2, {1: "m1"}, {1: "s0"}, {}, 10.0, "seat 1 lost")
    assert cache.first_unanswered(view, first, fenced) == "m0"
    _answer(cache, first, "m0")
    _answer(cache, first, "m2", early=True)  # an early answer counts as heard but is asked again
    assert cache.first_unanswered(view, first, fenced) == "m3"
    assert cache.unanswered(view, first, fenced) == ["m3", "m4", "m5", "m2"]
    # m4 dies: the grown round keeps the same answers and stops waiting on m4.
    fenced["m4"] = "exit"
    grown = Round(3, {1: "m1", 4: "m4"}, {1: "s0", 4: "s1"}, first.acks, 10.0, "seat 4 lost")
    assert cache.unanswered(view, grown, fenced) == ["m3", "m5", "m2"]
    _answer(cache, grown, "m3")
    _answer(cache, grown, "m2")  # its full answer replaces the early one
    _answer(cache, grown, "s0")  # a chosen spare's answer is not a survivor's
    assert cache.unanswered(view, grown, fenced) == ["m5"]
    _answer(cache, grown, "m5")
    assert cache.first_unanswered(view, grown, fenced) == "" and cache.unanswered(view, grown, fenced) == []


def test_answers_stored_before_the_cache_first_looked_are_counted() -> None:
    view, fenced = _view(4), {}
    cache = Survivors()
    rnd = Round(2, {0: "m0"}, {0: "s0"}, {}, 10.0, "seat 0 lost")
    rnd.acks["m1"] = PrepareAck("m1", 2, 3, [3], {})
    cache.answered(rnd, "m1", False)  # the cache had not built this round's wait yet: ignored, then rebuilt
    rnd.acks["m3"] = PrepareAck("m3", 2, 3, [3], {}, early=True)
    assert cache.unanswered(view, rnd, fenced) == ["m2", "m3"]
    assert cache.first_unanswered(view, rnd, fenced) == "m2"
    # A new view (a commit) starts over from that view's seats.
    later = View(2, ["m1", "s0", "m2", "m3"], [], 3, "epoch-2", "store:1", {}, {}, [1, 2, 3, 0], {})
    assert cache.unanswered(later, Round(4, {}, {}, {}, 10.0, "blind"), fenced) == ["m1", "s0", "m2", "m3"]


def test_the_spare_order_is_kept_for_one_interval_less_the_members_fenced_since() -> None:
    view, fenced = _view(4), {}
    pool = SparePool(fresh_for=0.5)
    calls: list[list[str]] = []

    def order(candidates: list[str]) -> list[str]:
        calls.append(candidates)
        return list(reversed(candidates))

    assert pool.ordered(10.0, view, [], fenced, order) == ["s1", "s0"]
    assert pool.ordered(10.3, view, [], fenced, order) == ["s1", "s0"] and len(calls) == 1  # kept
    fenced["s1"] = "exit"
    assert pool.ordered(10.4, view, [], fenced, order) == ["s0"] and len(calls) == 1  # filtered, not reordered
    assert pool.ordered(10.45, view, ["s2"], fenced, order) == ["s2", "s1", "s0"]  # a spare joined: ordered again
    assert pool.ordered(11.0, view, ["s2"], fenced, order) == ["s2", "s1", "s0"] and len(calls) == 3  # stale
