"""Replica checks: the seats' checksums of their replicated state, compared step by step, and the corrupt seat named.

Every snapshot a seat takes checksums one part of the state that is the same on every seat (``rt.ddp``'s
parameters and optimizer state: ``snapshot/checksum.py``), the same part on every seat for the same step;
the heartbeats bring the newest few. Once every seat told its checksum of a step, ``decisions.replica_verdict``
compares them. A seat against a majority is corrupt: it is fenced and replaced like a dead one, and the round
resumes from the newest step whose checks passed on every seat, the K-th checked step before the mismatch
with checks of 1/K per step (the part found bad was last seen good then). No majority, or no spare to take
the seat, stops the job naming the seats and the step: a run never finishes on state that silently differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from deadpool.coordinator import decisions
from deadpool.coordinator.views import Views
from deadpool.events import schema
from deadpool.events.log import EventLog
from deadpool.events.vocabulary import Detector
from deadpool.protocol.view import INITIAL_STEP

KEPT_STEPS = 32  # steps whose checksums wait for the last seats' (older ones are dropped unchecked)


@dataclass(frozen=True, slots=True)
class Corruption:
    """A seat found corrupt: what the service fences and replaces, and the step every seat resumes from."""

    member: str
    seat: int
    step: int  # the step whose checksums disagreed
    reason: str
    rollback_step: int  # the newest step whose checks passed on every seat
    detector: Detector = Detector.REPLICA_CHECK


class ReplicaChecks:
    """The checksums told for each step not yet compared, the steps compared clean, and the corruptions found."""

    def __init__(self, parts: int, every: int, events: EventLog, views: Views, fail: Callable[[str], None]) -> None:
        self._parts = parts  # each check covers 1/parts of the replicated state (0: no checks)
        self._every = every  # a snapshot (and its check) every this many steps: which part a step's check covers
        self._events = events
        self._views = views
        self._fail = fail  # stop the job with this message (Ending.fail)
        self._told: dict[int, dict[int, int]] = {}  # step -> seat -> checksum, under the groups of `_epoch`
        self._clean: list[int] = []  # steps whose checksums every seat told and all agreed, oldest first
        self._epoch = 0  # the view whose rebuild the checksums in `_told` were taken under
        self.found: list[tuple[int, int]] = []  # (seat, step) of each corruption found, for status and metrics
        self._named: set[str] = set()  # members found corrupt (each is named once)

    def status(self) -> dict[str, object]:
        """For ``deadpool status``: the corruptions found, and how much of the replicated state each check covers."""
        return {"corruptions": [{"rank": seat, "step": step} for seat, step in self.found],
                "replica_checks": f"1/{self._parts} per step" if self._parts else "off"}

    def told(self, member: str, checks: Iterable[list[int]]) -> list[Corruption]:
        """A member's newest [epoch, step, checksum] triples (its heartbeat's): compare each step all seats told;
        returns the seats found corrupt (each once)."""
        view = self._views.current
        seat = view.seat_of(member) if view is not None and self._parts else None
        if view is None or seat is None:
            return []
        found: list[Corruption] = []
        groups = self._views.groups_epoch
        if groups != self._epoch:  # a rebuild: training went back to its resume step, and checks again from it
            self._epoch, self._told = groups, {}
            self._clean = [step for step in self._clean if step <= view.resume_step]
        for check in checks:
            if len(check) != 3 or check[0] < groups:
                continue  # taken under groups a later view replaced
            _, step, digest = check
            if self._clean and step <= self._clean[-1]:
                continue  # compared already
            told = self._told.setdefault(step, {})
            told[seat] = digest
            if len(told) == view.world_size:
                del self._told[step]
                found += self._compare(step, told)
        if len(self._told) > KEPT_STEPS:
            for step in sorted(self._told)[: len(self._told) - KEPT_STEPS]:
                del self._told[step]
        return found

    def _compare(self, step: int, told: dict[int, int]) -> list[Corruption]:
        minority, why = decisions.replica_verdict(told)
        if minority == []:
            self._clean.append(step)
            del self._clean[: -(self._parts + 1)]
            return []
        view = self._views.current
        assert view is not None
        part = f"{(step // self._every) % self._parts + 1}/{self._parts}"
        self._events.emit(schema.SdcSuspected(
            detector=Detector.REPLICA_CHECK, step=step, seats=minority or sorted(told), part=part, reason=why,
            checksums={str(seat): f"{digest:016x}" for seat, digest in sorted(told.items())}))
        if minority is None:
            self._fail(f"silent data corruption at step {step}: the seats' checksums of their replicated state "
                       f"disagree, {why}. Stopped: no state known good can be chosen; relaunch from a checkpoint")
            return []
        # The part found bad was last seen good `parts` checks ago: resume from there (the initial state, earlier).
        clean = self._clean[-self._parts] if len(self._clean) >= self._parts else INITIAL_STEP
        found = [Corruption(view.seats[seat], seat, step, f"replica check at step {step}: {why}", clean)
                 for seat in minority if view.seats[seat] not in self._named]
        self._named.update(corruption.member for corruption in found)
        self.found += [(corruption.seat, step) for corruption in found]
        return found
