"""SnapshotActor: streams this member's snapshots to its buddy, keeps its wards' copies, serves restores.

- When the compute side finishes a local snapshot (``LocalReady``), the actor
  streams it to the buddy of its seat as one multipart message: an
  authenticated ``SnapshotHeader`` frame followed by zero-copy chunks of the
  arena.  At most one transfer is in flight; a newer snapshot waits for it
  (back-pressure: a slow buddy never makes memory grow).  The buddy's
  ``SnapshotAck`` is published to the compute thread, whose pre-step gate
  waits for it.
- As a buddy, it keeps the two newest complete copies for each ward seat
  (the received frames themselves, no extra copy) and acknowledges each.
- It answers ``RestoreRequest`` from an adopted spare with the copy.
- Messages from members outside the current view are dropped and logged;
  messages from a *newer* view than ours are parked until our view catches up.

Same host: shared memory instead of TCP.  When the buddy runs on the ward's
host and the ward's slot is a shared-memory file (``shm.py``), the header
names the file and no payload follows; the buddy checks the file, maps it
read-only (once per file) and holds the copy as a view of the ward's slot,
without copying it.  A buddy that cannot map it acks with ``error`` and the
ward sends that snapshot, and every later one to that buddy, over the wire.

Confirmed in place.  The ward also writes each header into its slot file's
head block (``shm.write_head``).  Once the buddy has acked a header naming a
slot file (in the current view, for that allocation of the file), it maps that
file for as long as the ward may write it, so a later snapshot in the same
file is held by the buddy the moment the copy and its head are written: the
ward then confirms it to its gate without any message.  With two slots that
is one header and ack per slot file and view, then none.  The buddy learns
what each mapped slot holds by reading its head (``_refresh``) when it is
asked: for every PrepareAck (the runtime thread fills in ``ward_steps``) and
for a restore.  The ward marks a slot's head as being
rewritten (``shm.invalidate_head``) before its arena changes, so a slot whose
old snapshot is being overwritten is neither reported nor served.

Why holding the ward's slot without a copy is safe: the ward has two slots
and rewrites the one holding snapshot k-1 only when it captures k+1, at the
end of step k+1, after that step's gradient all-reduce completed.  Every seat
ran its pre-step gate (``Runtime._gate``) before joining that all-reduce, and
the gate waits until the seat's snapshot k is copied and confirmed by its
buddy (by its ack, or in place once the buddy maps the file).  So when k-1's
slot is rewritten, every seat holds step k (locally, or as its buddy's
confirmed copy) and holds it until it holds k+1, and the restore step
(``decisions.plan_restore``: the newest step held by every seat) is at least
k: k-1 is never requested again.  And the slot of the newest confirmed
snapshot is never rewritten before the next one is confirmed.  A ward killed
mid-copy leaves its newest confirmed slot intact (and the head of the slot it
was rewriting marked as such); the buddy's mapping keeps those pages after
the ward is gone and its file is unlinked.  A buddy keeps a mapped slot until
a newer header names that file (it was reallocated) or the seat is no longer
its ward and no restore needs it: never while the ward may still confirm a
snapshot in it without a message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from deadpool.actors.handoff import Fetch, Handoff, LocalReady, Progress
from deadpool.actors.membership import ViewChanged
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import Message, RestoreReply, RestoreRequest, SnapshotAck, SnapshotHeader
from deadpool.protocol.transport import Transport, TransportError
from deadpool.protocol.view import View
from deadpool.snapshot import shm
from deadpool.snapshot.statetree import Manifest, SpecCache, held_nbytes
from deadpool.snapshot.store import Slot

log = logging.getLogger("deadpool.actors.snapshot_actor")

CHUNK_BYTES = 16 << 20
MAX_SNAPSHOT_BYTES = 64 << 30


@dataclass(frozen=True, slots=True)
class Bulk:
    """A message from a peer on the bulk channel, with its payload frames."""

    message: Message
    frames: list[memoryview]


@dataclass(slots=True)
class WardCopy:
    header: SnapshotHeader  # for a mapped slot: the newest header read from its head block
    frames: list[memoryview]  # the received frames, or chunks of a read-only view of the ward's slot file
    mapping: shm.Mapping | None = None  # the ward's slot file, mapped read-only (a shared copy)
    head_frame: bytes = b""  # the head block's frame `header` was decoded from (b"": the header came by message)
    valid: bool = True  # a mapped slot's head names a complete snapshot (false while the ward rewrites it)

    @property
    def shared(self) -> bool:
        """Held in the ward's shared-memory slot: no memory of its own."""
        return bool(self.header.shm_path)


@dataclass(slots=True)
class _InFlight:
    slot: Slot
    step: int
    generation: str
    sent_at: float
    attempts: int
    epoch: int  # view epoch when this transfer began: acks for headers from older views do not count
    mapped: tuple[str, str, int] | None = None  # (buddy, slot file, allocation) when the buddy is to map it


def payload_chunks(payload: memoryview) -> list[memoryview]:
    return [payload[offset : offset + CHUNK_BYTES] for offset in range(0, len(payload), CHUNK_BYTES)]


class SnapshotActor:
    """Owns the buddy relationship: outgoing copies, incoming ward copies, restores."""

    def __init__(
        self,
        member: str,
        transport: Transport,
        handoff: Handoff,
        progress: Progress,
        events: EventLog,
        secret: bytes | None,
        send_timeout: float,
        resend_after: float = 2.0,
        shm_dir: str = "",
    ) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue(maxsize=64)
        self._member = member
        self._transport = transport
        self._handoff = handoff
        self._progress = progress
        self._events = events
        self._secret = secret
        self._send_timeout = send_timeout
        self._resend_after = resend_after
        self._view: View | None = None
        self._wards: dict[int, list[WardCopy]] = {}
        self._inflight: _InFlight | None = None
        self._next: Slot | None = None
        self._parked: deque[Bulk] = deque(maxlen=16)
        self._fetches: dict[tuple[int, int], concurrent.futures.Future[tuple[Manifest, list[memoryview]]]] = {}
        self._sender: asyncio.Task[None] | None = None
        self._flight_started = asyncio.Event()  # wakes the resend loop, which sleeps while nothing is in flight
        self._shm_dir = shm_dir  # ward files are mapped only from here ("" : no shared-memory copies taken)
        self._shm_refused: set[str] = set()  # buddies that could not map our slots: they get frames
        self._mappings: dict[str, shm.Mapping] = {}  # ward slot file -> its mapping, while a copy lives in it
        self._mapped_by_buddy: set[tuple[str, str, int]] = set()  # (buddy, slot file, allocation) it acked, this view
        self._spec_caches: dict[int, SpecCache] = {}  # ward seat -> its last validated tensor specs
        self.bytes_sent = 0
        self.bytes_held_for_wards = 0  # copies held in memory of our own
        self.bytes_shared_for_wards = 0  # copies held as mappings of a ward's slot (no extra memory)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._resend_loop())
            while True:
                item = await self.inbox.get()
                if isinstance(item, LocalReady):
                    self._on_local(item.slot, tasks)
                elif isinstance(item, ViewChanged):
                    self._on_view(item.view, tasks)
                elif isinstance(item, Fetch):
                    await self._on_fetch(item)
                elif isinstance(item, Bulk):
                    await self._on_bulk(item, tasks)

    # -- outgoing -----------------------------------------------------------------------------

    def _buddy_addr(self) -> str | None:
        view = self._view
        if view is None:
            return None
        seat = view.seat_of(self._member)
        if seat is None or view.world_size < 2:
            return None
        return view.bulk_addrs.get(view.buddy_member(seat))

    def _on_local(self, slot: Slot, tasks: asyncio.TaskGroup) -> None:
        self._progress.snapshot_step = slot.step
        view = self._view
        if view is None or slot.generation != view.store_prefix:
            return  # taken before the current view's rebuild: nobody needs it
        if view.world_size < 2:
            self._handoff.confirm(slot.generation, slot.step)  # no buddy: local only, nothing to wait for
            return
        if self._inflight is None:
            self._start_send(slot, tasks)
        else:
            self._next = slot

    def _start_send(self, slot: Slot, tasks: asyncio.TaskGroup) -> None:
        """Send the snapshot to the buddy, or, when the buddy already maps this slot file, only publish
        its header in the file's head block and count it confirmed (no message, no ack)."""
        view = self._view
        seat = view.seat_of(self._member) if view else None
        if view is None or seat is None:
            return
        buddy = view.buddy_member(seat)
        mapped = None
        if self._shares_memory_with(view, buddy, slot):
            frame = self._header_frame(slot, shared=True)
            # A header too large for the head block cannot describe the slot there: frames instead.
            if frame is not None and slot.head is not None and shm.write_head(slot.head, frame):
                mapped = (buddy, slot.shm_path, slot.allocation)
                if mapped in self._mapped_by_buddy:
                    self._confirmed(slot.generation, slot.step)
                    return
        self._inflight = _InFlight(slot, slot.step, slot.generation, time.monotonic(), 1, view.epoch, mapped)
        self._flight_started.set()
        self._sender = tasks.create_task(self._send_snapshot(self._inflight))

    def _header_frame(self, slot: Slot, shared: bool) -> bytes | None:
        """The encoded header of `slot`'s snapshot: naming its file (`shared`) or followed by the payload."""
        view = self._view
        seat = view.seat_of(self._member) if view else None
        if view is None or seat is None or slot.manifest is None:
            return None
        header = SnapshotHeader(self._member, view.epoch, seat, slot.step, slot.nbytes, slot.manifest.encode(),
                                shm_path=slot.shm_path if shared else "", shm_offset=shm.HEAD_BYTES if shared else 0)
        return codec.encode(header, self._secret)

    def _confirmed(self, generation: str, step: int) -> None:
        self._handoff.confirm(generation, step)
        self._progress.confirmed_step = step

    async def _send_snapshot(self, flight: _InFlight) -> None:
        addr, slot = self._buddy_addr(), flight.slot
        if not slot.complete or slot.step != flight.step or slot.generation != flight.generation:
            return  # the slot was reused: a newer snapshot supersedes this one
        if flight.mapped is not None and flight.mapped[0] in self._shm_refused:
            flight.mapped = None  # the buddy cannot map our slots: it gets frames
        shared = flight.mapped is not None
        frame = self._header_frame(slot, shared)
        if addr is None or frame is None:
            return
        frames: list[Any] = [frame]
        if not shared:
            frames += payload_chunks(slot.payload())  # what the snapshot holds
        try:
            await self._transport.send(addr, frames, self._send_timeout)
            if not shared:
                self.bytes_sent += slot.nbytes
        except TransportError as err:
            log.warning("snapshot of step %d not sent to buddy: %s (will retry)", slot.step, err)

    def _shares_memory_with(self, view: View, buddy: str, slot: Slot) -> bool:
        """The buddy can map the slot: same host, the slot is a shared-memory file, and it never refused."""
        host = view.hosts.get(self._member, "")
        return bool(slot.shm_path and host) and host == view.hosts.get(buddy) and buddy not in self._shm_refused

    async def _resend_loop(self) -> None:
        """Resend the transfer in flight when no ack came within `resend_after` of its send.

        It sleeps until the flight's deadline, or, with nothing in flight, until a
        transfer starts (at most `resend_after`): a transfer is acked within
        milliseconds, so polling four times per `resend_after` woke the runtime
        thread for nothing, and every wake-up costs CPU that training could use.
        """
        while True:
            flight = self._inflight
            if flight is None:
                self._flight_started.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._resend_after):
                        await self._flight_started.wait()
                continue
            wait = flight.sent_at + self._resend_after - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if self._sender is not None and not self._sender.done():
                await asyncio.sleep(self._resend_after / 4)  # still sending it (a slow buddy): look again later
                continue
            log.info("no ack for snapshot of step %d yet; resending (attempt %d)", flight.step, flight.attempts + 1)
            await self._resend(flight)

    def _resend(self, flight: _InFlight) -> Coroutine[Any, Any, None]:
        flight.sent_at = time.monotonic()
        flight.attempts += 1
        return self._send_snapshot(flight)

    def _on_ack(self, ack: SnapshotAck, tasks: asyncio.TaskGroup) -> None:
        view, flight = self._view, self._inflight
        seat = view.seat_of(self._member) if view else None
        if view is None or seat is None or ack.sender != view.buddy_member(seat):
            self._events.emit(Event.REJECTED, reason="ack_from_non_buddy", peer=ack.sender)
            return
        if ack.error:
            self._on_shm_refused(ack, tasks)
            return
        if flight is None or ack.step != flight.step or ack.header_epoch < flight.epoch:
            return  # a late ack for a superseded transfer (or for an older view's header of the same step)
        if flight.mapped is not None:  # later snapshots in this file are confirmed in place
            buddy, path, _ = flight.mapped
            self._mapped_by_buddy = {m for m in self._mapped_by_buddy if m[:2] != (buddy, path)} | {flight.mapped}
        self._confirmed(flight.generation, flight.step)
        self._inflight = None
        pending, self._next = self._next, None
        if pending is not None and pending.complete:
            self._start_send(pending, tasks)

    def _on_shm_refused(self, ack: SnapshotAck, tasks: asyncio.TaskGroup) -> None:
        """The buddy could not map our slot: from now on it gets frames, starting with this snapshot."""
        if ack.sender not in self._shm_refused:
            self._shm_refused.add(ack.sender)
            log.warning("buddy %s cannot map this member's snapshot slots (%s); sending copies over the wire",
                        ack.sender, ack.error)
            self._events.emit(Event.SNAPSHOT_SHM_REFUSED, peer=ack.sender, error=ack.error)
        flight = self._inflight
        if flight is None or ack.step != flight.step:
            return
        self._sender = tasks.create_task(self._resend(flight))

    # -- views --------------------------------------------------------------------------------

    def _on_view(self, view: View, tasks: asyncio.TaskGroup) -> None:
        old = self._view
        self._view = view
        self._mapped_by_buddy.clear()  # the buddy (or its view of us) may have changed: map-and-ack again
        my_seat = view.seat_of(self._member)
        wards = set(view.wards_of(my_seat)) if my_seat is not None else set()
        for seat in list(self._wards):
            # Keep copies for seats we still guard, and any copy a restore may still ask for.
            if seat not in wards and seat not in view.restore_from:
                del self._wards[seat]
        for seat in [seat for seat in self._spec_caches if seat not in wards]:
            del self._spec_caches[seat]
        self._update_holdings()
        if old is None or old.store_prefix != view.store_prefix:
            self._inflight, self._next = None, None  # the compute side re-announces after its rebuild
        parked, self._parked = list(self._parked), deque(maxlen=16)
        for item in parked:
            self.inbox.put_nowait(item)

    def ward_steps(self) -> dict[int, list[int]]:
        """Seat -> steps of the complete copies held for it, read from the mapped slots' heads now.

        The runtime thread puts this into every PrepareAck: a same-host ward's newest
        snapshots were never announced by message."""
        view = self._view
        if view is not None:
            for seat in self._wards:
                self._refresh(seat, view)
        return {seat: sorted({c.header.step for c in copies if c.valid}) for seat, copies in self._wards.items()}

    def _refresh(self, seat: int, view: View) -> None:
        """Read what each mapped slot of `seat` holds now from its head block (``shm.read_head``)."""
        for copy in self._wards.get(seat, []):
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
            self._events.emit(Event.REJECTED, reason=problem[0], peer=copy.header.sender, seat=seat, detail=problem[1],
                              kind="slot_head")

    def _update_holdings(self) -> None:
        """Memory report, and unmap slot files no copy lives in any more."""
        held = [c for copies in self._wards.values() for c in copies]
        self.bytes_held_for_wards = sum(c.header.nbytes for c in held if not c.shared)
        self.bytes_shared_for_wards = sum(c.header.nbytes for c in held if c.shared)
        live = {c.header.shm_path for c in held if c.shared}
        for path in [path for path in self._mappings if path not in live]:
            del self._mappings[path]  # unmapped once the last view of it (e.g. a restore being sent) is gone

    # -- incoming bulk ------------------------------------------------------------------------

    async def _on_bulk(self, item: Bulk, tasks: asyncio.TaskGroup) -> None:
        message = item.message
        view = self._view
        epoch = getattr(message, "epoch", 0)
        if view is None or epoch > view.epoch:
            self._parked.append(item)  # from a view we have not heard of yet
            return
        if isinstance(message, SnapshotHeader):
            await self._on_ward_copy(message, item.frames, view)
        elif isinstance(message, SnapshotAck):
            self._on_ack(message, tasks)
        elif isinstance(message, RestoreRequest):
            await self._on_restore_request(message, view)
        elif isinstance(message, RestoreReply):
            self._on_restore_reply(message, item.frames)
        else:
            self._events.emit(Event.REJECTED, reason="unexpected_type", detail=type(message).__name__)

    async def _on_ward_copy(self, header: SnapshotHeader, frames: list[memoryview], view: View) -> None:
        if header.shm_path and frames:
            self._events.emit(Event.REJECTED, reason="unexpected_frames", peer=header.sender, kind="shm_snapshot")
            return
        if not header.shm_path and sum(len(f) for f in frames) != header.nbytes:
            self._events.emit(Event.REJECTED, reason="size_mismatch", peer=header.sender)
            return
        problem = self._check_ward_header(header, view)
        if problem is not None:
            self._events.emit(Event.REJECTED, reason=problem[0], peer=header.sender, seat=header.seat,
                              detail=problem[1])
            return
        mapping = None
        if header.shm_path:
            try:
                mapping = shm.map_readonly(header.shm_path, self._shm_dir, header.shm_offset, header.nbytes,
                                           self._mappings.get(header.shm_path))
            except shm.ShmRefused as err:
                self._events.emit(Event.REJECTED, reason="bad_shm_path", peer=header.sender, detail=str(err))
                await self._send_ack(view, header, error=str(err))
                return
            self._mappings[header.shm_path] = mapping
            frames = payload_chunks(mapping.view[header.shm_offset : header.shm_offset + header.nbytes])
            if header.shm_offset < shm.HEAD_BYTES:
                mapping = None  # no head block before the payload: this copy is what the header says, no more
        copies = [c for c in self._wards.get(header.seat, []) if c.header.sender == header.sender]
        if header.shm_path:
            # The copy that lived in the file this header names is gone: the ward rewrote that slot.
            copies = [c for c in copies if c.header.shm_path != header.shm_path]
        else:
            copies = [c for c in copies if c.header.step != header.step or c.shared]
        copies.append(WardCopy(header, frames, mapping))
        # A mapped slot stays mapped while the ward may still confirm snapshots in it without a message;
        # copies received as frames: the two newest.
        received = sorted((c for c in copies if not c.shared), key=lambda c: c.header.step)[-2:]
        self._wards[header.seat] = sorted([c for c in copies if c.shared] + received, key=lambda c: c.header.step)
        self._update_holdings()
        await self._send_ack(view, header)

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

    async def _send_ack(self, view: View, header: SnapshotHeader, error: str = "") -> None:
        ack = SnapshotAck(self._member, view.epoch, header.seat, header.step, error[:500], header.epoch)
        addr = view.bulk_addrs.get(header.sender)
        if addr is not None:
            try:
                await self._transport.send(addr, [codec.encode(ack, self._secret)], self._send_timeout)
            except TransportError as err:
                log.warning("ack for seat %d step %d not sent: %s", header.seat, header.step, err)

    async def _on_restore_request(self, request: RestoreRequest, view: View) -> None:
        if not 0 <= request.seat < view.world_size or view.seats[request.seat] != request.sender:
            self._events.emit(Event.REJECTED, reason="not_in_view", peer=request.sender, kind="restore_request")
            return
        self._refresh(request.seat, view)
        copy = next((c for c in self._wards.get(request.seat, []) if c.valid and c.header.step == request.step), None)
        if copy is None:
            held = [c.header.step for c in self._wards.get(request.seat, []) if c.valid]
            reply = RestoreReply(self._member, request.epoch, request.seat, request.step, False,
                                 f"no copy of seat {request.seat} step {request.step} here (held: {held})")
            frames: list[Any] = [codec.encode(reply, self._secret)]
        else:
            # Served as frames even when held in shared memory: the requester may be on another host.
            header = dataclasses.replace(copy.header, shm_path="", shm_offset=0)
            reply = RestoreReply(self._member, request.epoch, request.seat, request.step, True, "", header)
            frames = [codec.encode(reply, self._secret), *copy.frames]
        try:
            await self._transport.send(request.reply_to, frames, self._send_timeout)
        except TransportError as err:
            log.warning("restore reply to %s not sent: %s", request.sender, err)

    # -- restores for this member -------------------------------------------------------------

    async def _on_fetch(self, fetch: Fetch) -> None:
        view = self._view
        addr = view.bulk_addrs.get(fetch.member) if view else None
        if view is None or addr is None:
            fetch.future.set_exception(LookupError(f"no address for member {fetch.member}"))
            return
        self._fetches[(fetch.seat, fetch.step)] = fetch.future
        request = RestoreRequest(self._member, view.epoch, fetch.seat, fetch.step, self._transport.address)
        try:
            await self._transport.send(addr, [codec.encode(request, self._secret)], self._send_timeout)
        except TransportError as err:
            self._fetches.pop((fetch.seat, fetch.step), None)
            fetch.future.set_exception(LookupError(f"restore request to {fetch.member} failed: {err}"))

    def _on_restore_reply(self, reply: RestoreReply, frames: list[memoryview]) -> None:
        future = self._fetches.pop((reply.seat, reply.step), None)
        if future is None or future.done():
            return
        if not reply.ok or reply.header is None:
            future.set_exception(LookupError(reply.error or "restore refused"))
            return
        if sum(len(f) for f in frames) != reply.header.nbytes:
            future.set_exception(LookupError("restore payload size does not match its header"))
            return
        try:
            manifest = Manifest.decode(reply.header.manifest, MAX_SNAPSHOT_BYTES)
        except ValueError as err:
            future.set_exception(LookupError(f"bad manifest in restore reply: {err}"))
            return
        future.set_result((manifest, frames))
