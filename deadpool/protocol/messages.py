"""Every message DeadPool puts on the wire, as immutable dataclasses.

Actors never exchange anything else: the codec (``codec.py``) turns these into
bytes and back, validating every field against the annotations below.  Each
class has a small integer tag in ``REGISTRY``; tags are append-only and never
renumbered, so an old peer meeting a new message gets a clean "unknown tag"
error instead of a misparse.

Identity fields (``sender``, ``epoch``) are on every message that can change
shared state, so that receivers can drop messages from zombies (fenced
members) and from superseded views.
"""

from __future__ import annotations

import enum
from dataclasses import field

from deadpool.protocol.audits import Audit as Audit
from deadpool.protocol.audits import AuditDigest as AuditDigest
from deadpool.protocol.immutable import immutable
from deadpool.protocol.moves import Hold as Hold
from deadpool.protocol.moves import Holding as Holding
from deadpool.protocol.moves import Leave as Leave
from deadpool.protocol.moves import LeaveAt as LeaveAt
from deadpool.protocol.moves import Leaving as Leaving
from deadpool.protocol.moves import Takeover as Takeover
from deadpool.protocol.operator import ChaosCommand as ChaosCommand
from deadpool.protocol.operator import ChaosResult as ChaosResult
from deadpool.protocol.operator import MoveCommand as MoveCommand
from deadpool.protocol.operator import MoveResult as MoveResult
from deadpool.protocol.operator import StatusReply as StatusReply
from deadpool.protocol.operator import StatusRequest as StatusRequest
from deadpool.protocol.view import View

PROTOCOL_VERSION = 5  # 2: Heartbeat has control_addr, Rejoin added; 3: AckBatch in columns; 4: digest by seat runs;
# 5: a whole view in pieces is packed in columns and compressed


class Role(enum.StrEnum):
    """What a worker was started as (on the wire as its value)."""

    ACTIVE = "active"  # holds a seat from the start
    SPARE = "spare"  # waits to be adopted into a dead seat


@immutable
class Join:
    """A worker (active or spare) announces itself to the coordinator."""

    sender: str  # member id, never reused
    role: Role  # active or spare
    seat_hint: int  # RANK from the environment for actives, -1 for spares
    world_size: int  # WORLD_SIZE the worker was started with
    pid: int  # process id on its host, for fence-by-kill and status
    host: str  # host name, the failure domain for buddy placement
    control_addr: str  # where the coordinator sends views and commands
    bulk_addr: str  # where peers send snapshot data and restore requests
    # An active's complete disk checkpoints (--checkpoint-dir) for the job's world, oldest first: the first view
    # of a job launched with --resume starts after the newest one every seat sees.
    disk_steps: list[int] = field(default_factory=list)


@immutable
class Heartbeat:
    """Periodic liveness from a worker; also carries its progress for status."""

    sender: str  # member id
    epoch: int  # the newest view the worker holds
    step: int  # last finished step (-1 before the first)
    snapshot_step: int  # newest complete local snapshot (-2 if none)
    confirmed_step: int  # newest snapshot the buddy has confirmed (-2 if none)
    stall_p99_s: float  # p99 of the pre-step snapshot stall over recent steps
    control_addr: str  # where a coordinator that does not know this member (a restarted one) asks it to re-join
    compute_s: float = 0.0  # median over recent steps of its step time outside collective waits (slowness)
    # [epoch, step, checksum] of its newest snapshots' part of the replicated state (Progress.checks), oldest first
    checks: list[list[int]] = field(default_factory=list)


@immutable
class Welcome:
    """The coordinator's answer to Join: the job's shape, so a worker can check it."""

    epoch: int  # the coordinator's current epoch (0 before the first view)
    member: str  # the member id this welcome is for
    world_size: int  # number of seats in the job
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped
    standby: str = ""  # the standby coordinator's control address ("": none)


@immutable
class CommitView:
    """A committed view; members adopt it only if its epoch is newer than theirs."""

    view: View  # the whole view, self-contained
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped


@immutable
class Prepare:
    """Phase one of a view change: stop at a step boundary and report snapshots."""

    epoch: int  # the epoch being prepared (current + 1 or more)
    failed_seats: list[int]  # seats whose members were declared dead
    reason: str  # human-readable reason, logged by every member
    replacements: dict[int, str] = field(default_factory=dict)  # seat -> the spare chosen for it (told too)
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped
    # False when the round grew (another seat lost): an answer to an earlier Prepare of the same pause still
    # counts, so a member that gave one does not answer again (a round at 131,072 members costs one answer each).
    reanswer: bool = True
    # The step the failure was injected at (a --chaos spec's, from its ChaosInjected; the latest of several),
    # -1 when unknown: where an ``at=recovery`` spec of a survivor is keyed, the same step in every survivor.
    failure_step: int = -1
    # Every seat it replaces left at a step boundary (a planned move): a step that ran to its end without a
    # failed collective counts, since the leaving seats took part in all of its collectives.
    planned: bool = False
    left_after: int = -2  # with `planned`: the step the leaving seats left after (the resume step); -2: unknown


@immutable
class PeerPaused:
    """A survivor stopped for a Prepare tells the members it shares a mesh group with where it stopped.

    A peer that ran ahead into a later step (it shares no group with the dead seat) would otherwise wait
    on that group for collectives this survivor will never issue.
    """

    sender: str  # member id of the survivor that paused
    epoch: int  # the sender's view epoch (the view both hold)
    prepare_epoch: int  # the epoch of the Prepare it paused for
    begun: int  # the last step it began (ran to its end): it issues no collective of a later step
    abandoned: bool = False  # it stopped step `begun`'s backward before its first collective: nothing after its forward
    in_forward: bool = False  # it stopped step `begun` in its forward: not even all of the forward's collectives


@immutable
class PrepareAck:
    """A survivor's answer to Prepare: which snapshots it can restore from."""

    sender: str  # member id
    epoch: int  # the epoch being acknowledged
    step: int  # last finished step of the live state
    local_steps: list[int]  # complete local snapshots held
    ward_steps: dict[int, list[int]]  # seat -> complete buddy copies held for that seat
    disk_steps: list[int] = field(default_factory=list)  # steps with a complete disk checkpoint for every seat
    dirty_groups: list[str] = field(default_factory=list)  # mesh groups with a collective not completed here
    # Sent when the Prepare arrived, before the compute thread stopped: `local_steps` is only the newest local
    # snapshot (the one a capture still in flight cannot overwrite); the full answer follows from the boundary.
    early: bool = False


@immutable
class CollectiveFailed:
    """A worker saw a collective fail (fast failure path: a peer's socket closed)."""

    sender: str  # member id
    epoch: int  # the view the collective ran under
    step: int  # the step that failed
    error: str  # the backend's message, for the event log


@immutable
class Recovered:
    """A worker finished its first step after a committed view change."""

    sender: str  # member id
    epoch: int  # the view it is running under
    step: int  # the step it finished
    ts: float  # wall-clock time the step finished
    groups_rebuilt: int = 0  # its mesh groups (rt.device_mesh) that got a new gloo group in the adoption
    group_s: float = 0.0  # how long its adoption spent building groups


@immutable
class Finished:
    """A seat finished training; carries the job-wide state digest."""

    sender: str  # member id
    epoch: int  # the view it finished under
    seat: int  # its seat
    step: int  # the last step it ran
    digest: str  # SHA-256 hex over every seat's final tracked state
    # A data loader no snapshot holds that a restore on this seat left where it was (so the final state may differ
    # from a failure-free run's); trailing defaults, so a Finished without them decodes as before:
    untracked_loader: str = ""  # its type ("": no such loader, or no restore after training iterated it)
    untracked_where: str = ""  # the script's line that iterated it ("" unknown)
    untracked_view: int = 0  # the epoch of the view whose restore left it where it was


@immutable
class Stop:
    """The coordinator ends the job (finished, or failed with a reason)."""

    ok: bool  # True when training finished, False when the job failed
    reason: str  # what happened, what is safe, what to do next
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped


@immutable
class Fenced:
    """Tells a member it was declared dead; it must exit without touching anything."""

    member: str  # the fenced member id
    epoch: int  # the epoch in which it was removed
    reason: str  # why it was declared dead
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped


@immutable
class AgentHello:
    """A host's launcher (agent) registers the worker processes it owns."""

    sender: str  # agent id
    host: str  # host name
    control_addr: str  # where the coordinator sends fence and stop commands
    members: dict[str, int]  # member id -> pid of the processes this agent started


@immutable
class ProcessExited:
    """The agent saw one of its worker processes exit."""

    sender: str  # agent id
    member: str  # member id of the exited process
    returncode: int  # exit status; negative is the signal that ended it
    seat_hint: int = -1  # the RANK it was started with (-1: a spare): all there is of a process that never joined


@immutable
class FenceKill:
    """The coordinator asks a host's agent to kill a member declared dead."""

    member: str  # member id to kill
    epoch: int  # epoch that declared it dead
    reason: str  # why
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped


@immutable
class SnapshotHeader:
    """First frame of a snapshot transfer; payload frames follow in the same message (or it names a file)."""

    sender: str  # member id of the sender
    epoch: int  # sender's view epoch
    seat: int  # seat whose state this is
    step: int  # the step the state belongs to (state after that step)
    nbytes: int  # total payload bytes across the following frames
    manifest: bytes  # encoded layout of the tensors and the non-tensor state
    digest: bytes = b""  # optional BLAKE2b of the payload, checked when present
    shm_path: str = ""  # same host: the payload lies in this shared-memory file, and no payload frames follow
    shm_offset: int = 0  # byte offset of the payload in shm_path


@immutable
class SnapshotAck:
    """The buddy confirms it holds a complete copy of (seat, step), or says why it could not take it."""

    sender: str  # member id of the buddy
    epoch: int  # buddy's view epoch
    seat: int  # seat of the copy
    step: int  # step of the copy
    error: str = ""  # non-empty: the copy was not taken as offered (shared memory refused); resend over the wire
    header_epoch: int = -1  # epoch of the SnapshotHeader this answers (a late ack from an older view is ignored)


class RestorePart(enum.StrEnum):
    """Which part of a seat's snapshot a restore asks for (on the wire as its value)."""

    HELD = "held"  # all the seat's snapshot holds (its own state and its slice), from the buddy's copy
    # only the seat's slice of the replicated region: from the seat's own snapshot (its member serves it) or,
    # for a seat being restored itself, from its buddy's copy
    SLICE = "slice"


@immutable
class RestoreRequest:
    """A seat being restored asks for a snapshot: its own from its buddy, or a peer's slice of the replicated state.

    A spare chosen for a seat asks before the view that seats it names the step (``newest``): the
    reply's header says which step it got, and the commit tells whether that is the one to restore.
    """

    sender: str  # member id of the requester (seated in `seat` for HELD, or a spare of the view)
    epoch: int  # the view under which the request is valid
    seat: int  # seat whose snapshot is asked for (the requester's own, for HELD)
    step: int  # step to restore
    reply_to: str  # bulk address for the reply
    part: RestorePart = RestorePart.HELD  # what of the snapshot is asked for
    newest: bool = False  # the newest complete copy held, whatever `step` says (a spare's prefetch)
    shared: bool = False  # the requester can read a same-host shared-memory slot itself (a SLICE's reply may name it)
    finishing: bool = False  # every seat finishes `step` (a move's): a seat in it, or before it, answers once it has


@immutable
class RestoreReply:
    """Answer to RestoreRequest; on success a SnapshotHeader-shaped payload follows."""

    sender: str  # member id of the buddy
    epoch: int  # the epoch of the request
    seat: int  # seat served
    step: int  # step served
    ok: bool  # False when the copy is not held
    error: str  # why not, when ok is False
    header: SnapshotHeader | None = None  # layout of the payload frames that follow
    part: RestorePart = RestorePart.HELD  # the part of the request this answers
    newest: bool = False  # the request asked for the newest copy (the header's step is the one served)


@immutable
class ChaosInjected:
    """A worker is about to inject a failure into itself (logged for recovery timing)."""

    sender: str  # member id
    action: str  # kill, stop
    seat: int  # its seat
    step: int  # step at which it fired
    ts: float  # wall-clock time just before the signal


@immutable
class StepReport:
    """A worker finished a step; sent only while someone waits on steps (chaos at-step)."""

    sender: str  # member id
    epoch: int  # current epoch
    step: int  # finished step
    loss: float = field(default=float("nan"))  # the step's loss, when the script reports it


@immutable
class SignalMember:
    """The coordinator asks a host's agent to deliver a signal to one member (operator chaos)."""

    member: str  # member id to signal
    action: str  # kill (SIGKILL), stop (SIGSTOP) or cont (SIGCONT)
    reason: str  # who asked, for the agent's log
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped


@immutable
class HeartbeatBatch:
    """A host agent's heartbeats for its members, one message per interval (hierarchical aggregation).

    At 16,384 members and 100 ms heartbeats a coordinator would handle ~164k
    messages/s; an agent batching its host's 8 members divides that by 8.  The
    agent forwards only beats it received since its previous batch, so a hung
    member drops out of the batch exactly as its own heartbeats would stop.
    """

    sender: str  # agent id, registered with AgentHello; it may vouch only for its own members
    beats: list[Heartbeat]  # the newest heartbeat of each member heard from since the previous batch


@immutable
class HostHeartbeat:
    """A host agent's heartbeats for its members in columns: one message per host and interval.

    The agent hears its workers' heartbeats on the host and forwards, once per
    interval, the members it heard from since its previous message (a hung one
    drops out).  Column i of every list belongs to ``members[i]``.  The coordinator
    counts an unchanged member list as one message, not one per member, so a job's
    steady-state cost grows with its hosts (``coordinator/coverage.py``).
    """

    sender: str  # agent id, registered with AgentHello; it vouches only for its own members
    members: list[str]  # the members heard from since the previous HostHeartbeat
    epochs: list[int]  # per member: the newest view it holds
    steps: list[int]  # per member: its last finished step (-1 before the first)
    snapshot_steps: list[int]  # per member: its newest complete local snapshot (-2 if none)
    confirmed_steps: list[int]  # per member: the newest snapshot its buddy confirmed (-2 if none)
    control_addrs: list[str]  # per member: where a coordinator that does not know it asks it to re-join
    stall_p99_s: list[float]  # per member: p99 of its pre-step wait for the snapshot copy (Heartbeat's)
    compute_s: list[float] = field(default_factory=list)  # per member: Heartbeat's compute_s ([]: none told)
    checks: list[list[list[int]]] = field(default_factory=list)  # per member: Heartbeat's checks ([]: none told)


@immutable
class ViewReport:
    """A member tells a restarted coordinator the view it holds (the highest epoch wins)."""

    sender: str  # member id
    role: Role  # active or spare at launch
    host: str  # host name
    pid: int  # process id
    control_addr: str  # control address
    bulk_addr: str  # bulk address
    step: int  # last finished step
    view: View | None  # the newest view this member adopted, if any


@immutable
class Rejoin:
    """A coordinator heard a heartbeat from a member it cannot reach: send your Join again.

    A restarted coordinator learns members from their Joins, but a member rejoins on its
    own only after a heartbeat failed to send, and a restart on the same address can be
    quick enough that none does.  The heartbeat's control address lets the coordinator ask.
    """

    epoch: int  # the coordinator's current epoch
    member: str  # the member asked to re-join
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped


TRACEBACK_LIMIT = 16 * 1024  # bytes of traceback text a UserException carries (the end of it: the raise is last)


@immutable
class UserException:
    """A worker's training script raised an exception that DeadPool did not cause; the process exits next.

    The first report counts as a failure of the member (a hardware fault can surface as a Python
    error); the same exception at the same step in its replacement stops the job (a user error).
    """

    sender: str  # member id
    epoch: int  # the view it ran under (0: not seated yet)
    seat: int  # its seat (-1: a spare, or not seated yet)
    step: int  # the step in progress when it raised (-1: before the first step)
    kind: str  # the exception's qualified type name, e.g. "ValueError" or "mylib.DataError"
    message: str  # str() of the exception, bounded
    traceback: str  # the formatted traceback, at most TRACEBACK_LIMIT bytes (its end)


@immutable
class Coordinators:
    """Who coordinates the job in a term: the active coordinator and its standby.

    The active sends it when its standby changes and answers every StandbyHello
    with it; a standby that took over sends it, with its new term, to every member,
    agent and older coordinator it knows.  A receiver follows the highest term it
    has seen (it sends to that term's active from then on and drops older terms'
    messages); a coordinator that receives a higher term than its own stands down.
    """

    term: int  # only grows; the first coordinator's is 1
    active: str  # control address of the term's active coordinator
    standby: str  # control address of its standby ("": none)
    store: str = ""  # host:port of the active's TCPStore (the next views rendezvous on it)


@immutable
class StandbyHello:
    """A standby coordinator tells the active one it is there (and listens for the answer: silence counts)."""

    sender: str  # the standby's control address
    term: int  # the newest term the standby knows


@immutable
class SilenceQuery:
    """The standby asks a host's agent whether it still hears the active coordinator (before a takeover)."""

    reply_to: str  # the standby's control address
    nonce: int  # matches the report to the query
    term: int  # the term whose active coordinator the standby no longer hears


@immutable
class SilenceReport:
    """An agent's answer to SilenceQuery: how long since the active coordinator last answered it."""

    sender: str  # agent id
    nonce: int  # the query's nonce
    silent_s: float  # seconds since this agent's last answer from the active coordinator
    term: int  # the newest term this agent follows


@immutable
class StartStandby:
    """The active coordinator asks a host's agent to start a standby coordinator (the last one was lost)."""

    term: int  # the active's term
    reason: str  # why (for the agent's log)


@immutable
class ViewDelta:
    """A committed view as its changes from the view before it (``protocol/viewsync.py``).

    A member holding the base view (same epoch and digest) applies it and checks the
    result's digest; any other member asks for the whole view (ViewRequest). Its size
    grows with what changed, not with the job.
    """

    epoch: int  # the view committed
    base_epoch: int  # the view it changes
    base_digest: bytes  # that view's digest (viewsync.view_digest)
    digest: bytes  # the digest of the view it makes
    seats: dict[int, str]  # seat -> new member, for the seats that changed
    spares_gone: list[str]  # spares no longer in the pool (adopted or lost)
    spares_new: list[str]  # spares appended to the pool, in adoption order
    resume_step: int
    store_prefix: str
    store_addr: str
    bulk_addrs: dict[str, str]  # entries added or changed
    hosts: dict[str, str]  # entries added or changed
    dropped: list[str]  # members whose entries left both maps
    buddies: dict[int, int]  # seat -> buddy, for the seats whose buddy changed
    restore_from: dict[int, str]  # whole (it names only seats being restored)
    rebuild_groups: list[str]  # whole (only groups reported unfinished)
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped


@immutable
class ViewChunk:
    """One piece of a committed view too large for one control frame (``protocol/viewsync.py``)."""

    epoch: int  # the view's epoch
    digest: bytes  # the whole view's digest, checked once every piece arrived
    index: int  # 0 .. count-1
    count: int  # pieces in all
    payload: bytes  # this piece of ``codec.pack_view(view)`` (the view packed and compressed)
    term: int = 0  # the sending coordinator's term (0: a peer of before terms); older terms are dropped


@immutable
class ViewRequest:
    """A member that cannot apply a ViewDelta (it missed the base) asks for the whole current view."""

    sender: str  # member id
    epoch: int  # the epoch it holds (0: none)


@immutable
class Relay:
    """The header of a coordinator's broadcast that a host agent passes on to its workers (``coordinator/fanout.py``).

    It travels as the first of two frames; the second is the message itself, encoded and authenticated
    once for every host. The agent sends that frame unchanged to each of its workers named in ``to``, so a
    broadcast costs the coordinator one send per host, not one per member.
    """

    to: list[str]  # control addresses of the agent's workers
    term: int = 0  # the sending coordinator's term; an agent drops a relay of an older one


@immutable
class AckBatch:
    """A host agent's PrepareAcks for its workers in columns, one message for those that answered within a few ms.

    Its workers answer a relayed Prepare at nearly the same moment; the coordinator then reads
    one message per host, not one per survivor (``agent/relay.py``). Column i of every list is
    ``members[i]``'s answer, field by field as in :class:`PrepareAck`: checked in a few passes
    over each column, not field by field per answer (``coordinator/rounds.py``).
    """

    sender: str  # agent id, registered with AgentHello; it carries only its own members' answers
    members: list[str]  # who answered
    epochs: list[int]  # per answer, PrepareAck's fields
    steps: list[int]
    local_steps: list[list[int]]
    ward_steps: list[dict[int, list[int]]]
    disk_steps: list[list[int]]
    dirty_groups: list[list[str]]
    early: list[bool]

    @classmethod
    def of(cls, sender: str, acks: list[PrepareAck]) -> AckBatch:
        """`acks` as one batch from agent `sender`."""
        return cls(sender, [a.sender for a in acks], [a.epoch for a in acks], [a.step for a in acks],
                   [a.local_steps for a in acks], [a.ward_steps for a in acks], [a.disk_steps for a in acks],
                   [a.dirty_groups for a in acks], [a.early for a in acks])

    def answers(self) -> list[PrepareAck]:
        """Each member's answer on its own (columns of unequal lengths: cut to the shortest)."""
        return list(map(PrepareAck, self.members, self.epochs, self.steps, self.local_steps, self.ward_steps,
                        self.disk_steps, self.dirty_groups, self.early))


Message = (
    Join
    | Heartbeat
    | Welcome
    | CommitView
    | Prepare
    | PrepareAck
    | CollectiveFailed
    | Recovered
    | Finished
    | Stop
    | Fenced
    | AgentHello
    | ProcessExited
    | FenceKill
    | SnapshotHeader
    | SnapshotAck
    | RestoreRequest
    | RestoreReply
    | ChaosInjected
    | StatusRequest
    | StatusReply
    | ChaosCommand
    | ChaosResult
    | StepReport
    | SignalMember
    | HeartbeatBatch
    | ViewReport
    | Rejoin
    | UserException
    | Coordinators
    | StandbyHello
    | SilenceQuery
    | SilenceReport
    | StartStandby
    | ViewDelta
    | ViewChunk
    | ViewRequest
    | MoveCommand
    | MoveResult
    | Leave
    | Leaving
    | PeerPaused
    | HostHeartbeat
    | Relay
    | AckBatch
    | Audit
    | AuditDigest
    | LeaveAt
    | Hold
    | Holding
    | Takeover
)

# Append-only: a tag, once given, is never reused or renumbered.
REGISTRY: dict[int, type[Message]] = {
    1: Join,
    2: Heartbeat,
    3: Welcome,
    4: CommitView,
    5: Prepare,
    6: PrepareAck,
    7: CollectiveFailed,
    8: Recovered,
    9: Finished,
    10: Stop,
    11: Fenced,
    12: AgentHello,
    13: ProcessExited,
    14: FenceKill,
    15: SnapshotHeader,
    16: SnapshotAck,
    17: RestoreRequest,
    18: RestoreReply,
    19: ChaosInjected,
    20: StatusRequest,
    21: StatusReply,
    22: ChaosCommand,
    23: ChaosResult,
    24: StepReport,
    25: HeartbeatBatch,
    26: SignalMember,
    27: ViewReport,
    28: Rejoin,
    29: UserException,
    30: Coordinators,
    31: StandbyHello,
    32: SilenceQuery,
    33: SilenceReport,
    34: StartStandby,
    35: ViewDelta,
    36: ViewChunk,
    37: ViewRequest,
    38: MoveCommand,
    39: MoveResult,
    40: Leave,
    41: Leaving,
    45: PeerPaused,
    60: HostHeartbeat,
    61: Relay,
    62: AckBatch,
    63: Audit,
    64: AuditDigest,
    65: LeaveAt,
    66: Hold,
    67: Holding,
    68: Takeover,
}
TAGS: dict[type[Message], int] = {cls: tag for tag, cls in REGISTRY.items()}
# Sent again unchanged, often, while nothing changed: a host agent's heartbeat between its workers' steps, its
# hello every second. A receiver may decode each distinct frame of them once (``codec.Recent``).
REPEATED: tuple[type[Message], ...] = (HostHeartbeat, AgentHello)
