"""torch's default process group under DeadPool: the script's own collectives, surviving swaps.

Once a member is seated, ``torch.distributed.is_initialized()`` is True and the
default group (``dist.all_reduce(t)``, ``dist.get_rank()``, ``nn.SyncBatchNorm``)
is a ``DefaultGroup``: one Python ``ProcessGroup`` per process, registered where
torch looks groups up, whose collectives run on the current view's gloo group
through the runtime (issued asynchronously, waited on interruptibly), so that a
failure poisons the step instead of raising in the script; why this shape is in
docs/design/groups.md.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import Store, _unregister_process_group
from torch.distributed.distributed_c10d import GroupName

from deadpool.chaos import ChaosPoint
from deadpool.errors import MisuseError
from deadpool.worker import objects, syncbn
from deadpool.worker.exit import GUARD
from deadpool.worker.groups.seat_group import BACKEND, Op, SeatGroup
from deadpool.worker.patches import INIT_PROCESS_GROUP, MESH_INIT_PROCESS_GROUP, PATCHES

log = logging.getLogger("deadpool")

GROUP_NAME = GroupName("deadpool:default")  # the name torch's registry knows the default group by

class UserCollectives(Protocol):
    """What the default group needs from the runtime (``GroupCollectives`` is the runtime's)."""

    def issue_user(self, issue: Callable[[Any], dist.Work], point: ChaosPoint) -> dist.Work | None:
        """Run `issue(group)` on the view's group, then the chaos `point`; None when the step is poisoned."""
        ...

    def await_user(self, work: dist.Work, what: str) -> bool:
        """Wait for `work`, interruptibly; False when it failed or was interrupted (the step is poisoned)."""
        ...



class DefaultGroup(SeatGroup):
    """torch's default group: the script's own collectives, on the current view's group of every seat."""

    def __init__(self, collectives: UserCollectives, rank: int, size: int) -> None:
        super().__init__(rank, size, GROUP_NAME)
        self.collectives = collectives

    def _issue(self, issue: Callable[[Any], dist.Work], op: Op) -> dist.Work | None:
        # A broadcast is where ZeroRedundancyOptimizer sends each seat's updated parameters (at=broadcast).
        return self.collectives.issue_user(issue, ChaosPoint.BROADCAST if op is Op.BROADCAST
                                           else ChaosPoint.USER_COLLECTIVE)

    def _await(self, work: dist.Work, op: Op) -> bool:
        return self.collectives.await_user(work, op.value)


def configure(collectives: UserCollectives, rank: int, size: int, store: Store) -> DefaultGroup | None:
    """Make torch's default group this seat's ``DefaultGroup`` for a view (once seated; anew only if the seat
    changed).

    The group object stays the same across views, so whatever cached it (a module's
    ``process_group``, ``dist.group.WORLD``) keeps working: what changes per view is the
    gloo group its collectives run on.  A replaced one is retired, never destroyed.
    Returns None, leaving torch alone, when the script made a default group of its own.
    """
    current = c10d._world.default_pg
    if isinstance(current, DefaultGroup) and current.collectives is collectives and \
            (current.rank(), current.size()) == (rank, size):
        c10d._world.pg_map[current] = (BACKEND, store)  # the store of the current view
        return current
    if current is not None and not isinstance(current, DefaultGroup):
        log.warning("torch.distributed already has a default group the script made: DeadPool's default group "
                    "is not installed, and collectives on that group will not survive a swap")
        return None
    if isinstance(current, DefaultGroup):
        _unregister(current)
        GUARD.retire(current)
    group = DefaultGroup(collectives, rank, size)
    c10d._register_pg_in_world(group, BACKEND, store, GROUP_NAME, BACKEND,
                               rank_mapping={seat: seat for seat in range(size)})
    c10d._update_default_pg(group)
    syncbn.enable()
    objects.enable()
    return group


def _unregister(group: DefaultGroup) -> None:
    """Take a replaced default group out of torch's registry (it is kept alive, never destroyed)."""
    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag):
        table.pop(group, None)
    for groups in world.tags_to_pg.values():
        while group in groups:
            groups.remove(group)
    _unregister_process_group(GROUP_NAME)
    c10d._update_default_pg(None)


def refuse_env_rendezvous() -> None:
    """Make ``dist.init_process_group()`` on torchrun's environment (``env://``) a clear error in this worker.

    Under ``deadpool launch`` ``MASTER_ADDR``/``MASTER_PORT`` name DeadPool's own store, so torch's
    call would fail on a port in use (on a spare, on its rank of -1). DeadPool makes the default group
    itself once the member is seated. A group on a store or rendezvous of the script's own is left alone.
    """
    PATCHES.install(INIT_PROCESS_GROUP, _refusing_env_rendezvous)
    PATCHES.install(MESH_INIT_PROCESS_GROUP, lambda original: _from_init_device_mesh)


def _refusing_env_rendezvous(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        init_method = args[1] if len(args) > 1 else kwargs.get("init_method")
        store = args[5] if len(args) > 5 else kwargs.get("store")
        if store is None and init_method in (None, "env://"):
            raise MisuseError(
                "torch.distributed.init_process_group() under deadpool launch: DeadPool makes torch's default group "
                "itself once this member has its seat (inside rt.steps(), where dist.get_rank() and collectives "
                "work); remove the call (for FSDP2 or tensor parallel, use rt.device_mesh())")
        original(*args, **kwargs)

    return init_process_group


def _from_init_device_mesh(*args: Any, **kwargs: Any) -> None:
    """init_device_mesh makes the default group itself (its module's own name for torch's function) when there is
    none: before the script's loop there is none yet, and torch's call would fail on DeadPool's port."""
    raise MisuseError(
        "torch.distributed.device_mesh.init_device_mesh() under deadpool launch: make the mesh with "
        "rt.device_mesh(shape, names), the same torch DeviceMesh, whose groups DeadPool rebuilds at a swap "
        "(a spare waits there for its seat)")
