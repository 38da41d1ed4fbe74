"""Job configuration: every bound and interval, and the environment contract of a worker.

Values come from the environment that ``deadpool launch`` sets (``DEADPOOL_*``)
so that workers, the coordinator and the launcher agree; this module is the one
place that parses it (``Config`` for the bounds, ``WorkerEnv`` for what a
worker is told about itself).  Derived bounds (the process-group timeout) are
computed here, once.
"""

from __future__ import annotations

import enum
import gc
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from deadpool.chaos import ChaosSpec, parse_all
from deadpool.errors import MisuseError
from deadpool.protocol.messages import Role


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback (where listening without the job's secret is allowed)."""
    return host in ("localhost", "::1") or host.startswith("127.")


def default_shm_dir() -> str:
    """``/dev/shm`` where it exists: snapshot slots there let a buddy on the same host map them, not copy them."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else ""


AUDIT_DEPTH = 12  # snapshots kept with --audit: a seat audited every 8 steps or so can still be rolled back


@dataclass(frozen=True, slots=True)
class Config:
    """Timeouts in seconds; every wait in DeadPool is bounded by one of these."""

    # Worker -> coordinator liveness period.  Only a hang (or a cut link) is detected by missed beats, after
    # failure_timeout; an exit, a kill or a failed collective is reported at once.  So the period only has to
    # be well under failure_timeout: at 0.25 s (8 beats per timeout) a worker's runtime thread and the
    # coordinator wake 2.5x less often than at 0.1 s, and on a host with fewer cores than ranks that CPU is
    # training time.
    heartbeat_interval: float = 0.25
    failure_timeout: float = 2.0  # missed heartbeats for this long: the member is dead
    prepare_timeout: float = 10.0  # survivors must acknowledge a Prepare within this
    view_timeout: float = 60.0  # a paused worker waits this long for a committed view
    startup_timeout: float = 120.0  # actives wait this long for the first view
    restore_timeout: float = 30.0  # an adopted spare waits this long for its snapshot
    copy_timeout: float = 60.0  # a local snapshot copy must finish within this
    spare_wait_timeout: float = 60.0  # policy "wait": how long to wait for a new spare
    no_spare_policy: str = "stop"  # "stop" the job, or "wait" for a spare to join
    snapshot_every: int = 1  # take a snapshot every this many steps
    send_timeout: float = 2.0  # one control message must be queued within this
    fence_by_kill: bool = True  # ask the dead member's host agent to SIGKILL it
    secret: str = ""  # shared secret for HMAC on every frame ("" = open, loopback only)
    checkpoint_dir: str = ""  # disk checkpoints (the fallback when a seat and its buddy die together)
    checkpoint_every: int = 0  # write one every this many steps; 0 = off
    resume: bool = False  # the first view restores every seat from the newest disk checkpoint all of them see
    shm_dir: str = field(default_factory=default_shm_dir)  # same-host buddy copies via files here; "" = off
    relay_broadcasts: bool = True  # views and Prepares go to a host's workers through its agent (fanout.py)
    # Fail-slow seats (coordinator/slowness.py): a seat whose compute time is this many times the job's median ...
    slow_threshold: float = 1.5
    slow_steps: int = 5  # ... for this many steps is reported (seat_slow) ...
    replace_slow: bool = False  # ... and moved to a spare when the cost model says it pays (--replace-slow) ...
    slow_reserve: int = 1  # ... while more spares than this stay free for failures
    total_steps: int = 0  # the script's --steps as the launcher saw it (0: unknown), the cost model's horizon
    # Silent data corruption (coordinator/replicas.py): every step each seat checksums 1/K of the state that is the
    # same on every seat (all of it every K steps) and the coordinator compares them; 0 switches the checks off.
    # Half per step keeps the sum under 1% of a step's CPU on the GPT demo (docs/design/corruption.md).
    replica_checks: int = 2
    audit: bool = False  # an idle spare re-does one seat's step after another and compares gradients (--audit)

    @property
    def pg_timeout(self) -> float:
        """Collective timeout: the bound when a hung peer cannot be killed."""
        return max(10.0, 5 * self.failure_timeout)

    def validate(self) -> Config:
        """Check the values for sense.

        Raises:
            MisuseError: a value is out of range, with the name of the setting.
        """
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not value > 0:
                raise MisuseError(f"{f.name} must be positive, got {value}")
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.checkpoint_dir):
            raise MisuseError("checkpoint_every needs a checkpoint_dir and must be >= 0")
        if self.resume and not self.checkpoint_dir:
            raise MisuseError("resume needs a checkpoint_dir")
        if self.slow_threshold <= 1 or self.slow_steps < 1 or self.slow_reserve < 0:
            raise MisuseError(f"slow_threshold must exceed 1 (got {self.slow_threshold}), slow_steps be at least 1 "
                              f"(got {self.slow_steps}) and slow_reserve at least 0 (got {self.slow_reserve})")
        if self.replica_checks < 0:
            raise MisuseError(f"replica_checks must be 0 (off) or more (steps to cover the state), "
                              f"got {self.replica_checks}")
        if self.snapshot_every < 1:
            raise MisuseError(f"snapshot_every must be at least 1, got {self.snapshot_every}")
        if self.shm_dir and not os.path.isabs(self.shm_dir):
            raise MisuseError(f"shm_dir must be an absolute path (or empty to turn it off), got {self.shm_dir!r}")
        if self.no_spare_policy not in ("stop", "wait"):
            raise MisuseError(f"no_spare_policy must be 'stop' or 'wait', got {self.no_spare_policy!r}")
        if self.failure_timeout <= 2 * self.heartbeat_interval:
            raise MisuseError(
                f"failure_timeout ({self.failure_timeout}s) must exceed two heartbeat intervals "
                f"({self.heartbeat_interval}s each), or healthy members would be declared dead"
            )
        return self

    @property
    def snapshot_depth(self) -> int:
        """Snapshots each seat (and its buddy) keeps: two, or with replica checks of 1/K per step, K + 2; with
        audits, AUDIT_DEPTH.

        A corruption is seen at the latest K steps after it (when the check reaches its part), a check's
        verdict comes during the next step, and the step after it may finish before the fence lands: the
        newest step known clean, K before the mismatch, must still be held then. An audit finds a faulty seat
        up to one round of audits (a step per seat, or more) after its last clean one, where the job goes back.
        """
        depth = self.replica_checks + 2 if self.replica_checks else 2
        return max(depth, AUDIT_DEPTH) if self.audit else depth

    def to_env(self) -> dict[str, str]:
        """The environment that carries this config to child processes."""
        return {f"DEADPOOL_{f.name.upper()}": str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Config:
        """Read ``DEADPOOL_*`` variables; unset ones keep their defaults.

        Raises:
            MisuseError: a variable does not parse as its setting's type.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        defaults = cls()
        for f in fields(cls):
            raw = env.get(f"DEADPOOL_{f.name.upper()}")
            if raw is None:
                continue
            kind = type(getattr(defaults, f.name))
            try:
                if kind is bool:
                    values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
                else:
                    values[f.name] = kind(raw)
            except ValueError:
                raise MisuseError(f"DEADPOOL_{f.name.upper()}={raw!r} is not a valid {kind.__name__}") from None
        values.update(overrides)
        return replace(defaults, **values).validate()


class Backend(enum.StrEnum):
    """What carries a job's CUDA tensors (``deadpool launch --backend``); CPU tensors always go to gloo."""

    AUTO = "auto"  # NCCL where CUDA and NCCL are available, else gloo
    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True, slots=True)
class WorkerEnv:
    """What ``deadpool launch`` tells a worker process through its environment."""

    coordinator: str  # DEADPOOL_COORDINATOR: the coordinator's control address (required)
    member: str  # DEADPOOL_MEMBER_ID, or a fresh host:pid:random id
    role: Role  # DEADPOOL_ROLE: active (seated from the start) or spare
    world_size: int  # WORLD_SIZE at launch (0 for spares added to a running job)
    initial_rank: int  # RANK at launch for an active member, -1 for a spare
    spare_index: int  # DEADPOOL_SPARE_INDEX: the spare's index at launch, -1 for an active member
    host: str  # DEADPOOL_HOST: the failure domain (default: this host's name)
    bind_host: str  # DEADPOOL_BIND_HOST: the address this worker listens on, gloo included
    events_path: str | None  # DEADPOOL_EVENTS: the event log file (None: no log)
    chaos: tuple[ChaosSpec, ...]  # DEADPOOL_CHAOS: the declared failures of the whole job
    config: Config  # the job's bounds and intervals (the other DEADPOOL_* variables)
    local_rank: int = 0  # LOCAL_RANK: this process's index on its host (its GPU, modulo the GPUs it sees)
    backend: Backend = Backend.AUTO  # DEADPOOL_BACKEND: ``deadpool launch --backend``
    nccl_standin: bool = False  # DEADPOOL_NCCL_STANDIN=1: gloo with NCCL's failure semantics (a test aid)
    standin_aborts: bool = True  # DEADPOOL_NCCL_STANDIN_ABORT=0: the stand-in's aborts do nothing (the hang's test)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WorkerEnv:
        """Read a worker's environment.

        Raises:
            MisuseError: DEADPOOL_COORDINATOR is unset (the process was not started by ``deadpool launch``),
                or a variable does not parse.
        """
        coordinator = environ.get("DEADPOOL_COORDINATOR")
        if not coordinator:
            raise MisuseError(
                "deadpool.init(): DEADPOOL_COORDINATOR is not set. Start the script with "
                "`deadpool launch --nproc N --spares S SCRIPT`, which starts the coordinator and the workers."
            )
        role = environ.get("DEADPOOL_ROLE", Role.ACTIVE)
        if role not in tuple(Role):
            raise MisuseError(f"DEADPOOL_ROLE must be 'active' or 'spare', got {role!r}")
        backend = environ.get("DEADPOOL_BACKEND") or Backend.AUTO
        if backend not in tuple(Backend):
            raise MisuseError(f"DEADPOOL_BACKEND must be one of {', '.join(Backend)}, got {backend!r}")
        return cls(
            coordinator=coordinator,
            member=environ.get("DEADPOOL_MEMBER_ID") or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}",
            role=Role(role),
            world_size=_int(environ, "WORLD_SIZE", 1),
            initial_rank=_int(environ, "RANK", -1) if role == Role.ACTIVE else -1,
            spare_index=_int(environ, "DEADPOOL_SPARE_INDEX", -1),
            host=environ.get("DEADPOOL_HOST") or socket.gethostname(),
            bind_host=environ.get("DEADPOOL_BIND_HOST") or "127.0.0.1",
            events_path=environ.get("DEADPOOL_EVENTS") or None,
            chaos=tuple(parse_all(environ.get("DEADPOOL_CHAOS", ""))),
            config=Config.from_env(dict(environ)),
            local_rank=_int(environ, "LOCAL_RANK", 0),
            backend=Backend(backend),
            nccl_standin=environ.get("DEADPOOL_NCCL_STANDIN") == "1",
            standin_aborts=environ.get("DEADPOOL_NCCL_STANDIN_ABORT") != "0",
        )


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise MisuseError(f"{name}={raw!r} is not a valid int") from None


# A coordinator's cyclic-GC thresholds: its young generation holds 1,000,000 objects (the default 700).
COORDINATOR_GC = (1_000_000, 50, 100)


def relax_gc(thresholds: tuple[int, int, int] = COORDINATOR_GC) -> tuple[int, int, int]:
    """Run the cyclic garbage collector less often in a coordinator; returns the thresholds it had.

    A coordinator keeps a record per member and allocates a few short-lived objects per message
    (decoded fields, sends), none of them in cycles.  With the interpreter's thresholds a young
    collection ran every 700 allocations and the older ones walked every record: at 131,072 members
    ``deadpool simulate`` measured a quarter of the coordinator's CPU there (5.45 CPU-s per second
    with them, 4.09 with a young generation of 100,000; forming the first view 18.0 CPU-s, 11.1).
    What outlives a message is long-lived (records, a round's answers, recently decoded frames), so a
    young collection walks it once for nothing before the heap is frozen at the next view
    (:class:`FreezeOnCommit`): at 100,000 that walk cost 1.4-2.0 CPU-s of a 131,072-member simulation
    (in 36 collections), at 1,000,000 none ran within the coordinator's turns (1.03 and 1.02 CPU-s per
    second against 1.19 and 1.17 in runs alternating the two). Without cycles, nothing waits for the
    collector but cyclic garbage. The older generations still run, 50 and 5,000 young collections apart,
    and only once a quarter of the heap is new.
    """
    previous = gc.get_threshold()
    gc.set_threshold(*thresholds)
    return previous


class FreezeOnCommit:
    """A coordinator's long-lived state kept out of the collector's walks: frozen (``gc.freeze``) at each view.

    What is alive when a view is committed (the records, the view, its indexes) lives on until the next one;
    a full collection walked all of it again, for 2.1 s in one tick of ``deadpool simulate`` at 131,072
    members (the run's longest stall).  Frozen objects are still freed by reference counting; only cycles
    among them would stay, and the coordinator makes none.  Freezing is O(1).
    """

    def __init__(self) -> None:
        self._epoch = -1

    def committed(self, epoch: int) -> None:
        """The coordinator holds view `epoch` (called after each turn; freezes once per new epoch)."""
        if epoch != self._epoch:
            self._epoch = epoch
            gc.freeze()


def raise_priority(niceness: int = -10) -> bool:
    """Give a control-plane process (launcher, coordinator) the CPU before busy workers.

    On a host whose cores are saturated by training, a failure report that
    waits for a time slice waits tens of milliseconds; raising the priority of
    the few processes that detect and decide makes detection prompt.  Needs
    the privilege to lower niceness; without it nothing changes.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except (PermissionError, OSError):
        return False
    return True
