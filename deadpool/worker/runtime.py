"""The compute-side runtime: ``deadpool.init()``, ``rt.track``, ``rt.ddp``, ``rt.steps``, ``rt.finish``.

The training loop stays the user's; ``rt.steps()`` is where the runtime gets
control between steps.  This module holds the public API, the step loop, when
a snapshot is captured, and the pre-step gate; what a snapshot holds and how it
loads is ``tracked.py``'s, taking a seat is ``recovery.py``'s, the step's
collectives are ``groups/hub.py``'s, and the end of the process is ``exit.py``'s.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from deadpool.actors.handoff import Command, Handoff, LocalReady, Progress
from deadpool.actors.runtime_thread import RuntimeThread
from deadpool.chaos import ChaosPoint, Corrupted
from deadpool.config import WorkerEnv
from deadpool.errors import MisuseError
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.audits import audited_seat
from deadpool.protocol.messages import (
    Audit,
    AuditDigest,
    CommitView,
    Fenced,
    Finished,
    Holding,
    Join,
    Leave,
    Leaving,
    Prepare,
    Role,
    Stop,
)
from deadpool.protocol.view import INITIAL_STEP
from deadpool.snapshot.checkpoint import DiskCheckpointer, complete_steps
from deadpool.snapshot.statetree import state_digest
from deadpool.snapshot.store import Slot, SnapshotStore
from deadpool.worker import dcp, dtensors
from deadpool.worker import rng as rng_mod
from deadpool.worker.data import DataSeats, LoaderWatch, TrackedLoader, UntrackedLoader
from deadpool.worker.ddp import DEFAULT_BUCKET_MB, DataParallel
from deadpool.worker.exit import GUARD, ExceptionReport, exit_moved
from deadpool.worker.faults import FaultInjector
from deadpool.worker.groups.communicators import Communicators, communicator_kind
from deadpool.worker.groups.default import DefaultGroup, refuse_env_rendezvous
from deadpool.worker.groups.hub import GroupCollectives
from deadpool.worker.groups.own import OwnGroups, patch_new_group
from deadpool.worker.lost_step import AbandonableBackward, AbandonableForward, skip_when_lost
from deadpool.worker.recovery import Recovery, Seating
from deadpool.worker.step import StepState
from deadpool.worker.tracked import TrackedState

NO_BUCKETS = "no rt.ddp gradient bucket in the step: nothing to audit"  # an AuditDigest's `missed`
MOVED_LINGER_S = 10.0  # a moved member exits at most this long after it was fenced (its last sends leaving)

log = logging.getLogger("deadpool")

_RUNTIME: Runtime | None = None


def init() -> Runtime:
    """Start (once per process) the runtime of a worker started by ``deadpool launch``.

    Raises:
        MisuseError: the process was not started by ``deadpool launch`` (no coordinator address).
    """
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = Runtime(os.environ)
        refuse_env_rendezvous()
        patch_new_group(_RUNTIME._new_group)
    return _RUNTIME


class Runtime:
    """One worker's runtime: the steps of its seat, the snapshots that protect them, and their gate.

    Raises:
        MisuseError: the environment is not one ``deadpool launch`` set up (see ``WorkerEnv.from_env``).
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        env = WorkerEnv.from_env(environ)
        self.config = env.config
        self.member = env.member
        self.role = env.role
        self.initial_rank = env.initial_rank
        self.host = env.host
        self._env_world_size = env.world_size  # 0 for spares added to a running job
        self.events = EventLog(env.events_path, member=self.member, source="worker")
        self._state = StepState()
        self._handoff = Handoff()
        self._progress = Progress()
        self._thread = RuntimeThread(
            self.member, env.coordinator, env.bind_host, self.config, self._handoff, self._progress, self.events,
            # Transports go behind the partition switch only when a `partition:` spec names this process.
            partitionable=FaultInjector.partitions(env),
        )
        self._thread.role_and_host = (self.role, self.host)
        self._thread.start()
        self._faults = FaultInjector(env, self._state, self._handoff, self.events, self._thread.partition)
        communicators = Communicators(self.events)
        self._handoff.on_loss(lambda seats: communicators.abort_holding(seats, "a Prepare declared seats lost"))
        kind, device = communicator_kind(env, self.config.pg_timeout)
        self._collectives = GroupCollectives(
            self.member, self._state, self._handoff, self.events, self._faults, self._gate,
            self.config.pg_timeout, env.bind_host, communicators, kind, device, env.standin_aborts,
        )
        self._disk = DiskCheckpointer(self.config.checkpoint_dir, self.config.checkpoint_every)
        self._snapshots = SnapshotStore(
            on_complete=self._on_snapshot_copied,
            after_copy=self._save_to_disk if self._disk.enabled else None,
            shm_dir=self.config.shm_dir,
            member=self.member,
            depth=self.config.snapshot_depth,
        )
        self._tracked = TrackedState(self._collectives, self._snapshots, self.config.replica_checks,
                                     self.config.snapshot_every)
        self._own_groups = OwnGroups()  # the script's dist.new_group() groups
        self._dcp_wrapped = False  # torch.distributed.checkpoint's save and load quiet in a lost step (dcp.py)
        self._snapshots_on = True  # rt.set_snapshots
        self._data_seats = DataSeats()  # DistributedSamplers: seated at every adopted view
        self._data_seats.seat_unseated(env.world_size, lambda: self.rank)
        self._loader_watch = LoaderWatch(lambda: self._state.step >= 0, self._untracked_loader)
        self._loader_watch.install()
        # A lost step's backward stops at DeadPool's next gradient hook (rt.ddp) or mesh collective; FSDP2 is reset.
        self._backward = AbandonableBackward(self._tracked.backward_abandoned)
        self._backward.install()
        self._recovery = Recovery(
            env, self._state, self._handoff, self._progress, self.events, self._snapshots, self._disk,
            self._collectives, self._faults, self._tracked, self._data_seats,
        )
        self._stalls: deque[float] = deque(maxlen=200)
        self._computes: deque[float] = deque(maxlen=5)  # recent steps' time outside collective waits
        self._report: dict[str, float] = {}
        self._step_started = time.perf_counter()
        self.final_digest = ""
        self._finished = False
        GUARD.arm(lambda: self._thread.stop(timeout=1.0), ExceptionReport(self._handoff, self.member, self._state),
                  self._left_early)
        disk = self.config.checkpoint_dir and self.role == Role.ACTIVE
        if self.role == Role.ACTIVE:
            self._faults.point(ChaosPoint.JOIN, INITIAL_STEP)
        self._handoff.post(Join(
            self.member, self.role, self.initial_rank, self._env_world_size, os.getpid(), self.host,
            self._thread.control_addr, self._thread.bulk_addr,
            complete_steps(Path(self.config.checkpoint_dir), self._env_world_size) if disk else [],
        ))
        self.events.emit(schema.MemberJoined(role=self.role, pid=os.getpid(), host=self.host,
                         control_addr=self._thread.control_addr, bulk_addr=self._thread.bulk_addr))

    @property
    def rank(self) -> int:
        """This member's seat (-1 while it waits as a spare); an active member knows its seat from the start."""
        if self._state.view is None and self.role == Role.ACTIVE:
            return self.initial_rank
        return self._state.rank

    # -- public API ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of seats in the job (from the current view once seated)."""
        view = self._state.view
        return view.world_size if view else self._env_world_size

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
        if self._state.step >= 0:
            raise MisuseError("rt.track() must be called before the first step")
        for name, obj in objects.items():
            is_loader = isinstance(obj, torch.utils.data.DataLoader)  # a plain one is refused naming the fix
            if not is_loader and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise MisuseError(f"rt.track({name}=...): {type(obj).__name__} has no state_dict()/load_state_dict()")
            if name.startswith("__"):
                raise MisuseError(f"rt.track(): names starting with '__' are reserved, got {name!r}")
            tracked = self._tracked.add(name, obj)
            if isinstance(tracked, TrackedLoader):
                for sampler in tracked.samplers:
                    self._data_seats.add(sampler)
            if isinstance(obj, torch.nn.Module) and self._tracked.sharded and dtensors.fsdp_resets():
                # A mesh seat's lost step stops its forward at the next submodule, as rt.ddp's does; the groups it
                # leaves a peer waiting on are rebuilt (the peer's wait ends at its pause notice).
                AbandonableForward(obj, self._collectives.step_lost, self._collectives.abandon_forward).wrap()
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._optimizer_pre_step)
                skip_when_lost(obj, lambda: self._collectives.step_lost() or self._state.auditing,
                               self._optimizer_stepped)

    def distributed_sampler(
        self, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
    ) -> torch.utils.data.DistributedSampler[Any]:
        """A ``torch.utils.data.DistributedSampler`` of this seat, re-seated by DeadPool at every adopted view.

        A spare cannot build one itself (its rank is -1 until it takes a seat): it gets a
        placeholder seat, which its adoption replaces with the dead seat's rank and the view's size.
        """
        world = max(self.world_size, 1)
        rank = self.rank if self.rank >= 0 else 0
        sampler: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last,
        )
        self._data_seats.add(sampler)
        return sampler

    def device_mesh(self, shape: Sequence[int], names: Sequence[str], device_type: str = "cpu") -> DeviceMesh:
        """A torch ``DeviceMesh`` of the job's seats (row-major), for ``fully_shard`` and ``parallelize_module``.

        Its groups keep their identity across swaps while DeadPool replaces the gloo groups behind
        those that held a replaced seat.  On a spare this blocks until the coordinator chooses it for
        a seat (its seat decides which shards it holds; the Prepare of the swap says, so it wraps its
        model while the survivors finish their step), so that it wraps its model exactly as the
        seat's old member did; its state is restored when it reaches ``rt.steps()``.  A spare released
        before it was needed exits here (status 0).  `device_type`: where the mesh's tensors live ("cuda":
        their collectives go to NCCL where ``deadpool launch --backend`` allows).

        Raises:
            MisuseError: called twice or after the first step, or the shape does not cover the seats.
        """
        if self._tracked.sharded:
            raise MisuseError("rt.device_mesh(): this job has its mesh already (call it once)")
        if self._state.step >= 0:
            raise MisuseError("rt.device_mesh() must be called before the first step")
        # DTensor imports torch._dynamo on first use (about 1.5 s of CPU): a spare pays it while it waits
        # for a seat, not while the survivors wait for it to wrap its model.
        importlib.import_module("torch._dynamo")
        seating = self._seating()
        mesh = self._collectives.seat_mesh(shape, names, seating.view, seating.seat, first=seating.first,
                                           device_type=device_type)
        self._tracked.use_mesh()
        self._progress.answers_early = False  # a mesh seat's PrepareAck lists the groups its step left dirty
        return mesh

    def _new_group(self, ranks: Sequence[int] | None = None, sort_ranks: bool = True) -> Any:
        """``dist.new_group(ranks)`` under ``deadpool launch``: a group over those seats (all of them for None; in
        the order given with ``sort_ranks=False``, as torch's) that DeadPool rebuilds at every swap that
        replaced one of them, as a mesh dimension's; torch's ``GroupMember.NON_GROUP_MEMBER`` on a seat outside
        it. Every seat makes it, at the same point of its script, before the first step; a spare waits here for
        its seat, as in ``rt.device_mesh``.

        Raises:
            MisuseError: called after the first step.
            ValueError: `ranks` are not distinct seats of the job.
        """
        if self._state.step >= 0:
            raise MisuseError("dist.new_group() under deadpool launch: make the script's groups before its loop "
                              "over rt.steps() (a spare makes them before it takes its seat, and replays from a "
                              "step after the one that made them)")
        seating = self._seating()
        name, seats = self._own_groups.name(ranks, sort_ranks, seating.view.world_size, seating.seat)
        if name is None:
            return dist.GroupMember.NON_GROUP_MEMBER
        group = self._collectives.seat_group(seats, name, seating.view, seating.seat, first=seating.first)
        self._progress.answers_early = False  # its PrepareAck lists the groups its step left dirty
        return group

    def zero_optimizer(
        self, params: Any, optimizer_class: type[torch.optim.Optimizer], **defaults: Any,
    ) -> torch.optim.Optimizer:
        """torch's ``ZeroRedundancyOptimizer`` over the seats (optimizer state sharded across them).

        Built once this member knows its seat, on torch's default group, which keeps its identity
        across swaps (its collectives run on the current view's group): a spare blocks here until
        the coordinator chooses it for a seat, so that it holds that seat's partition, as
        ``rt.device_mesh`` does.  Track it like any optimizer; each seat's snapshot then holds its
        own shard, and a swap restores the dead seat's shard from its buddy.

        Raises:
            MisuseError: called after the first step, torch.distributed has a default group of the
                script's, or ``overlap_with_ddp`` (it needs torch DDP's hooks).
        """
        if defaults.get("overlap_with_ddp"):
            raise MisuseError("rt.zero_optimizer(): overlap_with_ddp=True is not supported (it needs DDP hooks)")
        if self._state.step >= 0:
            raise MisuseError("rt.zero_optimizer() must be called before the first step")
        if dist.is_initialized() and not isinstance(c10d._world.default_pg, DefaultGroup):
            raise MisuseError("rt.zero_optimizer(): torch.distributed already has a default process group; under "
                              "DeadPool the runtime owns the groups (do not call init_process_group)")
        from torch.distributed.optim import ZeroRedundancyOptimizer  # FSDP and DTensor come with it: only here

        seating = self._seating()
        self._collectives.seat_default_group(seating.view, seating.seat)
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(params, optimizer_class, **defaults)
        return optimizer

    def _seating(self) -> Seating:
        """This member's seat, waited for (a spare until a Prepare or view chooses it); a spare the job
        finished without exits here (status 0)."""
        seating = self._recovery.wait_for_offer()
        if seating is None:
            self._recovery.wait_for_seat()
            self._shutdown()
            raise SystemExit(0)
        return seating

    def ddp(
        self, model: torch.nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB, broadcast_buffers: bool = True,
    ) -> DataParallel:
        """Wrap `model` for data-parallel training across the seats (rebuilds itself after swaps).

        Gradients are all-reduced in fixed buckets of about `bucket_mb`, each issued as soon as
        its gradients are ready; after backward each ``param.grad`` is a view into its bucket.
        With `broadcast_buffers` (torch DDP's default) the module's buffers (BatchNorm running
        statistics) are seat 0's on every seat after each training forward; ``no_sync()``
        accumulates gradients without all-reducing them, as DDP's.
        """
        wrapper = DataParallel(model, self._collectives, bucket_mb, broadcast_buffers)
        self._tracked.add_ddp(wrapper)
        return wrapper

    def set_snapshots(self, enabled: bool) -> None:
        """Take the per-step snapshot (True, the default) or not, from the end of the current step on.

        Steps run while it is off are not protected: a failure rolls the job back to the newest
        snapshot taken and replays from there (more work lost, the same final state).  Call it at
        the same step on every seat.  For phases that need no protection, and for measuring the
        snapshots' cost inside one job (``bench/overhead_injob.py``).
        """
        self._snapshots_on = bool(enabled)

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
        recovery = self._recovery
        step = recovery.wait_for_seat()
        while isinstance(step, Audit):  # an idle spare re-does a seat's step for the coordinator (--audit)
            yield from self._audit(step)
            step = recovery.wait_for_seat()
        if step is None:
            return  # a spare never needed: the job finished
        while True:
            if step >= max_steps:
                if self._finalize(max_steps):
                    return
                step = recovery.recover()
                continue
            self._begin_step(step)
            yield step
            if self._state.poison is not None or self._handoff.step_lost(self._state.epoch):
                step = recovery.recover()
                continue
            pending = self._end_step(step)
            step = recovery.recover(pending) if pending is not None else step + 1

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
        """Stop the runtime; returns (and logs) the job-wide final state digest ("" on a spare).

        Raises:
            MisuseError: called on a seat whose loop over ``rt.steps()`` was left before its end (a ``break``), with
                no exception on its way out (``finish`` in a ``finally`` then only stops the runtime).
        """
        why = self._left_early()
        if why and sys.exc_info()[1] is None:
            raise MisuseError(why)
        if self.final_digest and self.rank == 0:
            print(f"final state digest: {self.final_digest}", flush=True)
        self._shutdown()
        return self.final_digest

    # -- step lifecycle -----------------------------------------------------------------------

    def _begin_step(self, step: int) -> None:
        self._state.step = step
        self._state.poison = None
        self._handoff.begin_step(step)
        self._state.backward_issued = self._state.abandoned = self._state.forward_abandoned = False
        self._report = {}
        self._step_started = time.perf_counter()
        self._collectives.waits.take()  # waits before the step (a restore's) are not the step's
        self._tracked.at_boundary(self._state.epoch)
        view, state = self._state.view, self._state
        self._collectives.digest_step(self.config.audit and view is not None and view.world_size > 1 and (
            state.auditing or audited_seat(step, view.world_size) == state.rank))
        self._faults.point(ChaosPoint.BOUNDARY)
        if delay := self._faults.slowdown(self._progress.compute_s):
            time.sleep(delay)  # a straggler, made to order (slow: chaos)
        if not self._dcp_wrapped:
            self._dcp_wrapped = dcp.enable_once_imported(self._collectives.step_lost)

    def _end_step(self, step: int) -> Command | None:
        """Bookkeeping after a good step; returns a command that needs recovery, if one came."""
        elapsed = time.perf_counter() - self._step_started
        waited = self._collectives.waits.take()
        self._computes.append(max(0.0, elapsed - waited))
        self._progress.compute_s = round(statistics.median(self._computes), 6)
        for what in (Corrupted.PARAM, Corrupted.OPTIM) if self._faults.armed else ():  # a corrupt: spec's flip
            self._faults.corrupt(what, step, functools.partial(self._tracked.first_tensor, what))
        if self._snapshots_on and (step + 1) % self.config.snapshot_every == 0:
            self._capture(step)
        self._progress.step = step
        self._loader_watch.first_step_done()
        self._faults.first_step_done(step)
        if self._collectives.digesting:  # an audit step: the coordinator compares it with a spare's re-done one
            digest = self._collectives.take_audit_digest()
            self._handoff.post(AuditDigest(self.member, self._state.epoch, self.rank, step, digest or 0,
                                           "" if digest is not None else NO_BUCKETS))
        report = dict(self._report)
        loss, tokens = report.pop("loss", None), report.pop("tokens", None)
        rate = round(tokens / elapsed, 1) if tokens is not None and elapsed > 0 else None
        self.events.emit(schema.StepFinished(epoch=self._state.epoch, rank=self.rank, step=step,
                                             step_s=round(elapsed, 6), wait_s=round(waited, 6), loss=loss,
                                             tokens=tokens, tokens_per_s=rate,
                                             report=report))
        self._recovery.step_finished(step)
        leave, hold = self._handoff.at_boundary(step)
        if self._state.poison is None and leave is not None:
            self._leave(step, leave)
        elif self._state.poison is None and hold:
            return self._hold(step)
        return self._drain_commands()

    def _hold(self, step: int) -> Command | None:
        """A seat moves away after `step`: take this seat's snapshot of it, say so, and wait here for the view change
        (bounded), so that the next step is not begun only to be abandoned and the spare's restore has the cores
        to itself; returns the command that came (None: none within the view timeout, the step loop goes on)."""
        self._capture_for_move(step)
        if (command := self._drain_commands()) is not None:
            return command
        # After the views that only change the spares (a drain's) are applied: the coordinator counts a Holding of
        # the view it holds.
        self.events.emit(schema.SeatHeld(epoch=self._state.epoch, rank=self.rank, step=step))
        self._handoff.post(Holding(self.member, self._state.epoch, step))
        deadline = time.monotonic() + self.config.view_timeout
        while (command := self._drain_commands()) is None:  # a view that only changes the spares does not end it
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._handoff.pause(self._state.epoch, remaining) or not self._handoff.pending():
                return None
        return command

    def _audit(self, audit: Audit) -> Iterator[int]:
        """Re-do seat `audit.seat`'s step `audit.step` from its snapshot of the step before, as that seat, with the
        collectives completing locally and the optimizer's step skipped; then send the digest of the local
        gradients (``AuditDigest``). A spare needed meanwhile (a Prepare) abandons it."""
        why = self._recovery.load_for_audit(audit)
        state, digest = self._state, None
        if not why:
            held = self._recovery.held
            state.view, state.rank, state.auditing = held, audit.seat, True
            self._begin_step(audit.step)
            try:
                yield audit.step
            finally:
                lost = self._collectives.step_lost()
                digest = self._collectives.take_audit_digest()
                state.view, state.rank, state.auditing, state.step = None, -1, False, -1
            why = "this spare was needed: the audit was abandoned" if lost else "" if digest is not None else NO_BUCKETS
        self._handoff.post(AuditDigest(self.member, audit.epoch, audit.seat, audit.step, digest or 0, why))

    def _leave(self, step: int, leave: Leave) -> None:
        """A planned move: hand this seat over after `step`, once the buddy confirmed this boundary's snapshot, then
        exit 0 (``exit_moved``). A Prepare meanwhile (a failure elsewhere) interrupts it: the seat leaves at the
        first boundary after that repair."""
        view, state = self._state.view, self._state
        if view is None or self.rank < 0:
            return
        self._capture_for_move(step)
        confirmed, snapshot_step = self._newest_confirmed()
        if not confirmed or snapshot_step != step:
            return
        self._handoff.post(Leaving(self.member, state.epoch, step))
        answer = self._handoff.wait_terminal(self.config.view_timeout)
        if isinstance(answer, Fenced):
            self._thread.stop(timeout=MOVED_LINGER_S, linger=True)  # the spare's parts of this snapshot leave first
            exit_moved(self.events, self.member, self.rank, step, leave.reason)

    def _drain_commands(self) -> Command | None:
        """Apply views that need no pause; return the first command that does."""
        while (command := self._handoff.poll()) is not None:
            if isinstance(command, CommitView):
                view = self._state.view
                if command.view.epoch <= self._state.epoch:
                    continue
                if view is not None and command.view.store_prefix == view.store_prefix:
                    self._recovery.set_view(command.view)
                    continue
            if isinstance(command, (CommitView, Prepare, Stop, Fenced)):
                return command
        return None

    def _capture_for_move(self, step: int) -> None:
        """A planned move's boundary: every seat's snapshot of `step` is taken (the spare takes the seat from it)."""
        if not self._snapshots_on or (step + 1) % self.config.snapshot_every:
            self._capture(step)

    def _capture(self, step: int) -> None:
        if self._state.view is not None:
            self._tracked.capture(step, self._state.view, self.rank)

    def _save_to_disk(self, slot: Slot) -> None:
        """Copy thread: every N steps, the finished snapshot also goes to disk (background write)."""
        if self.rank >= 0:
            self._disk.maybe_save(slot, self.rank)

    def _untracked_loader(self, message: str, loader: UntrackedLoader) -> None:
        """The loader watch saw training iterate a loader no snapshot holds (warned once)."""
        self._tracked.note_untracked(loader)
        self.events.emit(schema.DataLoaderUntracked(rank=self.rank, step=self._state.step, loader=loader.kind,
                         where=loader.where))

    def _on_snapshot_copied(self, slot: Slot) -> None:
        """Copy thread: hand the finished snapshot to the SnapshotActor for streaming."""
        try:
            self._handoff.post(LocalReady(slot))
        except RuntimeError:
            pass  # runtime already stopped (shutdown)

    # -- inside a step ------------------------------------------------------------------------

    def _optimizer_pre_step(self, *_: Any) -> None:
        self._gate()

    def _optimizer_stepped(self) -> None:
        """An optimizer's step() is about to change parameters in the step in progress (it is not lost)."""
        self._state.stepped = self._state.step

    def _gate(self) -> bool:
        """Before parameters change: the previous snapshot must be copied and confirmed by the buddy.

        Returns False when the step is poisoned (a view change interrupted the wait).
        """
        state = self._state
        if state.poison is not None:
            return False
        if state.gated_step == state.step:
            return True
        start = time.perf_counter()
        if not self._newest_confirmed()[0]:
            state.poison = "interrupted while waiting for the buddy's snapshot confirmation"
            return False
        stall = time.perf_counter() - start
        self._stalls.append(stall)
        if len(self._stalls) >= 10:
            ordered = sorted(self._stalls)
            self._progress.stall_p99_s = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        state.gated_step = state.step
        return True

    def _newest_confirmed(self) -> tuple[bool, int | None]:
        """Wait until the newest snapshot is copied and its buddy confirmed its copy: (False, _) when a Prepare
        interrupted the wait, else (True, that snapshot's step; None when there is none, or no buddy).

        Raises:
            WaitTimeout: neither came within the view timeout.
        """
        self._snapshots.wait_copy(self.config.copy_timeout)
        newest = self._snapshots.newest_started()
        view = self._state.view
        if newest is None or view is None or view.world_size < 2:
            return True, None
        generation, step = newest.generation, newest.step
        confirmed = self._handoff.wait_until(
            lambda: self._handoff.is_confirmed(generation, step), self._state.epoch, self.config.view_timeout,
            f"waiting for the buddy to confirm its copy of step {step}",
        )
        return confirmed, step

    # -- the end ------------------------------------------------------------------------------

    def _finalize(self, max_steps: int) -> bool:
        """Agree on the job-wide digest; False if a failure interrupted it (then recovery runs)."""
        view = self._state.view
        assert view is not None and self._collectives.group is not None
        self._state.step = max_steps
        self._tracked.at_boundary(self._state.epoch)  # restored, and no step since (a failure as the seats finished)
        state = self._tracked.live()
        rngs = {kind: state_digest(value) for kind, value in state["__rng__"].items()}  # --check-determinism
        # Python's `random` and numpy's are seeded from the OS unless the script seeds them: restored, not digested.
        for unseeded in rng_mod.UNSEEDED:
            state["__rng__"].pop(unseeded, None)
        parts = {name: state_digest(value) for name, value in state.items()}
        seat_digest = state_digest(state)  # hashed once: each pass over the state delays this seat's exit
        mine = torch.frombuffer(bytearray(bytes.fromhex(seat_digest)), dtype=torch.uint8)
        gathered = [torch.zeros(32, dtype=torch.uint8) for _ in range(view.world_size)]
        if not self._collectives.exchange_digests(gathered, mine):
            return False
        if self._handoff.interrupted(view.epoch):
            return False
        self.final_digest = hashlib.sha256(b"".join(bytes(t.tolist()) for t in gathered)).hexdigest()
        self._finished = True
        loader, where, rolled_back = self._tracked.untracked_rollback()
        self._handoff.post(Finished(self.member, view.epoch, self.rank, max_steps - 1, self.final_digest,
                                    loader, where, rolled_back))
        self.events.emit(schema.SeatFinished(epoch=view.epoch, rank=self.rank, step=max_steps - 1,
                         state_digest=self.final_digest, seat_digest=seat_digest, parts=parts, rngs=rngs))
        stats = self.stats()
        self.events.emit(schema.SnapshotMemory(rank=self.rank, own_snapshots_bytes=stats["own_snapshots_bytes"],
                         buddy_copies_bytes=stats["buddy_copies_bytes"],
                         buddy_copies_shared_bytes=stats["buddy_copies_shared_bytes"],
                         snapshot_bytes=stats["snapshot_bytes"], snapshot_copied_bytes=stats["snapshot_copied_bytes"],
                         stall_p99_s=round(stats["stall_p99_s"], 6)))
        return True

    def _left_early(self) -> str:
        """Why this seat is leaving before its loop over ``rt.steps()`` ended ("": it is not, or it has no seat)."""
        state = self._state
        if self._finished or state.view is None or state.rank < 0 or self._handoff.terminal is not None:
            return ""
        return (f"rank {state.rank} left the loop over rt.steps() in step {state.step}, before its end (a sys.exit, "
                "return or break inside it?): every seat runs every step to the loop's end, so the job cannot go on "
                "without this one")

    def _shutdown(self) -> None:
        global _RUNTIME
        self._disk.close()
        self._loader_watch.uninstall()
        self._backward.uninstall()
        self._thread.stop(timeout=5.0)
        self._snapshots.close()
        self.events.close()
        _RUNTIME = None
        GUARD.finish()

