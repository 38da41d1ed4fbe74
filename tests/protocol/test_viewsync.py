"""Views that fit the frame limit: deltas against the view held, whole views in pieces, digests that catch a miss."""

from __future__ import annotations

import dataclasses

import pytest

from deadpool.coordinator.liveness import Liveness
from deadpool.protocol import codec, viewsync
from deadpool.protocol.messages import CommitView, ViewChunk
from deadpool.protocol.view import View


def big_view(members: int, epoch: int = 1) -> View:
    seats = [f"node{i // 8:05d}:rank{i}:abcdef" for i in range(members)]
    return View(epoch, seats, ["spare-a", "spare-b"], 7, f"epoch-{epoch}", "store:1",
                {m: f"tcp://10.0.{i // 8}.1:{29600 + i % 8}" for i, m in enumerate([*seats, "spare-a", "spare-b"])},
                {m: m.split(":")[0] for m in [*seats, "spare-a", "spare-b"]},
                [(i + 8) % members for i in range(members)], {})


def test_a_delta_rebuilds_the_committed_view_exactly_and_is_small() -> None:
    base = big_view(20_000)
    dead = base.seats[5]
    new = dataclasses.replace(
        base, epoch=2, seats=[("spare-a" if m == dead else m) for m in base.seats], spares=["spare-b", "late"],
        store_prefix="epoch-2", restore_from={5: base.seats[13]},
        bulk_addrs={**{m: a for m, a in base.bulk_addrs.items() if m != dead}, "late": "tcp://10.9.9.9:1"},
        hosts={**{m: h for m, h in base.hosts.items() if m != dead}, "late": "node9"})
    delta = viewsync.make_delta(base, new, viewsync.view_digest(base), viewsync.view_digest(new))
    assert delta is not None
    assert len(codec.encode(delta)) < 1000 < len(codec.encode(CommitView(new)))
    rebuilt, why = viewsync.apply_delta(base, viewsync.view_digest(base), delta)
    assert rebuilt == new and why == ""
    # A member holding another base (it missed a view) gets None and asks for the whole view.
    other = dataclasses.replace(base, epoch=0)
    assert viewsync.apply_delta(other, viewsync.view_digest(other), delta)[0] is None
    # A corrupted delta fails its digest rather than making a different view.
    bad = dataclasses.replace(delta, seats={5: "someone-else"})
    assert viewsync.apply_delta(base, viewsync.view_digest(base), bad) == (
        None, "view 2 rebuilt from the delta does not match its digest")


def test_a_delta_told_what_changed_compares_only_those_and_equals_the_full_comparison() -> None:
    base = big_view(2_000)
    dead, moved = base.seats[5], base.seats[40]
    new = dataclasses.replace(
        base, epoch=2, seats=[("spare-a" if m == dead else m) for m in base.seats], spares=["spare-b", "late"],
        store_prefix="epoch-2", restore_from={5: base.seats[13]},
        bulk_addrs={**{m: a for m, a in base.bulk_addrs.items() if m != dead}, "late": "tcp://10.9.9.9:1",
                    moved: "tcp://10.8.8.8:1"},
        hosts={**{m: h for m, h in base.hosts.items() if m != dead}, "late": "node9"})
    digests = viewsync.view_digest(base), viewsync.view_digest(new)
    full = viewsync.make_delta(base, new, *digests)
    told = viewsync.make_delta(base, new, *digests, changed={moved})
    assert full is not None and told == full and told.dropped == [dead] and told.bulk_addrs[moved] == "tcp://10.8.8.8:1"
    assert viewsync.apply_delta(base, digests[0], told)[0] == new
    # Told nothing of the moved member, the delta misses its address and the digest catches it.
    missed = viewsync.make_delta(base, new, *digests, changed=set())
    assert missed is not None and moved not in missed.bulk_addrs
    assert viewsync.apply_delta(base, digests[0], missed)[0] is None


def test_a_whole_view_over_the_frame_limit_goes_in_pieces_that_reassemble(monkeypatch: pytest.MonkeyPatch) -> None:
    view = big_view(40_000)
    digest = viewsync.view_digest(view)
    assert len(codec.encode(CommitView(view, 3))) > codec.DEFAULT_MAX_FRAME_BYTES
    assert len(viewsync.whole(view, digest, term=3)) == 1  # packed, a view this regular fits in one piece
    monkeypatch.setattr(viewsync, "CHUNK_BYTES", 16 * 1024)  # several pieces, for what follows
    pieces = viewsync.whole(view, digest, term=3)
    assert len(pieces) > 1 and all(isinstance(p, ViewChunk) for p in pieces)
    assert max(len(codec.encode(p)) for p in pieces) <= codec.DEFAULT_MAX_FRAME_BYTES
    assembly = viewsync.Reassembly()
    results = [assembly.add(p) for p in reversed(pieces)]  # any order
    assert all(r == (None, "") for r in results[:-1]) and results[-1] == (view, "")
    # A piece that does not belong (wrong digest) cannot complete the view.
    assembly = viewsync.Reassembly()
    for piece in pieces[:-1]:
        assembly.add(piece)
    forged = dataclasses.replace(pieces[-1], payload=b"x" * len(pieces[-1].payload))
    assert assembly.add(forged)[0] is None
    small = big_view(10)
    assert viewsync.whole(small, viewsync.view_digest(small), 1) == [CommitView(small, 1)]


def test_liveness_finds_the_silent_oldest_first_and_out_of_order_times() -> None:
    live = Liveness()
    for i in range(5):
        live.seen(f"m{i}", float(i))
    live.seen("m0", 10.0)  # heard again: moves to the newest
    assert live.silent(12.5, 10.0) == {"m1": 1.0, "m2": 2.0}
    live.seen("old", -5.0)  # handed over by a takeover: older than everyone
    assert list(live.silent(12.5, 10.0)) == ["old", "m1", "m2"]
    live.forget("m1")
    live.all_seen(20.0)
    assert live.silent(25.0, 10.0) == {}


def test_the_digest_does_not_depend_on_map_order_but_sees_every_entry() -> None:
    view = big_view(2_000)
    digest = viewsync.view_digest(view)
    shuffled = dataclasses.replace(view, bulk_addrs=dict(reversed(view.bulk_addrs.items())),
                                   hosts=dict(reversed(view.hosts.items())))
    assert viewsync.view_digest(shuffled) == digest
    # An entry for a key that is not a member, a missing entry and a changed one each change it.
    assert viewsync.view_digest(dataclasses.replace(view, hosts={**view.hosts, "stranger": "node0"})) != digest
    missing = {m: h for m, h in view.hosts.items() if m != view.seats[3]}
    assert viewsync.view_digest(dataclasses.replace(view, hosts=missing)) != digest
    moved = {**view.bulk_addrs, view.seats[3]: "tcp://10.9.9.9:1"}
    assert viewsync.view_digest(dataclasses.replace(view, bulk_addrs=moved)) != digest


def test_liveness_takes_a_batch_heard_together_as_each_heard_then() -> None:
    live = Liveness()
    for i, member in enumerate(["a", "b", "c", "d"]):
        live.seen(member, float(i))
    live.seen_all(["b", "a"], 10.0)
    assert live.silent(12.5, 2.0) == {"c": 2.0, "d": 3.0, "b": 10.0, "a": 10.0}
    assert list(live.silent(11.0, 2.0)) == ["c", "d"], "oldest first, the batch after them"
    live.seen_all(["c"], 1.0)  # an older time (a handed-over silence) still sorts where it belongs
    assert list(live.silent(6.0, 2.0)) == ["c", "d"]


def test_a_commits_digest_hashes_again_only_the_runs_of_seats_it_changed_and_equals_the_full_one() -> None:
    base = big_view(3 * viewsync.DIGEST_SEATS + 100)  # four runs, the last one short
    runs = viewsync.seat_runs(base)
    dead, moved = base.seats[5], base.seats[2 * viewsync.DIGEST_SEATS + 1]
    buddies = list(base.buddies)
    buddies[3 * viewsync.DIGEST_SEATS + 50] = 0
    new = dataclasses.replace(
        base, epoch=2, seats=[("spare-a" if m == dead else m) for m in base.seats], spares=["spare-b", "late"],
        bulk_addrs={**{m: a for m, a in base.bulk_addrs.items() if m != dead}, "late": "tcp://10.9.9.9:1",
                    moved: "tcp://10.8.8.8:1"},
        hosts={**{m: h for m, h in base.hosts.items() if m != dead}, "late": "node9"}, buddies=buddies)
    told = viewsync.seat_runs(new, base, runs, {moved, "late"})
    assert told == viewsync.seat_runs(new)
    assert viewsync.view_digest(new, told) == viewsync.view_digest(new)
    # The seat, the address and the buddy changed runs 0, 2 and 3; run 1 is the very object of the view before.
    assert told[1] is runs[1] and all(told[i] != runs[i] for i in (0, 2, 3))
    # Told nothing of the moved address, its run is taken as it was: the digest differs from the view's own, so a
    # member rebuilding the view finds the mismatch and asks for the whole view.
    missed = viewsync.seat_runs(new, base, runs, {"late"})
    assert missed[2] is runs[2] and viewsync.view_digest(new, missed) != viewsync.view_digest(new)
    # Nothing known (None), or another seat count: every run is hashed.
    assert viewsync.seat_runs(new, base, runs, None) == told
    assert viewsync.seat_runs(new, big_view(100), runs[:1], set()) == told


def test_the_spares_and_the_entries_of_no_member_count_in_the_digest() -> None:
    view = big_view(viewsync.DIGEST_SEATS + 10)
    digest = viewsync.view_digest(view)
    assert viewsync.view_digest(dataclasses.replace(view, spares=["spare-b", "spare-a"])) != digest
    assert viewsync.view_digest(dataclasses.replace(view, hosts={**view.hosts, "spare-a": "node7"})) != digest
    extra = dataclasses.replace(view, bulk_addrs={**view.bulk_addrs, "stranger": "tcp://10.1.1.1:1"})
    assert viewsync.view_digest(extra) != digest
    assert viewsync.view_digest(extra, viewsync.seat_runs(view)) == viewsync.view_digest(extra)


def test_a_packed_view_keeps_members_without_entries_and_entries_of_no_member() -> None:
    view = big_view(100)
    bulk = {m: a for m, a in view.bulk_addrs.items() if m != view.seats[3]}
    bulk["gone-member"] = "tcp://10.9.9.9:1"  # an entry whose key is in no seat and no pool
    hosts = {m: h for m, h in view.hosts.items() if m != "spare-b"}
    odd = dataclasses.replace(view, bulk_addrs=bulk, hosts=hosts, restore_from={3: view.seats[11], 4: "@disk"},
                              rebuild_groups=["deadpool:dp:0"])
    packed = codec.pack_view(odd)
    back = codec.unpack_view(packed, viewsync.MAX_VIEW_BYTES)
    assert back == odd and viewsync.view_digest(back) == viewsync.view_digest(odd)
    assert view.seats[3] not in back.bulk_addrs and "spare-b" not in back.hosts


def test_a_packed_view_that_is_not_one_is_refused_with_the_reason() -> None:
    import zlib

    import msgpack

    packed = codec.pack_view(big_view(50))
    assert codec.unpack_view(b"not zlib at all", 1 << 20).reason == "malformed"  # type: ignore[union-attr]
    assert codec.unpack_view(packed[:-5], 1 << 20).reason == "malformed"  # type: ignore[union-attr]
    assert codec.unpack_view(packed + b"x", 1 << 20).reason == "malformed"  # type: ignore[union-attr]
    # A small frame that inflates past the bound is cut off there, not inflated whole.
    bomb = zlib.compress(b"\0" * (64 << 20))
    assert len(bomb) < 100_000
    assert codec.unpack_view(bomb, 1 << 20).reason == "too_large"  # type: ignore[union-attr]
    assert codec.unpack_view(zlib.compress(b"\xc1"), 1 << 20).reason == "malformed"  # type: ignore[union-attr]
    fields = msgpack.unpackb(zlib.decompress(packed), raw=False, strict_map_key=False)
    short = [*fields[:6], fields[6][:-1], *fields[7:]]  # the bulk column one entry short
    refused = codec.unpack_view(zlib.compress(msgpack.packb(short)), 1 << 20)
    assert refused.reason == "bad_field" and "column of 51 entries for 52 members" in str(refused)  # type: ignore[union-attr]
    wild = [*fields[:7], [10_000], *fields[8:]]  # a missing index past the members
    assert codec.unpack_view(zlib.compress(msgpack.packb(wild)), 1 << 20).reason == "bad_field"  # type: ignore[union-attr]


def test_the_first_view_of_131072_members_goes_to_an_agent_in_two_pieces() -> None:
    import random

    rng = random.Random(7)
    members = [f"node{i // 8:05d}:rank{i}:{rng.getrandbits(24):06x}" for i in range(131_072)]
    view = View(1, members[:124_518], members[124_518:], -1, "epoch-1", "store:1",
                {m: f"tcp://10.{(i >> 11) & 255}.{(i >> 3) & 255}.1:{29600 + i % 8}" for i, m in enumerate(members)},
                {m: m.split(":")[0] for m in members}, [(i + 8) % 124_518 for i in range(124_518)], {})
    digest = viewsync.view_digest(view)
    pieces = viewsync.whole(view, digest, term=1)
    assert len(pieces) == 2 and max(len(codec.encode(p)) for p in pieces) <= codec.DEFAULT_MAX_FRAME_BYTES
    assembly = viewsync.Reassembly()
    assert [assembly.add(p) for p in pieces][-1] == (view, "")
