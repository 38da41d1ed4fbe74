"""``deadpool status``: the live view of a job -- seats, members, steps, snapshots, spares, recent events.

It asks the coordinator for its status document (``tools.request``) once, or every
``--watch`` seconds until the job ends, and prints it as a table or, with ``--json``, as
the document itself for scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from deadpool.agent import jobfile
from deadpool.errors import MisuseError

from .request import add_connection_arguments, fetch_status, job_of

SILENT_AFTER_S = 1.0  # status flags a seat whose member was not heard from for this long (ten heartbeats)
STATUS_WIDTH = 140  # columns of the table when the output is not a terminal (a log, a pipe)
EVENT_WIDTH = 130  # an event line longer than this is cut, so each event stays on one line


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
    if status.get("role") == "standby":  # only the standby answered: the active is lost or unreachable
        return Text(f"DeadPool standby coordinator {status.get('standby')} (term {status.get('term')}): the active "
                    f"coordinator {status.get('active')} has been silent for {status.get('active_silent_s')} s "
                    f"(takeover after {status.get('takeover_bound_s')} s, once most hosts confirm); it hears "
                    f"{status.get('members_heard')} members and {status.get('agents_heard')} hosts", style="yellow")
    head = Text.assemble(
        ("DeadPool job", "bold"),
        f"  epoch {status.get('epoch')}  world size {status.get('world_size')}  "
        f"resume step {status.get('resume_step')}  store prefix {status.get('store_prefix') or '-'}",
    )
    parts: list[Any] = [head]
    if "term" in status:
        parts.append(Text(f"coordinator term {status['term']}; standby {status.get('standby') or 'none'}"))
    if status.get("round"):
        rnd = status["round"]
        parts.append(Text(f"view change in progress: epoch {rnd.get('epoch')}, seats {rnd.get('failed_seats')} "
                          "being refilled", style="yellow"))
    for move in [m for m in status.get("moves", []) if isinstance(m, dict)]:
        after = move.get("leaves_after")
        when = "at its next step boundary" if after is None else f"after step {after}"
        parts.append(Text(f"moving: rank {move.get('rank')} ({move.get('member')}) to {move.get('spare') or 'a spare'}"
                          f" {when} ({move.get('trigger')}: {move.get('reason')}; asked "
                          f"{move.get('asked_s')} s ago)", style="yellow"))
    if status.get("replica_checks"):
        parts.append(Text(f"replica checks (silent data corruption): {status['replica_checks']}"))
    if isinstance(audits := status.get("audits"), dict):
        flight = audits.get("in_flight")
        now = f"; now rank {flight.get('rank')} step {flight.get('step')} on {flight.get('spare')}" \
            if isinstance(flight, dict) else ""
        why = f" (the last: {audits['why_missed']})" if audits.get("why_missed") else ""
        parts.append(Text(f"audits: {audits.get('clean')} clean, {audits.get('missed')} missed{why}{now}"))
    for found in [c for c in status.get("corruptions", []) if isinstance(c, dict)]:
        parts.append(Text(f"silent data corruption: rank {found.get('rank')} at step {found.get('step')} (replaced, "
                          "rolled back)", style="bold red"))
    if status.get("drained_hosts"):
        parts.append(Text(f"drained hosts: {', '.join(map(str, status['drained_hosts']))}"))
    if status.get("outcome"):
        outcome = status["outcome"]
        parts.append(Text(f"job ended: {outcome.get('reason')}", style="green" if outcome.get("ok") else "red"))
    table = Table(title="seats", title_justify="left", expand=False)
    for column in ("rank", "member", "host", "pid", "state", "step", "snapshot", "buddy copy", "heartbeat",
                   "stall p99", "slowness"):
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
            "-" if not isinstance(slow := s.get("slowness"), (int, float)) else f"{slow:.2f}x",
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


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``deadpool status``."""
    add_connection_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the status document as JSON (for scripts)")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until the job ends (with --json: one document "
                             "per line)")


def run_status(args: argparse.Namespace) -> int:
    """``deadpool status``: print the live view once, or every --watch seconds until the job ends.

    Raises:
        MisuseError: bad arguments, or no job given or found (exit status 2).
        WaitTimeout: the coordinator did not answer.
    """
    if args.watch is not None and not args.watch > 0:
        raise MisuseError(f"--watch takes a positive number of seconds, got {args.watch}")
    job = job_of(args)
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
