"""The GPU snapshot path's logic, run on the CPU: no GPU is lent to this machine.

The CUDA calls are replaced by recording fakes, so the test checks the order that makes the
path correct (the side stream waits for the compute stream before copying; the copies are
issued on the side stream into pinned memory; an event recorded after them is synchronized
before the snapshot counts as complete) and that the bytes arrive intact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deadpool.snapshot import arena as memory
from deadpool.snapshot import shm
from deadpool.snapshot import store as snapshot
from deadpool.snapshot.statetree import materialize, replicated_slice
from deadpool.snapshot.store import SnapshotStore


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.current_stream: FakeStream | None = None
        self.events = 0


class FakeStream:
    def __init__(self, recorder: Recorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def wait_stream(self, other: FakeStream) -> None:
        self.recorder.calls.append(f"{self.name}.wait_stream({other.name})")

    def wait_event(self, event: FakeEvent) -> None:
        self.recorder.calls.append(f"{self.name}.wait_event({event.name})")


class FakeEvent:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        recorder.events += 1
        self.name = f"event{recorder.events}"

    def record(self, stream: FakeStream) -> None:
        self.recorder.calls.append(f"{self.name}.record({stream.name})")

    def synchronize(self) -> None:
        self.recorder.calls.append(f"{self.name}.synchronize")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    compute = FakeStream(recorder, "compute")
    monkeypatch.setattr(snapshot, "on_accelerator", lambda tensors: True)

    def allocate(nbytes: int, pinned: bool) -> torch.Tensor:
        recorder.calls.append(f"allocate(pinned={pinned})")
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(memory, "allocate_arena", allocate)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: FakeStream(recorder, "side"))
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(recorder))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: compute)

    @contextlib.contextmanager
    def use_stream(stream: FakeStream) -> Iterator[None]:
        recorder.calls.append(f"enter({stream.name})")
        recorder.current_stream = stream
        yield
        recorder.calls.append(f"exit({stream.name})")
        recorder.current_stream = compute

    monkeypatch.setattr(torch.cuda, "stream", use_stream)
    original_copy = torch.Tensor.copy_

    def copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        stream = recorder.current_stream.name if recorder.current_stream else "none"
        recorder.calls.append(f"copy({src.numel()} bytes, non_blocking={non_blocking}, stream={stream})")
        return original_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    return recorder


def test_gpu_path_orders_stream_copies_and_event(fake_cuda: Recorder) -> None:
    completed: list[int] = []
    store = SnapshotStore(on_complete=lambda slot: completed.append(slot.step))
    try:
        weights = torch.arange(4096, dtype=torch.float32)
        moments = torch.ones(128, dtype=torch.float64)
        store.capture(3, "g", {"w": weights, "m": moments}, background={weights.data_ptr(), moments.data_ptr()})
        store.wait_copy(5.0)
        calls = fake_cuda.calls
        assert calls[0] == "allocate(pinned=True)"
        assert calls[1:3] == ["side.wait_stream(compute)", "enter(side)"], "copies must wait for pending compute"
        copies = [c for c in calls if c.startswith("copy(")]
        assert copies == ["copy(16384 bytes, non_blocking=True, stream=side)",
                          "copy(1024 bytes, non_blocking=True, stream=side)"]
        assert not any("wait_event" in c for c in calls), "nothing for the compute stream to wait for"
        last_event = calls.index("event1.record(side)")
        assert last_event > calls.index(copies[-1])
        assert calls.index("event1.synchronize") > last_event, "complete only once the copies are"
        assert completed == [3]
        slot = store.find(3)
        assert slot is not None and slot.pinned
        restored = materialize(*store.restore_arena(slot))
        assert torch.equal(restored["w"], weights) and torch.equal(restored["m"], moments)
    finally:
        store.close()


def test_gpu_path_copies_buffers_first_and_makes_only_them_block_the_compute_stream(fake_cuda: Recorder) -> None:
    """A buffer may change in the next forward: the compute stream waits for its copy (on the GPU),
    not for the parameters' copies, which the optimizer pre-step hook waits for."""
    store = SnapshotStore(on_complete=lambda _: None)
    try:
        weights = torch.arange(4096, dtype=torch.float32)
        running_mean = torch.full((16,), 2.0)
        store.capture(1, "g", {"w": weights, "buf": running_mean}, background={weights.data_ptr()})
        store.wait_copy(5.0)
        calls = fake_cuda.calls
        copies = [c for c in calls if c.startswith("copy(")]
        assert copies[0].startswith("copy(64 bytes") and copies[1].startswith("copy(16384 bytes")
        buffer_done = calls.index("event1.record(side)")
        assert calls.index(copies[0]) < buffer_done < calls.index(copies[1])
        assert calls[buffer_done + 1] == "compute.wait_event(event1)"
        assert "event2.synchronize" in calls and "compute.wait_event(event2)" not in calls
        slot = store.find(1)
        assert slot is not None
        restored = materialize(*store.restore_arena(slot))
        assert torch.equal(restored["w"], weights) and torch.equal(restored["buf"], running_mean)
    finally:
        store.close()


def test_gpu_path_copies_only_the_seats_slice_of_replicated_state(fake_cuda: Recorder) -> None:
    world = 4
    weights = torch.randn(1000)
    stores = [SnapshotStore(on_complete=lambda _: None) for _ in range(world)]
    try:
        arenas = []
        for seat, store in enumerate(stores):
            own = torch.full((3,), float(seat))
            slot = store.capture(0, "g", {"w": weights, "own": own}, {weights.data_ptr()},
                                 {weights.data_ptr()}, seat, world)
            store.wait_copy(5.0)
            assert slot.manifest is not None and slot.arena is not None
            assert store.bytes_copied_per_snapshot <= slot.arena.numel() < slot.manifest.nbytes / 2
            first, last = replicated_slice(slot.manifest, seat, world)
            arenas.append((slot.manifest, store.restore_arena(slot)[1], first, last))
        manifest, rebuilt = arenas[0][0], arenas[0][1].clone()
        for _, arena, first, last in arenas:
            rebuilt[first:last] = arena[first:last]
        assert torch.equal(materialize(manifest, rebuilt)["w"], weights)
    finally:
        for store in stores:
            store.close()


def test_gpu_path_page_locks_shared_memory_slots_for_a_buddy_to_map(
    fake_cuda: Recorder, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """With a shared-memory directory the GPU path copies into the slot file itself, page-locked, so a
    buddy on the same host maps it as on the CPU path; where CUDA refuses, private pinned memory."""
    locked: list[int] = []
    unlocked: list[int] = []
    monkeypatch.setattr(shm, "in_memory_filesystem", lambda directory: True)
    monkeypatch.setattr(memory, "page_lock", lambda arena: locked.append(arena.data_ptr()) or True)
    monkeypatch.setattr(memory, "page_unlock", lambda arena: unlocked.append(arena.data_ptr()))
    store = SnapshotStore(on_complete=lambda _: None, shm_dir=str(tmp_path), member="m")
    weights = torch.arange(1000, dtype=torch.float32)
    slot = store.capture(0, "g", {"w": weights}, background={weights.data_ptr()})
    store.wait_copy(5.0)
    assert slot.arena is not None and slot.manifest is not None
    assert slot.shm_path and slot.pinned and slot.registered and locked == [slot.arena.data_ptr()]
    assert "allocate(pinned=True)" not in fake_cuda.calls
    with open(slot.shm_path, "rb") as mapped:  # what a buddy on this host maps (after the head block)
        mapped.seek(shm.HEAD_BYTES)
        assert mapped.read(slot.manifest.nbytes) == slot.arena[: slot.manifest.nbytes].numpy().tobytes()
    store.close()
    assert unlocked == locked and not list(tmp_path.iterdir())

    monkeypatch.setattr(memory, "page_lock", lambda arena: False)
    store = SnapshotStore(on_complete=lambda _: None, shm_dir=str(tmp_path), member="m")
    try:
        slot = store.capture(0, "g", {"w": weights}, background=set())
        store.wait_copy(5.0)
        assert not slot.shm_path and slot.pinned and not slot.registered
        assert fake_cuda.calls.count("allocate(pinned=True)") == 1
        assert not list(tmp_path.iterdir()), "the refused slot file is removed"
    finally:
        store.close()


def test_gpu_path_does_not_page_lock_files_outside_memory_filesystems(
    fake_cuda: Recorder, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Linux refuses long-term pins of pages of an ordinary file: such a directory is not even tried."""
    monkeypatch.setattr(shm, "in_memory_filesystem", lambda directory: False)
    monkeypatch.setattr(memory, "page_lock", lambda arena: pytest.fail("page_lock called"))
    store = SnapshotStore(on_complete=lambda _: None, shm_dir=str(tmp_path), member="m")
    try:
        weights = torch.arange(100, dtype=torch.float32)
        slot = store.capture(0, "g", {"w": weights}, background=set())
        store.wait_copy(5.0)
        assert not slot.shm_path and slot.pinned and "allocate(pinned=True)" in fake_cuda.calls
        assert not list(tmp_path.iterdir())
    finally:
        store.close()


@pytest.mark.skipif(not torch.cuda.is_available() or not shm.in_memory_filesystem("/dev/shm"),
                    reason="no CUDA device, or no /dev/shm memory filesystem")
def test_real_gpu_snapshot_into_a_shared_memory_slot() -> None:
    store = SnapshotStore(on_complete=lambda _: None, shm_dir="/dev/shm", member="test-gpu-slot")
    try:
        weights = torch.randn(1 << 20, device="cuda")
        expected = weights.cpu()
        slot = store.capture(0, "g", {"w": weights}, background={weights.data_ptr()})
        store.wait_copy(30.0)
        assert slot.arena is not None and slot.manifest is not None
        assert slot.shm_path and slot.registered and slot.arena.is_pinned()
        with open(slot.shm_path, "rb") as mapped:
            mapped.seek(shm.HEAD_BYTES)
            assert mapped.read(slot.manifest.nbytes) == slot.arena[: slot.manifest.nbytes].numpy().tobytes()
        assert torch.equal(materialize(*store.restore_arena(slot))["w"], expected)
    finally:
        store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_real_gpu_snapshot_holds_the_state_at_capture() -> None:
    """On a real GPU: a buffer changed by the next forward right after the capture, and parameters
    changed after the pre-step wait, leave the snapshot as it was at the capture."""
    store = SnapshotStore(on_complete=lambda _: None)
    try:
        weights = torch.randn(1 << 22, device="cuda")
        buffer = torch.zeros(1 << 22, device="cuda")
        expected_weights, expected_buffer = weights.cpu(), buffer.cpu()
        slot = store.capture(0, "g", {"w": weights, "b": buffer}, background={weights.data_ptr()})
        buffer.add_(1.0)  # queued on the compute stream at once, as the next forward would
        store.wait_copy(30.0)  # the optimizer pre-step hook
        weights.add_(1.0)
        assert slot.arena is not None and slot.pinned and slot.arena.is_pinned()
        restored = materialize(*store.restore_arena(slot))
        assert torch.equal(restored["w"], expected_weights)
        assert torch.equal(restored["b"], expected_buffer), "the next forward overwrote a buffer before its copy"
        assert torch.equal(buffer.cpu(), expected_buffer + 1.0)
    finally:
        store.close()
