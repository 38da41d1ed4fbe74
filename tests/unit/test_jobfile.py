"""Where operator tools find a job: the job files of this host, by current link or by coordinator address."""

from __future__ import annotations

import os
import threading
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



def test_agents_sharing_a_home_write_their_job_files_at_once_without_error(home: Path) -> None:
    """Hosts of one job may share a home directory; each agent's write must stand on its own."""
    errors: list[BaseException] = []

    def agent(n: int) -> None:
        info = jobfile.JobInfo(f"tcp://10.0.0.{n}:29400", "s", "", os.getpid())
        try:
            for _ in range(300):
                jobfile.write(info, f"agent-host{n}")
        except BaseException as err:  # noqa: BLE001 - the test reports whatever a writer raised
            errors.append(err)

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert jobfile.resolve().coordinator.startswith("tcp://10.0.0.")
    assert sorted(p.name for p in (home / "jobs").iterdir()) == [
        "agent-host0.json", "agent-host1.json", "agent-host2.json", "agent-host3.json", "current.json"]


def test_a_job_file_that_cannot_be_written_is_a_warning_not_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("DEADPOOL_HOME", str(blocked))
    info = jobfile.JobInfo("tcp://10.0.0.1:29400", "s", "", os.getpid())
    assert jobfile.publish(info, "agent-host0") is None
    assert "give them --coordinator tcp://10.0.0.1:29400" in capsys.readouterr().err
