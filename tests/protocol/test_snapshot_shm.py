"""Same-host buddy copies through shared memory (``snapshot/shm.py``, ``arena.py``, ``ward_copies.py``), and the
SnapshotActor that streams, keeps and serves them (``actors/snapshot_actor.py``).

Fast tests, no processes: slot files are allocated, validated and mapped in
this process; two SnapshotActors talk over the in-process transport, as a
ward and its buddy on one host, and the buddy says what it holds the way it
does for a Prepare (a ``PrepareReady`` in, a ``PrepareAck`` out).  The
end-to-end kill scenario with the TCP path forced on one host is in
``tests/e2e/test_hotswap.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import stat
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from deadpool.actors.handoff import Fetch, Handoff, LocalReady, PrepareReady, Progress
from deadpool.actors.inbox import Bulk, Drain, Outbound, ViewChanged
from deadpool.actors.snapshot_actor import SnapshotActor
from deadpool.errors import ActorStopped, RestoreFailed
from deadpool.events.log import EventLog
from deadpool.protocol import codec
from deadpool.protocol.messages import PrepareAck, RestoreReply, RestoreRequest, SnapshotHeader
from deadpool.protocol.transport import Limits, Transport, open_transport
from deadpool.protocol.view import View
from deadpool.snapshot import shm
from deadpool.snapshot.arena import Slot
from deadpool.snapshot.statetree import Manifest, materialize
from deadpool.snapshot.store import SnapshotStore

pytestmark = pytest.mark.timeout(30)

WARD, BUDDY = "host:rank0:aaaaaa", "host:rank1:bbbbbb"
GENERATION = "epoch-1"
BULK = Limits(max_frame_bytes=(16 << 20) + (1 << 20), max_frames=4097, inbox_size=8, send_hwm=8)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private directory on tmpfs where there is one (the real case), else on disk."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="dp-shm-test-", dir=base)
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def _state(seed: int, rows: int = 64) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 32, generator=generator), "step": seed, "b": torch.arange(7)}


def _capture(store: SnapshotStore, step: int, state: dict[str, Any]) -> Slot:
    slot = store.capture(step, GENERATION, state, set())
    store.wait_copy(10.0)
    assert slot.complete
    return slot


# -- allocation -------------------------------------------------------------------------------


def test_cpu_slots_are_private_shared_memory_files_removed_on_close(shm_dir: str) -> None:
    store = SnapshotStore(on_complete=lambda _: None, shm_dir=shm_dir, member=WARD)
    try:
        state = _state(1)
        first = _capture(store, 0, state)
        second = _capture(store, 1, _state(2))
        assert first.shm_path != second.shm_path
        for slot in (first, second):
            assert slot.shm_path == shm.slot_path(shm_dir, WARD, os.getpid(), slot.index)
            assert os.path.basename(slot.shm_path).startswith(f"deadpool-host_rank0_aaaaaa-{os.getpid()}-slot")
            info = os.lstat(slot.shm_path)
            assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
            assert slot.manifest is not None and info.st_size >= slot.manifest.nbytes
        # The file is the head block and the arena: what the copy wrote is what a reader of the file sees.
        assert first.manifest is not None
        on_file = Path(first.shm_path).read_bytes()[shm.HEAD_BYTES : shm.HEAD_BYTES + first.manifest.nbytes]
        assert on_file == bytes(first.payload())
        restored = materialize(first.manifest, torch.frombuffer(bytearray(on_file), dtype=torch.uint8))
        assert torch.equal(restored["w"], state["w"]) and restored["step"] == 1
    finally:
        store.close()
    assert os.listdir(shm_dir) == []


def test_growing_snapshot_reallocates_and_unlinks_the_old_file(shm_dir: str) -> None:
    store = SnapshotStore(on_complete=lambda _: None, shm_dir=shm_dir, member=WARD)
    try:
        slot = _capture(store, 0, _state(1, rows=8))
        _capture(store, 1, _state(2, rows=8))
        old_inode = os.stat(slot.shm_path).st_ino
        bigger = _capture(store, 2, _state(3, rows=4096))  # reuses slot 0's index, needs a larger arena
        assert bigger.index == slot.index and bigger.shm_path == slot.shm_path
        assert os.stat(bigger.shm_path).st_ino != old_inode
        assert bigger.manifest is not None and os.stat(bigger.shm_path).st_size >= bigger.manifest.nbytes
        assert len(os.listdir(shm_dir)) == 2
    finally:
        store.close()


def test_unusable_shm_dir_falls_back_to_private_memory_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "no-such-dir")
    store = SnapshotStore(on_complete=lambda _: None, shm_dir=missing, member=WARD)
    try:
        with caplog.at_level(logging.WARNING, logger="deadpool.snapshot.arena"):
            state = _state(1)
            first = _capture(store, 0, state)
            second = _capture(store, 1, _state(2))
        assert first.shm_path == second.shm_path == ""
        assert first.mapping is None and first.arena is not None
        assert first.manifest is not None
        assert torch.equal(materialize(first.manifest, first.arena)["w"], state["w"])
        assert len([r for r in caplog.records if "private memory" in r.getMessage()]) == 1
    finally:
        store.close()


def test_full_tmpfs_fails_at_allocation_not_later(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    store = SnapshotStore(on_complete=lambda _: None, shm_dir=shm_dir, member=WARD)
    try:
        slot = _capture(store, 0, _state(1))
        assert slot.shm_path == "" and slot.arena is not None
        assert os.listdir(shm_dir) == [], "the half-made file is removed"
    finally:
        store.close()


def test_remove_files_removes_one_workers_files_only(shm_dir: str) -> None:
    mine = [shm.slot_path(shm_dir, WARD, 123, i) for i in (0, 1)]
    others = [shm.slot_path(shm_dir, WARD, 1123, 0), shm.slot_path(shm_dir, BUDDY, 123, 0)]
    for path in mine + others:
        shm.create(path, 4096).close()
    assert sorted(shm.remove_files(shm_dir, WARD, 123)) == sorted(mine)
    assert sorted(os.listdir(shm_dir)) == sorted(os.path.basename(p) for p in others)
    assert shm.remove_files("", WARD, 123) == []


# -- the reader's checks ----------------------------------------------------------------------


def _slot_file(shm_dir: str, nbytes: int = 4096, fill: bytes = b"\x07") -> str:
    path = shm.slot_path(shm_dir, WARD, 4242, 0)
    mapping = shm.create(path, nbytes)
    mapping[:] = fill * nbytes
    mapping.close()
    return path


def test_map_readonly_maps_a_valid_file_and_reuses_the_mapping(shm_dir: str) -> None:
    path = _slot_file(shm_dir)
    mapping = shm.map_readonly(path, shm_dir, 0, 4096, None)
    assert mapping.view.readonly and bytes(mapping.view[:4]) == b"\x07" * 4
    assert shm.map_readonly(path, shm_dir, 100, 3996, mapping) is mapping
    shm.unlink(path)
    replaced = _slot_file(shm_dir, fill=b"\x09")  # same name, new file: mapped afresh
    again = shm.map_readonly(replaced, shm_dir, 0, 4096, mapping)
    assert again is not mapping and bytes(again.view[:1]) == b"\x09"


@pytest.mark.parametrize("case", ["outside_dir", "not_normalized", "wrong_prefix", "symlink", "directory",
                                  "too_small", "negative_offset", "missing", "disabled"])
def test_map_readonly_refuses_files_it_may_not_trust(shm_dir: str, tmp_path: Path, case: str) -> None:
    path = _slot_file(shm_dir)
    directory, offset, nbytes = shm_dir, 0, 4096
    if case == "outside_dir":
        other = tmp_path / os.path.basename(path)
        other.write_bytes(b"\x00" * 4096)
        path = str(other)
    elif case == "not_normalized":
        path = os.path.join(shm_dir, "sub", "..", os.path.basename(path))
    elif case == "wrong_prefix":
        renamed = os.path.join(shm_dir, "other-slot0")
        os.rename(path, renamed)
        path = renamed
    elif case == "symlink":
        link = os.path.join(shm_dir, "deadpool-link-1-slot0")
        os.symlink(path, link)
        path = link
    elif case == "directory":
        path = os.path.join(shm_dir, "deadpool-dir-1-slot0")
        os.mkdir(path)
    elif case == "too_small":
        nbytes = 4097
    elif case == "negative_offset":
        offset = -1
    elif case == "missing":
        path = os.path.join(shm_dir, "deadpool-gone-1-slot0")
    elif case == "disabled":
        directory = ""
    try:
        with pytest.raises(shm.ShmRefused):
            shm.map_readonly(path, directory, offset, nbytes, None)
    finally:
        if case == "directory":
            os.rmdir(path)


def test_a_mapping_outlives_the_writer_unlinking_its_file(shm_dir: str) -> None:
    path = _slot_file(shm_dir, fill=b"\x05")
    mapping = shm.map_readonly(path, shm_dir, 0, 4096, None)
    held = mapping.view[10:20]
    del mapping
    shm.unlink(path)  # what the agent does after the ward exited
    assert not os.path.exists(path)
    assert bytes(held) == b"\x05" * 10


# -- ward and buddy actors on one host --------------------------------------------------------


class Pair:
    """A ward (seat 0) and its buddy (seat 1) on one host, each a SnapshotActor on inproc transports."""

    def __init__(self, ward_shm_dir: str, buddy_shm_dir: str) -> None:
        self.transports: dict[str, Transport] = {}
        self.handoffs = {m: Handoff() for m in (WARD, BUDDY)}
        self.events = {m: EventLog(None, member=m) for m in (WARD, BUDDY)}
        for log in self.events.values():
            log.records = []
        self.actors: dict[str, SnapshotActor] = {}
        self.progress = {m: Progress() for m in (WARD, BUDDY)}
        self.to_membership: dict[str, list[Outbound | Drain]] = {WARD: [], BUDDY: []}
        self.received: dict[str, list[Any]] = {WARD: [], BUDDY: []}
        self.tasks: list[asyncio.Task[None]] = []
        self.store = SnapshotStore(on_complete=lambda _: None, shm_dir=ward_shm_dir, member=WARD)
        for member, directory in ((WARD, ward_shm_dir), (BUDDY, buddy_shm_dir)):
            transport = open_transport(f"inproc://shm-{uuid.uuid4().hex}", BULK)
            self.transports[member] = transport
            self.actors[member] = SnapshotActor(member, transport, self.handoffs[member], self.progress[member],
                                                self.events[member], b"secret", send_timeout=2.0,
                                                shm_dir=directory, to_membership=self.to_membership[member].append)

    def view(self, hosts: tuple[str, str] = ("host", "host"), epoch: int = 1) -> View:
        return View(epoch=epoch, seats=[WARD, BUDDY], spares=[], resume_step=-1, store_prefix=GENERATION,
                    store_addr="127.0.0.1:1", bulk_addrs={m: t.address for m, t in self.transports.items()},
                    hosts={WARD: hosts[0], BUDDY: hosts[1]}, buddies=[1, 0], restore_from={})

    async def start(self, view: View) -> None:
        for member, actor in self.actors.items():
            self.tasks.append(asyncio.create_task(actor.run()))
            self.tasks.append(asyncio.create_task(self._read(self.transports[member], actor, self.received[member])))
            actor.inbox.post(ViewChanged(view))

    @staticmethod
    async def _read(transport: Transport, actor: SnapshotActor, received: list[Any] | None = None) -> None:
        """What RuntimeThread._read does for the bulk transport."""
        while True:
            frames = await transport.recv()
            message = codec.decode(frames[0], b"secret")
            assert not isinstance(message, codec.DecodeError), message
            if received is not None:
                received.append(message)
            await actor.inbox.put(Bulk(message, frames[1:]))

    def headers_received(self) -> list[int]:
        """Steps of the snapshot headers the buddy was sent."""
        return [m.step for m in self.received[BUDDY] if isinstance(m, SnapshotHeader)]

    async def send(self, step: int, state: dict[str, Any]) -> Slot:
        slot = _capture(self.store, step, state)
        self.actors[WARD].inbox.post(LocalReady(slot))
        await until(lambda: self.handoffs[WARD].is_confirmed(GENERATION, step))
        return slot

    async def ward_steps(self, member: str = BUDDY) -> dict[int, list[int]]:
        """What `member` reports for its wards when the compute thread stops for a Prepare."""
        sent = self.to_membership[member]
        before = len(sent)
        self.actors[member].inbox.post(PrepareReady(9, 5, 5, [4, 5], [3]))
        await until(lambda: len(sent) > before)
        (item,) = sent[before:]
        assert isinstance(item, Outbound) and isinstance(item.message, PrepareAck), item
        ack = item.message
        assert (ack.sender, ack.epoch, ack.step, ack.local_steps, ack.disk_steps) == (member, 9, 5, [4, 5], [3])
        return ack.ward_steps

    def held(self) -> dict[int, list[Any]]:
        return self.actors[BUDDY]._wards.by_seat

    def events_of(self, member: str, kind: str) -> list[dict[str, Any]]:
        records = self.events[member].records
        assert records is not None
        return [r.fields() for r in records if r.event == kind]

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for transport in self.transports.values():
            await transport.close()
        self.store.close()


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest_asyncio.fixture
async def make_pair() -> AsyncIterator[Callable[[str, str], Pair]]:
    pairs: list[Pair] = []

    def make(ward_shm_dir: str, buddy_shm_dir: str) -> Pair:
        pair = Pair(ward_shm_dir, buddy_shm_dir)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        await pair.aclose()


def _copy_bytes(copy: Any) -> bytes:
    return b"".join(bytes(frame) for frame in copy.frames)


async def test_same_host_buddy_maps_the_slot_instead_of_receiving_it(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    slot = await pair.send(0, _state(1))
    (copy,) = pair.held()[0]
    assert copy.shared and copy.header.shm_path == slot.shm_path
    assert all(frame.readonly for frame in copy.frames)
    assert _copy_bytes(copy) == bytes(slot.payload())
    ward, buddy = pair.progress[WARD], pair.progress[BUDDY]
    assert ward.bytes_sent == 0, "nothing streamed"
    assert buddy.bytes_held_for_wards == 0 and buddy.bytes_shared_for_wards == copy.header.nbytes
    assert await pair.ward_steps() == {0: [0]}


async def test_a_mapped_slot_is_confirmed_in_place_and_its_head_says_what_it_holds(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    """Once the buddy mapped both slot files (one header and ack each), later snapshots cost no message:
    the ward publishes each header in its slot's head block and counts it confirmed; the buddy reads
    the heads when asked what it holds, and serves what they name."""
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    buddy = pair.actors[BUDDY]
    first = await pair.send(0, _state(1))
    second = await pair.send(1, _state(2))
    assert pair.headers_received() == [0, 1]
    third = await pair.send(2, _state(3))  # rewrites step 0's slot
    fourth = await pair.send(3, _state(4))
    assert (third.shm_path, fourth.shm_path) == (first.shm_path, second.shm_path)
    assert pair.headers_received() == [0, 1], "steps 2 and 3 were confirmed without a message"
    assert await pair.ward_steps() == {0: [2, 3]}
    assert [_copy_bytes(c) for c in pair.held()[0]] == [bytes(third.payload()), bytes(fourth.payload())]
    assert set(buddy._wards.mappings) == {first.shm_path, second.shm_path}
    # The ward rewrites step 2's slot: from then on it is not held (nor reported) until the ward
    # publishes the new snapshot's header there.
    _capture(pair.store, 4, _state(5))
    assert await pair.ward_steps() == {0: [3]}
    pair.actors[WARD].inbox.post(LocalReady(third))
    await until(lambda: pair.handoffs[WARD].is_confirmed(GENERATION, 4))
    assert await pair.ward_steps() == {0: [3, 4]} and pair.headers_received() == [0, 1]


async def test_a_slot_being_rewritten_is_neither_reported_nor_served(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    buddy = pair.actors[BUDDY]
    first = await pair.send(0, _state(1))
    await pair.send(1, _state(2))
    assert first.head is not None
    shm.invalidate_head(first.head)  # what capture does before the copy overwrites the slot
    assert await pair.ward_steps() == {0: [1]}
    buddy._on_restore_request(RestoreRequest(WARD, 1, 0, 0, pair.transports[WARD].address), pair.view())
    await until(lambda: any(isinstance(m, RestoreReply) for m in pair.received[WARD]))
    reply = next(m for m in pair.received[WARD] if isinstance(m, RestoreReply))
    assert not reply.ok and "held: [1]" in reply.error


async def test_snapshots_after_a_view_change_are_announced_again(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    """A new view may bring a new buddy, or one that dropped its mappings: each slot is mapped and acked
    again before its snapshots are confirmed in place."""
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    for step in range(3):
        await pair.send(step, _state(step))
    assert pair.headers_received() == [0, 1]
    for actor in pair.actors.values():
        actor.inbox.post(ViewChanged(pair.view(epoch=2)))
    for step in range(3, 6):
        await pair.send(step, _state(step))
    assert pair.headers_received() == [0, 1, 3, 4]
    assert await pair.ward_steps() == {0: [4, 5]}


async def test_a_forged_or_foreign_head_is_refused(shm_dir: str, make_pair: Callable[[str, str], Pair]) -> None:
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    first = await pair.send(0, _state(1))
    await pair.send(1, _state(2))
    assert first.head is not None and first.manifest is not None
    header = SnapshotHeader(WARD, 1, 0, 7, first.nbytes, first.manifest.encode(), shm_path=first.shm_path,
                            shm_offset=shm.HEAD_BYTES)
    assert shm.write_head(first.head, codec.encode(header, b"not the secret"))
    assert await pair.ward_steps() == {0: [1]}
    other = dataclasses.replace(header, sender=BUDDY)  # a header naming another member, in the ward's file
    assert shm.write_head(first.head, codec.encode(other, b"secret"))
    assert await pair.ward_steps() == {0: [1]}
    beyond = dataclasses.replace(header, shm_offset=shm.HEAD_BYTES + (1 << 30))
    assert shm.write_head(first.head, codec.encode(beyond, b"secret"))
    assert await pair.ward_steps() == {0: [1]}
    reasons = [(r["reason"], r.get("kind")) for r in pair.events_of(BUDDY, "rejected")]
    assert reasons == [("bad_head", "slot_head"), ("not_my_ward", "slot_head"), ("size_mismatch", "slot_head")]
    assert shm.write_head(first.head, codec.encode(header, b"secret"))  # a good one is taken again
    assert await pair.ward_steps() == {0: [1, 7]}


def test_head_block_sequence_lock() -> None:
    head = memoryview(bytearray(4096))
    assert shm.read_head(head) is None  # never written
    assert shm.write_head(head, b"one")
    assert shm.read_head(head) == b"one"
    shm.invalidate_head(head)
    assert shm.read_head(head) is None  # being rewritten
    shm.invalidate_head(head)  # idempotent: still odd
    assert shm.write_head(head, b"two") and shm.read_head(head) == b"two"
    assert not shm.write_head(head, b"x" * 4096) and shm.read_head(head) == b"two"  # too large: untouched
    assert shm.read_head(head[:8]) is None


async def test_held_copy_survives_the_ward_unlinking_its_files_and_is_served_to_a_restore(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    state = _state(5, rows=2048)
    slot = await pair.send(0, state)
    expected = bytes(slot.payload())
    assert shm.remove_files(shm_dir, WARD, os.getpid())  # the ward died; its agent cleaned up
    assert os.listdir(shm_dir) == []
    # The spare that takes seat 0 fetches the copy from the buddy (here: a third endpoint).
    spare = "host:spare0:cccccc"
    spare_transport = open_transport(f"inproc://shm-{uuid.uuid4().hex}", BULK)
    pair.transports[spare] = spare_transport
    spare_actor = SnapshotActor(spare, spare_transport, Handoff(), Progress(), EventLog(None), b"secret",
                                send_timeout=2.0, shm_dir=shm_dir, to_membership=lambda item: None)
    view = View(epoch=2, seats=[spare, BUDDY], spares=[], resume_step=0, store_prefix="epoch-2",
                store_addr="127.0.0.1:1", bulk_addrs={m: t.address for m, t in pair.transports.items()},
                hosts={spare: "host", BUDDY: "host"}, buddies=[1, 0], restore_from={0: BUDDY})
    pair.tasks.append(asyncio.create_task(spare_actor.run()))
    pair.tasks.append(asyncio.create_task(Pair._read(spare_transport, spare_actor)))
    pair.actors[BUDDY].inbox.post(ViewChanged(view))
    spare_actor.inbox.post(ViewChanged(view))
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    spare_actor.inbox.post(Fetch(0, 0, BUDDY, future))
    await until(future.done)
    fetched = future.result()
    manifest, frames = fetched.manifest, fetched.frames
    assert isinstance(manifest, Manifest) and fetched.step == 0
    assert b"".join(bytes(f) for f in frames) == expected
    assert all(len(f) <= 16 << 20 for f in frames)
    arena = torch.frombuffer(bytearray(expected), dtype=torch.uint8)
    assert torch.equal(materialize(manifest, arena)["w"], state["w"])


async def test_a_buddy_that_cannot_map_acks_with_an_error_and_gets_frames_at_once(
    shm_dir: str, tmp_path: Path, make_pair: Callable[[str, str], Pair]
) -> None:
    pair = make_pair(shm_dir, str(tmp_path))  # the buddy trusts another directory only
    await pair.start(pair.view())
    slot = await pair.send(0, _state(1))
    (copy,) = pair.held()[0]
    assert not copy.shared and _copy_bytes(copy) == bytes(slot.payload())
    rejected = pair.events_of(BUDDY, "rejected")
    assert [r["reason"] for r in rejected] == ["bad_shm_path"]
    refused = pair.events_of(WARD, "snapshot_shm_refused")
    assert len(refused) == 1 and refused[0]["peer"] == BUDDY
    assert pair.progress[WARD].bytes_sent == copy.header.nbytes
    # Later snapshots go over the wire directly: no second refusal.
    await pair.send(1, _state(2))
    assert all(not c.shared for c in pair.held()[0])
    assert len(pair.events_of(BUDDY, "rejected")) == 1
    assert pair.progress[BUDDY].bytes_held_for_wards > 0 and pair.progress[BUDDY].bytes_shared_for_wards == 0


async def test_buddy_on_another_host_gets_frames(shm_dir: str, make_pair: Callable[[str, str], Pair]) -> None:
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view(hosts=("host-a", "host-b")))
    await pair.send(0, _state(1))
    (copy,) = pair.held()[0]
    assert not copy.shared and not pair.events_of(BUDDY, "rejected")


async def test_shm_header_with_payload_frames_is_rejected(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    view = pair.view()
    await pair.start(view)
    slot = _capture(pair.store, 0, _state(1))
    assert slot.manifest is not None
    header = SnapshotHeader(WARD, 1, 0, 0, slot.manifest.nbytes, slot.manifest.encode(),
                            shm_path=slot.shm_path)
    await pair.transports[WARD].send(pair.transports[BUDDY].address,
                                     [codec.encode(header, b"secret"), b"extra"], 1.0)
    await until(lambda: bool(pair.events_of(BUDDY, "rejected")))
    assert pair.events_of(BUDDY, "rejected")[0]["reason"] == "unexpected_frames"
    assert not pair.held()


async def test_a_changed_bad_manifest_is_rejected_after_a_valid_one_was_accepted(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    """The buddy skips re-validating tensor specs identical to the ward's previous ones; changed ones are
    validated again: a tensor moved outside the arena is refused, and the good copy stays the held one."""
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    slot = await pair.send(0, _state(1))
    assert slot.manifest is not None and not pair.events_of(BUDDY, "rejected")
    bad_specs = [dataclasses.replace(spec, offset=slot.manifest.nbytes) for spec in slot.manifest.tensors]
    bad = Manifest(slot.manifest.skeleton, tuple(bad_specs), slot.manifest.nbytes)
    header = SnapshotHeader(WARD, 1, 0, 1, slot.manifest.nbytes, bad.encode(), shm_path=slot.shm_path)
    await pair.transports[WARD].send(pair.transports[BUDDY].address, [codec.encode(header, b"secret")], 1.0)
    await until(lambda: bool(pair.events_of(BUDDY, "rejected")))
    (rejected,) = pair.events_of(BUDDY, "rejected")
    assert rejected["reason"] == "bad_manifest" and "outside the arena" in rejected["detail"]
    assert [c.header.step for c in pair.held()[0]] == [0]
    # The layout it had before is still accepted (and its specs were not replaced by the bad ones).
    await pair.send(2, _state(3))
    assert [c.header.step for c in pair.held()[0]] == [0, 2]


def test_sweep_removes_only_slot_files_whose_writer_is_gone(tmp_path: Path) -> None:
    """What a SIGKILLed agent leaves behind goes at the next agent's start; live writers' files stay."""
    limit = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead_pid = next(pid for pid in range(limit - 1, 1, -1) if not Path(f"/proc/{pid}").exists())  # no such process
    stale = tmp_path / f"deadpool-host_rank1_ab12-{dead_pid}-slot0"
    live = tmp_path / f"deadpool-host_rank2_cd34-{os.getpid()}-slot1"
    other = tmp_path / f"not-a-slot-{dead_pid}-slot0"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    assert shm.sweep_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
    assert shm.sweep_stale("") == [] and shm.sweep_stale(str(tmp_path / "missing")) == []


MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
tmpfs /run tmpfs rw 0 0
/dev/vdb /run/data ext4 rw 0 0
hugetlbfs /dev/hugepages hugetlbfs rw 0 0
"""


@pytest.mark.parametrize(("directory", "in_memory"), [
    ("/dev/shm", True), ("/dev/shm/jobs/a", True), ("/tmp", False), ("/dev", False),
    ("/run/x", True), ("/run/data/slots", False), ("/run/database", True), ("/dev/hugepages", True),
])
def test_memory_filesystem_is_the_deepest_mount_holding_the_directory(directory: str, in_memory: bool) -> None:
    assert shm.in_memory_filesystem(directory, MOUNTS) is in_memory


@pytest.mark.parametrize("shared", [True, False])
async def test_a_header_whose_size_is_not_what_the_seat_holds_is_rejected(
    shm_dir: str, make_pair: Callable[[str, str], Pair], shared: bool,
) -> None:
    """The manifest and the world size say how many bytes a seat's snapshot holds; a header naming
    another size (a mapped file read too far, or a stream cut short) is refused, not held."""
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    slot = _capture(pair.store, 0, _state(1))
    assert slot.manifest is not None
    payload = slot.payload()
    short = len(payload) - 8
    header = SnapshotHeader(WARD, 1, 0, 0, short, slot.manifest.encode(), shm_path=slot.shm_path if shared else "")
    frames: list[Any] = [codec.encode(header, b"secret")] + ([] if shared else [payload[:short]])
    await pair.transports[WARD].send(pair.transports[BUDDY].address, frames, 1.0)
    await until(lambda: bool(pair.events_of(BUDDY, "rejected")))
    (rejected,) = pair.events_of(BUDDY, "rejected")
    assert rejected["reason"] == "size_mismatch" and "holds" in rejected["detail"]
    assert not pair.held()


# -- restores, Prepares and teardown ----------------------------------------------------------


def _spare(pair: Pair, shm_dir: str, restore_from: str) -> tuple[SnapshotActor, View]:
    """A spare adopting seat 0, restoring from `restore_from`; its actor and the view it adopts."""
    spare = "host:spare0:cccccc"
    transport = open_transport(f"inproc://shm-{uuid.uuid4().hex}", BULK)
    pair.transports[spare] = transport
    actor = SnapshotActor(spare, transport, Handoff(), Progress(), EventLog(None), b"secret", send_timeout=2.0,
                          shm_dir=shm_dir, to_membership=lambda item: None)
    view = View(epoch=2, seats=[spare, BUDDY], spares=[], resume_step=0, store_prefix="epoch-2",
                store_addr="127.0.0.1:1", bulk_addrs={m: t.address for m, t in pair.transports.items()},
                hosts={spare: "host", BUDDY: "host"}, buddies=[1, 0], restore_from={0: restore_from})
    pair.tasks.append(asyncio.create_task(actor.run()))
    pair.tasks.append(asyncio.create_task(Pair._read(transport, actor)))
    actor.inbox.post(ViewChanged(view))
    return actor, view


async def test_a_restore_the_buddy_cannot_serve_fails_with_restore_failed(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    await pair.send(0, _state(1))
    spare, view = _spare(pair, shm_dir, BUDDY)
    pair.actors[BUDDY].inbox.post(ViewChanged(view))
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    spare.inbox.post(Fetch(0, 3, BUDDY, future))  # step 3 was never taken
    await until(future.done)
    with pytest.raises(RestoreFailed, match=r"no copy of seat 0 step 3 here \(held: \[0\]\)"):
        future.result()
    unknown: concurrent.futures.Future[Any] = concurrent.futures.Future()
    spare.inbox.post(Fetch(0, 0, "host:nobody:000000", unknown))
    await until(unknown.done)
    with pytest.raises(RestoreFailed, match="no address"):
        unknown.result()


async def test_a_restore_still_waiting_when_the_actor_stops_fails_with_actor_stopped(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    """A restoring spare must not wait out its restore timeout for an actor that is gone."""
    pair = make_pair(shm_dir, shm_dir)
    silent = open_transport(f"inproc://shm-{uuid.uuid4().hex}", BULK)  # takes the request, never answers
    pair.transports["host:silent:dddddd"] = silent
    spare, _ = _spare(pair, shm_dir, "host:silent:dddddd")
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    spare.inbox.post(Fetch(0, 0, "host:silent:dddddd", future))
    await asyncio.wait_for(silent.recv(), 5.0)  # the request went out
    assert not future.done()
    running = pair.tasks[-2]  # the spare actor's run()
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    assert future.done()
    with pytest.raises(ActorStopped):
        future.result()


async def test_a_prepare_is_acknowledged_with_the_ward_copies_and_a_drain_follows_the_ack(
    shm_dir: str, make_pair: Callable[[str, str], Pair]
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    await pair.send(0, _state(1))
    await pair.send(1, _state(2))
    buddy, sent = pair.actors[BUDDY], pair.to_membership[BUDDY]
    marker = Drain(lambda: None)
    buddy.inbox.post(PrepareReady(2, 1, 1, [0, 1], []))
    buddy.inbox.post(marker)
    await until(lambda: len(sent) == 2)
    ack, drain = sent
    assert isinstance(ack, Outbound) and ack.message == PrepareAck(BUDDY, 2, 1, [0, 1], {0: [0, 1]}, [])
    assert drain is marker, "the marker continues to the membership actor after the PrepareAck"
