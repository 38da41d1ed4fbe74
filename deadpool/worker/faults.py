"""Fault injection on the compute side: this process's ``--chaos`` specs, fired at the points of a step.

The specs are data (``deadpool.chaos``); this is where the compute thread
meets them.  Without a spec for this process every point returns at once, so
a job without ``--chaos`` pays one attribute test per point and nothing more.
An armed process also notes the points its first step passes: a spec whose
point that step did not pass (``at=backward`` on an FSDP2 script) is warned
about then (``chaos_point_unseen``), not only at the end of the run.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import torch

from deadpool import chaos
from deadpool.actors.handoff import Handoff
from deadpool.chaos import ChaosAction, ChaosPlan, ChaosPoint, ChaosSpec, Corrupted, Switch
from deadpool.config import WorkerEnv
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.protocol.messages import ChaosInjected
from deadpool.worker.step import StepState

log = logging.getLogger("deadpool")

# How long a point waits for the runtime thread to hand the ChaosInjected report to the transport
# before the signal lands (a kill would otherwise take the report with it).
REPORT_FLUSH_S = 1.0
# ZeroMQ writes from its own I/O thread: a report handed over just before a SIGKILL can die with the process,
# and the coordinator keys the repair's ``at=recovery`` point on it (Prepare.failure_step). A moment's grace
# lets it leave first; the injection's timestamp is taken after it.
REPORT_LINGER_S = 0.05


class FaultInjector:
    """Fires each of this process's specs once, at its point and step (or, for a spare, after its delay)."""

    def __init__(
        self, env: WorkerEnv, state: StepState, handoff: Handoff, events: EventLog, partition: Switch,
    ) -> None:
        self._plan = ChaosPlan(list(env.chaos), env.initial_rank, env.spare_index)
        self.armed = any(self._plan.declares(action) for action in ChaosAction)  # False: every point is a no-op
        self._member = env.member
        self._state = state
        self._handoff = handoff
        self._events = events
        self._partition = partition
        self._slow_factor = 0.0  # a fired slow: spec's factor (0: none)
        self._slow_base: float | None = None  # the compute time it multiplies, fixed when the slowdown began
        # The points the steps passed until the end of this member's first finished one (None: not noting any more).
        self._seen: set[ChaosPoint] | None = set() if self.armed else None

    @staticmethod
    def partitions(env: WorkerEnv) -> bool:
        """Whether a ``partition:`` spec names this process (its transports must then be cuttable)."""
        return ChaosPlan(list(env.chaos), env.initial_rank, env.spare_index).declares(ChaosAction.PARTITION)

    def point(self, point: ChaosPoint, step: int | None = None) -> None:
        """Fire the spec due at `point` of `step` (default: the step in progress), if there is one.

        The report (event and ChaosInjected) goes out before the failure lands; a
        ``stop:`` spec returns once the process is continued.
        """
        if not self.armed:
            return
        if self._seen is not None and self._state.step >= 0:  # a step's points, not start-up's
            self._seen.add(point)
        state = self._state
        spec = self._plan.due(point, state.step if step is None else step)
        if spec is None:
            return
        self._report(spec)
        if not self._handoff.flush(REPORT_FLUSH_S):
            log.warning("chaos %s: the report was not handed to the transport within %.1fs; injecting anyway",
                        spec, REPORT_FLUSH_S)
        time.sleep(REPORT_LINGER_S)
        # The event is the injection's timestamp (what recovery times count from): taken once the report is
        # out, as the signal goes, not before the report's hand-over, which only an injected failure waits for.
        self._events.emit(schema.ChaosInjected(action=spec.action, at=point, spec=str(spec),
                          epoch=state.epoch, rank=state.rank, step=state.step))
        if spec.action is ChaosAction.SLOW:
            self._slow_factor = spec.factor  # from now on: every step's start (slowdown)
            return
        chaos.inject(spec, self._partition)

    def _report(self, spec: ChaosSpec) -> None:
        """Tell the coordinator what is injected now (it times the detection from it)."""
        self._handoff.post(ChaosInjected(self._member, spec.action, self._state.rank, self._state.step, time.time()))

    def corrupt(self, what: Corrupted, step: int, target: Callable[[], tuple[str, torch.Tensor] | None]) -> None:
        """Flip the bit a ``corrupt:`` spec for `what` names, if one is due at `step`, in the tensor `target` gives
        (its name and the tensor): silent data corruption, nothing crashes."""
        if not self.armed:
            return
        spec = self._plan.corrupt_due(what, step)
        if spec is None:
            return
        found = target()
        state = self._state
        if found is None:
            log.warning("chaos %s: this seat has no %s tensor to corrupt at step %d", spec, what, step)
            return
        name, tensor = found
        flip_bit(tensor, spec.bit)
        self._report(spec)
        self._events.emit(schema.ChaosInjected(action=spec.action, at=str(what), spec=str(spec), tensor=name,
                          epoch=state.epoch, rank=state.rank, step=step))

    def slowdown(self, compute_s: float) -> float:
        """Seconds this step's start sleeps under a ``slow:`` spec that fired: (factor - 1) times the compute time
        of a step before the slowdown (`compute_s`, the median of recent steps, taken at the first call)."""
        if not self._slow_factor:
            return 0.0
        if self._slow_base is None:
            self._slow_base = compute_s
        return (self._slow_factor - 1) * self._slow_base

    def first_step_done(self, step: int) -> None:
        """End of this member's first finished step: each spec still to fire whose point the step did not pass
        gets a ``chaos_point_unseen`` event and a line on stderr, so the operator learns at the start of the run
        that it will likely never fire (the launch would end with ``NOT_FIRED_STATUS``)."""
        seen, self._seen = self._seen, None
        if seen is None:
            return
        passed = [point for point in chaos.POINTS if point in seen]
        for spec in chaos.unseen(self._plan.pending(), seen, step):
            self._events.emit(schema.ChaosPointUnseen(spec=str(spec), at=spec.at, seen=[str(point) for point in passed],
                              epoch=self._state.epoch, rank=self._state.rank, step=step))
            # On stderr whatever the script's logging: the operator must see it while the run can still be stopped.
            print(f"deadpool: warning: chaos spec {spec} will likely never fire: this member's first step (step "
                  f"{step}) passed no {spec.at} point ({chaos.WHERE[spec.at]}); it passed "
                  f"{', '.join(passed) or 'none'}. If it does not fire, the launch exits with status "
                  f"{chaos.NOT_FIRED_STATUS}",
                  file=sys.stderr, flush=True)

    def spare_point(self, elapsed: float, wait: float) -> float:
        """A spare waiting for a seat, `elapsed` seconds in: fire a spec now due; returns how long it may wait."""
        if not self.armed:
            return wait
        due = self._plan.next_spare_deadline()
        if due is not None:
            wait = max(0.01, min(wait, due - elapsed))
        spec = self._plan.spare_due(elapsed)
        if spec is not None:
            self._events.emit(schema.ChaosInjected(action=spec.action, spec=str(spec), rank=-1))
            chaos.inject(spec, self._partition)
        return wait


def flip_bit(tensor: torch.Tensor, bit: int) -> None:
    """Flip `bit` (0..31) of the 32-bit little-endian word in the middle of `tensor`'s bytes, in place, outside
    autograd (a tensor of under 4 bytes: that bit modulo 8 of its first byte)."""
    data = tensor.detach().reshape(-1).view(torch.uint8)
    words = data.numel() // 4
    index = (words // 2) * 4 + bit // 8 if words else 0
    data[index] ^= 1 << (bit % 8)
