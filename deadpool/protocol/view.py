"""Views: the numbered membership of a job, and pure functions over them.

A view says who sits in which seat (rank), who waits as a spare, where every
member can be reached, which seat keeps a copy of which other seat's snapshot
(its *buddy*), and from which step training resumes.  Epochs only grow; a
member adopts a view only if its epoch is newer than the one it holds.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# A `restore_from` value that names no member: the seat reads its state from the disk checkpoint of
# `resume_step` (the fallback when a seat and the buddy holding its copy are lost together).
DISK_SOURCE = "@disk"
# The step a view resumes from to start at the beginning: the initial state, which the script builds (no snapshot).
INITIAL_STEP = -1
FIRST_EPOCH = 1  # the job's first view
# Ring offsets tried for a buddy placement that crosses hosts: hosts hold a handful of seats, so a crossing
# offset is small where one exists; trying every offset of a 131,072-seat ring would cost O(seats^2).
MAX_OFFSET = 256


@dataclass(frozen=True, slots=True)
class View:
    """One committed membership of the job."""

    epoch: int  # strictly growing view number
    seats: list[str]  # seat (rank) -> member id
    spares: list[str]  # member ids waiting to be adopted, in adoption order
    resume_step: int  # state to restore (INITIAL_STEP: the initial state); training goes on at +1
    store_prefix: str  # TCPStore prefix of this view's process group
    store_addr: str  # host:port of the TCPStore that every process group rendezvouses on
    bulk_addrs: dict[str, str]  # member id -> address for snapshot traffic
    hosts: dict[str, str]  # member id -> host (failure domain)
    buddies: list[int]  # seat -> the seat whose member keeps a copy of its snapshots
    restore_from: dict[int, str]  # seat -> member id serving its snapshot (seats that changed), or DISK_SOURCE
    # Mesh groups (``rt.device_mesh``) that a seat reported with an unfinished collective: rebuilt with the
    # groups that hold a replaced seat, which every seat works out itself.
    rebuild_groups: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.seats)

    def seat_of(self, member: str) -> int | None:
        """The seat a member sits in, or None for spares and strangers."""
        try:
            return self.seats.index(member)
        except ValueError:
            return None

    def restores_from_disk(self, seat: int) -> bool:
        """The seat's state comes from the disk checkpoint of `resume_step`, not from a member."""
        return self.restore_from.get(seat) == DISK_SOURCE

    def contains(self, member: str) -> bool:
        return member in self.seats or member in self.spares

    def buddy_member(self, seat: int) -> str:
        """The member that keeps the copy of `seat`'s snapshots."""
        return self.seats[self.buddies[seat]]

    def wards_of(self, seat: int) -> list[int]:
        """The seats whose snapshot copies `seat` keeps."""
        return [ward for ward, buddy in enumerate(self.buddies) if buddy == seat and ward != seat]


def place_buddies(seats: Sequence[str], hosts: Mapping[str, str]) -> tuple[list[int], str]:
    """Choose, for every seat, the seat that keeps its snapshot copy.

    A uniform ring offset keeps the load even (every seat holds exactly one
    ward).  The smallest offset (up to MAX_OFFSET) that puts every copy on another host wins, so a
    whole-host loss never takes a seat and its copy together.  Where no offset
    crosses hosts (one host, or hosts too uneven for any ring offset) the
    offset is 1.  Returns the placement and the reason for it.
    """
    world = len(seats)
    if world == 1:
        return [0], "one seat: no buddy, snapshots are local only"
    offset = crossing_offset(seats, hosts)
    if offset is not None:
        return [*range(offset, world), *range(offset)], f"ring offset {offset}: every copy on another host"
    return [*range(1, world), 0], "ring offset 1: one host, copies on the next seat"


def crossing_offset(seats: Sequence[str], hosts: Mapping[str, str]) -> int | None:
    """The smallest ring offset (up to MAX_OFFSET) putting every seat's copy on another host than the seat, or None."""
    world = len(seats)
    host_of = hosts_by_seat(seats, hosts)
    for offset in range(1, min(world, MAX_OFFSET + 1)):
        if crosses_at(host_of, offset):
            return offset
    return None


def hosts_by_seat(seats: Sequence[str], hosts: Mapping[str, str]) -> list[str]:
    """Each seat's host ("": not known), looked up in C."""
    return list(map(hosts.get, seats, itertools.repeat("")))


def crosses_at(host_of: list[str], offset: int) -> bool:
    """Every seat's host (`host_of`, by seat) differs from the host of the seat `offset` further on the ring.

    Seat i against seat i + offset, compared in C without copying the list; a wrong offset usually fails
    within the first host's seats.
    """
    return all(map(operator.ne, host_of, itertools.chain(itertools.islice(host_of, offset, None), host_of)))
