"""What a SnapshotActor serves to a seat being restored: a seat's held copy (also the newest one, to a spare
prefetching before the step is known) and a seat's slice of the replicated state, from the seat's own snapshot or
from its buddy's copy.  Two actors on the in-process transport, as in test_snapshot_shm.py, plus a third endpoint
for the spare."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_snapshot_shm import BUDDY, BULK, GENERATION, WARD, Pair, make_pair, shm_dir, until  # noqa: F401

from deadpool.actors import snapshot_actor
from deadpool.actors.handoff import Fetch, Fetched, Handoff, LocalReady, Progress
from deadpool.actors.inbox import Drain, Outbound, PrepareArrived, ViewChanged
from deadpool.actors.snapshot_actor import SnapshotActor
from deadpool.errors import RestoreFailed
from deadpool.events.log import EventLog
from deadpool.protocol.messages import PrepareAck, RestorePart, RestoreReply, SnapshotHeader
from deadpool.protocol.transport import open_transport
from deadpool.protocol.view import View
from deadpool.snapshot import shm, ward_copies
from deadpool.snapshot.arena import Slot
from deadpool.snapshot.statetree import replicated_slice

pytestmark = pytest.mark.timeout(30)
SPARE = "host:spare0:cccccc"


def _replicated_state(seed: int) -> tuple[dict[str, Any], set[int]]:
    generator = torch.Generator().manual_seed(seed)
    state = {"own": torch.randn(16, generator=generator), "param": torch.randn(4096, generator=generator)}
    return state, {state["param"].data_ptr()}


async def _with_spare(pair: Pair, spare_shm_dir: str = "") -> tuple[SnapshotActor, View]:
    transport = open_transport(f"inproc://parts-{uuid.uuid4().hex}", BULK)
    pair.transports[SPARE] = transport
    actor = SnapshotActor(SPARE, transport, Handoff(), Progress(), EventLog(None), b"secret", send_timeout=2.0,
                          shm_dir=spare_shm_dir, to_membership=lambda item: None)
    view = View(epoch=1, seats=[WARD, BUDDY], spares=[SPARE], resume_step=-1, store_prefix=GENERATION,
                store_addr="127.0.0.1:1", bulk_addrs={m: t.address for m, t in pair.transports.items()},
                hosts={WARD: "host", BUDDY: "host", SPARE: "host"}, buddies=[1, 0], restore_from={})
    await pair.start(view)
    pair.tasks.append(asyncio.create_task(actor.run()))
    pair.tasks.append(asyncio.create_task(Pair._read(transport, actor)))
    actor.inbox.post(ViewChanged(view))
    return actor, view


async def _snapshot(pair: Pair, step: int) -> Slot:
    """The ward's snapshot of `step` (seat 0 of 2, half of it replicated), confirmed by its buddy."""
    state, replicated = _replicated_state(step)
    slot = pair.store.capture(step, GENERATION, state, set(), replicated, seat=0, world=2)
    pair.store.wait_copy(10.0)
    pair.actors[WARD].inbox.post(LocalReady(slot))
    await until(lambda: pair.handoffs[WARD].is_confirmed(GENERATION, step))
    return slot


async def _fetch(actor: SnapshotActor, seat: int, step: int, member: str, part: RestorePart,
                 newest: bool = False) -> Fetched:
    future: concurrent.futures.Future[Fetched] = concurrent.futures.Future()
    actor.inbox.post(Fetch(seat, step, member, future, part, newest))
    await until(future.done)
    return future.result()


async def test_a_spare_fetches_the_newest_copy_and_each_seats_slice_before_the_step_is_known(
    shm_dir: str, make_pair: Callable[[str, str], Pair],  # noqa: F811
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    spare, _ = await _with_spare(pair)
    for step in (3, 4):  # the ward's two newest snapshots, each streamed to the buddy
        state, replicated = _replicated_state(step)
        slot = pair.store.capture(step, GENERATION, state, set(), replicated, seat=0, world=2)
        pair.store.wait_copy(10.0)
        pair.actors[WARD].inbox.post(LocalReady(slot))
        await until(lambda s=step: pair.handoffs[WARD].is_confirmed(GENERATION, s))  # type: ignore[misc]
    held = bytes(slot.payload())
    newest = await _fetch(spare, 0, -1, BUDDY, RestorePart.HELD, newest=True)
    assert newest.step == 4 and b"".join(bytes(f) for f in newest.frames) == held
    first, last = replicated_slice(newest.manifest, 0, 2)
    own = await _fetch(spare, 0, 4, WARD, RestorePart.SLICE)  # from the ward's own snapshot
    copy = await _fetch(spare, 0, 4, BUDDY, RestorePart.SLICE)  # from the buddy's copy of it
    for fetched in (own, copy):
        assert fetched.step == 4 and b"".join(bytes(f) for f in fetched.frames) == held[-(last - first):]
    with pytest.raises(RestoreFailed, match="holds no snapshot of step 2"):
        await _fetch(spare, 0, 2, WARD, RestorePart.SLICE)


async def test_a_slice_travels_in_frames_no_larger_than_a_chunk(
    shm_dir: str, make_pair: Callable[[str, str], Pair], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """A slice is as big as the replicated region over the world size (half of it with two seats): sent as one
    frame, one over the bulk socket's limit was dropped and the restore waited out its timeout."""
    monkeypatch.setattr(ward_copies, "CHUNK_BYTES", 4096)  # the slice (8 KiB) spans frames
    pair = make_pair(shm_dir, shm_dir)
    spare, _ = await _with_spare(pair)
    slot = await _snapshot(pair, 5)
    held = bytes(slot.payload())
    for member in (WARD, BUDDY):  # the ward's own snapshot, the buddy's copy of it
        fetched = await _fetch(spare, 0, 5, member, RestorePart.SLICE)
        first, last = replicated_slice(fetched.manifest, 0, 2)
        assert len(fetched.frames) == 2 and all(len(f) <= 4096 for f in fetched.frames)
        assert b"".join(bytes(f) for f in fetched.frames) == held[-(last - first):]


async def test_a_same_host_spare_reads_a_seats_slice_from_its_slot_file_and_asks_for_frames_if_it_cannot(
    shm_dir: str, make_pair: Callable[[str, str], Pair], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """The seat names its slot file instead of copying its slice into frames; the spare copies the slice out
    of it after checking the slot's head.  A read that fails (here: forced) is asked again for frames."""
    pair = make_pair(shm_dir, shm_dir)
    spare, _ = await _with_spare(pair, shm_dir)
    slot = await _snapshot(pair, 6)
    held = bytes(slot.payload())
    mapped: list[str] = []
    real_map = shm.map_readonly

    def recorded_map(path: str, *rest: Any) -> shm.Mapping:
        mapped.append(path)
        return real_map(path, *rest)

    monkeypatch.setattr(shm, "map_readonly", recorded_map)
    fetched = await _fetch(spare, 0, 6, WARD, RestorePart.SLICE)
    first, last = replicated_slice(fetched.manifest, 0, 2)
    assert mapped == [slot.shm_path], "read from the seat's slot file"
    assert fetched.step == 6 and b"".join(bytes(f) for f in fetched.frames) == held[-(last - first):]

    reads: list[str] = []

    def refused(*_: Any) -> str:
        reads.append("refused")
        return "forced"

    monkeypatch.setattr(spare, "_read_shared", refused)
    fetched = await _fetch(spare, 0, 6, WARD, RestorePart.SLICE)
    assert reads == ["refused"] and b"".join(bytes(f) for f in fetched.frames) == held[-(last - first):], \
        "asked again, and served in frames"


async def test_a_slice_of_a_step_finished_but_still_being_copied_is_answered_once_the_copy_is_done(
    shm_dir: str, make_pair: Callable[[str, str], Pair], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """A planned move's spare asks for every seat's slice of the step the moving seat left after as soon as the
    Prepare names it, when a seat may still be finishing or copying that step: the seat answers once its copy is
    done, and refuses after a bound when it never comes (or at once for a step it has not finished, unless the
    asker says every seat finishes it)."""
    monkeypatch.setattr(snapshot_actor, "COPYING_WAIT_S", 0.3)
    pair = make_pair(shm_dir, shm_dir)
    spare, _ = await _with_spare(pair)
    await _snapshot(pair, 7)
    pair.progress[WARD].step = 8  # finished step 8; its snapshot is not in yet
    future: concurrent.futures.Future[Fetched] = concurrent.futures.Future()
    spare.inbox.post(Fetch(0, 8, WARD, future, RestorePart.SLICE))
    await asyncio.sleep(0.1)
    assert not future.done(), "the seat waits for the copy of the step it finished"
    slot = await _snapshot(pair, 8)
    await until(future.done)
    first, last = replicated_slice(future.result().manifest, 0, 2)
    assert future.result().step == 8 and b"".join(bytes(f) for f in future.result().frames) == \
        bytes(slot.payload())[-(last - first):]
    pair.progress[WARD].step = 9  # finished step 9, whose copy never comes
    with pytest.raises(RestoreFailed, match="holds no snapshot of step 9"):
        await _fetch(spare, 0, 9, WARD, RestorePart.SLICE)
    with pytest.raises(RestoreFailed, match="holds no snapshot of step 10"):  # not finished: refused at once
        await asyncio.wait_for(_fetch(spare, 0, 10, WARD, RestorePart.SLICE), 0.25)
    # A planned move's spare says every seat finishes the step: a seat still in it answers once it has.
    future = concurrent.futures.Future()
    spare.inbox.post(Fetch(0, 10, WARD, future, RestorePart.SLICE, finishing=True))
    await asyncio.sleep(0.1)
    assert not future.done(), "the seat finishes step 10 first"
    pair.progress[WARD].step = 10
    slot = await _snapshot(pair, 10)
    await until(future.done)
    assert future.result().step == 10


@pytest.mark.parametrize("same_host", [False, True], ids=["other-host", "same-host"])
async def test_a_moving_seat_serves_its_whole_snapshot_of_the_step_it_is_still_in_once_it_has_taken_it(
    shm_dir: str, make_pair: Callable[[str, str], Pair], same_host: bool,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A move's Takeover has the reserved spare ask the moving seat itself for its snapshot of the step it leaves
    after, while it is still in that step: the seat answers once it has taken it, with what its buddy's copy holds,
    in frames (its slot files go when it exits)."""
    pair = make_pair(shm_dir, shm_dir)
    spare, _ = await _with_spare(pair, shm_dir if same_host else "")
    reads: list[int] = []
    read = spare._read_shared
    monkeypatch.setattr(spare, "_read_shared", lambda *args: reads.append(args[1].step) or read(*args))
    await _snapshot(pair, 6)
    pair.progress[WARD].step = 6  # in step 7, and told (near its end) to leave after step 8
    future: concurrent.futures.Future[Fetched] = concurrent.futures.Future()
    spare.inbox.post(Fetch(0, 8, WARD, future, RestorePart.HELD, finishing=True))
    await asyncio.sleep(0.1)
    pair.progress[WARD].step = 7
    await _snapshot(pair, 7)
    await asyncio.sleep(0.1)
    assert not future.done(), "the moving seat answers once it has taken its snapshot of step 8"
    pair.progress[WARD].step = 8
    slot = await _snapshot(pair, 8)
    await until(future.done)
    own = future.result()
    assert own.step == 8 and b"".join(bytes(f) for f in own.frames) == bytes(slot.payload())
    assert reads == [], "in frames, also to a spare on its host: the member's slot files go when it exits"
    copy = await _fetch(spare, 0, 8, BUDDY, RestorePart.HELD)
    assert b"".join(bytes(f) for f in copy.frames) == bytes(slot.payload()), "the same bytes as the buddy's copy"


async def test_a_slot_file_read_is_refused_unless_its_head_publishes_that_seat_step_and_range(
    shm_dir: str, make_pair: Callable[[str, str], Pair],  # noqa: F811
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    spare, _ = await _with_spare(pair, shm_dir)
    slot = await _snapshot(pair, 7)
    assert slot.manifest is not None
    size = slot.manifest.replicated // 2
    good = SnapshotHeader(WARD, 1, 0, 7, size, slot.manifest.encode(), shm_path=slot.shm_path,
                          shm_offset=shm.HEAD_BYTES + slot.nbytes - size)
    read = spare._read_shared
    assert not isinstance(read(RestoreReply(WARD, 1, 0, 7, True, "", good, RestorePart.SLICE), good, []), str)
    for bad, sender in ((dataclasses.replace(good, step=6), WARD),  # another step than the head publishes
                        (good, BUDDY),  # another sender than the head's
                        (dataclasses.replace(good, shm_offset=good.shm_offset + 1), WARD),  # past the file's end
                        (dataclasses.replace(good, shm_offset=shm.HEAD_BYTES - 8), WARD),  # from the head block
                        (dataclasses.replace(good, shm_path=f"{shm_dir}/elsewhere"), WARD)):  # not the slot
        reply = RestoreReply(sender, 1, 0, bad.step, True, "", bad, RestorePart.SLICE)
        assert isinstance(read(reply, bad, []), str), bad


async def test_a_restore_request_from_outside_the_view_is_refused(
    shm_dir: str, make_pair: Callable[[str, str], Pair],  # noqa: F811
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    spare, view = await _with_spare(pair)
    outsider = View(epoch=1, seats=[WARD, BUDDY], spares=[], resume_step=-1, store_prefix=GENERATION,
                    store_addr="127.0.0.1:1", bulk_addrs=view.bulk_addrs, hosts=view.hosts, buddies=[1, 0],
                    restore_from={})
    for actor in pair.actors.values():
        actor.inbox.post(ViewChanged(outsider))  # the spare is no longer in the view the servers hold
    future: concurrent.futures.Future[Fetched] = concurrent.futures.Future()
    spare.inbox.post(Fetch(0, -1, BUDDY, future, RestorePart.HELD, newest=True))
    await until(lambda: bool(pair.events_of(BUDDY, "rejected")))
    assert pair.events_of(BUDDY, "rejected")[-1]["reason"] == "not_in_view" and not future.done()


async def test_a_prepare_is_answered_early_with_the_newest_local_snapshot_unless_the_seat_has_a_mesh(
    shm_dir: str, make_pair: Callable[[str, str], Pair],  # noqa: F811
) -> None:
    pair = make_pair(shm_dir, shm_dir)
    await pair.start(pair.view())
    for step in (3, 4):
        await pair.send(step, {"w": torch.full((64,), float(step))})
    sent = pair.to_membership[WARD]
    pair.actors[WARD].inbox.post(PrepareArrived(2))
    await until(lambda: any(isinstance(item, Outbound) for item in sent))
    (ack,) = [item.message for item in sent if isinstance(item, Outbound)]
    assert isinstance(ack, PrepareAck) and ack.early and ack.epoch == 2 and ack.local_steps == [4]
    pair.progress[WARD].answers_early = False  # a mesh seat: its answer lists the groups left dirty
    pair.actors[WARD].inbox.post(PrepareArrived(3))
    pair.actors[WARD].inbox.post(Drain(lambda: None))  # behind it: once the drain passes, nothing else came
    await until(lambda: any(isinstance(item, Drain) for item in sent))
    assert len([item for item in sent if isinstance(item, Outbound)]) == 1
