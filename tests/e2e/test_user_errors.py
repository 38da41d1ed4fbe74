"""A training script's own exception, and --check-determinism, with real processes.

An exception that repeats at the same step in the replacement is the script's error: the job
stops after one swap (exit 1, the traceback in the summary, the other spare unused).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import References
from launch_util import REPO, TINY, TINY_JOB, launch, running


def test_an_exception_that_repeats_in_the_replacement_stops_the_job_after_one_swap(tmp_path: Path) -> None:
    result = launch(tmp_path, "--nproc", "2", "--spares", "2", "--no-progress", steps=10,
                    script_args=("--raise-at-step", "5", "--raise-on-rank", "1"), script=TINY, timeout=120)
    assert result.returncode == 1, result.output[-3000:]
    refilled = [e for e in result.of("view_committed") if e.get("failed_seats")]
    assert len(refilled) == 1, "exactly one replacement"
    failed = result.of("job_failed")
    assert len(failed) == 1 and failed[0]["reason"] == "user_error"
    assert failed[0]["exception"] == "ValueError" and failed[0]["step"] == 5
    assert "bad batch at step 5" in failed[0]["traceback"] and "a bug in the training script" in failed[0]["detail"]
    reports = result.of("user_exception")
    assert [r["verdict"] for r in reports] == ["swap", "stop"]
    # One spare took the seat; the other was never seated.
    seated = {m for e in result.of("view_committed") for m in e["seats"]}
    spares = {e["member"] for e in result.of("member_joined") if e.get("role") == "spare"}
    assert len(spares) == 2 and len(spares & seated) == 1
    summary = result.output[result.output.index("deadpool: job FAILED"):]
    assert "job failed (user_error)" in summary and "Traceback (most recent call last)" in summary
    assert 'raise ValueError(f"bad batch at step {step}' in summary
    # Survivors say why in one line each, not with a JobStopped traceback.
    assert "JobStopped" not in result.output
    assert "[rank0] deadpool: job stopped:" in result.output


HOLDS_THE_PIPE = """\
import signal, subprocess, sys
sys.path.insert(0, {fixtures!r})
# A child that outlives its worker and holds its output pipe: a DataLoader worker stuck where it cannot
# notice that its parent is gone behaves the same way.
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(f"child {{child.pid}} holds the pipe", flush=True)
import tiny_train
tiny_train.main()
"""


def test_a_workers_child_that_holds_its_output_pipe_does_not_hold_the_launcher(tmp_path: Path) -> None:
    """Each worker's process group goes with it: the launcher reads its output to the end and exits, and the
    children its workers left behind (the killed rank's among them) are ended, not left for 600 s."""
    script = tmp_path / "holds_the_pipe.py"
    script.write_text(HOLDS_THE_PIPE.format(fixtures=str(TINY.parent)))
    result = launch(tmp_path, "--nproc", "2", "--spares", "1", "--no-progress", "--chaos", "kill:rank=1:step=4",
                    steps=8, script=script, timeout=120)
    assert result.returncode == 0, result.output[-3000:]
    children = [int(pid) for pid in re.findall(r"child (\d+) holds the pipe", result.output)]
    assert len(children) == 3, result.output[-3000:]
    assert [s["rank"] for s in result.of("swap_completed")] == [1]
    assert not [pid for pid in children if running(pid)], "a worker's children outlived the job"


def test_a_rank_held_in_its_own_code_during_a_swap_says_where_and_the_job_survives(tmp_path: Path,
                                                                                   references: References) -> None:
    """Rank 0 sleeps 12 s in step 5 (past the 10 s collective timeout) as rank 1 is killed: the swap's group
    cannot form without it (the spare's adoption times out, and the job rebuilds). Meanwhile rank 0's
    runtime reports where its training thread is (``compute_late``, with the stack). The digest is the one
    of the run without either."""
    reference = references.get(TINY, TINY_JOB, (), 8)
    result = launch(tmp_path, "--nproc", "2", "--spares", "1", "--no-progress", "--chaos", "kill:rank=1:step=5",
                    steps=8, script=TINY, timeout=180,
                    script_args=("--stall-at-step", "5", "--stall-s", "12", "--raise-on-rank", "0"))
    assert result.returncode == 0, result.output[-3000:]
    assert result.digest == reference.digest
    late = result.of("compute_late")
    assert len(late) >= 1 and ":rank0:" in late[0]["member"] and late[0]["waited_s"] >= 10, late
    assert "time.sleep(args.stall_s)" in late[0]["stack"], late[0]["stack"]
    assert "[rank0] deadpool: the training thread has not taken the coordinator's" in result.output
    assert [s["rank"] for s in result.of("swap_completed")] == [1]


def test_check_determinism_passes_on_a_script_that_tracks_everything(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "deadpool", "launch", "--check-determinism", "--no-progress", "--nproc", "2",
         "--events", str(tmp_path / "events.jsonl"), str(TINY), "--steps", "10"],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "--check-determinism PASSED" in output and "all three runs agree: 2 tracked object(s)" in output
    assert "kill:rank=1:step=5" in output
    killed = (tmp_path / "events.jsonl.3").read_text()
    assert '"event":"swap_completed"' in killed


def test_a_script_that_fails_before_it_joins_stops_the_job_at_once(tmp_path: Path) -> None:
    """A rank whose script raises before ``deadpool.init()`` never joins: the first view cannot form, and the
    job says so as soon as the agent reports the exit, not after the startup timeout (or never, when every
    process failed and nobody joined)."""
    script = tmp_path / "fails_at_import.py"
    script.write_text('raise ImportError("no module named missing_dependency")\n')
    result = launch(tmp_path, "--nproc", "2", "--spares", "1", "--no-progress", steps=5, script=script, timeout=60)
    assert result.returncode != 0, result.output[-3000:]
    assert "before it joined the job, so training cannot start" in result.output
    assert "no module named missing_dependency" in result.output
    assert result.elapsed < 60


LEAVES_THE_LOOP = """\
import sys
sys.path.insert(0, {fixtures!r})
import torch
import deadpool
rt = deadpool.init()
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
rt.track(model=model, optimizer=optimizer)
ddp = rt.ddp(model)
for step in rt.steps(8):
    ddp(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if rt.rank == 1 and step == 3:
        {leave}
rt.finish()
"""


@pytest.mark.parametrize("leave", ["sys.exit(0)", "break"])
def test_a_seat_that_leaves_its_loop_early_is_the_scripts_error(tmp_path: Path, leave: str) -> None:
    """A ``sys.exit`` (status 0 too) or a ``break`` out of ``rt.steps()`` on one seat: reported as the script's
    error at once (not found by missing heartbeats, with status 0 or a "no spare left" failure after its
    replacement did the same), so the job stops after one swap and says what the seat did."""
    script = tmp_path / "leaves_the_loop.py"
    script.write_text(LEAVES_THE_LOOP.format(fixtures=str(TINY.parent), leave=leave))
    result = launch(tmp_path, "--nproc", "2", "--spares", "1", "--no-progress", steps=8, script=script, timeout=120)
    assert result.returncode == 1, result.output[-3000:]
    assert [f["detected_by"] for f in result.of("member_failed")] == ["exception"], result.output[-3000:]
    failed = result.of("job_failed")
    assert len(failed) == 1 and failed[0]["reason"] == "user_error" and failed[0]["step"] == 3
    assert "rank 1 left the loop over rt.steps() in step 3, before its end" in failed[0]["traceback"]


COLLECTIVE_BEFORE_THE_LOOP = """\
import torch
import torch.distributed as dist
import deadpool
rt = deadpool.init()
dist.new_group([0, 1])  # installs torch's default group before the loop
count = torch.tensor([1.0])
dist.all_reduce(count)
for step in rt.steps(4):
    pass
rt.finish()
"""


def test_a_collective_on_the_default_group_before_the_loop_is_refused_not_completed_alone(tmp_path: Path) -> None:
    """Before the loop no seat has its communicator: an all-reduce there summed this seat's value alone (1.0 where
    the failure-free answer is 2.0), silently, once the default group was installed early (by dist.new_group or
    rt.device_mesh). It is the script's error now, named, and the job stops before its first step."""
    script = tmp_path / "collective_before_the_loop.py"
    script.write_text(COLLECTIVE_BEFORE_THE_LOOP)
    result = launch(tmp_path, "--nproc", "2", "--spares", "1", "--no-progress", steps=4, script=script, timeout=120)
    assert result.returncode == 1, result.output[-3000:]
    assert "a collective on torch's default group before the loop over rt.steps()" in result.output
    assert not result.of("training_finished")
