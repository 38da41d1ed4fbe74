"""The events file's schema: one frozen, typed record per event kind, for the writer and every reader.

Every line of the file is one of these records, encoded as a flat JSON object whose ``event`` field is
the record's tag (the ``Event`` catalogue's name).  ``EventLog.emit`` takes a record and writes it;
``read`` and ``decode`` validate each line against its kind's record (with msgspec, in C) and raise
``SchemaError`` naming the line, the field and the kind on a mismatch, so ``deadpool events``, the
launcher's summaries, the metrics, the simulator's invariant checks, ``--check-determinism`` and the
benchmarks all read one schema.  The envelope (``ts``, ``epoch``, ``member``, ``rank``, ``step``,
``source_process``) is on every record; a writer leaves it ``None`` for the log to fill in.  A field a
record does not know is ignored (a newer writer may add fields); a line of an event kind this reader
does not know becomes an ``Unrecognised`` record that keeps its name and fields, so a newer writer's
file still reads.  Closed vocabularies are enums (``events.vocabulary``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from deadpool.events.catalogue import Event
from deadpool.events.vocabulary import (
    ChaosAction,
    ChaosVia,
    Detector,
    MoveTrigger,
    Raised,
    RejectReason,
    RestoreSource,
    Trigger,
)

log = logging.getLogger("deadpool.events.schema")

NO_SEAT = -1  # the rank of a record whose member holds no seat (a spare, the coordinator)


class SchemaError(ValueError):
    """A line of an events file does not match its event kind's schema (the message names the line,
    the kind and the field)."""


class Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="event"):
    """The envelope every line carries; a subclass per event kind adds its own fields.

    A writer leaves an envelope field ``None`` to have the log fill it in (its member, its view's
    epoch, its rank and step); a line read back always has them.
    """

    ts: float = 0.0  # unix seconds (the log's clock: the simulator's is virtual)
    epoch: int | None = None  # the writer's view epoch, or the one the event is about
    member: str | None = None  # the writer, or the member the event is about (member_failed, spare_lost)
    rank: int | None = None  # that member's seat (-1: none)
    step: int | None = None  # the step in progress, or the one the event is about
    source_process: str = ""  # the kind of process that wrote the line (worker, coordinator, agent, ...)

    @property
    def event(self) -> Event:
        """The event kind this record is a line of (its ``event`` field on disk)."""
        return Event(str(type(self).__struct_config__.tag))

    def fields(self) -> dict[str, Any]:
        """The record as the flat JSON object written to the file (an optional field left ``None`` is left out)."""
        data: dict[str, Any] = msgspec.to_builtins(self)
        if not self.source_process:
            del data["source_process"]
        for name in _optional(type(self)):
            if data[name] is None:
                del data[name]
        return data

    def _extras(self, data: dict[str, Any]) -> Record:
        """The record with the fields of `data` it does not declare, for a kind whose lines carry free fields."""
        return self


class UntrackedRollback(msgspec.Struct, frozen=True, kw_only=True):
    """A restore left a data loader no snapshot holds where it was: the final state may differ."""

    loader: str  # the loader's type
    where: str  # the script's line that iterated it ("" unknown)
    view: int  # the epoch of the view whose restore it was
    rank: int  # the seat that reported it (the lowest of those that did)


# -- the coordinator --------------------------------------------------------------------------------


class CoordinatorStarted(Record, frozen=True, kw_only=True, tag=Event.COORDINATOR_STARTED.value):
    """The coordinator is listening."""

    address: str  # its control address, tcp://host:port
    store: str  # the rendezvous store's address
    pid: int
    recovering: bool  # restarted: it waits for the members' views instead of forming the first
    world_size: int
    metrics: str  # the metrics URL ("" none)
    term: int


class StandbyStarted(Record, frozen=True, kw_only=True, tag=Event.STANDBY_STARTED.value):
    """A standby coordinator runs."""

    address: str
    store: str
    pid: int
    active: str  # the active coordinator's address
    hosts: int


class MemberJoined(Record, frozen=True, kw_only=True, tag=Event.MEMBER_JOINED.value):
    """A worker registered (the coordinator's line) or started (the worker's own)."""

    role: str  # active | spare (the wire's Role)
    host: str
    pid: int
    seat_hint: int = NO_SEAT  # the coordinator's line: the seat it was started for
    control_addr: str = ""  # the worker's line: its addresses
    bulk_addr: str = ""

    @property
    def spare(self) -> bool:
        """Whether it joined as a spare."""
        return self.role == "spare"


class MemberFailed(Record, frozen=True, kw_only=True, tag=Event.MEMBER_FAILED.value):
    """A member declared dead; ``member`` and ``rank`` name it and its seat (-1: a spare)."""

    detected_by: Detector
    reason: str  # the detector's words
    detection_s: float | None = None  # injected failure to its detection (known only for injected ones)


class SpareLost(Record, frozen=True, kw_only=True, tag=Event.SPARE_LOST.value):
    """A spare died or was fenced before it was seated; ``member`` names it."""

    spares_left: int


class SpareReleased(Record, frozen=True, kw_only=True, tag=Event.SPARE_RELEASED.value):
    """A spare told to leave at the end of the job."""

    reason: str


class MoveRequested(Record, frozen=True, kw_only=True, tag=Event.MOVE_REQUESTED.value):
    """The coordinator accepted a planned move: ``member`` at ``rank`` to ``spare``."""

    spare: str
    trigger: MoveTrigger
    reason: str
    host: str = ""  # a drain: the host drained


class SeatSlow(Record, frozen=True, kw_only=True, tag=Event.SEAT_SLOW.value):
    """``member`` at ``rank`` computed ``score`` times the job's median for ``steps`` steps (reported once)."""

    step: int
    score: float
    threshold: float
    steps: int
    moved: bool  # a planned move for it started (--replace-slow)
    reason: str  # the cost model's word, or why no move


class SdcSuspected(Record, frozen=True, kw_only=True, tag=Event.SDC_SUSPECTED.value):
    """The replicas' checksums of their replicated state at ``step`` disagreed (``checksums``: seat -> checksum,
    hexadecimal); ``seats`` are those against the majority (all of them where there is none)."""

    detector: Detector
    seats: list[int]
    checksums: dict[str, str]
    part: str  # which part of the replicated state was compared, "k/K"
    reason: str


class SdcConfirmed(Record, frozen=True, kw_only=True, tag=Event.SDC_CONFIRMED.value):
    """``member`` at ``rank`` holds corrupt state at ``step``: it is fenced and replaced, and every seat resumes
    from ``rollback_step``, the newest step whose checks passed on every seat."""

    detector: Detector
    rollback_step: int
    reason: str


class SeatLeft(Record, frozen=True, kw_only=True, tag=Event.SEAT_LEFT.value):
    """A moving member stopped after ``step`` (its buddy holds that snapshot) and hands its seat over."""

    step: int


class SeatHeld(Record, frozen=True, kw_only=True, tag=Event.SEAT_HELD.value):
    """A seat told that another moves after ``step`` waits at that step's end for the view change; ``late``: it had
    ended the step when told, and will pause inside the next one instead."""

    step: int
    late: bool = False


class MovedExit(Record, frozen=True, kw_only=True, tag=Event.MOVED_EXIT.value):
    """A moved member's last line: it stopped after ``step`` and exits 0."""

    step: int
    reason: str


class ViewPrepared(Record, frozen=True, kw_only=True, tag=Event.VIEW_PREPARED.value):
    """A view change began: the survivors are told to pause."""

    failed_seats: list[int]  # the seats being refilled
    reason: str
    replacements: dict[str, str]  # seat -> the spare chosen for it
    trigger: Trigger
    told: int  # members told
    through_agents: int  # of those, told through their host agents


class ViewCommitted(Record, frozen=True, kw_only=True, tag=Event.VIEW_COMMITTED.value):
    """A view committed (one per epoch at most)."""

    resume_step: int  # training goes on at resume_step + 1
    seats: list[str]  # rank -> member
    spares: list[str]  # in adoption order
    store_prefix: str
    reason: str
    rebuild_groups: list[str]  # the groups (store prefixes) every seat rebuilds
    failed_seats: list[int]  # the seats this view gave to spares
    buddies: list[int]  # seat -> the seat that keeps its copy
    trigger: Trigger
    term: int


class ViewAdopted(Record, frozen=True, kw_only=True, tag=Event.VIEW_ADOPTED.value):
    """A restarted coordinator took the highest view a member reported, as it is."""

    seats: list[str]
    spares: list[str]
    resume_step: int
    reported_by: str


class SwapCompleted(Record, frozen=True, kw_only=True, tag=Event.SWAP_COMPLETED.value):
    """A spare took a dead member's seat (``rank``) and finished its first step."""

    old_member: str
    new_member: str
    recovery_s: float  # from the failure to the first finished step after it
    groups_rebuilt: int  # the new member's adoption
    group_s: float


class DiskFallback(Record, frozen=True, kw_only=True, tag=Event.DISK_FALLBACK.value):
    """Every seat rolls back to a disk checkpoint."""

    resume_step: int | None
    reason: str


class CollectiveErrorReported(Record, frozen=True, kw_only=True, tag=Event.COLLECTIVE_ERROR_REPORTED.value):
    """The coordinator heard of a worker's failed collective."""

    error: str


class ChaosInjected(Record, frozen=True, kw_only=True, tag=Event.CHAOS_INJECTED.value):
    """A fault injected on purpose: by a ``--chaos`` spec (the member's own line) or an operator's command
    (the coordinator's line, which names the target)."""

    action: ChaosAction
    via: ChaosVia = ChaosVia.SPEC
    spec: str = ""  # the spec that fired, as ``str(ChaosSpec)`` writes it
    at: str = ""  # the spec's point
    target_member: str = ""  # an operator's command: the member it was for
    target_rank: int = NO_SEAT
    at_step: int | None = None  # an operator's command: the step it waited for
    target_step: int | None = None  # an operator's command: the target's step when it was sent
    tensor: str = ""  # a corrupt spec's: the tensor whose bit it flipped (tracked name and state key)

    def target(self) -> tuple[str, int]:
        """The member the fault was injected into, and its seat (-1: a spare or unknown)."""
        if self.via is ChaosVia.OPERATOR:
            return self.target_member, self.target_rank
        return self.member or "", NO_SEAT if self.rank is None else self.rank


class Rejected(Record, frozen=True, kw_only=True, tag=Event.REJECTED.value):
    """A message or a join refused."""

    reason: str  # bad_mac, stale_epoch, rate_limited, fenced_peer, ... (the codec names its own)
    detail: str = ""
    peer: str = ""  # the sender refused
    kind: str = ""  # the message kind refused
    seat: int | None = None
    count: int | None = None  # how many were dropped (rate limits, full inboxes)
    ack_epoch: int | None = None
    report_epoch: int | None = None
    groups_epoch: int | None = None

    @property
    def fenced_peer(self) -> bool:
        """A fenced member spoke (and is told again that it is out)."""
        return self.reason == RejectReason.FENCED_PEER


class RejoinAsked(Record, frozen=True, kw_only=True, tag=Event.REJOIN_ASKED.value):
    """A restarted coordinator asks ``member`` to join again."""


class TrainingFinished(Record, frozen=True, kw_only=True, tag=Event.TRAINING_FINISHED.value):
    """Training finished at ``step``."""

    state_digest: str
    untracked_rollback: UntrackedRollback | None = None  # None: no restore left an untracked loader behind


class JobFailed(Record, frozen=True, kw_only=True, tag=Event.JOB_FAILED.value):
    """The job failed and stopped.  With a machine cause, ``reason`` is the cause (``user_error``) and
    ``detail`` the prose; otherwise ``reason`` is the prose."""

    reason: str
    detail: str | None = None
    exception: str = ""  # a script's error: its type name
    raised_by: str = ""  # a script's error: the member that raised it
    traceback: str = ""  # a script's error: the end of its traceback


class UserException(Record, frozen=True, kw_only=True, tag=Event.USER_EXCEPTION.value):
    """The coordinator heard a script's exception."""

    raised_by: str
    exception: str
    message: str
    verdict: Raised
    reason: str
    traceback: str


class StandbyJoined(Record, frozen=True, kw_only=True, tag=Event.STANDBY_JOINED.value):
    """The active coordinator heard its standby."""

    standby: str
    term: int


class StandbyLost(Record, frozen=True, kw_only=True, tag=Event.STANDBY_LOST.value):
    """The active coordinator stopped hearing its standby."""

    standby: str
    silent_s: float
    term: int


class Takeover(Record, frozen=True, kw_only=True, tag=Event.TAKEOVER.value):
    """A standby became the active coordinator."""

    term: int
    old_active: str
    silent_s: float
    confirmed_by: list[str]
    reason: str


class TakeoverDeclined(Record, frozen=True, kw_only=True, tag=Event.TAKEOVER_DECLINED.value):
    """The active is silent but too few hosts confirm it (once per silence)."""

    term: int
    silent_s: float
    reports: dict[str, float]  # agent -> seconds it has not heard the active
    reason: str


class CoordinatorStoodDown(Record, frozen=True, kw_only=True, tag=Event.COORDINATOR_STOOD_DOWN.value):
    """An older term's coordinator stops acting."""

    term: int
    kind: str  # superseded | cut_off (the link's StandDown)
    reason: str


class CommitWithheld(Record, frozen=True, kw_only=True, tag=Event.COMMIT_WITHHELD.value):
    """A view not committed: too few hosts heard."""

    reason: str


class TermFollowed(Record, frozen=True, kw_only=True, tag=Event.TERM_FOLLOWED.value):
    """A member or agent follows a newer term."""

    term: int
    active: str


class ChaosNotFired(Record, frozen=True, kw_only=True, tag=Event.CHAOS_NOT_FIRED.value):
    """A launcher's closing finding: a ``--chaos`` spec for one of its host's members never fired."""

    spec: str
    at: str
    target_member: str
    target_rank: int | None  # the seat the member started in (-1: a spare)
    last_step: int | None  # the member's last finished step (-1 or None: none)
    seen: list[str]  # the points its first step passed (empty: unknown)
    ended: str  # how the member's run ended, as the events tell it
    why: str  # the sentence the closing summary prints


# -- the workers --------------------------------------------------------------------------------------


class Paused(Record, frozen=True, kw_only=True, tag=Event.PAUSED.value):
    """Stopped at a step boundary for a Prepare."""

    reason: str
    backward_abandoned: bool
    forward_abandoned: bool


class Restored(Record, frozen=True, kw_only=True, tag=Event.RESTORED.value):
    """A member loaded a snapshot of ``step`` into ``rank`` (a survivor rolling back, or an adopted spare)."""

    source: RestoreSource
    bytes: int  # size of the restored state
    live_bytes: int  # of those, already held by live tensors: not reloaded
    s: float  # seconds the restore took
    fetch_s: float
    group_s: float
    wait_s: float
    preloaded: bool
    groups_rebuilt: list[str] | None = None  # with a mesh: the names of its groups rebuilt and kept
    groups_kept: list[str] | None = None
    mesh_group_s: float | None = None
    decisions_taken: int | None = None


class AdoptFailed(Record, frozen=True, kw_only=True, tag=Event.ADOPT_FAILED.value):
    """A spare could not take its seat."""

    error: str


class ComputeLate(Record, frozen=True, kw_only=True, tag=Event.COMPUTE_LATE.value):
    """The training thread left a coordinator's command untaken for the collective timeout."""

    command: str
    command_epoch: int
    waited_s: float
    stack: str  # where the training thread is


class CollectiveFailed(Record, frozen=True, kw_only=True, tag=Event.COLLECTIVE_FAILED.value):
    """A worker's collective raised or was interrupted."""

    error: str


class Fenced(Record, frozen=True, kw_only=True, tag=Event.FENCED.value):
    """The writer was declared dead and is never readmitted."""

    reason: str
    fenced_epoch: int


class FencedExit(Record, frozen=True, kw_only=True, tag=Event.FENCED_EXIT.value):
    """A fenced member woke up and exits, touching nothing."""

    reason: str


class SnapshotMemory(Record, frozen=True, kw_only=True, tag=Event.SNAPSHOT_MEMORY.value):
    """Bytes of a worker's own snapshots and buddy copies, at the end."""

    own_snapshots_bytes: int
    buddy_copies_bytes: int
    buddy_copies_shared_bytes: int
    snapshot_bytes: int
    snapshot_copied_bytes: int
    stall_p99_s: float


class SnapshotShmRefused(Record, frozen=True, kw_only=True, tag=Event.SNAPSHOT_SHM_REFUSED.value):
    """The buddy would not map the slot file; TCP instead."""

    peer: str
    error: str


class StepFinished(Record, frozen=True, kw_only=True, tag=Event.STEP_FINISHED.value):
    """A rank finished ``step``.  The script's ``rt.report`` fields are written beside these, flat; a
    reader finds those it does not declare in ``report``."""

    step_s: float
    wait_s: float | None = None  # of step_s, the time spent waiting on collectives (the slowest seat waits least)
    loss: float | None = None
    tokens: float | None = None  # tokens this rank processed in the step
    tokens_per_s: float | None = None
    report: dict[str, Any] = {}  # the script's other reported fields

    DECLARED: ClassVar[frozenset[str]] = frozenset()  # filled in below: the names a line's own fields use

    def fields(self) -> dict[str, Any]:
        data = Record.fields(self)
        data.update(data.pop("report"))
        return data

    def _extras(self, data: dict[str, Any]) -> Record:
        extra = {k: v for k, v in data.items() if k not in StepFinished.DECLARED}
        return msgspec.structs.replace(self, report=extra) if extra else self


class SeatFinished(Record, frozen=True, kw_only=True, tag=Event.SEAT_FINISHED.value):
    """A seat reached the last step: its digests, for ``--check-determinism``."""

    state_digest: str
    seat_digest: str
    parts: dict[str, str]  # tracked name -> SHA-256 hex ("__rng__": the RNG states together)
    rngs: dict[str, str]  # RNG kind -> SHA-256 hex


class DataLoaderUntracked(Record, frozen=True, kw_only=True, tag=Event.DATA_LOADER_UNTRACKED.value):
    """A data loader no snapshot holds is iterated (once per process)."""

    loader: str  # its type
    where: str  # the script's line that iterates it ("" unknown)


class ChaosPointUnseen(Record, frozen=True, kw_only=True, tag=Event.CHAOS_POINT_UNSEEN.value):
    """A member's first finished step passed no point of a spec it is to fire later."""

    spec: str
    at: str
    seen: list[str]  # the points the step passed


class GroupsAborted(Record, frozen=True, kw_only=True, tag=Event.GROUPS_ABORTED.value):
    """A worker's communicators aborted together (NCCL or the stand-in)."""

    groups: list[str]  # the communicators' store prefixes
    reason: str  # what asked for it
    s: float  # seconds the batch took
    late: list[str]  # those that did not return within the bound
    failed: list[str]  # those that raised


class Unrecognised(msgspec.Struct, frozen=True, kw_only=True):
    """A line of an event kind this reader does not know (a newer writer's): kept by name, fields untyped."""

    event: str
    ts: float | None
    data: dict[str, Any]  # the whole line
    member: str | None = None  # the envelope, where the line has it
    rank: int | None = None

    def fields(self) -> dict[str, Any]:
        """The line as it was read."""
        return dict(self.data)


EventRecord = (
    CoordinatorStarted | StandbyStarted | MemberJoined | MemberFailed | SpareLost | SpareReleased | MoveRequested
    | SeatSlow | SdcSuspected | SdcConfirmed | SeatLeft | SeatHeld | MovedExit | ViewPrepared
    | ViewCommitted | ViewAdopted | SwapCompleted | DiskFallback | CollectiveErrorReported | ChaosInjected
    | Rejected | RejoinAsked | TrainingFinished | JobFailed | UserException | StandbyJoined | StandbyLost
    | Takeover | TakeoverDeclined | CoordinatorStoodDown | CommitWithheld | TermFollowed | ChaosNotFired | Paused
    | Restored | AdoptFailed | ComputeLate | CollectiveFailed | Fenced | FencedExit | SnapshotMemory
    | SnapshotShmRefused | StepFinished | SeatFinished | DataLoaderUntracked | ChaosPointUnseen | GroupsAborted
)
"""Every event kind's record: what ``EventLog.emit`` takes."""

Line = EventRecord | Unrecognised
"""What a reader gets for one line."""

_KINDS: dict[str, type[Record]] = {c.__struct_config__.tag: c for c in EventRecord.__args__}  # type: ignore[attr-defined]
StepFinished.DECLARED = frozenset({"event", *StepFinished.__struct_fields__} - {"report"})


@functools.cache
def _optional(kind: type[Record]) -> tuple[str, ...]:
    """A kind's own fields that default to ``None`` (left out of a line while ``None``)."""
    envelope = set(Record.__struct_fields__)
    return tuple(f.name for f in msgspec.structs.fields(kind) if f.name not in envelope and f.default is None)


def encode(record: Record) -> bytes:
    """One record as its line (JSON, newline-terminated)."""
    return json.dumps(record.fields(), default=str, separators=(",", ":")).encode() + b"\n"


def validate(data: dict[str, Any], where: str = "an event") -> Line:
    """The typed record one decoded line states.

    Raises:
        SchemaError: the line has no event name, or does not match its kind's schema (a required field
            missing or renamed, a field of the wrong type, a value outside its vocabulary).
    """
    name = data.get("event")
    if not isinstance(name, str):
        raise SchemaError(f"{where}: no event name (the line's \"event\" field is {name!r})")
    kind = _KINDS.get(name)
    if kind is None:
        ts = data.get("ts")
        member, rank = data.get("member"), data.get("rank")
        return Unrecognised(event=name, ts=float(ts) if isinstance(ts, int | float) else None, data=data,
                            member=member if isinstance(member, str) else None,
                            rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None)
    try:
        record: Record = msgspec.convert(data, kind)
    except msgspec.ValidationError as err:
        raise SchemaError(f"{where}: a {name!r} event does not match its schema: {err}") from None
    return record._extras(data)  # type: ignore[return-value]


def decode(line: str | bytes, where: str = "an event") -> Line:
    """The typed record one line of an events file states.

    Raises:
        SchemaError: the line is not a JSON object, or does not match its kind's schema.
    """
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise SchemaError(f"{where}: not a JSON event line ({err})") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: not a JSON object")
    return validate(data, where)


def iter_file(path: str | os.PathLike[str]) -> Iterator[Line]:
    """The records of an events file, in file order.

    A last line without its newline may be a write still in progress (a reader can see half of one
    ``write``, and a crash can leave half of one); it is skipped.

    Raises:
        OSError: the file cannot be opened.
        SchemaError: a whole line is not an event, or does not match its kind's schema (the message
            names the file, the line number, the kind and the field).
    """
    with Path(path).open() as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.strip()
            if not line:
                continue
            if not raw.endswith("\n"):
                try:
                    json.loads(line)
                except json.JSONDecodeError:
                    log.debug("%s:%d: a line still being written; skipped", path, number)
                    continue
            yield decode(line, f"{path}:{number}")


def read(path: str | os.PathLike[str]) -> list[Line]:
    """Every record of an events file, in file order (see ``iter_file``).

    Raises:
        OSError: the file cannot be opened.
        SchemaError: a line does not match its kind's schema.
    """
    return list(iter_file(path))
