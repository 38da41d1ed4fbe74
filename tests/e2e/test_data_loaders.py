"""Tracked data loaders: a restore puts the script's own iterator back where the snapshot was taken.

Each test runs a small training-like loop twice, once failure-free and once rolled back (or
taken over by a "spare" with a placeholder seat) from a snapshot encoded and decoded like a
real one, and compares what each step saw: the batch and a draw from the torch RNG that a
dropout mask would take.  Also: sampler seating, and the one-time warning about untracked loaders.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from deadpool.errors import MisuseError
from deadpool.snapshot.statetree import flatten, unflatten
from deadpool.worker import rng
from deadpool.worker.data import DataSeats, LoaderWatch, TrackedLoader, UntrackedLoader, seat_sampler

stateful = pytest.importorskip("torchdata.stateful_dataloader")

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SAMPLES = 26  # 13 per seat of 2: with batches of 3, an epoch is 5 batches (drop_last on the sampler: 12 each)
STEPS = 14  # almost three epochs


def _loader(rank: int, world: int, num_workers: int) -> tuple[Any, DistributedSampler[Any]]:
    dataset = TensorDataset(torch.arange(SAMPLES))
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                                          seed=7, drop_last=True)
    return stateful.StatefulDataLoader(dataset, batch_size=3, sampler=sampler, num_workers=num_workers), sampler


class Seat:
    """One seat's script: its loader, its sampler, its iterator, and a snapshot of every step."""

    def __init__(self, rank: int, world: int, num_workers: int) -> None:
        self.loader, self.sampler = _loader(rank, world, num_workers)
        self.tracked = TrackedLoader("data", self.loader)
        self.seats = DataSeats()
        for sampler in self.tracked.samplers:
            self.seats.add(sampler)
        self.it = iter(self.loader)  # the script's iterator, taken once before the loop

    def step(self) -> tuple[list[int], float]:
        try:
            (batch,) = next(self.it)
        except StopIteration:
            self.sampler.set_epoch(self.sampler.epoch + 1)  # the epoch lives in the sampler, which is tracked
            self.it = iter(self.loader)
            (batch,) = next(self.it)
        return batch.tolist(), torch.rand(()).item()  # the draw a dropout mask would take

    def snapshot(self) -> tuple[bytes, list[torch.Tensor]]:
        return flatten({"data": self.tracked.state_dict(), "__rng__": rng.capture()})

    def restore(self, snapshot: tuple[bytes, list[torch.Tensor]], rank: int, world: int) -> None:
        state = unflatten(*snapshot)
        self.seats.seat(rank, world)  # the adoption seats samplers before it loads
        self.tracked.load_state_dict(state["data"])
        rng.restore(state["__rng__"])  # last, as the runtime does


def failure_free(num_workers: int) -> list[tuple[list[int], float]]:
    torch.manual_seed(0)
    seat = Seat(1, 2, num_workers)
    return [seat.step() for _ in range(STEPS)]


@pytest.fixture(scope="module")
def reference() -> dict[int, list[tuple[list[int], float]]]:
    return {workers: failure_free(workers) for workers in (0, 2)}


@pytest.mark.parametrize(("num_workers", "fail_after", "resume"), [
    (0, 8, 6), (0, 11, 4), (0, 4, -1), (0, 9, 9),  # within an epoch, across two epoch ends, to the start, none
    (2, 8, 6), (2, 11, 4),  # two loader worker processes (each pass starts them: slower)
])
def test_a_rollback_resumes_the_scripts_own_iterator(
    reference: dict[int, list[tuple[list[int], float]]], num_workers: int, fail_after: int, resume: int,
) -> None:
    """Rolled back across epoch ends (and to before the first step): the same batches and RNG draws."""
    torch.manual_seed(0)
    seat = Seat(1, 2, num_workers)
    snapshots = {-1: seat.snapshot()}
    seen = []
    for step in range(fail_after + 1):
        seen.append(seat.step())
        snapshots[step] = seat.snapshot()
    seat.restore(snapshots[resume], 1, 2)
    del seen[resume + 1 :]
    seen.extend(seat.step() for _ in range(resume + 1, STEPS))
    assert seen == reference[num_workers]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_spare_with_a_placeholder_seat_takes_over_the_dead_seats_batches(
    reference: dict[int, list[tuple[list[int], float]]], num_workers: int,
) -> None:
    torch.manual_seed(0)
    dead = Seat(1, 2, num_workers)
    for _ in range(7):
        dead.step()
    snapshot = dead.snapshot()
    torch.manual_seed(123)  # a spare's own RNG, and a loader seated at a placeholder (rank 0 of 1)
    spare = Seat(0, 1, num_workers)
    assert (spare.sampler.rank, spare.sampler.num_replicas) == (0, 1)
    spare.restore(snapshot, 1, 2)
    assert (spare.sampler.rank, spare.sampler.num_replicas, spare.sampler.num_samples) == (1, 2, 13)
    assert [spare.step() for _ in range(7, STEPS)] == reference[num_workers][7:]


def test_the_rebuilt_pass_leaves_the_torch_rng_alone() -> None:
    """Building a torch loader's pass draws a base seed from the global RNG; a restore's rebuild gives it back."""
    seat = Seat(1, 2, 0)
    seat.step()
    before = torch.get_rng_state()
    iter(DataLoader(TensorDataset(torch.arange(4))))
    assert not torch.equal(before, torch.get_rng_state()), "torch changed: a pass no longer draws a base seed"
    snapshot = seat.snapshot()
    seat.restore(snapshot, 1, 2)
    restored = torch.get_rng_state()
    seat.step()  # rebuilds the pass
    torch.set_rng_state(restored)
    expected = torch.rand(()).item()
    seat.restore(snapshot, 1, 2)
    assert seat.step()[1] == expected


def test_seat_sampler_recomputes_the_derived_sizes_and_keeps_the_epoch() -> None:
    dataset = TensorDataset(torch.arange(10))
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=1, rank=0, drop_last=True, seed=3)
    sampler.set_epoch(4)
    seat_sampler(sampler, 1, 3)
    fresh: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=3, rank=1, drop_last=True, seed=3)
    fresh.set_epoch(4)
    assert (sampler.rank, sampler.num_replicas, sampler.epoch) == (1, 3, 4)
    assert (sampler.num_samples, sampler.total_size) == (fresh.num_samples, fresh.total_size) == (3, 9)
    assert list(sampler) == list(fresh)


def test_a_distributed_sampler_built_without_its_seat_before_the_default_group_takes_the_members(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DistributedSampler(dataset), as under torchrun: there is no default group before the loop (torch would raise),
    so it takes the member's seat (0 on a spare, rank -1) and the job's size, and every adopted view re-seats it."""
    monkeypatch.setattr(DistributedSampler, "__init__", DistributedSampler.__init__)  # restored after the test
    seats, rank = DataSeats(), [-1]
    seats.seat_unseated(4, lambda: rank[0])
    seats.seat_unseated(4, lambda: 99)  # once per process
    dataset = TensorDataset(torch.arange(16))
    spare = DistributedSampler(dataset, shuffle=False)
    assert (spare.rank, spare.num_replicas) == (0, 4)
    rank[0] = 2
    active = DistributedSampler(dataset, shuffle=False, drop_last=True)
    assert (active.rank, active.num_replicas) == (2, 4)
    told = DistributedSampler(dataset, num_replicas=2, rank=1)  # the script's own seat: left as it said
    seats.seat(3, 4)  # the spare's adoption of seat 3
    assert (spare.rank, active.rank, told.rank) == (3, 3, 1)
    assert list(spare) == [3, 7, 11, 15]


def test_a_plain_data_loader_cannot_be_tracked_and_the_error_names_the_fix() -> None:
    with pytest.raises(MisuseError, match="StatefulDataLoader"):
        TrackedLoader("data", DataLoader(TensorDataset(torch.arange(4))))


def test_a_loader_iterated_before_it_is_tracked_is_refused() -> None:
    loader, _ = _loader(0, 1, 0)
    iter(loader)
    with pytest.raises(MisuseError, match="before the first iter"):
        TrackedLoader("data", loader)


class Watched:
    def __init__(self) -> None:
        self.in_steps = False
        self.reports: list[str] = []
        self.where: list[str] = []
        self.watch = LoaderWatch(lambda: self.in_steps, self._warned)
        self.watch.install()

    def _warned(self, message: str, loader: UntrackedLoader) -> None:
        self.reports.append(loader.kind)
        self.where.append(loader.where)


@pytest.fixture
def watched() -> Any:
    state = Watched()
    yield state
    state.watch.uninstall()


def test_an_untracked_loader_iterated_in_a_step_warns_once_naming_the_fix(watched: Watched) -> None:
    plain = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    watched.in_steps = True
    iterated_at = sys._getframe().f_lineno + 2  # the line of next(iter(plain)) below
    with pytest.warns(RuntimeWarning, match=r"StatefulDataLoader.*rt\.track\(data=loader\)"):
        next(iter(plain))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(plain))  # once per process
        next(iter(DataLoader(TensorDataset(torch.arange(8)))))
    assert watched.reports == ["DataLoader"]
    assert watched.where == [f"test_data_loaders.py:{iterated_at}"], "the line that iterates, for the closing line"


def test_a_tracked_loader_does_not_warn(watched: Watched) -> None:
    seat = Seat(1, 2, 0)
    watched.in_steps = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        seat.step()
        seat.restore(seat.snapshot(), 1, 2)
        seat.step()
    watched.watch.first_step_done()
    assert watched.reports == []


def test_a_pass_started_before_the_loop_warns_after_the_first_step_if_it_yielded(watched: Watched) -> None:
    unused = iter(DataLoader(TensorDataset(torch.arange(8))))  # started, never read: no warning
    started_at = sys._getframe().f_lineno + 1  # the next line starts the pass
    used = iter(DataLoader(TensorDataset(torch.arange(8))))
    watched.in_steps = True
    next(used)
    with pytest.warns(RuntimeWarning, match="StatefulDataLoader"):
        watched.watch.first_step_done()
    assert watched.reports == ["DataLoader"]
    assert watched.where == [f"test_data_loaders.py:{started_at}"], "where the pass started, not the runtime's step end"
    del unused


def test_a_pass_started_before_the_loop_and_never_read_does_not_warn(watched: Watched) -> None:
    unused = iter(DataLoader(TensorDataset(torch.arange(8))))
    watched.in_steps = True
    watched.watch.first_step_done()
    assert watched.reports == []
    del unused


def test_numpy_rng_is_captured_and_restored_and_survives_a_snapshot() -> None:
    import numpy as np

    np.random.seed(5)
    np.random.randn()  # leaves a cached gaussian: part of the state
    snapshot = flatten(rng.capture())
    expected = (np.random.randn(3).tolist(), np.random.rand(2).tolist())
    np.random.seed(99)
    rng.restore(unflatten(*snapshot))
    assert (np.random.randn(3).tolist(), np.random.rand(2).tolist()) == expected


def test_a_tracked_loader_is_freed_without_the_garbage_collector() -> None:
    """No cycle through the cursor: a cycle's collection leaves each loader worker to a 5 s join timeout."""
    import gc
    import weakref

    loader, _ = _loader(0, 1, 0)
    TrackedLoader("data", loader)
    next(iter(loader))
    freed = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert freed() is None, "the tracked loader is in a reference cycle"
    finally:
        gc.enable()
