"""What the membership service remembers, and what it asks its caller to send.

Plain records, no behaviour: the coordinator's state machine (``service.py``)
keeps them, its pure decisions (``decisions.py``) read them, and the process
around it (``main.py``, or the simulator) delivers the :class:`Send` list that
every ``handle``/``tick`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deadpool.coordinator.decisions import Trigger
from deadpool.protocol.immutable import immutable
from deadpool.protocol.messages import AgentHello, Message, Prepare, PrepareAck, Relay, Role, Welcome


@immutable
class Send:
    """One message the coordinator wants delivered; the caller encodes and sends it (bounded by send_timeout)."""

    address: str  # control address of the member or agent
    message: Message  # broadcasts repeat one object, so the caller can encode it once
    relay: Relay | None = None  # `address` is a host agent: send this header, then `message`, for it to pass on
    # The coordinator sends this very message object to `address` again and again while it holds (an agent's
    # Welcome, every second): the caller may keep its frame by address (``fanout.encoded``'s `kept`).
    again: bool = False


@dataclass(slots=True)
class MemberRecord:
    """What the coordinator knows of one member."""

    member: str  # member id
    role: Role  # as it joined (active or spare)
    host: str  # host name, for failure domains
    pid: int  # process id on that host (0: known only from a reported view)
    control_addr: str  # where its membership actor listens ("": not reachable until it re-joins)
    bulk_addr: str  # where its snapshot actor listens
    seat_hint: int  # the seat it asked for (its RANK; -1 for a spare)
    joined: float  # coordinator clock at its Join
    last_seen: float  # coordinator clock of its newest accepted message
    step: int = -1  # newest finished step it reported
    snapshot_step: int = -2  # newest local snapshot it reported
    confirmed_step: int = -2  # newest snapshot its buddy confirmed holding
    stall_p99_s: float = 0.0  # p99 of its pre-step wait for the snapshot copy
    compute_s: float = 0.0  # its recent step time outside collective waits (Heartbeat.compute_s)
    epoch: int = 0  # view epoch it reported holding
    exited: bool = False  # its agent reported the process gone (no kill needed)


@dataclass(slots=True)
class Round:
    """A view change in progress (between Prepare and Commit)."""

    epoch: int  # the epoch prepared (and committed when every survivor answered)
    failed: dict[int, str]  # seat -> dead member
    replacements: dict[int, str]  # seat -> spare chosen ({} while waiting for a spare to join)
    acks: dict[str, PrepareAck]  # survivor -> its answer, as it arrived (nothing copied per answer)
    deadline: float  # survivors that have not answered by then are declared dead
    reason: str  # why the round started, and the spares chosen
    trigger: Trigger = Trigger.SEAT_LOST  # the same, for readers that count (events' ``trigger``)
    joined: list[str] = field(default_factory=list)  # spares that joined during the round: pooled at the commit
    waiting_since: float | None = None  # no_spare_policy "wait": when the wait for a spare began
    withheld: bool = False  # its commit waits for the lease (commit_withheld was emitted once)
    first_epoch: int = 0  # the epoch of its first Prepare: answers to any Prepare of the round count
    prepare: Prepare | None = None  # its newest Prepare, sent again directly to the silent at `resend_at`
    resend_at: float = float("inf")  # some of it went through agents (fanout.py): when to resend it directly
    # A planned move's: the step its seats left after (each confirmed at its buddy). Early answers, which name only
    # the newest snapshot complete then, commit only at this step or later; the full ones decide otherwise.
    wanted: int = -2
    limit: int | None = None  # a corruption's: the newest step it may resume from (checks passed on every seat)


@dataclass(slots=True)
class PendingSwap:
    """A seat refilled by a spare, until that spare reports its first finished step (swap_completed)."""

    seat: int  # the seat refilled
    old_member: str  # the member that died
    new_member: str  # the spare seated
    failed_at: float  # wall clock of the first evidence of the failure
    epoch: int  # the view that seated the spare


@dataclass(slots=True)
class Agent:
    """One host's `deadpool launch`: it reports exits, kills fenced members and batches heartbeats."""

    agent_id: str  # agent id (the sender of its messages)
    host: str  # the host it runs on
    control_addr: str  # where it listens
    members: dict[str, int] = field(default_factory=dict)  # member -> pid, the processes it started
    seen: float = 0.0  # when its last hello arrived (the lease counts the hosts heard recently)
    hello: AgentHello | None = None  # its hello as registered: a repeat (every second) changes nothing
    welcome: Welcome | None = None  # the answer to its hello, sent again as the same object while it holds
