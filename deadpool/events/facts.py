"""The facts the events file states: one frozen, typed record per event this project's readers know.

What the summary concludes from the typed records of ``events.schema`` (``summary.parse`` makes them):
a fact joins a record with what the file says elsewhere (the seat of a member a line names without one),
and the closing lines, ``deadpool events`` and the metrics work on these.
"""

from __future__ import annotations

from dataclasses import dataclass

UNKNOWN = "?"  # what a fact holds for a name (detector, source, action) its record does not give
NO_RANK = 1 << 30  # sorts after every real rank: records without a seat (coordinator, spares) speak last


@dataclass(frozen=True, slots=True)
class CoordinatorStarted:
    """The coordinator is listening."""

    ts: float | None  # when it started (unix seconds)
    address: str  # its control address, tcp://host:port ("" when absent)


@dataclass(frozen=True, slots=True)
class MemberJoined:
    """A worker (active or spare) registered with the coordinator, as the writer saw it."""

    ts: float | None  # when it joined
    member: str  # the member's id
    rank: int | None  # the rank the record carries (-1 or None: no seat yet)
    role: str  # active | spare ("" when absent)
    process: str  # the kind of process that wrote the line (worker, coordinator, ...)

    @property
    def spare(self) -> bool:
        """Whether it joined as a spare."""
        return self.role == "spare"


@dataclass(frozen=True, slots=True)
class Failure:
    """One member declared dead."""

    ts: float | None  # when the failure was declared (unix seconds)
    member: str  # the dead member's id
    rank: int | None  # the seat it held (None: a spare or unknown)
    detected_by: str  # a vocabulary.Detector
    reason: str  # free text from the detector
    detection_s: float | None = None  # injected failure to its detection (known only for injected ones)


@dataclass(frozen=True, slots=True)
class SpareLost:
    """A spare died or was fenced before it was seated."""

    ts: float | None  # when it was lost
    member: str  # the lost spare ("" when the record does not say)
    rank: int | None  # a seat, if it ever had one


@dataclass(frozen=True, slots=True)
class ViewCommit:
    """One committed view (the first per epoch; at most one may exist)."""

    ts: float | None  # when it was committed
    epoch: int | None  # the view's epoch
    resume_step: int | None  # training goes on at resume_step + 1
    seats: tuple[str, ...] | None  # rank -> member id (None: the record gives no list)
    spares: tuple[str, ...] | None  # spare member ids, in adoption order (None: no list)
    refilled: tuple[int, ...] = ()  # the seats this view gave to spares
    reason: str = ""  # why the view changed


@dataclass(frozen=True, slots=True)
class Restore:
    """One member loading a snapshot (a survivor rolling back, or an adopted spare)."""

    ts: float | None  # when the restore finished
    member: str  # who restored
    rank: int | None  # its seat
    source: str  # local | buddy | disk (UNKNOWN when absent)
    bytes: int | None  # size of the restored state
    s: float | None  # seconds the restore took
    step: int | None = None  # the step restored


@dataclass(frozen=True, slots=True)
class Swap:
    """A spare that took a dead member's seat and finished its first step."""

    ts: float | None  # when the swap was reported complete
    rank: int | None  # the seat
    old_member: str  # the member that died
    new_member: str  # the spare that took its place
    recovery_s: float | None  # from the failure to the first finished step after it


@dataclass(frozen=True, slots=True)
class StepDone:
    """One rank finished one step."""

    ts: float | None  # when it finished
    epoch: int | None  # the view it ran in (a replayed step has a later epoch)
    step: int | None  # the step number
    rank: int | None  # the rank that reports it
    member: str  # the member in that seat
    loss: float | None  # the user's reported loss
    tokens: float | None  # tokens this rank processed in the step
    tokens_per_s: float | None  # this rank's rate
    step_s: float | None  # seconds the step took

    @property
    def order(self) -> int:
        """The rank for choosing whose record speaks for a step (seatless records last)."""
        return self.rank if self.rank is not None and self.rank >= 0 else NO_RANK


@dataclass(frozen=True, slots=True)
class ChaosInjection:
    """A fault injected on purpose (``--chaos`` or ``deadpool chaos``)."""

    ts: float | None  # when it was injected
    action: str  # kill | stop | cont | ... (UNKNOWN when absent)
    member: str  # the target member ("" when unknown)
    rank: int | None  # the target seat
    spec: str = ""  # the --chaos spec that fired, as ``str(ChaosSpec)`` writes it ("": an operator's command)


@dataclass(frozen=True, slots=True)
class Fenced:
    """A member declared dead was fenced (never readmitted)."""

    ts: float | None
    member: str  # the writer of the record
    rank: int | None  # the writer's rank
    reason: str  # "" when absent


@dataclass(frozen=True, slots=True)
class Rejection:
    """A message or a join refused."""

    ts: float | None
    member: str  # the writer of the record (who refused)
    rank: int | None  # the writer's rank
    reason: str  # bad_mac, stale_epoch, rate_limited, ... ("" when absent)


@dataclass(frozen=True, slots=True)
class UntrackedRollback:
    """A restore left a data loader no snapshot holds where it was: the final state may differ from a failure-free
    run's (``training_finished``'s ``untracked_rollback``)."""

    loader: str  # the loader's type (UNKNOWN when absent)
    where: str  # the script's line that iterated it ("" unknown)
    view: int | None  # the epoch of the view whose restore it was
    rank: int | None  # the seat that reported it (the lowest of those that did)


@dataclass(frozen=True, slots=True)
class JobFinished:
    """Training finished (every rank may write one)."""

    ts: float | None
    member: str  # the writer
    rank: int | None  # the writer's rank (None or -1: the coordinator)
    step: int | None  # the last step
    digest: str  # the final state digest ("" when absent)
    untracked: UntrackedRollback | None = None  # None: no restore left an untracked loader behind


@dataclass(frozen=True, slots=True)
class ChaosPointUnseen:
    """A member's first finished step passed no point of a spec it is to fire later: it will likely never fire."""

    ts: float | None
    member: str  # the member armed with the spec
    rank: int | None  # its seat
    step: int | None  # its first finished step
    spec: str  # the spec, as ``str(ChaosSpec)`` writes it
    at: str  # the spec's point (UNKNOWN when absent)
    seen: tuple[str, ...]  # the points the step passed


@dataclass(frozen=True, slots=True)
class ChaosNotFired:
    """A launcher's closing finding: a ``--chaos`` spec for one of its host's members never fired."""

    ts: float | None
    spec: str  # the spec, as ``str(ChaosSpec)`` writes it
    at: str  # its point
    member: str  # the member it was for ("" unknown)
    rank: int | None  # the seat that member started in (-1: a spare)
    last_step: int | None  # the member's last finished step (-1 or None: none)
    seen: tuple[str, ...]  # the points its first step passed (empty: unknown)
    ended: str  # how the member's run ended, as the events tell it
    why: str  # the sentence the closing summary prints


@dataclass(frozen=True, slots=True)
class JobFailed:
    """The job failed and stopped."""

    ts: float | None
    member: str  # the writer
    rank: int | None  # the writer's rank
    reason: str  # why, and what to do next ("" when absent)
    cause: str = ""  # the machine cause where the event names one (``user_error``), else ""
    traceback: str = ""  # a script's error: the end of its traceback
    raised_by: str = ""  # a script's error: the member that raised it


@dataclass(frozen=True, slots=True)
class GroupsAborted:
    """A worker's communicators aborted together (NCCL or the stand-in), as soon as it learned of a lost seat."""

    ts: float | None
    member: str  # the worker
    rank: int | None  # its seat
    groups: tuple[str, ...]  # the communicators' store prefixes
    reason: str  # what asked for it (the Prepare, a rebuild that set them aside)
    s: float | None  # seconds the batch took


Fact = (
    CoordinatorStarted | MemberJoined | Failure | SpareLost | ViewCommit | Restore | Swap | StepDone
    | ChaosInjection | Fenced | Rejection | JobFinished | JobFailed | ChaosPointUnseen | ChaosNotFired
    | GroupsAborted
)
