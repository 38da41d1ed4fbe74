"""Swarm benchmark: the real coordinator process against thousands of members on real sockets, with members killed.

Issue 21 asks how the control plane behaves as a job grows.  ``bench/simulate_scale.py``
answers on a virtual clock; this benchmark answers on this machine, in wall-clock time:
the real coordinator (``python -m deadpool.coordinator.main``, as ``deadpool launch``
starts it) on 127.0.0.1, and 512 to 8,192 lightweight members split over a few swarm
processes (``bench/swarm_world.py``).  A member is the simulator's state machine
(``tools/simulate/cluster.py``: join, heartbeat through its host agent, PrepareAck, view
adoption, exit when fenced) with its own ZeroMQ control socket; no torch runs.  After
the first view and a steady window, members are killed one at a time, alternately as a
crash (the host agent reports the exit, as ``deadpool launch`` does) and as a hang
(silent until the coordinator's FenceKill).  For each kill, from the coordinator's
events file and the swarm's own clocks (one host, one wall clock):

- ``detect``: kill -> ``member_failed``;
- ``change``: ``member_failed`` -> the ``view_committed`` without the member;
- ``adopt``: ``member_failed`` -> the last running member holding that view;
- ``swap``: ``member_failed`` -> ``swap_completed`` (adds the simulated restore and one step).

The invariants of ``tools/simulate/checks.py`` are checked on the coordinator's events
(one view per epoch, epochs growing, no fenced member in a committed view, every view
received for an epoch the same), plus: every seat filled, every kill detected, replaced
and swapped, every running member holding the newest view at the end, no job failure.
What the benchmark leaves out is listed in bench/README.md ("Swarm").

Usage::

    python bench/swarm.py                          # 512, 2,048 and 8,192 members, 4 kills each (~2 minutes)
    python bench/swarm.py --members 512,2048 --kills 2
    python bench/swarm.py --json                   # one JSON object per row, per-kill detail included
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from deadpool.tools.simulate.checks import Checker  # noqa: E402
from deadpool.tools.simulate.cluster import SimConfig  # noqa: E402
from swarm_world import Layout  # noqa: E402

from deadpool.events import schema  # noqa: E402
from deadpool.protocol.transport import new_event_loop  # noqa: E402

WORKER = Path(__file__).resolve().parent / "swarm_world.py"
SIZES = (512, 2048, 8192)
START_TIMEOUT_S = 120.0  # coordinator and swarm processes up, sockets bound
FIRST_VIEW_TIMEOUT_S = 180.0  # every member joined and holds the first view
KILL_LEAD_S = 0.2  # a kill is announced this long before it strikes (every swarm process stalls at the same tick)
RELEASE_LEAD_S = 0.05  # the adoption barrier opens this long after it is announced, in every swarm process at once


@dataclass
class Settings:
    """One run's knobs (the command line)."""

    kills: int = 4
    procs: int = 0  # 0: one swarm process per 2,048 members, 1 to 4
    members_per_host: int = 8
    seed: int = 0
    heartbeat_interval: float = 0.25  # Config's default
    # Config's default.  At 8,192 members on this 2-core host it declared healthy members dead at the start
    # until the transport read queued messages without an asyncio future (bench/README.md, "Swarm").
    failure_timeout: float = 2.0
    step_s: float = 1.0
    restore_s: float = 0.1
    join_s: float = 0.0  # 0: members join within max(2 s, 1 s per 1,024 members), as launches spread out
    steady_s: float = 3.0
    gap_s: float = 0.5
    kill_timeout_s: float = 30.0
    keep: bool = False

    def procs_for(self, members: int) -> int:
        return self.procs or max(1, min(4, members // 2048))

    def join_for(self, members: int) -> float:
        return self.join_s or max(2.0, members / 1024)


@dataclass
class Kill:
    """One kill and what the coordinator and the swarm saw of it (wall-clock seconds)."""

    member: str
    kind: str  # crash | hang
    seat: int
    at: float = 0.0  # when its process stopped (the swarm process's clock)
    failed: float | None = None  # member_failed
    detected_by: str = ""
    committed: float | None = None  # the first view_committed without it
    epoch: int = 0
    prepared: float | None = None  # the last member that got the round's Prepare
    adopted: float | None = None  # the last running member holding that view
    swapped: float | None = None  # swap_completed of its seat
    # CPU seconds from the kill command until the view without it was seen committed: the coordinator's and the
    # swarm processes' (all of them): who the view change waits on, on a host whose cores they share.
    coordinator_cpu_s: float | None = None
    swarm_cpu_s: float | None = None

    def row(self) -> dict[str, Any]:
        def since(t: float | None, t0: float | None) -> float | None:
            return None if t is None or t0 is None else round(t - t0, 4)
        return {"member": self.member, "kind": self.kind, "seat": self.seat, "detected_by": self.detected_by,
                "epoch": self.epoch, "detect_s": since(self.failed, self.at),
                "prepare_s": since(self.prepared, self.failed), "view_change_s": since(self.committed, self.failed),
                "adopt_s": since(self.adopted, self.failed),
                "swap_s": since(self.swapped, self.failed), "coordinator_cpu_s": self.coordinator_cpu_s,
                "swarm_cpu_s": self.swarm_cpu_s}


class Replay:
    """What ``checks.Checker`` reads of a run (its Observed), rebuilt from the coordinator's events as they come."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.tick = 0  # milliseconds since t0: the checker's failed_tick
        self._now = 0.0
        self.coordinator = SimpleNamespace(fenced={})  # the members declared dead so far
        self.killed: set[str] = set()

    def at(self, ts: float) -> None:
        self._now = ts - self.t0
        self.tick = round(self._now * 1000)

    def now(self) -> float:
        return self._now

    def healthy(self, member: str) -> bool:
        return member not in self.killed


@dataclass
class RunState:
    """The run as the coordinator's events tell it, with the invariant checker fed from them."""

    world: int
    t0: float
    replay: Replay = field(init=False)
    checker: Checker = field(init=False)
    seats: list[str] = field(default_factory=list)
    spares: list[str] = field(default_factory=list)
    epoch: int = 0
    commits: list[tuple[int, float, frozenset[str]]] = field(default_factory=list)  # (epoch, ts, members)
    failed: dict[str, tuple[float, str]] = field(default_factory=dict)  # member -> (ts, detected_by)
    swaps: dict[str, float] = field(default_factory=dict)  # old member -> ts of swap_completed
    rejected: dict[str, int] = field(default_factory=dict)
    first_view: float | None = None
    job_failed: str = ""

    def __post_init__(self) -> None:
        self.replay = Replay(self.t0)
        self.checker = Checker(self.replay)  # type: ignore[arg-type]  # duck-typed: reads .coordinator.fenced

    def on_line(self, line: bytes) -> None:
        """One line of the coordinator's events file, read through the event schema."""
        record = schema.decode(line, "the coordinator's events")
        ts = record.ts or 0.0
        self.replay.at(ts)
        self.checker.on_event(record)
        match record:
            case schema.MemberFailed(member=str() as member):
                self.failed.setdefault(member, (ts, record.detected_by))
                self.replay.coordinator.fenced[member] = record.reason
            case schema.ViewCommitted(epoch=int() as epoch):
                seats, spares = list(record.seats), list(record.spares)
                self._check_seats(epoch, seats, spares)
                self.seats, self.spares, self.epoch = seats, spares, epoch
                self.commits.append((epoch, ts, frozenset(seats) | frozenset(spares)))
                if self.first_view is None:
                    self.first_view = ts
            case schema.SwapCompleted():
                self.swaps.setdefault(record.old_member, ts)
            case schema.Rejected():
                self.rejected[record.reason] = self.rejected.get(record.reason, 0) + 1
            case schema.JobFailed():
                self.job_failed = record.detail or record.reason
                self.checker.violation(f"the job failed: {self.job_failed[:300]}")

    def replaced(self, member: str) -> bool:
        """`member` was declared dead and the newest committed view no longer holds it."""
        return member in self.failed and member not in self.seats and member not in self.spares

    def _check_seats(self, epoch: int, seats: list[str], spares: list[str]) -> None:
        """Every seat filled, by one member each, none of them also a spare."""
        if len(seats) != self.world or any(not m for m in seats):
            self.checker.violation(f"view {epoch} fills {sum(1 for m in seats if m)} of {self.world} seats")
        if len(set(seats)) != len(seats):
            self.checker.violation(f"view {epoch} seats a member twice")
        if set(seats) & set(spares):
            self.checker.violation(f"view {epoch} lists a seated member as a spare")


class RowFailed(Exception):
    """A row could not be measured (the job failed, or never formed its first view); says what the events show."""

    def __init__(self, what: str, state: RunState, workdir: Path, detail: dict[str, Any] | None = None) -> None:
        self.detail = detail or {}
        failed = len(state.failed)
        why = f"; the job failed: {state.job_failed[:160]}" if state.job_failed else ""
        super().__init__(f"{what} ({failed} member(s) declared dead, {state.checker._false_positives} of them not "
                         f"killed{why}; logs in {workdir})")


class EventTail:
    """The coordinator's JSON-lines events file, read as it grows."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: Any = None
        self._partial = b""

    def poll(self) -> list[bytes]:
        if self._file is None:
            if not self._path.exists():
                return []
            self._file = self._path.open("rb")
        data = self._file.read()
        if not data:
            return []
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return [line for line in lines if line.strip()]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class SwarmProcess:
    """One swarm process (bench/swarm_world.py): its pipes, and its answers sorted by kind."""

    def __init__(self, proc: asyncio.subprocess.Process, index: int) -> None:
        self.proc = proc
        self.index = index
        self.ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.answers: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=16)
        self.killed: dict[str, float] = {}

    async def read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            document = json.loads(line)
            if "ready" in document:
                self.ready.set_result(document["ready"])
            elif "killed" in document:
                self.killed[document["killed"]] = document["ts"]
            else:
                await self.answers.put(document)
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(f"swarm process {self.index} exited before it was ready"))

    def command(self, document: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(document) + "\n").encode())

    async def ask(self, document: dict[str, Any], key: str, timeout: float = 60.0) -> dict[str, Any]:
        self.command(document)
        answer = await asyncio.wait_for(self.answers.get(), timeout)
        return dict(answer[key])


async def _status(swarm: list[SwarmProcess]) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(p.ask({"cmd": "status"}, "status") for p in swarm)))


def _held(statuses: list[dict[str, Any]]) -> dict[int, int]:
    """Running members by the epoch of the view they hold, over every swarm process."""
    held: dict[int, int] = {}
    for status in statuses:
        for epoch, count in status["held"].items():
            held[int(epoch)] = held.get(int(epoch), 0) + count
    return held


def _release(swarm: list[SwarmProcess], epoch: int) -> None:
    """Every member holds view `epoch`: its seats may step (the workers' adoption barrier opens)."""
    at = time.time() + RELEASE_LEAD_S
    for p in swarm:
        p.command({"cmd": "release", "epoch": epoch, "at": at})


async def _converged(swarm: list[SwarmProcess], state: RunState, timeout: float) -> bool:
    """Wait (bounded) until every running member holds the newest committed view."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not state.job_failed:
        held = _held(await _status(swarm))
        if state.epoch and set(held) == {state.epoch}:
            return True
        await asyncio.sleep(0.25)
    return False


def _footprint(pid: int) -> dict[str, float]:
    """The coordinator's open descriptors (a socket and a mailbox per member it sends to) and resident memory."""
    try:
        process = psutil.Process(pid)
        return {"coordinator_fds": process.num_fds(), "coordinator_rss_mb": round(process.memory_info().rss / 2**20)}
    except psutil.Error:
        return {}


async def _diagnose(swarm: list[SwarmProcess]) -> dict[str, Any]:
    """What the swarm processes say of themselves (how late their heartbeat loops ran), if they still answer."""
    try:
        statuses = await asyncio.wait_for(_status(swarm), 10.0)
    except TimeoutError:
        return {"swarm": "a swarm process did not answer within 10 s"}
    return {"swarm_lag_max_s": max(s["lag_max_s"] for s in statuses),
            "swarm_queued_max": max(s["queued_max"] for s in statuses)}


def _cpu(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


async def run_swarm(members: int, settings: Settings) -> dict[str, Any]:
    """One row: start the coordinator and the swarm, wait for the first view, measure, kill, check, tear down."""
    started = time.monotonic()
    sim = SimConfig(members=members, members_per_host=settings.members_per_host)  # the simulator's seats/spares split
    procs = settings.procs_for(members)
    layout = Layout(members, sim.seats, settings.members_per_host, procs, settings.seed)
    if settings.kills > sim.spares:
        raise SystemExit(f"--kills {settings.kills} exceeds the {sim.spares} spares of {members} members")
    workdir = Path(tempfile.mkdtemp(prefix=f"deadpool-swarm-{members}-"))
    events = workdir / "events.jsonl"
    env = {**os.environ, "DEADPOOL_SECRET": secrets.token_hex(16),
           "DEADPOOL_HEARTBEAT_INTERVAL": str(settings.heartbeat_interval),
           "DEADPOOL_FAILURE_TIMEOUT": str(settings.failure_timeout)}
    with (workdir / "coordinator.log").open("wb") as log:
        coordinator = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deadpool.coordinator.main", "--world-size", str(layout.seats), "--events",
            str(events), "--bind", "tcp://127.0.0.1:0", "--store-port", "0", "--hosts", str(layout.hosts),
            stdout=asyncio.subprocess.PIPE, stderr=log, stdin=asyncio.subprocess.DEVNULL, env=env, cwd=ROOT)
    swarm: list[SwarmProcess] = []
    readers: list[asyncio.Task[None]] = []
    tail = EventTail(events)
    t0 = time.time()
    state = RunState(layout.seats, t0)
    watching = True
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        while watching:
            for line in tail.poll():
                state.on_line(line)
            await asyncio.sleep(0.02)

    try:
        assert coordinator.stdout is not None
        ready = json.loads(await asyncio.wait_for(coordinator.stdout.readline(), START_TIMEOUT_S))
        for index in range(procs):
            spec = {"proc": index, "coordinator": ready["control"], "members": members, "seats": layout.seats,
                    "members_per_host": settings.members_per_host, "procs": procs, "seed": settings.seed,
                    "t0": t0, "tick": 0.01, "heartbeat_interval": settings.heartbeat_interval,
                    "step_s": settings.step_s, "restore_s": settings.restore_s,
                    "join_s": settings.join_for(members)}
            with (workdir / f"swarm{index}.log").open("wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, str(WORKER), json.dumps(spec), stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=log, env=env, cwd=ROOT, limit=1 << 24)
            swarm.append(SwarmProcess(proc, index))
            readers.append(asyncio.create_task(swarm[-1].read()))
        await asyncio.wait_for(asyncio.gather(*(p.ready for p in swarm)), START_TIMEOUT_S)
        watcher = asyncio.create_task(watch())
        go = time.time()
        for p in swarm:
            p.command({"cmd": "go"})
        deadline = time.monotonic() + FIRST_VIEW_TIMEOUT_S
        while state.first_view is None and time.monotonic() < deadline and coordinator.returncode is None:
            await asyncio.sleep(0.1)
        if state.first_view is None:
            raise RowFailed(f"no first view within {FIRST_VIEW_TIMEOUT_S:.0f}s", state, workdir)
        if not await _converged(swarm, state, FIRST_VIEW_TIMEOUT_S):
            raise RowFailed("the members did not all adopt the first view", state, workdir,
                            await _diagnose(swarm))
        startup_s = time.time() - go
        _release(swarm, state.epoch)
        await asyncio.sleep(1.0)

        # Steady state: what the coordinator receives and spends with nothing failing.
        before, cpu0, w0 = await _status(swarm), _cpu(coordinator.pid), time.monotonic()
        await asyncio.sleep(settings.steady_s)
        after, cpu1, w1 = await _status(swarm), _cpu(coordinator.pid), time.monotonic()
        sent = sum(a["counts"]["sent"] - b["counts"]["sent"] for a, b in zip(after, before, strict=True))
        steady = {"coordinator_msgs_per_s": round(sent / (w1 - w0), 1),
                  "coordinator_cpu_s_per_s": round((cpu1 - cpu0) / (w1 - w0), 4),
                  "swarm_cpu_s_per_s": round(sum(a["cpu_s"] - b["cpu_s"] for a, b in zip(after, before,
                                                                                          strict=True)) / (w1 - w0), 4),
                  **_footprint(coordinator.pid)}

        # Kills, one at a time: each is detected, replaced and swapped before the next.
        rng = random.Random(settings.seed)
        kills: list[Kill] = []
        cpu_k0, wk0 = _cpu(coordinator.pid), time.monotonic()
        for k in range(settings.kills):
            if state.job_failed:
                break
            candidates = [(seat, m) for seat, m in enumerate(state.seats) if m not in state.replay.killed]
            seat, member = rng.choice(candidates)
            kill = Kill(member, ("crash", "hang")[k % 2], seat)
            kills.append(kill)
            state.replay.killed.add(member)
            at = time.time() + KILL_LEAD_S
            spent = _cpu(coordinator.pid), sum(_cpu(p.proc.pid) for p in swarm)
            for p in swarm:
                p.command({"cmd": "kill", "member": member, "kind": kill.kind, "at": at})
            deadline = time.monotonic() + settings.failure_timeout + settings.kill_timeout_s
            while not state.replaced(member) and time.monotonic() < deadline and not state.job_failed:
                await asyncio.sleep(0.02)
            kill.coordinator_cpu_s = round(_cpu(coordinator.pid) - spent[0], 3)
            kill.swarm_cpu_s = round(sum(_cpu(p.proc.pid) for p in swarm) - spent[1], 3)
            if state.replaced(member) and await _converged(swarm, state, 10.0):
                _release(swarm, state.epoch)
            while member not in state.swaps and time.monotonic() < deadline and not state.job_failed:
                await asyncio.sleep(0.05)
            await asyncio.sleep(settings.gap_s)
        cpu_k1, wk1 = _cpu(coordinator.pid), time.monotonic()
        await asyncio.sleep(0.3)
        final = await _status(swarm)
        steady.update(await _diagnose(swarm))
        stats = list(await asyncio.gather(*(p.ask({"cmd": "stop"}, "stats") for p in swarm)))
        watching = False
        await watcher
        for line in tail.poll():
            state.on_line(line)
    finally:
        watching = False
        if watcher is not None and not watcher.done():
            watcher.cancel()
        for p in swarm:
            with contextlib.suppress(ProcessLookupError, ConnectionError):
                p.proc.stdin.close()  # type: ignore[union-attr]
        for p in swarm:
            try:
                await asyncio.wait_for(p.proc.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.kill()
                await p.proc.wait()
        for task in readers:
            task.cancel()
        with contextlib.suppress(ProcessLookupError):
            coordinator.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(coordinator.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                coordinator.kill()
            await coordinator.wait()
        tail.close()

    for p in swarm:
        for kill in kills:
            if kill.member in p.killed:
                kill.at = p.killed[kill.member]
    return _result(members, layout, settings, state, kills, stats, final, steady, startup_s,
                   (cpu_k1 - cpu_k0) / (wk1 - wk0), time.monotonic() - started, workdir)


def _result(members: int, layout: Layout, settings: Settings, state: RunState, kills: list[Kill],
            stats: list[dict[str, Any]], final: list[dict[str, Any]], steady: dict[str, float], startup_s: float,
            kill_cpu: float, wall_s: float, workdir: Path) -> dict[str, Any]:
    """The row: per-kill timings, their summaries, and the end-of-run checks."""
    checker = state.checker
    adoptions: dict[int, float] = {}
    prepares: dict[int, float] = {}
    for s in stats:
        for epoch, (_, _, last) in s["adoptions"].items():
            adoptions[int(epoch)] = max(adoptions.get(int(epoch), 0.0), last)
        for epoch, (_, _, last) in s["prepares"].items():
            prepares[int(epoch)] = max(prepares.get(int(epoch), 0.0), last)
        for epoch, digest in s["view_digests"].items():
            checker.check_view_sent(int(epoch), bytes.fromhex(digest))
        for text in s["violations"]:
            checker.violation(f"swarm process {s['proc']}: {text}")
    for kill in kills:
        if not kill.at:
            checker.violation(f"kill of {kill.member} was never carried out")
            continue
        if kill.member not in state.failed:
            checker.violation(f"the {kill.kind} of {kill.member} was never detected")
            continue
        kill.failed, kill.detected_by = state.failed[kill.member]
        commit = next(((e, t) for e, t, inside in state.commits if t >= kill.failed and kill.member not in inside),
                      None)
        if commit is None:
            checker.violation(f"{kill.member} was detected but no committed view replaced it")
            continue
        kill.epoch, kill.committed = commit
        kill.adopted = adoptions.get(kill.epoch)
        kill.prepared = prepares.get(kill.epoch)
        kill.swapped = state.swaps.get(kill.member)
        if kill.swapped is None:
            checker.violation(f"the seat of {kill.member} was never reported swapped (swap_completed)")
    held = _held(final)
    stale = sum(count for epoch, count in held.items() if epoch != state.epoch)
    if stale:
        checker.violation(f"{stale} running member(s) did not hold the newest view {state.epoch} at the end")
    rows = [kill.row() for kill in kills]

    def pick(key: str, kind: str = "") -> list[float]:
        return [r[key] for r in rows if r[key] is not None and (not kind or r["kind"] == kind)]

    result: dict[str, Any] = {
        "members": members, "seats": layout.seats, "spares": members - layout.seats, "hosts": layout.hosts,
        "swarm_procs": layout.procs, "kills": len(kills), "swaps_completed": len(state.swaps),
        "detect_crash_s_p50": _p50(pick("detect_s", "crash")), "detect_crash_s_max": _max(pick("detect_s", "crash")),
        "detect_hang_s_p50": _p50(pick("detect_s", "hang")), "detect_hang_s_max": _max(pick("detect_s", "hang")),
        "prepare_s_p50": _p50(pick("prepare_s")), "prepare_s_max": _max(pick("prepare_s")),
        "view_change_s_p50": _p50(pick("view_change_s")), "view_change_s_max": _max(pick("view_change_s")),
        "adopt_s_p50": _p50(pick("adopt_s")), "adopt_s_max": _max(pick("adopt_s")),
        "swap_s_p50": _p50(pick("swap_s")), "swap_s_max": _max(pick("swap_s")),
        **steady,
        "coordinator_cpu_s_per_s_kills": round(kill_cpu, 4),
        "invariant_violations": checker.violation_count,
        "violations": list(checker.violations),
        "false_positives": checker._false_positives,
        "rejected": state.rejected,
        "startup_s": round(startup_s, 2),
        "wall_s": round(wall_s, 1),
        "heartbeat_interval": settings.heartbeat_interval,
        "failure_timeout": settings.failure_timeout,
        "per_kill": rows,
        "workdir": str(workdir) if settings.keep else "",
    }
    if not settings.keep:
        for child in workdir.iterdir():
            child.unlink()
        workdir.rmdir()
    return result


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _max(values: list[float]) -> float | None:
    return round(max(values), 4) if values else None


RATIO_KEYS = ("detect_crash_s_p50", "detect_hang_s_p50", "view_change_s_p50", "adopt_s_p50")


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Each row's timings over the smallest row's (512 members by default), measured in the same run."""
    measured = [r for r in results if "error" not in r]
    if not measured:
        return
    base = min(measured, key=lambda r: r["members"])
    for row in measured:
        row["ratios"] = {key: (round(row[key] / base[key], 2) if row[key] and base[key] else None)
                         for key in RATIO_KEYS}


def format_table(results: list[dict[str, Any]]) -> str:
    """The rows for people: p50/max in seconds, ratios to the smallest row, the counts."""
    def pair(row: dict[str, Any], key: str) -> str:
        p50, top = row[f"{key}_p50"], row[f"{key}_max"]
        return "-" if p50 is None else f"{p50:.3f}/{top:.3f}"

    def ratio(row: dict[str, Any], key: str) -> str:
        value = row["ratios"][key]
        return "-" if value is None else f"{value:.2f}x"

    header = (f"{'members':>7} {'procs':>5} {'kills':>5} {'swaps':>5} {'detect crash':>13} {'detect hang':>13} "
              f"{'view change':>13} {'all adopted':>13} {'ratios vs first row (crash/hang/change/adopt)':>46} "
              f"{'coord cpu s/s':>13} {'(kills)':>7} {'msgs/s':>8} {'viol':>4} {'false+':>6} {'start s':>7}")
    lines = [header, "-" * len(header)]
    for row in results:
        if "error" in row:
            lines.append(f"{row['members']:>7}  not measured: {row['error']}")
            continue
        ratios = "/".join(ratio(row, key) for key in RATIO_KEYS)
        lines.append(
            f"{row['members']:>7} {row['swarm_procs']:>5} {row['kills']:>5} {row['swaps_completed']:>5} "
            f"{pair(row, 'detect_crash_s'):>13} {pair(row, 'detect_hang_s'):>13} {pair(row, 'view_change_s'):>13} "
            f"{pair(row, 'adopt_s'):>13} {ratios:>46} {row['coordinator_cpu_s_per_s']:>13.3f} "
            f"{row['coordinator_cpu_s_per_s_kills']:>7.3f} {row['coordinator_msgs_per_s']:>8.0f} "
            f"{row['invariant_violations']:>4} {row['false_positives']:>6} {row['startup_s']:>7.1f}")
    lines.append("times in seconds, p50/max over the row's kills; detect: kill -> member_failed; view change: "
                 "member_failed -> view_committed; all adopted: member_failed -> every running member holds it")
    for row in results:
        for text in row.get("violations", []):
            lines.append(f"  {row['members']} members, violation: {text}")
    return "\n".join(lines)


async def _amain(sizes: list[int], settings: Settings, as_json: bool) -> int:
    results: list[dict[str, Any]] = []
    for members in sizes:
        try:
            row = await run_swarm(members, settings)
        except RowFailed as err:
            row = {"members": members, "error": str(err), **err.detail}
        except TimeoutError:
            row = {"members": members, "error": "a swarm process did not answer within 60 s (starved of CPU?)"}
        results.append(row)
        if not as_json:
            outcome = (f"failed: {row['error']}" if "error" in row else
                       f"{row['kills']} kills, {row['swaps_completed']} swaps, {row['invariant_violations']} "
                       f"violations, {row['wall_s']:.0f}s")
            print(f"{members} members: {outcome}", file=sys.stderr, flush=True)
    add_ratios(results)
    if as_json:
        for row in results:
            print(json.dumps(row))
    else:
        print(format_table(results))
    return 0 if all(r.get("invariant_violations") == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--members", default=",".join(str(s) for s in SIZES),
                        help="comma-separated member counts (default: 512,2048,8192)")
    parser.add_argument("--kills", type=int, default=Settings.kills, help="members killed per row, alternately "
                        "a crash and a hang (default: 4)")
    parser.add_argument("--procs", type=int, default=0, help="swarm processes (default: 1 per 2,048 members, 1-4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat-interval", type=float, default=Settings.heartbeat_interval)
    parser.add_argument("--failure-timeout", type=float, default=Settings.failure_timeout,
                        help="the coordinator's failure_timeout (default: Config's, 2 s)")
    parser.add_argument("--steady-s", type=float, default=Settings.steady_s, help="steady window measured")
    parser.add_argument("--join-s", type=float, default=Settings.join_s,
                        help="members join within this (default: 2 s, 1 s per 1,024 members above 2,048)")
    parser.add_argument("--keep", action="store_true", help="keep the events file and logs (path in --json)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.members.split(",") if s]
    settings = Settings(kills=args.kills, procs=args.procs, seed=args.seed,
                        heartbeat_interval=args.heartbeat_interval, failure_timeout=args.failure_timeout,
                        steady_s=args.steady_s, join_s=args.join_s, keep=args.keep)
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_amain(sizes, settings, args.json))
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
