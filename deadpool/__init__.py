"""DeadPool: keep distributed PyTorch training alive when ranks die.

A spare process takes a dead rank's seat while the job runs, the dead rank's
state comes back from an in-memory snapshot held by a peer, and the process
group is rebuilt in place.  See README.md for the tour and docs/ (the
documentation site) for the guide and the design.

    rt = deadpool.init()
    rt.track(model=model, optimizer=opt, sched=sched)
    ddp = rt.ddp(model)
    for step in rt.steps(max_steps):
        ...
    rt.finish()
"""

from typing import TYPE_CHECKING, Any

from deadpool.errors import DeadPoolError, FencedError, JobStopped, MisuseError, PeerFailure, WaitTimeout

if TYPE_CHECKING:
    from deadpool.worker.runtime import Runtime, init


def __getattr__(name: str) -> Any:
    """Import the runtime (and torch) only when a training script asks for it: operator tools stay fast."""
    if name in ("Runtime", "init"):
        from deadpool.worker import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'deadpool' has no attribute {name!r}")


__all__ = [
    "DeadPoolError",
    "FencedError",
    "JobStopped",
    "MisuseError",
    "PeerFailure",
    "Runtime",
    "WaitTimeout",
    "init",
]
__version__ = "0.1.0"
