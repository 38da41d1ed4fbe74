"""Failure injection declared as data: ``kill:rank=2:step=20``, ``stop:rank=1:step=35:at=allreduce``.

Grammar: ``ACTION:KEY=VALUE[:KEY=VALUE...]`` with

- ACTION: ``kill`` (SIGKILL), ``stop`` (SIGSTOP; the member hangs, as a
  wedged host would) or ``partition`` (every DeadPool message to and from the
  member is dropped from then on, both ways, as a cut link would; its
  process and its gloo sockets live on)
- ACTION ``slow`` with ``rank=R:step=N:factor=F`` (F > 1): from step N on, the
  member's compute takes F times as long (it sleeps (F - 1) times its recent
  compute time at every step's start): the others wait for it in every
  collective, as for a throttled GPU
- ACTION ``preempt`` with ``host=H:step=N``: SIGTERM to the launcher of host
  H (its ``--node-rank``) once one of its workers reports step N, which a
  job of several hosts answers by draining that host (a preemption notice)
- ACTION ``corrupt`` with ``rank=R:step=N:what=param|grad|optim[:bit=B][:every=1]``:
  flips bit B (default 16) of the 32-bit word in the middle of the member's first
  parameter (after step N's optimizer step), of its first gradient bucket
  (before step N's all-reduce) or of its optimizer's first state tensor (after
  the step), as silent data corruption would; ``every=1`` flips it again at
  every step from N on (a faulty chip). Nothing crashes: only the replica
  checks (or ``--check-determinism``) can tell
- target: ``rank=R`` (the member that starts in seat R) or ``spare=J`` (the
  J-th spare started by the launcher)
- when: ``step=N`` for ranks (the step at which it fires) and ``after=SECONDS``
  for spares
- ``at=`` where inside the step: ``boundary`` (default: before step N starts),
  ``backward`` (during step N's backward pass) or ``allreduce`` (after step N's
  gradient all-reduce was issued, while it is in flight) or ``broadcast``
  (a ZeRO optimizer's parameter broadcast of step N in flight) or
  ``usercollective`` (the script's first own collective of step N on the
  default group, e.g. its ``dist.all_reduce``, in flight), ``allgather``,
  ``reducescatter``, ``forward`` or ``p2p`` (step N's first all-gather,
  reduce-scatter, other forward collective, or send/recv on a mesh group of
  ``rt.device_mesh``, in flight) or ``recovery``
  (while adopting the view that repairs a failure another spec injected at
  step N, as the coordinator's Prepare names it, so every survivor keys on the
  same step: a failure during a swap in progress)

Each spec fires once, in the member it names, by the member signalling itself:
a real SIGKILL or SIGSTOP from the kernel, at a precise point in the step.
A spec names the member that *starts* in a seat, so the spare that takes the
seat over does not fire it again when it replays the step.  Which points a
step passes depends on the script's parallelism (``WHERE``); a spec that never
fired makes a finished launch exit with ``NOT_FIRED_STATUS``.
"""

from __future__ import annotations

import enum
import os
import signal
from dataclasses import dataclass
from typing import Protocol

from deadpool.errors import MisuseError
from deadpool.events.vocabulary import ChaosAction as ChaosAction
from deadpool.events.vocabulary import Corrupted as Corrupted


class ChaosPoint(enum.StrEnum):
    """Where inside a step a rank's spec fires."""

    BOUNDARY = "boundary"
    BACKWARD = "backward"
    ALLREDUCE = "allreduce"
    BROADCAST = "broadcast"
    USER_COLLECTIVE = "usercollective"  # the script's own collective on the default group or its own group
    ALLGATHER = "allgather"  # an all-gather on a mesh group (FSDP2's, DTensor's), in flight (worker/groups/mesh.py)
    REDUCESCATTER = "reducescatter"  # a reduce-scatter on a mesh group (FSDP2's gradients), in flight
    FORWARD = "forward"  # another collective on a mesh group in forward (tensor parallel's all-reduce)
    P2P = "p2p"  # a send or recv on a mesh group (a pipeline stage's activations or gradients), in flight
    RECOVERY = "recovery"
    # Start-up, before step 0 (a spec with one of these needs no step): a bad node found at start-up.
    JOIN = "join"  # about to join (its script called deadpool.init()): the coordinator has not heard of it
    GROUPS = "groups"  # seated in the first view, building its groups (the others wait for this seat in theirs)
    SNAPSHOT = "snapshot"  # the first snapshot (of the initial state) taken, not yet confirmed by the buddy


# Where each point is, as the worker's code passes it (``worker/ddp.py``, ``groups/hub.py``, ``groups/mesh.py``,
# ``groups/default.py``): what a spec's ``at=`` means for the script's parallelism, in the warnings and closing lines.
WHERE = {
    ChaosPoint.BOUNDARY: "the start of the step",
    ChaosPoint.BACKWARD: "rt.ddp's gradient hooks, or a mesh collective inside a backward other than an all-gather, "
                         "reduce-scatter, send or recv (tensor parallel's all-reduce, expert parallel's all-to-all)",
    ChaosPoint.ALLREDUCE: "rt.ddp's gradient all-reduce, at the end of the backward",
    ChaosPoint.BROADCAST: "a broadcast on torch's default group (ZeroRedundancyOptimizer's parameters)",
    ChaosPoint.USER_COLLECTIVE: "the script's own collective on torch's default group, or one other than an "
                                "all-gather, reduce-scatter, send or recv on a dist.new_group() group",
    ChaosPoint.ALLGATHER: "an all-gather on a mesh group or a dist.new_group() group (FSDP2's, DTensor's)",
    ChaosPoint.REDUCESCATTER: "a reduce-scatter on a mesh group or a dist.new_group() group (FSDP2's gradients)",
    ChaosPoint.FORWARD: "a mesh collective outside a backward other than an all-gather, reduce-scatter, send or "
                        "recv (tensor parallel's forward all-reduce)",
    ChaosPoint.P2P: "a send or recv on a mesh group (a pipeline stage's)",
    ChaosPoint.RECOVERY: "the adoption of the view that repairs a failure another spec injected at that step",
    ChaosPoint.JOIN: "start-up: in deadpool.init(), before the member joins (its seat is filled in the first view)",
    ChaosPoint.GROUPS: "start-up: the first view's groups being built (rt.device_mesh's too, before the loop)",
    ChaosPoint.SNAPSHOT: "start-up: the initial state's snapshot taken, before the buddy confirmed its copy",
}
# `deadpool launch`'s exit status when training finished but a spec for one of its host's members never fired: the
# run tested no recovery, so it must not read as a pass (0 finished, 1 failed, 2 misuse, 128+N a signal).
NOT_FIRED_STATUS = 4

# Points every step passes (the boundary) or no step does (recovery, a view change): what a step's visit says
# nothing about.
STARTUP = frozenset({ChaosPoint.JOIN, ChaosPoint.GROUPS, ChaosPoint.SNAPSHOT})  # before step 0 (step -1)
NOT_PER_STEP = frozenset({ChaosPoint.BOUNDARY, ChaosPoint.RECOVERY, *STARTUP})

SIGNALS = {ChaosAction.KILL: signal.SIGKILL, ChaosAction.STOP: signal.SIGSTOP, ChaosAction.CONT: signal.SIGCONT}
SPEC_ACTIONS = (ChaosAction.KILL, ChaosAction.STOP, ChaosAction.PARTITION, ChaosAction.PREEMPT,
                ChaosAction.SLOW, ChaosAction.CORRUPT)  # what a --chaos spec may declare
CORRUPT_BIT = 16  # a corrupt: spec's default bit (a mantissa bit of a float32: the value changes, stays finite)
OPERATOR_ACTIONS = (ChaosAction.KILL, ChaosAction.STOP, ChaosAction.CONT)  # what `deadpool chaos` may send
POINTS = tuple(ChaosPoint)


@dataclass(frozen=True, slots=True)
class ChaosSpec:
    """One declared failure."""

    action: ChaosAction  # kill, stop or partition
    rank: int = -1  # seat of the member at launch, or -1
    spare: int = -1  # index of the spare at launch, or -1
    step: int = -1  # step at which a rank's spec fires
    after: float = -1.0  # seconds after start at which a spare's spec fires
    at: ChaosPoint = ChaosPoint.BOUNDARY  # point inside the step
    host: int = -1  # a preempt spec's host (its launcher's --node-rank), or -1
    factor: float = 0.0  # a slow spec's: how many times as long the member's compute takes
    what: Corrupted | None = None  # a corrupt spec's: which tensor
    bit: int = CORRUPT_BIT  # ... which bit of its middle 32-bit word
    every: bool = False  # ... flipped again at every step from `step` on

    def __str__(self) -> str:
        if self.action is ChaosAction.CORRUPT:
            return (f"corrupt:rank={self.rank}:step={self.step}:what={self.what}:bit={self.bit}"
                    + (":every=1" if self.every else ""))
        if self.action is ChaosAction.PREEMPT:
            return f"preempt:host={self.host}:step={self.step}"
        if self.action is ChaosAction.SLOW:
            return f"slow:rank={self.rank}:step={self.step}:factor={self.factor:g}"
        target = f"rank={self.rank}:step={self.step}" if self.rank >= 0 else f"spare={self.spare}:after={self.after}"
        suffix = f":at={self.at}" if self.at is not ChaosPoint.BOUNDARY else ""
        return f"{self.action}:{target}{suffix}"


def parse(spec: str) -> ChaosSpec:
    """Parse one spec.

    Raises:
        MisuseError: with what is wrong and an example of a valid spec.
    """
    example = "e.g. kill:rank=2:step=20, stop:rank=1:step=35:at=allreduce, kill:spare=0:after=3, preempt:host=1:step=6"
    action, _, rest = spec.partition(":")
    if action not in SPEC_ACTIONS:
        raise MisuseError(f"chaos spec {spec!r}: action must be one of {', '.join(SPEC_ACTIONS)} ({example})")
    fields: dict[str, str] = {}
    for part in rest.split(":") if rest else []:
        key, sep, value = part.partition("=")
        if not sep or key not in ("rank", "spare", "step", "after", "at", "host", "factor", "what", "bit", "every") \
                or key in fields:
            raise MisuseError(f"chaos spec {spec!r}: bad or repeated field {part!r} ({example})")
        fields[key] = value
    at = fields.get("at", ChaosPoint.BOUNDARY)
    if at not in POINTS:
        raise MisuseError(f"chaos spec {spec!r}: at= must be one of {', '.join(POINTS)}")
    try:
        parsed = ChaosSpec(
            action=ChaosAction(action),
            rank=int(fields.get("rank", -1)),
            spare=int(fields.get("spare", -1)),
            step=int(fields.get("step", -1)),
            after=float(fields.get("after", -1.0)),
            at=ChaosPoint(at),
            host=int(fields.get("host", -1)),
            factor=float(fields.get("factor", 0.0)),
        )
    except ValueError:
        raise MisuseError(f"chaos spec {spec!r}: rank, spare, step and host take integers, after takes seconds") \
            from None
    if parsed.action is ChaosAction.PREEMPT:
        if parsed.host < 0 or parsed.step < 0 or set(fields) != {"host", "step"}:
            raise MisuseError(f"chaos spec {spec!r}: preempt takes host=H:step=N and nothing else "
                              "(e.g. preempt:host=1:step=6)")
        return parsed
    if parsed.host >= 0:
        raise MisuseError(f"chaos spec {spec!r}: host= is for preempt only ({example})")
    if parsed.action is ChaosAction.CORRUPT:
        return _corrupt(spec, parsed, fields)
    if {"what", "bit", "every"} & set(fields):
        raise MisuseError(f"chaos spec {spec!r}: what=, bit= and every= are for corrupt only ({example})")
    if parsed.action is ChaosAction.SLOW:
        if parsed.rank < 0 or parsed.step < 0 or set(fields) != {"rank", "step", "factor"}:
            raise MisuseError(f"chaos spec {spec!r}: slow takes rank=R:step=N:factor=F and nothing else "
                              "(e.g. slow:rank=1:step=8:factor=3)")
        if not parsed.factor > 1:
            raise MisuseError(f"chaos spec {spec!r}: factor must be more than 1 (a seat F times slower), "
                              f"got {fields['factor']}")
        return parsed
    if "factor" in fields:
        raise MisuseError(f"chaos spec {spec!r}: factor= is for slow only ({example})")
    if (parsed.rank >= 0) == (parsed.spare >= 0):
        raise MisuseError(f"chaos spec {spec!r}: name exactly one target, rank=R or spare=J ({example})")
    if parsed.at in STARTUP and parsed.step != -1:
        raise MisuseError(f"chaos spec {spec!r}: at={parsed.at} is a start-up point, before step 0: leave out step=")
    if parsed.rank >= 0 and parsed.step < 0 and parsed.at not in STARTUP:
        raise MisuseError(f"chaos spec {spec!r}: a rank's failure needs step=N ({example})")
    if parsed.spare >= 0 and parsed.after < 0:
        raise MisuseError(f"chaos spec {spec!r}: a spare's failure needs after=SECONDS ({example})")
    return parsed


def _corrupt(spec: str, parsed: ChaosSpec, fields: dict[str, str]) -> ChaosSpec:
    """A ``corrupt:`` spec's own fields, checked.

    Raises:
        MisuseError: a field it does not take, or a tensor kind, bit or ``every`` that does not exist.
    """
    example = "e.g. corrupt:rank=2:step=15:what=param, corrupt:rank=1:step=12:what=grad:bit=20:every=1"
    if parsed.rank < 0 or parsed.step < 0 or "what" not in fields or set(fields) - {"rank", "step", "what", "bit",
                                                                                      "every"}:
        raise MisuseError(f"chaos spec {spec!r}: corrupt takes rank=R:step=N:what=param|grad|optim[:bit=B][:every=1] "
                          f"and nothing else ({example})")
    if fields["what"] not in tuple(Corrupted):
        raise MisuseError(f"chaos spec {spec!r}: what= must be one of {', '.join(Corrupted)} (a parameter, a local "
                          f"gradient or the optimizer state), got {fields['what']!r}")
    bit = fields.get("bit", str(CORRUPT_BIT))
    if not bit.isdigit() or not 0 <= int(bit) < 32:
        raise MisuseError(f"chaos spec {spec!r}: bit= must be 0..31 (a bit of a 32-bit word), got {bit!r}")
    if fields.get("every", "1") not in ("0", "1"):
        raise MisuseError(f"chaos spec {spec!r}: every= takes 1 (again at every step from step= on) or 0, "
                          f"got {fields['every']!r}")
    return ChaosSpec(action=parsed.action, rank=parsed.rank, step=parsed.step, what=Corrupted(fields["what"]),
                     bit=int(bit), every=fields.get("every", "0") == "1")


def unreachable(spec: ChaosSpec, world: int | None, spares: int, steps: int | None,
                hosts: int | None = None) -> tuple[str, str]:
    """Why `spec` can never fire in a launch: (refusal, warning), "" for none.

    `world` is the job's seat count (None when unknown: a launch that only adds spares),
    `spares` the launch's ``--spares`` (a spare index counts on its own host), and `steps`
    the script's step count when the launcher can see it (``--steps N`` in its arguments).
    A rank or spare beyond what is started is certain; a step beyond the end is only as sure
    as that argument, so it is a warning. `hosts`: the job's ``--nnodes`` (a preempt spec's host).
    """
    if spec.action is ChaosAction.PREEMPT and hosts is not None and spec.host >= hosts:
        return (f"chaos spec {str(spec)!r} names host {spec.host}, but the job has {hosts} host(s) "
                f"(--nnodes {hosts}; hosts 0..{hosts - 1}): it could never fire"), ""
    if spec.rank >= 0 and world is not None and spec.rank >= world:
        return (f"chaos spec {str(spec)!r} names rank {spec.rank}, but the world has {world} seat(s) "
                f"(ranks 0..{world - 1}): it could never fire"), ""
    if spec.spare >= 0 and spec.spare >= spares:
        return (f"chaos spec {str(spec)!r} names spare {spec.spare}, but this launch starts {spares} spare(s) "
                f"(--spares {spares}; spares are numbered from 0 on each host): it could never fire"), ""
    if spec.rank >= 0 and steps is not None and spec.step >= steps:
        return "", (f"chaos spec {str(spec)!r} fires at step {spec.step}, but the script's arguments say --steps "
                    f"{steps} (steps 0..{steps - 1}): it will not fire if that is the step count (the launcher "
                    f"sees only the script's arguments, not its loop), and a run that finishes then exits "
                    f"{NOT_FIRED_STATUS}")
    return "", ""


def parse_all(text: str) -> list[ChaosSpec]:
    """Parse a comma-separated list (the form carried in DEADPOOL_CHAOS)."""
    return [parse(item) for item in text.split(",") if item.strip()]


def applies(spec: ChaosSpec, initial_rank: int, spare_index: int) -> bool:
    """Whether `spec` is for the process started at `initial_rank` (-1: a spare) as its host's spare `spare_index`."""
    return (spec.rank >= 0 and spec.rank == initial_rank) or (spec.spare >= 0 and spec.spare == spare_index)


def host_specs(specs: list[str], first_rank: int, nproc: int, spares: int) -> list[str]:
    """The specs (as ``str(ChaosSpec)`` writes them) that one host's workers fire: ranks first_rank.. and its spares."""
    parsed = [parse(spec) for spec in specs]
    return [str(s) for s in parsed
            if any(applies(s, rank, -1) for rank in range(first_rank, first_rank + nproc))
            or any(applies(s, -1, index) for index in range(spares))]


def unseen(specs: list[ChaosSpec], seen: set[ChaosPoint], step: int) -> list[ChaosSpec]:
    """The rank specs still to fire at `step` or later whose point a finished step that passed `seen` did not pass.

    A step of a script passes the same points as the next one, as a rule (a script's own collective every N
    steps is the exception), so such a spec will likely never fire: an ``at=backward`` spec on an FSDP2 script,
    whose backward holds only all-gathers and reduce-scatters, say.
    """
    return [spec for spec in specs
            if spec.rank >= 0 and spec.step >= step and spec.at not in NOT_PER_STEP and spec.at not in seen]


class ChaosPlan:
    """The specs that apply to this process, each fired at most once."""

    def __init__(self, specs: list[ChaosSpec], initial_rank: int, spare_index: int) -> None:
        self._specs = [s for s in specs if applies(s, initial_rank, spare_index)]
        self._fired: set[ChaosSpec] = set()

    def corrupt_due(self, what: Corrupted, step: int) -> ChaosSpec | None:
        """The ``corrupt:`` spec for `what` due at `step` (at its step, or any later one with ``every``), if any."""
        for spec in self._specs:
            again = spec.every and spec.step <= step  # a faulty chip: every step from its step on
            if spec.what == what and (again or (spec.step == step and spec not in self._fired)):
                self._fired.add(spec)
                return spec
        return None

    def due(self, point: ChaosPoint, step: int) -> ChaosSpec | None:
        """The rank spec due at (point, step), if any, marked as fired."""
        for spec in self._specs:
            if spec.rank >= 0 and spec.what is None and spec.at == point and spec.step == step \
                    and spec not in self._fired:
                self._fired.add(spec)
                return spec
        return None

    def spare_due(self, elapsed: float) -> ChaosSpec | None:
        """The spare spec due after `elapsed` seconds, if any, marked as fired."""
        for spec in self._specs:
            if spec.spare >= 0 and elapsed >= spec.after and spec not in self._fired:
                self._fired.add(spec)
                return spec
        return None

    def pending(self) -> list[ChaosSpec]:
        """The specs for this process that have not fired."""
        return [spec for spec in self._specs if spec not in self._fired]

    def declares(self, action: ChaosAction) -> bool:
        """Whether a spec for this process does `action` (a ``partition:`` one needs wrapped transports)."""
        return any(spec.action is action for spec in self._specs)

    def next_spare_deadline(self) -> float | None:
        pending = [s.after for s in self._specs if s.spare >= 0 and s not in self._fired]
        return min(pending) if pending else None


class Switch(Protocol):
    """What a partition spec cuts (``deadpool.transports.partitioned.PartitionSwitch``)."""

    cut: bool


def inject(spec: ChaosSpec, partition: Switch) -> None:
    """Deliver the spec's failure to this very process (returns only after a SIGSTOP is continued)."""
    if spec.action is ChaosAction.PARTITION:
        partition.cut = True
    else:
        os.kill(os.getpid(), SIGNALS[spec.action])
