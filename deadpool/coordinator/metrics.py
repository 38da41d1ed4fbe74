"""Prometheus metrics of a job, served by the coordinator (``--metrics-port``).

Counters and histograms follow the coordinator's events as they are emitted (an
``EventLog`` listener reading them as ``deadpool.events.summary`` facts, so no event is
missed between scrapes); gauges are refreshed from its status document on its own event
loop every second.  The HTTP server binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from deadpool.events import schema, summary

log = logging.getLogger("deadpool.coordinator.metrics")

# Detection takes milliseconds (an exit, a reset socket) to failure_timeout (a hang); recovery adds
# a snapshot transfer and a group rebuild.
TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


def _label(name: str) -> str:
    """A label value from a fact's name field; ``unknown`` where the record did not give one."""
    return name if name and name != summary.UNKNOWN else "unknown"


class CoordinatorMetrics:
    """The coordinator's metrics; `on_event` is an ``EventLog`` listener, `refresh` takes a status document."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.epoch = Gauge("deadpool_epoch", "Epoch of the newest committed view", registry=r)
        self.world_size = Gauge("deadpool_world_size", "Seats in the job", registry=r)
        self.members = Gauge("deadpool_members", "Members seated in the current view and not fenced", registry=r)
        self.spares = Gauge("deadpool_spares", "Spares waiting in the pool of the current view", registry=r)
        self.fenced = Gauge("deadpool_fenced_members", "Members declared dead so far (never readmitted)",
                            registry=r)
        self.view_change = Gauge("deadpool_view_change_in_progress", "1 between a Prepare and its commit",
                                 registry=r)
        self.step = Gauge("deadpool_step", "Last finished step per seat (from heartbeats)", ["rank"], registry=r)
        self.heartbeat_age = Gauge("deadpool_heartbeat_age_seconds", "Seconds since a seat's member was last heard",
                                   ["rank"], registry=r)
        self.stall = Gauge("deadpool_snapshot_stall_p99_seconds",
                           "p99 of the pre-step wait for the snapshot copy, per seat (the only compute stall)",
                           ["rank"], registry=r)
        self.slowness = Gauge("deadpool_seat_slowness",
                              "A seat's compute time (its step less its collective waits) over the job's median",
                              ["rank"], registry=r)
        self.snapshot_lag = Gauge("deadpool_snapshot_confirmed_lag_steps",
                                  "Steps between a seat's last finished step and its buddy-confirmed snapshot",
                                  ["rank"], registry=r)
        self.failures = Counter("deadpool_failures", "Members declared dead, by detector", ["detected_by"],
                                registry=r)
        self.corruptions = Counter("deadpool_sdc_detected", "Seats found holding silently corrupted state, by "
                                   "detector (sdc_confirmed)", ["detector"], registry=r)
        self.swaps = Counter("deadpool_swaps", "Seats refilled by a spare (swap_completed)", registry=r)
        self.views = Counter("deadpool_views_committed", "Views committed", registry=r)
        self.chaos = Counter("deadpool_chaos_injected", "Operator chaos actions carried out", ["action"], registry=r)
        self.rejected = Counter("deadpool_rejected_messages", "Messages the coordinator dropped, by reason",
                                ["reason"], registry=r)
        self.detection = Histogram("deadpool_detection_seconds",
                                   "Injected failure to member_failed (known only when the failure was injected)",
                                   buckets=TIME_BUCKETS, registry=r)
        self.recovery = Histogram("deadpool_recovery_seconds",
                                  "Failure to the new member's first finished step in the seat",
                                  buckets=TIME_BUCKETS, registry=r)
        self._server: Any = None
        self.url = ""  # where /metrics is served, once started
        self._ranks: set[str] = set()

    # -- events ---------------------------------------------------------------------------------

    def on_event(self, record: schema.EventRecord) -> None:
        """Count one event; never raises, since it runs inside the coordinator's ``emit``."""
        if isinstance(record, schema.SdcConfirmed):
            self.corruptions.labels(_label(record.detector)).inc()
        match summary.parse(record):
            case summary.Failure() as failure:
                self.failures.labels(_label(failure.detected_by)).inc()
                if failure.detection_s is not None and failure.detection_s >= 0:
                    self.detection.observe(failure.detection_s)
            case summary.Swap() as swap:
                self.swaps.inc()
                if swap.recovery_s is not None and swap.recovery_s >= 0:
                    self.recovery.observe(swap.recovery_s)
            case summary.ViewCommit() as view:
                self.views.inc()
                self.epoch.set(float(view.epoch or 0))
                if view.spares is not None:
                    self.spares.set(len(view.spares))
            case summary.ChaosInjection() as chaos:
                self.chaos.labels(_label(chaos.action)).inc()
            case summary.Rejection() as rejection:
                self.rejected.labels(_label(rejection.reason)).inc()

    # -- status ---------------------------------------------------------------------------------

    def refresh(self, status: dict[str, Any]) -> None:
        """Set the gauges from a ``Coordinator.status()`` document; seats that left are removed."""
        self.epoch.set(float(status.get("epoch", 0)))
        self.world_size.set(float(status.get("world_size", 0)))
        seats = [s for s in status.get("seats", []) if isinstance(s, dict)]
        self.members.set(sum(1 for s in seats if s.get("state") == "active"))
        self.spares.set(len(status.get("spares", [])))
        self.fenced.set(len(status.get("fenced", [])))
        self.view_change.set(1 if status.get("round") else 0)
        ranks: set[str] = set()
        for seat in seats:
            rank = str(seat.get("rank"))
            ranks.add(rank)
            step = int(seat.get("step", -1))
            self.step.labels(rank).set(step)
            age = seat.get("heartbeat_age_s")
            if isinstance(age, (int, float)):
                self.heartbeat_age.labels(rank).set(age)
            self.stall.labels(rank).set(float(seat.get("stall_p99_s", 0.0)))
            if isinstance(slowness := seat.get("slowness"), (int, float)):
                self.slowness.labels(rank).set(slowness)
            confirmed = int(seat.get("confirmed_step", -2))
            if step >= 0 and confirmed >= 0:
                self.snapshot_lag.labels(rank).set(step - confirmed)
        for gone in self._ranks - ranks:
            for gauge in (self.step, self.heartbeat_age, self.stall, self.slowness, self.snapshot_lag):
                try:
                    gauge.remove(gone)
                except KeyError:
                    pass
        self._ranks = ranks

    async def refresh_forever(self, status: Callable[[], dict[str, Any]], interval: float = 1.0) -> None:
        """Refresh the gauges every `interval` seconds on the caller's loop, until cancelled."""
        while True:
            try:
                self.refresh(status())
            except (TypeError, ValueError, KeyError) as err:
                log.warning("metrics: status refresh failed: %s", err)
            await asyncio.sleep(interval)

    # -- HTTP -----------------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve ``/metrics`` from a daemon thread; returns its URL (port 0 picks a free port).

        Raises:
            OSError: the address cannot be bound (in use, not local).
        """
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.url = f"http://{host}:{server.server_port}/metrics"
        return self.url

    def stop(self) -> None:
        """Stop serving; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
