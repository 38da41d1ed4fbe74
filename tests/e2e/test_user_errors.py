"""A training script's own exception, and --check-determinism, with real processes.

An exception that repeats at the same step in the replacement is the script's error: the job
stops after one swap (exit 1, the traceback in the summary, the other spare unused).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launch_util import REPO, launch

pytestmark = pytest.mark.e2e

TINY = REPO / "tests" / "fixtures" / "tiny_train.py"


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
