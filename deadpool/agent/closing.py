"""The closing lines a launcher prints: failures, refilled seats, restores, swaps, and the final digest.

Read from this host's events file, so the host whose coordinator ran the job at its
end (host 0, or the standby's host after a takeover) prints the ``final state digest``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deadpool.events import summary
from deadpool.events.log import read_events


def summarize(events_path: str, chaos: Sequence[str] = ()) -> list[str]:
    """The closing lines: failures, refilled seats, buddy restores, swaps with their recovery time, the digest.

    `chaos`: the ``--chaos`` specs this host's workers were to fire (as ``str(ChaosSpec)`` writes them); one that
    none of them fired gets a line saying so, since a fault test whose fault never came tested nothing.
    """
    lines: list[str] = []
    digest: str | None = None
    fired: set[str] = set()
    records = read_events(events_path) if Path(events_path).exists() else iter(())
    for record in records:
        match summary.parse(record):
            case summary.ChaosInjection(spec=spec) if spec:
                fired.add(spec)
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
                digest = finished.digest
    lines += [f"  chaos: {spec} never fired (its member did not reach that point of that step, or was not "
              "running then)" for spec in chaos if spec not in fired]
    if digest is not None:
        lines.append(f"final state digest: {digest}")
    return lines


def _failure_lines(failed: summary.JobFailed) -> list[str]:
    """The summary's lines for a job_failed event: the reason; for a script's error, its traceback too."""
    if not failed.cause:
        return [f"  job failed: {failed.reason}"]
    lines = [f"  job failed ({failed.cause}): {failed.reason}"]
    if failed.traceback:
        lines.append(f"  traceback of {failed.raised_by or '?'} (rank {-1 if failed.rank is None else failed.rank}):")
        lines.extend(f"    {line}" for line in failed.traceback.rstrip("\n").splitlines())
    return lines
