"""A lost step ends early and changes nothing that a rollback would have to undo.

Once a step is lost (a collective failed, or a Prepare interrupted it), nothing
it computes counts: the view change rolls every seat back and the step is
replayed.  Two things make that cheap.  An optimizer's ``step()`` in a lost
step is skipped, so parameters and optimizer state keep the values they had
after the last finished step, and a survivor resuming from that very step
reloads only the small state its step did change (RNGs, scheduler, buffers,
data position; ``Recovery`` checks that the condition holds).  And the rest
of a lost backward is abandoned: DeadPool's gradient hooks raise
``StepAbandoned``, which autograd carries out of the engine and the wrapper
installed around ``torch.autograd.backward`` swallows, so ``loss.backward()``
returns at once instead of computing gradients nobody will use.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch


class StepAbandoned(Exception):
    """Raised inside a lost step's backward to stop it; never reaches the script (``abandonable_backward``)."""


def skip_when_lost(optimizer: torch.optim.Optimizer, lost: Callable[[], bool], stepped: Callable[[], None]) -> None:
    """Make `optimizer`'s ``step()`` do nothing (return None) while `lost()`; `stepped()` runs before a real one.

    The wrapper is a bound method carrying the attributes of the ``step`` it wraps, so an LR
    scheduler built before or after it still finds what it looks for (``_wrapped_by_lr_sched``,
    ``__func__``).
    """
    inner = optimizer.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if lost():
            return None
        stepped()
        return inner(*args, **kwargs)

    functools.update_wrapper(step, getattr(inner, "__func__", inner))
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


class AbandonableBackward:
    """``torch.autograd.backward``, which returns quietly when DeadPool abandons a lost step's backward.

    ``Tensor.backward`` calls ``torch.autograd.backward`` by name, so replacing that name covers
    ``loss.backward()`` and GradScaler's scaled backward alike.  Installed once per process.
    """

    def __init__(self) -> None:
        self._original: Callable[..., Any] | None = None

    def install(self) -> None:
        if self._original is not None:
            return
        original = torch.autograd.backward
        self._original = original

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except StepAbandoned:
                return None

        torch.autograd.backward = backward  # type: ignore[assignment]

    def uninstall(self) -> None:
        if self._original is not None:
            torch.autograd.backward = self._original  # type: ignore[assignment]
            self._original = None
