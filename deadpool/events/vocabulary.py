"""The closed vocabularies the events file uses: every field whose value is one of a known few is one of these.

The event schema (``events.schema``) types those fields with these enums, so a reader validates the value
and compares members, never text.  The rooms that make the decisions re-export them under their own names
(``coordinator.decisions.Trigger``, ``chaos.ChaosAction``, ``worker.restore.Source``).  A ``StrEnum``
member equals its string, so the JSON on disk is the plain value.  Append new values; never rename one.
"""

from __future__ import annotations

import enum


class Detector(enum.StrEnum):
    """What found a member dead (``member_failed``'s ``detected_by``)."""

    HEARTBEAT = "heartbeat"  # silent, directly and through its host agent, for the failure timeout
    EXIT = "exit"  # its host agent saw its process end
    PREPARE_TIMEOUT = "prepare_timeout"  # a survivor that did not answer the round's Prepare in time
    EXCEPTION = "exception"  # its script raised (the first of its kind: replaced once)
    OPERATOR = "operator"  # declared dead by a person or a test (``Coordinator.declare_dead``)
    REPLICA_CHECK = "replica_check"  # its replicated state's checksum disagreed with every other seat's (corrupt)
    AUDIT = "audit"  # a spare re-did one of its steps and computed other local gradients (corrupt)


class Trigger(enum.StrEnum):
    """What started a view change: the ``trigger`` field of view_prepared and view_committed.

    Beside the human-readable ``reason``, so that readers count by value, never by prose.
    """

    FIRST_VIEW = "first_view"  # every seat joined
    SEAT_LOST = "seat_lost"  # a seated member was declared dead
    BLIND_REBUILD = "blind_rebuild"  # a collective failed but nobody was found dead: the group is rebuilt
    SPARE_FAILED = "spare_failed"  # the spare chosen for a swap failed: choosing again
    SPARE_JOINED = "spare_joined"  # a spare joined the pool (or the seat that waited for one)
    SPARE_LOST = "spare_lost"  # a spare in the pool was declared dead
    MOVE = "move"  # a seated member left at a step boundary for a planned move
    DRAIN = "drain"  # the spares of a drained host left the pool
    CORRUPTION = "corruption"  # a seat found corrupt (silent data corruption) is replaced and every seat rolls back


class MoveTrigger(enum.StrEnum):
    """Why a planned move was asked for (``move_requested``'s ``trigger``)."""

    OPERATOR = "operator"  # ``deadpool move``
    DRAIN = "drain"  # ``deadpool drain``: every seat of a host
    PREEMPTION = "preemption"  # a host's launcher got SIGTERM: its host is drained
    SLOW = "slow"  # --replace-slow: a seat stayed slow and the cost model says a move pays


class RestoreSource(enum.StrEnum):
    """Where an adopting seat's state comes from (the ``restored`` event's ``source``)."""

    INITIAL = "initial"  # the job's initial state, as the script built it: nothing is restored
    LOCAL = "local"  # this member's own snapshot (its live tensors where they still hold it)
    BUDDY = "buddy"  # the copy the seat's buddy holds, with the peers' slices of the replicated region
    MOVER = "mover"  # a move's: the moving member's own snapshot, fetched as it ended its last step, and the slices
    DISK = "disk"  # the disk checkpoint


class ChaosAction(enum.StrEnum):
    """What a chaos spec or an operator's chaos command does to a member."""

    KILL = "kill"  # SIGKILL: a crash
    STOP = "stop"  # SIGSTOP: a hang
    CONT = "cont"  # SIGCONT: undoes a stop (operator only)
    PARTITION = "partition"  # every DeadPool message dropped both ways (spec only)
    PREEMPT = "preempt"  # SIGTERM to a host's launcher: a preemption notice (spec only, fired by that launcher)
    SLOW = "slow"  # the member computes `factor` times as long from its step on: a straggler (spec only)
    CORRUPT = "corrupt"  # one bit of a parameter, local gradient or optimizer state flipped: silent corruption


class Corrupted(enum.StrEnum):
    """Which tensor a ``corrupt:`` chaos spec flips a bit of (its ``what=``)."""

    PARAM = "param"  # a parameter, after the step's optimizer step
    GRAD = "grad"  # a local gradient, before its all-reduce (rt.ddp)
    OPTIM = "optim"  # the optimizer's state, after its step


class ChaosVia(enum.StrEnum):
    """Who injected a fault (``chaos_injected``'s ``via``)."""

    SPEC = "spec"  # a ``--chaos`` spec the member was armed with
    OPERATOR = "operator"  # ``deadpool chaos``, through the coordinator and the member's host agent


class Raised(enum.StrEnum):
    """What to do about an exception a training script raised (``user_exception``'s ``verdict``)."""

    SWAP = "swap"  # the first of its kind: treat it as the member's failure and replace it once
    STOP = "stop"  # it repeats in another process at the same step: the script's own error, stop the job


class FailureCause(enum.StrEnum):
    """The machine cause a ``job_failed`` names in ``reason`` when it has one (its prose is then in ``detail``)."""

    USER_ERROR = "user_error"  # the script's own exception, raised in more than one process


class RejectReason(enum.StrEnum):
    """Why a ``rejected`` line dropped a message, where a reader counts by it (others are the codec's text)."""

    FENCED_PEER = "fenced_peer"  # a fenced member spoke: it is told again that it is out
