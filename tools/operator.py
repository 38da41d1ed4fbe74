"""Operator tools against a live job: ``deadpool status`` and ``deadpool chaos``.

An operator tool is a short-lived endpoint of the control plane.  It binds its
own transport, sends one authenticated request to the coordinator
(``StatusRequest`` or ``ChaosCommand``) that names that endpoint as
``reply_to``, and waits for the answer carrying the same nonce, never longer
than ``--timeout``.  It speaks the job's protocol with the job's secret
(``deadpool.agent.jobfile.resolve``), so the coordinator treats a wrong secret like
any other unauthenticated frame: dropped and logged, and the tool reports a
timeout that names the secret as a likely cause.

The coordinator, not this tool, carries out chaos: it resolves a rank to the
member seated there, asks that member's host agent to deliver the signal, and
logs a ``chaos_injected`` event, so every action lands in the events file next
to the failure and the swap it causes.  ``chaos random`` is a loop of the same
requests whose targets are drawn from the live status with a seeded RNG, so a
soak run can be repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deadpool.agent import jobfile
from deadpool.errors import MisuseError, PeerFailure, WaitTimeout
from deadpool.protocol import codec
from deadpool.protocol.messages import ChaosCommand, ChaosResult, Message, StatusReply, StatusRequest
from deadpool.protocol.transport import CONTROL_LIMITS, TransportError, open_transport

log = logging.getLogger("deadpool.tools.operator")

DEFAULT_TIMEOUT = 5.0  # seconds for one request/reply; the coordinator answers in milliseconds
ACTIONS = ("kill", "stop", "cont")
RANDOM_ACTIONS = ("kill", "stop")  # cont undoes a stop; alone it injects nothing
SETTLE_TIMEOUT = 120.0  # chaos random waits this long for the job to be ready for the next failure
SILENT_AFTER_S = 1.0  # status flags a seat whose member was not heard from for this long (ten heartbeats)
STATUS_WIDTH = 140  # columns of the table when the output is not a terminal (a log, a pipe)
EVENT_WIDTH = 130  # an event line longer than this is cut, so each event stays on one line


# -- one request, one reply ---------------------------------------------------------------------


def _reply_host(coordinator: str) -> str:
    """The local address the coordinator can answer to: loopback for a local job, else the routed one.

    Raises:
        MisuseError: no local address routes to the coordinator's host.
    """
    host = coordinator.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            local: str = probe.getsockname()[0]
            return local
    except OSError as err:
        raise MisuseError(f"cannot find a local address that reaches {coordinator} ({err}); pass --bind-host") from None


async def _exchange(job: jobfile.JobInfo, build: Callable[[str, int], Message], expect: type[Message],
                    timeout: float, bind_host: str = "") -> Message:
    """Send one request and return the reply with its nonce, within `timeout` seconds in all.

    Raises:
        WaitTimeout: the coordinator did not accept or did not answer within `timeout`.
    """
    secret = job.secret.encode() or None
    transport = open_transport(f"tcp://{bind_host or _reply_host(job.coordinator)}:0", CONTROL_LIMITS)
    nonce = secrets.randbits(62)
    frame = codec.encode(build(transport.address, nonce), secret)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    reply: Message | None = None
    failure: WaitTimeout | None = None
    async with asyncio.TaskGroup() as tasks:
        reader = tasks.create_task(transport.run())
        try:
            await transport.send(job.coordinator, [frame], timeout)
            while reply is None:
                frames = await asyncio.wait_for(transport.recv(), max(0.0, deadline - loop.time()))
                decoded = codec.decode(frames[0], secret, CONTROL_LIMITS.max_frame_bytes)
                if isinstance(decoded, codec.DecodeError):
                    log.warning("dropped a frame: %s (%s)", decoded.reason, decoded.detail)
                elif isinstance(decoded, expect) and getattr(decoded, "nonce", None) == nonce:
                    reply = decoded
        except TransportError as err:
            failure = WaitTimeout(
                f"could not reach the coordinator at {job.coordinator} within {timeout:g}s ({err}). "
                "Nothing was changed. Is the job still running? `deadpool launch` prints the address."
            )
        except TimeoutError:
            failure = WaitTimeout(
                f"no answer from the coordinator at {job.coordinator} within {timeout:g}s. Nothing is known to have "
                "changed. Either the job ended, or the secret differs from the job's (set DEADPOOL_SECRET or "
                "--secret-file to the job's secret)."
            )
        finally:
            await transport.close()
            reader.cancel()
    if failure is not None:
        raise failure
    assert reply is not None
    return reply


async def fetch_status(job: jobfile.JobInfo, timeout: float = DEFAULT_TIMEOUT, bind_host: str = "") -> dict[str, Any]:
    """The coordinator's live state (``Coordinator.status()``) as a dict.

    Raises:
        WaitTimeout: no answer within `timeout`.
        PeerFailure: the answer is not a JSON object.
    """
    reply = await _exchange(job, lambda addr, nonce: StatusRequest(addr, nonce), StatusReply, timeout, bind_host)
    assert isinstance(reply, StatusReply)
    try:
        document = json.loads(reply.json)
    except json.JSONDecodeError as err:
        raise PeerFailure(f"the coordinator's status is not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise PeerFailure("the coordinator's status is not a JSON object")
    return document


async def send_chaos(job: jobfile.JobInfo, action: str, rank: int = -1, member: str = "", at_step: int = -1,
                     timeout: float = DEFAULT_TIMEOUT, bind_host: str = "") -> ChaosResult:
    """Ask the coordinator to signal a member; the result says whether it was done or armed, and why not.

    Raises:
        MisuseError: an unknown action, or not exactly one target.
        WaitTimeout: no answer within `timeout`.
    """
    if action not in ACTIONS:
        raise MisuseError(f"unknown chaos action {action!r}: use one of {', '.join(ACTIONS)}")
    if (rank >= 0) == bool(member):
        raise MisuseError("name the target: --rank R (a seat) or --member ID (see `deadpool status`), not both")
    reply = await _exchange(job, lambda addr, nonce: ChaosCommand(action, rank, member, at_step, addr, nonce),
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


# -- rendering ------------------------------------------------------------------------------------


def _age(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.1f}s"


def _state(seat: dict[str, Any]) -> Any:
    """The seat's state, flagged when its member has been silent long enough to look hung."""
    from rich.text import Text

    state = str(seat.get("state"))
    age = seat.get("heartbeat_age_s")
    if state == "active" and isinstance(age, (int, float)) and age > SILENT_AFTER_S:
        return Text("silent", style="yellow")
    return Text(state, style="green" if state == "active" else "red")


def _step(value: Any) -> str:
    return "-" if not isinstance(value, int) or value < 0 else str(value)


def render_status(status: dict[str, Any], events: int = 8) -> Any:
    """A rich renderable of a status document: the seats, the spares and the newest events."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    seats = [s for s in status.get("seats", []) if isinstance(s, dict)]
    rank_of = {str(s.get("member")): s.get("rank") for s in seats}
    head = Text.assemble(
        ("DeadPool job", "bold"),
        f"  epoch {status.get('epoch')}  world size {status.get('world_size')}  "
        f"resume step {status.get('resume_step')}  store prefix {status.get('store_prefix') or '-'}",
    )
    parts: list[Any] = [head]
    if status.get("round"):
        rnd = status["round"]
        parts.append(Text(f"view change in progress: epoch {rnd.get('epoch')}, seats {rnd.get('failed_seats')} "
                          "being refilled", style="yellow"))
    if status.get("outcome"):
        outcome = status["outcome"]
        parts.append(Text(f"job ended: {outcome.get('reason')}", style="green" if outcome.get("ok") else "red"))
    table = Table(title="seats", title_justify="left", expand=False)
    for column in ("rank", "member", "host", "pid", "state", "step", "snapshot", "buddy copy", "heartbeat",
                   "stall p99"):
        table.add_column(column, justify="right" if column in ("rank", "pid", "step", "snapshot") else "left",
                         no_wrap=True)
    for s in seats:
        buddy = str(s.get("copy_on") or "")
        copy = "-" if not buddy else f"step {_step(s.get('confirmed_step'))} on rank {rank_of.get(buddy, '?')}"
        stall = s.get("stall_p99_s")
        table.add_row(
            str(s.get("rank")), str(s.get("member")), str(s.get("host")), str(s.get("pid")), _state(s),
            _step(s.get("step")), _step(s.get("snapshot_step")), copy, _age(s.get("heartbeat_age_s")),
            "-" if not isinstance(stall, (int, float)) else f"{stall * 1e3:.1f} ms",
        )
    parts.append(table)
    spares = [s for s in status.get("spares", []) if isinstance(s, dict)]
    if spares:
        spare_table = Table(title=f"spares ({len(spares)})", title_justify="left", expand=False)
        for column in ("member", "host", "pid", "heartbeat"):
            spare_table.add_column(column)
        for s in spares:
            spare_table.add_row(str(s.get("member")), str(s.get("host")), str(s.get("pid")),
                                _age(s.get("heartbeat_age_s")))
        parts.append(spare_table)
    else:
        parts.append(Text("spares (0): none left", style="yellow"))
    if status.get("fenced"):
        parts.append(Text(f"fenced (dead, never readmitted): {', '.join(map(str, status['fenced']))}"))
    recent = [e for e in status.get("recent_events", []) if isinstance(e, dict)][-events:]
    if recent:
        parts.append(Text("recent events", style="bold"))
        for record in recent:
            parts.append(Text(_event_line(record)))
    return Group(*parts)


_EVENT_DETAIL = ("reason", "detected_by", "resume_step", "recovery_s", "action", "target_member", "detail")


def _event_line(record: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(float(record.get("ts", 0.0))))
    who = record.get("member") or ""
    rank = record.get("rank")
    where = f" rank {rank}" if isinstance(rank, int) and rank >= 0 else ""
    detail = " ".join(f"{k}={record[k]}" for k in _EVENT_DETAIL if record.get(k) not in (None, ""))
    line = f"  {stamp} e{record.get('epoch')} {record.get('event')}{where} {who} {detail}".rstrip()
    return line if len(line) <= EVENT_WIDTH else line[: EVENT_WIDTH - 1] + "…"


# -- the command line -----------------------------------------------------------------------------


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", default="",
                        help="coordinator address tcp://HOST:PORT (default: the job started on this host)")
    parser.add_argument("--secret-file", default="", help="file holding the job's secret (default: DEADPOOL_SECRET "
                                                          "or the local job file)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds to wait for each answer")
    parser.add_argument("--bind-host", default="", help="local address the coordinator answers to (default: routed)")


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``deadpool status``."""
    _add_connection_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the status document as JSON (for scripts)")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until the job ends (with --json: one document "
                             "per line)")


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``deadpool chaos``: one sub-command per action, plus ``random``."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="{kill,stop,cont,random}")
    helps = {"kill": "SIGKILL a member (a crash)", "stop": "SIGSTOP a member (a hang)",
             "cont": "SIGCONT a stopped member"}
    for action in ACTIONS:
        sub = actions.add_parser(action, help=helps[action])
        sub.add_argument("--rank", type=int, default=-1, help="the member seated at this rank")
        sub.add_argument("--member", default="", help="the member with this id (e.g. a spare)")
        sub.add_argument("--at-step", type=int, default=-1, help="when the target finishes this step")
        sub.add_argument("--after", type=float, default=0.0, help="after this many seconds")
        _add_connection_arguments(sub)
    rand = actions.add_parser("random", help="seeded failures at random seats, for soak runs")
    rand.add_argument("--seed", type=int, required=True, help="RNG seed: the same seed picks the same seats")
    rand.add_argument("--failures", type=int, required=True, help="how many actions to inject")
    rand.add_argument("--interval", type=float, required=True, help="seconds between actions")
    rand.add_argument("--actions", default="kill", help="comma-separated, from kill,stop (default kill)")
    rand.add_argument("--settle-timeout", type=float, default=SETTLE_TIMEOUT,
                      help="seconds to wait for the job to be ready (no view change, a spare left) before each action")
    _add_connection_arguments(rand)


def _job(args: argparse.Namespace) -> jobfile.JobInfo:
    if not args.timeout > 0:
        raise MisuseError(f"--timeout must be positive, got {args.timeout}")
    return jobfile.resolve(args.coordinator, args.secret_file)


def run_status(args: argparse.Namespace) -> int:
    """``deadpool status``: print the live view once, or every --watch seconds until the job ends."""
    if args.watch is not None and not args.watch > 0:
        raise MisuseError(f"--watch takes a positive number of seconds, got {args.watch}")
    job = _job(args)
    if args.watch is None:
        status = asyncio.run(fetch_status(job, args.timeout, args.bind_host))
        _show(status, args.json)
        return 0
    return asyncio.run(_watch(job, args))


def _show(status: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(status), flush=True)
        return
    _console().print(render_status(status))


def _console() -> Any:
    """A console that keeps the table on one line per seat when printing to a file or pipe."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=STATUS_WIDTH)


async def _watch(job: jobfile.JobInfo, args: argparse.Namespace) -> int:
    """Refresh until the job reports an outcome; a coordinator that stops answering ends the watch."""
    from rich.live import Live

    console = _console()
    live = Live(console=console, auto_refresh=False) if console.is_terminal and not args.json else None
    try:
        if live is not None:
            live.start()
        while True:
            status = await fetch_status(job, args.timeout, args.bind_host)
            if live is not None:
                live.update(render_status(status), refresh=True)
            else:
                _show(status, args.json)
            if status.get("outcome"):
                return 0 if status["outcome"].get("ok") else 1
            await asyncio.sleep(args.watch)
    finally:
        if live is not None:
            live.stop()


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
    job = _job(args)

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
    job = _job(args)

    def report(line: str) -> None:
        print(f"deadpool chaos random {line}", flush=True)

    done = asyncio.run(random_chaos(job, args.seed, args.failures, args.interval, actions, args.timeout,
                                    args.settle_timeout, args.bind_host, report))
    print(f"deadpool chaos random: {done} failure{'s' if done != 1 else ''} injected", flush=True)
    return 0
