"""``deadpool events FILE --plot OUT.png``: the loss over wall time with failures, views and swaps marked.

Reads the file through ``deadpool.events.summary`` like the text timeline; matplotlib (the
optional ``plot`` extra) is imported only when a plot is drawn, so the ``deadpool`` command
starts without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

from deadpool.errors import MisuseError
from deadpool.events.summary import Record, Summary, summarize

from .text import clip, nice_every, opt, short_who

LineStyle = Literal["-", "--", "-.", ":"]

# Marker kind -> (colour, line style, legend entry); legend order follows this table.
_MARK_STYLES: dict[str, tuple[str, LineStyle, str]] = {
    "chaos": ("tab:orange", ":", "chaos injected"),
    "failure": ("tab:red", "-", "member failed"),
    "view": ("0.45", "--", "view committed"),
    "swap": ("tab:green", "-", "swap completed"),
    "job_failed": ("darkred", "-.", "job failed"),
}


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

    summary = summarize(events)
    t0 = summary.start_ts or 0.0
    points = summary.steps

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
            segments.setdefault(p.epoch, []).append((_x(p.ts, t0), p.loss))
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
    last = summary.end_ts - t0 if summary.end_ts is not None else 0.0
    ax.set_xlim(-0.02 * max(last, 1.0), max(last, 1.0) * 1.04)
    if losses:
        low, high = min(losses), max(losses)
        span = (high - low) or max(abs(high), 1.0) * 0.1
        labelled = summary.chaos or summary.failures or summary.swaps or summary.job_failed is not None
        ax.set_ylim(low - 0.05 * span, high + (0.45 if labelled else 0.08) * span)  # room for the labels

    # Step numbers on the top axis, at the first time each round step finished.
    every = nice_every(summary.last_step + 1 if summary.last_step is not None else 0, 10)
    ticks: dict[int, float] = {}
    for p in points:
        if p.step is not None and p.step % every == 0 and p.step not in ticks:
            ticks[p.step] = _x(p.ts, t0)
    if ticks:
        top = ax.secondary_xaxis("top")
        top.set_xticks(list(ticks.values()), labels=[str(s) for s in ticks])
        top.set_xlabel("step", fontsize=9)
        top.tick_params(labelsize=8)

    # Event markers: (time, kind, label for the annotation or "").
    marks: list[tuple[float, str, str]] = []
    for c in summary.chaos:
        marks.append((_x(c.ts, t0), "chaos", f"chaos: {c.action} {short_who(c.rank, c.member)}"))
    for f in summary.failures:
        marks.append((_x(f.ts, t0), "failure", f"{short_who(f.rank, f.member)} failed ({f.detected_by})"))
    for v in summary.views:
        marks.append((_x(v.ts, t0), "view", ""))
    for s in summary.swaps:
        back = f"rank {opt(s.rank)} back" + (f" in {s.recovery_s:.2f} s" if s.recovery_s is not None else "")
        marks.append((_x(s.ts, t0), "swap", back))
    if summary.job_failed is not None:
        marks.append((_x(summary.job_failed_ts, t0), "job_failed", f"job failed: {clip(summary.job_failed, 50)}"))

    for x, kind, _ in marks:
        color, style, _ = _MARK_STYLES[kind]
        ax.axvline(x, color=color, linestyle=style, linewidth=1.2, alpha=0.9)
    for v in summary.views:
        ax.text(
            _x(v.ts, t0),
            0.02,
            f" epoch {opt(v.epoch)}",
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


def _title(summary: Summary) -> str:
    failures, swaps = len(summary.failures), len(summary.swaps)
    counts = (
        f"{summary.steps_finished} steps, {failures} failure{'s' if failures != 1 else ''}, "
        f"{swaps} swap{'s' if swaps != 1 else ''}"
    )
    if summary.job_failed is not None:
        return f"DeadPool job FAILED ({counts}): {clip(summary.job_failed, 60)}"
    digest = f"final digest {summary.final_digest[:16]}…" if summary.final_digest else "no final digest"
    return f"DeadPool run: {counts} — {digest}"


def _x(ts: float | None, t0: float) -> float:
    return ts - t0 if ts is not None else 0.0
