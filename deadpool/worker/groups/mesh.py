"""``rt.device_mesh``: a torch ``DeviceMesh`` whose groups keep their identity while DeadPool replaces their gloo.

Every mesh dimension of a seat, and every group the script makes with ``dist.new_group``, is a
``MeshGroup`` (a ``SeatGroup``) registered in torch's registry under a stable name, so
``fully_shard`` and ``parallelize_module`` take the mesh unchanged and FSDP2's cached group
objects (and the script's own) stay valid across swaps.  At a view change only the
groups that hold a replaced seat, or that a seat reported unfinished (``dirty``), get a new gloo
group; the others keep theirs.  A failed collective breaks only its own group: collectives on
the others are still issued and waited on, so every healthy group stays in step on all its
seats and can be kept (why, and the proof, in docs/design/groups.md).  A step lost before its
backward issued a collective stops its backward there, and issues nothing more.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from deadpool.chaos import ChaosPoint
from deadpool.errors import CollectiveAborted, MisuseError
from deadpool.protocol.view import View
from deadpool.worker.exit import GUARD
from deadpool.worker.groups.seat_group import BACKEND, GATHERS, POINT_TO_POINT, SCATTERS, Op, SeatGroup
from deadpool.worker.lost_step import StepAbandoned
from deadpool.worker.patches import MESH_SCATTER, PATCHES

log = logging.getLogger("deadpool")


class MeshCollectives(Protocol):
    """What a mesh group needs from the runtime (``GroupCollectives`` is the runtime's)."""

    def fault_point(self, point: ChaosPoint) -> None:
        """A fault-injection point (returns at once when no chaos is declared)."""
        ...

    def poison(self, err: BaseException) -> None:
        """The step is lost: report the failure (the step runs on to its end, then recovery)."""
        ...

    def abandons_backward(self) -> bool:
        """A backward collective is about to be issued: True when the lost step's backward stops here."""
        ...

    def abandoned(self) -> bool:
        """The lost step's forward or backward stopped on this seat: the step's remaining collectives complete
        locally."""
        ...

    def usable(self, communicator: Any) -> bool:
        """`communicator` was not aborted: collectives may still be issued on it."""
        ...

    def retired(self, communicator: Any) -> None:
        """A rebuild replaced `communicator`: it is set aside (and aborted where the backend can)."""
        ...

    def wait_bounded(self, work: dist.Work, what: str, seats: Sequence[int]) -> None:
        """Wait for `work` until it completes, the group timeout, or a Prepare that declares one of `seats` dead.

        Raises:
            CollectiveAborted: the collective failed, timed out or lost a seat.
        """
        ...


def in_backward() -> bool:
    """The calling thread runs an autograd backward (a collective of FSDP2's or DTensor's in it)."""
    return torch._C._current_autograd_node() is not None


def chaos_point(op: Op, own: bool = False) -> ChaosPoint:
    """Where a collective's kill fires: ``allgather``, ``reducescatter``, ``p2p``; else ``backward`` or ``forward``
    on a mesh dimension, ``usercollective`` on a group of the script's own (`own`)."""
    if op in GATHERS:
        return ChaosPoint.ALLGATHER
    if op in SCATTERS:
        return ChaosPoint.REDUCESCATTER
    if op in POINT_TO_POINT:
        return ChaosPoint.P2P
    if own:
        return ChaosPoint.USER_COLLECTIVE
    return ChaosPoint.BACKWARD if in_backward() else ChaosPoint.FORWARD


@dataclass
class MeshDim:
    """One of this seat's mesh groups: its seats, and the gloo group it runs on now."""

    dim: str  # the mesh dimension's name ("dp", "tp")
    name: str  # the stable name torch's registry knows the group by
    seats: tuple[int, ...]  # the global ranks in the group, in group-rank order
    inner: Any = None  # the gloo group (None: none yet, the seat is not in a view)
    members: tuple[str, ...] = ()  # the members of `seats` when `inner` was built
    broken: bool = False  # a collective on it failed this step: the rest complete locally
    dirty: bool = False  # a collective on it did not complete on this seat since it was built
    p2p: bool = False  # it carried a send or recv since it was built: rebuilt at every view change
    own: bool = False  # the script's dist.new_group(), not a mesh dimension

    def needs_rebuild(self, view: View) -> bool:
        """A seat of the group has a new member, the view says so, or the seat has none yet."""
        return self.inner is None or self.name in view.rebuild_groups or \
            tuple(view.seats[seat] for seat in self.seats) != self.members


class MeshGroup(SeatGroup):
    """A mesh dimension's group: collectives issued on its gloo group, each waited on until done or timeout.

    FSDP2's all-gathers and reduce-scatters go unstaged (``SeatGroup._UNSTAGED``): their buffers are its own.
    """

    _UNSTAGED = True

    def __init__(self, dim: MeshDim, collectives: MeshCollectives, rank: int) -> None:
        super().__init__(dim.seats.index(rank), len(dim.seats), dim.name)
        self.dim = dim
        self._collectives = collectives

    def _issue(self, issue: Callable[[Any], dist.Work], op: Op) -> dist.Work | None:
        dim = self.dim
        if in_backward() and self._collectives.abandons_backward():
            raise StepAbandoned  # carried out of the backward and swallowed (lost_step.AbandonableBackward)
        dim.p2p = dim.p2p or op in POINT_TO_POINT
        if self._collectives.abandoned():  # this seat stopped the step: it issues nothing more (a peer left
            return None  # waiting on it ends that wait at its pause notice, PeerPaused)
        if dim.broken or dim.inner is None or not self._collectives.usable(dim.inner):
            dim.dirty = dim.dirty or dim.inner is not None
            return None
        try:
            work = issue(dim.inner)
        except RuntimeError as err:
            self._break(err)
            return None
        dim.dirty = True  # until the wait completes
        self._collectives.fault_point(chaos_point(op, dim.own))
        return work

    def completes_locally(self) -> bool:
        """A collective issued now completes on this seat alone: the group is not built (a spare, or a first
        build a failure interrupted), a collective on it failed this step, or this seat stopped the lost step."""
        return self.dim.broken or self.dim.inner is None or self._collectives.abandoned() or \
            not self._collectives.usable(self.dim.inner)

    def _await(self, work: dist.Work, op: Op) -> bool:
        try:
            self._collectives.wait_bounded(work, f"{op.value} on mesh group {self.dim.name}", self.dim.seats)
        except (CollectiveAborted, RuntimeError) as err:
            self._break(err)
            return False
        self.dim.dirty = False
        return True

    def _break(self, err: BaseException) -> None:
        self.dim.broken = True
        self.dim.dirty = True
        self._collectives.poison(err)


class LocalScatter:
    """DTensor's scatter of a tensor every seat holds whole (``distribute_tensor``, as ``parallelize_module``
    shards a module) gives each seat its own chunk when the collective completes locally.

    Every seat passes the chunks of its own copy, but torch hands them to the group on the source seat
    only: completed locally, another seat's shard would stay uninitialized memory.  A seat wraps its model
    on a group that completes locally when it will restore its state (a spare) or when a failure
    interrupted the first view's groups; with the scatter taken from its own copy, the initial state it
    then starts from is the one the scatter would have given (the script builds the same model on every
    seat).  Installed once per process, on DTensor's placement module (what it calls by that name).
    """

    @staticmethod
    def install() -> None:
        PATCHES.install(MESH_SCATTER, LocalScatter._scattering)

    @staticmethod
    def _scattering(original: Callable[..., Any]) -> Callable[..., Any]:
        def mesh_scatter(output: torch.Tensor, scatter_list: list[torch.Tensor], mesh: DeviceMesh,
                         mesh_dim: int = 0, async_op: bool = False, *, group_src: int = 0) -> Any:
            group = mesh.get_group(mesh_dim)
            if isinstance(group, MeshGroup) and group.completes_locally() and scatter_list:
                with torch.no_grad():
                    output.copy_(scatter_list[mesh.get_local_rank(mesh_dim)])
                return None
            return original(output, scatter_list, mesh, mesh_dim, async_op, group_src=group_src)

        return mesh_scatter


def mesh_dims(shape: Sequence[int], names: Sequence[str], rank: int) -> list[MeshDim]:
    """This seat's group along every dimension of a mesh of `shape` over ranks 0..N-1 (row-major)."""
    layout = torch.arange(math.prod(shape)).view(*shape)
    coords = [int(c) for c in (layout == rank).nonzero()[0]]
    dims = []
    for axis, dim in enumerate(names):
        index = list(coords)
        index[axis] = slice(None)  # type: ignore[call-overload]
        seats = tuple(int(r) for r in layout[tuple(index)].tolist())
        others = [c for a, c in enumerate(coords) if a != axis]
        key = "-".join(str(c) for c in others) or "0"
        dims.append(MeshDim(dim, f"deadpool:{dim}:{key}", seats))
    return dims


@dataclass
class Rebuilt:
    """What one view change did to this seat's mesh groups."""

    rebuilt: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    seconds: float = 0.0


class SeatGroups:
    """This seat's groups that DeadPool rebuilds: the dimensions of ``rt.device_mesh`` and the script's own
    ``dist.new_group()`` groups."""

    def __init__(self, rank: int, collectives: MeshCollectives) -> None:
        self._seat = rank
        self._collectives = collectives
        self.dims: list[MeshDim] = []
        self.groups: list[MeshGroup] = []

    def add(self, dim: MeshDim) -> MeshGroup:
        """A group of this seat's, registered in torch's registry under its stable name; built at the next rebuild."""
        group = MeshGroup(dim, self._collectives, self._seat)
        c10d._register_pg_in_world(group, BACKEND, None, dim.name, BACKEND,  # type: ignore[arg-type]
                                   rank_mapping={seat: i for i, seat in enumerate(dim.seats)})
        self.dims.append(dim)
        self.groups.append(group)
        return group

    def add_mesh(self, shape: Sequence[int], names: Sequence[str], world: int, device_type: str = "cpu") -> DeviceMesh:
        """The script's mesh of `shape` over the job's `world` seats (row-major): a group per dimension.

        Raises:
            MisuseError: the shape does not cover the job's seats, or names and shape disagree.
        """
        shape, names = tuple(int(n) for n in shape), tuple(names)
        if len(shape) != len(names) or not shape or min(shape) < 1:
            raise MisuseError(f"rt.device_mesh({shape}, {names}): one name per dimension, every size >= 1")
        if len(set(names)) != len(names):
            raise MisuseError(f"rt.device_mesh(): dimension names must differ, got {names}")
        if math.prod(shape) != world:
            raise MisuseError(f"rt.device_mesh({shape}): the mesh has {math.prod(shape)} seats, "
                              f"the job has {world} (--nproc)")
        groups = [self.add(dim) for dim in mesh_dims(shape, names, self._seat)]
        LocalScatter.install()
        return DeviceMesh.from_group(
            list[dist.ProcessGroup](groups), device_type, mesh=torch.arange(world).view(*shape), mesh_dim_names=names,
        )

    def dirty_groups(self) -> list[str]:
        """The groups with a collective this seat did not complete since their last build (the PrepareAck's), and
        those that carried sends and recvs: a lost step may leave a send there that no recv took (gloo delivers
        eagerly), or skip a pipeline's set-up on one seat only, and a later recv of the same tag would take it."""
        return [dim.name for dim in self.dims if dim.dirty or dim.p2p]

    def peers(self, view: View) -> list[str]:
        """The members this seat shares a mesh group with in `view` (told where it paused for a Prepare)."""
        return sorted({view.seats[seat] for dim in self.dims for seat in dim.seats if seat != self._seat})

    def configure(self, view: View, build: Callable[..., Any]) -> Rebuilt:
        """Give the groups that need it a new communicator under `view`'s prefix, in parallel; keep the others.

        `build(prefix, group_rank, group_size, seats=...)` builds one (on a store connection of its own).

        Raises:
            CollectiveAborted: interrupted by a newer view, or a peer died meanwhile.
            WaitTimeout: a group did not form in time.
        """
        started = time.perf_counter()
        report = Rebuilt()
        todo = [dim for dim in self.dims if dim.needs_rebuild(view)]
        for dim in self.dims:
            dim.broken = False
            if dim not in todo:
                if dim.dirty:
                    log.warning("mesh group %s has an unfinished collective but the view keeps it", dim.name)
                report.kept.append(dim.name)
        if todo:
            try:
                with concurrent.futures.ThreadPoolExecutor(len(todo), thread_name_prefix="deadpool-mesh") as pool:
                    futures = {dim.name: pool.submit(build, f"{view.store_prefix}/mesh/{dim.name}",
                                                     self.groups[self.dims.index(dim)].rank(), len(dim.seats),
                                                     seats=dim.seats)
                               for dim in todo}
                    built = {name: future.result() for name, future in futures.items()}
            except BaseException:
                # A peer may have built and kept a group this seat gave up on (its connect completed as a newer
                # view interrupted ours): the PrepareAck lists them all, so every seat of each builds it again.
                for dim in todo:
                    dim.dirty = True
                raise
            for dim in todo:
                if dim.inner is not None:
                    GUARD.retire(dim.inner)
                    self._collectives.retired(dim.inner)
                dim.inner = built[dim.name]
                dim.members = tuple(view.seats[seat] for seat in dim.seats)
                dim.dirty = dim.p2p = False
                report.rebuilt.append(dim.name)
        report.seconds = time.perf_counter() - started
        return report
