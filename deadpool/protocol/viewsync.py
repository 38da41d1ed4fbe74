"""Committed views that fit the control-frame limit at any job size: deltas, chunks and their digests.

A view is O(members) (every member's id, address and host), so at tens of
thousands of members it no longer fits one control frame. The coordinator sends
a member that holds the previous view only what changed (:class:`ViewDelta`,
the size of the change), and any other member the whole view: one
``CommitView`` where it fits, else pieces of at most :data:`CHUNK_BYTES` of its
packed form (:class:`ViewChunk`; ``codec.pack_view``, each member id once,
compressed). Every view has a digest over a canonical encoding; a member applies
a delta only to the base it names and keeps the result only if its digest
matches, otherwise it asks for the whole view (``ViewRequest``). Pure functions
and one small reassembly buffer; no I/O.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TypeVar

import msgpack

from deadpool.protocol import codec
from deadpool.protocol.messages import CommitView, ViewChunk, ViewDelta
from deadpool.protocol.view import View

CHUNK_BYTES = 1020 * 1024  # one piece of a chunked view: the 1 MiB frame limit less 4 KiB for the envelope
FULL_VIEW_BYTES = CHUNK_BYTES  # a whole view up to this size goes as one CommitView
MAX_VIEW_BYTES = 256 * 1024 * 1024  # a reassembled view may not exceed this (about 2M members)

_T = TypeVar("_T")


DIGEST_SEATS = 4096  # seats per run of the view digest: a commit hashes again only the runs it changed


@dataclass(frozen=True, slots=True)
class SeatRun:
    """The digest of one run of :data:`DIGEST_SEATS` seats (their members, addresses, hosts and buddies)."""

    digest: bytes
    bulk: int  # how many of its members have a bulk address in the view
    hosts: int  # and a host


def seat_runs(view: View, before: View | None = None, runs: list[SeatRun] | None = None,
              changed: Collection[str] | None = None) -> list[SeatRun]:
    """`view`'s seat runs, each taken from `before`'s `runs` where the run is unchanged: the same members and
    buddies, none of them in `changed` (the members whose address or host was stored anew since `before`, as
    ``decisions.next_view`` takes them; None: not known, every run is hashed)."""
    seats, buddies, bulk_addrs, hosts = view.seats, view.buddies, view.bulk_addrs, view.hosts
    if before is None or runs is None or changed is None or len(before.seats) != len(seats):
        before, runs, changed = None, [], ()  # nothing to take
    known = changed if isinstance(changed, (set, frozenset)) else set(changed)
    seats_before, buddies_before = (before.seats, before.buddies) if before is not None else ([], [])
    out: list[SeatRun] = []
    for i, start in enumerate(range(0, len(seats), DIGEST_SEATS)):
        end = start + DIGEST_SEATS
        members = seats[start:end]
        if (i < len(runs) and members == seats_before[start:end] and buddies[start:end] == buddies_before[start:end]
                and known.isdisjoint(members)):
            out.append(runs[i])
            continue
        bulk, host = list(map(bulk_addrs.get, members)), list(map(hosts.get, members))
        packed = msgpack.packb([members, bulk, host, buddies[start:end]], use_bin_type=True)
        out.append(SeatRun(hashlib.blake2b(packed, digest_size=16).digest(),
                           len(bulk) - bulk.count(None), len(host) - host.count(None)))
    return out


def view_digest(view: View, runs: list[SeatRun] | None = None) -> bytes:
    """16 bytes over a canonical encoding of `view`, equal wherever the view is equal.

    The seats go in runs of :data:`DIGEST_SEATS` (:func:`seat_runs`; `runs` if already known), each with its
    members' entries of the address maps, so that a commit hashes again only what it changed; then the spares
    with theirs, and the maps' entries for keys that are no member, sorted.
    """
    runs = seat_runs(view) if runs is None else runs
    canonical = [
        view.epoch, view.spares, view.resume_step, view.store_prefix, view.store_addr,
        *_spares_and_others(view.bulk_addrs, view, sum(run.bulk for run in runs)),
        *_spares_and_others(view.hosts, view, sum(run.hosts for run in runs)),
        sorted(view.restore_from.items()), view.rebuild_groups, [run.digest for run in runs],
    ]
    return hashlib.blake2b(msgpack.packb(canonical, use_bin_type=True), digest_size=16).digest()


def _spares_and_others(entries: dict[str, str], view: View,
                       of_seats: int) -> tuple[list[str | None], list[tuple[str, str]]]:
    """`entries`' values for the spares in order (None: no entry), and its entries for keys that are no member
    of `view`, sorted (`of_seats`: how many entries the seats have)."""
    values = list(map(entries.get, view.spares))
    if of_seats + len(values) - values.count(None) == len(entries):  # every key is a member: nothing else to list
        return values, []
    listed = {*view.seats, *view.spares}
    return values, sorted(item for item in entries.items() if item[0] not in listed)


def _changed(old: dict[str, str], new: dict[str, str]) -> dict[str, str]:
    """`new`'s entries that `old` lacks or holds another value for (compared in C: a view has 131,072)."""
    return {key: new[key] for key in itertools.compress(new, map(operator.ne, map(old.get, new), new.values()))}


def _changed_at(old: dict[str, str], new: dict[str, str], keys: Collection[str]) -> dict[str, str]:
    """`new`'s entries for `keys` that `old` lacks or holds another value for."""
    return {key: value for key in keys if (value := new.get(key)) is not None and old.get(key) != value}


def _moved(old: list[_T], new: list[_T]) -> dict[int, _T]:
    """Index -> `new`'s item where it differs from `old`'s (lists of one length, compared in C)."""
    return {i: new[i] for i in itertools.compress(itertools.count(), map(operator.ne, old, new))}


def make_delta(base: View, view: View, base_digest: bytes, digest: bytes,
               changed: Collection[str] | None = None) -> ViewDelta | None:
    """The delta from `base` to `view`, or None where one cannot express it (the seat count changed).

    Given `changed`, the caller vouches that a member's address entries differ between the two views only
    where it entered or left a seat or the pool, or is in `changed`: only those are compared, not every
    member's (the coordinator's views, whose maps it patches, ``decisions.next_view``).
    """
    if len(base.seats) != len(view.seats) or len(base.buddies) != len(view.buddies):
        return None
    gone = set(base.spares) - set(view.spares)
    kept = [s for s in base.spares if s not in gone]
    if view.spares[:len(kept)] != kept:
        return None  # the pool was reordered, not only trimmed and extended
    seats, spares_new = _moved(base.seats, view.seats), view.spares[len(kept):]
    # `touched`: the members that may have lost every entry (found in C as the keys each map lost, or those the
    # caller names with the ones that moved); only they are looked at for `dropped`.
    if changed is None:
        bulk, hosts = _changed(base.bulk_addrs, view.bulk_addrs), _changed(base.hosts, view.hosts)
        touched: Collection[str] = (base.bulk_addrs.keys() - view.bulk_addrs.keys()) | (base.hosts.keys()
                                                                                        - view.hosts.keys())
    else:
        touched = {*changed, *seats.values(), *map(base.seats.__getitem__, seats), *gone, *spares_new}
        bulk = _changed_at(base.bulk_addrs, view.bulk_addrs, touched)
        hosts = _changed_at(base.hosts, view.hosts, touched)
    dropped = [m for m in touched if m not in view.bulk_addrs and m not in view.hosts
               and (m in base.bulk_addrs or m in base.hosts)]
    return ViewDelta(
        epoch=view.epoch, base_epoch=base.epoch, base_digest=base_digest, digest=digest, seats=seats,
        spares_gone=sorted(gone), spares_new=spares_new, resume_step=view.resume_step,
        store_prefix=view.store_prefix, store_addr=view.store_addr, bulk_addrs=bulk, hosts=hosts,
        dropped=sorted(dropped), buddies=_moved(base.buddies, view.buddies),
        restore_from=dict(view.restore_from), rebuild_groups=list(view.rebuild_groups),
    )


def apply_delta(base: View, base_digest: bytes, delta: ViewDelta) -> tuple[View | None, str]:
    """The view `delta` makes from `base`, or None and why (another base, a bad seat, a digest mismatch)."""
    if delta.base_epoch != base.epoch or delta.base_digest != base_digest:
        return None, f"delta for base view {delta.base_epoch}, this member holds view {base.epoch}"
    world = len(base.seats)
    if any(not 0 <= seat < world for seat in delta.seats) or any(
            not 0 <= seat < world or not 0 <= b < world for seat, b in delta.buddies.items()):
        return None, "delta names a seat outside the view"
    gone = set(delta.spares_gone)
    bulk, hosts = dict(base.bulk_addrs), dict(base.hosts)
    bulk.update(delta.bulk_addrs)
    hosts.update(delta.hosts)
    for member in delta.dropped:
        bulk.pop(member, None)
        hosts.pop(member, None)
    seats, buddies = list(base.seats), list(base.buddies)
    for seat, member in delta.seats.items():
        seats[seat] = member
    for seat, buddy in delta.buddies.items():
        buddies[seat] = buddy
    view = View(
        epoch=delta.epoch, seats=seats, spares=[s for s in base.spares if s not in gone] + delta.spares_new,
        resume_step=delta.resume_step, store_prefix=delta.store_prefix, store_addr=delta.store_addr,
        bulk_addrs=bulk, hosts=hosts, buddies=buddies, restore_from=dict(delta.restore_from),
        rebuild_groups=list(delta.rebuild_groups),
    )
    if view_digest(view) != delta.digest:
        return None, f"view {delta.epoch} rebuilt from the delta does not match its digest"
    return view, ""


def whole(view: View, digest: bytes, term: int) -> list[CommitView | ViewChunk]:
    """The view for a member without its base: one CommitView where it fits, else pieces of its packed form
    (``codec.pack_view``: each member id once, compressed; 15 pieces of 1 MiB at 131,072 members became 2)."""
    if not _surely_over(view, FULL_VIEW_BYTES) and codec.view_bytes(view) <= FULL_VIEW_BYTES:
        return [CommitView(view, term)]
    packed = codec.pack_view(view)
    count = -(-len(packed) // CHUNK_BYTES)
    return [ViewChunk(view.epoch, digest, i, count, packed[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES], term)
            for i in range(count)]


def _surely_over(view: View, limit: int) -> bool:
    """`view`'s encoding is surely over `limit` bytes: its seats' ids alone (each at least its length and a byte of
    header, in C) are. Encoding a view of 131,072 members only to learn that cost a tenth of a CPU-second."""
    return sum(map(len, view.seats)) + len(view.seats) > limit


@dataclass
class Reassembly:
    """A member's pieces of the newest chunked view, until every piece arrived (older epochs dropped)."""

    epoch: int = 0
    digest: bytes = b""
    count: int = 0
    pieces: dict[int, bytes] = field(default_factory=dict)

    def add(self, chunk: ViewChunk) -> tuple[View | None, str]:
        """Keep `chunk`; the view once complete and checked, or None and why not (yet)."""
        if not 0 <= chunk.index < chunk.count or chunk.count * CHUNK_BYTES > MAX_VIEW_BYTES + CHUNK_BYTES:
            return None, f"piece {chunk.index} of {chunk.count} is out of range"
        if chunk.epoch < self.epoch:
            return None, f"piece of view {chunk.epoch}, older than the one being assembled ({self.epoch})"
        if (chunk.epoch, chunk.digest, chunk.count) != (self.epoch, self.digest, self.count):
            self.epoch, self.digest, self.count, self.pieces = chunk.epoch, chunk.digest, chunk.count, {}
        if len(chunk.payload) > CHUNK_BYTES:
            return None, f"piece of {len(chunk.payload)} bytes is over {CHUNK_BYTES}"
        self.pieces[chunk.index] = chunk.payload
        if len(self.pieces) < self.count:
            return None, ""
        packed = b"".join(self.pieces[i] for i in range(self.count))
        self.pieces = {}
        view = codec.unpack_view(packed, MAX_VIEW_BYTES)
        if isinstance(view, codec.DecodeError):
            return None, f"chunked view {chunk.epoch}: {view}"
        if view.epoch != chunk.epoch or view_digest(view) != chunk.digest:
            return None, f"chunked view {chunk.epoch} does not match its digest"
        return view, ""
