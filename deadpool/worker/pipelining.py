"""``torch.distributed.pipelining`` across swaps: every schedule sets its stages up again after a rebuild.

A pipeline schedule sets its stages up in its first ``step()``: a vote passed from stage to stage
over the pipeline group (and, without static shapes, a metadata exchange), after which it never
speaks of it again. A spare's schedule is new, so its first step would vote alone while its
neighbours, set up long ago, send activations: a hang, or a wrong inference. After every view
change that rolls the seats back (every seat adopts it at the same step boundary) each schedule
of this process sets its stages up once more in its next step, the spare's with them
(``rebuilt()``, from ``GroupCollectives.rebuild``). A set-up that a failure interrupts (its vote
or shapes completed locally) ends the lost step's schedule there, without an exception: the step
is replayed, and the set-up with it. torch's schedule classes are patched only once the script
imported them (importing them costs about a second).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

from deadpool.worker.lost_step import fill_missing_grads
from deadpool.worker.patches import PATCHES, PIPELINE_SET_UP, PIPELINE_STEPS


class Seat(Protocol):
    """What the patched schedules need from the runtime (``GroupCollectives`` is the runtime's)."""

    def step_lost(self) -> bool:
        """The step is lost (a collective failed, or a Prepare interrupted it)."""
        ...

    def abandon_forward(self) -> None:
        """This seat stops the lost step: its later mesh collectives complete locally, its peers stop waiting."""
        ...


class LostSetUp(Exception):
    """A schedule's set-up in a lost step: the schedule's step ends (caught around ``step()``, never the script's)."""


_generation = 0  # rebuilds this process took part in: a schedule set up under an older one sets up again
_seat: Seat | None = None


def rebuilt(seat: Seat) -> None:
    """The seat's groups were rebuilt for a new view (every seat at the same step): schedules set up again."""
    global _generation, _seat
    _generation, _seat = _generation + 1, seat
    _patch()


def _lost() -> bool:
    return _seat is not None and _seat.step_lost()


def _patch() -> None:
    if PATCHES.install(PIPELINE_SET_UP, _setting_up_again):
        for target in PIPELINE_STEPS:
            PATCHES.install(target, _ending_lost_set_ups)


def _setting_up_again(original: Any) -> Any:
    @functools.wraps(original)
    def initialize(self: Any, stages: Any, args: Any, kwargs: Any, target: Any, fwd_initialized: bool,
                   bwd_initialized: bool, *rest: Any, **more: Any) -> tuple[bool, bool]:
        if getattr(self, "_deadpool_generation", None) != _generation:
            fwd_initialized = bwd_initialized = False
        if not fwd_initialized and _lost():
            raise LostSetUp  # its peers may never answer: set up in the replayed step
        try:
            result: tuple[bool, bool] = original(self, stages, args, kwargs, target, fwd_initialized,
                                                 bwd_initialized, *rest, **more)
        except Exception:
            if _lost():  # a vote or shape that never came: torch's own check failed on the local stand-in
                raise LostSetUp from None
            raise
        if result != (fwd_initialized, bwd_initialized) and _lost():
            raise LostSetUp  # set up on stand-ins: again in the replayed step
        self._deadpool_generation = _generation
        return result

    return initialize


def _ending_lost_set_ups(step: Any) -> Any:
    @functools.wraps(step)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, *args, **kwargs)
        except LostSetUp:
            if _seat is not None:
                _seat.abandon_forward()
            stages = getattr(self, "_stages", None) or [getattr(self, "_stage", None)]
            fill_missing_grads(getattr(stage, "submod", None) for stage in stages)
            return None

    return guarded
