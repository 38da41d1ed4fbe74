"""rt.device_mesh's groups without a job: names, which groups a view rebuilds, and a broken group's collectives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from deadpool.chaos import ChaosPoint
from deadpool.errors import CollectiveAborted
from deadpool.protocol.view import View
from deadpool.worker.groups.mesh import MeshDim, MeshGroup, SeatGroups, chaos_point, mesh_dims
from deadpool.worker.groups.seat_group import Op


def view(seats: list[str], rebuild: list[str] | None = None) -> View:
    return View(2, seats, [], 5, "epoch-2", "127.0.0.1:1", {}, {}, [1, 2, 3, 0], {}, rebuild or [])


def test_a_seats_groups_are_the_slices_through_it_named_by_the_other_coordinates() -> None:
    dims = mesh_dims((2, 2), ("dp", "tp"), 2)  # [[0, 1], [2, 3]]
    assert [(d.dim, d.name, d.seats) for d in dims] == [("dp", "deadpool:dp:0", (0, 2)),
                                                        ("tp", "deadpool:tp:1", (2, 3))]
    dims = mesh_dims((2, 2, 2), ("pp", "dp", "tp"), 5)  # 5 = (1, 0, 1)
    assert [(d.name, d.seats) for d in dims] == [("deadpool:pp:0-1", (1, 5)), ("deadpool:dp:1-1", (5, 7)),
                                                ("deadpool:tp:1-0", (4, 5))]


def test_a_group_is_rebuilt_when_a_seat_changed_member_or_the_view_names_it() -> None:
    dim = MeshDim("tp", "deadpool:tp:0", (0, 1), inner=object(), members=("a", "b"))
    assert not dim.needs_rebuild(view(["a", "b", "c", "d"]))
    assert dim.needs_rebuild(view(["a", "spare", "c", "d"]))
    assert dim.needs_rebuild(view(["a", "b", "c", "d"], rebuild=["deadpool:tp:0"]))
    assert MeshDim("tp", "deadpool:tp:0", (0, 1)).needs_rebuild(view(["a", "b", "c", "d"])), "no gloo group yet"


def test_a_rebuild_that_fails_leaves_every_group_it_was_building_dirty() -> None:
    """One group formed, the other's build was interrupted by a newer view: the peer of the first may keep what
    it built, so both are reported (PrepareAck) and rebuilt on every seat of them, never kept on one side."""
    mesh = SeatGroups(0, Runtime())  # its groups without torch's registry and DeviceMesh (no default group here)
    mesh.dims = mesh_dims((2, 2), ("dp", "tp"), 0)
    mesh.groups = [MeshGroup(dim, Runtime(), 0) for dim in mesh.dims]

    def build(prefix: str, rank: int, size: int, seats: object = None) -> object:
        if "tp" in prefix:
            raise CollectiveAborted(f"building group {prefix}", "interrupted by a newer view", interrupted=True)
        return Sums()

    with pytest.raises(CollectiveAborted):
        mesh.configure(view(["a", "b", "c", "d"]), build)
    assert sorted(mesh.dirty_groups()) == ["deadpool:dp:0", "deadpool:tp:0"]
    assert all(dim.inner is None for dim in mesh.dims)


class Runtime:
    def __init__(self) -> None:
        self.poisoned: list[str] = []
        self.points: list[ChaosPoint] = []
        self.fail = False

    def fault_point(self, point: ChaosPoint) -> None:
        self.points.append(point)

    def poison(self, err: BaseException) -> None:
        self.poisoned.append(str(err))

    def wait_bounded(self, work: Any, what: str, seats: Any) -> None:
        if self.fail:
            raise CollectiveAborted(what, "peer closed the connection")

    def abandons_backward(self) -> bool:
        return False

    def abandoned(self) -> bool:
        return False

    def usable(self, communicator: Any) -> bool:
        return True

    def retired(self, communicator: Any) -> None:
        pass


class Done:
    """A collective that completed."""

    def wait(self, timeout: object = None) -> bool:
        return True


class Sums:
    """A gloo stand-in for a group of two identical seats: an all-reduce doubles, and completes at once."""

    def __init__(self) -> None:
        self.issued = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Done:
        self.issued += 1
        for tensor in tensors:
            tensor.mul_(2)
        return Done()


def test_a_failed_collective_breaks_only_its_group_and_marks_it_dirty() -> None:
    runtime, inner = Runtime(), Sums()
    dim = MeshDim("tp", "deadpool:tp:0", (0, 1), inner=inner, members=("a", "b"))
    group = MeshGroup(dim, runtime, 0)
    t = torch.ones(2)
    group.allreduce([t]).wait()
    assert t.tolist() == [2.0, 2.0] and not dim.dirty and runtime.points == [ChaosPoint.FORWARD]
    runtime.fail = True
    t = torch.ones(2)
    group.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0], "completed locally, never raised"
    assert dim.broken and dim.dirty and runtime.poisoned
    runtime.fail = False
    group.allreduce([t]).wait()
    assert inner.issued == 2, "a broken group issues nothing more this step"


@pytest.mark.parametrize(("op", "point"), [(Op.ALL_GATHER_INTO_TENSOR, ChaosPoint.ALLGATHER),
                                           (Op.REDUCE_SCATTER_TENSOR, ChaosPoint.REDUCESCATTER),
                                           (Op.ALL_REDUCE, ChaosPoint.FORWARD)])
def test_chaos_points_follow_the_collective(op: Op, point: ChaosPoint) -> None:
    assert chaos_point(op) == point


def test_an_all_reduce_on_the_scripts_own_group_is_the_user_collective_point() -> None:
    """A reduce-scatter on it stays ``reducescatter`` (FSDP2's own group for it, set_separate_reduce_scatter_group)."""
    runtime = Runtime()
    dim = MeshDim("group", "deadpool:group:0-1", (0, 1), inner=Sums(), members=("a", "b"), own=True)
    MeshGroup(dim, runtime, 1).allreduce([torch.ones(1)]).wait()
    assert runtime.points == [ChaosPoint.USER_COLLECTIVE]
    assert chaos_point(Op.REDUCE_SCATTER_TENSOR, own=True) == ChaosPoint.REDUCESCATTER


def test_an_all_reduce_in_backward_is_the_backward_point() -> None:
    seen: list[ChaosPoint] = []
    x = torch.ones(1, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(chaos_point(Op.ALL_REDUCE)))
    y.sum().backward()
    assert seen == [ChaosPoint.BACKWARD]


class Gathers:
    """A gloo stand-in for two identical seats that keeps each buffer it was given and the writes it may still do
    (a SIGSTOPped peer that resumes completes an abandoned collective into them)."""

    def __init__(self) -> None:
        self.given: list[torch.Tensor] = []
        self.late: list[Callable[[], object]] = []

    def _allgather_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any) -> Done:
        self.given.append(output)
        output.copy_(tensor.repeat(2))
        self.late.append(lambda: output.fill_(-1.0))
        return Done()

    def _reduce_scatter_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any) -> Done:
        self.given += [output, tensor]
        output.copy_(tensor.reshape(2, -1)[0] * 2)
        self.late += [lambda: output.fill_(-1.0), lambda: tensor.fill_(-1.0)]
        return Done()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def gathering() -> tuple[MeshGroup, Runtime, Gathers]:
    runtime, inner = Runtime(), Gathers()
    dim = MeshDim("dp", "deadpool:dp:0", (0, 1), inner=inner, members=("a", "b"))
    return MeshGroup(dim, runtime, 0), runtime, inner


def test_fsdp2s_gathers_and_scatters_go_unstaged_into_memory_they_own_alone() -> None:
    group, _, inner = gathering()
    output = torch.zeros(4)
    shard = output.narrow(0, 0, 2)  # FSDP2 gathers in place: its input is its own slice of the output
    shard.copy_(torch.tensor([1.0, 2.0]))
    group.allgather_into_tensor_coalesced([output], [shard]).wait()
    assert same_memory(inner.given[-1], output) and output.tolist() == [1.0, 2.0, 1.0, 2.0]
    scatter_in, scatter_out = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(2)
    group.reduce_scatter_tensor_coalesced([scatter_out], [scatter_in]).wait()
    assert same_memory(inner.given[-2], scatter_out) and same_memory(inner.given[-1], scatter_in)
    assert scatter_out.tolist() == [2.0, 4.0]
    # Memory another tensor views (a caller's slice of something larger, a view kept elsewhere) is staged.
    whole = torch.zeros(8)
    group.allgather_into_tensor_coalesced([whole[:4]], [torch.ones(2)]).wait()
    assert not same_memory(inner.given[-1], whole)
    assert whole.tolist() == [1.0] * 4 + [0.0] * 4
    kept = torch.zeros(4)
    alias = kept.view(2, 2)
    group.allgather_into_tensor_coalesced([kept], [torch.ones(2)]).wait()
    assert not same_memory(inner.given[-1], kept) and alias.sum().item() == 4.0


def test_an_abandoned_unstaged_collective_leaves_its_tensors_in_memory_gloo_no_longer_writes() -> None:
    group, runtime, inner = gathering()
    runtime.fail = True
    output = torch.zeros(4)
    shard = output.narrow(0, 2, 2)
    shard.copy_(torch.tensor([5.0, 6.0]))
    group.allgather_into_tensor_coalesced([output], [shard]).wait()
    assert output.tolist() == [5.0, 6.0, 5.0, 6.0], "this seat's shard in every place, as if every seat held it"
    scatter_in, scatter_out = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(2)
    group.reduce_scatter_tensor_coalesced([scatter_out], [scatter_in]).wait()
    assert scatter_out.tolist() == [1.0, 2.0] and runtime.poisoned
    for late in inner.late:
        late()  # the abandoned collectives complete after all, into the memory they were given
    assert output.tolist() == [5.0, 6.0, 5.0, 6.0] and shard.tolist() == [5.0, 6.0]
    assert scatter_out.tolist() == [1.0, 2.0] and scatter_in.tolist() == [1.0, 2.0, 3.0, 4.0]
