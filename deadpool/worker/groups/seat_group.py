"""A seat's group as torch sees it: a Python ``ProcessGroup`` whose collectives run on a communicator DeadPool
replaces per view, on staged copies, and complete locally when the step is lost.

``SeatGroup`` implements every collective torch calls on a group once; its subclasses say where a
collective is issued and how it is waited on: torch's default group (``default.py``), a mesh
dimension's or the script's own group (``mesh.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
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
)

from deadpool.errors import MisuseError
from deadpool.worker import objects
from deadpool.worker.groups.waits import UserWork, WaitedWork, WaitThread, Works

BACKEND = "gloo"  # what the collectives really run on; torch code branches on it (SyncBatchNorm does)

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
        f"{', '.join(op.value for op in Op)} (see docs/guide/collectives.md)"
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
        self._progress: tuple[Any, WaitThread] | None = None  # (gloo group, its progress thread)

    def _issue(self, issue: Callable[[Any], dist.Work], op: Op) -> dist.Work | None:
        """Run `issue(gloo_group)`; None when the collective must complete locally."""
        raise NotImplementedError

    def _await(self, work: dist.Work, op: Op) -> bool:
        """Wait for `work`, interruptibly; False when it failed or was interrupted."""
        raise NotImplementedError

    def _progress_of(self, group: Any) -> WaitThread:
        """The progress thread of `group` (the gloo group a collective is issued on): a new one per group."""
        if self._progress is None or self._progress[0] is not group:
            if self._progress is not None:
                self._progress[1].close()
            self._progress = (group, WaitThread(self._name))
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

