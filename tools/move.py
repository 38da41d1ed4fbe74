"""``deadpool move`` and ``deadpool drain``: planned moves of live seats to spares, with no finished step redone.

The coordinator carries them out (``deadpool/coordinator/moves.py``): it checks the request, answers at
once, and tells each moving member to leave at its next step boundary; ``deadpool status`` then shows
the moves in progress and the drained hosts. A refusal (no such seat or host, a seat already moving,
too few spares where they may go) exits 2 with the coordinator's one line, the job untouched.
"""

from __future__ import annotations

import argparse
import asyncio

from deadpool.agent import jobfile
from deadpool.errors import MisuseError
from deadpool.protocol.messages import MoveCommand, MoveResult

from .request import DEFAULT_TIMEOUT, add_connection_arguments, exchange, job_of, locate


async def send_move(job: jobfile.JobInfo, rank: int = -1, member: str = "", spare: str = "", host: str = "",
                    reason: str = "", timeout: float = DEFAULT_TIMEOUT, bind_host: str = "") -> MoveResult:
    """Ask the coordinator for a move (a seat, by rank or member) or a drain (`host`); returns its answer.

    Raises:
        WaitTimeout: no answer within `timeout`.
    """
    if job.coordinators:  # a job with a standby: the active coordinator of the newest term carries it out
        job, _ = await locate(job, timeout, bind_host)
    reply = await exchange(job, lambda addr, nonce: MoveCommand(rank, member, spare, host, reason, addr, nonce),
                           MoveResult, timeout, bind_host)
    assert isinstance(reply, MoveResult)
    return reply


def add_move_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=int, default=-1, help="the seat to move")
    parser.add_argument("--member", default="", help="the member to move, by id (see `deadpool status`)")
    parser.add_argument("--spare", default="", help="the spare to take the seat (default: the coordinator chooses)")
    parser.add_argument("--reason", default="operator move", help="why, for the events and the moved worker's output")
    add_connection_arguments(parser)


def add_drain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", required=True, help="the host to empty (its name in `deadpool status`)")
    parser.add_argument("--reason", default="", help="why, for the events and the moved workers' output")
    add_connection_arguments(parser)


def run_move(args: argparse.Namespace) -> int:
    """``deadpool move``: one seat to a spare.

    Raises:
        MisuseError: bad arguments, or the coordinator refused (exit status 2).
    """
    if args.rank < -1:
        raise MisuseError(f"--rank must be >= 0, got {args.rank}")
    if (args.rank >= 0) == bool(args.member):
        raise MisuseError("name the seat: --rank R or --member ID (see `deadpool status`), "
                          f"{'not both' if args.member else 'got neither'}")
    job = job_of(args)
    result = asyncio.run(send_move(job, args.rank, args.member, args.spare, "", args.reason, args.timeout,
                                   args.bind_host))
    return _report(result)


def run_drain(args: argparse.Namespace) -> int:
    """``deadpool drain``: every seat of a host to spares on other hosts; its spares leave the pool.

    Raises:
        MisuseError: bad arguments, or the coordinator refused (exit status 2).
    """
    if not args.host.strip():
        raise MisuseError("--host names the host to drain (see `deadpool status`)")
    job = job_of(args)
    result = asyncio.run(send_move(job, host=args.host, reason=args.reason or f"drain of host {args.host}",
                                   timeout=args.timeout, bind_host=args.bind_host))
    return _report(result)


def _report(result: MoveResult) -> int:
    if not result.ok:
        raise MisuseError(result.detail)
    print(f"deadpool: {result.detail}", flush=True)
    return 0
