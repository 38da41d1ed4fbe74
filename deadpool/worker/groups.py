"""torch's default process group under DeadPool: the script's own collectives, surviving swaps.

Once a member is seated, ``torch.distributed.is_initialized()`` is True and the
default group (``dist.all_reduce(t)``, ``dist.get_rank()``, ``nn.SyncBatchNorm``)
is a ``DefaultGroup``: one Python ``ProcessGroup`` per process, registered where
torch looks groups up, whose collectives run on the current view's gloo group
through the runtime (issued asynchronously, waited on interruptibly), so that a
failure poisons the step instead of raising in the script; why this shape is in
docs/architecture.md.
"""

from __future__ import annotations

import enum
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    Store,
    _unregister_process_group,
)
from torch.distributed.distributed_c10d import GroupName

from deadpool.chaos import ChaosPoint
from deadpool.errors import MisuseError
from deadpool.worker import objects, syncbn
from deadpool.worker.exit import GUARD

log = logging.getLogger("deadpool")

GROUP_NAME = GroupName("deadpool:default")  # the name torch's registry knows the default group by
BACKEND = "gloo"  # what the collectives really run on; torch code branches on it (SyncBatchNorm does)


class UserCollectives(Protocol):
    """What the default group needs from the runtime (``GroupCollectives`` is the runtime's)."""

    def issue_user(self, issue: Callable[[Any], dist.Work], point: ChaosPoint) -> dist.Work | None:
        """Run `issue(group)` on the view's group, then the chaos `point`; None when the step is poisoned."""
        ...

    def await_user(self, work: dist.Work, what: str) -> bool:
        """Wait for `work`, interruptibly; False when it failed or was interrupted (the step is poisoned)."""
        ...


class UserWork(dist.Work):
    """A collective of the script's: waiting completes it, and never raises.

    `finish` runs once, on the first wait: it waits for the real collective and
    copies its staged result into the script's tensors, or, when the step was
    poisoned, leaves them well-formed with local values.
    """

    def __init__(self, finish: Callable[[], None] | None, real: dist.Work | None, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._finish = finish
        self._real = real
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None or self._real is None or self._real.is_completed()

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        self.wait()
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(self._result)
        return future


class Works(dist.Work):
    """Several gloo works as one: done when all are; its future completes with the last of theirs."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for all; with `timeout`, raise RuntimeError if they are not done by then (like a gloo work)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self._works:
            if deadline is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.0)))
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def get_future(self) -> torch.futures.Future[Any]:
        if len(self._works) == 1:
            return self._works[0].get_future()
        return torch.futures.collect_all([work.get_future() for work in self._works])


class Progress:
    """One gloo group's thread for works that progress only inside ``wait()`` (gloo's reduce-scatter).

    It waits on them in the order they were issued, which is the order gloo runs a group's
    collectives in, so that the seat can wait for a ``WaitedWork`` interruptibly or give up on it.
    `close` ends the thread once it is idle; one blocked in an abandoned collective ends when gloo
    gives up on it (the group's timeout).
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[WaitedWork | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=f"deadpool-progress-{name}", daemon=True).start()

    def submit(self, work: WaitedWork) -> None:
        self._queue.put(work)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            work.progress()


class WaitedWork(dist.Work):
    """Works that progress only inside ``wait()``, waited on by their group's ``Progress`` thread.

    Its future completes when those waits return (or with their error).
    """

    def __init__(self, works: list[dist.Work], progress: Progress) -> None:
        super().__init__()
        self._works = works
        self._future: torch.futures.Future[None] = torch.futures.Future()
        self._done = threading.Event()
        progress.submit(self)

    def progress(self) -> None:
        """Wait for the works (on the progress thread)."""
        try:
            for work in self._works:
                work.wait()
        except RuntimeError as err:
            self._future.set_exception(err)  # type: ignore[arg-type]  # the stub types the argument as the result
        else:
            self._future.set_result(None)
        finally:
            self._done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the works; with `timeout`, raise RuntimeError if they are not done by then (like gloo)."""
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"not completed within {timeout}")
        self._future.wait()  # raises the works' error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


def _tensors(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


class Op(enum.StrEnum):
    """A collective a ``SeatGroup`` carries (the name torch.distributed gives it)."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    ALL_GATHER = "all_gather"
    ALL_GATHER_INTO_TENSOR = "all_gather_into_tensor"
    REDUCE_SCATTER = "reduce_scatter"
    REDUCE_SCATTER_TENSOR = "reduce_scatter_tensor"
    SCATTER = "scatter"
    BARRIER = "barrier"
    REDUCE = "reduce"
    GATHER = "gather"
    ALL_TO_ALL = "all_to_all"
    ALL_TO_ALL_SINGLE = "all_to_all_single"
    SEND = "send"
    RECV = "recv"


GATHERS = frozenset({Op.ALL_GATHER, Op.ALL_GATHER_INTO_TENSOR})
SCATTERS = frozenset({Op.REDUCE_SCATTER, Op.REDUCE_SCATTER_TENSOR})
POINT_TO_POINT = frozenset({Op.SEND, Op.RECV})


def _unsupported(what: str) -> MisuseError:
    return MisuseError(
        f"torch.distributed.{what} on a DeadPool group is not supported: it carries "
        f"{', '.join(op.value for op in Op)} (see the README, 'Your own collectives')"
    )


def _fill(output: torch.Tensor, source: torch.Tensor) -> None:
    """`output` holds `source`'s leading elements, zeros past them: a local stand-in of another shape's data."""
    values = source.reshape(-1)[:output.numel()]
    filled = torch.zeros(output.numel(), dtype=output.dtype, device=output.device)
    values = values.to(output.device)
    filled[:values.numel()] = values
    output.copy_(filled.view(output.shape))


def _split(tensor: torch.Tensor, sizes: list[int], size: int) -> Sequence[torch.Tensor]:
    """An all-to-all's chunks of `tensor`: `sizes` rows each, or `size` equal ones when `sizes` is empty."""
    return torch.split(tensor, sizes) if sizes else tensor.tensor_split(size)


def _rows(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """`tensor` as `size` equal rows (the layout of an all-gather's output and a reduce-scatter's input)."""
    return tensor.reshape(size, -1)


_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _own_memory(tensor: torch.Tensor, within: Sequence[torch.Tensor] = ()) -> bool:
    """`tensor` may go to gloo as it is, unstaged: it is the whole of its storage (contiguous, from its start, not
    needing grad) and no other tensor views that storage but those of `within` that lie in it (an in-place
    all-gather's input).  Gloo gets an alias of it (:func:`_aliases`); should the collective be abandoned,
    :func:`_move` gives the tensor new memory, and a late completion writes into memory that nobody reads."""
    if _USE_COUNT is None or tensor.requires_grad or not tensor.numel() or not tensor.is_contiguous() \
            or tensor.storage_offset():
        return False
    storage = tensor.untyped_storage()
    if storage.nbytes() != tensor.nbytes:
        return False
    inside = [t for t in within if t.numel() and _shares(t, [tensor])]
    if any(t.requires_grad for t in inside):
        return False
    return _USE_COUNT(storage._cdata) == 2 + len(inside)  # this handle, the tensor, the views inside it


def _shares(tensor: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    """`tensor` lies in the memory of one of `others`."""
    where = tensor.untyped_storage().data_ptr()
    return any(other.untyped_storage().data_ptr() == where for other in others)


def _aliases(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Other tensor objects over the same memory, for gloo to hold: :func:`_move` then re-points the caller's
    own objects, and gloo's still hold (and keep alive) the memory they were given."""
    return [t.detach() for t in tensors]


def _move(tensors: Sequence[torch.Tensor]) -> None:
    """Give each tensor new memory holding its values: gloo keeps the old memory of an abandoned collective
    (through the aliases it was given: re-pointing the very objects gloo holds would re-point gloo's too)."""
    with torch.no_grad():
        for tensor in tensors:
            tensor.set_(tensor.clone())  # type: ignore[call-overload]  # set_(Tensor) is in torch, not the stub


class SeatGroup(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose collectives run on a gloo group the runtime replaces per view.

    Each collective works on staged copies (an abandoned collective may still complete
    later, when a SIGSTOPped peer resumes, and must not write into the caller's tensors
    then) and copies the result back once it completed.  A group with `_UNSTAGED` hands
    gloo the buffers of an all-gather or reduce-scatter into tensors that own their memory
    alone (FSDP2's: the staging copies cost it 7-9% of a step): abandoned, those tensors
    move to new memory, and the old stays gloo's.  When the step is poisoned a
    collective completes locally: an all_reduce, reduce, broadcast or recv leaves the tensor as
    it was, an all_gather or gather gives this seat's tensor in every place, a reduce-scatter
    this seat's own chunk, an all-to-all what this seat sends itself from every seat, as if
    every seat held the same.  The values are lost with the step; what matters
    is that the caller (the script, FSDP2, DTensor) runs to the step's end without an error.
    Subclasses say where a collective is issued (`_issue`) and how it is waited on (`_await`).
    """

    _UNSTAGED = False  # all-gathers and reduce-scatters into tensors that own their memory go unstaged

    def __init__(self, rank: int, size: int, name: str) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stub lists only (store, rank, size)
        self._name = name
        self._progress: tuple[Any, Progress] | None = None  # (gloo group, its progress thread)

    def _issue(self, issue: Callable[[Any], dist.Work], op: Op) -> dist.Work | None:
        """Run `issue(gloo_group)`; None when the collective must complete locally."""
        raise NotImplementedError

    def _await(self, work: dist.Work, op: Op) -> bool:
        """Wait for `work`, interruptibly; False when it failed or was interrupted."""
        raise NotImplementedError

    def _progress_of(self, group: Any) -> Progress:
        """The progress thread of `group` (the gloo group a collective is issued on): a new one per group."""
        if self._progress is None or self._progress[0] is not group:
            if self._progress is not None:
                self._progress[1].close()
            self._progress = (group, Progress(self._name))
        return self._progress[1]

    # torch's names: C++ calls these through the ProcessGroup trampoline (DeviceMesh reads the group name).

    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._name

    def _in_place(self, op: Op, tensors: torch.Tensor | list[torch.Tensor],
                  issue: Callable[[Any, list[torch.Tensor]], dist.Work]) -> dist.Work:
        """A collective that writes its result into its inputs (all-reduce, broadcast, reduce), on staged copies:
        lost, it leaves them as they were."""
        live = _tensors(tensors)
        staged = [t.clone() for t in live]
        return self._start(op, lambda group: issue(group, staged), lambda: torch._foreach_copy_(live, staged), None,
                           live)

    def allreduce(  # type: ignore[override]
        self, tensors: torch.Tensor | list[torch.Tensor], opts: AllreduceOptions | None = None,
    ) -> dist.Work:
        options = opts if opts is not None else AllreduceOptions()
        return self._in_place(Op.ALL_REDUCE, tensors, lambda group, staged: group.allreduce(staged, options))

    def broadcast(  # type: ignore[override]
        self, tensors: torch.Tensor | list[torch.Tensor], opts: BroadcastOptions | None = None,
    ) -> dist.Work:
        options = opts if opts is not None else BroadcastOptions()
        return self._in_place(Op.BROADCAST, tensors, lambda group, staged: group.broadcast(staged, options))

    def allgather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        options = opts if opts is not None else AllgatherOptions()
        return self._gathered(Op.ALL_GATHER, output_lists, inputs,
                              lambda group, staged: group.allgather(staged, inputs, options))

    def _gathered(self, op: Op, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  issue: Callable[[Any, list[list[torch.Tensor]]], dist.Work]) -> dist.Work:
        """A collective that gathers into lists of outputs (all-gather; gather, whose lists only the root has), on
        staged outputs: lost, it gives this seat's tensor in every place."""
        staged = [[torch.empty_like(t) for t in outputs] for outputs in output_lists]

        def done() -> None:
            for outputs, results in zip(output_lists, staged, strict=True):
                torch._foreach_copy_(outputs, results)

        def local() -> None:
            for outputs, tensor in zip(output_lists, inputs[:len(output_lists)], strict=True):
                for output in outputs:
                    output.copy_(tensor)

        flat = [t for outputs in output_lists for t in outputs]
        return self._start(op, lambda group: issue(group, staged), done, local, flat)

    def all_gather_single(  # type: ignore[override]
        self, output: torch.Tensor, tensor: torch.Tensor, opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        return self.allgather_into_tensor_coalesced([output], [tensor], opts)

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def allgather_into_tensor_coalesced(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        unstaged = self._UNSTAGED and all(_own_memory(t, inputs) for t in outputs)
        staged = _aliases(outputs) if unstaged else [torch.empty_like(t) for t in outputs]
        given = _aliases(inputs) if unstaged else inputs
        moving = [*outputs, *(t for t in inputs if _shares(t, outputs))] if unstaged else []  # when abandoned
        options = opts if opts is not None else AllgatherOptions()
        size = self.size()

        def issue(group: Any) -> dist.Work:  # gloo has no coalesced all-gather: one each
            pairs = zip(staged, given, strict=True)
            return Works([group._allgather_base(out, tensor, options) for out, tensor in pairs])

        def local() -> None:
            _move(moving)  # the outputs, and the inputs inside them, leave the memory gloo may still write
            for output, tensor in zip(outputs, inputs, strict=True):
                _rows(output, size).copy_(tensor.reshape(1, -1).expand(size, -1))

        done = (lambda: None) if unstaged else (lambda: torch._foreach_copy_(outputs, staged))
        return self._start(Op.ALL_GATHER_INTO_TENSOR, issue, done, local, outputs)

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> dist.Work:
        return self.reduce_scatter_tensor_coalesced(
            outputs, [torch.cat([t.reshape(-1) for t in inputs]) for inputs in input_lists], opts)

    def reduce_scatter_single(  # type: ignore[override]
        self, output: torch.Tensor, tensor: torch.Tensor, opts: ReduceScatterOptions | None = None,
    ) -> dist.Work:
        return self.reduce_scatter_tensor_coalesced([output], [tensor], opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions | None = None,
    ) -> dist.Work:
        """gloo's reduce-scatter, on staged copies; it makes progress only inside ``wait()``, which cannot be
        given up on, so the group's progress thread waits (``WaitedWork``) and the seat waits for it,
        interruptibly."""
        unstaged = self._UNSTAGED and all(map(_own_memory, [*inputs, *outputs]))
        staged_in = _aliases(inputs) if unstaged else [t.detach().clone() for t in inputs]
        staged_out = _aliases(outputs) if unstaged else [torch.empty_like(t) for t in outputs]
        moving = [*inputs, *outputs] if unstaged else []  # when abandoned
        options = opts if opts is not None else ReduceScatterOptions()
        rank, size = self.rank(), self.size()

        def issue(group: Any) -> dist.Work:
            pairs = zip(staged_out, staged_in, strict=True)
            works = [group._reduce_scatter_base(out, tensor, options) for out, tensor in pairs]
            return WaitedWork(works, self._progress_of(group))

        def local() -> None:
            _move(moving)
            for output, tensor in zip(outputs, inputs, strict=True):
                output.copy_(_rows(tensor, size)[rank].view_as(output))

        done = (lambda: None) if unstaged else (lambda: torch._foreach_copy_(outputs, staged_out))
        return self._start(Op.REDUCE_SCATTER_TENSOR, issue, done, local, outputs)

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
        opts: ScatterOptions | None = None,
    ) -> dist.Work:
        staged = [torch.empty_like(t) for t in outputs]
        options = opts if opts is not None else ScatterOptions()
        rank = self.rank()

        def local() -> None:
            for output, inputs in zip(outputs, input_lists, strict=False):  # only the root has inputs
                output.copy_(inputs[rank])

        return self._start(Op.SCATTER, lambda group: group.scatter(staged, input_lists, options),
                           lambda: torch._foreach_copy_(outputs, staged), local, outputs)

    def barrier(self, opts: BarrierOptions | None = None) -> dist.Work:  # type: ignore[override]
        options = opts if opts is not None else BarrierOptions()
        return self._start(Op.BARRIER, lambda group: group.barrier(options), lambda: None, None, [])

    def reduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: ReduceOptions | None = None,
    ) -> dist.Work:
        options = opts if opts is not None else ReduceOptions()
        return self._in_place(Op.REDUCE, tensors, lambda group, staged: group.reduce(staged, options))

    def gather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: GatherOptions | None = None,
    ) -> dist.Work:
        options = opts if opts is not None else GatherOptions()
        return self._gathered(Op.GATHER, output_lists, inputs,
                              lambda group, staged: group.gather(staged, inputs, options))

    def all_to_all_single(  # type: ignore[override]
        self, output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int],
        input_split_sizes: list[int], opts: AllToAllOptions | None = None,
    ) -> dist.Work:
        staged = torch.empty_like(output)
        options = opts if opts is not None else AllToAllOptions()
        size, rank = self.size(), self.rank()

        def local() -> None:  # from every seat, what this one sends itself (as if every seat held the same)
            own = _split(tensor, input_split_sizes, size)[rank]
            for chunk in _split(output, output_split_sizes, size):
                _fill(chunk, own)

        return self._start(Op.ALL_TO_ALL_SINGLE, lambda group: group.alltoall_base(
            staged, tensor, output_split_sizes, input_split_sizes, options), lambda: output.copy_(staged), local,
            [output])

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions | None = None,
    ) -> dist.Work:
        staged = [torch.empty_like(t) for t in outputs]
        options = opts if opts is not None else AllToAllOptions()
        rank = self.rank()

        def local() -> None:
            for output in outputs:
                _fill(output, inputs[rank])

        return self._start(Op.ALL_TO_ALL, lambda group: group.alltoall(staged, inputs, options),
                           lambda: torch._foreach_copy_(outputs, staged), local, outputs)

    # gloo's sends and recvs complete only inside a wait, and a wait with a timeout that runs out closes the
    # connection: their group's progress thread waits for them (as for a reduce-scatter), the seat on that.

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:  # type: ignore[override]
        return self._start(Op.SEND, lambda group: WaitedWork([group.send(tensors, dst, tag)], self._progress_of(group)),
                           lambda: None, None, [])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:  # type: ignore[override]
        live = _tensors(tensors)
        staged = [torch.empty_like(t) for t in live]  # a lost recv leaves the tensor as it was
        return self._start(Op.RECV, lambda group: WaitedWork([group.recv(staged, src, tag)], self._progress_of(group)),
                           lambda: torch._foreach_copy_(live, staged), None, live)

    # What is not carried fails with a message that says so (torch's would be "No backend type ...").

    def recv_anysource(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("recv from any source (src=None)")

    def _start(
        self,
        op: Op,
        issue: Callable[[Any], dist.Work],
        done: Callable[[], object],
        local: Callable[[], None] | None,
        result: list[torch.Tensor],
    ) -> dist.Work:
        real = self._issue(issue, op)
        if real is None:
            if local is not None:
                with torch.no_grad():  # as a backend writes: a recv's buffer may be a leaf that requires grad
                    local()
            objects.lost_locally()  # inside torch's object collectives: the bytes after the sizes never come
            return UserWork(None, None, result)

        def finish() -> None:
            with torch.no_grad():
                if self._await(real, op):
                    done()
                    return
                if local is not None:
                    local()
            objects.lost_locally()

        return UserWork(finish, real, result)


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


def install_default_group(collectives: UserCollectives, rank: int, size: int, store: Store) -> DefaultGroup | None:
    """Make torch's default group this seat's ``DefaultGroup`` (once seated; again only if the seat changed).

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
    original = dist.init_process_group
    if getattr(original, "refuses_env_rendezvous", False):
        return

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

    init_process_group.refuses_env_rendezvous = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group

    def from_init_device_mesh(*args: Any, **kwargs: Any) -> None:
        raise MisuseError(
            "torch.distributed.device_mesh.init_device_mesh() under deadpool launch: make the mesh with "
            "rt.device_mesh(shape, names), the same torch DeviceMesh, whose groups DeadPool rebuilds at a swap "
            "(a spare waits there for its seat)")

    # init_device_mesh makes the default group itself (its module's own name for torch's function) when there is
    # none: before the script's loop there is none yet, and torch's call would fail on DeadPool's port.
    device_mesh.init_process_group = from_init_device_mesh  # type: ignore[attr-defined]


def own_groups(make: Callable[[Sequence[int] | None, bool], Any]) -> None:
    """Make ``dist.new_group`` (and torch's helpers that make groups with it, ``new_subgroups``) give the
    script a group that DeadPool rebuilds at every swap that replaced one of its seats, as it does a mesh
    dimension's: `make(ranks, sort_ranks)` is the runtime's. What torch's other arguments choose (a backend, its
    options, a timeout, a description) is DeadPool's here: its gloo group and collective timeout."""
    original = c10d.new_group
    if getattr(original, "deadpool_makes", False):
        return

    @functools.wraps(original)
    def new_group(ranks: Sequence[int] | None = None, timeout: Any = None, backend: Any = None,
                  pg_options: Any = None, use_local_synchronization: bool = False, group_desc: str | None = None,
                  device_id: torch.device | None = None, sort_ranks: bool = True) -> Any:
        return make(ranks, sort_ranks)

    new_group.deadpool_makes = True  # type: ignore[attr-defined]
    dist.new_group = c10d.new_group = new_group
