"""Data loading that survives a swap: tracked ``StatefulDataLoader``s, seated ``DistributedSampler``s, the watch.

A tracked loader (``rt.track(data=loader)``) is held in snapshots by a ``TrackedLoader``: the
loader's own ``state_dict()``, its sampler's epoch and its generator.  ``iter(loader)`` then
returns one cursor per loader, so the iterator a script holds follows a restore; the iterator
a restore rebuilds is built without touching the torch RNG (every ``iter()`` of a torch loader
draws a base seed from it).  ``DataSeats`` gives each ``DistributedSampler`` the seat of the
view, and ``LoaderWatch`` warns once about a loader no snapshot holds.  Why each of these is
needed is in docs/design/compute.md ("Data loaders").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from deadpool.errors import MisuseError
from deadpool.worker.patches import LOADER_PASS, PATCHES, SAMPLER_INIT

UNTRACKED_WARNING = (
    "deadpool: a {kind} is iterated during training but no snapshot holds it: after a swap it does not "
    "resume at the batch of the restored step, and each iter() draws a seed from the torch RNG that dropout "
    "uses, so the run diverges silently. Use torchdata.stateful_dataloader.StatefulDataLoader (the arguments "
    "of DataLoader) and track it: rt.track(data=loader)."
)
_LIBRARIES = ("deadpool", "torch", "torchdata")  # frames a warning skips to point at the script's line


# -- samplers -----------------------------------------------------------------------------------


def seat_sampler(sampler: DistributedSampler[Any], rank: int, world: int) -> None:
    """Give `sampler` the seat `rank` of `world`, with the sizes derived from them recomputed.

    torch's own ``__init__`` derives ``num_samples`` and ``total_size`` (they depend on
    ``drop_last``), so it is run again with the sampler's settings; the epoch is kept.
    """
    if (sampler.rank, sampler.num_replicas) == (rank, world):
        return
    epoch = sampler.epoch
    DistributedSampler.__init__(sampler, sampler.dataset, num_replicas=world, rank=rank, shuffle=sampler.shuffle,
                                seed=sampler.seed, drop_last=sampler.drop_last)
    sampler.epoch = epoch


def samplers_under(loader: DataLoader[Any]) -> list[DistributedSampler[Any]]:
    """The ``DistributedSampler`` a loader draws its indices from (its sampler, or its batch sampler's)."""
    found: list[DistributedSampler[Any]] = []
    for candidate in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(candidate, DistributedSampler) and not any(candidate is s for s in found):
            found.append(candidate)
    return found


class DataSeats:
    """The samplers DeadPool seats at every adopted view: ``rt.distributed_sampler``'s, tracked loaders', and those
    the script builds before the loop with the seat left out."""

    def __init__(self) -> None:
        self._samplers: list[DistributedSampler[Any]] = []

    def seat_unseated(self, world: int, rank: Callable[[], int]) -> None:
        """Make ``DistributedSampler(dataset)`` without a rank or size work before DeadPool's default group exists
        (before the loop, and on a spare, where torch asks the default group and raises): it takes this
        member's seat (`rank()`; seat 0 on a spare, as ``rt.distributed_sampler``) and the job's `world`, and
        is seated at every adopted view. Once the default group exists torch's own defaults are the seat's."""
        seats = self

        def seating(original: Callable[..., None]) -> Callable[..., None]:
            signature = inspect.signature(original)

            @functools.wraps(original)
            def __init__(sampler: DistributedSampler[Any], *args: Any, **kwargs: Any) -> None:
                bound = signature.bind(sampler, *args, **kwargs)
                unseated = bound.arguments.get("rank") is None and not torch.distributed.is_initialized()
                if unseated:
                    bound.arguments["rank"] = max(rank(), 0)
                    if bound.arguments.get("num_replicas") is None:
                        bound.arguments["num_replicas"] = world
                original(*bound.args, **bound.kwargs)
                if unseated:
                    seats.add(sampler)

            return __init__

        PATCHES.install(SAMPLER_INIT, seating)

    def add(self, sampler: DistributedSampler[Any]) -> None:
        if not any(sampler is known for known in self._samplers):
            self._samplers.append(sampler)

    def seat(self, rank: int, world: int) -> None:
        """Called when a view is adopted, before a snapshot is loaded (a loader rebuilt then reads the seat)."""
        for sampler in self._samplers:
            seat_sampler(sampler, rank, world)


# -- tracked loaders ----------------------------------------------------------------------------


@contextlib.contextmanager
def rng_untouched(generator: torch.Generator | None) -> Iterator[None]:
    """Whatever the body draws from the global torch RNG (and `generator`) is given back."""
    saved = torch.get_rng_state()
    own = generator.get_state() if generator is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(saved)
        if generator is not None and own is not None:
            generator.set_state(own)


class Cursor:
    """What ``iter()`` of a tracked loader returns: the loader's current pass, which a restore replaces.

    A script keeps the iterator it got at the start of an epoch; after a rollback that object
    must yield the batches after the restored step, so it is this cursor, not torch's iterator.
    """

    def __init__(self, loader: DataLoader[Any], original_iter: Callable[[DataLoader[Any]], Iterator[Any]]) -> None:
        # Weak: the loader holds its cursor, and a strong reference back would make the pair a cycle. A cycle
        # is freed only by the garbage collector, whose finalizer order leaves each loader worker process to
        # a 5 s join timeout (measured: 10 s for a loader of 2 workers, against 0.01 s when freed at once).
        self._loader_ref = weakref.ref(loader)
        self._original_iter = original_iter
        self.current: Iterator[Any] | None = None  # the pass in progress (None: none since construction or a restore)
        self.pending: dict[str, Any] | None = None  # a restored position, built into a pass at the next batch

    def restart(self) -> Cursor:
        """The script's ``iter(loader)``: a new pass, as the loader itself would start one."""
        self.pending = None
        self.current = self._original_iter(self._loader)
        return self

    @property
    def _loader(self) -> DataLoader[Any]:
        loader = self._loader_ref()
        if loader is None:
            raise MisuseError("a tracked loader's iterator was used after the loader itself was freed")
        return loader

    def __iter__(self) -> Cursor:
        return self

    def __next__(self) -> Any:
        if self.current is None:
            if self.pending is not None:
                # The pass the snapshot held, rebuilt: building it draws a base seed the original pass drew
                # long ago (the restored one is in the state), so the draw is given back.
                self._loader.load_state_dict(self.pending)  # type: ignore[attr-defined]
                self.pending = None
                with rng_untouched(self._loader.generator):
                    self.current = self._original_iter(self._loader)
            else:
                self.current = self._original_iter(self._loader)  # where the script's own iter() would have run
        return next(self.current)

    def __len__(self) -> int:
        return len(self._loader)


def _iter_tracked(loader: DataLoader[Any]) -> Cursor:
    cursor: Cursor = loader._deadpool_cursor  # type: ignore[attr-defined]
    return cursor.restart()


_TRACKING_CLASSES: dict[type, type] = {}


def _tracking_class(cls: type) -> type:
    """`cls` with one change: ``iter()`` returns the loader's cursor (same name, so reprs and errors read the same)."""
    sub = _TRACKING_CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__iter__": _iter_tracked, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _TRACKING_CLASSES[cls] = sub
    return sub


def is_stateful_loader(obj: Any) -> bool:
    return isinstance(obj, DataLoader) and callable(getattr(obj, "state_dict", None))


def is_tracked_loader(obj: Any) -> bool:
    return isinstance(obj, DataLoader) and isinstance(getattr(obj, "_deadpool_cursor", None), Cursor)


class TrackedLoader:
    """What a snapshot holds of a ``StatefulDataLoader``: its position, its sampler's epoch, its generator.

    Raises:
        MisuseError: the loader was iterated before it was tracked (the script's iterator could not follow
            a restore), or it is a plain ``DataLoader`` (nothing to restore it from).
    """

    def __init__(self, name: str, loader: DataLoader[Any]) -> None:
        if not is_stateful_loader(loader):
            raise MisuseError(
                f"rt.track({name}=...): a torch DataLoader has no state_dict(), so a snapshot cannot hold where it "
                "is. Use torchdata.stateful_dataloader.StatefulDataLoader (the same arguments) and track that."
            )
        if getattr(loader, "_iterator", None) is not None:
            raise MisuseError(f"rt.track({name}=...): track the loader before the first iter() of it, so that the "
                              "iterator the script holds can follow a restore")
        if is_tracked_loader(loader):
            raise MisuseError(f"rt.track({name}=...): this loader is tracked already")
        self.loader = loader
        self.samplers = samplers_under(loader)
        original = type(loader)
        self.cursor = Cursor(loader, original.__iter__)
        loader._deadpool_cursor = self.cursor  # type: ignore[attr-defined]
        loader.__class__ = _tracking_class(original)

    def state_dict(self) -> dict[str, Any]:
        cursor = self.cursor
        if cursor.pending is not None:
            position: dict[str, Any] | None = cursor.pending  # restored, no batch taken since
        elif cursor.current is None:
            position = None  # not iterated yet (a StatefulDataLoader would build a pass to answer)
        else:
            position = self.loader.state_dict()  # type: ignore[attr-defined]
        state: dict[str, Any] = {"position": position}
        if self.samplers:
            state["epoch"] = self.samplers[0].epoch
        if self.loader.generator is not None:
            state["generator"] = self.loader.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(state["epoch"])
        if "generator" in state and self.loader.generator is not None:
            self.loader.generator.set_state(state["generator"])
        self.loader.load_state_dict({})  # type: ignore[attr-defined]  # drops the pass of the abandoned timeline
        self.cursor.current = None
        self.cursor.pending = state["position"]


# -- the watch ----------------------------------------------------------------------------------

_WATCH: LoaderWatch | None = None
_REMEMBERED = 16  # untracked passes started before training that the first step checks


def _watching(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def watched_iter_init(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        original(self, loader, *args, **kwargs)
        watch = _WATCH
        if watch is not None:
            watch.started(self, loader)

    return watched_iter_init


@dataclass(frozen=True, slots=True)
class UntrackedLoader:
    """A loader that training iterates and no snapshot holds: what the watch warned about."""

    kind: str  # the loader's type ("DataLoader")
    where: str  # the script's line that started its pass, "file.py:42" ("" when no frame of the script is found)


class LoaderWatch:
    """Warns once per process about a torch loader that no snapshot holds and that training iterates.

    Every torch loader's pass starts in ``_BaseDataLoaderIter.__init__`` (a ``StatefulDataLoader``'s
    too); the watch hooks that, once per pass, so steps cost nothing.  A pass started inside a
    step warns at once; one started before the first step is checked at the end of the first step
    (did it yield a batch?).  The runtime keeps what it warned about: a restore after it cannot
    roll that loader back, which the end of the run reports.
    """

    def __init__(self, in_steps: Callable[[], bool], warn: Callable[[str, UntrackedLoader], None]) -> None:
        self._in_steps = in_steps  # a step has begun on this worker
        self._warn = warn  # (message, the loader): the runtime's warning and event
        self._before: list[tuple[weakref.ref[Any], UntrackedLoader]] = []  # untracked passes started before step 0
        self._checked = False
        self.warned = False

    def install(self) -> None:
        """Watch every pass started from now on (one watch per process: the newest runtime's)."""
        global _WATCH
        PATCHES.install(LOADER_PASS, _watching)
        _WATCH = self

    def uninstall(self) -> None:
        global _WATCH
        if _WATCH is self:
            _WATCH = None

    def started(self, pass_: Any, loader: Any) -> None:
        """A torch loader started a pass."""
        if self.warned or is_tracked_loader(loader):
            return
        if self._in_steps():
            self._fire(UntrackedLoader(type(loader).__name__, _where(_script_frame()[0])))
        elif len(self._before) < _REMEMBERED:
            with contextlib.suppress(TypeError):
                self._before.append((weakref.ref(pass_), UntrackedLoader(type(loader).__name__,
                                                                        _where(_script_frame()[0]))))

    def first_step_done(self) -> None:
        """End of this worker's first step: warn if an untracked pass started before it yielded a batch."""
        if self._checked:
            return
        self._checked = True
        for ref, loader in self._before:
            pass_ = ref()
            if pass_ is not None and getattr(pass_, "_num_yielded", 0) > 0 and not self.warned:
                self._fire(loader)
        self._before.clear()

    def _fire(self, loader: UntrackedLoader) -> None:
        self.warned = True
        message = UNTRACKED_WARNING.format(kind=loader.kind)
        warnings.warn(message, RuntimeWarning, stacklevel=_script_frame()[1])
        self._warn(message, loader)


def _script_frame() -> tuple[FrameType, int]:
    """The first frame outside DeadPool and torch (the script's line that iterates), and its ``stacklevel`` for
    a ``warnings.warn`` in the caller of this function."""
    frame, level = sys._getframe(1), 1  # the caller: the frame that warnings.warn's stacklevel 1 names
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES:
        frame, level = frame.f_back, level + 1
    return frame, level


def _where(frame: FrameType) -> str:
    """``file.py:42`` of a frame of the script ("" when the walk ended inside a library)."""
    if frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
