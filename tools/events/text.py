"""``deadpool events FILE``: a job's events file as a plain-text timeline ending with its summary.

It answers the questions a person asks after a failure -- who died, how it was noticed,
which spare took the seat, how long the job was down, where it resumed, and whether the
final state digest matches a failure-free run.  It reads the file through the event schema
(``events.schema``, condensed by ``events.summary``), so a line that does not match its kind's
schema is an error that names it; a file cut off by a crash reads, and events of kinds this
version does not know are shown generically.
"""

from __future__ import annotations

from collections.abc import Sequence

from deadpool.events.catalogue import Event
from deadpool.events.summary import (
    ChaosInjection,
    ChaosNotFired,
    ChaosPointUnseen,
    CoordinatorStarted,
    Fact,
    Failure,
    Fenced,
    JobFailed,
    JobFinished,
    MemberJoined,
    Record,
    Rejection,
    Restore,
    SpareLost,
    StepDone,
    Summary,
    SummaryBuilder,
    Swap,
    ViewCommit,
    ordered,
    seat_map,
)

# Fields every line carries; the generic formatter leaves them out of ``k=v`` lists.
_IDENTITY = frozenset({"ts", "event", "epoch", "member", "rank", "step", "source_process"})

# Before these events the timeline shows the last finished step, so a reader sees where it broke.
_SHOW_STEP_BEFORE = frozenset({Event.CHAOS_INJECTED, Event.MEMBER_FAILED, Event.JOB_FAILED, Event.TRAINING_FINISHED,
                               Event.CHAOS_NOT_FIRED})


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
    records = ordered(events)
    builder = SummaryBuilder(seat_map(records))
    facts = [(ts, record, builder.feed(record)) for ts, record in records]
    summary = builder.summary()
    t0 = summary.start_ts
    shown = {id(point) for point in summary.steps}  # the lowest rank's record of each (epoch, step)
    if progress_every is None:
        progress_every = nice_every(summary.last_step + 1 if summary.last_step is not None else 0, 20)
    progress_every = max(1, progress_every)
    digests: dict[str, list[int | None]] = {}
    for _, _, fact in facts:
        if isinstance(fact, JobFinished):
            digests.setdefault(fact.digest, []).append(fact.rank)

    lines: list[str] = []
    pending: tuple[float | None, StepDone] | None = None  # latest progress point not yet shown
    show_next = False  # a view changed: show the first step after it
    for ts, record, fact in facts:
        if isinstance(fact, StepDone):
            if id(fact) in shown and fact.step is not None and (show_next or fact.step % progress_every == 0):
                lines.append(_line(ts, t0, "progress", _describe_progress(fact)))
                pending, show_next = None, False
            elif id(fact) in shown:
                pending = (ts, fact)
            continue
        if record.event in _SHOW_STEP_BEFORE and pending is not None:
            lines.append(_line(pending[0], t0, "progress", _describe_progress(pending[1])))
            pending = None
        if isinstance(fact, ViewCommit):
            show_next = True
        text = _describe(fact, record)
        if isinstance(fact, JobFinished):
            ranks = digests.pop(fact.digest, None)
            if ranks is None:
                continue  # another rank already reported this digest
            if len(ranks) > 1:
                text += f" (same from {len(ranks)} ranks)"
        lines.append(_line(ts, t0, record.event, text))
    if pending is not None:  # the job stopped (or the file ends) between round steps
        lines.append(_line(pending[0], t0, "progress", _describe_progress(pending[1])))
    if not lines:
        lines.append("(no events)")
    return "\n".join([*lines, "", format_summary(summary)]) + "\n"


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
        row("", f"{rel(f.ts, t0):>9}  {who(f.rank, f.member)} detected_by={f.detected_by}{why}")
    views = ", ".join(f"epoch {opt(v.epoch)} resume_step {opt(v.resume_step)}" for v in summary.views)
    row("views committed", f"{len(summary.views)}" + (f" ({views})" if views else ""))
    row("swaps", f"{len(summary.swaps)}")
    for s in summary.swaps:
        row(
            "",
            f"{rel(s.ts, t0):>9}  rank {opt(s.rank)}: {s.old_member or '?'} -> {s.new_member or '?'}"
            f"  recovery {secs(s.recovery_s)}",
        )
    if summary.restores:
        by_source: dict[str, int] = {}
        for r in summary.restores:
            by_source[r.source] = by_source.get(r.source, 0) + 1
        total = sum(r.bytes or 0 for r in summary.restores)
        sources = ", ".join(f"{k} {v}" for k, v in sorted(by_source.items()))
        row("restores", f"{len(summary.restores)} ({sources}; {size(total)} in all)")
    if summary.spare_changes:
        row("spare pool", " -> ".join(str(c.spares) for c in summary.spare_changes))
    if summary.chaos:
        row("chaos injected", ", ".join(f"{c.action} {who(c.rank, c.member)}" for c in summary.chaos))
    for unseen in summary.chaos_unseen:
        row("chaos unseen", f"{unseen.spec}: {who(unseen.rank, unseen.member)}'s first step (step "
            f"{opt(unseen.step)}) passed no {unseen.at} point (it passed {', '.join(unseen.seen) or 'none'})")
    for finding in summary.chaos_not_fired:
        row("chaos not fired", f"{finding.spec}: {finding.why or '(no reason given)'}")
    if summary.fenced or summary.rejected:
        row("fenced/rejected", f"{summary.fenced}/{summary.rejected}")
    catalogued = {str(kind) for kind in Event}
    others = [name for name in summary.unknown_events if name in catalogued]  # not summarized: see the timeline
    if others:
        row("other events", ", ".join(others))
    if len(others) < len(summary.unknown_events):
        row("unknown events", ", ".join(name for name in summary.unknown_events if name not in catalogued))
    if summary.job_failed is not None:
        row("outcome", f"FAILED: {summary.job_failed}")
    else:
        row("outcome", summary.outcome + (f" at step {summary.final_step}" if summary.final_step is not None else ""))
    row("final digest", summary.final_digest or "(none)")
    if summary.untracked_rollback is not None:
        row("not guaranteed", _untracked(summary.untracked_rollback.loader, summary.untracked_rollback.where,
                                         summary.untracked_rollback.view))
    return "\n".join(out)


def _untracked(loader: str, where: str, view: int | None) -> str:
    at = f" ({where})" if where else ""
    return (f"the final state may differ from a failure-free run's: an untracked {loader}{at} was not rolled back "
            f"at the swap of view {opt(view)}")


def _line(ts: float | None, t0: float | None, label: str, text: str) -> str:
    return f"{rel(ts, t0):>11}  {label:<19} {text}".rstrip()


def _describe_progress(p: StepDone) -> str:
    parts = [f"step {opt(p.step)}"]
    if p.loss is not None:
        parts.append(f"loss={p.loss:.4f}")
    if p.tokens_per_s is not None:
        parts.append(f"tokens/s={p.tokens_per_s:,.0f}")
    if p.step_s is not None:
        parts.append(f"step_s={p.step_s:.3f}")
    parts.append(f"(rank {opt(p.rank)}, epoch {opt(p.epoch)})")
    return "  ".join(parts)


def _describe(fact: Fact | None, r: Record) -> str:
    """The text of one timeline line after its label."""
    match fact:
        case CoordinatorStarted():
            return f"address={fact.address or '?'}"
        case MemberJoined():
            return who(fact.rank, fact.member) + (f" role={fact.role}" if fact.role else "")
        case Failure():
            text = f"{who(fact.rank, fact.member)} detected_by={fact.detected_by}"
            return text + (f" reason={fact.reason!r}" if fact.reason else "")
        case ViewCommit():
            text = f"epoch {opt(fact.epoch)} resume_step={opt(fact.resume_step)}"
            if fact.seats is not None:
                text += f" world={len(fact.seats)}"
            if fact.spares is not None:
                text += f" spares={len(fact.spares)}"
            return text
        case Restore():
            text = f"{who(fact.rank, fact.member)} from {fact.source}"
            if fact.step is not None and fact.step >= 0:
                text += f" step {fact.step}"
            if fact.bytes is not None:
                text += f" {size(fact.bytes)}"
            if fact.s is not None:
                text += f" in {secs(fact.s)}"
            return text
        case Swap():
            return (f"rank {opt(fact.rank)}: {fact.old_member or '?'} -> {fact.new_member or '?'} "
                    f"recovery {secs(fact.recovery_s)}")
        case Fenced() | Rejection() | JobFailed():
            return who(fact.rank, fact.member) + (f" reason={fact.reason!r}" if fact.reason else "")
        case JobFinished():
            text = f"{who(fact.rank, fact.member)} step {opt(fact.step)}"
            text += f" digest={fact.digest}" if fact.digest else ""
            if fact.untracked is not None:
                text += "; " + _untracked(fact.untracked.loader, fact.untracked.where, fact.untracked.view)
            return text
        case ChaosPointUnseen():
            return (f"{who(fact.rank, fact.member)} spec={fact.spec} at={fact.at} "
                    f"seen={','.join(fact.seen) or '-'}")
        case ChaosNotFired():
            return f"spec={fact.spec} {who(fact.rank, fact.member)}: {fact.why}"
        case ChaosInjection():
            return f"action={fact.action} {who(fact.rank, fact.member)}" + _extras(
                r, {"action", "target_member", "target_rank"}
            )
        case SpareLost():
            return who(fact.rank, fact.member) + _extras(r, set())
        case _:
            return who(r.rank, r.member or "") + _extras(r, set())


def _extras(r: Record, known: set[str]) -> str:
    """``k=v`` for the fields that are neither identity nor already shown."""
    parts = [f"{k}={clip(_text(v), 60)}" for k, v in r.fields().items()
             if k not in _IDENTITY and k not in known and v is not None]
    return (" " + " ".join(parts)) if parts else ""


# ---------------------------------------------------------------------------
# Small formatters (shared with the plot)


def _text(value: object) -> str:
    return value if isinstance(value, str) else str(value)


def rel(ts: float | None, t0: float | None) -> str:
    """A time relative to the first record, ``+1.234s``."""
    if ts is None or t0 is None:
        return "?"
    return f"+{ts - t0:.3f}s"


def who(rank: int | None, member: str) -> str:
    """``rank 2 (member)``, or the member alone when it has no seat."""
    if rank is not None and rank >= 0:
        return f"rank {rank}" + (f" ({member})" if member else "")
    return member or "-"


def short_who(rank: int | None, member: str) -> str:
    """``rank 2``, or the member (clipped) when it has no seat."""
    return f"rank {rank}" if rank is not None and rank >= 0 else (clip(member, 24) or "?")


def opt(value: int | None) -> str:
    """A number, or ``?`` when unknown."""
    return "?" if value is None else str(value)


def secs(value: float | None) -> str:
    """Seconds with three decimals, or ``?``."""
    return "?" if value is None else f"{value:.3f} s"


def size(n: int) -> str:
    """Bytes in decimal units: ``12.0 MB``."""
    amount = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(amount) < 1000 or unit == "GB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1000
    return f"{amount:.1f} GB"  # pragma: no cover - the loop always returns


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, with an ellipsis when cut."""
    return text if len(text) <= width else text[: width - 1] + "…"


def nice_every(count: int, target: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that splits ``count`` into at most ``target`` parts."""
    every, scale = 1, 1
    while count / every > target:
        for m in (2, 5, 10):
            every = m * scale
            if count / every <= target:
                return every
        scale *= 10
    return every
