"""The closing lines a launcher prints: failures, refilled seats, restores, swaps, and the final digest.

Read from this host's events file, so the host whose coordinator ran the job at its end
(host 0, or the standby's host after a takeover) prints the ``final state digest``, and
the line saying when that final state is not guaranteed to be a failure-free run's.  What
the exit status makes of them (a chaos spec that never fired, ``--strict``) is ``verdict.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deadpool.agent import verdict
from deadpool.events import schema, summary


@dataclass(frozen=True, slots=True)
class Closing:
    """What the end of one host's launch reports: the lines, and the findings its exit status depends on."""

    lines: list[str]  # the closing lines, in order, the digest last
    not_fired: list[summary.ChaosNotFired]  # this host's specs that never fired
    untracked: summary.UntrackedRollback | None  # a restore left an untracked data loader where it was


def read(events_path: str, chaos: Sequence[str] = (), targets: Mapping[str, str] | None = None) -> Closing:
    """The closing lines and findings of a job from its events file.

    `chaos`: the ``--chaos`` specs this host's workers were to fire (as ``str(ChaosSpec)`` writes them), and
    `targets` the member each was for; one that none of them fired gets a line saying why (what its member
    reached), since a fault test whose fault never came tested nothing.

    Raises:
        schema.SchemaError: a line of the file does not match its kind's schema.
    """
    targets = targets or {}
    lines: list[str] = []
    final: summary.JobFinished | None = None
    trails = verdict.Trails({member: verdict.Trail() for member in targets.values() if member})
    records = schema.iter_file(events_path) if Path(events_path).exists() else iter(())
    seats: dict[str, int] = {}
    for record in records:
        summary.learn_seats(seats, record)
        fact = summary.parse(record, seats)
        trails.follow(fact)
        match fact:
            case summary.Failure() as f:
                lines.append(f"  failure: rank {-1 if f.rank is None else f.rank} ({f.member}) "
                             f"detected by {f.detected_by}: {f.reason}")
            case summary.ViewCommit(refilled=refilled) as view if refilled:
                lines.append(f"  view {view.epoch}: seats {list(refilled)} refilled, "
                             f"resume after step {view.resume_step}")
            case summary.Restore(source="buddy") as restore:
                lines.append(f"  restored rank {restore.rank} from its buddy: {(restore.bytes or 0) / 1e6:.1f} MB "
                             f"in {restore.s or 0:.3f} s")
            case summary.Swap() as swap:
                lines.append(f"  swap: rank {swap.rank} back in {swap.recovery_s} s "
                             f"(failure to first finished step; {swap.old_member} -> {swap.new_member})")
            case summary.JobFailed() as failed:
                lines.extend(_failure_lines(failed))
            case summary.JobFinished() as finished:
                final = finished
    unfired = verdict.not_fired(chaos, targets, trails)
    lines += [verdict.not_fired_line(finding) for finding in unfired]
    untracked = final.untracked if final is not None else None
    if untracked is not None:
        lines.append(verdict.untracked_line(untracked))
    if final is not None:
        lines.append(f"final state digest: {final.digest}")
    return Closing(lines, unfired, untracked)


def summarize(events_path: str, chaos: Sequence[str] = ()) -> list[str]:
    """The closing lines alone (``read``'s, with no member known for the specs)."""
    return read(events_path, chaos).lines


def _failure_lines(failed: summary.JobFailed) -> list[str]:
    """The summary's lines for a job_failed event: the reason; for a script's error, its traceback too."""
    if not failed.cause:
        return [f"  job failed: {failed.reason}"]
    lines = [f"  job failed ({failed.cause}): {failed.reason}"]
    if failed.traceback:
        lines.append(f"  traceback of {failed.raised_by or '?'} (rank {-1 if failed.rank is None else failed.rank}):")
        lines.extend(f"    {line}" for line in failed.traceback.rstrip("\n").splitlines())
    return lines
