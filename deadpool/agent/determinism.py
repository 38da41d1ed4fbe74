"""``deadpool launch --check-determinism``: one script run three times, and the first state that differs.

A kill is recovered bit-identically only if everything that changes between steps is
tracked; state that is not (a data iterator, an RNG of the script's own) makes the killed run
diverge silently.  This check runs the script failure-free twice and once with a kill, reads
each seat's per-object digests (the ``seat_finished`` record of the event schema: ``parts`` per tracked
name, ``rngs`` per RNG kind), and names the first tracked object or RNG that differs.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from deadpool.chaos import NOT_FIRED_STATUS
from deadpool.errors import MisuseError
from deadpool.events import schema
from deadpool.events.vocabulary import ChaosAction

DEFAULT_KILL_STEP = 5  # the kill's step when the script's arguments show no --steps
RNG_PREFIX = "rng:"  # digest names of the RNG kinds ("rng:torch", "rng:python", ...), after the tracked names

Digests = dict[int, dict[str, str]]  # rank -> name -> SHA-256 hex


@dataclass(frozen=True, slots=True)
class Run:
    """What one of the three runs left: its exit status, its seats' digests, and the failures it saw."""

    label: str  # "failure-free", "failure-free again", "with a kill"
    returncode: int
    digests: Digests
    failures: int  # member_failed events (the kill run must have one)
    corrupted: bool = False  # a corrupt: chaos spec flipped a bit (no failure to expect: only a digest to compare)


def digests_of(records: Iterable[schema.Line]) -> tuple[Digests, int, bool]:
    """Each seat's per-object digests from its (last) seat_finished event, the number of failures, and whether a
    ``corrupt:`` chaos spec flipped a bit."""
    seats: Digests = {}
    failures = 0
    corrupted = False
    for record in records:
        match record:
            case schema.MemberFailed():
                failures += 1
            case schema.ChaosInjected(action=ChaosAction.CORRUPT):
                corrupted = True
            case schema.SeatFinished(rank=int() as rank):
                names = {name: d for name, d in record.parts.items() if name != "__rng__"}
                names.update({f"{RNG_PREFIX}{kind}": d for kind, d in record.rngs.items()})
                seats[rank] = names
    return seats, failures, corrupted


def compare(reference: Run, again: Run, killed: Run) -> tuple[bool, list[str]]:
    """Whether the three runs agree, and the lines that say so or name the first difference.

    A kill run that ended with the launcher's ``NOT_FIRED_STATUS``, or finished without a failure, tested
    nothing (``never_fired``): it is a failure of the check, named as such.

    Names are compared in order: the tracked objects (as tracked), then the RNGs.  An RNG that
    differs between the two failure-free runs is not seeded by the script (Python's ``random``
    is seeded from the OS unless the script seeds it); it is noted and left out.  A tracked
    object that differs between them makes the script irreproducible by itself, which no
    recovery can fix.
    """
    for run in (reference, again):
        if not _finished(run):
            return False, [f"the run {run.label} did not finish (exit {run.returncode}): nothing to compare"]
    if never_fired(killed):
        return False, [f"the run {killed.label} saw no failure (exit {killed.returncode}): the kill never fired "
                       "(its step beyond the script's last step, or its at= point not in this script's steps: "
                       "the run's closing lines say which); give one that fires with --chaos kill:rank=R:step=S"]
    if not _finished(killed):
        return False, [f"the run {killed.label} did not finish (exit {killed.returncode}): nothing to compare"]
    if not set(reference.digests) == set(again.digests) == set(killed.digests):
        return False, [f"the runs finished with different seats: {sorted(reference.digests)}, "
                       f"{sorted(again.digests)}, {sorted(killed.digests)}"]
    names = list(dict.fromkeys(name for seat in sorted(reference.digests) for name in reference.digests[seat]))
    lines: list[str] = []
    unseeded: set[str] = set()
    for name in names:
        ranks = _differing(reference.digests, again.digests, name)
        if not ranks:
            continue
        if name.startswith(RNG_PREFIX):
            unseeded.add(name)
            lines.append(f"note: {_label(name)} differs between the two failure-free runs on rank(s) {ranks}: the "
                         "script does not seed it, so it is not compared (seed it if the training uses it)")
            continue
        return False, [*lines, f"{_label(name)} differs between the two failure-free runs on rank(s) {ranks}: "
                       "the script is not reproducible by itself (an unseeded RNG, nondeterministic kernels, the "
                       "data order), so no recovery can match it; make it reproducible first"]
    for name in names:
        if name in unseeded:
            continue
        ranks = _differing(reference.digests, killed.digests, name)
        if ranks and killed.corrupted and not killed.failures:
            return False, [*lines, f"first difference: {_label(name)} on rank(s) {ranks} differs after the injected "
                           "corruption from both failure-free runs: the flipped bit went unseen and unrepaired "
                           "(are the replica checks off, --replica-checks 0, or is the tensor not replicated?)"]
        if ranks:
            return False, [*lines, f"first difference: {_label(name)} on rank(s) {ranks} differs after the kill "
                           "from both failure-free runs. State that changes between steps but is not tracked "
                           "(a data iterator, an RNG of the script's own, a counter) diverges after a rollback: "
                           "track it with rt.track(name=obj), anything with state_dict()/load_state_dict()"]
    tracked = sum(1 for name in names if not name.startswith(RNG_PREFIX))
    rngs = len(names) - tracked - len(unseeded)
    return True, [*lines, f"all three runs agree: {tracked} tracked object(s) and {rngs} RNG(s) on "
                  f"{len(reference.digests)} seat(s), bit for bit"]


def never_fired(killed: Run) -> bool:
    """The kill run's kill never fired: its launch said so (``NOT_FIRED_STATUS``), or it finished with no failure
    (and no corruption, which need not cause one)."""
    return killed.returncode == NOT_FIRED_STATUS or (killed.returncode == 0 and killed.failures == 0
                                                     and not killed.corrupted)


def _finished(run: Run) -> bool:
    return run.returncode == 0 and bool(run.digests)


def _differing(left: Digests, right: Digests, name: str) -> list[int]:
    return [rank for rank in sorted(left) if left[rank].get(name) != right.get(rank, {}).get(name)]


def _label(name: str) -> str:
    return f"the {name[len(RNG_PREFIX):]} RNG" if name.startswith(RNG_PREFIX) else f"tracked object {name!r}"


def kill_spec(world: int, steps: int | None) -> str:
    """The kill the third run gets when no --chaos is given: rank 1 (0 in a world of one), half-way."""
    step = max(1, steps // 2) if steps is not None and steps >= 2 else DEFAULT_KILL_STEP
    return f"kill:rank={1 if world > 1 else 0}:step={step}"


def check(args: argparse.Namespace, steps: int | None, launch: Callable[[argparse.Namespace], tuple[int, str]]) -> int:
    """Run the three launches with `launch` (returns exit status and events file); 0 when all agree,
    ``NOT_FIRED_STATUS`` when the kill never fired (as a launch whose spec never fired), else 1.

    Raises:
        MisuseError: the job cannot be checked this way (more than one host, or a world of one).
    """
    if args.nnodes != 1 or args.coordinator:
        raise MisuseError("--check-determinism runs the whole job on this host: drop --nnodes/--coordinator")
    if args.nproc < 2:
        raise MisuseError("--check-determinism needs --nproc 2 or more: a kill of the only seat cannot be "
                          "recovered from memory")
    if getattr(args, "resume", False):
        raise MisuseError("--check-determinism starts every run from step 0: drop --resume")
    chaos = list(args.chaos) or [kill_spec(args.nproc, steps)]
    folder = Path(tempfile.mkdtemp(prefix="deadpool-determinism-"))
    plan = [("failure-free", [], args.spares), ("failure-free again", [], args.spares),
            ("with a kill", chaos, max(1, args.spares))]
    runs: list[Run] = []
    for i, (label, specs, spares) in enumerate(plan, 1):
        run_args = copy.copy(args)
        run_args.chaos, run_args.spares, run_args.check_determinism = specs, spares, False
        run_args.strict = False  # the check compares the digests itself
        run_args.events = f"{args.events}.{i}" if args.events else str(folder / f"run{i}.jsonl")
        if args.checkpoint_dir:  # a folder each: a run must not meet an earlier run's checkpoints
            run_args.checkpoint_dir = str(Path(args.checkpoint_dir) / f"run{i}")
        what = f" ({', '.join(specs)}, --spares {spares})" if specs else ""
        print(f"deadpool: --check-determinism: run {i}/3, {label}{what}", flush=True)
        code, events = launch(run_args)
        seats, failures, corrupted = digests_of(schema.iter_file(events) if Path(events).exists() else [])
        runs.append(Run(label, code, seats, failures, corrupted))
    ok, lines = compare(*runs)
    out = sys.stdout if ok else sys.stderr
    print(f"deadpool: --check-determinism {'PASSED' if ok else 'FAILED'}", file=out, flush=True)
    for line in lines:
        print(f"  {line}", file=out, flush=True)
    if ok:
        return 0
    return NOT_FIRED_STATUS if _finished(runs[0]) and _finished(runs[1]) and never_fired(runs[2]) else 1
