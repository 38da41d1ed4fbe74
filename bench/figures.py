"""Regenerate the documentation's figures from the benchmarks' results files.

Every benchmark the docs quote writes one results file per run with ``--json PATH`` (``bench/results.py``:
the date, the machine, the git commit, the exact command and the measured rows).  This script reads
``docs/results/*.json`` and writes:

- ``docs/performance.md``: one section per results file, its tables, and the run it came from;
- the headline table of ``README.md``, between ``<!-- figures:begin -->`` and ``<!-- figures:end -->``.

A figure therefore always names its run, and updating a figure is re-running the command its section shows,
then this script.  Nothing here measures anything.

    python bench/figures.py            # rewrite both
    python bench/figures.py --check    # exit 1 if either differs from what the results files give
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
PERFORMANCE = REPO / "docs" / "performance.md"
README = REPO / "README.md"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"


@dataclass(frozen=True)
class Run:
    """One results file."""

    path: Path
    data: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def rows(self) -> list[dict[str, Any]]:
        return list(self.data.get("rows", []))

    def machine(self) -> str:
        m = self.data.get("machine", {})
        memory = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
        torch = f", torch {self.data['torch']}" if self.data.get("torch") else ""
        return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores{memory}{torch}"

    def commit(self) -> str:
        """The commit, short, in backticks, and whether the tree it ran from had uncommitted changes."""
        commit = f"`{str(self.data.get('commit', ''))[:10] or '?'}`"
        return commit + (" with uncommitted changes" if self.data.get("dirty") else "")

    def cite(self, link: str, machine: bool = True) -> str:
        """The run in one line: file (linked), date, commit, and (unless left out) machine."""
        date = self.data.get("date", "?")
        text = f"[`{self.name}`]({link}{self.name}), {date}, commit {self.commit()}"
        return f"{text}, {self.machine()}" if machine else text

    def load(self) -> str:
        load = self.data.get("load_average")
        return f"load average {load:g} at its end" if isinstance(load, (int, float)) else ""

    def provenance(self) -> list[str]:
        """The block under a section's heading: where the figures come from and how to remake them."""
        return [
            f"Run: {self.cite('results/')}" + (f"; {self.load()}." if self.load() else "."),
            "",
            "```bash",
            self.data.get("command", "?"),
            "```",
            "",
        ]


def load(folder: Path = RESULTS) -> list[Run]:
    """Every results file, in name order."""
    return [Run(path, json.loads(path.read_text())) for path in sorted(folder.glob("*.json"))]


def fmt(value: Any, spec: str = ".3f", unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:{spec}}{unit}"
    return str(value)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


# -- one renderer per benchmark: (section lines, headline rows) -----------------------------------------------

Headline = tuple[str, str]  # (what, figure)

# The failure repairs a planned move is compared with, as bench/recovery.py's REPAIRS names them (here in the
# order the pages list them): the move's ratio key, the repair's row, the failure in words.
REPAIRS = (("vs_boundary_kill", "DeadPool hot-swap", "a kill at a step boundary"),
           ("vs_random_kill", "DeadPool hot-swap, kill at an instant spread over a step",
            "a kill at an instant spread over a step"),
           ("vs_allreduce_kill", "DeadPool hot-swap, kill in the all-reduce", "a kill in the all-reduce"),
           ("vs_hang", "DeadPool hot-swap, hang at a step boundary", "a hang at a step boundary"))


def _interval(bounds: list[float] | None) -> str:
    return f"{bounds[0]:.2f} to {bounds[1]:.2f}" if bounds else "none: one repetition"


def recovery(run: Run) -> tuple[list[str], list[Headline]]:
    rows = run.rows
    config = run.data.get("config", {})
    sharded = bool(rows) and all("FSDP2" in r["system"] for r in rows)
    failure = f"SIGKILL of rank {config.get('kill_rank', 2)} in step {config.get('kill_step', 20)}"
    lines = [
        (f"The Llama demo (13.2M parameters) under FSDP2 x tensor parallel on a 2x2 mesh, {config.get('world', 4)} "
         f"ranks and 1 spare, {config.get('steps', 40)} steps, {failure}; medians over the run's repetitions. Its "
         "overhead is left out: plain DDP, the run's reference, trains another model." if sharded else
         f"The same training (the GPT demo, {config.get('world', 4)} ranks, {config.get('steps', 40)} steps) with "
         f"the same failure ({failure}) under each system; medians over the run's repetitions."),
        "",
        "- `recovery_s`: from the kill (for the planned move: from the moment the moving seat left) to the first "
        "step every participating rank finished after it.",
        "- `beyond one step`: `recovery_s` less one failure-free step (a swap recomputes at least the failed step).",
        "- `time lost`: from the last step every rank finished before the kill (or the move) to the first one after, "
        "less one failure-free step: what the job lost against its failure-free pace, including the part of a step "
        "a kill inside it wasted, and a moving seat's wait for its step boundary.",
        "- `overhead`: the failure-free median step over plain torch DDP's in the same run.",
        "- `recomputed`: the steps the job ran again after the failure.",
        "",
    ]
    lines += table(
        ["system", "recovery_s", "beyond one step", "time lost", "vs TorchFT", "failure-free step", "overhead",
         "recomputed", "runs ok"],
        [[r["system"], fmt(r.get("recovery_s")), fmt(r.get("beyond_step_s")), fmt(r.get("lost_s")),
          fmt(r.get("vs_torchft"), ".2f", "x"),
          fmt(r.get("failure_free_step_s")), fmt(r.get("overhead_ratio")), fmt(r.get("steps_recomputed"), "g"),
          str(r.get("runs_ok", "-"))] for r in rows])
    phased = [r for r in rows if "detect_s" in r]
    if phased:
        lines += ["Where DeadPool's recovery went (medians; seconds):", ""]
        lines += table(["system", "detect", "pause", "commit", "restore", "first step"],
                       [[r["system"], *(fmt(r.get(p)) for p in ("detect_s", "pause_s", "commit_s", "restore_s",
                                                                 "first_step_s"))] for r in phased])
    move = next((r for r in rows if r["system"].startswith("DeadPool planned move") and r.get("recovery_s")),
                None)
    ratios = [f"{move[key]:.2f}x {what}'s (95% interval {_interval(move.get(key + '_ci95'))}, "
              f"{move[key + '_pairs']} repetitions" + (f"; mean over mean {move[key + '_means']:.2f}x, "
                                                        f"{_interval(move.get(key + '_means_ci95'))}"
                                                        if key + "_means" in move else "") + ")"
              for key, _, what in REPAIRS if move is not None and key in move]
    if ratios:
        lines += ["", "The planned move's time lost over a failure's, repetition by repetition (each pair ran in the "
                  "same round; geometric means), and the move's mean over the failure's: " + "; ".join(ratios) + ".",
                  ""]
    for note in run.data.get("notes", []):
        lines.append(f"- {note}")
    plot = run.path.with_suffix(".png")
    if plot.exists():  # written by the same run's --plot
        lines += ["", f"![every system's steps against time in this run, the kill dotted](results/{plot.name})",
                  "", f"The plot is `{plot.name}`, drawn by the same run (`--plot`)."]
    heads: list[Headline] = []
    torchft = next((r for r in rows if r["system"] == "TorchFT" and r.get("recovery_s")), None)
    if move is not None:
        found = ((next((r for r in rows if r["system"] == row and r.get("lost_s")), None), what)
                 for _, row, what in REPAIRS)
        repairs = [f"{r['lost_s']:.2f} s for {what}" for r, what in found if r is not None]
        listed = ", ".join(repairs[:-1]) + (" and " if len(repairs) > 1 else "") + (repairs[-1] if repairs else "")
        against = f"; {listed} in the same run" if repairs else ""
        # The spread kill's repetitions differ by design (one instant each): its mean is what a failure costs.
        paired = [f"{move[key]:.2f}x {which}, 95% interval {_interval(move.get(key + '_ci95'))}"
                  for key, which in (("vs_boundary_kill", "the boundary kill's, per repetition"),
                                     ("vs_random_kill_means", "the spread kill's mean"),
                                     ("vs_hang", "the hang's, per repetition")) if key in move]
        if paired:
            against += f" (the move: {'; '.join(paired)})"
        heads.append(("planned move, `deadpool move` (GPT demo, 4 ranks + 1 spare)",
                      f"**{fmt(move.get('lost_s'), '.2f')} s** lost against the failure-free pace, "
                      f"{fmt(move.get('steps_recomputed'), 'g')} steps recomputed{against}"))
    for r in rows:
        if not r["system"].startswith("DeadPool") or r.get("recovery_s") is None or r is move \
                or "audit" in r["system"] or "flipped" in r["system"]:  # corruption and audits: their own section
            continue
        if "FSDP2" in r["system"]:
            where, model = "kill at a step boundary", "Llama 13M, FSDP2 x TP on a 2x2 mesh + 1 spare"
        else:
            where = r["system"].split(", ", 1)[1] if ", " in r["system"] else "kill at a step boundary"
            model = "GPT demo, 4 ranks + 1 spare"
        against = (f"; TorchFT in the same run {torchft['recovery_s']:.2f} s ({r['vs_torchft']:.2f}x)"
                   if torchft and r.get("vs_torchft") else "")
        heads.append((f"recovery, {where} ({model})",
                      f"**{r['recovery_s']:.2f} s**: one step ({r['failure_free_step_s']:.2f} s) + "
                      f"{r['beyond_step_s']:.2f} s{against}"))
    return lines, heads[:2] if move is None else [heads[1], heads[0]] if len(heads) > 1 else heads


def overhead(run: Run) -> tuple[list[str], list[Headline]]:
    rows = run.rows
    lines = [
        "Failure-free cost of protection: every row trains the same model with the same world size (4 ranks, "
        "gloo); the median step time as a ratio to plain torch DDP of the same size, measured in the same run.",
        "",
        "- `stall p99`: the 99th percentile of the time the loop was blocked by the protection (DeadPool's "
        "pre-step wait for the snapshot copy; the save call for `torch.save` and `dcp.save`).",
        "- `snapshot`: one snapshot or checkpoint of the training state, per seat for DeadPool.",
        "- `other processes`: the share of the machine's CPUs that processes outside the benchmark used while "
        "the row ran; a row with a large share was disturbed, and its ratio says little.",
        "",
    ]
    lines += table(
        ["system", "size", "parameters", "step", "ratio", "CPU ratio", "stall p99", "snapshot", "other processes"],
        [[r["system"], r["size"], f"{r['params'] / 1e6:.1f}M", fmt(r["step_s_median"], ".3f", " s"),
          fmt(r["ratio"]), fmt(r.get("cpu_ratio") or None), fmt(r["stall_p99_s"] * 1000, ".2f", " ms"),
          f"{r['snapshot_bytes'] / 1e6:.1f} MB" if r.get("snapshot_bytes") else "-",
          fmt(100 * r["foreign_cpu"], ".0f", "%") if "foreign_cpu" in r else "-"] for r in rows])
    heads: list[Headline] = []
    deadpool = next((r for r in rows if r["system"] == "deadpool snapshot every step"), None)
    if deadpool:
        others = [r for r in rows if r["size"] == deadpool["size"] and r["system"] in
                  ("torch.save every step", "dcp.save every step", "dcp.async_save every step")]
        also = "; " + ", ".join(f"{r['system']} {r['ratio']:.2f}" for r in others) if others else ""
        baseline = next((r for r in rows if r["size"] == deadpool["size"] and r["system"] == "plain DDP"), None)
        disturbed = ""
        if baseline and max(baseline.get("foreign_cpu", 0), deadpool.get("foreign_cpu", 0)) > 0.1:
            disturbed = (f" (other processes used {100 * baseline['foreign_cpu']:.0f}% and "
                         f"{100 * deadpool['foreign_cpu']:.0f}% of the CPUs during the two rows)")
        heads.append((f"failure-free step with a snapshot every step, vs plain DDP ({deadpool['size']} model, "
                      f"{deadpool['params'] / 1e6:.1f}M, 4 ranks)", f"**{deadpool['ratio']:.3f}**{also}{disturbed}"))
    return lines, heads


def transport(run: Run) -> tuple[list[str], list[Headline]]:
    rows = run.rows
    lines = ["Control messages (one loop sending and receiving `Heartbeat`s, encoded, sent, received, decoded):", ""]
    control = [r for r in rows if r.get("bench") == "control"]
    lines += table(["transport", "HMAC", "messages/s", "µs/message"],
                   [[r["transport"], "yes" if r.get("hmac") else "no", f"{r['msgs_per_s']:,.0f}",
                     fmt(r["us_per_msg"], ".1f")] for r in control])
    inbound = [r for r in rows if r.get("bench") == "inbound"]
    if inbound:
        lines += ["Inbound control (sender processes into one endpoint, what a coordinator reads): the receiver's "
                  "CPU per message, against a plain pyzmq receive loop on the same traffic:", ""]
        lines += table(["transport", "senders", "µs/message", "plain pyzmq µs/message", "ratio"],
                       [[r["transport"], str(r["senders"]), fmt(r["us_per_msg"], ".1f"),
                         fmt(r["raw_us_per_msg"], ".1f"), fmt(r["ratio_to_raw"], ".2f")] for r in inbound])
    stream = [r for r in rows if r.get("bench") == "stream"]
    if stream:
        lines += ["Snapshot streaming (zero-copy frames to a buddy process, until its acknowledgement; "
                  "GB = 10^9 bytes):", ""]
        lines += table(["transport", "mode", "GB/s", "vs memcpy", "snapshot", "frame"],
                       [[r["transport"], r["mode"], fmt(r["gb_per_s"], ".2f"), fmt(r["ratio_to_memcpy"], ".2f"),
                         f"{r['bytes'] >> 20} MiB", f"{r['frame_bytes'] >> 20} MiB"] for r in stream])
    heads: list[Headline] = []
    hmac = next((r for r in control if r["transport"] == "tcp" and r.get("hmac")), None)
    tcp = next((r for r in stream if r["transport"] == "tcp" and r["mode"] == "recv+store"), None)
    if hmac and tcp:
        heads.append(("control messages over TCP with HMAC (one loop); snapshot streaming to a buddy over TCP",
                      f"**{hmac['msgs_per_s']:,.0f} msgs/s**; **{tcp['gb_per_s']:.2f} GB/s** "
                      f"({tcp['ratio_to_memcpy']:.2f} of a memcpy)"))
    return lines, heads


def simulate_scale(run: Run) -> tuple[list[str], list[Headline]]:
    rows = [r for r in run.rows if "not_run" not in r]
    lines = [
        "The real coordinator on a virtual clock against simulated members and host agents speaking the real "
        f"protocol through the real codec and frame limit; {run.data.get('failures', '?')} seeded failures (a "
        f"third each hangs, crashes and zombies), seed {run.data.get('seed', '?')}. `batched`: one heartbeat "
        "message per host of 8 members per interval (what `deadpool launch` agents send); `plain`: one per "
        "member. Detection and view change are virtual seconds; CPU is the coordinator's real CPU seconds per "
        "virtual second.",
        "",
    ]
    lines += table(
        ["members", "mode", "heartbeat s", "failures", "CPU s/s", "detect p50", "view change p50", "p99",
         "largest frame", "violations", "swaps", "job"],
        [[f"{r['members']:,}", r["mode"], fmt(r["heartbeat_interval"], "g"), str(r["failures_injected"]),
          fmt(r["coordinator_cpu_s_per_s"]), fmt(r["detect_s_p50"], ".2f"), fmt(r["view_change_s_p50"], ".2f"),
          fmt(r["view_change_s_p99"], ".2f"), f"{r['max_frame_bytes'] / 1024:,.0f} KiB",
          str(r["invariant_violations"]), str(r["swaps_completed"]), str(r["job"])] for r in rows])
    heads: list[Headline] = []
    largest = max((r for r in rows if r["mode"] == "batched"), key=lambda r: r["members"], default=None)
    if largest:
        heads.append((f"coordinator, simulated job of {largest['members']:,} members, "
                      f"{largest['failures_injected']} failures",
                      f"**{largest['coordinator_cpu_s_per_s']:.2f} coordinator CPU-s per virtual second**, "
                      f"view change p50 "
                      f"{largest['view_change_s_p50']:.2f} s, {largest['invariant_violations']} invariant "
                      "violations"))
    return lines, heads


def overhead_injob(run: Run) -> tuple[list[str], list[Headline]]:
    lines = ["Inside one job, interleaved blocks of steps with and without DeadPool's snapshots (and on native "
             "groups), so that both sides share the machine's state; ratios with 95% intervals over rounds.", ""]
    rows = run.rows
    keys = [k for k in rows[0] if k not in ("rounds",)] if rows else []
    lines += table(keys, [[fmt(r.get(k)) if isinstance(r.get(k), float) else str(r.get(k)) for k in keys]
                          for r in rows])
    return lines, []


def slow(run: Run) -> tuple[list[str], list[Headline]]:
    config = run.data.get("config", {})
    lines = [f"The GPT demo ({config.get('world', 4)} ranks + {config.get('spares', 2)} spares, "
             f"{config.get('steps', 40)} steps) with rank 1 made {config.get('factor', 3):g} times slower from step "
             f"{config.get('slow_step', 8)} on (`slow:` chaos), with `--replace-slow` and without it; rank 0's median "
             "step time (every step waits for the slowest seat) before the slowdown, while the seat is slow, and "
             "after the move.", ""]
    lines += table(["run", "step before", "step while slow", "step after the move", "reported at step",
                    "recomputed", "whole run", "bit-identical"],
                   [[r["system"], fmt(r.get("before_step_s")), fmt(r.get("slow_step_s")), fmt(r.get("after_step_s")),
                     fmt(r.get("seat_slow_at"), "g"), fmt(r.get("steps_recomputed"), "g"), fmt(r.get("total_s"), ".1f",
                                                                                                " s"),
                     str(r.get("bit_identical", "-"))] for r in run.rows])
    for note in run.data.get("notes", []):
        lines.append(f"- {note}")
    return lines, []


RENDERERS: dict[str, tuple[str, Callable[[Run], tuple[list[str], list[Headline]]]]] = {
    "recovery": ("Recovery", recovery),
    "overhead": ("Failure-free overhead", overhead),
    "overhead_injob": ("Overhead inside one job", overhead_injob),
    "transport": ("Transport", transport),
    "simulate_scale": ("The coordinator at scale (simulated)", simulate_scale),
    "slow": ("A slow rank, moved or not", slow),
}


def sections(runs: list[Run]) -> Iterator[tuple[Run, str, list[str], list[Headline]]]:
    order = list(RENDERERS)
    for run in sorted(runs, key=lambda r: (order.index(r.data["benchmark"]) if r.data.get("benchmark") in order
                                            else len(order), r.path.stem)):
        kind = run.data.get("benchmark", "")
        if kind not in RENDERERS:
            raise SystemExit(f"{run.path}: unknown benchmark {kind!r} (known: {', '.join(RENDERERS)})")
        title, render = RENDERERS[kind]
        lines, heads = render(run)
        yield run, title, lines, heads


def performance_page(runs: list[Run]) -> str:
    out = [
        "# Performance",
        "",
        "<!-- Generated by `python bench/figures.py` from docs/results/*.json: edit those (by re-running the",
        "     benchmark) or the script, not this page. -->",
        "",
        "Every figure on this page comes from one results file in `docs/results/`, written by the benchmark "
        "command shown under its heading (`--json PATH`), and names its run: the file, the date, the git commit "
        "and the machine. Figures compared in one table come from the same run. To update a figure, re-run its "
        "command and then `python bench/figures.py`, which rewrites this page and the README's table.",
        "",
        "These runs were made in small configurations (fewer repetitions and steps than the benchmarks' "
        "defaults) on a shared machine, so treat them as one run's figures, not as a distribution. "
        "`bench/README.md` says what each benchmark measures and its full options.",
        "",
    ]
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.data.get("benchmark", "")] = counts.get(run.data.get("benchmark", ""), 0) + 1
    for run, title, lines, _ in sections(runs):
        kind = run.data.get("benchmark", "")
        out += [f"## {title}" + (f" (`{run.name}`)" if counts[kind] > 1 else ""), ""]
        out += [f"`bench/{kind}.py`. " + run.provenance()[0], *run.provenance()[1:]]
        out += lines
        if out[-1] != "":
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def readme_table(runs: list[Run]) -> str:
    rows, machines = [], []
    for run, _, _, heads in sections(runs):
        for what, figure in heads:
            rows.append((what, figure, run))
            machines.append(run.machine())
    shared = len(set(machines)) == 1
    lines = [BEGIN,
             "<!-- Generated by `python bench/figures.py` from docs/results/*.json; do not edit by hand. -->", ""]
    lines += table(["what", "figure", "run (file, date, commit" + ("" if shared else ", machine") + ")"],
                   [[what, figure, ", ".join(filter(None, [run.cite("docs/results/", machine=not shared), run.load()]))]
                    for what, figure, run in rows])
    if shared and machines:
        lines += [f"Every run above: {machines[0]}.", ""]
    return "\n".join(lines) + END


def readme_text(readme: str, runs: list[Run]) -> str:
    begin, end = readme.find(BEGIN), readme.find(END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{README}: the markers {BEGIN} and {END} are missing")
    return readme[:begin] + readme_table(runs) + readme[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/performance.md or README.md is stale")
    args = parser.parse_args(argv)
    runs = load()
    if not runs:
        print(f"no results files in {RESULTS}", file=sys.stderr)
        return 1
    wanted = {PERFORMANCE: performance_page(runs), README: readme_text(README.read_text(), runs)}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(REPO)} is stale: run python bench/figures.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(REPO)}")
    if not stale:
        print("docs/performance.md and README.md are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
