"""A buddy's copies of its wards' snapshots: what it keeps, what it reports, what it serves.

Synchronous and without I/O of its own: the SnapshotActor hands it every
ward header it receives and asks it what it holds (for a PrepareAck) and for
a copy (for a restore).  A copy is either the frames received over the wire
(the newest few per ward) or a read-only mapping of the ward's shared-memory
slot file, whose head block says which snapshot it holds now: a mapped slot
is re-read (``refresh``) whenever the question is asked, because a same-host
ward confirms later snapshots in it without a message.  Why holding the
ward's slot without a copy is safe is argued in ``docs/design/snapshots.md``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import SnapshotHeader
from deadpool.protocol.view import View
from deadpool.snapshot import shm
from deadpool.snapshot.statetree import Manifest, SpecCache, held_nbytes

log = logging.getLogger("deadpool.snapshot.ward_copies")

CHUNK_BYTES = 16 << 20  # a snapshot travels (and a held copy is kept) as frames of at most this many bytes
MAX_SNAPSHOT_BYTES = 64 << 30  # a manifest declaring more is refused


def payload_chunks(payload: memoryview) -> list[memoryview]:
    """`payload` as zero-copy frames of at most CHUNK_BYTES."""
    return [payload[offset : offset + CHUNK_BYTES] for offset in range(0, len(payload), CHUNK_BYTES)]


@dataclass(slots=True)
class WardCopy:
    """One snapshot of a ward held by its buddy."""

    header: SnapshotHeader  # for a mapped slot: the newest header read from its head block
    frames: list[memoryview]  # the received frames, or chunks of a read-only view of the ward's slot file
    mapping: shm.Mapping | None = None  # the ward's slot file, mapped read-only (a shared copy)
    head_frame: bytes = b""  # the head block's frame `header` was decoded from (b"": the header came by message)
    valid: bool = True  # a mapped slot's head names a complete snapshot (false while the ward rewrites it)

    @property
    def shared(self) -> bool:
        """Held in the ward's shared-memory slot: no memory of its own."""
        return bool(self.header.shm_path)


@dataclass(frozen=True, slots=True)
class Taken:
    """What became of a ward's header: whether to acknowledge it, and with which error."""

    ack: bool  # False: refused (logged as an event); nothing to acknowledge
    error: str = ""  # with ack: the slot file could not be mapped, the ward is to send frames instead


class WardCopies:
    """The copies one member holds for its ward seats, and the slot files it maps for them."""

    def __init__(self, member: str, secret: bytes | None, shm_dir: str, events: EventLog, depth: int = 2) -> None:
        self._member = member
        self._depth = depth  # copies received as frames kept per ward: as many as the ward keeps snapshots
        self._secret = secret
        self._shm_dir = shm_dir  # ward files are mapped only from here ("" : no shared-memory copies taken)
        self._events = events
        self.by_seat: dict[int, list[WardCopy]] = {}  # oldest step first
        self.mappings: dict[str, shm.Mapping] = {}  # ward slot file -> its mapping, while a copy lives in it
        self._spec_caches: dict[int, SpecCache] = {}  # ward seat -> its last validated tensor specs
        self.bytes_held = 0  # copies held in memory of our own
        self.bytes_shared = 0  # copies held as mappings of a ward's slot (no extra memory)

    # -- taking copies ------------------------------------------------------------------------

    def take(self, header: SnapshotHeader, frames: list[memoryview], view: View) -> Taken:
        """Check a ward's header (and its payload `frames`, or the slot file it names) and keep the copy."""
        if header.shm_path and frames:
            self._events.emit(schema.Rejected(reason="unexpected_frames", peer=header.sender, kind="shm_snapshot"))
            return Taken(ack=False)
        if not header.shm_path and sum(len(f) for f in frames) != header.nbytes:
            self._events.emit(schema.Rejected(reason="size_mismatch", peer=header.sender))
            return Taken(ack=False)
        problem = self._check_ward_header(header, view)
        if problem is not None:
            self._events.emit(schema.Rejected(reason=problem[0], peer=header.sender, seat=header.seat,
                              detail=problem[1]))
            return Taken(ack=False)
        mapping = None
        if header.shm_path:
            try:
                mapping = shm.map_readonly(header.shm_path, self._shm_dir, header.shm_offset, header.nbytes,
                                           self.mappings.get(header.shm_path))
            except shm.ShmRefused as err:
                self._events.emit(schema.Rejected(reason="bad_shm_path", peer=header.sender, detail=str(err)))
                return Taken(ack=True, error=str(err))
            self.mappings[header.shm_path] = mapping
            frames = payload_chunks(mapping.view[header.shm_offset : header.shm_offset + header.nbytes])
            if header.shm_offset < shm.HEAD_BYTES:
                mapping = None  # no head block before the payload: this copy is what the header says, no more
        copies = [c for c in self.by_seat.get(header.seat, []) if c.header.sender == header.sender]
        if header.shm_path:
            # The copy that lived in the file this header names is gone: the ward rewrote that slot.
            copies = [c for c in copies if c.header.shm_path != header.shm_path]
        else:
            copies = [c for c in copies if c.header.step != header.step or c.shared]
        copies.append(WardCopy(header, frames, mapping))
        # A mapped slot stays mapped while the ward may still confirm snapshots in it without a message;
        # copies received as frames: the newest `depth` (two, or more where replica checks may roll back further).
        received = sorted((c for c in copies if not c.shared), key=lambda c: c.header.step)[-self._depth:]
        self.by_seat[header.seat] = sorted([c for c in copies if c.shared] + received, key=lambda c: c.header.step)
        self._update_holdings()
        return Taken(ack=True)

    def _check_ward_header(self, header: SnapshotHeader, view: View) -> tuple[str, str] | None:
        """Why a ward's header is refused (reason, detail), or None."""
        my_seat = view.seat_of(self._member)
        if not 0 <= header.seat < view.world_size or view.seats[header.seat] != header.sender:
            return "not_in_view", f"{header.sender} is not seat {header.seat} here"
        if my_seat is None or view.buddies[header.seat] != my_seat:
            return "not_my_ward", f"seat {header.seat}"
        return self._check_layout(header, view.world_size)

    def _check_head(self, header: SnapshotHeader, copy: WardCopy, world: int) -> tuple[str, str] | None:
        """Why a header read from a mapped slot's head is refused, or None.

        It must come from the ward the slot was accepted from (which may have died since: its
        seat then belongs to a spare) and describe a payload inside that file, after the head."""
        accepted, mapping = copy.header, copy.mapping
        assert mapping is not None
        if (header.sender, header.seat, header.shm_path) != (accepted.sender, accepted.seat, mapping.path):
            return "not_my_ward", f"{header.sender} seat {header.seat} in {accepted.sender}'s slot file"
        if header.shm_offset < shm.HEAD_BYTES or header.shm_offset + header.nbytes > mapping.size:
            return "size_mismatch", f"{header.nbytes} bytes at {header.shm_offset} of a {mapping.size}-byte file"
        return self._check_layout(header, world)

    def _check_layout(self, header: SnapshotHeader, world: int) -> tuple[str, str] | None:
        try:
            # Validated in full whenever its tensor specs differ from this seat's previous (valid) header.
            manifest = Manifest.decode(header.manifest, MAX_SNAPSHOT_BYTES,
                                       self._spec_caches.setdefault(header.seat, SpecCache()))
        except ValueError as err:
            return "bad_manifest", str(err)
        held = held_nbytes(manifest, header.seat, world)
        if header.nbytes != held:
            return "size_mismatch", f"{header.nbytes} bytes where seat {header.seat} holds {held}"
        return None

    # -- what is held -------------------------------------------------------------------------

    def steps(self, view: View | None) -> dict[int, list[int]]:
        """Seat -> steps of the complete copies held for it, read from the mapped slots' heads now.

        What a PrepareAck reports: a same-host ward's newest snapshots were never announced by message."""
        if view is not None:
            for seat in self.by_seat:
                self.refresh(seat, view)
        return {seat: sorted({c.header.step for c in copies if c.valid}) for seat, copies in self.by_seat.items()}

    def find(self, seat: int, step: int | None, view: View) -> WardCopy | None:
        """The complete copy of `seat`'s snapshot of `step` (None: the newest), as its slot's head says now."""
        self.refresh(seat, view)
        valid = [c for c in self.by_seat.get(seat, []) if c.valid and step in (None, c.header.step)]
        return max(valid, key=lambda c: c.header.step, default=None)

    def held_steps(self, seat: int) -> list[int]:
        """Steps of the complete copies held for `seat`, as last refreshed (for messages to people)."""
        return [c.header.step for c in self.by_seat.get(seat, []) if c.valid]

    def refresh(self, seat: int, view: View) -> None:
        """Read what each mapped slot of `seat` holds now from its head block (``shm.read_head``)."""
        for copy in self.by_seat.get(seat, []):
            if copy.mapping is None:
                continue
            frame = shm.read_head(copy.mapping.view[: shm.HEAD_BYTES])
            if frame is None:
                copy.valid = False  # being rewritten: what it held is gone, the next snapshot is not there yet
                continue
            if frame == copy.head_frame:
                copy.valid = True  # the header accepted last time (the same step written again, or no change)
                continue
            header = codec.decode(frame, self._secret)
            problem: tuple[str, str] | None
            if not isinstance(header, SnapshotHeader):
                problem = ("bad_head", str(header))
            elif (problem := self._check_head(header, copy, view.world_size)) is None:
                copy.header, copy.valid, copy.head_frame = header, True, frame
                copy.frames = payload_chunks(copy.mapping.view[header.shm_offset : header.shm_offset + header.nbytes])
                continue
            copy.valid, copy.head_frame = False, b""
            self._events.emit(schema.Rejected(reason=problem[0], peer=copy.header.sender, seat=seat, detail=problem[1],
                              kind="slot_head"))

    # -- letting go ---------------------------------------------------------------------------

    def on_view(self, view: View) -> None:
        """Keep copies for the seats we still guard, and any copy a restore in `view` may still ask for."""
        my_seat = view.seat_of(self._member)
        wards = set(view.wards_of(my_seat)) if my_seat is not None else set()
        for seat in list(self.by_seat):
            if seat not in wards and seat not in view.restore_from:
                del self.by_seat[seat]
        for seat in [seat for seat in self._spec_caches if seat not in wards]:
            del self._spec_caches[seat]
        self._update_holdings()

    def clear(self) -> None:
        """Drop every copy and mapping (the actor stopped)."""
        self.by_seat.clear()
        self._spec_caches.clear()
        self._update_holdings()

    def _update_holdings(self) -> None:
        """Memory report, and unmap slot files no copy lives in any more."""
        held = [c for copies in self.by_seat.values() for c in copies]
        self.bytes_held = sum(c.header.nbytes for c in held if not c.shared)
        self.bytes_shared = sum(c.header.nbytes for c in held if c.shared)
        live = {c.header.shm_path for c in held if c.shared}
        for path in [path for path in self.mappings if path not in live]:
            del self.mappings[path]  # unmapped once the last view of it (e.g. a restore being sent) is gone
