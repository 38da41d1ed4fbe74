"""Every place DeadPool changes torch, in one registry: what each patch replaces, why, and how it is undone.

A ``Target`` names an attribute of torch (a function of a module, a method of a class, an attribute of
an object torch keeps); ``PATCHES`` replaces it with a wrapper of the original and can put the
original back.  ``CHANGED_ON_OBJECTS`` lists what DeadPool changes on the script's own objects (an
optimizer's ``step``, a module's ``forward``, a tracked loader's class).  ``tests/unit/test_patches.py``
checks every target against the installed torch, so an upgrade that moves one fails there, by name.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Target:
    """One attribute of torch that DeadPool replaces."""

    module: str  # the module it is reached from ("torch.distributed.distributed_c10d")
    path: str  # the attribute, dotted from the module ("new_group", "SyncBatchNorm.forward")
    why: str
    aliases: tuple[str, ...] = ()  # other modules whose attribute of the same name is replaced with it
    lazy: bool = False  # replaced only once the script imported the module (importing it costs time)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"

    def resolve(self, imported_only: bool = False) -> tuple[Any, str] | None:
        """The object holding the attribute, and the attribute's name; None where `imported_only` and the module
        is not imported yet.

        Raises:
            AttributeError, ImportError: the installed torch has no such attribute or module.
        """
        module = sys.modules.get(self.module) if imported_only else importlib.import_module(self.module)
        if module is None:
            return None
        *owners, attribute = self.path.split(".")
        owner: Any = module
        for part in owners:
            owner = getattr(owner, part)
        getattr(owner, attribute)  # raises where torch moved it
        return owner, attribute


@dataclass(frozen=True, slots=True)
class ObjectChange:
    """An attribute DeadPool changes on one of the script's objects of `kind` (not on torch itself)."""

    module: str
    kind: str  # the class, dotted from the module
    attribute: str
    why: str


class Patches:
    """The process's patches of torch: installed once each, the original kept, undone on request."""

    def __init__(self) -> None:
        self._originals: dict[Target, Any] = {}

    def install(self, target: Target, make: Callable[[Any], Any], renew: bool = False) -> bool:
        """Replace `target` with `make(original)`; True when replaced.

        Once per process: a second call leaves the first replacement, unless `renew` (the newest
        maker wins, still wrapping torch's original). A lazy target whose module the script has not
        imported is left alone (False).
        """
        if target in self._originals and not renew:
            return False
        found = target.resolve(imported_only=target.lazy)
        if found is None:
            return False
        owner, attribute = found
        original = self._originals.get(target, getattr(owner, attribute))
        replacement = make(original)
        setattr(owner, attribute, replacement)
        for alias in target.aliases:
            setattr(importlib.import_module(alias), attribute, replacement)
        self._originals[target] = original
        return True

    def installed(self, target: Target) -> bool:
        return target in self._originals

    def original(self, target: Target) -> Any:
        """torch's own attribute behind `target` (the current one where it is not replaced)."""
        if target in self._originals:
            return self._originals[target]
        found = target.resolve()
        assert found is not None
        return getattr(*found)

    def undo(self, target: Target) -> None:
        """Put torch's original back (nothing where `target` is not replaced)."""
        original = self._originals.pop(target, None)
        if original is None:
            return
        found = target.resolve()
        assert found is not None
        owner, attribute = found
        setattr(owner, attribute, original)
        for alias in target.aliases:
            setattr(importlib.import_module(alias), attribute, original)

    def undo_all(self) -> None:
        for target in list(self._originals):
            self.undo(target)


PATCHES = Patches()

C10D = "torch.distributed.distributed_c10d"
_DCP_SAVER = "torch.distributed.checkpoint.state_dict_saver"
_SCHEDULES = "torch.distributed.pipelining.schedules"

INIT_PROCESS_GROUP = Target(
    "torch.distributed", "init_process_group",
    "torchrun's env:// rendezvous would meet DeadPool's own store: a clear error instead")
MESH_INIT_PROCESS_GROUP = Target(
    "torch.distributed.device_mesh", "init_process_group",
    "init_device_mesh makes a default group through its module's own name for it: a clear error instead")
NEW_GROUP = Target(
    C10D, "new_group", "the script's dist.new_group is a group DeadPool rebuilds at a swap",
    aliases=("torch.distributed",))
SYNC_BATCH_NORM = Target(
    "torch.nn", "SyncBatchNorm.forward", "CPU tensors: statistics synced over the default group, as on GPU")
OBJECT_COLLECTIVES = {  # by their names in torch.distributed
    name: Target(C10D, name, "object collectives: a lost step's completes locally without unpickling bytes that "
                 "never came", aliases=("torch.distributed",))
    for name in ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                 "send_object_list", "recv_object_list")
}
AUTOGRAD_BACKWARD = Target(
    "torch.autograd", "backward",
    "a lost step's backward, abandoned, returns quietly (loss.backward() calls it by name)")
SAMPLER_INIT = Target(
    "torch.utils.data.distributed", "DistributedSampler.__init__",
    "a sampler made before the default group exists takes the member's seat instead of raising")
LOADER_PASS = Target(
    "torch.utils.data.dataloader", "_BaseDataLoaderIter.__init__",
    "every loader's pass starts here: an untracked loader that training iterates is warned about")
MESH_SCATTER = Target(
    "torch.distributed.tensor.placement_types", "mesh_scatter",
    "a scatter completed locally gives each seat its own shard (not uninitialized memory)")
SHARDING_DECISIONS = Target(
    "torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached",
    "DTensor's sharding decisions are recorded for the snapshots and taken from them by a spare")
SHARDING_CACHE = Target(
    "torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding",
    "the Python cache in front of the decisions calls DeadPool's")
DCP_SAVE = Target(
    _DCP_SAVER, "_save_state_dict", "a lost step's DCP save completes locally and writes nothing", lazy=True)
DCP_LOAD = Target(
    "torch.distributed.checkpoint.state_dict_loader", "_load_state_dict",
    "a lost step's DCP load completes locally and reads nothing", lazy=True)
DCP_ASYNC_SAVE = Target(
    _DCP_SAVER, "async_save", "refused with a clear error: it plans on a thread beside the step's collectives",
    aliases=("torch.distributed.checkpoint",), lazy=True)
PIPELINE_SET_UP = Target(
    _SCHEDULES, "_PipelineSchedule._initialize_pp_stages",
    "a schedule sets its stages up again after a rebuild; a set-up a failure interrupts ends the lost step",
    lazy=True)
PIPELINE_STEPS = tuple(
    Target(_SCHEDULES, f"{schedule}.step", "a set-up ended by a lost step leaves the step quietly", lazy=True)
    for schedule in ("PipelineScheduleSingle", "PipelineScheduleMulti")
)

TARGETS: tuple[Target, ...] = (
    INIT_PROCESS_GROUP, MESH_INIT_PROCESS_GROUP, NEW_GROUP, SYNC_BATCH_NORM, *OBJECT_COLLECTIVES.values(),
    AUTOGRAD_BACKWARD,
    SAMPLER_INIT, LOADER_PASS, MESH_SCATTER, SHARDING_DECISIONS, SHARDING_CACHE, DCP_SAVE, DCP_LOAD, DCP_ASYNC_SAVE,
    PIPELINE_SET_UP, *PIPELINE_STEPS,
)

CHANGED_ON_OBJECTS: tuple[ObjectChange, ...] = (
    ObjectChange("torch.optim", "Optimizer", "step", "a tracked optimizer's step does nothing in a lost step"),
    ObjectChange("torch.nn", "Module", "forward",
                 "a mesh seat's tracked model: a lost step's forward returns stand-ins of the right shape"),
    ObjectChange("torch.utils.data", "DataLoader", "__iter__",
                 "a tracked loader's class is a subclass whose iter() follows a restore"),
)
