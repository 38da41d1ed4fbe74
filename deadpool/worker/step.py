"""Where the compute thread stands: its view and seat, the step in progress, and whether that step counts.

One ``StepState`` per worker, shared by the runtime's step loop, its recovery
and its collectives, and written only by the compute thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from deadpool.protocol.view import View


@dataclass
class StepState:
    """The compute thread's position in the job."""

    view: View | None = None  # the committed view this member sits in (None until seated)
    rank: int = -1  # this member's seat in `view` (-1: a spare)
    step: int = -1  # the step in progress
    gated_step: int = -2  # the step whose pre-step gate passed (its previous snapshot is confirmed)
    poison: str | None = None  # why the step in progress is lost (None: it counts)
    stepped: int = -1  # the newest step in which an optimizer's step() ran (a lost step's is skipped)
    backward_issued: bool = False  # the step in progress issued a mesh collective in its backward
    abandoned: bool = False  # the step in progress is lost and its backward stopped before its first collective
    forward_abandoned: bool = False  # the step in progress is lost and its forward stopped (a mesh seat)
    auditing: bool = False  # a spare re-does `rank`'s `step` for an audit: its collectives complete locally

    @property
    def epoch(self) -> int:
        return self.view.epoch if self.view else 0

