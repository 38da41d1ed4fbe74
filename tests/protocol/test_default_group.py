"""torch's default group under DeadPool, without a job: registration, staging, and poisoned collectives.

The runtime's side (``UserCollectives``) is a stand-in whose "group" runs each
collective as if every other seat held the same tensor; a failure or a poisoned
step must leave the script's tensors well-formed and raise nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch._C._distributed_c10d import HashStore

from deadpool.actors.handoff import Handoff
from deadpool.chaos import ChaosAction, ChaosPoint, ChaosSpec
from deadpool.config import WorkerEnv
from deadpool.errors import MisuseError
from deadpool.events.log import EventLog
from deadpool.protocol.messages import CollectiveFailed
from deadpool.protocol.view import View
from deadpool.worker import syncbn
from deadpool.worker.exit import ExitGuard
from deadpool.worker.faults import FaultInjector
from deadpool.worker.groups import default, own
from deadpool.worker.groups.communicators import Communicators
from deadpool.worker.groups.default import DefaultGroup
from deadpool.worker.groups.hub import GroupCollectives
from deadpool.worker.patches import Patches
from deadpool.worker.step import StepState

WORLD = 3


class Done:
    """A finished dist.Work."""

    def get_future(self) -> torch.futures.Future[object]:
        future: torch.futures.Future[object] = torch.futures.Future()
        future.set_result(None)
        return future

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Failed(Done):
    """A collective whose wait fails."""


class IdenticalPeers:
    """A gloo group stand-in: every other seat holds the same tensors."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Done:
        for tensor in tensors:
            tensor.mul_(WORLD)
        return Done()

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Done:
        for outs, tensor in zip(outputs, inputs, strict=True):
            for out in outs:
                out.copy_(tensor)
        return Done()

    def _allgather_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any) -> Done:
        output.copy_(tensor.repeat(WORLD))
        return Done()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Done:
        for tensor in tensors:
            tensor.fill_(7.0)  # seat 0's value
        return Done()

    def barrier(self, opts: Any) -> Done:
        return Done()

    def _reduce_scatter_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any) -> Done:
        output.copy_(tensor.reshape(WORLD, -1)[1] * WORLD)  # seat 1's chunk, summed over identical seats
        return Done()

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Done:
        for output, chunks in zip(outputs, inputs, strict=True):
            output.copy_(chunks[1] * WORLD)
        return Done()

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Done:
        for output in outputs:
            output.fill_(5.0)  # the root's chunk for seat 1
        return Done()

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Done:
        return self.allreduce(tensors, opts)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Done:
        return self.allgather(outputs, inputs, opts) if outputs else Done()  # only the root has outputs

    def alltoall_base(self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], opts: Any) -> Done:
        output.copy_(torch.arange(float(output.numel())))  # what the seats sent this one
        return Done()

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> Done:
        for i, output in enumerate(outputs):
            output.fill_(float(i))
        return Done()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Done:
        return Done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Done:
        for tensor in tensors:
            tensor.fill_(float(src))
        return Done()


class Runtime:
    """A ``UserCollectives``: `poisoned` refuses to issue, `fail` makes the wait fail."""

    def __init__(self) -> None:
        self.group = IdenticalPeers()
        self.poisoned = False
        self.fail = False
        self.fail_after: int | None = None  # this many collectives succeed, then one fails
        self.late: list[Callable[[], None]] = []  # what the group would still do after an abandoned wait
        self.points: list[ChaosPoint] = []  # where each issued collective would fire a chaos spec

    def issue_user(self, issue: Callable[[Any], Any], point: ChaosPoint) -> Any:
        self.points.append(point)
        if self.poisoned:
            return None
        if self.fail_after == 0:
            self.fail_after = None
            return Failed()
        if self.fail_after is not None:
            self.fail_after -= 1
        if not self.fail:
            return issue(self.group)
        self.late.append(lambda: issue(self.group))
        return Done()

    def await_user(self, work: Any, what: str) -> bool:
        return not self.fail and not isinstance(work, Failed)


@pytest.fixture(autouse=True)
def torch_syncbn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installing the group routes SyncBatchNorm's CPU forward (syncbn.py) through a registry of this test's own:
    both undone after each test."""
    monkeypatch.setattr(nn.SyncBatchNorm, "forward", nn.SyncBatchNorm.forward)
    monkeypatch.setattr(syncbn, "PATCHES", Patches())


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    assert not dist.is_initialized()
    rt = Runtime()
    group = default.configure(rt, 1, WORLD, HashStore())
    assert group is not None
    try:
        yield rt
    finally:
        default._unregister(group)
    assert not dist.is_initialized()


def test_once_seated_torch_sees_a_default_group(runtime: Runtime) -> None:
    group = c10d._get_default_group()
    assert isinstance(group, DefaultGroup) and dist.group.WORLD is group
    assert dist.is_initialized() and dist.get_rank() == 1 and dist.get_world_size() == WORLD
    assert dist.get_backend() == "gloo"
    assert c10d._resolve_process_group(default.GROUP_NAME) is group
    assert default.configure(runtime, 1, WORLD, HashStore()) is group, "kept across views"


def test_collectives_run_on_the_runtimes_group(runtime: Runtime) -> None:
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    assert torch.equal(tensor, torch.full((4,), float(WORLD)))
    gathered = [torch.zeros(2) for _ in range(WORLD)]
    dist.all_gather(gathered, torch.tensor([1.0, 2.0]))
    assert all(torch.equal(g, torch.tensor([1.0, 2.0])) for g in gathered)
    flat = torch.zeros(2 * WORLD)
    dist.all_gather_single(flat, torch.tensor([1.0, 2.0]))
    assert torch.equal(flat, torch.tensor([1.0, 2.0] * WORLD))
    sent = torch.zeros(3)
    dist.broadcast(sent, src=0)
    assert torch.equal(sent, torch.full((3,), 7.0))
    dist.barrier()
    broadcast = ChaosPoint.BROADCAST  # ZeRO's post-step broadcast: where at=broadcast fires
    assert runtime.points == [*[ChaosPoint.USER_COLLECTIVE] * 3, broadcast, ChaosPoint.USER_COLLECTIVE]


def test_an_async_collective_writes_only_when_waited_on(runtime: Runtime) -> None:
    tensor = torch.ones(2)
    work = dist.all_reduce(tensor, async_op=True)
    assert work is not None
    assert torch.equal(tensor, torch.ones(2)), "the collective runs on a staged copy"
    work.wait()
    assert torch.equal(tensor, torch.full((2,), float(WORLD)))
    assert work.is_completed()


def test_on_a_poisoned_step_collectives_complete_locally_and_raise_nothing(runtime: Runtime) -> None:
    runtime.poisoned = True
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    assert torch.equal(tensor, torch.ones(2))
    gathered = [torch.full((2,), float("nan")) for _ in range(WORLD)]
    dist.all_gather(gathered, torch.tensor([1.0, 2.0]))
    assert all(torch.equal(g, torch.tensor([1.0, 2.0])) for g in gathered), "as if every seat held the same"
    flat = torch.full((2 * WORLD,), float("nan"))
    dist.all_gather_single(flat, torch.tensor([1.0, 2.0]))
    assert torch.equal(flat, torch.tensor([1.0, 2.0] * WORLD))
    dist.barrier()


def test_a_failed_collective_never_writes_into_the_scripts_tensor_even_later(runtime: Runtime) -> None:
    runtime.fail = True
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    assert torch.equal(tensor, torch.ones(2))
    for late in runtime.late:
        late()  # a SIGSTOPped peer resumes: the abandoned collective completes into its staged copy
    assert torch.equal(tensor, torch.ones(2))


def test_a_default_group_of_the_scripts_own_is_left_alone() -> None:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        assert default.configure(Runtime(), 0, 1, HashStore()) is None
        assert not isinstance(c10d._get_default_group(), DefaultGroup)
    finally:
        dist.destroy_process_group()


def test_a_changed_seat_gets_a_new_group_and_the_old_one_is_retired(monkeypatch: pytest.MonkeyPatch) -> None:
    guard = ExitGuard()  # not the process's own: a retired object makes that one end the process at exit
    monkeypatch.setattr(default, "GUARD", guard)
    rt = Runtime()
    first = default.configure(rt, 0, 2, HashStore())
    second = default.configure(rt, 1, 2, HashStore())
    try:
        assert first is not None and second is not None and first is not second
        assert dist.get_rank() == 1 and c10d._resolve_process_group(default.GROUP_NAME) is second
        assert first not in c10d._world.pg_map
        assert any(obj is first for obj in guard._retired), "never destroyed: kept until exit"
    finally:
        assert second is not None
        default._unregister(second)


# -- the runtime's side: GroupCollectives.issue_user / await_user --------------------------------


class Pending:
    """A dist.Work that never completes (a SIGSTOPped peer): a timed wait runs out, like gloo's."""

    def get_future(self) -> torch.futures.Future[object]:
        return torch.futures.Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert timeout is not None, "an untimed wait would never return"
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


class Recorder:
    def __init__(self) -> None:
        self.posted: list[Any] = []

    def __call__(self, message: Any) -> None:
        self.posted.append(message)
        done = getattr(message, "done", None)
        if callable(done):
            done()


def seat(chaos: tuple[ChaosSpec, ...] = ()) -> tuple[GroupCollectives, StepState, Recorder]:
    env = WorkerEnv.from_env({"DEADPOOL_COORDINATOR": "tcp://127.0.0.1:1", "DEADPOOL_MEMBER_ID": "m0", "RANK": "0"})
    env = dataclasses.replace(env, chaos=chaos)
    state = StepState(view=View(1, ["m0", "m1"], [], -1, "epoch-1", "127.0.0.1:1", {}, {}, [1, 0], {}), rank=0, step=4)
    handoff, recorder = Handoff(), Recorder()
    handoff.bind(recorder)
    events = EventLog(None, member="m0", source="worker")
    injector = FaultInjector(env, state, handoff, events, partition=type("Switch", (), {"cut": False})())
    collectives = GroupCollectives("m0", state, handoff, events, injector, lambda: True, timeout=0.05,
                                   bind_host="127.0.0.1", communicators=Communicators(events))
    return collectives, state, recorder


def test_a_users_collective_that_times_out_poisons_the_step_and_is_reported() -> None:
    collectives, state, recorder = seat()
    collectives.group = object()
    work = collectives.issue_user(lambda group: Pending(), ChaosPoint.USER_COLLECTIVE)
    assert work is not None
    assert collectives.await_user(work, "all_reduce") is False
    assert state.poison is not None and "all_reduce of step 4" in state.poison
    assert collectives.group is None, "the group is retired"
    assert [type(m) for m in recorder.posted if isinstance(m, CollectiveFailed)] == [CollectiveFailed]
    assert collectives.issue_user(lambda group: pytest.fail("nothing is issued on a poisoned step"),
                                  ChaosPoint.USER_COLLECTIVE) is None


def test_a_users_collective_that_raises_at_issue_poisons_the_step() -> None:
    collectives, state, _ = seat()
    collectives.group = object()

    def issue(group: Any) -> Any:
        raise RuntimeError("Connection closed by peer")

    assert collectives.issue_user(issue, ChaosPoint.USER_COLLECTIVE) is None
    assert state.poison is not None and "Connection closed" in state.poison


def test_the_usercollective_chaos_point_fires_after_the_issue(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ChaosSpec(ChaosAction.KILL, rank=0, step=4, at=ChaosPoint.USER_COLLECTIVE)
    collectives, _, _ = seat(chaos=(spec,))
    collectives.group = object()
    order: list[str] = []
    monkeypatch.setattr("deadpool.chaos.inject", lambda s, switch: order.append("fired"))
    collectives.issue_user(lambda group: order.append("issued") or Done(), ChaosPoint.USER_COLLECTIVE)
    assert order == ["issued", "fired"], "the collective is in flight when the spec fires"


def test_the_sharding_collectives_run_and_complete_locally_when_poisoned(runtime: Runtime) -> None:
    """reduce_scatter(_tensor), all_gather_into_tensor and scatter (FSDP2's, DTensor's): each seat's own chunk."""
    tensor = torch.arange(6.0)
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, tensor)
    assert out.tolist() == [6.0, 9.0]
    listed = torch.zeros(2)
    dist.reduce_scatter(listed, list(tensor.chunk(WORLD)))
    assert listed.tolist() == [6.0, 9.0]
    gathered = torch.zeros(6)
    dist.all_gather_into_tensor(gathered, torch.tensor([1.0, 2.0]))
    assert gathered.tolist() == [1.0, 2.0] * WORLD
    scattered = torch.zeros(2)
    dist.scatter(scattered, None, src=0)
    assert scattered.tolist() == [5.0, 5.0]
    runtime.poisoned = True
    dist.reduce_scatter_tensor(out, tensor)
    assert out.tolist() == [2.0, 3.0], "this seat's own chunk, unreduced"
    dist.all_gather_into_tensor(gathered, torch.tensor([4.0, 5.0]))
    assert gathered.tolist() == [4.0, 5.0] * WORLD


def test_a_collective_that_is_not_carried_says_so(runtime: Runtime) -> None:
    with pytest.raises(MisuseError, match="recv from any source .* on a DeadPool group is not supported"):
        dist.recv(torch.ones(1))


def test_reduce_gather_all_to_all_and_point_to_point_run_and_complete_locally_when_poisoned(
    runtime: Runtime,
) -> None:
    """Seat 1 of 3: what each carries, and what each leaves when the step is lost (as if every seat held the same)."""
    reduced = torch.ones(2)
    dist.reduce(reduced, dst=0)
    assert reduced.tolist() == [3.0, 3.0]
    with pytest.raises(ValueError):  # torch's own check: only the root passes a list
        dist.gather(torch.ones(1), [torch.zeros(1)] * WORLD, dst=0)
    dist.gather(torch.ones(1), None, dst=0)
    exchanged = torch.zeros(6)
    dist.all_to_all_single(exchanged, torch.zeros(3), [2, 2, 2], [1, 1, 1])
    assert exchanged.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    outs = [torch.zeros(1) for _ in range(WORLD)]
    dist.all_to_all(outs, [torch.ones(1) * i for i in range(WORLD)])
    assert [o.item() for o in outs] == [0.0, 1.0, 2.0]
    dist.send(torch.ones(1), dst=2)
    got = torch.zeros(2)
    assert dist.recv(got, src=0) == 0 and got.tolist() == [0.0, 0.0]
    assert dist.irecv(got, src=2).wait() and got.tolist() == [2.0, 2.0]
    assert runtime.points == [ChaosPoint.USER_COLLECTIVE] * 7

    runtime.poisoned = True
    dist.reduce(reduced, dst=0)
    assert reduced.tolist() == [3.0, 3.0], "a lost reduce leaves the tensor as it was"
    mine = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # to seat 0: [1], seat 1: [2, 3], seat 2: [4, 5, 6]
    exchanged = torch.full((7,), float("nan"))  # from seat 0: 2 rows, seat 1: 2, seat 2: 3
    dist.all_to_all_single(exchanged, mine, [2, 2, 3], [1, 2, 3])
    assert exchanged.tolist() == [2.0, 3.0, 2.0, 3.0, 2.0, 3.0, 0.0], "what this seat sends itself, from each"
    equal = torch.full((3,), float("nan"))
    dist.all_to_all_single(equal, torch.tensor([7.0, 8.0, 9.0]))
    assert equal.tolist() == [8.0, 8.0, 8.0]
    outs = [torch.full((1,), float("nan")) for _ in range(WORLD)]
    dist.all_to_all(outs, [torch.ones(1) * (10 + i) for i in range(WORLD)])
    assert [o.item() for o in outs] == [11.0] * WORLD
    dist.send(torch.ones(1), dst=2)
    got = torch.full((2,), 9.0)
    assert dist.recv(got, src=0) == 0 and got.tolist() == [9.0, 9.0], "a lost recv leaves the tensor as it was"


def test_a_gather_at_its_root_completes_locally_with_this_seats_tensor_everywhere() -> None:
    rt = Runtime()
    group = default.configure(rt, 0, WORLD, HashStore())
    assert group is not None
    try:
        gathered = [torch.zeros(2) for _ in range(WORLD)]
        dist.gather(torch.tensor([1.0, 2.0]), gathered, dst=0)
        assert all(g.tolist() == [1.0, 2.0] for g in gathered)
        rt.poisoned = True
        gathered = [torch.full((2,), float("nan")) for _ in range(WORLD)]
        dist.gather(torch.tensor([3.0, 4.0]), gathered, dst=0)
        assert all(g.tolist() == [3.0, 4.0] for g in gathered)
        objects: list[Any] = [None] * WORLD
        dist.gather_object({"seat": 0}, objects, dst=0)
        assert objects == [{"seat": 0}] * WORLD
    finally:
        default._unregister(group)


def test_an_object_collective_lost_halfway_leaves_the_scripts_objects_as_if_local(runtime: Runtime) -> None:
    """torch's object collectives are two collectives (sizes, then bytes): one lost after the sizes came must not
    unpickle bytes that never came (a traceback in the script), nor hand the script made-up objects."""
    runtime.fail_after = 1  # the sizes arrive (seat 0's: 7 bytes), the bytes do not
    received: list[Any] = ["mine"]
    dist.broadcast_object_list(received, src=0)
    assert received == ["mine"], "a broadcast this seat did not get leaves the list as it was"
    payload, size = c10d._object_to_tensor({"lr": 0.5}, torch.device("cpu"), None)

    def seat_0s(tensors: list[torch.Tensor], opts: Any) -> Done:  # seat 0 broadcasts {"lr": 0.5}
        tensors[0].copy_(size if tensors[0].dtype == torch.long else payload)
        return Done()

    runtime.group.broadcast = seat_0s  # type: ignore[method-assign]
    dist.broadcast_object_list(received, src=0)
    assert received == [{"lr": 0.5}]
    runtime.fail_after = 1
    placeholders: list[Any] = [None]
    dist.broadcast_object_list(placeholders, src=0)
    assert placeholders == [{"lr": 0.5}], "lost, a broadcast leaves what this seat received from its source last"
    assert placeholders[0] is not received[0]
    runtime.fail_after = 1
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, {"loss": 1.5})
    assert everyone == [{"loss": 1.5}] * WORLD, "as if every seat held the same"
    runtime.poisoned = True
    dist.all_gather_object(everyone, {"loss": 2.5})
    assert everyone == [{"loss": 2.5}] * WORLD
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, None, src=0)
    assert mine == [None]
    runtime.poisoned, runtime.fail = False, False
    with pytest.raises(AttributeError):  # the script's own error still reaches it
        dist.all_gather_object(everyone, lambda: None)


def test_the_scripts_own_groups_and_torchs_helpers_that_make_groups_are_the_runtimes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dist.new_group, with any of torch's arguments, and new_subgroups_by_enumeration (which calls it inside
    torch, as new_subgroups does) reach the
    runtime's maker with the ranks and their order; torch's backend, options and timeout are not asked for."""
    import torch.distributed.distributed_c10d as c10d

    made: list[tuple[Any, bool]] = []
    monkeypatch.setattr(c10d, "new_group", c10d.new_group)  # both restored after the test
    monkeypatch.setattr(dist, "new_group", dist.new_group)
    monkeypatch.setattr(own, "PATCHES", Patches())  # this test's registry: the process's may hold the patch already
    own.patch_new_group(lambda ranks, sort_ranks: made.append((ranks, sort_ranks)) or "group")
    own.patch_new_group(lambda ranks, sort_ranks: "a second patch")  # once per process
    assert dist.new_group([0, 1], backend="gloo", timeout=None, group_desc="mine") == "group"
    assert dist.new_group([2, 1], sort_ranks=False) == "group"
    monkeypatch.setattr(c10d, "get_rank", lambda group=None: 3)
    assert dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])[0] == "group"
    assert made == [([0, 1], True), ([2, 1], False), ([0, 1], True), ([2, 3], True)]
