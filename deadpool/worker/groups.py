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

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    Store,
    _unregister_process_group,
)
from torch.distributed.distributed_c10d import GroupName

from deadpool.errors import MisuseError
from deadpool.worker import syncbn
from deadpool.worker.exit import GUARD

log = logging.getLogger("deadpool")

GROUP_NAME = GroupName("deadpool:default")  # the name torch's registry knows the default group by
BACKEND = "gloo"  # what the collectives really run on; torch code branches on it (SyncBatchNorm does)


class UserCollectives(Protocol):
    """What the default group needs from the runtime (``GroupCollectives`` is the runtime's)."""

    def issue_user(self, issue: Callable[[Any], dist.Work]) -> dist.Work | None:
        """Run `issue(group)` on the view's group; None when the step is poisoned (complete locally)."""
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


def _tensors(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _unsupported(what: str) -> MisuseError:
    return MisuseError(
        f"torch.distributed.{what} on the default group is not supported under DeadPool: it carries "
        "all_reduce, all_gather, all_gather_into_tensor, broadcast and barrier (see the README, "
        "'Your own collectives')"
    )


class DefaultGroup(dist.ProcessGroup):
    """The default group: all_reduce, all_gather (into a list or a tensor), broadcast and barrier.

    Each collective works on staged copies (an abandoned collective may still complete
    later, when a SIGSTOPped peer resumes, and must not write into the script's tensors
    then) and copies the result back once it completed.  On a poisoned step a
    collective completes locally: an all_reduce or broadcast leaves the tensor as it was,
    an all_gather gives this seat's tensor in every place, as if every seat held the same.
    Other collectives are not carried: they raise ``MisuseError``.
    """

    def __init__(self, collectives: UserCollectives, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stub lists only (store, rank, size)
        self.collectives = collectives

    def getBackendName(self) -> str:  # torch's name: C++ calls it through the ProcessGroup trampoline
        return BACKEND

    def allreduce(  # type: ignore[override]
        self, tensors: torch.Tensor | list[torch.Tensor], opts: AllreduceOptions | None = None,
    ) -> dist.Work:
        live = _tensors(tensors)
        staged = [t.clone() for t in live]
        options = opts if opts is not None else AllreduceOptions()
        return self._start("all_reduce", lambda group: group.allreduce(staged, options),
                           lambda: torch._foreach_copy_(live, staged), None, live)

    def broadcast(  # type: ignore[override]
        self, tensors: torch.Tensor | list[torch.Tensor], opts: BroadcastOptions | None = None,
    ) -> dist.Work:
        live = _tensors(tensors)
        staged = [t.clone() for t in live]
        options = opts if opts is not None else BroadcastOptions()
        return self._start("broadcast", lambda group: group.broadcast(staged, options),
                           lambda: torch._foreach_copy_(live, staged), None, live)

    def allgather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        staged = [[torch.empty_like(t) for t in outputs] for outputs in output_lists]
        options = opts if opts is not None else AllgatherOptions()

        def done() -> None:
            for outputs, results in zip(output_lists, staged, strict=True):
                torch._foreach_copy_(outputs, results)

        def local() -> None:
            for outputs, tensor in zip(output_lists, inputs, strict=True):
                for output in outputs:
                    output.copy_(tensor)

        flat = [t for outputs in output_lists for t in outputs]
        return self._start("all_gather", lambda group: group.allgather(staged, inputs, options), done, local, flat)

    def all_gather_single(  # type: ignore[override]
        self, output: torch.Tensor, tensor: torch.Tensor, opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        staged = torch.empty_like(output)
        options = opts if opts is not None else AllgatherOptions()

        def local() -> None:
            output.view(self.size(), -1).copy_(tensor.reshape(1, -1).expand(self.size(), -1))

        return self._start("all_gather_into_tensor", lambda group: group._allgather_base(staged, tensor, options),
                           lambda: output.copy_(staged), local, [output])

    def barrier(self, opts: BarrierOptions | None = None) -> dist.Work:  # type: ignore[override]
        options = opts if opts is not None else BarrierOptions()
        return self._start("barrier", lambda group: group.barrier(options), lambda: None, None, [])

    # What is not carried fails with a message that says so (torch's would be "No backend type ...").

    def reduce(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("reduce")

    def reduce_scatter(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("reduce_scatter")

    def reduce_scatter_single(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("reduce_scatter_tensor")

    def gather(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("gather")

    def scatter(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("scatter")

    def alltoall(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("all_to_all")

    def alltoall_base(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("all_to_all_single")

    def send(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("send")

    def recv(self, *_: Any) -> dist.Work:  # type: ignore[override]
        raise _unsupported("recv")

    def _start(
        self,
        what: str,
        issue: Callable[[Any], dist.Work],
        done: Callable[[], object],
        local: Callable[[], None] | None,
        result: list[torch.Tensor],
    ) -> dist.Work:
        real = self.collectives.issue_user(issue)
        if real is None:
            if local is not None:
                local()
            return UserWork(None, None, result)

        def finish() -> None:
            if self.collectives.await_user(real, what):
                done()
            elif local is not None:
                local()

        return UserWork(finish, real, result)


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
    group._set_group_name(GROUP_NAME)
    group._set_group_desc("DeadPool's default group: the current view's seats")
    c10d._register_pg_in_world(group, BACKEND, store, GROUP_NAME, BACKEND,
                               rank_mapping={seat: seat for seat in range(size)})
    c10d._update_default_pg(group)
    syncbn.enable()
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
