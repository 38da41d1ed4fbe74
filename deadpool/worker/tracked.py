"""What a snapshot holds of a seat: the objects ``rt.track`` registered, the global RNGs, and how they load.

The runtime adds the objects and captures their state at step boundaries; recovery
loads a restored snapshot into them and asks which live tensors still hold a snapshot's
values (a survivor's restore keeps those instead of copying them).  ``TrackedState`` is
that one interface: it knows which storages only ``optimizer.step()`` changes (copied in
the background) and which every seat shares (``rt.ddp``'s, split into one slice per
seat), how a sharded seat's DTensors are captured and laid out again, and whether a
restore rolled training back past a loader no snapshot holds.
"""

from __future__ import annotations

from typing import Any

import torch

from deadpool.events.vocabulary import Corrupted
from deadpool.protocol.view import View
from deadpool.snapshot.statetree import Manifest, flatten, materialize, same_layout
from deadpool.snapshot.store import SnapshotStore
from deadpool.worker import dtensors
from deadpool.worker import rng as rng_mod
from deadpool.worker import zero as zero_mod
from deadpool.worker.data import TrackedLoader, UntrackedLoader
from deadpool.worker.ddp import DataParallel
from deadpool.worker.groups.hub import GroupCollectives
from deadpool.worker.lost_step import fill_missing_grads


class TrackedState:
    """The tracked objects of one seat, their live state, and the snapshots they capture and load."""

    def __init__(self, collectives: GroupCollectives, snapshots: SnapshotStore, checks: int = 0,
                 every: int = 1) -> None:
        self._collectives = collectives  # DTensor's sharding decisions (a mesh job's), rt.ddp's seat-0 broadcast
        self._snapshots = snapshots
        self._checks = checks  # replica checks: each snapshot checksums 1/checks of the replicated state (0: none)
        self._every = every  # a snapshot every this many steps: the part checked follows the snapshots' count
        self._objects: dict[str, Any] = {}  # by rt.track's name: what holds each one's state
        self._sharded = False  # the script has a mesh (rt.device_mesh): tracked state may hold DTensors
        self._optimizers: list[torch.optim.Optimizer] = []
        self._ddps: list[DataParallel] = []  # rt.ddp wrappers: their parameters are the same on every seat
        self._untracked: UntrackedLoader | None = None  # the loader the watch warned about: no restore rolls it back
        self._restored_untracked = False  # a restore ran after that warning; its view is named at the next step
        self._untracked_view = 0  # the epoch of the first view whose restore left that loader where it was

    # -- what is tracked ----------------------------------------------------------------------

    def add(self, name: str, obj: Any) -> Any:
        """Track `obj` as `name`; returns what holds its state: a ``TrackedLoader`` for a loader, a ``ZeroShard``
        for torch's ``ZeroRedundancyOptimizer`` (a seat snapshots its own shard, not the whole), else `obj`.

        Raises:
            MisuseError: a loader that cannot be tracked (``TrackedLoader`` says why).
        """
        self._objects[name] = obj
        if isinstance(obj, torch.utils.data.DataLoader):
            self._objects[name] = TrackedLoader(name, obj)  # its position, its sampler's epoch; iter() follows restores
        if zero_mod.is_zero(obj):
            self._objects[name] = zero_mod.ZeroShard(obj)
        if isinstance(obj, torch.optim.Optimizer):
            self._optimizers.append(obj)
        return self._objects[name]

    def add_ddp(self, wrapper: DataParallel) -> None:
        """An ``rt.ddp`` model: its parameters are the same on every seat (each seat's snapshot copies a slice)."""
        self._ddps.append(wrapper)

    def use_mesh(self) -> None:
        """The script has a mesh (``rt.device_mesh``): tracked state may hold DTensors, captured as local shards."""
        self._sharded = True

    @property
    def sharded(self) -> bool:
        """The script has a mesh: tracked state may hold DTensors."""
        return self._sharded

    def backward_abandoned(self) -> None:
        """A lost step's backward stopped early: FSDP2's iteration state is reset and missing gradients filled."""
        dtensors.reset_fsdp_iterations(self._objects.values())
        fill_missing_grads(self._objects.values())

    # -- capture ------------------------------------------------------------------------------

    def live(self) -> dict[str, Any]:
        """The live state: every tracked object's ``state_dict()`` (a seat's local shards) and the RNG states."""
        state = {name: obj.state_dict() for name, obj in self._objects.items()}
        if self._sharded:
            state = dtensors.localize(state)  # a seat holds the local shards of its DTensors
        state["__rng__"] = rng_mod.capture()
        if self._sharded and (switches := dtensors.fsdp_switches(self._objects.values())):
            state["__fsdp__"] = switches
        return state

    def capture(self, step: int, view: View, seat: int) -> None:
        """Snapshot the live state as `seat`'s of `step` under `view`, with its replica check (the same part of
        the replicated state on every seat for the same step)."""
        check = ((step // self._every) % self._checks, self._checks) if self._checks else None
        self._snapshots.capture(step, view.store_prefix, self._snapshot_state(), self._background_pointers(),
                                self._replicated_pointers(), seat, view.world_size, check)

    def _snapshot_state(self) -> dict[str, Any]:
        """The live state, and DTensor's decisions with it: not training state (no digest covers them), but what
        a spare's first step would otherwise make cold."""
        state = self.live()
        if (carried := self._collectives.decisions) is not None:
            carried.make_load_decisions(self._objects.values())
            if (decisions := carried.snapshot_entry()) is not None:
                state["__decisions__"] = decisions
        return state

    def _background_pointers(self) -> set[int]:
        """Storages that change only inside optimizer.step(): safe to copy while the next step runs."""
        pointers: set[int] = set()
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                pointers.update(dtensors.local(p).data_ptr() for p in group["params"])
            inner: torch.optim.Optimizer = getattr(optimizer, "optim", optimizer)  # ZeRO: the local shard's optimizer
            for state in inner.state.values():
                pointers.update(dtensors.local(v).data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
        return pointers

    def _replicated_pointers(self) -> set[int]:
        """Storages that are the same on every seat: the parameters of ``rt.ddp`` models (their gradients
        are averaged) and a plain optimizer's state for them.  A ZeRO shard is not: it differs per seat."""
        replicated = [p for wrapper in self._ddps for bucket in wrapper.buckets for p in bucket.params]
        pointers = {p.data_ptr() for p in replicated}
        for optimizer in self._optimizers:
            if zero_mod.is_zero(optimizer):
                continue
            for param in replicated:
                state = optimizer.state.get(param)
                if state:
                    pointers.update(v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor) and v.numel())
        return pointers

    def first_tensor(self, what: Corrupted) -> tuple[str, torch.Tensor] | None:
        """The tensor a ``corrupt:`` chaos spec flips a bit of, with its name: the first parameter of the first
        tracked module, or the first optimizer's first state tensor of more than one element (this seat's)."""
        for name, obj in self._objects.items():
            if what is Corrupted.PARAM and isinstance(obj, torch.nn.Module):
                for key, param in obj.named_parameters():
                    return f"{name}.{key}", dtensors.local(param)
            if what is Corrupted.OPTIM and isinstance(obj, torch.optim.Optimizer):
                inner: torch.optim.Optimizer = getattr(obj, "optim", obj)  # ZeRO: the local shard's optimizer
                for index, state in enumerate(inner.state.values()):
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and value.numel() > 1:
                            return f"{name}.state[{index}].{key}", dtensors.local(value)
        return None

    # -- restore ------------------------------------------------------------------------------

    def load(self, manifest: Manifest, arena: torch.Tensor,
             kept: dict[int, torch.Tensor] | None = None) -> dict[str, Any]:
        """Load a restored snapshot into the tracked objects and RNGs; returns its RNG states, to put back again
        after something that may draw from the RNGs (building the groups).

        `kept`: live tensors, by manifest index, that hold the snapshot's values already (``unchanged``).
        """
        state = materialize(manifest, arena, kept)
        rng: dict[str, Any] = state["__rng__"]
        self._load(state)
        return rng

    def _load(self, state: dict[str, Any]) -> None:
        self._restored_untracked = self._restored_untracked or self._untracked is not None
        if (decisions := state.pop("__decisions__", None)) is not None and self._collectives.decisions is not None:
            self._collectives.decisions.take(decisions)
        # A lost step may have stopped an FSDP2 forward mid-way (a pipeline's set-up, a stand-in with no backward
        # after it): its parameters still unsharded, the replayed step would skip an all-gather its peers issue.
        dtensors.reset_fsdp_iterations(self._objects.values())
        dtensors.set_fsdp_switches(self._objects.values(), state.pop("__fsdp__", []))
        rng = state.pop("__rng__")
        for name, obj in self._objects.items():
            value = dtensors.relayout(state[name], obj) if self._sharded else state[name]
            if isinstance(obj, torch.nn.Module) and len(fresh := _without_live(value, obj.state_dict())) < len(value):
                if fresh:
                    obj.load_state_dict(fresh, strict=False)  # the rest are its live tensors already
            else:
                obj.load_state_dict(value)
        rng_mod.restore(rng)  # last: loading an object may draw from the RNGs (a loader's pass does)

    def unchanged(self, manifest: Manifest) -> dict[int, torch.Tensor] | None:
        """The live tensors that only an optimizer's step() changes (and the replicated ones), by their index in
        `manifest`; None when the live state is not laid out as the manifest says.  After a lost step that
        skipped the optimizer, they hold what the snapshot of the step before holds (recovery checks that)."""
        state = self._snapshot_state()
        _, tensors = flatten(state)
        # The sharding decisions only grow, a lost step's too: not training state, never kept, any size.
        if not same_layout(manifest, tensors, ignore=state.get("__decisions__", {}).get("msgpack")):
            return None
        kept = self._background_pointers() | self._replicated_pointers()
        return {i: t for i, t in enumerate(tensors) if t.data_ptr() in kept}

    def take_seat0_state(self, epoch: int) -> None:
        """The initial state on every seat of view `epoch`: ``rt.ddp``'s replicas take seat 0's, as under DDP."""
        for wrapper in self._ddps:
            wrapper.take_seat0_state(lambda flat: self._collectives.broadcast_adopting(
                flat, f"rt.ddp's initial state from seat 0 (view {epoch})", epoch))

    # -- what no snapshot holds ---------------------------------------------------------------

    def note_untracked(self, loader: UntrackedLoader) -> None:
        """The loader watch saw training iterate `loader`, which no snapshot holds: no restore rolls it back."""
        self._untracked = loader

    def at_boundary(self, epoch: int) -> None:
        """A step (or the final digest) begins in view `epoch`: if a restore ran after the loader watch warned,
        this view (the restore's) is the first whose rollback left the untracked loader where it was."""
        if self._restored_untracked:
            self._restored_untracked = False
            self._untracked_view = self._untracked_view or epoch

    def untracked_rollback(self) -> tuple[str, str, int]:
        """The untracked loader's kind and where its pass started, and the first view whose rollback left it where
        it was, for this seat's ``Finished``; ("", "", 0) when no restore did."""
        untracked = self._untracked if self._untracked_view else None
        if untracked is None:
            return "", "", self._untracked_view
        return untracked.kind, untracked.where, self._untracked_view


def _without_live(value: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """A module's state dict to load, `value`, without the entries that are its `live` tensors themselves: a
    survivor's restore keeps the live tensors that hold the snapshot's values, and loading one copies it onto
    itself (a DTensor's copy is far from free: a sharding decision per shape, the first time).  All of it where
    the keys differ from the module's, so that the strict load names what is missing or unexpected."""
    if value.keys() != live.keys():
        return value
    return {key: v for key, v in value.items() if not (
        isinstance(v, torch.Tensor) and isinstance(live[key], torch.Tensor)
        and dtensors.local(v).data_ptr() == dtensors.local(live[key]).data_ptr()
        and dtensors.local(v).shape == dtensors.local(live[key]).shape)}
