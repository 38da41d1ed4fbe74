"""Process groups that can be abandoned, the collectives of a step on them, and their failures.

gloo cannot cancel a collective or a group's connect, so every wait here is on
a condition that completion or an interrupt (a Prepare) wakes, and a group is
never destroyed, only retired; ``GroupCollectives`` holds the seat's current
group, runs a step's collectives on it (``rt.ddp``'s, ZeRO's, and the script's
own through torch's default group, ``default.py``), and poisons the step when
one fails (the gloo facts behind this are in docs/design/groups.md).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore
from torch.distributed.device_mesh import DeviceMesh

from deadpool.actors.handoff import Handoff
from deadpool.chaos import ChaosPoint, Corrupted
from deadpool.errors import CollectiveAborted, MisuseError, WaitTimeout
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.messages import CollectiveFailed
from deadpool.protocol.view import View
from deadpool.snapshot.checksum import checksum
from deadpool.worker import dtensors, pipelining
from deadpool.worker.exit import GUARD
from deadpool.worker.faults import FaultInjector
from deadpool.worker.groups import default
from deadpool.worker.groups.communicators import Builder, Communicators, Kind
from deadpool.worker.groups.mesh import MeshDim, MeshGroup, Rebuilt, SeatGroups, in_backward
from deadpool.worker.groups.waits import WaitClock, Waiter
from deadpool.worker.propagation import Decisions
from deadpool.worker.step import StepState

log = logging.getLogger(__name__)


class StepCollectives(Protocol):
    """What ``rt.ddp`` needs from the runtime during backward (``GroupCollectives`` is the runtime's)."""

    @property
    def world_size(self) -> int:
        """Seats whose gradients are summed: the divisor of the average."""
        ...

    def fault_point(self, point: ChaosPoint) -> None:
        """A fault-injection point inside backward (returns at once when no chaos is declared)."""
        ...

    def packed_gradient(self, flat: torch.Tensor) -> None:
        """A local gradient bucket, packed, before its reduction: a ``corrupt:...:what=grad`` chaos spec due now
        flips a bit of it, and an audited step digests it."""
        ...

    def local_only(self) -> bool:
        """The step's collectives complete locally, without effect: a spare re-doing a seat's step (an audit)."""
        ...

    def step_lost(self) -> bool:
        """The step in progress no longer counts: a collective failed or a Prepare interrupted it."""
        ...

    def issue_allreduce(self, flat: torch.Tensor) -> dist.Work | None:
        """Start the sum of one bucket; None when the step is poisoned (issue nothing more this backward)."""
        ...

    def await_allreduces(self, works: Sequence[dist.Work]) -> bool:
        """Wait for the issued sums; False when they were abandoned (the step is poisoned)."""
        ...

    def broadcast_buffers(self, flat: torch.Tensor) -> bool:
        """Overwrite `flat` with seat 0's, waited on interruptibly; False when the step is poisoned."""
        ...


class GroupCollectives:
    """The seat's process group, rebuilt for every view, and the collectives of a step on it.

    A collective that fails or is interrupted *poisons* the step: the step runs to its end
    without effect that matters, the group is retired, and the step boundary starts recovery.
    """

    def __init__(
        self,
        member: str,
        state: StepState,
        handoff: Handoff,
        events: EventLog,
        faults: FaultInjector,
        gate: Callable[[], bool],
        timeout: float,
        bind_host: str,
        communicators: Communicators,
        kind: Kind = Kind.GLOO,
        device: torch.device | None = None,
        standin_aborts: bool = True,
    ) -> None:
        self.group: Any = None  # the current view's communicator (None: retired, or not seated yet)
        self._member = member
        self._state = state
        self._handoff = handoff
        self._events = events
        self._faults = faults
        self._gate = gate
        self._timeout = timeout
        self._audited: list[int] = []  # checksums of an audited step's gradient buckets so far, in order
        self.digesting = False  # the step in progress is an audit step: its gradient buckets are digested
        self.communicators = communicators
        self._builder = Builder(communicators, kind, device, timeout, bind_host, handoff.interrupted, standin_aborts)
        self.waits = WaitClock()  # the step's time in collective waits (the runtime takes it per step)
        self._waiter = Waiter(handoff.condition, lambda: handoff.interrupted(state.epoch), self.waits)
        self.subgroups: SeatGroups | None = None  # rt.device_mesh's groups and the script's own, once it made one
        self.decisions: Decisions | None = None  # DTensor's sharding decisions over rt.device_mesh
        self.last_rebuild = Rebuilt()  # what the newest view change did to the mesh groups

    # -- the group ----------------------------------------------------------------------------

    def configure(self, view: View, seat: int) -> None:
        """Retire the current group and build `view`'s, on a fresh store connection.

        A fresh connection per build: an abandoned build may still block in a store call on the old one.

        Raises:
            CollectiveAborted: interrupted by a view newer than `view`, or a peer died meanwhile.
            WaitTimeout: the group did not form in time.
        """
        self.retire()
        store = self._builder.connect(view)  # the job's group and then the default group; mesh groups get their own
        build = self._builder.for_view(view)
        if self.subgroups is None:
            self.group = build(view.store_prefix, seat, view.world_size, store)
        else:  # the job's group forms while the subgroups do
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deadpool-group") as pool:
                group = pool.submit(build, view.store_prefix, seat, view.world_size, store)
                try:
                    self.last_rebuild = self.subgroups.configure(view, build)
                finally:
                    self.group = group.result()
        # torch's default group is the script's way onto this group: registered once seated, kept across views.
        default.configure(self, seat, view.world_size, PrefixStore(f"{view.store_prefix}/default_pg", store))
        pipelining.rebuilt(self)

    def seat_mesh(self, shape: Sequence[int], names: Sequence[str], view: View, seat: int,
                  first: bool, device_type: str = "cpu") -> DeviceMesh:
        """This seat's mesh in `view`, with torch's default group (a DeviceMesh needs one) installed.

        `first`: the job's first view, which the seat takes without a restore: its groups are built
        now, for the collectives of the script's wrapping (``parallelize_module`` scatters).  A
        seat that will restore (a spare) gets its groups when it adopts the view; until then its
        collectives complete locally (what they compute is overwritten by the restore).

        Raises:
            MisuseError: the shape does not cover the view's seats.
        """
        subgroups = self._seat_subgroups(view, seat)
        mesh = subgroups.add_mesh(shape, names, view.world_size, device_type)
        self.decisions = Decisions(mesh)
        if first:
            self._first_build(subgroups, view)
        return mesh

    def seat_group(self, seats: Sequence[int], name: str, view: View, seat: int, first: bool) -> MeshGroup:
        """The script's own group over `seats` (``dist.new_group``), which holds `seat`: built now in the first
        view (its seats all make it at the same point of their scripts), at the adoption otherwise; rebuilt
        like a mesh dimension's."""
        subgroups = self._seat_subgroups(view, seat)
        group = subgroups.add(MeshDim("group", name, tuple(seats), own=True))
        if first:
            self._first_build(subgroups, view)
        return group

    def _first_build(self, subgroups: SeatGroups, view: View) -> None:
        """Build the first view's groups for the script's wrapping; a failure meanwhile (a seat lost at start-up)
        leaves them unbuilt: the wrapping completes locally, and ``rt.steps()`` adopts the view that repairs it,
        from the initial state."""
        self.fault_point(ChaosPoint.GROUPS)
        try:
            self.last_rebuild = subgroups.configure(view, self._builder.for_view(view))
        except (CollectiveAborted, WaitTimeout) as err:
            log.warning("the first view's mesh groups did not form (%s): the script's wrapping completes on this "
                        "seat alone, and the seat starts from its initial state once the view is repaired", err)

    def _seat_subgroups(self, view: View, seat: int) -> SeatGroups:
        if self.subgroups is None:
            self.seat_default_group(view, seat)
            self.subgroups = SeatGroups(seat, self)
        return self.subgroups

    def seat_default_group(self, view: View, seat: int) -> None:
        """Install torch's default group for `seat` before `view` is adopted (its collectives complete locally
        until then): what a parallel wrapper built before the first step needs (a DeviceMesh, ZeRO)."""
        default.configure(self, seat, view.world_size,
                          PrefixStore(f"{view.store_prefix}/default_pg", self._builder.connect(view)))

    def usable(self, communicator: Any) -> bool:
        return self.communicators.usable(communicator)

    def retired(self, communicator: Any) -> None:
        self.communicators.retire(communicator)

    def retire(self) -> None:
        """Set the current group aside without destroying it: destroying a group with an op in flight
        blocks until the op times out, and gloo aborts the process if it is destructed later."""
        if self.group is not None:
            GUARD.retire(self.group)
            self.communicators.retire(self.group)
        self.group = None

    def poison(self, err: BaseException) -> None:
        """Mark the step as lost; tell the coordinator unless it is the one that interrupted us."""
        state = self._state
        state.poison = str(err)
        self.retire()
        if isinstance(err, CollectiveAborted) and err.interrupted:
            return
        self._events.emit(schema.CollectiveFailed(epoch=state.epoch, rank=state.rank, step=state.step, error=str(err)))
        self._handoff.post(CollectiveFailed(self._member, state.epoch, state.step, str(err)[:500]))

    # -- StepCollectives (rt.ddp) -------------------------------------------------------------

    @property
    def world_size(self) -> int:
        view = self._state.view
        return view.world_size if view else 1

    def fault_point(self, point: ChaosPoint) -> None:
        self._faults.point(point)

    def packed_gradient(self, flat: torch.Tensor) -> None:
        state = self._state
        self._faults.corrupt(Corrupted.GRAD, state.step, lambda: ("rt.ddp gradient bucket", flat))
        if self.digesting:
            self._audited.append(checksum([flat.detach().reshape(-1).view(torch.uint8).cpu().numpy()]))

    def local_only(self) -> bool:
        return self._state.auditing

    def digest_step(self, on: bool) -> None:
        """Whether the step beginning digests its gradient buckets (an audit step: ``protocol/audits.py``)."""
        self.digesting, self._audited = on, []

    def take_audit_digest(self) -> int | None:
        """The checksum of the gradient buckets packed in the step, in order (None: none was)."""
        pieces, self._audited = self._audited, []
        if not pieces:
            return None
        return checksum([np.array(pieces, dtype=np.uint64).view(np.uint8)])

    def step_lost(self) -> bool:
        """The step in progress is lost: poisoned, or a view change is being prepared (it is poisoned then, so
        that a step cut short this way never counts, even for a planned move's Prepare)."""
        if self._state.poison is None and self._handoff.interrupted(self._state.epoch):
            self._state.poison = "a view change is being prepared"
        return self._state.poison is not None

    def issue_allreduce(self, flat: torch.Tensor) -> dist.Work | None:
        """Start the sum of one gradient bucket on the view's group (``rt.ddp``, during backward).

        The first bucket of a step runs the pre-step gate first: no seat joins a step's
        all-reduce before its previous snapshot is confirmed.  Returns None when the step
        is poisoned or there is no group: the caller issues nothing more for this backward.
        """
        if self._state.auditing or not self._gate() or self.group is None or self._state.view is None:
            return None
        try:
            work: dist.Work = self.group.allreduce([flat])
        except RuntimeError as err:
            self.poison(err)
            return None
        return work

    def await_allreduces(self, works: Sequence[dist.Work]) -> bool:
        """End of backward: wait for every bucket's all-reduce, interruptibly.

        Returns False when they were abandoned (the step is poisoned): an abandoned
        operation may still complete later (a SIGSTOPped peer resumes) and write into
        its buffer, so the caller must not reuse those buffers.
        """
        if self._state.auditing:
            return False  # nothing was issued: the local gradients stay as they are
        self._faults.point(ChaosPoint.ALLREDUCE)
        try:
            for work in works:
                self._waiter.wait(work, f"gradient all-reduce of step {self._state.step}", self._timeout)
        except (CollectiveAborted, RuntimeError) as err:
            self.poison(err)
            return False
        return True

    def broadcast_buffers(self, flat: torch.Tensor) -> bool:
        """``rt.ddp``'s module buffers from seat 0, after a forward that all-reduces its backward.

        `flat` is a fresh buffer (an abandoned broadcast may still complete into it later);
        the caller copies it into the live buffers only when this returns True.
        """
        if self._state.poison is not None or self.group is None or self._state.auditing:
            return False
        options = BroadcastOptions()
        options.rootRank = 0
        return self._run(lambda group: group.broadcast([flat], options), f"buffer broadcast of step {self._state.step}")

    def abandons_backward(self) -> bool:
        """A mesh collective of this seat's backward is about to be issued: True when the step is lost and the
        step issued no backward collective yet, so that the backward stops here (as does any later backward of
        the step) and every later collective of the step completes locally (``abandoned``).  A seat that issued
        one first runs its step to its end; a wait on a peer that stopped ends at that peer's ``PeerPaused``
        (why this is safe: docs/design/groups.md)."""
        state = self._state
        if state.backward_issued or state.abandoned:
            return state.abandoned
        if self.step_lost() and dtensors.fsdp_resets():
            state.abandoned = True
        else:
            state.backward_issued = True
        return state.abandoned

    def abandoned(self) -> bool:
        """This seat stopped the lost step's forward or backward: the step's remaining mesh collectives complete
        locally (a backward's first one stops that backward, ``abandons_backward``)."""
        return self._state.abandoned or self._state.forward_abandoned

    def abandon_forward(self) -> None:
        """This seat stopped the lost step's forward (``lost_step.AbandonableForward``): it issues no further
        collective of the step, and its pause notice ends its mesh peers' waits on it (``PeerPaused.in_forward``)."""
        self._state.forward_abandoned = True

    def wait_bounded(self, work: dist.Work, what: str, seats: Sequence[int]) -> None:
        """A mesh group's collective: waited on until it completes, fails or times out, a Prepare declares
        one of the group's `seats` dead, or one of them paused for a Prepare before this step (``PeerPaused``:
        a seat sharing no group with the dead one may run ahead into the next step) or, for a collective past
        this step's forward, after abandoning this step's backward (``abandons_backward``). A Prepare for other
        seats does not cut it short: the group's seats all issue it, so it completes (a seat of the dead
        one's group may wait on it without a direct connection, so gloo would not fail it before its timeout).
        Before the first step (the script's wrapping) any newer Prepare cuts it short: a peer whose first groups
        did not form completes its wrapping alone and never issues it, and every seat starts again from the
        initial state anyway.

        Raises:
            CollectiveAborted: it failed, timed out, or lost a seat.
        """
        state, handoff = self._state, self._handoff
        epoch, step = state.epoch, state.step
        members = [state.view.seats[seat] for seat in seats] if state.view is not None else []
        past_forward = state.backward_issued or in_backward()  # a collective no seat that abandoned this step issues
        waiter = Waiter(handoff.condition, lambda: handoff.lost_any(epoch, seats) or
                        handoff.peer_stopped_before(epoch, members, step, past_forward) or
                        (step < 0 and handoff.interrupted(epoch)), self.waits)
        waiter.wait(work, f"{what} (step {self._state.step})", self._timeout)

    # -- the script's own collectives (torch's default group, groups.py) ------------------------

    def issue_user(self, issue: Callable[[Any], dist.Work], point: ChaosPoint) -> dist.Work | None:
        """Start one of the script's collectives on the view's group: `issue(group)`, then the chaos `point`.

        None when the step is poisoned or the seat has no group: the caller completes the
        collective locally (the step is rolled back anyway).

        Raises:
            MisuseError: the seat has adopted no view yet (before the loop): the result would be this seat's alone.
        """
        if self._state.view is None:
            raise MisuseError(
                "a collective on torch's default group before the loop over rt.steps(): its communicator is built "
                "when the loop starts (a spare has no seat before it), so it would complete on this seat alone. "
                "Do it inside the loop (its first step), take the value from rt (rank, world_size), or load a "
                "torch.distributed.checkpoint with no_dist=True")
        if self._state.poison is not None or self.group is None:
            return None
        try:
            work = issue(self.group)
        except RuntimeError as err:
            self.poison(err)
            return None
        self._faults.point(point)
        return work

    def await_user(self, work: dist.Work, what: str) -> bool:
        """Wait for a collective `issue_user` started, interruptibly; False when the step is poisoned."""
        try:
            self._waiter.wait(work, f"{what} of step {self._state.step} (the script's, on the default group)",
                              self._timeout)
        except (CollectiveAborted, RuntimeError) as err:
            self.poison(err)
            return False
        return True

    # -- the other collectives of a seat ------------------------------------------------------

    def _run(self, issue: Callable[[Any], dist.Work], what: str) -> bool:
        """Issue a collective on the current group and wait for it; False (the step poisoned) when it failed."""
        try:
            work = issue(self.group)
            self._waiter.wait(work, what, self._timeout)
        except (CollectiveAborted, RuntimeError) as err:
            self.poison(err)
            return False
        return True

    def exchange_digests(self, gathered: list[torch.Tensor], mine: torch.Tensor) -> bool:
        """Every seat's final digest into `gathered`; False (the step poisoned) when the exchange failed."""
        return self._run(lambda group: group.allgather([gathered], [mine]), "final digest exchange")

    def allgather(self, outputs: list[torch.Tensor], tensor: torch.Tensor, what: str, epoch: int) -> None:
        """All-gather on the current group, waited on until it completes or a view newer than `epoch` comes.

        Raises:
            CollectiveAborted: a peer failed, the bound expired, or a newer view interrupted it.
        """
        self._adopting(lambda group: group.allgather([outputs], [tensor]), what, epoch)

    def barrier(self, what: str, epoch: int) -> None:
        """Wait until every seat of the current group got here (a one-element all-reduce), or a newer view comes.

        Raises:
            CollectiveAborted: a peer failed, the bound expired, or a newer view interrupted it.
        """
        self._adopting(lambda group: group.allreduce([torch.zeros(1)]), what, epoch)

    def broadcast_adopting(self, flat: torch.Tensor, what: str, epoch: int) -> None:
        """Seat 0's `flat` to every seat of the group being adopted (``_adopting``)."""
        options = BroadcastOptions()
        options.rootRank = 0
        self._adopting(lambda group: group.broadcast([flat], options), what, epoch)

    def _adopting(self, issue: Callable[[Any], dist.Work], what: str, epoch: int) -> None:
        """A collective of an adoption: on the current group, waited on until done or a view newer than `epoch`.

        Raises:
            CollectiveAborted: a peer failed, the bound expired, or a newer view interrupted it.
        """
        try:
            work = issue(self.group)
        except RuntimeError as err:
            raise CollectiveAborted(what, str(err)) from err
        waiter = Waiter(self._handoff.condition, lambda: self._handoff.interrupted(epoch), self.waits)
        waiter.wait(work, what, self._timeout)
