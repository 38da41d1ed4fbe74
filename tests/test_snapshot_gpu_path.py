"""The GPU snapshot path's logic, run on the CPU: no GPU is lent to this machine.

The CUDA calls are replaced by recording fakes, so the test checks the order that makes the
path correct (the side stream waits for the compute stream before copying; the copies are
issued on the side stream into pinned memory; an event recorded after them is synchronized
before the snapshot counts as complete) and that the bytes arrive intact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from deadpool import snapshot
from deadpool.snapshot import SnapshotStore
from deadpool.statetree import materialize


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.current_stream: FakeStream | None = None


class FakeStream:
    def __init__(self, recorder: Recorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def wait_stream(self, other: "FakeStream") -> None:
        self.recorder.calls.append(f"{self.name}.wait_stream({other.name})")


class FakeEvent:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def record(self, stream: FakeStream) -> None:
        self.recorder.calls.append(f"event.record({stream.name})")

    def synchronize(self) -> None:
        self.recorder.calls.append("event.synchronize")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    compute = FakeStream(recorder, "compute")
    monkeypatch.setattr(snapshot, "on_accelerator", lambda tensors: True)

    def allocate(nbytes: int, pinned: bool) -> torch.Tensor:
        recorder.calls.append(f"allocate(pinned={pinned})")
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(snapshot, "allocate_arena", allocate)
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
        recorder.calls.append(f"copy(non_blocking={non_blocking}, stream={stream})")
        return original_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    return recorder


def test_gpu_path_orders_stream_copies_and_event(fake_cuda: Recorder) -> None:
    completed: list[int] = []
    store = SnapshotStore(on_complete=lambda slot: completed.append(slot.step))
    try:
        weights = torch.arange(4096, dtype=torch.float32)
        moments = torch.ones(128, dtype=torch.float64)
        store.capture(3, "g", {"w": weights, "m": moments}, background=set())
        store.wait_copy(5.0)
        calls = fake_cuda.calls
        assert calls[0] == "allocate(pinned=True)"
        assert calls[1:3] == ["side.wait_stream(compute)", "enter(side)"], "copies must wait for pending compute"
        copies = [c for c in calls if c.startswith("copy(")]
        assert copies == ["copy(non_blocking=True, stream=side)"] * 2
        assert calls.index("event.record(side)") > calls.index(copies[-1])
        assert calls.index("event.synchronize") > calls.index("event.record(side)")
        assert completed == [3]
        slot = store.find(3)
        assert slot is not None and slot.pinned
        restored = materialize(*store.restore_arena(slot))
        assert torch.equal(restored["w"], weights) and torch.equal(restored["m"], moments)
    finally:
        store.close()
