"""Reading an events file back: a summary, a plain-text timeline and a plot.

Every process of a job appends JSON lines to one events file (see
``deadpool.events.log``).  This module is what ``deadpool events FILE [--plot
OUT.png]`` runs on that file after (or during) a run: it answers the questions
a person asks after a failure -- who died, how it was noticed, which spare took
the seat, how long the job was down, where it resumed, and whether the final
state digest matches a failure-free run.

Nothing here talks to a live job; it only reads records, so it works on the
file of a crashed job, a half-written file, or one copied from a cluster.
Records are treated as untrusted: every field may be missing or of the wrong
type, and unknown events are shown generically rather than rejected.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from deadpool.errors import MisuseError
from deadpool.events.log import read_events

Record = dict[str, Any]

# Fields every line carries; the generic formatter leaves them out of ``k=v`` lists.
_IDENTITY = frozenset({"ts", "event", "epoch", "member", "rank", "step", "source_process"})
# Sorts after every real rank: records without a seat (coordinator, spares) speak last.
_NO_RANK = 1 << 30


# ---------------------------------------------------------------------------
# The summary


@dataclass(frozen=True, slots=True)
class Failure:
    """One member declared dead."""

    ts: float | None  # when the failure was declared (unix seconds)
    member: str  # the dead member's id
    rank: int | None  # the seat it held (None: a spare or unknown)
    detected_by: str  # heartbeat | collective_error | exit | report
    reason: str  # free text from the detector ("" when absent)


@dataclass(frozen=True, slots=True)
class ViewCommit:
    """One committed view (the first per epoch; at most one may exist)."""

    ts: float | None  # when it was committed
    epoch: int | None  # the view's epoch
    resume_step: int | None  # training goes on at resume_step + 1
    seats: tuple[str, ...]  # rank -> member id
    spares: tuple[str, ...]  # spare member ids, in adoption order


@dataclass(frozen=True, slots=True)
class Swap:
    """A spare that took a dead member's seat and finished its first step."""

    ts: float | None  # when the swap was reported complete
    rank: int | None  # the seat
    old_member: str  # the member that died
    new_member: str  # the spare that took its place
    recovery_s: float | None  # from the failure to the first finished step after it


@dataclass(frozen=True, slots=True)
class Restore:
    """One member loading a snapshot (a survivor rolling back, or an adopted spare)."""

    ts: float | None  # when the restore finished
    member: str  # who restored
    rank: int | None  # its seat
    source: str  # local | buddy | disk
    bytes: int | None  # size of the restored state
    s: float | None  # seconds the restore took


@dataclass(frozen=True, slots=True)
class SpareChange:
    """The spare pool after one event changed it."""

    ts: float | None  # when the pool changed
    cause: str  # the event that changed it (member_joined, view_committed, spare_lost, ...)
    member: str  # the spare concerned ("" for a view that reset the pool)
    spares: int  # pool size after the change


@dataclass(frozen=True, slots=True)
class ChaosInjection:
    """A fault injected on purpose (``--chaos`` or ``deadpool chaos``)."""

    ts: float | None  # when it was injected
    action: str  # kill | stop | cont | ...
    member: str  # the target member ("" when unknown)
    rank: int | None  # the target seat


@dataclass(frozen=True, slots=True)
class Summary:
    """What happened in a job, condensed from its events.

    A job's file mixes lines from every process, so the same fact may be
    written more than once (every survivor may report one death).  The summary
    keeps the first record of a failure per member, of a view per epoch, and of
    a swap per (old, new) member pair, so counts mean what a person expects.
    """

    events: int  # records read
    start_ts: float | None  # earliest timestamp in the file
    end_ts: float | None  # latest timestamp in the file
    steps_finished: int  # distinct step numbers some rank finished
    last_step: int | None  # highest step number finished
    replayed_steps: int  # step completions redone after a rollback to resume_step
    failures: tuple[Failure, ...]
    views: tuple[ViewCommit, ...]
    swaps: tuple[Swap, ...]
    restores: tuple[Restore, ...]
    spare_changes: tuple[SpareChange, ...]
    chaos: tuple[ChaosInjection, ...]
    fenced: int  # fenced events (zombies that woke up and were told to exit)
    rejected: int  # rejected events (messages or joins refused)
    finished: bool  # some rank wrote training_finished
    final_step: int | None  # from training_finished
    final_digest: str | None  # training_finished.state_digest
    job_failed: str | None  # the job_failed reason, None when the job did not fail
    unknown_events: tuple[str, ...]  # event names this module does not know (shown generically)

    @property
    def duration_s(self) -> float | None:
        """Seconds from the first to the last record."""
        if self.start_ts is None or self.end_ts is None:
            return None
        return self.end_ts - self.start_ts

    @property
    def outcome(self) -> str:
        """``failed``, ``finished`` or ``incomplete`` (no final event: crashed or still running)."""
        if self.job_failed is not None:
            return "failed"
        if self.finished:
            return "finished"
        return "incomplete"


def load(path: str | os.PathLike[str]) -> list[Record]:
    """Read every readable event of a file, in file order.

    Bad lines are skipped (and logged) by ``read_events``, so a file cut off by
    a crash still loads.

    Raises:
        OSError: the file cannot be opened (missing, unreadable).
    """
    return list(read_events(path))


def summarize(events: Iterable[Record]) -> Summary:
    """Condense a job's events into a ``Summary``; never raises on odd records."""
    ordered = _ordered(events)
    acc = _Accumulator(_seat_map(ordered))
    for ts, record in ordered:
        acc.count(ts)
        handler = _SUMMARY_HANDLERS.get(_str(record.get("event")))
        if handler is None:
            acc.unknown.setdefault(_str(record.get("event")) or "?", None)
        else:
            handler(acc, ts, record)
    return acc.finish()


class _Accumulator:
    """Mutable state while ``summarize`` walks the records; becomes a frozen Summary."""

    def __init__(self, seats: dict[str, int]) -> None:
        self.seats = seats  # member -> seat, for records that do not say
        self.events = 0
        self.start_ts: float | None = None
        self.end_ts: float | None = None
        self.step_runs: set[tuple[int | None, int]] = set()  # (epoch, step) completions
        self.failures: dict[str, Failure] = {}
        self.anonymous_failures: list[Failure] = []
        self.views: dict[int | None, ViewCommit] = {}
        self.swaps: dict[tuple[str, str], Swap] = {}
        self.restores: list[Restore] = []
        self.spares: list[str] = []
        self.spare_changes: list[SpareChange] = []
        self.chaos: list[ChaosInjection] = []
        self.fenced = 0
        self.rejected = 0
        self.final: tuple[int, Record] | None = None  # (rank, record) of training_finished
        self.job_failed: str | None = None
        self.unknown: dict[str, None] = {}

    def count(self, ts: float | None) -> None:
        self.events += 1
        if ts is not None:
            self.start_ts = ts if self.start_ts is None else min(self.start_ts, ts)
            self.end_ts = ts if self.end_ts is None else max(self.end_ts, ts)

    def set_spares(self, ts: float | None, cause: str, member: str, spares: list[str]) -> None:
        if spares != self.spares:
            self.spares = spares
            self.spare_changes.append(SpareChange(ts, cause, member, len(spares)))

    def finish(self) -> Summary:
        steps = {step for _, step in self.step_runs}
        failures = sorted([*self.failures.values(), *self.anonymous_failures], key=_ts_key)
        final = self.final[1] if self.final else {}
        final_step = _int(final.get("step"))
        final_digest = _str(final.get("state_digest")) or None
        return Summary(
            events=self.events,
            start_ts=self.start_ts,
            end_ts=self.end_ts,
            steps_finished=len(steps),
            last_step=max(steps) if steps else None,
            replayed_steps=len(self.step_runs) - len(steps),
            failures=tuple(failures),
            views=tuple(self.views.values()),
            swaps=tuple(self.swaps.values()),
            restores=tuple(self.restores),
            spare_changes=tuple(self.spare_changes),
            chaos=tuple(self.chaos),
            fenced=self.fenced,
            rejected=self.rejected,
            finished=self.final is not None,
            final_step=final_step,
            final_digest=final_digest,
            job_failed=self.job_failed,
            unknown_events=tuple(self.unknown),
        )


def _on_step(acc: _Accumulator, ts: float | None, r: Record) -> None:
    step = _int(r.get("step"))
    if step is not None and step >= 0:
        acc.step_runs.add((_int(r.get("epoch")), step))


def _on_failed(acc: _Accumulator, ts: float | None, r: Record) -> None:
    member, rank = _subject(r, "failed", acc.seats)
    failure = Failure(ts, member, rank, _str(r.get("detected_by")) or "?", _str(r.get("reason")))
    if not member:
        acc.anonymous_failures.append(failure)
    else:
        acc.failures.setdefault(member, failure)
    if member and member in acc.spares:
        acc.set_spares(ts, "member_failed", member, [m for m in acc.spares if m != member])


def _on_view(acc: _Accumulator, ts: float | None, r: Record) -> None:
    epoch = _int(r.get("epoch"))
    if epoch in acc.views:
        return
    seats, spares = _str_list(r.get("seats")), _str_list(r.get("spares"))
    acc.views[epoch] = ViewCommit(ts, epoch, _int(r.get("resume_step")), tuple(seats), tuple(spares))
    if isinstance(r.get("spares"), list):
        acc.set_spares(ts, "view_committed", "", spares)


def _on_restored(acc: _Accumulator, ts: float | None, r: Record) -> None:
    acc.restores.append(
        Restore(
            ts,
            _str(r.get("member")),
            _int(r.get("rank")),
            _str(r.get("source")) or "?",
            _int(r.get("bytes")),
            _float(r.get("s")),
        )
    )


def _on_swap(acc: _Accumulator, ts: float | None, r: Record) -> None:
    old, new = _str(r.get("old_member")), _str(r.get("new_member"))
    swap = Swap(ts, _int(r.get("rank")), old, new, _float(r.get("recovery_s")))
    if old or new:
        acc.swaps.setdefault((old, new), swap)
    else:
        acc.swaps[(f"?{len(acc.swaps)}", "")] = swap


def _on_joined(acc: _Accumulator, ts: float | None, r: Record) -> None:
    member = _str(r.get("member"))
    if _str(r.get("role")) == "spare" and member and member not in acc.spares:
        acc.set_spares(ts, "member_joined", member, [*acc.spares, member])


def _on_spare_lost(acc: _Accumulator, ts: float | None, r: Record) -> None:
    member, _ = _subject(r, "lost", acc.seats)
    if member in acc.spares:
        acc.set_spares(ts, "spare_lost", member, [m for m in acc.spares if m != member])
    elif acc.spares:  # unnamed: the pool shrank by one, whoever it was
        acc.set_spares(ts, "spare_lost", member, acc.spares[1:])


def _on_chaos(acc: _Accumulator, ts: float | None, r: Record) -> None:
    member, rank = _subject(r, "target", acc.seats)
    acc.chaos.append(ChaosInjection(ts, _str(r.get("action")) or "?", member, rank))


def _on_fenced(acc: _Accumulator, ts: float | None, r: Record) -> None:
    acc.fenced += 1


def _on_rejected(acc: _Accumulator, ts: float | None, r: Record) -> None:
    acc.rejected += 1


def _on_finished(acc: _Accumulator, ts: float | None, r: Record) -> None:
    # Every rank may write one; the lowest rank's latest record speaks for the job.
    # Records come in time order, so a later one of the same rank replaces an earlier one.
    rank = _int(r.get("rank"))
    candidate = (rank if rank is not None and rank >= 0 else _NO_RANK, r)
    if acc.final is None or candidate[0] <= acc.final[0]:
        acc.final = candidate


def _on_job_failed(acc: _Accumulator, ts: float | None, r: Record) -> None:
    if acc.job_failed is None:
        acc.job_failed = _str(r.get("reason")) or "(no reason given)"


def _ignore(acc: _Accumulator, ts: float | None, r: Record) -> None:
    """Known events that carry nothing the summary keeps."""


_SUMMARY_HANDLERS: dict[str, Callable[[_Accumulator, float | None, Record], None]] = {
    "coordinator_started": _ignore,
    "member_joined": _on_joined,
    "member_failed": _on_failed,
    "view_committed": _on_view,
    "restored": _on_restored,
    "swap_completed": _on_swap,
    "fenced": _on_fenced,
    "rejected": _on_rejected,
    "training_finished": _on_finished,
    "job_failed": _on_job_failed,
    "chaos_injected": _on_chaos,
    "spare_lost": _on_spare_lost,
    "step_finished": _on_step,
}


# ---------------------------------------------------------------------------
# The plain-text timeline


def format_timeline(events: Sequence[Record], progress_every: int | None = None) -> str:
    """Render the events as one line each, times relative to the first event.

    ``step_finished`` records come from every rank at every step; printing them
    would bury the few lines that matter, so one compact progress line (the
    lowest rank's) is shown every ``progress_every`` steps -- by default a round
    number giving at most about 20 such lines -- plus the last step before a
    failure and the first step after a view change, which say where the job
    stopped and where it went on.  ``training_finished`` is shown once per
    distinct digest: every rank writes it, and only a disagreement is news.
    The text ends with the summary block.
    """
    ordered = _ordered(events)
    summary = summarize(events)
    seats = _seat_map(ordered)
    t0 = summary.start_ts
    points = {id(p.record): p for p in _loss_points(ordered)}
    if progress_every is None:
        progress_every = _nice_every(summary.last_step + 1 if summary.last_step is not None else 0, 20)
    progress_every = max(1, progress_every)
    digests: dict[str, list[int | None]] = {}
    for _, record in ordered:
        if _str(record.get("event")) == "training_finished":
            digests.setdefault(_str(record.get("state_digest")), []).append(_int(record.get("rank")))

    lines: list[str] = []
    pending: tuple[float | None, Record] | None = None  # latest progress point not yet shown
    show_next = False  # a view changed: show the first step after it
    for ts, record in ordered:
        name = _str(record.get("event")) or "?"
        if name == "step_finished":
            point = points.get(id(record))
            if point is not None and (show_next or point.step % progress_every == 0):
                lines.append(_line(ts, t0, "progress", _describe_progress(record)))
                pending, show_next = None, False
            elif point is not None:
                pending = (ts, record)
            continue
        if name in _SHOW_STEP_BEFORE and pending is not None:
            lines.append(_line(pending[0], t0, "progress", _describe_progress(pending[1])))
            pending = None
        if name == "view_committed":
            show_next = True
        text = _DESCRIBERS.get(name, _describe_generic)(record, seats)
        if name == "training_finished":
            ranks = digests.pop(_str(record.get("state_digest")), None)
            if ranks is None:
                continue  # another rank already reported this digest
            if len(ranks) > 1:
                text += f" (same from {len(ranks)} ranks)"
        lines.append(_line(ts, t0, name, text))
    if pending is not None:  # the job stopped (or the file ends) between round steps
        lines.append(_line(pending[0], t0, "progress", _describe_progress(pending[1])))
    if not lines:
        lines.append("(no events)")
    return "\n".join([*lines, "", format_summary(summary)]) + "\n"


# Before these events the timeline shows the last finished step, so a reader sees where it broke.
_SHOW_STEP_BEFORE = frozenset({"chaos_injected", "member_failed", "job_failed", "training_finished"})


def format_summary(summary: Summary) -> str:
    """The closing block of the timeline: the numbers a person checks first."""
    t0 = summary.start_ts
    out = ["summary"]

    def row(label: str, text: str) -> None:
        out.append(f"  {label:<17}{text}")

    duration = summary.duration_s
    row("events", f"{summary.events}" + (f" over {duration:.3f} s" if duration is not None else ""))
    steps = f"{summary.steps_finished}"
    if summary.last_step is not None:
        steps += f" (last step {summary.last_step})"
    if summary.replayed_steps:
        steps += f", {summary.replayed_steps} replayed after rollback"
    row("steps finished", steps)
    row("failures", f"{len(summary.failures)}")
    for f in summary.failures:
        why = f" ({f.reason})" if f.reason else ""
        row("", f"{_rel(f.ts, t0):>9}  {_who(f.rank, f.member)} detected_by={f.detected_by}{why}")
    views = ", ".join(f"epoch {_opt(v.epoch)} resume_step {_opt(v.resume_step)}" for v in summary.views)
    row("views committed", f"{len(summary.views)}" + (f" ({views})" if views else ""))
    row("swaps", f"{len(summary.swaps)}")
    for s in summary.swaps:
        row(
            "",
            f"{_rel(s.ts, t0):>9}  rank {_opt(s.rank)}: {s.old_member or '?'} -> {s.new_member or '?'}"
            f"  recovery {_secs(s.recovery_s)}",
        )
    if summary.restores:
        by_source: dict[str, int] = {}
        for r in summary.restores:
            by_source[r.source] = by_source.get(r.source, 0) + 1
        total = sum(r.bytes or 0 for r in summary.restores)
        sources = ", ".join(f"{k} {v}" for k, v in sorted(by_source.items()))
        row("restores", f"{len(summary.restores)} ({sources}; {_bytes(total)} in all)")
    if summary.spare_changes:
        row("spare pool", " -> ".join(str(c.spares) for c in summary.spare_changes))
    if summary.chaos:
        row("chaos injected", ", ".join(f"{c.action} {_who(c.rank, c.member)}" for c in summary.chaos))
    if summary.fenced or summary.rejected:
        row("fenced/rejected", f"{summary.fenced}/{summary.rejected}")
    if summary.unknown_events:
        row("unknown events", ", ".join(summary.unknown_events))
    if summary.job_failed is not None:
        row("outcome", f"FAILED: {summary.job_failed}")
    else:
        row("outcome", summary.outcome + (f" at step {summary.final_step}" if summary.final_step is not None else ""))
    row("final digest", summary.final_digest or "(none)")
    return "\n".join(out)


def _line(ts: float | None, t0: float | None, label: str, text: str) -> str:
    return f"{_rel(ts, t0):>11}  {label:<19} {text}".rstrip()


def _describe_progress(r: Record) -> str:
    parts = [f"step {_opt(_int(r.get('step')))}"]
    loss, tps, step_s = _float(r.get("loss")), _float(r.get("tokens_per_s")), _float(r.get("step_s"))
    if loss is not None:
        parts.append(f"loss={loss:.4f}")
    if tps is not None:
        parts.append(f"tokens/s={tps:,.0f}")
    if step_s is not None:
        parts.append(f"step_s={step_s:.3f}")
    parts.append(f"(rank {_opt(_int(r.get('rank')))}, epoch {_opt(_int(r.get('epoch')))})")
    return "  ".join(parts)


def _describe_coordinator(r: Record, seats: dict[str, int]) -> str:
    return f"address={_str(r.get('address')) or '?'}"


def _describe_joined(r: Record, seats: dict[str, int]) -> str:
    role = _str(r.get("role"))
    return _who(_int(r.get("rank")), _str(r.get("member"))) + (f" role={role}" if role else "")


def _describe_failed(r: Record, seats: dict[str, int]) -> str:
    member, rank = _subject(r, "failed", seats)
    text = f"{_who(rank, member)} detected_by={_str(r.get('detected_by')) or '?'}"
    reporter = _str(r.get("member"))
    if reporter and reporter != member:
        text += f" reported_by={reporter}"
    reason = _str(r.get("reason"))
    return text + (f" reason={reason!r}" if reason else "")


def _describe_view(r: Record, seats: dict[str, int]) -> str:
    text = f"epoch {_opt(_int(r.get('epoch')))} resume_step={_opt(_int(r.get('resume_step')))}"
    members, spares = r.get("seats"), r.get("spares")
    if isinstance(members, list):
        text += f" world={len(members)}"
    if isinstance(spares, list):
        text += f" spares={len(spares)}"
    return text


def _describe_restored(r: Record, seats: dict[str, int]) -> str:
    size, secs = _int(r.get("bytes")), _float(r.get("s"))
    text = f"{_who(_int(r.get('rank')), _str(r.get('member')))} from {_str(r.get('source')) or '?'}"
    step = _int(r.get("step"))
    if step is not None and step >= 0:
        text += f" step {step}"
    if size is not None:
        text += f" {_bytes(size)}"
    if secs is not None:
        text += f" in {_secs(secs)}"
    return text


def _describe_swap(r: Record, seats: dict[str, int]) -> str:
    old, new = _str(r.get("old_member")) or "?", _str(r.get("new_member")) or "?"
    return f"rank {_opt(_int(r.get('rank')))}: {old} -> {new} recovery {_secs(_float(r.get('recovery_s')))}"


def _describe_reason(r: Record, seats: dict[str, int]) -> str:
    reason = _str(r.get("reason"))
    return _who(_int(r.get("rank")), _str(r.get("member"))) + (f" reason={reason!r}" if reason else "")


def _describe_finished(r: Record, seats: dict[str, int]) -> str:
    digest = _str(r.get("state_digest"))
    text = f"{_who(_int(r.get('rank')), _str(r.get('member')))} step {_opt(_int(r.get('step')))}"
    return text + (f" digest={digest}" if digest else "")


def _describe_chaos(r: Record, seats: dict[str, int]) -> str:
    member, rank = _subject(r, "target", seats)
    return f"action={_str(r.get('action')) or '?'} {_who(rank, member)}" + _extras(
        r, {"action", "target_member", "target_rank"}
    )


def _describe_spare_lost(r: Record, seats: dict[str, int]) -> str:
    member, rank = _subject(r, "lost", seats)
    return _who(rank, member) + _extras(r, {"lost_member", "lost_rank"})


def _describe_generic(r: Record, seats: dict[str, int]) -> str:
    return _who(_int(r.get("rank")), _str(r.get("member"))) + _extras(r, set())


_DESCRIBERS: dict[str, Callable[[Record, dict[str, int]], str]] = {
    "coordinator_started": _describe_coordinator,
    "member_joined": _describe_joined,
    "member_failed": _describe_failed,
    "view_committed": _describe_view,
    "restored": _describe_restored,
    "swap_completed": _describe_swap,
    "fenced": _describe_reason,
    "rejected": _describe_reason,
    "training_finished": _describe_finished,
    "job_failed": _describe_reason,
    "chaos_injected": _describe_chaos,
    "spare_lost": _describe_spare_lost,
}


# ---------------------------------------------------------------------------
# The plot


@dataclass(frozen=True, slots=True)
class _LossPoint:
    ts: float
    epoch: int | None
    step: int
    rank: int
    loss: float | None
    record: Record


def plot(events: Sequence[Record], out_path: str | os.PathLike[str]) -> None:
    """Draw the loss over wall time with failures, views and swaps marked; save it.

    Wall time rather than step on the x axis, because the point is to see the
    cost of a failure: the pause while the view changes and the steps replayed
    after the rollback.  The loss of each step is the lowest rank's (ranks see
    different batches).  The format follows the file name's suffix (PNG when it
    has none).  Uses the Agg renderer directly, so no display and no pyplot
    global state are involved.

    Raises:
        MisuseError: matplotlib is not installed (it is the optional ``plot`` extra).
        OSError: ``out_path`` cannot be written.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.transforms import Bbox, blended_transform_factory
    except ImportError as error:
        raise MisuseError(
            "plotting events needs matplotlib, which is not installed; nothing was written. "
            "Install it with: pip install 'deadpool[plot]'"
        ) from error

    ordered = _ordered(events)
    summary = summarize(events)
    t0 = summary.start_ts or 0.0
    points = _loss_points(ordered)

    fig = Figure(figsize=(11, 5.5), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("loss (lowest rank reporting each step)")
    ax.grid(True, alpha=0.25)

    # The loss curve, broken where the view changed so the pause shows as a gap.
    legend: list[tuple[Any, str]] = []
    segments: dict[int | None, list[tuple[float, float]]] = {}
    for p in points:
        if p.loss is not None:
            segments.setdefault(p.epoch, []).append((p.ts - t0, p.loss))
    losses = [loss for segment in segments.values() for _, loss in segment]
    for segment in segments.values():
        ax.plot(
            [x for x, _ in segment],
            [y for _, y in segment],
            color="tab:blue",
            linewidth=1.4,
            marker="." if len(points) <= 300 else None,
            markersize=3,
        )
    if losses:
        legend.append((Line2D([], [], color="tab:blue", linewidth=1.4), "loss"))
    else:
        message = "no step_finished events with a loss" if summary.events else "no events"
        ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", color="0.4")

    # Axis ranges first: the annotations below are placed in axes coordinates.
    last = max((ts - t0 for ts, _ in ordered if ts is not None), default=0.0)
    ax.set_xlim(-0.02 * max(last, 1.0), max(last, 1.0) * 1.04)
    if losses:
        low, high = min(losses), max(losses)
        span = (high - low) or max(abs(high), 1.0) * 0.1
        labelled = summary.chaos or summary.failures or summary.swaps or summary.job_failed is not None
        ax.set_ylim(low - 0.05 * span, high + (0.45 if labelled else 0.08) * span)  # room for the labels

    # Step numbers on the top axis, at the first time each round step finished.
    every = _nice_every(summary.last_step + 1 if summary.last_step is not None else 0, 10)
    ticks: dict[int, float] = {}
    for p in points:
        if p.step % every == 0 and p.step not in ticks:
            ticks[p.step] = p.ts - t0
    if ticks:
        top = ax.secondary_xaxis("top")
        top.set_xticks(list(ticks.values()), labels=[str(s) for s in ticks])
        top.set_xlabel("step", fontsize=9)
        top.tick_params(labelsize=8)

    # Event markers: (time, kind, label for the annotation or "").
    marks: list[tuple[float, str, str]] = []
    for c in summary.chaos:
        marks.append((_x(c.ts, t0), "chaos", f"chaos: {c.action} {_short_who(c.rank, c.member)}"))
    for f in summary.failures:
        marks.append((_x(f.ts, t0), "failure", f"{_short_who(f.rank, f.member)} failed ({f.detected_by})"))
    for v in summary.views:
        marks.append((_x(v.ts, t0), "view", ""))
    for s in summary.swaps:
        back = f"rank {_opt(s.rank)} back" + (f" in {s.recovery_s:.2f} s" if s.recovery_s is not None else "")
        marks.append((_x(s.ts, t0), "swap", back))
    failed_at = [_x(ts, t0) for ts, r in ordered if _str(r.get("event")) == "job_failed"]
    if summary.job_failed is not None and failed_at:
        marks.append((failed_at[0], "job_failed", f"job failed: {_clip(summary.job_failed, 50)}"))

    for x, kind, _ in marks:
        color, style, _ = _MARK_STYLES[kind]
        ax.axvline(x, color=color, linestyle=style, linewidth=1.2, alpha=0.9)
    for v in summary.views:
        ax.text(
            _x(v.ts, t0),
            0.02,
            f" epoch {_opt(v.epoch)}",
            transform=blended_transform_factory(ax.transData, ax.transAxes),
            rotation=90,
            ha="left",
            va="bottom",
            fontsize=7,
            color="0.4",
        )
    # Shade each seat's time without a member: from its failure to the swap that refilled it.
    failed_at_member = {f.member: f.ts for f in summary.failures if f.member}
    for s in summary.swaps:
        down_from = failed_at_member.get(s.old_member)
        if down_from is not None and s.ts is not None and s.ts > down_from:
            ax.axvspan(down_from - t0, s.ts - t0, color="tab:red", alpha=0.07, linewidth=0)
    kinds = {kind for _, kind, _ in marks}
    for kind, (color, style, name) in _MARK_STYLES.items():
        if kind in kinds:
            legend.append((Line2D([], [], color=color, linestyle=style), name))

    # Labels stack downwards from the top so that close events do not overprint.
    fig.draw_without_rendering()  # runs the layout, so the axes have their final place
    transform = blended_transform_factory(ax.transData, ax.transAxes)
    axes_box = ax.get_window_extent()
    placed: list[Bbox] = []
    for x, kind, label in sorted(marks, key=lambda m: m[0]):
        if not label:
            continue
        color = _MARK_STYLES[kind][0]
        for level in range(12):
            y = 0.97 - 0.07 * level
            text = ax.text(
                x,
                y,
                " " + label,
                transform=transform,
                ha="left",
                va="top",
                fontsize=8,
                color=color,
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": color, "alpha": 0.85},
            )
            text.set_in_layout(False)  # labels live inside the axes; they must not move them
            box = text.get_window_extent()
            if box.x1 > axes_box.x1:  # near the right edge: put the label left of its line
                text.set_horizontalalignment("right")
                box = text.get_window_extent()
            if not any(box.overlaps(other) for other in placed) or level == 11:
                placed.append(box)
                break
            text.remove()

    if legend:
        fig.legend(
            [handle for handle, _ in legend],
            [name for _, name in legend],
            loc="outside lower center",
            ncol=len(legend),
            fontsize=8,
            frameon=False,
        )

    fig.suptitle(_title(summary), fontsize=11)
    fig.savefig(out_path)


LineStyle = Literal["-", "--", "-.", ":"]

# Marker kind -> (colour, line style, legend entry); legend order follows this table.
_MARK_STYLES: dict[str, tuple[str, LineStyle, str]] = {
    "chaos": ("tab:orange", ":", "chaos injected"),
    "failure": ("tab:red", "-", "member failed"),
    "view": ("0.45", "--", "view committed"),
    "swap": ("tab:green", "-", "swap completed"),
    "job_failed": ("darkred", "-.", "job failed"),
}


def _title(summary: Summary) -> str:
    failures, swaps = len(summary.failures), len(summary.swaps)
    counts = (
        f"{summary.steps_finished} steps, {failures} failure{'s' if failures != 1 else ''}, "
        f"{swaps} swap{'s' if swaps != 1 else ''}"
    )
    if summary.job_failed is not None:
        return f"DeadPool job FAILED ({counts}): {_clip(summary.job_failed, 60)}"
    digest = f"final digest {summary.final_digest[:16]}…" if summary.final_digest else "no final digest"
    return f"DeadPool run: {counts} — {digest}"


def _loss_points(ordered: Sequence[tuple[float | None, Record]]) -> list[_LossPoint]:
    """One point per (epoch, step): the record of the lowest rank that reported it.

    Keyed by epoch as well as step, so steps replayed after a rollback appear a
    second time, later, where they really happened.  Points come out in time order.
    """
    best: dict[tuple[int | None, int], _LossPoint] = {}
    for ts, r in ordered:
        if _str(r.get("event")) != "step_finished" or ts is None:
            continue
        step = _int(r.get("step"))
        if step is None or step < 0:
            continue
        rank = _int(r.get("rank"))
        point = _LossPoint(
            ts,
            _int(r.get("epoch")),
            step,
            rank if rank is not None and rank >= 0 else _NO_RANK,
            _float(r.get("loss")),
            r,
        )
        key = (point.epoch, step)
        if key not in best or point.rank < best[key].rank:
            best[key] = point
    return sorted(best.values(), key=lambda p: p.ts)


# ---------------------------------------------------------------------------
# Defensive field access and small formatters


def _ordered(events: Iterable[Record]) -> list[tuple[float | None, Record]]:
    """Records with their timestamp, sorted by time (stably, so ties keep file order).

    Lines from several hosts may be slightly out of order in the file.  A record
    without a usable ``ts`` keeps its place after the record before it.
    """
    out: list[tuple[float, int, float | None, Record]] = []
    last = -math.inf
    for index, record in enumerate(events):
        if not isinstance(record, dict):
            continue
        ts = _float(record.get("ts"))
        if ts is not None:
            last = ts
        out.append((ts if ts is not None else last, index, ts, record))
    out.sort(key=lambda item: (item[0], item[1]))
    return [(ts, record) for _, _, ts, record in out]


def _subject(r: Record, prefix: str, seats: dict[str, int]) -> tuple[str, int | None]:
    """The member an event is about, and its seat.

    A writer may name the member it reports on in ``{prefix}_member`` (the
    coordinator reporting a death); otherwise the event is about the writer
    itself.  When the record gives no seat for that member, the seat it was
    seen in elsewhere in the file is used.
    """
    named = _str(r.get(f"{prefix}_member"))
    member = named or _str(r.get("member"))
    rank = _int(r.get(f"{prefix}_rank"))
    if rank is None and (not named or named == _str(r.get("member"))):
        rank = _int(r.get("rank"))
    if rank is None or rank < 0:
        rank = seats.get(member)
    return member, rank


def _seat_map(ordered: Iterable[tuple[float | None, Record]]) -> dict[str, int]:
    """Member id -> the seat it sat in, from committed views and the workers' own step lines.

    Member ids are never reused and a member keeps its seat once adopted, so
    one map serves the whole file.
    """
    seats: dict[str, int] = {}
    for _, r in ordered:
        name = _str(r.get("event"))
        if name == "view_committed" and isinstance(r.get("seats"), list):
            for seat, member in enumerate(r["seats"]):
                seats.setdefault(_str(member), seat)
        elif name == "step_finished":
            rank = _int(r.get("rank"))
            if rank is not None and rank >= 0 and _str(r.get("member")):
                seats.setdefault(_str(r.get("member")), rank)
    return seats


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        result = float(value)
    except ValueError:
        return None
    return result if math.isfinite(result) else None


def _str_list(value: Any) -> list[str]:
    return [_str(v) for v in value] if isinstance(value, list) else []


def _ts_key(item: Failure) -> float:
    return item.ts if item.ts is not None else math.inf


def _x(ts: float | None, t0: float) -> float:
    return ts - t0 if ts is not None else 0.0


def _rel(ts: float | None, t0: float | None) -> str:
    if ts is None or t0 is None:
        return "?"
    return f"+{ts - t0:.3f}s"


def _who(rank: int | None, member: str) -> str:
    if rank is not None and rank >= 0:
        return f"rank {rank}" + (f" ({member})" if member else "")
    return member or "-"


def _short_who(rank: int | None, member: str) -> str:
    return f"rank {rank}" if rank is not None and rank >= 0 else (_clip(member, 24) or "?")


def _opt(value: int | None) -> str:
    return "?" if value is None else str(value)


def _secs(value: float | None) -> str:
    return "?" if value is None else f"{value:.3f} s"


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(size) < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"  # pragma: no cover - the loop always returns


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _extras(r: Record, known: set[str]) -> str:
    """``k=v`` for the fields that are neither identity nor already shown."""
    parts = [f"{k}={_clip(_str(v), 60)}" for k, v in r.items() if k not in _IDENTITY and k not in known]
    return (" " + " ".join(parts)) if parts else ""


def _nice_every(count: int, target: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that splits ``count`` into at most ``target`` parts."""
    every, scale = 1, 1
    while count / every > target:
        for m in (2, 5, 10):
            every = m * scale
            if count / every <= target:
                return every
        scale *= 10
    return every
