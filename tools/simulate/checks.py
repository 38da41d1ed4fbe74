"""The simulation's invariant checks and its metrics.

Checked as the run goes, each breach counted in ``invariant_violations``: at most
one committed view per epoch, epochs strictly increasing, no fenced member seated
(or spare) in a committed view, every view sent (whole, a delta, a piece) carrying the one view
committed for its epoch, no message from a fenced member changing coordinator
state; at the end, every failure swapped or reported as a job failure, and a job
failure only where a fault forced it (no spare left for a lost seat).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from deadpool.config import Config
from deadpool.coordinator.service import Coordinator
from deadpool.events import schema
from deadpool.events.vocabulary import Trigger
from deadpool.protocol.messages import AckBatch, HeartbeatBatch, HostHeartbeat, Message

from .cluster import Failure, SimConfig

REAL_TIME_KEYS: tuple[str, ...] = (
    "wall_s",
    "cpu_handle_s_per_s",
    "cpu_tick_s_per_s",
    "cpu_tick_ms",
    "cpu_startup_s",
    "cpu_stall_s_max",
    "cpu_view_change_s_max",
    "cpu_total_s",
    "coordinator_cpu_s_per_s",
)
"""Metrics measured in real time: they differ between runs of the same seed."""

MAX_VIOLATIONS_LISTED = 20


class Observed(Protocol):
    """What the checker reads of the run (implemented by the simulation loop)."""

    @property
    def tick(self) -> int:
        """The current tick."""

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator under test."""

    def now(self) -> float:
        """Virtual seconds."""

    def healthy(self, member: str) -> bool:
        """The member runs and no failure was injected into it."""


@dataclass
class Costs:
    """What the coordinator process spent and sent, measured by the loop (CPU figures are real time)."""

    bytes_out: int = 0  # every frame the coordinator sent
    view_frame_bytes: int = 0  # the largest CommitView frame
    max_frame_bytes: int = 0  # the largest frame the coordinator sent
    dropped_oversize: int = 0  # frames members refused for the control-frame limit
    steady_msgs: int = 0  # messages handled in the steady window
    steady_handle_cpu: float = 0.0
    steady_tick_cpu: float = 0.0
    total_cpu: float = 0.0
    stall_cpu_max: float = 0.0  # the most CPU of one tick
    startup_cpu: float | None = None  # coordinator CPU until the first view was committed
    view_change_cpu_max: float = 0.0  # the most CPU of one tick that prepared or committed a view
    inbound: dict[type, int] = field(default_factory=dict)  # messages the coordinator handled, by type


class Checker:
    """The invariants, checked at the moment things happen, and the counts the metrics report."""

    def __init__(self, run: Observed) -> None:
        self._run = run
        self.violations: list[str] = []
        self.violation_count = 0
        self.commits: list[tuple[int, int, list[str], list[str]]] = []  # (epoch, tick, seats, spares)
        self.failed_tick: dict[str, int] = {}  # member -> tick it was declared dead
        self.view_change_tick = False  # this tick prepared or committed a view
        self._view_digests: dict[int, bytes] = {}
        self._false_positives = 0
        self._fenced_rejections = 0
        self._spurious_rebuilds = 0
        self._swaps = 0

    def violation(self, text: str) -> None:
        self.violation_count += 1
        if len(self.violations) < MAX_VIOLATIONS_LISTED:
            self.violations.append(f"t={self._run.now():.2f}s {text}")

    def on_line(self, line: bytes) -> None:
        """One line of the coordinator's events, the moment it is written (state is exactly as it was then).

        Read through the event schema, as ``deadpool events`` reads a file.

        Raises:
            SchemaError: the line does not match its kind's schema.
        """
        self.on_event(schema.decode(line, "the coordinator's events"))

    def on_event(self, record: schema.Line) -> None:
        """One typed coordinator event (see :meth:`on_line`)."""
        match record:
            case schema.ViewCommitted(epoch=int() as epoch):
                self.view_change_tick = True
                self._check_commit(epoch, record.seats, record.spares)
            case schema.ViewPrepared():
                self.view_change_tick = True
                if record.trigger is Trigger.BLIND_REBUILD:
                    self._spurious_rebuilds += 1  # a CollectiveFailed named nobody dead
            case schema.MemberFailed(member=str() as member):
                self.failed_tick.setdefault(member, self._run.tick)
                if self._run.healthy(member):
                    self._false_positives += 1  # declared dead while it was healthy
            case schema.Rejected() if record.fenced_peer:
                self._fenced_rejections += 1
            case schema.SwapCompleted():
                self._swaps += 1

    def _check_commit(self, epoch: int, seats: list[str], spares: list[str]) -> None:
        """One view per epoch, epochs growing, nobody fenced in it (checked at the moment of the commit)."""
        if any(epoch == e for e, *_ in self.commits):
            self.violation(f"epoch {epoch} committed twice")
        elif self.commits and epoch <= self.commits[-1][0]:
            self.violation(f"epoch {epoch} committed after epoch {self.commits[-1][0]}")
        fenced = self._run.coordinator.fenced
        bad = [m for m in [*seats, *spares] if m in fenced]
        if bad:
            self.violation(f"view {epoch} contains fenced member(s) {bad[:3]}")
        self.commits.append((epoch, self._run.tick, seats, spares))

    def check_view_sent(self, epoch: int, digest: bytes) -> None:
        """A view sent this tick (whole, a delta or a piece) carries the one view committed for its epoch."""
        if self._view_digests.setdefault(epoch, digest) != digest:
            self.violation(f"two different views sent for epoch {epoch}")
        if not any(epoch == e for e, *_ in self.commits):
            self.violation(f"CommitView for epoch {epoch}, which was never committed")

    def fenced_state(self, message: Message) -> list[tuple[str, tuple[Any, ...]]]:
        """For each fenced member a message speaks for: the coordinator state it must not change."""
        if isinstance(message, HeartbeatBatch):
            senders = [beat.sender for beat in message.beats]
        elif isinstance(message, AckBatch | HostHeartbeat):
            senders = message.members
        else:
            sender = getattr(message, "sender", None)
            senders = [sender] if isinstance(sender, str) else []
        fenced = self._run.coordinator.fenced
        return [(m, self._member_state(m)) for m in senders if m in fenced]

    def _member_state(self, member: str) -> tuple[Any, ...]:
        coordinator = self._run.coordinator
        record = coordinator.members.get(member)
        rnd = coordinator.round
        acked = rnd is not None and member in rnd.acks
        if record is None:
            return (None, acked)
        return (record.last_seen, record.step, record.epoch, record.snapshot_step, acked)

    def check_fenced(self, before: list[tuple[str, tuple[Any, ...]]]) -> None:
        for member, state in before:
            if self._member_state(member) != state:
                self.violation(f"a message from fenced member {member} changed coordinator state")

    def _check_failure_forced(self, reason: str) -> None:
        """A failed job is an allowed outcome only where a fault forces it: no spare left for a lost seat.

        The simulator never strikes a seat's buddy while that seat awaits its swap, so a seat and
        its only copy are never lost together; with spares left the job must go on.
        """
        coordinator = self._run.coordinator
        view = coordinator.view
        if view is None:
            return  # before the first view a lost seat fails the job: no snapshot exists yet
        spares = [s for s in view.spares if s not in coordinator.fenced and self._run.healthy(s)]
        lost = [m for m in view.seats if m in coordinator.fenced]  # seats awaiting a spare
        if len(spares) >= len(lost):
            self.violation(f"the job failed with {len(spares)} healthy spare(s) left and no seat's copy lost: "
                           f"{_shorten(reason, 200)}")

    def metrics(self, cfg: SimConfig, coordinator_config: Config, failures: list[Failure], costs: Costs,
                steady: tuple[int, int], wall_s: float) -> dict[str, Any]:
        """The run's result (the last checks included: every failure detected and resolved)."""
        tick_s = cfg.tick
        outcome = self._run.coordinator.outcome
        fired = [f for f in failures if f.member]
        detect: list[float] = []
        change: list[float] = []
        for failure in fired:
            failed = self.failed_tick.get(failure.member)
            if failed is None:
                if outcome is None or outcome[0]:
                    self.violation(f"failure of {failure.member} was never detected")
                continue
            detect.append((failed - failure.fired_tick) * tick_s)
            removed = next((t for _, t, seats, spares in self.commits
                            if t >= failed and failure.member not in seats and failure.member not in spares), None)
            if removed is not None:
                change.append((removed - failed) * tick_s)
            elif outcome is None or outcome[0]:
                self.violation(f"failure of {failure.member} was neither swapped nor reported as a job failure")
        if outcome is not None and not outcome[0]:
            self._check_failure_forced(outcome[1])
        steady_ticks = steady[1] - steady[0]
        steady_s = steady_ticks * tick_s
        return {
            "members": cfg.members,
            "seats": cfg.seats,
            "spares": cfg.spares,
            "failures": cfg.failures,
            "failures_injected": len(fired),
            "seed": cfg.seed,
            "aggregate": cfg.aggregate,
            "heartbeat_interval": cfg.heartbeat_interval,
            "failure_timeout": coordinator_config.failure_timeout,
            "virtual_s": round(self._run.tick * tick_s, 3),
            "views_committed": len(self.commits),
            "invariant_violations": self.violation_count,
            "violations": list(self.violations),
            "detect_s_p50": _p50(detect),
            "detect_s_max": _round(max(detect, default=None)),
            "view_change_s_p50": _p50(change),
            "view_change_s_p99": _quantile(change, 0.99),
            "view_change_s_max": _round(max(change, default=None)),
            "swaps_completed": self._swaps,
            "failures_on_spares": sum(1 for f in fired if f.on_spare),  # resolved without a swap
            "job": "running" if outcome is None else ("finished" if outcome[0] else "failed"),
            "job_failure_reason": "" if outcome is None or outcome[0] else _shorten(outcome[1]),
            "false_positives": self._false_positives,
            "fenced_rejections": self._fenced_rejections,
            "spurious_rebuilds": self._spurious_rebuilds,
            "coordinator_msgs_per_s": round(costs.steady_msgs / steady_s, 1),
            "coordinator_bytes_out": costs.bytes_out,
            # What grows with the job: one kind a member sends per view change multiplies by every round.
            "coordinator_messages": {kind.__name__: n for kind, n in sorted(costs.inbound.items(),
                                                                             key=lambda item: item[0].__name__)},
            "view_frame_bytes": costs.view_frame_bytes,
            "frames_dropped_oversize": costs.dropped_oversize,
            "max_frame_bytes": costs.max_frame_bytes,
            "coordinator_cpu_s_per_s": round(costs.total_cpu / max(self._run.tick * tick_s, tick_s), 4),
            "cpu_handle_s_per_s": round(costs.steady_handle_cpu / steady_s, 4),
            "cpu_tick_s_per_s": round(costs.steady_tick_cpu / steady_s, 4),
            "cpu_tick_ms": round(1000 * costs.steady_tick_cpu / steady_ticks, 3),
            "cpu_startup_s": round(costs.startup_cpu or 0.0, 3),
            "cpu_stall_s_max": round(costs.stall_cpu_max, 4),
            "cpu_view_change_s_max": round(costs.view_change_cpu_max, 4),
            "cpu_total_s": round(costs.total_cpu, 3),
            "wall_s": round(wall_s, 3),
        }


def format_table(result: dict[str, Any]) -> str:
    """The metrics as a short two-column table for people (``deadpool simulate`` without ``--json``)."""
    rows = [(key, value) for key, value in result.items() if key != "violations"]
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    lines += [f"  violation: {text}" for text in result.get("violations", [])]
    if result.get("frames_dropped_oversize"):
        lines.append(
            f"note: a CommitView of {result['view_frame_bytes']:,} bytes is over the members' control-frame limit, "
            "so every member dropped it, as real workers would; to study the protocol past that point, rerun "
            "with a larger --max-frame-bytes."
        )
    return "\n".join(lines)


def _shorten(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _p50(values: list[float]) -> float | None:
    """The median (nearest rank, low), or None without samples."""
    return _quantile(values, 0.5)


def _quantile(values: list[float], q: float) -> float | None:
    """The `q` quantile (nearest rank, low), or None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[int(q * (len(ordered) - 1))], 4)
