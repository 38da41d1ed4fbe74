"""torch's object collectives (``all_gather_object``, ``broadcast_object_list``, ...) in a lost step.

Each is two or three tensor collectives: the pickled sizes, then the bytes. When the step is lost
between them, the sizes may have come and the bytes not (a collective of a lost step completes
locally, groups/default.py), and torch would unpickle bytes that never came: a traceback in the script,
or made-up objects. ``enable()`` (called when DeadPool's default group is installed) wraps them:
a collective of DeadPool's groups that completes locally inside one ends it (``lost_locally``),
and the call leaves the script's objects as a local collective leaves tensors: as they were, or
as if every seat held this seat's (the step is rolled back and replayed, so only their being
well-formed matters). The script's own errors (an object that does not pickle) still reach it.
"""

from __future__ import annotations

import enum
import functools
import inspect
import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from deadpool.worker.patches import OBJECT_COLLECTIVES, PATCHES

_CALLS = threading.local()  # depth: object collectives running on this thread


class LostInObjectCall(Exception):
    """A collective inside an object collective completed locally: the step is lost (caught by the wrapper)."""


def lost_locally() -> None:
    """A collective of DeadPool's completed locally: inside an object collective, give up on it here.

    Raises:
        LostInObjectCall: an object collective runs on this thread.
    """
    if getattr(_CALLS, "depth", 0):
        raise LostInObjectCall


def _copy(obj: Any) -> Any:
    """`obj` as torch's object collectives hand it over: pickled and unpickled."""
    return pickle.loads(pickle.dumps(obj))


def _group(a: inspect.BoundArguments) -> dist.ProcessGroup:
    return c10d._group_or_default_group(a.arguments.get("group"))


def _group_rank(a: inspect.BoundArguments, peer: str) -> tuple[int, int]:
    """(this seat's rank in the call's group, the group rank the call names by `peer` or ``group_<peer>``)."""
    group, rank, group_rank = _group(a), a.arguments.get(peer), a.arguments.get(f"group_{peer}")
    if rank is None and group_rank is None:
        rank = 0  # torch's default root: global rank 0
    return group.rank(), c10d._canonicalize_group_rank(group, rank, group_rank, return_global=False)


class Kind(enum.StrEnum):
    """torch's object collectives (their names in ``torch.distributed``)."""

    ALL_GATHER = "all_gather_object"
    GATHER = "gather_object"
    BROADCAST = "broadcast_object_list"
    SCATTER = "scatter_object_list"
    SEND = "send_object_list"
    RECV = "recv_object_list"


FROM_SOURCE = frozenset({Kind.BROADCAST, Kind.SCATTER, Kind.RECV})  # objects that come from one seat


class ObjectCall:
    """One of torch's object collectives: what a lost call leaves (`lost`), after what a call received
    (`received`, for the calls whose objects come from one source).

    A lost call has nothing of this seat's to stand in for a source's objects: it leaves those the seat
    received last from the same source into a list of the same length (a script's placeholders, ``[None]``,
    may not be usable), or the list as it was when there are none.
    """

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._last: dict[tuple[str, int, int], list[Any]] = {}

    def lost(self, a: inspect.BoundArguments) -> Any:
        """Leave the script's objects as a local collective would; return what torch's call returns."""
        args = a.arguments
        if self.kind is Kind.ALL_GATHER:  # as if every seat held this seat's object
            args["object_list"][:] = [_copy(args["obj"]) for _ in args["object_list"]]
            return None
        if self.kind is Kind.GATHER:
            mine, dst = _group_rank(a, "dst")
            if mine == dst and args["object_gather_list"] is not None:
                args["object_gather_list"][:] = [_copy(args["obj"]) for _ in args["object_gather_list"]]
            return None
        if self.kind is Kind.SEND:
            return None
        key, mine = self._key(a)
        if mine == key[1]:  # the source: its objects are its own
            if self.kind is Kind.SCATTER:
                args["scatter_object_output_list"][0] = _copy(args["scatter_object_input_list"][mine])
        elif (last := self._last.get(key)) is not None:
            self._objects(a)[:len(last)] = [_copy(obj) for obj in last]
        return dist.get_global_rank(_group(a), key[1]) if self.kind is Kind.RECV else None

    def received(self, a: inspect.BoundArguments) -> None:
        if self.kind in FROM_SOURCE:
            key, mine = self._key(a)
            if mine != key[1]:
                self._last[key] = self._objects(a)[:key[2]]

    def _objects(self, a: inspect.BoundArguments) -> list[Any]:
        if self.kind is Kind.SCATTER:
            return a.arguments["scatter_object_output_list"]  # type: ignore[no-any-return]
        return a.arguments["object_list"]  # type: ignore[no-any-return]

    def _key(self, a: inspect.BoundArguments) -> tuple[tuple[str, int, int], int]:
        """((group name, source's group rank, objects), this seat's group rank)."""
        mine, src = _group_rank(a, "src")
        received = 1 if self.kind is Kind.SCATTER else len(self._objects(a))  # a scatter fills the first only
        return (_group(a).group_name, src, received), mine


def _wrap(original: Callable[..., Any], call: ObjectCall) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _CALLS.depth = getattr(_CALLS, "depth", 0) + 1
        try:
            result = original(*args, **kwargs)
        except LostInObjectCall:
            return call.lost(bound)
        finally:
            _CALLS.depth -= 1
        call.received(bound)
        return result

    return wrapped


def enable() -> None:
    """Wrap torch's object collectives where scripts call them (``torch.distributed`` and its c10d module)."""
    for kind in Kind:
        PATCHES.install(OBJECT_COLLECTIVES[kind.value], functools.partial(_wrap, call=ObjectCall(kind)))
