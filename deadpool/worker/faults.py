"""Fault injection on the compute side: this process's ``--chaos`` specs, fired at the points of a step.

The specs are data (``deadpool.chaos``); this is where the compute thread
meets them.  Without a spec for this process every point returns at once, so
a job without ``--chaos`` pays one attribute test per point and nothing more.
"""

from __future__ import annotations

import logging
import time

from deadpool import chaos
from deadpool.actors.handoff import Handoff
from deadpool.chaos import ChaosAction, ChaosPlan, ChaosPoint, Switch
from deadpool.config import WorkerEnv
from deadpool.events.catalogue import Event
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
        state = self._state
        spec = self._plan.due(point, state.step if step is None else step)
        if spec is None:
            return
        self._handoff.post(ChaosInjected(self._member, spec.action, state.rank, state.step, time.time()))
        if not self._handoff.flush(REPORT_FLUSH_S):
            log.warning("chaos %s: the report was not handed to the transport within %.1fs; injecting anyway",
                        spec, REPORT_FLUSH_S)
        time.sleep(REPORT_LINGER_S)
        # The event is the injection's timestamp (what recovery times count from): taken once the report is
        # out, as the signal goes, not before the report's hand-over, which only an injected failure waits for.
        self._events.emit(Event.CHAOS_INJECTED, action=spec.action, at=point, spec=str(spec),
                          epoch=state.epoch, rank=state.rank, step=state.step)
        chaos.inject(spec, self._partition)

    def spare_point(self, elapsed: float, wait: float) -> float:
        """A spare waiting for a seat, `elapsed` seconds in: fire a spec now due; returns how long it may wait."""
        if not self.armed:
            return wait
        due = self._plan.next_spare_deadline()
        if due is not None:
            wait = max(0.01, min(wait, due - elapsed))
        spec = self._plan.spare_due(elapsed)
        if spec is not None:
            self._events.emit(Event.CHAOS_INJECTED, action=spec.action, spec=str(spec), rank=-1)
            chaos.inject(spec, self._partition)
        return wait
