"""The script's own ``torch.distributed.checkpoint`` saves and loads in a lost step.

A distributed save is planned with collectives on the default group (each seat's plan gathered,
a global plan checked and scattered back). In a lost step those complete locally (groups/default.py,
objects.py): the coordinator seat would check a global plan made of its own plan in every place,
fail, and raise ``CheckpointException`` in the script, a second failure the job may not survive
(the seat and its buddy's dead peer lost together). The step is replayed from the restore, save
and all, so a lost step's save only has to end quietly: ``enable`` wraps torch's save and load
(the functions ``dcp.save`` and ``dcp.load`` call, so the script's way of importing them does not
matter). On the training thread, a save or load that begins in a lost step does nothing, and one
that raises after its step was lost inside returns as if it had done nothing; whatever files it
wrote are written again by the replay (the same step, so the same path). A save that fails in a
step that is not lost still raises, and one without collectives (``no_dist``: DeadPool's own disk
checkpoints) is left alone. ``dcp.async_save`` is refused with a ``MisuseError`` that says why.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

from deadpool.errors import MisuseError
from deadpool.worker.patches import DCP_ASYNC_SAVE, DCP_LOAD, DCP_SAVE, PATCHES


def enable_once_imported(step_lost: Callable[[], bool]) -> bool:
    """Wrap torch's save and load once the script has imported ``torch.distributed.checkpoint`` (it costs half a
    second of imports: a script that does not checkpoint never pays it); True once they are wrapped."""
    if DCP_SAVE.module not in sys.modules or DCP_LOAD.module not in sys.modules:
        return False
    from torch.distributed.checkpoint.metadata import Metadata

    save_stand_in: Callable[[], Any] = lambda: Metadata(state_dict_metadata={})  # noqa: E731
    for target, stand_in in ((DCP_SAVE, save_stand_in), (DCP_LOAD, lambda: None)):
        PATCHES.install(target, functools.partial(_quiet_when_lost, step_lost=step_lost, stand_in=stand_in))
    PATCHES.install(DCP_ASYNC_SAVE, _refuse_async_save)
    return True


def _refuse_async_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """``dcp.async_save`` raises a ``MisuseError`` that says why and what to use: torch's own refusal asks the
    default group for a CPU backend ("try initializing process group with 'cpu:gloo,cuda:nccl'"), which misleads
    here, and its planning would run on a thread beside the step's collectives."""
    @functools.wraps(original)
    def async_save(*args: Any, **kwargs: Any) -> Any:
        raise MisuseError("torch.distributed.checkpoint.async_save() under deadpool launch is not supported (it plans "
                          "on a thread beside the step's collectives): use dcp.save(), or DeadPool's own checkpoints "
                          "written in the background (deadpool launch --checkpoint-dir DIR --checkpoint-every K)")

    return async_save


def _quiet_when_lost(original: Callable[..., Any], step_lost: Callable[[], bool],
                     stand_in: Callable[[], Any]) -> Callable[..., Any]:
    from torch.distributed.checkpoint.api import CheckpointException

    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        local = signature.bind(*args, **kwargs).arguments.get("no_dist", False)
        if local or threading.current_thread() is not threading.main_thread():
            return original(*args, **kwargs)
        if step_lost():
            return stand_in()
        try:
            return original(*args, **kwargs)
        except (Exception, CheckpointException):  # the latter a BaseException: every seat's errors, gathered
            if step_lost():  # its collectives completed locally: what it checked was made up
                return stand_in()
            raise

    return wrapped
