"""TrackedState: what a snapshot holds of a seat is captured, compared with the live state, and loaded back."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deadpool.protocol.view import View
from deadpool.snapshot.store import SnapshotStore
from deadpool.worker.data import UntrackedLoader
from deadpool.worker.tracked import TrackedState

VIEW = View(1, ["m0"], [], 7, "epoch-1", "127.0.0.1:1", {}, {}, [0], {})


@pytest.fixture
def store() -> Iterator[SnapshotStore]:
    s = SnapshotStore(on_complete=lambda _: None)
    yield s
    s.close()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def tracked_job(store: SnapshotStore) -> tuple[TrackedState, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    collectives: Any = types.SimpleNamespace(decisions=None)  # no mesh: no sharding decisions
    tracked = TrackedState(collectives, store)
    assert tracked.add("model", model) is model
    assert tracked.add("optimizer", optimizer) is optimizer
    train(model, optimizer)
    return tracked, model, optimizer


def captured(tracked: TrackedState, store: SnapshotStore, step: int) -> tuple[Any, torch.Tensor]:
    tracked.capture(step, VIEW, 0)
    store.wait_copy(10.0)
    slot = store.find(step)
    assert slot is not None
    return store.restore_arena(slot)


def test_a_load_puts_back_the_captured_state_and_rngs_bit_for_bit(store: SnapshotStore) -> None:
    tracked, model, optimizer = tracked_job(store)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manifest, arena = captured(tracked, store, 0)
    draw = torch.rand(3)
    train(model, optimizer)  # the step after the snapshot, to be rolled back
    rng = tracked.load(manifest, arena)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(torch.rand(3), draw), "the RNG states are the snapshot's"
    assert set(rng) >= {"torch", "python"}


def test_the_unchanged_tensors_are_those_only_an_optimizer_step_changes(store: SnapshotStore) -> None:
    tracked, model, optimizer = tracked_job(store)
    manifest, arena = captured(tracked, store, 0)
    kept = tracked.unchanged(manifest)
    assert kept is not None
    moments = [s["momentum_buffer"] for s in optimizer.state.values()]
    assert {t.data_ptr() for t in kept.values()} == {t.data_ptr() for t in [*model.parameters(), *moments]}
    pointers = {p.data_ptr() for p in model.parameters()}
    tracked.load(manifest, arena, kept)  # the live parameters stay, not copied onto themselves
    assert {p.data_ptr() for p in model.parameters()} == pointers
    # A live state laid out otherwise (a tensor of another shape) keeps nothing.
    model.bias = torch.nn.Parameter(torch.zeros(3))
    assert tracked.unchanged(manifest) is None


def test_a_restore_after_the_loader_watch_warned_names_the_next_view(store: SnapshotStore) -> None:
    tracked, _, _ = tracked_job(store)
    manifest, arena = captured(tracked, store, 0)
    tracked.at_boundary(1)
    assert tracked.untracked_rollback() == ("", "", 0), "no loader the snapshot misses"
    tracked.note_untracked(UntrackedLoader("DataLoader", "train.py:42"))
    tracked.at_boundary(1)
    assert tracked.untracked_rollback() == ("", "", 0), "no restore since the warning"
    tracked.load(manifest, arena)
    tracked.at_boundary(3)
    tracked.load(manifest, arena)
    tracked.at_boundary(5)
    assert tracked.untracked_rollback() == ("DataLoader", "train.py:42", 3), "the first view whose restore left it"
