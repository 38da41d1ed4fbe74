"""How a worker takes (or retakes) its seat: wait for one, answer Prepares, adopt the committed view.

Adopting a view restores the seat's state of the view's resume step (from the
local snapshot, or the live tensors where they still hold it; from the buddy's
copy, fetched by ``fetch.py``, perhaps before the view came; or from the disk
checkpoint: one plan per source, ``restore.py``), rebuilds the process group,
and captures the restored state as the seat's first snapshot under the new view.
The tracked objects are loaded and captured through ``tracked.TrackedState``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from deadpool.actors.handoff import Command, Handoff, PrepareReady, Progress
from deadpool.chaos import ChaosPoint
from deadpool.config import WorkerEnv
from deadpool.errors import CollectiveAborted, JobStopped, RestoreFailed, WaitTimeout
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.messages import (
    Audit,
    AuditDigest,
    CollectiveFailed,
    CommitView,
    Fenced,
    Prepare,
    Recovered,
    Role,
    Stop,
    Takeover,
)
from deadpool.protocol.view import FIRST_EPOCH, INITIAL_STEP, View
from deadpool.snapshot.checkpoint import DiskCheckpointer, complete_steps
from deadpool.snapshot.store import SnapshotStore
from deadpool.worker import rng as rng_mod
from deadpool.worker.data import DataSeats
from deadpool.worker.exit import exit_fenced
from deadpool.worker.faults import FaultInjector
from deadpool.worker.fetch import PeerFetch, Prefetch
from deadpool.worker.groups.hub import GroupCollectives
from deadpool.worker.restore import (
    BuddyPlan,
    DiskPlan,
    InitialPlan,
    LocalPlan,
    MoverPlan,
    Plan,
    Preloaded,
    PreloadedPlan,
    SlicesPlan,
)
from deadpool.worker.step import StepState
from deadpool.worker.tracked import TrackedState

SPARE_WAIT_S = 7 * 24 * 3600.0  # a spare may wait this long for a seat (the job's life, in practice)
AUDIT_POLL_S = 0.05  # a spare of an audited job looks for the coordinator's next audit this often
NOT_IN_STEPS = ("this spare waits for its seat before rt.steps() (in rt.zero_optimizer or rt.device_mesh, which "
                "build a seat's own state), so it cannot re-do another seat's step: audits cover rt.ddp only")


@dataclass(frozen=True)
class Reserved:
    """A Prepare chose this spare for `seat`: its CommitView is still to come."""

    epoch: int  # the epoch being prepared
    seat: int
    view: View  # the newest view the spare held (the job's shape and store)
    wrapped: bool = True  # the script wrapped its model for `seat` (``wait_for_offer``): no other seat will do


@dataclass(frozen=True)
class Seating:
    """The seat ``rt.device_mesh`` wraps the model for."""

    view: View  # the view that seats this member, or the one held when a Prepare reserved the seat
    seat: int
    first: bool  # the job's first view, taken without a restore


class Recovery:
    """The seat-taking half of a worker's runtime; the step loop calls it at step boundaries."""

    def __init__(
        self,
        env: WorkerEnv,
        state: StepState,
        handoff: Handoff,
        progress: Progress,
        events: EventLog,
        snapshots: SnapshotStore,
        disk: DiskCheckpointer,
        collectives: GroupCollectives,
        faults: FaultInjector,
        tracked: TrackedState,
        data_seats: DataSeats,
    ) -> None:
        self._env = env
        self._config = env.config
        self._state = state
        self._handoff = handoff
        self._progress = progress
        self._events = events
        self._snapshots = snapshots
        self._disk = disk
        self._collectives = collectives
        self._faults = faults
        self._tracked = tracked  # what a snapshot holds of the seat: captured, loaded, compared with the live state
        self._data_seats = data_seats  # DistributedSamplers: they take the adopted seat
        self._recovering_epoch = 0  # epoch whose first finished step is reported as Recovered
        self._swap_unreported = env.role == Role.SPARE  # a spare reports its first step in a seat (swap_completed)
        self._offer: CommitView | Reserved | Stop | None = None  # what rt.device_mesh or rt.zero_optimizer waited for
        self._held: View | None = None  # the newest view a waiting spare was told of (it sits in its spares)
        self._fetch = PeerFetch(env.member, handoff, env.config.restore_timeout)
        self._preloaded: Preloaded | None = None  # a reserved spare's prefetch, already loaded
        self._adopted_groups = (0, 0.0)  # (mesh groups rebuilt, seconds building groups) of the last adoption
        self._failure_step = -1  # the injected failure's step the Prepares of this pause named (-1: none)
        self._initial_rng: dict[str, Any] | None = None  # the RNG states of the initial state (its first adoption)
        self._audits_refused = False  # this spare told the operator it cannot re-do a seat's step

    @property
    def held(self) -> View | None:
        """The newest view a waiting spare was told of (None: none yet, or seated)."""
        return self._held

    def set_view(self, view: View) -> None:
        """Sit in `view` without touching the group (a view that keeps the store prefix: spares changed)."""
        state = self._state
        state.view = view
        seat = view.seat_of(self._env.member)
        state.rank = -1 if seat is None else seat
        self._progress.epoch = view.epoch
        self._events.epoch, self._events.rank = view.epoch, state.rank

    def step_finished(self, step: int) -> None:
        """A good step ended: the first one after an adoption tells the coordinator the job recovered."""
        epoch = self._state.epoch
        if self._recovering_epoch and self._recovering_epoch <= epoch:  # later spare-only views count too
            self._recovering_epoch, self._swap_unreported = 0, False
            self._handoff.post(Recovered(self._env.member, epoch, step, time.time(), *self._adopted_groups))

    # -- waiting ------------------------------------------------------------------------------

    def wait_for_seat(self) -> int | Audit | None:
        """Block until this member has a seat (first view, or adoption); returns the first step.

        None: this spare was never needed and the job finished. An Audit: the coordinator asks this waiting spare
        to re-do a seat's step (``load_for_audit``, then ``rt.steps()`` runs it), after which it waits again.

        Raises:
            JobStopped: the coordinator ended the job.
            WaitTimeout: an active member got no first view within ``startup_timeout``.
        """
        offer, self._offer = self._offer or self._next_offer(moves=True, audits=True), None
        if isinstance(offer, Audit):
            return offer
        if isinstance(offer, Reserved):
            self._preload(offer)
            offer = self._seated_as_reserved(offer)
        if isinstance(offer, Stop):
            self._events.emit(schema.SpareReleased(reason=offer.reason))
            return None
        first = self._adopt_with_retry(offer.view)
        # Seated but interrupted (another failure during this swap): answer the next Prepare like
        # any survivor, from the snapshot the adoption already took.
        return first if first is not None else self.recover()

    def wait_for_offer(self) -> Seating | None:
        """Block until this member knows its seat, without adopting a view (``rt.steps()`` does); None: released.

        ``rt.device_mesh`` needs the seat before the script wraps its model, and the restore
        after.  A spare learns its seat from the Prepare that chose it, so it wraps while the
        survivors finish their step; the view that seats it comes later, to ``wait_for_seat``.

        Raises:
            JobStopped: the coordinator ended the job.
            WaitTimeout: an active member got no first view within ``startup_timeout``.
        """
        if self._offer is None:
            offer = self._next_offer(reservations=True)
            assert not isinstance(offer, Audit)  # not asked for
            self._offer = offer
        offer = self._offer
        if isinstance(offer, Reserved):
            return Seating(offer.view, offer.seat, first=False)
        if isinstance(offer, CommitView):
            seat = offer.view.seat_of(self._env.member)
            assert seat is not None
            return Seating(offer.view, seat, self.is_first(offer.view))
        return None

    def _seated_as_reserved(self, reserved: Reserved) -> CommitView | Stop:
        """The view that seats a reserved spare; one that seats it elsewhere fences a spare whose model is wrapped
        for the reserved seat, and the coordinator chooses again (any other restores that seat instead)."""
        offer = self._next_offer()
        assert not isinstance(offer, (Reserved, Audit))  # asked for views only
        if isinstance(offer, CommitView) and reserved.wrapped:
            seat = offer.view.seat_of(self._env.member)
            if seat != reserved.seat:
                exit_fenced(self._events, self._env.member, Fenced(
                    self._env.member, offer.view.epoch, f"seated at rank {seat}, but its model was wrapped for "
                    f"rank {reserved.seat}, which the Prepare of epoch {reserved.epoch} chose it for"))
        return offer

    def is_first(self, view: View) -> bool:
        """`view` is the job's first and this member takes its seat in it without a restore."""
        seat = view.seat_of(self._env.member)
        return self._state.view is None and view.resume_step == -1 and seat is not None and \
            seat not in view.restore_from

    def _next_offer(self, reservations: bool = False, moves: bool = False,
                    audits: bool = False) -> CommitView | Reserved | Stop | Audit:
        """The view that seats this member, or the Stop that releases a spare the job did not need.

        `reservations`: a Prepare that chooses this spare for a seat answers too; `moves`: such a Prepare of a
        planned move (the spare loads the moving seat's copy before the commit). `audits`: so does an audit the
        coordinator asks of this spare (only ``rt.steps()`` takes one: ``rt.device_mesh`` wraps the model for one
        seat, and audits cover ``rt.ddp`` and ZeRO only).
        """
        started = time.monotonic()
        spare = self._env.role == Role.SPARE
        bound = SPARE_WAIT_S if spare else self._config.startup_timeout
        poll = AUDIT_POLL_S if spare and self._config.audit else 1.0
        while True:
            if spare and self._held is not None and not self._handoff.pending() \
                    and (audit := self._handoff.next_audit()) is not None:
                if audits:
                    return audit
                self._handoff.post(AuditDigest(self._env.member, audit.epoch, audit.seat, audit.step, 0, NOT_IN_STEPS))
                if not self._audits_refused:  # once, where the operator sees it: --audit protects nothing here
                    self._audits_refused = True
                    print(f"deadpool: warning: --audit: {NOT_IN_STEPS}", file=sys.stderr, flush=True)
            wait = self._faults.spare_point(time.monotonic() - started, poll) if spare else 1.0
            if time.monotonic() - started > bound:
                raise WaitTimeout(
                    f"no seat assigned within {bound:.0f}s: the coordinator at "
                    f"{self._env.coordinator} never formed the first view. "
                    "Check that all ranks were started and can reach it."
                )
            try:
                command = self._handoff.take(wait, "waiting for a seat")
            except WaitTimeout:
                continue
            if isinstance(command, Stop):
                if command.ok and self._state.rank < 0:
                    return command
                raise JobStopped(command.reason)
            if isinstance(command, Fenced):
                exit_fenced(self._events, self._env.member, command)
            if isinstance(command, CommitView):
                if command.view.seat_of(self._env.member) is not None:
                    return command
                self._held = command.view
            if isinstance(command, Takeover) and self._held is not None:
                self._take_over(command, self._held, load=not reservations)
            if isinstance(command, Prepare) and self._held is not None:
                for seat, member in command.replacements.items():
                    if member == self._env.member:
                        self._fetch.start_prefetch(command, seat, self._held)
                        # A planned move's spare loads the copy before the commit too: the Prepare names the
                        # step the seat left after, once its buddy held the copy of it, and the view resumes there.
                        if reservations or (moves and command.planned):
                            return Reserved(command.epoch, seat, self._held, wrapped=reservations)

    def load_for_audit(self, audit: Audit) -> str:
        """A spare: load seat `audit.seat`'s snapshot of the step before `audit.step` (its buddy's copy, the other
        seats' slices) into the tracked objects, to re-do that step; "" when loaded, else why not.

        The snapshot may not be there yet (the seats are a step or two behind the audit's step): asked again
        until the restore timeout. A Prepare (this spare may be needed) or a newer view ends the wait at once.
        """
        held = self._held
        if held is None or not 0 <= audit.seat < held.world_size:
            return "this spare holds no view with that seat"
        deadline = time.monotonic() + self._config.restore_timeout
        while True:
            try:
                manifest, arena = self._fetch.snapshot_of(held, audit.seat, audit.step - 1)
                break
            except RestoreFailed as err:
                if time.monotonic() > deadline:
                    return f"no snapshot of seat {audit.seat} at step {audit.step - 1} to re-do from: {err}"
            except (CollectiveAborted, WaitTimeout) as err:
                return str(err)
            if not self._handoff.pause(held.epoch, AUDIT_POLL_S):  # False at once with a command queued
                return "a newer view or a Prepare came: this spare may be needed"
        self._data_seats.seat(audit.seat, held.world_size)
        self._preloaded = None  # a move's Takeover state, if one was loaded, is overwritten
        self._tracked.load(manifest, arena)
        return ""

    def recover(self, pending: Command | None = None) -> int:
        """Pause at the boundary, answer Prepares, adopt the committed view; returns the next step.

        Raises:
            JobStopped: the coordinator ended the job.
            WaitTimeout: no committed view came within ``view_timeout``.
        """
        state = self._state
        self._snapshots.wait_copy(self._config.copy_timeout)
        if state.poison is not None:
            self._events.emit(schema.Paused(epoch=state.epoch, rank=state.rank, step=state.step, reason=state.poison,
                              backward_abandoned=state.abandoned, forward_abandoned=state.forward_abandoned))
        acked = 0
        while True:
            command = pending if pending is not None else self._handoff.take(
                self._config.view_timeout, f"paused after step {state.step} waiting for the view change"
            )
            pending = None
            if isinstance(command, Stop):
                raise JobStopped(command.reason)
            if isinstance(command, Fenced):
                exit_fenced(self._events, self._env.member, command)
            if isinstance(command, Prepare) and command.epoch >= acked and (command.reanswer or not acked):
                acked = command.epoch
                self._failure_step = max(self._failure_step, command.failure_step)
                self._snapshots.wait_copy(self._config.copy_timeout)
                world = state.view.world_size if state.view else self._env.world_size
                disk = complete_steps(self._disk.root, world) if self._disk.enabled else []
                local = self._snapshots.complete_steps()
                if not local and state.step == INITIAL_STEP:
                    local = [INITIAL_STEP]  # it began no step: its live state is the initial state
                # The snapshot actor adds the ward copies it holds and sends the PrepareAck.
                groups, view = self._collectives.subgroups, state.view
                self._handoff.post(PrepareReady(command.epoch, self._progress.step, state.step, local, disk,
                                                groups.dirty_groups() if groups is not None else [],
                                                groups.peers(view) if groups is not None and view is not None else [],
                                                state.abandoned or state.forward_abandoned,
                                                state.forward_abandoned))
            elif isinstance(command, CommitView) and command.view.epoch > state.epoch:
                if command.view.seat_of(self._env.member) is None:
                    exit_fenced(self._events, self._env.member,
                                Fenced(self._env.member, command.view.epoch, "not seated in the committed view"))
                if state.view is not None and command.view.store_prefix == state.view.store_prefix:
                    self.set_view(command.view)
                    continue
                first = self._adopt_with_retry(command.view)
                if first is not None:
                    return first

    # -- adopting a view ----------------------------------------------------------------------

    def _adopt_with_retry(self, view: View) -> int | None:
        try:
            return self._adopt(view)
        except (CollectiveAborted, RestoreFailed, WaitTimeout) as err:
            self._events.emit(schema.AdoptFailed(epoch=view.epoch, error=str(err)))
            if not (isinstance(err, CollectiveAborted) and err.interrupted):
                # Interrupted by a newer view: the coordinator is already rebuilding, and a report would
                # make it rebuild once more (each rebuild interrupting the adoption of the one before).
                self._handoff.post(CollectiveFailed(self._env.member, view.epoch, view.resume_step,
                                                    f"adoption failed: {err}"))
            return None

    def _adopt(self, view: View) -> int:
        """Restore the view's resume state, rebuild the group, and return the first step to run.

        Raises:
            CollectiveAborted: interrupted by a newer view, or the group could not form.
            RestoreFailed: the snapshot to restore is not available.
            WaitTimeout: a bounded wait expired.
        """
        seat = view.seat_of(self._env.member)
        assert seat is not None
        initial = self.is_first(view)  # from the initial state: no restore
        first_view = initial and view.epoch == FIRST_EPOCH  # the job's first view (no failure came before it)
        started = time.perf_counter()
        if self._initial_rng is None and initial:
            # The RNG states the script left before its first group build: every seat that starts from the initial
            # state (in the first view, or again after a failure before the first snapshots were confirmed)
            # takes them back once its groups are built, however often it built them.
            self._initial_rng = rng_mod.capture()
        if not first_view:
            # Keyed on the step the failure was injected at, as the Prepare said, the same in every
            # survivor; else on the first step this member has not finished (a survivor may pause at the
            # boundary before that step, inside it, or, told late, in the step before it).
            failure_step, self._failure_step = self._failure_step, -1
            self._faults.point(ChaosPoint.RECOVERY, failure_step if failure_step >= 0 else self._progress.step + 1)
        self._data_seats.seat(seat, view.world_size)  # before a loader's pass is rebuilt from the snapshot
        self._fetch.seconds = 0.0
        plan = self._plan(view, seat, initial)
        # The restored state is this seat's snapshot of resume_step under the new view, taken before the seat
        # runs a step: the SnapshotActor streams it to the (possibly new) buddy at once, so the seat is
        # protected before its next step changes anything.  Until then the old snapshots stay (a failure
        # during this swap finds them, or the buddy's copy, again).  A state loaded whole already (RNG states
        # included) is taken now, its copy made while the groups form; any other once it is loaded.
        loaded = plan.load_early()
        if loaded:
            self._snapshots.forget_all(keep=plan.held)
            self._tracked.capture(view.resume_step, view, seat)
        # The groups form while the peers' answers come in (the snapshot actor receives them).
        grouping = time.perf_counter()
        if initial:
            self._faults.point(ChaosPoint.GROUPS, INITIAL_STEP)
        self._collectives.configure(view, seat)
        group_s = time.perf_counter() - grouping
        self._adopted_groups = (len(self._collectives.last_rebuild.rebuilt) if self._collectives.subgroups else 0,
                                group_s)
        # Loaded (or its RNG states put back) after the group is built: building one may draw from the global
        # RNGs, and the restored RNG states must survive bit for bit.
        plan.load_late()
        if view.resume_step == -1 and view.world_size > 1:
            # The initial state, on every seat of the view at once (a replacement seated before any snapshot
            # adopts "initial" while the survivors do not): rt.ddp's replicas start as seat 0's, as under DDP.
            self._tracked.take_seat0_state(view.epoch)
        if not loaded:
            self._snapshots.forget_all(keep=plan.held)
            self._tracked.capture(view.resume_step, view, seat)
        if initial:
            self._faults.point(ChaosPoint.SNAPSHOT, INITIAL_STEP)
        restore_s = time.perf_counter() - started - group_s
        self.set_view(view)
        self._state.poison = None
        self._state.gated_step = -2
        self._progress.step = view.resume_step
        # Every seat starts the step when the last one is ready: where ranks share cores, a survivor computing
        # ahead (it would wait for the replacement in its first collective anyway) only slows the replacement
        # down; where they do not, it changes nothing.  Every seat of every view waits, the first view's too: a
        # replacement seated at resume step -1 adopts "initial" while the survivors do not, and a barrier only
        # some seats enter would meet the others' first all-reduce.
        ready = time.perf_counter()
        self._collectives.barrier(f"waiting for every seat to adopt view {view.epoch}", view.epoch)
        if not first_view or self._swap_unreported:
            # Who reports the first finished step (Recovered): a spare that has not yet (its swap completed),
            # and seat 0 (a rebuild that replaced nobody worked).  Not every seat: at 131,072 members that is
            # a message per member per view change, for what one of them says.
            self._recovering_epoch = view.epoch if seat == 0 or self._swap_unreported else 0
            self._events.emit(schema.Restored(epoch=view.epoch, rank=seat, step=view.resume_step,
                              source=plan.source, bytes=plan.nbytes,
                              live_bytes=sum(t.nbytes for t in plan.kept.values()), s=round(restore_s, 6),
                              fetch_s=round(self._fetch.seconds, 6), group_s=round(group_s, 6),
                              wait_s=round(time.perf_counter() - ready, 6), preloaded=plan.preloaded,
                              **self._mesh_fields()))
        return view.resume_step + 1

    def _plan(self, view: View, seat: int, initial: bool) -> Plan:
        """How this adoption restores `seat`: the view names the source (the initial state, the disk, the buddy,
        or this member's own snapshot), and what this member holds decides the rest.

        Raises:
            RestoreFailed: the snapshot to restore is not available.
        """
        if initial:
            assert self._initial_rng is not None
            return InitialPlan(self._initial_rng)
        if view.restores_from_disk(seat):
            return DiskPlan(self._tracked, self._collectives, view, seat, self._config.checkpoint_dir)
        if seat in view.restore_from:
            preloaded, self._preloaded = self._preloaded, None
            plan: Plan
            sources = PeerFetch.sources(view, seat)
            # A move's Takeover asked the member that held the seat for its part, the others for their slices.
            taken_over = preloaded is not None and self._held is not None and seat < self._held.world_size and \
                preloaded.asked == PeerFetch.takeover_sources(self._held, seat) and preloaded.asked[1:] == sources[1:]
            if preloaded is None or (preloaded.seat, preloaded.step) != (seat, view.resume_step) or \
                    not (taken_over or preloaded.asked == sources):
                plan = BuddyPlan(self._tracked, self._fetch.from_buddy(view, seat))
            else:
                plan = (MoverPlan if taken_over else PreloadedPlan)(preloaded)
            self._fetch.prefetch = None
            return plan
        held = self._snapshots.find(view.resume_step)
        if held is None:
            raise RestoreFailed(f"no local snapshot of step {view.resume_step} "
                                f"(held: {self._snapshots.complete_steps()})")
        assert held.manifest is not None  # complete
        unchanged = self._tracked.unchanged(held.manifest) if self._holds_resume_state(view, seat) else None
        restored = self._snapshots.restore_arena(held, unchanged or ())
        if unchanged is None and restored[0].replicated:
            return SlicesPlan(self._tracked, held, self._fetch.slices_into(view, seat, *restored))
        return LocalPlan(self._tracked, held, restored, unchanged or {})

    def _mesh_fields(self) -> dict[str, Any]:
        """The ``restored`` event's account of the mesh groups and the script's own (none without either)."""
        if self._collectives.subgroups is None:
            return {}
        rebuilt, decisions = self._collectives.last_rebuild, self._collectives.decisions
        return {"groups_rebuilt": rebuilt.rebuilt, "groups_kept": rebuilt.kept,
                "mesh_group_s": round(rebuilt.seconds, 6), "decisions_taken": decisions.taken if decisions else 0}

    def _holds_resume_state(self, view: View, seat: int) -> bool:
        """This survivor's live parameters and optimizer state are its snapshot of the view's resume step: it
        finished exactly that step in this seat, and no optimizer step ran after it (a lost step skips it)."""
        return self._state.view is not None and self._state.rank == seat and \
            self._progress.step == view.resume_step and self._state.stepped <= view.resume_step

    def _preload(self, reserved: Reserved) -> None:
        """Load what the Prepare's prefetch brings into the tracked objects now, while the survivors finish their
        step: the adoption then only builds the groups and puts the RNG states back, if the view resumes from
        the step the copies are of and names the same sources.  Nothing is lost if not: the adoption restores."""
        prefetch = self._fetch.prefetch
        if prefetch is None or prefetch.seat != reserved.seat:
            return
        if self._preloaded is not None and self._preloaded.asked == prefetch.asked:
            return  # loaded already, on the move's Takeover
        self._load_prefetch(prefetch, reserved.epoch, reserved.view.world_size)

    def _take_over(self, takeover: Takeover, held: View, load: bool) -> None:
        """A move's Takeover reserved this spare for the seat `takeover.moving` leaves: ask for the seat's state of
        the step it leaves after, and (`load`: the tracked objects are the seat's already, not wrapped later for
        it by ``rt.device_mesh``) load it once every part came, all before the view change. A Prepare meanwhile
        ends the wait; the move's own keeps what was asked (``_preload``)."""
        seat = held.seat_of(takeover.moving)
        if seat is None or takeover.epoch != held.epoch:
            return  # the view changed since: the move's Prepare says what to fetch
        prefetch = self._fetch.start_takeover(seat, takeover.step, held)
        if load:
            self._load_prefetch(prefetch, held.epoch, held.world_size)

    def _load_prefetch(self, prefetch: Prefetch, epoch: int, world: int) -> None:
        """Wait for `prefetch`'s parts (a Prepare newer than `epoch` interrupts) and load them as the seat's state."""
        try:
            fetched = self._fetch.wait(epoch, "prefetched", prefetch.asked, prefetch.answers)
            if len({part.step for part in fetched}) != 1:
                return
            manifest, arena = self._fetch.assemble(prefetch.seat, world, prefetch.asked, fetched)
        except (CollectiveAborted, RestoreFailed, WaitTimeout):
            return  # a newer Prepare, or a copy not there or not whole: the adoption fetches what its view names
        self._data_seats.seat(prefetch.seat, world)
        rng = self._tracked.load(manifest, arena)
        self._preloaded = Preloaded(prefetch.seat, fetched[0].step, prefetch.asked, rng, manifest.nbytes)
