"""End to end: a run that tested nothing, or whose final state is not guaranteed, does not end like a pass.

A chaos spec whose point the script's steps never pass (``at=reducescatter`` on an ``rt.ddp``
script) is warned about at its member's first step and makes the launch exit 4; a script fed by a
plain ``DataLoader`` that goes through a swap ends "training finished" with a closing line saying
its final state may differ from a failure-free run's, and exits 5 under ``--strict``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from launch_util import REPO, TINY, launch

PLAIN = REPO / "tests" / "fixtures" / "plain_loader_train.py"
SPARES = ("--nproc", "2", "--spares", "1")


def test_a_spec_whose_point_the_script_never_passes_exits_4_and_says_why(tmp_path: Path) -> None:
    spec = "kill:rank=1:step=3:at=reducescatter"
    result = launch(tmp_path, *SPARES, "--chaos", spec, steps=6, script=TINY, timeout=150)
    assert result.returncode == 4, result.output[-3000:]
    assert not result.of("member_failed") and result.digest, "nobody died: the run finished, untested"
    # At the start: rank 1's first step passed the points of an rt.ddp step, and no reduce-scatter.
    [unseen] = result.of("chaos_point_unseen")
    assert (unseen["spec"], unseen["rank"], unseen["step"], unseen["seen"]) == (
        spec, 1, 0, ["boundary", "backward", "allreduce"])
    assert f"[rank1] deadpool: warning: chaos spec {spec} will likely never fire" in result.output
    # At the end: the launcher's event and closing line, and why the status is 4.
    [finding] = result.of("chaos_not_fired")
    assert (finding["spec"], finding["target_rank"], finding["last_step"], finding["ended"]) == (spec, 1, 5, "ran")
    assert finding["source_process"] == "agent" and finding["seen"] == ["boundary", "backward", "allreduce"]
    assert (f"  chaos: {spec} never fired: rank 1's member finished step 3 (and steps up to 5) without passing a "
            "reducescatter point") in result.output
    assert f"deadpool: exit status 4: training finished, but chaos spec(s) {spec} never fired" in result.output
    assert "setting OMP_NUM_THREADS=1 for each of the 3 worker processes" in result.output
    events = sorted(tmp_path.glob("events-*.jsonl"))[-1]
    shown = subprocess.run([sys.executable, "-m", "deadpool", "events", str(events)], capture_output=True, text=True,
                           timeout=60, cwd=REPO)
    assert shown.returncode == 0 and f"chaos not fired  {spec}: rank 1's member finished step 3" in shown.stdout


def test_a_swap_past_an_untracked_loader_is_named_and_fails_under_strict(tmp_path: Path) -> None:
    free = launch(tmp_path, *SPARES, "--strict", steps=8, script=PLAIN, timeout=150)
    assert free.returncode == 0 and free.digest, free.output[-3000:]
    assert len(free.of("data_loader_untracked")) == 2, "each seat is warned once, at its first iteration"
    assert "may differ from a failure-free run" not in free.output, "no swap: nothing to say"
    assert "untracked_rollback" not in free.of("training_finished")[0]

    killed = launch(tmp_path, *SPARES, "--strict", "--chaos", "kill:rank=1:step=4", steps=8, script=PLAIN,
                    timeout=150)
    assert killed.returncode == 5, killed.output[-3000:]
    assert [s["rank"] for s in killed.of("swap_completed")] == [1]
    [finished] = killed.of("training_finished")
    rollback = finished["untracked_rollback"]
    assert (rollback["loader"], rollback["rank"]) == ("DataLoader", 0), rollback
    assert rollback["where"].startswith("plain_loader_train.py:") and rollback["view"] >= 2
    assert (f"  final state may differ from a failure-free run: an untracked DataLoader (iterated at "
            f"{rollback['where']}, rank 0) was not rolled back at the swap of view {rollback['view']}") in killed.output
    assert "deadpool: exit status 5 (--strict): training finished" in killed.output
    assert killed.digest and killed.digest != free.digest, "the caveat is real: the final state differs"
