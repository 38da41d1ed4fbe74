"""The script's own groups: ``dist.new_group`` under DeadPool, a group it rebuilds at every swap that replaced
one of its seats, as it does a mesh dimension's (``mesh.py`` holds and rebuilds them).

``OwnGroups`` names each group the same on every seat (by its seats, and how many groups over the same
seats the script made before), so that the seats find one another's; ``patch_new_group`` routes torch's
``new_group`` (and its helpers that call it, ``new_subgroups``) to the runtime.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deadpool.worker.patches import NEW_GROUP, PATCHES


class OwnGroups:
    """The names of the script's ``dist.new_group()`` groups, made in the same order on every seat."""

    def __init__(self) -> None:
        self._made: dict[str, int] = {}  # groups made so far, by their seats

    def name(self, ranks: Sequence[int] | None, sort_ranks: bool, world: int, seat: int) -> tuple[str | None,
                                                                                                  list[int]]:
        """The stable name of the group over `ranks` (every seat for None; sorted unless `sort_ranks` is False,
        as torch's) and its seats in group-rank order; None for the name when `seat` is not one of them.

        Raises:
            ValueError: `ranks` are not distinct seats of a job of `world` seats.
        """
        seats = [int(r) for r in ranks] if ranks is not None else list(range(world))
        seats = sorted(seats) if sort_ranks else seats
        if len(set(seats)) != len(seats) or not all(0 <= r < world for r in seats):
            raise ValueError(f"dist.new_group({list(ranks or [])}): ranks must be distinct seats in 0..{world - 1}")
        key = "-".join(map(str, seats))
        self._made[key] = made = self._made.get(key, 0) + 1  # counted on every seat, members or not
        if seat not in seats:
            return None, seats
        return f"deadpool:group:{key}" + (f":{made}" if made > 1 else ""), seats


def patch_new_group(make: Callable[[Sequence[int] | None, bool], Any]) -> None:
    """Make ``dist.new_group`` give the script `make(ranks, sort_ranks)` (the runtime's). What torch's other
    arguments choose (a backend, its options, a timeout, a description) is DeadPool's here: its communicators
    and collective timeout."""
    PATCHES.install(NEW_GROUP, functools.partial(_making, make))


def _making(make: Callable[[Sequence[int] | None, bool], Any], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def new_group(ranks: Sequence[int] | None = None, timeout: Any = None, backend: Any = None,
                  pg_options: Any = None, use_local_synchronization: bool = False, group_desc: str | None = None,
                  device_id: torch.device | None = None, sort_ranks: bool = True) -> Any:
        return make(ranks, sort_ranks)

    return new_group
