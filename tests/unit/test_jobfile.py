"""Where operator tools find a job: the job files of this host, by current link or by coordinator address."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deadpool.agent import jobfile
from deadpool.errors import MisuseError


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DEADPOOL_HOME", str(tmp_path))
    monkeypatch.delenv("DEADPOOL_SECRET", raising=False)
    return tmp_path


def test_current_job_file_is_used_without_arguments(home: Path) -> None:
    path = jobfile.write(jobfile.JobInfo("tcp://127.0.0.1:4000", "s3cret", "/tmp/e.jsonl", os.getpid()), "job-a")
    assert jobfile.resolve() == jobfile.JobInfo("tcp://127.0.0.1:4000", "s3cret", "/tmp/e.jsonl", os.getpid())
    jobfile.remove(path)
    with pytest.raises(MisuseError, match="no running job found"):
        jobfile.resolve()


def test_an_address_alone_takes_the_secret_of_that_job(home: Path) -> None:
    jobfile.write(jobfile.JobInfo("tcp://127.0.0.1:4000", "first", "/tmp/a.jsonl", os.getpid()), "job-a")
    jobfile.write(jobfile.JobInfo("tcp://127.0.0.1:5000", "second", "/tmp/b.jsonl", os.getpid()), "job-b")
    # current.json points at job-b; the address names job-a.
    assert jobfile.resolve("tcp://127.0.0.1:4000").secret == "first"
    assert jobfile.resolve("tcp://localhost:4000").secret == "first"
    assert jobfile.resolve("tcp://127.0.0.1:5000").events == "/tmp/b.jsonl"
    assert jobfile.resolve("tcp://127.0.0.1:6000") == jobfile.JobInfo("tcp://127.0.0.1:6000", "", "", 0)


def test_a_given_secret_wins_over_the_job_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jobfile.write(jobfile.JobInfo("tcp://127.0.0.1:4000", "from-file", "", os.getpid()), "job-a")
    monkeypatch.setenv("DEADPOOL_SECRET", "from-env")
    assert jobfile.resolve("tcp://127.0.0.1:4000").secret == "from-env"
    secret_file = home / "secret"
    secret_file.write_text("from-secret-file\n")
    assert jobfile.resolve("tcp://127.0.0.1:4000", str(secret_file)).secret == "from-secret-file"


def test_the_live_launcher_wins_over_a_stale_file_of_the_same_address(home: Path) -> None:
    dead = 2**22 + 12345  # above the default pid_max: no such process
    jobfile.write(jobfile.JobInfo("tcp://127.0.0.1:4000", "stale", "", dead), "job-a")
    assert jobfile.resolve("tcp://127.0.0.1:4000").secret == "stale"  # better than nothing
    jobfile.write(jobfile.JobInfo("tcp://127.0.0.1:4000", "live", "", os.getpid()), "job-b")
    assert jobfile.resolve("tcp://127.0.0.1:4000").secret == "live"

