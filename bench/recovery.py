"""Recovery benchmark: DeadPool hot-swap against what users run today, on the same work, in one run.

For the same model (demos/gpt.py 'small', 3.3M parameters), world size (4), steps
(40) and failure (SIGKILL of rank 2 at the start of step 20), it runs:

- DeadPool: ``deadpool launch --nproc 4 --spares 1`` (hot-swap from the buddy's in-memory copy);
- the restart baseline: the same training under ``torchrun --max-restarts`` with a disk
  checkpoint every K steps (K=1 and K=10), resumed after the restart
  (bench/baselines/restart_baseline.py; FINDINGS.md there explains why stock torchrun's
  gloo restart fails here and the per-attempt store prefix that makes it work);
- TorchFT (PyPI ``torchft``), its lighthouse on 127.0.0.1, the killed replica group restarted
  (bench/baselines/torchft_baseline.py), where it installs and runs; otherwise one line says why;
- plain DDP without checkpoints, failure-free: the reference for the overhead ratio;
- ``sharded``: DeadPool on the Llama demo (13M parameters) under FSDP2 x tensor parallel on a 2x2
  mesh, the same kill (its overhead ratio is left out: another model than the DDP reference's);
- ``move``: DeadPool with no failure, but ``deadpool move --rank 2`` once every rank finished step 19:
  a planned move, timed from the moment the seat left (``seat_left``) instead of from a kill;
- ``sdc``: silent data corruption instead of a kill, timed from the flip: one bit of rank 2's first
  parameter flipped after step 20 (found by the replica checks), and, under ``--audit``, rank 2's local
  gradient corrupted at every step from 20 on (found by an audit); ``detect_s`` is the detection latency;
- ``audit``: DeadPool with ``--audit``, the same kill: the spare that takes the seat has re-done the
  seats' steps before (it ran the script's step body), where the plain row's spare has only waited;
  ``first_step_s`` of the two rows says whether that makes its first step in the seat a steady one.

Columns: time from the kill to the first step every rank finished after recovery
(``recovery_s``), the time the job lost against its failure-free pace (``lost_s``: from the last
step every rank finished before the kill or move to the first one after, less one failure-free
step), steps recomputed, total wall time of the run with one failure, and the failure-free median
step time as a ratio to plain DDP; for DeadPool's rows, where the recovery went (``detect_s``,
``pause_s``, ``commit_s``, ``restore_s``, ``first_step_s``: see ``phases``),
printed under the table and in ``--json``; for the move, its time lost over each kill's, repetition by
repetition (``vs_boundary_kill``, ``vs_allreduce_kill``, ``vs_random_kill``, ``vs_hang``: geometric means with 95%
intervals), and its mean over each repair's mean (the same keys with ``_means``).
Medians over ``--repeat`` runs (3 by default).  ``--json`` prints the rows (``--json PATH`` writes them with the
date, machine and commit: docs/results/); ``--plot OUT.png`` draws every system's step timeline.

``--at boundary,allreduce,backward`` adds DeadPool rows with the same kill inside step 20 (``--chaos ... at=``);
``--at random`` one whose SIGKILL this process sends, as a failure lands: repetition r of n at (r + 0.5) / n
of a step after every rank finished step 19, so that the row's runs spread over the step and their time lost
is what a failure costs on average.  ``kill_phases`` says where each landed: the fraction of a step after the
last step every rank finished before the repair (below 0 where the others still finished the step it hit).
``--at hang`` stops rank 2 (SIGSTOP) at the start of step 20 instead: alive but silent, as a host that stops
answering is, it is found by its missed heartbeats (``--failure-timeout``) or by a peer's collective timing out.

    python bench/recovery.py [--repeat 3] [--json [PATH]] [--plot recovery.png]
                             [--systems deadpool,move,audit,sdc,sharded,torchrun,torchft]
                             [--at boundary,allreduce,backward,random,hang]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import results  # noqa: E402
from bench.baselines._common import read_events  # noqa: E402  (the baselines' own files: not DeadPool events)
from bench.baselines.restart_baseline import run_restart_baseline  # noqa: E402
from bench.overhead_injob import ratio_ci, t95  # noqa: E402
from deadpool.events import schema  # noqa: E402

STEPS, KILL_RANK, KILL_STEP, WORLD = 40, 2, 20, 4
SHARDED = "DeadPool hot-swap, FSDP2 x TP (Llama 13M)"
MOVE = "DeadPool planned move, deadpool move of rank 2"
AUDITED = "DeadPool hot-swap, --audit (the spare re-did steps)"
FLIPPED = "DeadPool, a parameter bit flipped (replica check)"
FAULTY = "DeadPool --audit, a seat's gradients wrong from a step on (audit)"


def _all_ranks_finished(events: list[schema.Line]) -> list[tuple[float, int, int]]:
    """(ts, step, epoch) when every seat finished a step under a view, in time order."""
    finished: dict[tuple[int, int], list[float]] = defaultdict(list)
    for record in events:
        if isinstance(record, schema.StepFinished) and record.epoch is not None and record.step is not None:
            finished[(record.epoch, record.step)].append(record.ts)
    return sorted((max(ts), step, epoch) for (epoch, step), ts in finished.items() if len(ts) >= WORLD)


def _step_gaps(steps: list[tuple[float, int, int]]) -> list[float]:
    """The times between consecutive steps every seat finished under the same view (``_all_ranks_finished``'s)."""
    return [b[0] - a[0] for a, b in itertools.pairwise(steps) if a[2] == b[2] and b[1] == a[1] + 1]


LLAMA = ("demos/train_llama.py", "--fsdp", "--tp", "2")  # the sharded row: FSDP2 x TP on a 2x2 mesh
PHASES = ("detect_s", "pause_s", "commit_s", "restore_s", "first_step_s")


def phases(events: list[schema.Line], kill_ts: float, kill_epoch: int) -> dict[str, float]:
    """Where a swap's time went, each phase from the end of the one before (DeadPool's events):

    ``detect_s`` the kill to ``member_failed``; ``pause_s`` to the last survivor ``paused`` (it ran on
    until it noticed); ``commit_s`` to ``view_committed``; ``restore_s`` to the last seat ``restored``
    (rollbacks, the spare's fetch, the group rebuild); ``first_step_s`` to the first step every seat
    finished under the new view.
    """
    def first(kind: type[schema.Record]) -> float | None:
        return min((r.ts for r in events if isinstance(r, kind) and r.ts >= kill_ts), default=None)

    detected = first(schema.MemberFailed) or first(schema.SeatLeft)  # a planned move: the seat left
    committed = first(schema.ViewCommitted)
    if detected is None or committed is None:
        return {}
    paused = [r.ts for r in events if isinstance(r, schema.Paused) and detected <= r.ts <= committed]
    restored = [r.ts for r in events if isinstance(r, schema.Restored) and r.ts >= committed]
    after = [s for s in _all_ranks_finished(events) if s[2] > kill_epoch]
    if not restored or not after:
        return {}
    marks = [kill_ts, detected, max(paused, default=detected), committed, max(restored), after[0][0]]
    return {name: round(b - a, 3) for name, (a, b) in zip(PHASES, itertools.pairwise(marks), strict=True)}


def run_deadpool(kill: bool, workdir: Path, demo: tuple[str, ...] = ("demos/train_gpt.py",),
                 at: str = "boundary", move: bool = False, audit: bool = False, chaos: str = "",
                 phase: float = 0.5) -> dict[str, Any]:
    """One DeadPool job of `demo` (script and arguments), killed `at` a chaos point of the kill step (``random``:
    by this process, `phase` of a step after every rank finished the step before it), or with rank KILL_RANK
    moved (`move`) then; the same numbers as the baselines' drivers report, timed from the kill or from the
    moment the moving seat left."""
    workdir.mkdir(parents=True, exist_ok=True)
    events_path = workdir / "events.jsonl"
    command = [sys.executable, "-m", "deadpool", "launch", "--no-progress", "--events", str(events_path),
               "--nproc", str(WORLD), "--spares", "1", *(("--audit",) if audit else ())]
    external = kill and at == RANDOM  # a SIGKILL from outside, as a failure lands: no chaos point
    if kill and not move and not external:
        command += ["--chaos", chaos or (f"stop:rank={KILL_RANK}:step={KILL_STEP}" if at == HANG else
                                         f"kill:rank={KILL_RANK}:step={KILL_STEP}" + ("" if at == "boundary" else
                                                                                      f":at={at}"))]
    command += [str(REPO / demo[0]), *demo[1:], "--steps", str(STEPS)]
    started = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    killed: list[float] = []  # when this process sent the SIGKILL
    if move:
        _move_when(events_path, job)
    elif external:
        killed = _kill_when(events_path, job, phase)
    stdout, stderr = job.communicate(timeout=600)
    proc = subprocess.CompletedProcess(command, job.returncode, stdout, stderr)
    total = time.monotonic() - started
    events = schema.read(events_path) if events_path.exists() else []
    steps = _all_ranks_finished(events)
    result: dict[str, Any] = {"ok": proc.returncode == 0, "total_s": round(total, 3)}
    if proc.returncode != 0:  # why, in the coordinator's words where it gave them (the events stay in `workdir`)
        failed = [r for r in events if isinstance(r, schema.JobFailed)]
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        result["error"] = (failed[0].detail or failed[0].reason) if failed else tail
    same_epoch_gaps = _step_gaps(steps)
    if same_epoch_gaps:
        result["median_step_s"] = round(statistics.median(same_epoch_gaps), 4)
    kills: list[schema.ChaosInjected | schema.SeatLeft] = [r for r in events if isinstance(r, schema.ChaosInjected)]
    if move:
        kills = [r for r in events if isinstance(r, schema.SeatLeft)]
    kill_times = killed or [r.ts for r in kills]
    if kill_times:
        kill_ts = kill_times[0]
        kill_epoch = max((s[2] for s in steps if s[0] <= kill_ts), default=0) if move or external else \
            kills[0].epoch or 0
        # Steps every rank finished in the view the kill hit (some may have finished just after the kill),
        # and the first step every rank finished under the view that replaced it.
        last_before = max((s[1] for s in steps if s[2] == kill_epoch), default=-1)
        after = [s for s in steps if s[2] > kill_epoch]
        progress = max((s[0] for s in steps if s[2] == kill_epoch), default=None)  # the job's last step before it
        if after and progress is not None:
            result["gap_s"] = round(after[0][0] - progress, 3)
        if after:
            result["recovery_s"] = round(after[0][0] - kill_ts, 3)
            result["steps_recomputed"] = max(0, last_before + 1 - after[0][1])
        swap = [r for r in events if isinstance(r, schema.SwapCompleted)]
        result["swap_recovery_s"] = swap[0].recovery_s if swap else None
        result.update(phases(events, kill_ts, kill_epoch))
        if external and progress is not None and "median_step_s" in result:  # where in its step the kill landed
            result["kill_phase"] = round((kill_ts - progress) / result["median_step_s"], 3)
    result["timeline"] = [(round(ts - steps[0][0], 3), step) for ts, step, _ in steps] if steps else []
    if kill_times and steps:
        result["kill_at_s"] = round(kill_times[0] - steps[0][0], 3)
    return result


def _before_kill_step(events_path: Path, job: subprocess.Popen[str], poll: float) -> list[schema.Line]:
    """The job's events once every rank finished step KILL_STEP - 1, read every `poll` seconds ([]: the job ended, or
    300 s passed, first)."""
    deadline = time.monotonic() + 300
    while job.poll() is None and time.monotonic() < deadline:
        events = schema.read(events_path) if events_path.exists() else []
        if any(step >= KILL_STEP - 1 for _, step, _ in _all_ranks_finished(events)):
            return events
        time.sleep(poll)
    return []


def _kill_when(events_path: Path, job: subprocess.Popen[str], phase: float) -> list[float]:
    """SIGKILL seat KILL_RANK's worker (its pid from the coordinator's ``member_joined`` line) `phase` of a step (the
    job's median so far) after every rank finished step KILL_STEP - 1; the kill's time, or [] if it never came."""
    events = _before_kill_step(events_path, job, 0.02)
    if not events:
        return []
    pid = next(r.pid for r in events if isinstance(r, schema.MemberJoined) and r.source_process == "coordinator"
               and r.role == "active" and r.seat_hint == KILL_RANK)
    time.sleep(phase * statistics.median(_step_gaps(_all_ranks_finished(events))))
    killed = time.time()
    os.kill(pid, signal.SIGKILL)  # a worker of the job this process started
    return [killed]


def _move_when(events_path: Path, job: subprocess.Popen[str]) -> None:
    """``deadpool move --rank KILL_RANK`` once every rank finished step KILL_STEP - 1 (the job's own address)."""
    events = _before_kill_step(events_path, job, 0.05)
    if not events:
        return
    address = next(r.address for r in events if isinstance(r, schema.CoordinatorStarted))
    moved = subprocess.run([sys.executable, "-m", "deadpool", "move", "--rank", str(KILL_RANK),
                            "--coordinator", address], capture_output=True, text=True, timeout=60, cwd=REPO)
    if moved.returncode:
        print(f"deadpool move failed: {moved.stderr.strip()}", file=sys.stderr, flush=True)


def _timeline_from(result: dict[str, Any], workdir: Path) -> None:
    """Baseline drivers leave events.jsonl in their workdir: derive the same timeline from it."""
    if "timeline" in result:
        return
    finished: dict[tuple[int, int], list[float]] = defaultdict(list)
    participants: dict[tuple[int, int], int] = {}  # TorchFT: replicas that committed the step together
    kills = []
    for record in read_events(workdir / "events.jsonl"):
        if record.get("event") == "step_finished":
            # A restarted torchrun attempt recomputes steps (its own line); TorchFT replicas, restarted or not,
            # commit each step together (one line).
            incarnation = 0 if "participants" in record else int(record.get("launch", 0)) * 1000 + int(
                record.get("attempt", 0))
            key = (incarnation, int(record["step"]))
            finished[key].append(float(record["ts"]))
            participants[key] = max(participants.get(key, 0), int(record.get("participants", WORLD)))
        elif record.get("event") == "killing":
            kills.append(float(record["ts"]))
    # A step counts when as many ranks as committed it together have finished it; a TorchFT replica that
    # rejoins later reports its own first steps again (step 0 seconds after the others), which does not count.
    steps = sorted((sorted(ts)[needed - 1], key[1]) for key, ts in finished.items()
                   if len(ts) >= (needed := min(WORLD, participants[key])))
    if steps:
        result["timeline"] = [(round(ts - steps[0][0], 3), step) for ts, step in steps]
        if kills:
            result["kill_at_s"] = round(kills[0] - steps[0][0], 3)


RANDOM = "random"  # a SIGKILL sent from outside at an instant spread over the step, one phase per repetition
HANG = "hang"  # a SIGSTOP at the step's start: the member hangs, as a host that stops answering does
AT_NAMES = {"allreduce": "kill in the all-reduce", "backward": "kill in backward",
            RANDOM: "kill at an instant spread over a step", HANG: "hang at a step boundary"}
# The failure repairs the move's time lost is compared with: (its ratio's key, the repair's row, in words).
REPAIRS = (("vs_boundary_kill", "DeadPool hot-swap", "a kill at a step boundary"),
           ("vs_allreduce_kill", f"DeadPool hot-swap, {AT_NAMES['allreduce']}", f"a {AT_NAMES['allreduce']}"),
           ("vs_random_kill", f"DeadPool hot-swap, {AT_NAMES[RANDOM]}", f"a {AT_NAMES[RANDOM]}"),
           ("vs_hang", f"DeadPool hot-swap, {AT_NAMES[HANG]}", f"a {AT_NAMES[HANG]}"))


def measure(systems: set[str], repeat: int, root: Path,
            kill_points: tuple[str, ...] = ("boundary",)) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Run everything `repeat` times; return the table rows, one timeline per system, and notes.

    `kill_points`: where in step KILL_STEP DeadPool's GPT rank is killed, one row each (``boundary``: at its
    start, like every baseline's kill; ``allreduce``, ``backward``: inside the step, --chaos ``at=``)."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    notes: list[str] = []
    plan: list[tuple[str, bool, Any]] = []  # (row, with a kill, run(workdir) or None: shares another row's)
    plan.append(("plain DDP", False, lambda w: run_restart_baseline(STEPS, None, None, 1_000_000, WORLD, w)))
    if "deadpool" in systems:
        plan.append(("DeadPool hot-swap", False, lambda w: run_deadpool(False, w)))
        for at in kill_points:
            name = "DeadPool hot-swap" + (f", {AT_NAMES[at]}" if at in AT_NAMES else "")
            if at != "boundary":  # the same failure-free run: its step time is the row's too
                plan.append((name, False, None))
            # A kill from outside lands at a spread of instants, one per repetition in turn: (r + 0.5) / repeat
            # of a step after the step before the kill step, for r = 0, 1, ...
            spread = [(r + 0.5) / repeat for r in range(repeat)]
            plan.append((name, True, lambda w, at=at, spread=spread: run_deadpool(True, w, at=at,
                                                                                  phase=spread.pop(0))))
    if "move" in systems:
        plan.append((MOVE, False, None))  # the failure-free run is DeadPool hot-swap's
        plan.append((MOVE, True, lambda w: run_deadpool(True, w, move=True)))
    if "audit" in systems:
        plan.append((AUDITED, False, lambda w: run_deadpool(False, w, audit=True)))
        plan.append((AUDITED, True, lambda w: run_deadpool(True, w, audit=True)))
    if "sdc" in systems:  # silent corruption: the time from the flip to its detection is detect_s
        plan.append((FLIPPED, False, None))
        plan.append((FLIPPED, True, lambda w: run_deadpool(
            True, w, chaos=f"corrupt:rank={KILL_RANK}:step={KILL_STEP}:what=param")))
        plan.append((FAULTY, False, None if "audit" in systems else lambda w: run_deadpool(False, w, audit=True)))
        plan.append((FAULTY, True, lambda w: run_deadpool(
            True, w, audit=True, chaos=f"corrupt:rank={KILL_RANK}:step={KILL_STEP}:what=grad:every=1")))
    if "sharded" in systems:
        plan.append((SHARDED, False, lambda w: run_deadpool(False, w, LLAMA)))
        plan.append((SHARDED, True, lambda w: run_deadpool(True, w, LLAMA)))
    if "torchrun" in systems:
        for k in (1, 10):
            plan.append((f"torchrun restart, ckpt every {k}", False,
                         lambda w, k=k: run_restart_baseline(STEPS, None, None, k, WORLD, w)))
            plan.append((f"torchrun restart, ckpt every {k}", True,
                         lambda w, k=k: run_restart_baseline(STEPS, KILL_RANK, KILL_STEP, k, WORLD, w)))
    if "torchft" in systems:
        try:
            import torchft

            from bench.baselines.torchft_baseline import run_torchft_baseline

            plan.append(("TorchFT", False, lambda w: run_torchft_baseline(STEPS, None, None, w)))
            plan.append(("TorchFT", True, lambda w: run_torchft_baseline(STEPS, KILL_RANK, KILL_STEP, w)))
        except ImportError as err:
            notes.append(f"TorchFT: not measured: it does not import here ({err}); "
                         'install it with python3 -m pip install -e ".[bench]" -c constraints.txt')
    for rep in range(repeat):
        for index, (name, kill, run) in enumerate(plan):
            if run is None:
                continue  # shares another row's failure-free run
            workdir = root / f"{rep}-{index}"
            print(f"[{rep + 1}/{repeat}] {name}{' with a kill' if kill else ''} ...", file=sys.stderr, flush=True)
            try:
                result = run(workdir)
            except Exception as err:
                result = {"ok": False, "error": repr(err)}
            _timeline_from(result, workdir)
            if not result.get("ok", True):
                print(f"[{rep + 1}/{repeat}] {name} failed: {result.get('error', '?')} ({workdir})",
                      file=sys.stderr, flush=True)
            runs[f"{name}|{kill}"].append(result)

    def med(items: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in items if isinstance(r.get(key), (int, float))]
        return round(statistics.median(values), 3) if values else None

    ddp_step = med(runs["plain DDP|False"], "median_step_s")
    rows: list[dict[str, Any]] = []
    timelines: dict[str, Any] = {}
    for name in dict.fromkeys(n for n, _, _ in plan if n != "plain DDP"):
        shared = runs[f"{AUDITED}|False"] if name == FAULTY else []  # an audited job's failure-free run
        ok_runs = runs[f"{name}|False"] or shared or runs["DeadPool hot-swap|False"]
        kill_runs = runs[f"{name}|True"]
        step, recovery, gap = med(ok_runs, "median_step_s"), med(kill_runs, "recovery_s"), med(kill_runs, "gap_s")
        rows.append({
            "system": name,
            "recovery_s": recovery,
            # The time the job lost against its failure-free pace: from the last step every rank finished before the
            # failure (or the move) to the first one after, less one failure-free step. It counts what recovery_s
            # leaves out: the part of a step a kill inside it wasted, and a moving seat's wait for its boundary.
            "lost_s": round(gap - step, 3) if gap is not None and step else None,
            # Beyond the one step a swap must recompute at least (the failed step); the bound is 0.25 s.
            "beyond_step_s": round(recovery - step, 3) if recovery is not None and step else None,
            "steps_recomputed": med(kill_runs, "steps_recomputed"),
            "total_s": med(kill_runs, "total_s"),
            # The sharded row trains another model: its step is not comparable with the GPT's plain DDP.
            "overhead_ratio": round(step / ddp_step, 3) if step and ddp_step and name != SHARDED else None,
            "failure_free_step_s": step,
            **{phase: med(kill_runs, phase) for phase in PHASES if med(kill_runs, phase) is not None},
            "runs_ok": f"{sum(1 for r in kill_runs if r.get('ok', r.get('finished')))}/{len(kill_runs)}",
        })
        if step:  # each repetition's, in order (None where the run gave no gap): the move's ratios pair them
            rows[-1]["lost_s_runs"] = [round(r["gap_s"] - step, 3) if "gap_s" in r else None for r in kill_runs]
        if any("kill_phase" in r for r in kill_runs):  # where each repetition's kill landed in its step
            rows[-1]["kill_phases"] = [r.get("kill_phase") for r in kill_runs]
        if errors := [r["error"] for r in kill_runs if "error" in r]:
            rows[-1]["errors"] = errors
        if kill_runs and kill_runs[0].get("timeline"):
            timelines[name] = kill_runs[0]
    move = next((row for row in rows if row["system"] == MOVE), None)
    for key, name, _ in REPAIRS:
        repair = next((row for row in rows if row["system"] == name), None)
        if move is not None and repair is not None:
            move.update(_paired_ratio(key, move.get("lost_s_runs", []), repair.get("lost_s_runs", [])))
            move.update(_mean_ratio(f"{key}_means", move.get("lost_s_runs", []), repair.get("lost_s_runs", [])))
    torchft = next((r["recovery_s"] for r in rows if r["system"] == "TorchFT" and r["recovery_s"]), None)
    for row in rows:
        if row["system"].startswith("DeadPool") and torchft and row["recovery_s"] is not None:
            row["vs_torchft"] = round(row["recovery_s"] / torchft, 3)  # the bound: at most 0.75
    notes.append(f"plain DDP (torch DDP, no checkpoints) median step: {ddp_step} s")
    return rows, timelines, notes


def _paired_ratio(key: str, moves: list[float | None], kills: list[float | None]) -> dict[str, Any]:
    """The move's time lost over a kill's, repetition by repetition (the two ran in the same round): their
    geometric mean as `key`, its 95% interval as `key`_ci95 and the pairs counted (none: {})."""
    ratios = [m / k for m, k in zip(moves, kills, strict=False) if m is not None and k is not None and m > 0 and k > 0]
    if not ratios:
        return {}
    mean, low, high = ratio_ci(ratios)
    return {key: round(mean, 3), f"{key}_ci95": [round(low, 3), round(high, 3)] if len(ratios) > 1 else None,
            f"{key}_pairs": len(ratios)}


def _mean_ratio(key: str, moves: list[float | None], kills: list[float | None]) -> dict[str, Any]:
    """The move's mean time lost over a repair's mean (what a repair costs on average, whichever instant its
    failure hits: the spread kill's repetitions differ by design, so pairing them says less), as `key`, with its
    95% interval (delta method on the log of the ratio, t with the fewer runs less one degrees of freedom) as
    `key`_ci95 (none with fewer than two runs either side: {})."""
    top, bottom = [m for m in moves if m is not None], [k for k in kills if k is not None]
    if len(top) < 2 or len(bottom) < 2 or statistics.fmean(top) <= 0 or statistics.fmean(bottom) <= 0:
        return {}
    m, k = statistics.fmean(top), statistics.fmean(bottom)
    spread = math.sqrt(statistics.variance(top) / (len(top) * m * m)
                       + statistics.variance(bottom) / (len(bottom) * k * k))
    half = t95(min(len(top), len(bottom)) - 1) * spread
    return {key: round(m / k, 3), f"{key}_ci95": [round(m / k * math.exp(-half), 3), round(m / k * math.exp(half), 3)]}


def plot(timelines: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4.5))
    for name, result in timelines.items():
        points = result["timeline"]
        line, = axis.plot([t for t, _ in points], [s for _, s in points], marker=".", label=name)
        if "kill_at_s" in result:
            axis.axvline(result["kill_at_s"], color=line.get_color(), linestyle=":", alpha=0.6)
    axis.set_xlabel("seconds since the first step")
    axis.set_ylabel("step finished by every participating rank")
    axis.set_title(f"SIGKILL of rank {KILL_RANK} at step {KILL_STEP} (dotted: the kill)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--systems", default="deadpool,move,audit,sdc,sharded,torchrun,torchft")
    results.json_option(parser, "the rows")
    parser.add_argument("--plot", default="")
    parser.add_argument("--save", default="", help="also write the rows (the --json list) to this file")
    parser.add_argument("--at", default="boundary",
                        help="where DeadPool's kill hits step 20, one row each: boundary,allreduce,backward,random; "
                             "hang: a SIGSTOP at its start")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    root = Path(tempfile.mkdtemp(prefix="deadpool-recovery-bench-"))
    kill_points = tuple(dict.fromkeys(args.at.split(",")))
    if not set(kill_points) <= {"boundary", *AT_NAMES}:
        parser.error(f"--at: one or more of boundary, {', '.join(AT_NAMES)}")
    rows, timelines, notes = measure(set(args.systems.split(",")), args.repeat, root, kill_points)
    if args.save:
        Path(args.save).write_text(json.dumps(rows, indent=2) + "\n")
    move = next((row for row in rows if row["system"] == MOVE), None)
    if args.json and args.json != "-":
        results.write(args.json, "recovery", rows, notes, repeat=args.repeat,
                      config={"world": WORLD, "steps": STEPS, "kill_rank": KILL_RANK, "kill_step": KILL_STEP})
    if args.json == "-":
        print(json.dumps(rows, indent=2))
    else:
        header = f"{'system':36s} {'recovery_s':>10s} {'recomputed':>10s} {'total_s':>8s} {'overhead':>8s} {'ok':>5s}"
        print(header)
        for row in rows:
            print(f"{row['system']:36s} {row['recovery_s']!s:>10s} {row['steps_recomputed']!s:>10s} "
                  f"{row['total_s']!s:>8s} {row['overhead_ratio']!s:>8s} {row['runs_ok']:>5s}")
        print(f"(medians over {args.repeat} run(s); world 4, {STEPS} steps, SIGKILL rank {KILL_RANK} at step "
              f"{KILL_STEP}; load average {os.getloadavg()[0]:.1f})")
        for row in rows:
            if any(phase in row for phase in PHASES):
                print(f"{row['system']}: " + ", ".join(f"{p} {row[p]}" for p in PHASES if p in row)
                      + f" (failure-free step {row['failure_free_step_s']} s, {row['beyond_step_s']} s beyond it"
                      + (f"; {row['vs_torchft']}x TorchFT's recovery" if "vs_torchft" in row else "") + ")")
        for key, _, what in REPAIRS:
            if move is not None and key in move:
                print(f"the move's time lost over {what}'s, per repetition: {move[key]}x (geometric mean of "
                      f"{move[key + '_pairs']}; 95% interval {move[key + '_ci95']}); mean over mean: "
                      f"{move.get(key + '_means')}x (95% interval {move.get(key + '_means_ci95')})")
        for note in notes:
            print(note)
    if args.plot:
        plot(timelines, args.plot)
        print(f"timeline written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
