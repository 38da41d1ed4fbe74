"""``deadpool chaos``: kill, stop or continue a member of a live job, now, at a step or after a delay.

The coordinator, not this tool, carries out chaos: it resolves a rank to the member seated
there, asks that member's host agent to deliver the signal, and logs a ``chaos_injected``
event, so every action lands in the events file next to the failure and the swap it causes.
``chaos random`` is a loop of the same requests whose targets are drawn from the live
status with a seeded RNG, so a soak run can be repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deadpool.agent import jobfile
from deadpool.chaos import OPERATOR_ACTIONS, ChaosAction
from deadpool.errors import MisuseError, PeerFailure, WaitTimeout
from deadpool.protocol.messages import ChaosCommand, ChaosResult

from .request import DEFAULT_TIMEOUT, add_connection_arguments, exchange, fetch_status, job_of, locate

RANDOM_ACTIONS = (ChaosAction.KILL, ChaosAction.STOP)  # cont undoes a stop; alone it injects nothing
SETTLE_TIMEOUT = 120.0  # chaos random waits this long for the job to be ready for the next failure


async def send_chaos(job: jobfile.JobInfo, action: str, rank: int = -1, member: str = "", at_step: int = -1,
                     timeout: float = DEFAULT_TIMEOUT, bind_host: str = "") -> ChaosResult:
    """Ask the coordinator to signal a member; the result says whether it was done or armed, and why not.

    Raises:
        MisuseError: an unknown action, or not exactly one target.
        WaitTimeout: no answer within `timeout`.
    """
    if action not in OPERATOR_ACTIONS:
        raise MisuseError(f"unknown chaos action {action!r}: use one of {', '.join(OPERATOR_ACTIONS)}")
    if (rank >= 0) == bool(member):
        raise MisuseError("name the target: --rank R (a seat) or --member ID (see `deadpool status`), not both")
    command = ChaosAction(action)
    if job.coordinators:  # a job with a standby: the active coordinator of the newest term carries it out
        job, _ = await locate(job, timeout, bind_host)
    reply = await exchange(job, lambda addr, nonce: ChaosCommand(command, rank, member, at_step, addr, nonce),
                           ChaosResult, timeout, bind_host)
    assert isinstance(reply, ChaosResult)
    return reply


# -- chaos random: targets drawn from the live status --------------------------------------------


@dataclass(frozen=True, slots=True)
class RandomPick:
    """One action chosen by ``chaos random``."""

    action: str  # kill or stop
    rank: int  # the seat to hit
    member: str  # who sat there when it was chosen


def pick_random(rng: random.Random, status: dict[str, Any], actions: Sequence[str]) -> RandomPick | str:
    """Choose the next failure from a status document, or say why the job is not ready for one.

    Pure: the same seed and the same sequence of ready states give the same
    picks (the RNG is drawn only when a pick is made).  Ready means no view
    change in progress, every seat alive and at least one spare to take over,
    so a soak run exercises hot swaps rather than ending the job.
    """
    if status.get("outcome"):
        return f"the job ended: {status['outcome'].get('reason', '')}"
    if status.get("round"):
        return "a view change is in progress"
    seats = [s for s in status.get("seats", []) if isinstance(s, dict)]
    if not seats:
        return "no view committed yet"
    if any(s.get("state") != "active" for s in seats):
        return "a seat is not active yet"
    if not status.get("spares"):
        return "no spare left to take a seat"
    if any(int(s.get("step", -1)) < 0 for s in seats):
        return "training has not finished its first step"
    seat = rng.choice(sorted(seats, key=lambda s: int(s["rank"])))
    return RandomPick(rng.choice(list(actions)), int(seat["rank"]), str(seat.get("member", "")))


async def random_chaos(job: jobfile.JobInfo, seed: int, failures: int, interval: float, actions: Sequence[str],
                       timeout: float = DEFAULT_TIMEOUT, settle_timeout: float = SETTLE_TIMEOUT,
                       bind_host: str = "", report: Callable[[str], None] = lambda line: None) -> int:
    """Inject `failures` actions, one every `interval` seconds once the job is ready; returns how many were done.

    Raises:
        WaitTimeout: the coordinator stopped answering, or the job was not ready within `settle_timeout`.
        PeerFailure: the job ended, or the coordinator refused an action.
    """
    rng = random.Random(seed)
    for index in range(1, failures + 1):
        await asyncio.sleep(interval)
        deadline = time.monotonic() + settle_timeout
        while True:
            status = await fetch_status(job, timeout, bind_host)
            pick = pick_random(rng, status, actions)
            if isinstance(pick, RandomPick):
                break
            if status.get("outcome"):
                raise PeerFailure(f"{pick}; {index - 1} of {failures} failures injected")
            if time.monotonic() > deadline:
                raise WaitTimeout(f"the job was not ready for failure {index} within {settle_timeout:g}s: {pick}")
            await asyncio.sleep(0.5)
        result = await send_chaos(job, pick.action, rank=pick.rank, timeout=timeout, bind_host=bind_host)
        report(f"[{index}/{failures}] seed {seed}: {pick.action} rank {pick.rank} ({pick.member}): {result.detail}")
        if not result.ok:
            raise PeerFailure(f"the coordinator refused {pick.action} rank {pick.rank}: {result.detail}")
    return failures


# -- the command line -----------------------------------------------------------------------------

_HELPS = {ChaosAction.KILL: "SIGKILL a member (a crash)", ChaosAction.STOP: "SIGSTOP a member (a hang)",
          ChaosAction.CONT: "SIGCONT a stopped member"}


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``deadpool chaos``: one sub-command per action, plus ``random``."""
    actions = parser.add_subparsers(dest="action", required=True,
                                    metavar="{" + ",".join([*OPERATOR_ACTIONS, "random"]) + "}")
    for action in OPERATOR_ACTIONS:
        sub = actions.add_parser(action.value, help=_HELPS[action])
        sub.add_argument("--rank", type=int, default=-1, help="the member seated at this rank")
        sub.add_argument("--member", default="", help="the member with this id (e.g. a spare)")
        sub.add_argument("--at-step", type=int, default=-1, help="when the target finishes this step")
        sub.add_argument("--after", type=float, default=0.0, help="after this many seconds")
        add_connection_arguments(sub)
    rand = actions.add_parser("random", help="seeded failures at random seats, for soak runs")
    rand.add_argument("--seed", type=int, required=True, help="RNG seed: the same seed picks the same seats")
    rand.add_argument("--failures", type=int, required=True, help="how many actions to inject")
    rand.add_argument("--interval", type=float, required=True, help="seconds between actions")
    rand.add_argument("--actions", default="kill", help="comma-separated, from kill,stop (default kill)")
    rand.add_argument("--settle-timeout", type=float, default=SETTLE_TIMEOUT,
                      help="seconds to wait for the job to be ready (no view change, a spare left) before each action")
    add_connection_arguments(rand)


def run_chaos(args: argparse.Namespace) -> int:
    """``deadpool chaos``: one action now, at a step or after a delay; or ``random`` for soak runs.

    Raises:
        MisuseError: bad arguments (exit status 2).
    """
    if args.action == "random":
        return _run_random(args)
    if args.rank < -1:
        raise MisuseError(f"--rank must be >= 0, got {args.rank}")
    if (args.rank >= 0) == bool(args.member):
        raise MisuseError(f"name the target: --rank R (a seat) or --member ID (see `deadpool status`), "
                          f"{'not both' if args.member else 'got neither'}")
    if args.after < 0 or (args.after > 0 and args.at_step >= 0):
        raise MisuseError("give --at-step N or --after SECONDS (>= 0), not both")
    job = job_of(args)

    async def act() -> ChaosResult:
        await asyncio.sleep(args.after)
        return await send_chaos(job, args.action, args.rank, args.member, args.at_step, args.timeout, args.bind_host)

    result = asyncio.run(act())
    print(f"deadpool chaos: {result.detail}", flush=True)
    return 0 if result.ok else 1


def _run_random(args: argparse.Namespace) -> int:
    actions = [a.strip() for a in args.actions.split(",") if a.strip()]
    if not actions or any(a not in RANDOM_ACTIONS for a in actions):
        raise MisuseError(f"--actions takes a comma-separated list from {','.join(RANDOM_ACTIONS)}, "
                          f"got {args.actions!r}")
    if args.failures < 1:
        raise MisuseError(f"--failures must be at least 1, got {args.failures}")
    if not args.interval > 0 or not args.settle_timeout > 0:
        raise MisuseError("--interval and --settle-timeout must be positive")
    job = job_of(args)

    def report(line: str) -> None:
        print(f"deadpool chaos random {line}", flush=True)

    done = asyncio.run(random_chaos(job, args.seed, args.failures, args.interval, actions, args.timeout,
                                    args.settle_timeout, args.bind_host, report))
    print(f"deadpool chaos random: {done} failure{'s' if done != 1 else ''} injected", flush=True)
    return 0
