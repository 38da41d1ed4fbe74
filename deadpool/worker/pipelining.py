"""``torch.distributed.pipelining`` across swaps: every schedule sets its stages up again after a rebuild.

A pipeline schedule sets its stages up in its first ``step()``: a vote passed from stage to stage
over the pipeline group (and, without static shapes, a metadata exchange), after which it never
speaks of it again. A spare's schedule is new, so its first step would vote alone while its
neighbours, set up long ago, send activations: a hang, or a wrong inference. After every view
change that rolls the seats back (every seat adopts it at the same step boundary) each schedule
of this process sets its stages up once more in its next step, the spare's with them
(``rebuilt()``, from ``GroupCollectives.rebuild``). torch's schedule class is patched only once the
script imported it (importing it costs about a second).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

_SCHEDULES = "torch.distributed.pipelining.schedules"
_generation = 0  # rebuilds this process took part in: a schedule set up under an older one sets up again


def rebuilt() -> None:
    """The seat's groups were rebuilt for a new view (every seat at the same step): schedules set up again."""
    global _generation
    _generation += 1
    _patch()


def _patch() -> None:
    module = sys.modules.get(_SCHEDULES)
    base = getattr(module, "_PipelineSchedule", None)
    original = getattr(base, "_initialize_pp_stages", None)
    if original is None or getattr(original, "deadpool_generation", False):
        return

    @functools.wraps(original)
    def initialize(self: Any, stages: Any, args: Any, kwargs: Any, target: Any, fwd_initialized: bool,
                   bwd_initialized: bool, *rest: Any, **more: Any) -> tuple[bool, bool]:
        if getattr(self, "_deadpool_generation", None) != _generation:
            fwd_initialized = bwd_initialized = False
        result: tuple[bool, bool] = original(self, stages, args, kwargs, target, fwd_initialized, bwd_initialized,
                                             *rest, **more)
        self._deadpool_generation = _generation
        return result

    initialize.deadpool_generation = True  # type: ignore[attr-defined]
    base._initialize_pp_stages = initialize  # type: ignore[union-attr]
