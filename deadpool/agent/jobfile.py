"""Where operator tools find a running job: a small JSON file per launch, readable by its owner only.

``deadpool launch`` on the coordinator's host writes the coordinator address,
the shared secret and the events file to ``~/.deadpool/jobs/<id>.json`` (mode
0600) and points ``~/.deadpool/jobs/current.json`` at it, so ``deadpool
status`` and ``deadpool chaos`` work with no arguments on that host, and with
``--coordinator ADDR`` alone for any job of this host (the secret is looked up
by address).  Other hosts take the secret from ``DEADPOOL_SECRET`` or
``--secret-file``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deadpool.errors import MisuseError


@dataclass(frozen=True, slots=True)
class JobInfo:
    """How to reach one job's coordinator."""

    coordinator: str  # control address, tcp://host:port
    secret: str  # shared secret ("" when the job runs open on loopback)
    events: str  # events file of this host
    launcher_pid: int  # the agent that wrote this file
    coordinators: list[str] = field(default_factory=list)  # the job's other coordinators (its standby), asked next


def jobs_dir() -> Path:
    return Path(os.environ.get("DEADPOOL_HOME", Path.home() / ".deadpool")) / "jobs"


def write(info: JobInfo, name: str) -> Path:
    """Write the job file (0600) and make it the current one."""
    folder = jobs_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{name}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(asdict(info), handle)
    # A new link under a name of this writer's own, renamed over the current one:
    # agents of several hosts that share a home directory may do this at once.
    staged = folder / f".current-{name}.link"
    with contextlib.suppress(FileNotFoundError):
        staged.unlink()
    staged.symlink_to(path.name)
    os.replace(staged, folder / "current.json")
    return path


def publish(info: JobInfo, name: str) -> Path | None:
    """`write`, or a warning and None when the file cannot be written: it serves operator tools only."""
    try:
        return write(info, name)
    except OSError as err:
        print(f"deadpool: no job file for operator tools ({err}); give them --coordinator {info.coordinator}",
              file=sys.stderr, flush=True)
        return None


def remove(path: Path) -> None:
    """Delete a job file, and the current-job link if it points at it."""
    current = path.parent / "current.json"
    with contextlib.suppress(OSError):
        if current.is_symlink() and os.readlink(current) == path.name:
            current.unlink()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def find(coordinator: str) -> JobInfo | None:
    """The job file of this host whose coordinator is at `coordinator`, or None.

    When several files name that address (a job that ended without removing its
    file, then a new one bound the same port), the one whose launcher is alive wins.
    """
    wanted = _address_key(coordinator)
    found: list[JobInfo] = []
    try:
        paths = sorted(jobs_dir().glob("*.json"))
    except OSError:
        return None
    for path in paths:
        info = _read(path)
        if info is not None and _address_key(info.coordinator) == wanted and info not in found:
            found.append(info)
    alive = [info for info in found if process_alive(info.launcher_pid)]
    if alive:
        return alive[0]
    return found[0] if found else None


def _read(path: Path) -> JobInfo | None:
    try:
        data = json.loads(path.read_text())
        return JobInfo(**data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def _address_key(address: str) -> str:
    """An address for comparison: the scheme dropped, lower case, ``localhost`` as ``127.0.0.1``."""
    rest = address.strip().lower().split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if host == "localhost":
        host = "127.0.0.1"
    return f"{host}{sep}{port}"


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve(coordinator: str = "", secret_file: str = "") -> JobInfo:
    """The job to talk to: explicit arguments first, then the job files of this host.

    Given a coordinator but no secret (neither ``DEADPOOL_SECRET`` nor
    `secret_file`), the secret comes from this host's job file for that address,
    if there is one.

    Raises:
        MisuseError: no coordinator given and no running job found on this host.
    """
    secret = os.environ.get("DEADPOOL_SECRET", "")
    if secret_file:
        try:
            secret = Path(secret_file).read_text().strip()
        except OSError as err:
            raise MisuseError(f"cannot read --secret-file {secret_file}: {err}") from None
    if coordinator:
        known = None if secret else find(coordinator)
        if known is not None:
            return JobInfo(coordinator, known.secret, known.events, known.launcher_pid)
        return JobInfo(coordinator, secret, "", 0)
    current = jobs_dir() / "current.json"
    try:
        data = json.loads(current.read_text())
        info = JobInfo(**data)
    except (OSError, ValueError, TypeError):
        raise MisuseError(
            f"no running job found ({current} is missing): pass --coordinator tcp://HOST:PORT "
            "(printed by `deadpool launch`), with DEADPOOL_SECRET set if the job uses one"
        ) from None
    return JobInfo(info.coordinator, secret or info.secret, info.events, info.launcher_pid)
