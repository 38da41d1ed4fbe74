"""The compute-side runtime: ``deadpool.init()``, ``rt.track``, ``rt.ddp``, ``rt.steps``, ``rt.finish``.

The training loop stays the user's.  ``rt.steps()`` is where the runtime gets
control between steps: it captures snapshots, takes commands from the
membership service, and, after a failure, rolls back, rebuilds the process
group and resumes at the right step.  A spare waits inside ``rt.steps()``
until it is adopted, then continues exactly where the dead seat's snapshot
left off.

Within a step the runtime acts at two points only: backward (``DataParallel``
issues each gradient bucket's all-reduce through it and waits for them at the
end; the first issue runs the pre-step gate) and the optimizer pre-step
hook (it waits for the previous snapshot's copy and the buddy's confirmation;
the only possible stall, measured).  When a collective fails or a view change
is announced, the step is *poisoned*: it runs to its end without effect that
matters (its results are rolled back), and the step boundary starts recovery.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import logging
import os
import random
import socket
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions

from deadpool import chaos as chaos_mod
from deadpool.actors.handoff import Command, Fetch, Handoff, LocalReady, Progress
from deadpool.actors.runtime_thread import RuntimeThread
from deadpool.chaos import ChaosPoint
from deadpool.config import Config
from deadpool.coordinator.decisions import DISK
from deadpool.errors import JobStopped, MisuseError, WaitTimeout
from deadpool.events.catalogue import Event
from deadpool.events.log import EventLog
from deadpool.protocol.messages import (
    ChaosInjected,
    CollectiveFailed,
    CommitView,
    Fenced,
    Finished,
    Join,
    Prepare,
    PrepareAck,
    Recovered,
    Role,
    Stop,
)
from deadpool.protocol.view import View
from deadpool.snapshot.checkpoint import DiskCheckpointer, complete_steps
from deadpool.snapshot.checkpoint import load as checkpoint_load
from deadpool.snapshot.statetree import Manifest, expand, flatten, materialize, replicated_slice
from deadpool.snapshot.store import Slot, SnapshotStore
from deadpool.worker import zero as zero_mod
from deadpool.worker.collective import CollectiveAborted, Waiter, connect_store, create_group
from deadpool.worker.ddp import DEFAULT_BUCKET_MB, DataParallel

log = logging.getLogger("deadpool")

_RUNTIME: Runtime | None = None
_RETIRED_GROUPS: list[Any] = []  # groups and store clients are never destroyed (that can block or abort)
_EXIT_STATUS = [0]
_FINISHED = [False]  # rt.finish() ran: nothing of DeadPool's is left for the interpreter's teardown


def init() -> Runtime:
    """Start (once per process) the runtime of a worker started by ``deadpool launch``.

    Raises:
        MisuseError: the process was not started by ``deadpool launch`` (no coordinator address).
    """
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = Runtime(os.environ)
    return _RUNTIME


class Runtime:
    """One worker's runtime; see the module docstring for the shape of a step."""

    def __init__(self, environ: os._Environ[str] | dict[str, str]) -> None:
        coordinator = environ.get("DEADPOOL_COORDINATOR")
        if not coordinator:
            raise MisuseError(
                "deadpool.init(): DEADPOOL_COORDINATOR is not set. Start the script with "
                "`deadpool launch --nproc N --spares S SCRIPT`, which starts the coordinator and the workers."
            )
        self.config = Config.from_env(dict(environ))
        self.member = environ.get("DEADPOOL_MEMBER_ID") or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        role = environ.get("DEADPOOL_ROLE", Role.ACTIVE)
        if role not in tuple(Role):
            raise MisuseError(f"DEADPOOL_ROLE must be 'active' or 'spare', got {role!r}")
        self.role = Role(role)
        self._env_world_size = int(environ.get("WORLD_SIZE", "1"))  # 0 for spares added to a running job
        self.initial_rank = int(environ.get("RANK", "-1")) if self.role == Role.ACTIVE else -1
        self.host = environ.get("DEADPOOL_HOST") or socket.gethostname()
        self.rank = -1
        self.events = EventLog(environ.get("DEADPOOL_EVENTS") or None, member=self.member, source="worker")
        self._chaos = chaos_mod.ChaosPlan(
            chaos_mod.parse_all(environ.get("DEADPOOL_CHAOS", "")),
            self.initial_rank,
            int(environ.get("DEADPOOL_SPARE_INDEX", "-1")),
        )
        self._handoff = Handoff()
        self._progress = Progress()
        self._thread = RuntimeThread(
            self.member, coordinator, environ.get("DEADPOOL_BIND_HOST", "127.0.0.1"), self.config,
            self._handoff, self._progress, self.events,
        )
        self._thread.role_and_host = (self.role, self.host)
        self._thread.start()
        self._disk = DiskCheckpointer(self.config.checkpoint_dir, self.config.checkpoint_every)
        self._snapshots = SnapshotStore(
            on_complete=self._on_snapshot_copied,
            after_copy=self._save_to_disk if self._disk.enabled else None,
            shm_dir=self.config.shm_dir,
            member=self.member,
        )
        self._tracked: dict[str, Any] = {}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._zero_shards: list[zero_mod.ZeroShard] = []
        self._replicated_params: list[torch.nn.Parameter] = []  # averaged by rt.ddp: the same on every seat
        self._view: View | None = None
        self._group: Any = None
        self._waiter = Waiter(self._handoff.condition, self._is_interrupted)
        self._step = -1  # the step in progress
        self._gated_step = -2
        self._poison: str | None = None
        self._recovering_epoch = 0  # epoch whose first finished step is reported as Recovered
        self._stalls: deque[float] = deque(maxlen=200)
        self._report: dict[str, float] = {}
        self._step_started = time.perf_counter()
        self.final_digest = ""
        self._finished = False
        self._fetch_s = 0.0
        atexit.register(_exit_guard)
        _install_excepthook()
        self._handoff.post(Join(
            self.member, self.role, self.initial_rank, self._env_world_size, os.getpid(), self.host,
            self._thread.control_addr, self._thread.bulk_addr,
        ))
        self.events.emit(Event.MEMBER_JOINED, role=self.role, pid=os.getpid(), host=self.host,
                         control_addr=self._thread.control_addr, bulk_addr=self._thread.bulk_addr)

    # -- public API ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of seats in the job (from the current view once seated)."""
        return self._view.world_size if self._view else self._env_world_size

    @property
    def is_spare(self) -> bool:
        """True while this member waits in the spare pool."""
        return self.rank < 0

    def track(self, **objects: Any) -> None:
        """Register everything a snapshot must hold (anything with ``state_dict``/``load_state_dict``).

        Optimizers also get a pre-step hook: it waits for the previous snapshot's copy
        before parameters change (the measured stall).

        Raises:
            MisuseError: an object cannot be snapshotted, or tracking started after training.
        """
        if self._step >= 0:
            raise MisuseError("rt.track() must be called before the first step")
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise MisuseError(f"rt.track({name}=...): {type(obj).__name__} has no state_dict()/load_state_dict()")
            if name.startswith("__"):
                raise MisuseError(f"rt.track(): names starting with '__' are reserved, got {name!r}")
            self._tracked[name] = obj
            if zero_mod.is_zero(obj):
                shard = zero_mod.ZeroShard(obj, self._broadcast_zero_shards)
                self._tracked[name] = shard  # a seat snapshots its own shard, not the (unconsolidated) whole
                self._zero_shards.append(shard)
            if isinstance(obj, torch.optim.Optimizer):
                self._optimizers.append(obj)
                obj.register_step_pre_hook(self._optimizer_pre_step)

    def zero_optimizer(
        self, params: Any, optimizer_class: type[torch.optim.Optimizer], **defaults: Any,
    ) -> torch.optim.Optimizer:
        """A ``torch.distributed.optim.ZeroRedundancyOptimizer`` (optimizer state sharded across seats).

        Build it here rather than directly: it needs a process group when it is built, and
        DeadPool's groups change with every view (a spare does not know its seat yet).  Track it
        like any optimizer; each seat's snapshot then holds its own shard, and a swap restores the
        dead seat's shard from its buddy.

        Raises:
            MisuseError: torch.distributed has a default group already, or an unsupported option.
        """
        return zero_mod.build(params, optimizer_class, **defaults)

    def ddp(self, model: torch.nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB) -> DataParallel:
        """Wrap `model` for data-parallel training across the seats (rebuilds itself after swaps).

        Gradients are all-reduced in fixed buckets of about `bucket_mb`, each issued as soon as
        its gradients are ready; after backward each ``param.grad`` is a view into its bucket.
        """
        wrapper = DataParallel(model, self, bucket_mb)
        self._replicated_params.extend(p for bucket in wrapper.buckets for p in bucket.params)
        return wrapper

    def report(self, **metrics: float) -> None:
        """Attach metrics (e.g. ``loss=``, ``tokens=``) to the current step's ``step_finished`` event."""
        self._report.update({k: float(v) for k, v in metrics.items()})

    def steps(self, max_steps: int) -> Iterator[int]:
        """Yield the steps this seat must run, from 0 (or the resume point) to `max_steps - 1`.

        Spares block here until adopted.  After a failure anywhere in the job,
        the step sequence rewinds to the last step every seat can restore.

        Raises:
            JobStopped: the coordinator ended the job (an unrecoverable failure elsewhere).
            WaitTimeout: a bounded wait expired (the message names it).
        """
        if max_steps < 0:
            raise MisuseError(f"rt.steps(max_steps): must be >= 0, got {max_steps}")
        step = self._wait_for_seat()
        if step is None:
            return  # a spare never needed: the job finished
        while True:
            if step >= max_steps:
                if self._finalize(max_steps):
                    return
                step = self._recover()
                continue
            self._begin_step(step)
            yield step
            if self._poison is not None or self._handoff.interrupted(self._epoch):
                step = self._recover()
                continue
            pending = self._end_step(step)
            step = self._recover(pending) if pending is not None else step + 1

    def stats(self) -> dict[str, Any]:
        """Snapshot costs of this worker so far: stalls, sizes and memory held (the memory report)."""
        stalls = sorted(self._stalls)
        sent, held, shared = self._thread.snapshot_stats()
        return {
            "stall_s": list(self._stalls),
            "stall_p50_s": stalls[len(stalls) // 2] if stalls else 0.0,
            "stall_p99_s": stalls[min(len(stalls) - 1, int(0.99 * len(stalls)))] if stalls else 0.0,
            "snapshot_bytes": self._snapshots.bytes_per_snapshot,  # the whole state
            "snapshot_copied_bytes": self._snapshots.bytes_copied_per_snapshot,  # own state + replicated slice
            "own_snapshots_bytes": self._snapshots.memory_bytes(),  # both slots: each packs own state + slice
            "buddy_copies_bytes": held,  # copies in memory of this worker's own
            "buddy_copies_shared_bytes": shared,  # copies held as mappings of a same-host ward's slots: no extra memory
            "streamed_bytes": sent,
        }

    def finish(self) -> str:
        """Stop the runtime; returns (and logs) the job-wide final state digest ("" on a spare)."""
        if self.final_digest and self.rank == 0:
            print(f"final state digest: {self.final_digest}", flush=True)
        self._shutdown()
        return self.final_digest

    # -- step lifecycle -----------------------------------------------------------------------

    @property
    def _epoch(self) -> int:
        return self._view.epoch if self._view else 0

    def _is_interrupted(self) -> bool:
        return self._handoff.interrupted(self._epoch)

    def _begin_step(self, step: int) -> None:
        self._step = step
        self._poison = None
        self._report = {}
        self._step_started = time.perf_counter()
        self._chaos_point(ChaosPoint.BOUNDARY)

    def _end_step(self, step: int) -> Command | None:
        """Bookkeeping after a good step; returns a command that needs recovery, if one came."""
        elapsed = time.perf_counter() - self._step_started
        if (step + 1) % self.config.snapshot_every == 0:
            self._capture(step)
        self._progress.step = step
        fields: dict[str, Any] = {"step_s": round(elapsed, 6)}
        fields.update(self._report)
        if "tokens" in self._report and elapsed > 0:
            fields["tokens_per_s"] = round(self._report["tokens"] / elapsed, 1)
        self.events.emit(Event.STEP_FINISHED, epoch=self._epoch, rank=self.rank, step=step, **fields)
        if self._recovering_epoch and self._recovering_epoch <= self._epoch:  # later spare-only views count too
            self._recovering_epoch = 0
            self._handoff.post(Recovered(self.member, self._epoch, step, time.time()))
        return self._drain_commands()

    def _drain_commands(self) -> Command | None:
        """Apply views that need no pause; return the first command that does."""
        while (command := self._handoff.poll()) is not None:
            if isinstance(command, CommitView):
                if command.view.epoch <= self._epoch:
                    continue
                if self._view is not None and command.view.store_prefix == self._view.store_prefix:
                    self._set_view(command.view)
                    continue
            if isinstance(command, (CommitView, Prepare, Stop, Fenced)):
                return command
        return None

    def _capture(self, step: int) -> None:
        if self._view is not None:
            self._capture_state(step, self._view, self.rank)

    def _capture_state(self, step: int, view: View, seat: int) -> None:
        self._snapshots.capture(step, view.store_prefix, self._state(), self._background_pointers(),
                                self._replicated_pointers(), seat, view.world_size)

    def _state(self) -> dict[str, Any]:
        state = {name: obj.state_dict() for name, obj in self._tracked.items()}
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            rng["cuda"] = torch.cuda.get_rng_state_all()
        state["__rng__"] = rng
        return state

    def _load(self, state: dict[str, Any]) -> None:
        rng = state.pop("__rng__")
        for name, obj in self._tracked.items():
            obj.load_state_dict(state[name])
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])

    def _background_pointers(self) -> set[int]:
        """Storages that change only inside optimizer.step(): safe to copy while the next step runs."""
        pointers: set[int] = set()
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                pointers.update(p.data_ptr() for p in group["params"])
            inner: torch.optim.Optimizer = getattr(optimizer, "optim", optimizer)  # ZeRO: the local shard's optimizer
            for state in inner.state.values():
                pointers.update(v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
        return pointers

    def _replicated_pointers(self) -> set[int]:
        """Storages that are the same on every seat: the parameters of ``rt.ddp`` models (their gradients
        are averaged) and a plain optimizer's state for them.  A ZeRO shard is not: it differs per seat."""
        pointers = {p.data_ptr() for p in self._replicated_params}
        for optimizer in self._optimizers:
            if zero_mod.is_zero(optimizer):
                continue
            for param in self._replicated_params:
                state = optimizer.state.get(param)
                if state:
                    pointers.update(v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor) and v.numel())
        return pointers

    def _save_to_disk(self, slot: Slot) -> None:
        """Copy thread: every N steps, the finished snapshot also goes to disk (background write)."""
        if self.rank >= 0:
            self._disk.maybe_save(slot, self.rank)

    def _on_snapshot_copied(self, slot: Any) -> None:
        """Copy thread: hand the finished snapshot to the SnapshotActor for streaming."""
        try:
            self._handoff.post(LocalReady(slot))
        except RuntimeError:
            pass  # runtime already stopped (shutdown)

    # -- inside a step ------------------------------------------------------------------------

    def _optimizer_pre_step(self, *_: Any) -> None:
        self._gate()

    def _gate(self) -> bool:
        """Before parameters change: the previous snapshot must be copied and confirmed by the buddy.

        Returns False when the step is poisoned (a view change interrupted the wait).
        """
        if self._poison is not None:
            return False
        if self._gated_step == self._step:
            return True
        start = time.perf_counter()
        self._snapshots.wait_copy(self.config.copy_timeout)
        newest = self._snapshots.newest_started()
        view = self._view
        if newest is not None and view is not None and view.world_size > 1:
            generation, snap_step = newest.generation, newest.step
            confirmed = self._handoff.wait_until(
                lambda: self._handoff.is_confirmed(generation, snap_step), self._epoch, self.config.view_timeout,
                f"waiting for the buddy to confirm its copy of step {snap_step}",
            )
            if not confirmed:
                self._poison = "interrupted while waiting for the buddy's snapshot confirmation"
                return False
            self._progress.confirmed_step = snap_step
        stall = time.perf_counter() - start
        self._stalls.append(stall)
        if len(self._stalls) >= 10:
            ordered = sorted(self._stalls)
            self._progress.stall_p99_s = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        self._gated_step = self._step
        return True

    def _issue_allreduce(self, flat: torch.Tensor) -> dist.Work | None:
        """Start the sum of one gradient bucket on the view's group (``rt.ddp``, during backward).

        The first bucket of a step runs the pre-step gate first: no seat joins a step's
        all-reduce before its previous snapshot is confirmed.  Returns None when the step
        is poisoned or there is no group: the caller issues nothing more for this backward.
        """
        if not self._gate() or self._group is None or self._view is None:
            return None
        try:
            work: dist.Work = self._group.allreduce([flat])
        except RuntimeError as err:
            self._poison_step(err)
            return None
        return work

    def _await_allreduces(self, works: list[dist.Work]) -> bool:
        """End of backward: wait for every bucket's all-reduce, interruptibly.

        Returns False when they were abandoned (the step is poisoned): an abandoned
        operation may still complete later (a SIGSTOPped peer resumes) and write into
        its buffer, so the caller must not reuse those buffers.
        """
        self._chaos_point(ChaosPoint.ALLREDUCE)
        try:
            for work in works:
                self._waiter.wait(work, f"gradient all-reduce of step {self._step}", self.config.pg_timeout)
        except (CollectiveAborted, RuntimeError) as err:
            self._poison_step(err)
            return False
        return True

    def _broadcast_zero_shards(self, shard: zero_mod.ZeroShard) -> None:
        """ZeRO's parameter broadcast after its local step: on the view's group, waited on interruptibly.

        Other seats' shards are received into fresh buffers and copied into the parameters only
        once every broadcast completed: an abandoned broadcast may still complete later (a
        SIGSTOPped peer resumes) and must not write into live parameters.
        """
        if self._poison is not None or self._group is None:
            return  # the step is rolled back anyway
        received: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            works = []
            for rank, tensor in shard.shard_tensors():
                options = BroadcastOptions()
                options.rootRank = rank
                if rank != self.rank:
                    received.append((tensor, torch.empty_like(tensor)))
                    tensor = received[-1][1]
                works.append(self._group.broadcast([tensor], options))
            self._chaos_point(ChaosPoint.BROADCAST)
            for work in works:
                self._waiter.wait(work, f"ZeRO parameter broadcast of step {self._step}", self.config.pg_timeout)
        except (CollectiveAborted, RuntimeError) as err:
            self._poison_step(err)
            return
        for live, staged in received:
            live.copy_(staged)

    def _poison_step(self, err: BaseException) -> None:
        """Mark the step as lost; tell the coordinator unless it is the one that interrupted us."""
        self._poison = str(err)
        self._retire_group()
        if isinstance(err, CollectiveAborted) and "interrupted" in err.cause:
            return
        self.events.emit(Event.COLLECTIVE_FAILED, epoch=self._epoch, rank=self.rank, step=self._step, error=str(err))
        self._handoff.post(CollectiveFailed(self.member, self._epoch, self._step, str(err)[:500]))

    def _chaos_point(self, point: ChaosPoint, step: int | None = None) -> None:
        spec = self._chaos.due(point, self._step if step is None else step)
        if spec is None:
            return
        self.events.emit(Event.CHAOS_INJECTED, action=spec.action, at=point, spec=str(spec),
                         epoch=self._epoch, rank=self.rank, step=self._step)
        self._handoff.post(ChaosInjected(self.member, spec.action, self.rank, self._step, time.time()))
        time.sleep(0.002)  # let the runtime thread hand the report to ZeroMQ before the signal lands
        chaos_mod.inject(spec, self._thread.partition)

    # -- seats, views and recovery ------------------------------------------------------------

    def _wait_for_seat(self) -> int | None:
        """Block until this member has a seat (first view, or adoption); returns the first step."""
        started = time.monotonic()
        bound = self.config.startup_timeout if self.role == Role.ACTIVE else 7 * 24 * 3600.0
        while True:
            wait = 1.0
            if self.role == Role.SPARE:
                due = self._chaos.next_spare_deadline()
                if due is not None:
                    wait = max(0.01, min(wait, started + due - time.monotonic()))
                spec = self._chaos.spare_due(time.monotonic() - started)
                if spec is not None:
                    self.events.emit(Event.CHAOS_INJECTED, action=spec.action, spec=str(spec), rank=-1)
                    chaos_mod.inject(spec, self._thread.partition)
            if time.monotonic() - started > bound:
                raise WaitTimeout(
                    f"no seat assigned within {bound:.0f}s: the coordinator at "
                    f"{os.environ.get('DEADPOOL_COORDINATOR')} never formed the first view. "
                    "Check that all ranks were started and can reach it."
                )
            try:
                command = self._handoff.take(wait, "waiting for a seat")
            except WaitTimeout:
                continue
            if isinstance(command, Stop):
                if command.ok and self.is_spare:
                    self.events.emit(Event.SPARE_RELEASED, reason=command.reason)
                    return None
                raise JobStopped(command.reason)
            if isinstance(command, Fenced):
                _exit_fenced(self, command)
            if isinstance(command, CommitView) and command.view.seat_of(self.member) is not None:
                first = self._adopt_with_retry(command.view)
                # Seated but interrupted (another failure during this swap): answer the next Prepare like
                # any survivor, from the snapshot the adoption already took.
                return first if first is not None else self._recover()

    def _adopt_with_retry(self, view: View) -> int | None:
        try:
            return self._adopt(view)
        except (CollectiveAborted, LookupError, WaitTimeout) as err:
            self.events.emit(Event.ADOPT_FAILED, epoch=view.epoch, error=str(err))
            self._handoff.post(CollectiveFailed(self.member, view.epoch, view.resume_step, f"adoption failed: {err}"))
            return None

    def _recover(self, pending: Command | None = None) -> int:
        """Pause at the boundary, answer Prepares, adopt the committed view; returns the next step."""
        self._snapshots.wait_copy(self.config.copy_timeout)
        if self._poison is not None:
            self.events.emit(Event.PAUSED, epoch=self._epoch, rank=self.rank, step=self._step, reason=self._poison)
        acked = 0
        while True:
            command = pending if pending is not None else self._handoff.take(
                self.config.view_timeout, f"paused after step {self._step} waiting for the view change"
            )
            pending = None
            if isinstance(command, Stop):
                raise JobStopped(command.reason)
            if isinstance(command, Fenced):
                _exit_fenced(self, command)
            if isinstance(command, Prepare) and command.epoch >= acked:
                acked = command.epoch
                self._snapshots.wait_copy(self.config.copy_timeout)
                disk = complete_steps(self._disk.root, self.world_size) if self._disk.enabled else []
                # ward_steps: filled in by the runtime thread, which reads the buddy copies' slot heads.
                self._handoff.post(PrepareAck(
                    self.member, command.epoch, self._progress.step, self._snapshots.complete_steps(), {}, disk,
                ))
            elif isinstance(command, CommitView) and command.view.epoch > self._epoch:
                if command.view.seat_of(self.member) is None:
                    _exit_fenced(self, Fenced(self.member, command.view.epoch, "not seated in the committed view"))
                if self._view is not None and command.view.store_prefix == self._view.store_prefix:
                    self._set_view(command.view)
                    continue
                first = self._adopt_with_retry(command.view)
                if first is not None:
                    return first

    def _set_view(self, view: View) -> None:
        self._view = view
        seat = view.seat_of(self.member)
        self.rank = -1 if seat is None else seat
        self._progress.epoch = view.epoch
        self.events.epoch, self.events.rank = view.epoch, self.rank

    def _adopt(self, view: View) -> int:
        """Restore the view's resume state, rebuild the group, and return the first step to run.

        Raises:
            CollectiveAborted: interrupted by a newer view, or the group could not form.
            LookupError: the snapshot to restore is not available.
            WaitTimeout: a bounded wait expired.
        """
        seat = view.seat_of(self.member)
        assert seat is not None
        first_view = self._view is None and view.resume_step == -1 and seat not in view.restore_from
        started = time.perf_counter()
        if not first_view:
            # Keyed on the first step this member has not finished, not on the step in progress: a
            # member may pause at the boundary before that step or inside it, depending on how fast
            # the failure was reported, and the repair is for the same failure either way.
            self._chaos_point(ChaosPoint.RECOVERY, self._progress.step + 1)
        for shard in self._zero_shards:  # a spare takes the dead seat's partition before loading its shard
            shard.seat(seat, view.world_size, None)
        restored: tuple[Manifest, torch.Tensor] | None = None
        if first_view:
            source = "initial"
        elif view.restore_from.get(seat) == DISK:
            source, restored = "disk", checkpoint_load(self.config.checkpoint_dir, view.resume_step, seat)
        elif seat in view.restore_from:
            source, restored = "buddy", self._restore_from_buddy(view, seat)
        else:
            source, restored = "local", self._restore_local(view.resume_step)
        fetched = time.perf_counter()
        self._retire_group()
        # A fresh store connection per build: an abandoned build may still block in a store call on the old one.
        store = connect_store(view.store_addr, self.config.pg_timeout)
        _RETIRED_GROUPS.append(store)
        self._group = create_group(
            store, view.store_prefix, seat, view.world_size, self.config.pg_timeout,
            lambda: self._handoff.interrupted(view.epoch), connect_timeout=self.config.pg_timeout,
        )
        group_s = time.perf_counter() - fetched
        nbytes = 0
        if restored is not None:
            # Loaded after the group is built: building one may draw from the global RNGs, and the
            # restored RNG states must survive bit for bit.
            manifest, arena = restored
            self._gather_replicated(manifest, arena, seat, view)
            self._load(materialize(manifest, arena))
            nbytes = manifest.nbytes
        # The restored state is this seat's snapshot of resume_step under the new view, taken before the seat
        # runs a step: the SnapshotActor streams it to the (possibly new) buddy at once, so the seat is
        # protected before its next step changes anything.  Until then the old snapshots stay (a failure
        # during this swap finds them, or the buddy's copy, again).
        self._snapshots.forget_all()
        self._capture_state(view.resume_step, view, seat)
        restore_s = time.perf_counter() - started - group_s
        for shard in self._zero_shards:
            shard.seat(seat, view.world_size, self._group)
        self._set_view(view)
        self._poison = None
        self._gated_step = -2
        self._progress.step = view.resume_step
        if not first_view:
            self._recovering_epoch = view.epoch
            self.events.emit(Event.RESTORED, epoch=view.epoch, rank=seat, step=view.resume_step, source=source,
                             bytes=nbytes, s=round(restore_s, 6), fetch_s=round(self._fetch_s, 6),
                             group_s=round(group_s, 6))
        return view.resume_step + 1

    def _restore_local(self, step: int) -> tuple[Manifest, torch.Tensor]:
        slot = self._snapshots.find(step)
        if slot is None:
            raise LookupError(f"no local snapshot of step {step} (held: {self._snapshots.complete_steps()})")
        return self._snapshots.restore_arena(slot)

    def _gather_replicated(self, manifest: Manifest, arena: torch.Tensor, seat: int, view: View) -> None:
        """Complete a restored arena: every seat's snapshot holds only its slice of the replicated region.

        One all-gather on the new group: each seat sends its slice (from its own snapshot, or, for a
        swapped-in seat, from the buddy's copy) and receives every other seat's, all of the same step.

        Raises:
            LookupError: the snapshot's replicated region does not split into this job's slices.
            CollectiveAborted: a peer failed or a newer view interrupted the gather.
        """
        world = view.world_size
        if not manifest.replicated or world < 2:
            return
        if manifest.replicated % world:
            raise LookupError(f"snapshot of step {view.resume_step}: its replicated region "
                              f"({manifest.replicated} bytes) does not split into {world} slices")
        first, last = replicated_slice(manifest, seat, world)
        chunk, start = last - first, manifest.replicated_at
        slices = [arena[start + i * chunk : start + (i + 1) * chunk] for i in range(world)]
        try:
            work = self._group.allgather([slices], [arena[first:last].clone()])
        except RuntimeError as err:
            raise CollectiveAborted("gathering the replicated state", str(err)) from err
        waiter = Waiter(self._handoff.condition, lambda: self._handoff.interrupted(view.epoch))
        waiter.wait(work, f"gathering the replicated state of step {view.resume_step}", self.config.pg_timeout)

    def _restore_from_buddy(self, view: View, seat: int) -> tuple[Manifest, torch.Tensor]:
        source = view.restore_from[seat]
        fetch_started = time.perf_counter()
        future: concurrent.futures.Future[tuple[Manifest, list[memoryview]]] = concurrent.futures.Future()
        future.add_done_callback(lambda _: self._handoff.wake())
        self._handoff.post(Fetch(seat, view.resume_step, source, future))
        if not self._handoff.wait_until(future.done, view.epoch, self.config.restore_timeout,
                                        f"fetching seat {seat}'s snapshot of step {view.resume_step} from {source}"):
            raise CollectiveAborted("restore", "interrupted by a newer view")
        manifest, frames = future.result()
        self._fetch_s = time.perf_counter() - fetch_started
        try:
            # What the snapshot holds: the seat's own state, then its slice of the replicated region,
            # which the gather completes.
            return manifest, expand(manifest, frames, seat, view.world_size)
        except LookupError as err:
            raise LookupError(f"{err} (from {source})") from err

    def _retire_group(self) -> None:
        """Set the current group aside without destroying it: destroying a group with an op in flight
        blocks until the op times out, and gloo aborts the process if it is destructed later."""
        if self._group is not None:
            _RETIRED_GROUPS.append(self._group)
        self._group = None

    # -- the end ------------------------------------------------------------------------------

    def _finalize(self, max_steps: int) -> bool:
        """Agree on the job-wide digest; False if a failure interrupted it (then recovery runs)."""
        assert self._view is not None and self._group is not None
        self._step = max_steps
        state = self._state()
        # Python's `random` is seeded from the OS unless the script seeds it: restored, but not digested.
        state["__rng__"].pop("python")
        parts = {name: state_digest(value) for name, value in state.items()}
        seat_digest = state_digest(state)  # hashed once: each pass over the state delays this seat's exit
        mine = torch.frombuffer(bytearray(bytes.fromhex(seat_digest)), dtype=torch.uint8)
        gathered = [torch.zeros(32, dtype=torch.uint8) for _ in range(self._view.world_size)]
        try:
            work = self._group.allgather([gathered], [mine])
            self._waiter.wait(work, "final digest exchange", self.config.pg_timeout)
        except (CollectiveAborted, RuntimeError) as err:
            self._poison_step(err)
            return False
        if self._handoff.interrupted(self._epoch):
            return False
        self.final_digest = hashlib.sha256(b"".join(bytes(t.tolist()) for t in gathered)).hexdigest()
        self._finished = True
        self._handoff.post(Finished(self.member, self._epoch, self.rank, max_steps - 1, self.final_digest))
        self.events.emit(Event.SEAT_FINISHED, epoch=self._epoch, rank=self.rank, step=max_steps - 1,
                         state_digest=self.final_digest, seat_digest=seat_digest, parts=parts)
        stats = self.stats()
        self.events.emit(Event.SNAPSHOT_MEMORY, rank=self.rank, own_snapshots_bytes=stats["own_snapshots_bytes"],
                         buddy_copies_bytes=stats["buddy_copies_bytes"],
                         buddy_copies_shared_bytes=stats["buddy_copies_shared_bytes"],
                         snapshot_bytes=stats["snapshot_bytes"], snapshot_copied_bytes=stats["snapshot_copied_bytes"],
                         stall_p99_s=round(stats["stall_p99_s"], 6))
        return True

    def _shutdown(self) -> None:
        global _RUNTIME
        self._disk.close()
        self._thread.stop(timeout=5.0)
        self._snapshots.close()
        self.events.close()
        _RUNTIME = None
        _FINISHED[0] = True


def state_digest(state: Any) -> str:
    """SHA-256 over a state's structure and the bytes of every tensor in it."""
    skeleton, tensors = flatten(state)
    hasher = hashlib.sha256(skeleton)
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous()
        hasher.update(str(tuple(data.shape)).encode())
        hasher.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def _exit_fenced(runtime: Runtime, command: Fenced) -> None:
    """A fenced member leaves at once, touching nothing shared (no snapshot, no store, no peers)."""
    message = (
        f"deadpool: member {runtime.member} was declared dead at epoch {command.epoch} ({command.reason}) "
        "and its seat was given to another member. This process changed nothing after that and exits now; "
        "the job goes on without it."
    )
    runtime.events.emit(Event.FENCED_EXIT, reason=command.reason)
    print(message, file=sys.stderr, flush=True)
    os._exit(3)


def _install_excepthook() -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        _EXIT_STATUS[0] = 1
        previous(kind, value, tb)

    sys.excepthook = hook


def _exit_guard() -> None:
    """At exit, skip the destructors of process groups and the interpreter's teardown.

    Gloo aborts the process when a group whose op was abandoned is destructed,
    and a group whose peers died can block the interpreter's exit.  After
    ``rt.finish()`` (a released spare too) nothing of DeadPool's is left to clean
    up, while tearing down torch's modules takes 1-2 s on a busy host, which the
    launcher and the job's wall time would wait for.  So when groups were
    retired, the runtime finished, or the script ended with an uncaught
    exception, the process ends here with the status Python would have used (1
    after an uncaught exception); other processes exit normally.
    """
    runtime = _RUNTIME
    if not _RETIRED_GROUPS and _EXIT_STATUS[0] == 0 and not _FINISHED[0]:
        return
    if runtime is not None:
        runtime._thread.stop(timeout=1.0)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(_EXIT_STATUS[0])

