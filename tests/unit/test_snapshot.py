"""SnapshotStore's capture: what it copies is the state at the capture, whatever changed since the last one.

The store reuses the layout and the numpy views of the previous capture while
nothing changed (``SnapshotStore._layout/_targets/_sources``); these tests
change the state in every way a training loop can between two captures and
check the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deadpool.snapshot.arena import Slot
from deadpool.snapshot.statetree import expand, materialize, replicated_slice, scatter
from deadpool.snapshot.store import SnapshotStore

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def store() -> Iterator[SnapshotStore]:
    s = SnapshotStore(on_complete=lambda _: None)
    yield s
    s.close()


def capture(store: SnapshotStore, step: int, state: dict[str, Any], background: set[int] | None = None) -> Any:
    slot: Slot = store.capture(step, "g", state, background if background is not None else set())
    store.wait_copy(10.0)
    assert slot.manifest is not None and slot.arena is not None
    return materialize(slot.manifest, slot.arena)


def assert_same(snapshot: dict[str, Any], state: dict[str, Any]) -> None:
    assert snapshot.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert snapshot[key].dtype == value.dtype and torch.equal(snapshot[key], value), key
        else:
            assert snapshot[key] == value, key


def test_in_place_changes_between_captures_are_captured(store: SnapshotStore) -> None:
    weight, moment = torch.randn(16, 8), torch.zeros(16, 8)
    state = {"w": weight, "m": moment, "lr": 0.1}
    for step in range(5):  # both slots, several times: every reuse path
        weight.add_(1.0)
        moment.mul_(0.5).add_(step)
        state["lr"] = 0.1 / (step + 1)
        assert_same(capture(store, step, state, {weight.data_ptr(), moment.data_ptr()}), state)


def test_a_replaced_tensor_is_read_from_its_new_storage(store: SnapshotStore) -> None:
    state = {"w": torch.randn(16, 8)}
    capture(store, 0, state)
    for step in range(1, 4):
        state["w"] = torch.full((16, 8), float(step))  # new storage, same shape
        assert_same(capture(store, step, state), state)


def test_non_contiguous_and_re_viewed_tensors(store: SnapshotStore) -> None:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    state: dict[str, Any] = {"t": base.t(), "flat": base.reshape(-1)}
    assert_same(capture(store, 0, state), state)
    base.add_(100.0)
    assert_same(capture(store, 1, state), state)
    state = {"t": base.reshape(8, 6), "flat": base.view(torch.int32).reshape(-1)}  # same storage, other views
    assert_same(capture(store, 2, state), state)
    base.mul_(-1.0)
    assert_same(capture(store, 3, state), state)


def test_a_changed_shape_gets_a_new_layout_and_a_larger_arena(store: SnapshotStore) -> None:
    state = {"a": torch.randn(4), "b": torch.randn(3, dtype=torch.float64)}
    capture(store, 0, state)
    capture(store, 1, state)
    state = {"a": torch.randn(4), "b": torch.randn(300, dtype=torch.float64), "c": torch.ones(2, dtype=torch.bool)}
    for step in (2, 3):
        assert_same(capture(store, step, state), state)


def test_tied_tensors_are_captured_once_each_reference(store: SnapshotStore) -> None:
    shared = torch.randn(5, 5)
    state = {"embed": shared, "head": shared}
    assert_same(capture(store, 0, state), state)
    shared.add_(3.0)
    assert_same(capture(store, 1, state), state)


def test_each_seat_copies_its_slice_of_replicated_state_and_the_slices_rebuild_it() -> None:
    """Seats of a data-parallel job hold the same parameters: each copies 1/world of them, all its own state,
    and its arena is only that big."""
    world = 3
    weight, moment = torch.randn(50, 7), torch.randn(33)
    stores = [SnapshotStore(on_complete=lambda _: None) for _ in range(world)]
    try:
        for step in range(3):  # both slots, and a reused layout
            weight.add_(1.0)
            arenas = []
            for seat, store in enumerate(stores):
                own = torch.full((5,), float(seat))  # differs per seat: never sliced
                state = {"w": weight, "own": own, "m": moment, "step": step}
                slot = store.capture(step, "g", state, {weight.data_ptr(), moment.data_ptr()},
                                     {weight.data_ptr(), moment.data_ptr()}, seat, world)
                store.wait_copy(10.0)
                assert slot.manifest is not None and slot.arena is not None
                manifest = slot.manifest
                first, last = replicated_slice(manifest, seat, world)
                held = slot.payload()  # what a buddy maps or is streamed: own state, then the slice
                assert len(held) == manifest.replicated_at + last - first >= store.bytes_copied_per_snapshot
                assert slot.arena.numel() == len(held) < manifest.nbytes / 2, "the arena holds what it copies"
                _, arena = store.restore_arena(slot)  # put back at the manifest's offsets
                assert arena.numel() == manifest.nbytes
                assert arena[first:last].numpy().tobytes() == bytes(held[manifest.replicated_at:])
                full = materialize(manifest, arena)
                assert torch.equal(full["own"], own) and full["step"] == step  # private part: whole
                arenas.append((arena, first, last))
                # A survivor keeping its live replicated tensors reads only its own state: the slot's, uncopied.
                replicated = {i for i, spec in enumerate(manifest.tensors) if spec.offset >= manifest.replicated_at}
                _, own_part = store.restore_arena(slot, kept=replicated)
                assert own_part.data_ptr() == slot.arena.data_ptr() and own_part.numel() == manifest.replicated_at
                kept = materialize(manifest, own_part, {i: torch.zeros(0) for i in replicated})
                assert torch.equal(kept["own"], own) and kept["step"] == step
                _, whole = store.restore_arena(slot, kept=set(list(replicated)[1:]))  # one replicated tensor read
                assert whole.numel() == manifest.nbytes and whole.data_ptr() != slot.arena.data_ptr()
            assert manifest.replicated and manifest.replicated_at > 0
            rebuilt = arenas[0][0].clone()
            for arena, first, last in arenas:  # what the restore's all-gather does
                rebuilt[first:last] = arena[first:last]
            full = materialize(manifest, rebuilt)
            assert torch.equal(full["w"], weight) and torch.equal(full["m"], moment)
            rebuilt[arenas[1][1]:arenas[1][2]] = 0
            assert not torch.equal(materialize(manifest, rebuilt)["w"], weight)  # every slice is needed
    finally:
        for store in stores:
            store.close()


def test_expand_refuses_a_payload_that_is_not_what_the_seat_holds() -> None:
    weight = torch.randn(64)
    store = SnapshotStore(on_complete=lambda _: None)
    try:
        slot = store.capture(0, "g", {"w": weight, "own": torch.ones(3)}, set(), {weight.data_ptr()}, 1, 4)
        store.wait_copy(10.0)
        assert slot.manifest is not None
        payload = slot.payload()
        with pytest.raises(LookupError, match="where it holds"):
            expand(slot.manifest, [payload[:-1]], 1, 4)
        with pytest.raises(LookupError, match="where it holds"):
            expand(slot.manifest, [payload], 1, 2)  # another world size: another slice size
    finally:
        store.close()


def test_scatter_puts_streamed_parts_back_in_place_and_refuses_extra_bytes() -> None:
    target = bytearray(20)
    scatter([memoryview(b"abc"), memoryview(b"defgh")], [(0, 2), (10, 16)], memoryview(target))
    assert bytes(target) == b"ab" + bytes(8) + b"cdefgh" + bytes(4)
    with pytest.raises(ValueError, match="more bytes"):
        scatter([memoryview(b"abcd")], [(0, 2)], memoryview(bytearray(4)))
