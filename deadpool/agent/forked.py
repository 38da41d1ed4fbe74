"""How the launcher starts its workers: forked from the host's fork server, or as fresh interpreters.

The server (``deadpool/worker/forkserver.py``) imports torch once per host; each worker is a fork of it
that the launcher adopts, being its child subreaper, so that ``exits.ended`` and the kills work on it as on
a worker started by exec. ``ForkedWorker`` offers what the launcher uses of an ``asyncio`` process: its pid,
its output stream, its exit status and signals. The launcher reaps it (no asyncio child watcher knows it),
and reaps the orphans a killed worker leaves in its session (DataLoader workers), which would otherwise
stay zombies of the launcher for the job's life.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import sys
from pathlib import Path

from deadpool.errors import DeadPoolError
from deadpool.protocol import forks

PR_SET_CHILD_SUBREAPER = 36
READY_TIMEOUT = 180.0  # seconds the server may take to import torch (a loaded host, a cold page cache)
FORK_TIMEOUT = 30.0  # seconds for one fork request's answer
REAP_INTERVAL = 1.0  # seconds between two looks for orphaned zombies


class ForkServerError(DeadPoolError):
    """The fork server could not start, or could not start a worker (the message says why)."""


def become_subreaper() -> bool:
    """Make this process the parent of its descendants orphaned later (Linux 3.4 and later)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class ForkedWorker:
    """A worker forked by the server and adopted by this launcher."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader) -> None:
        self.pid = pid
        self.stdout = stdout
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        """Its exit status as ``Popen.returncode`` has it, reaping it once it has ended; None while it runs."""
        if self._code is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours to reap: cannot happen once adopted, but never wait for it
                self._code = -1
                return self._code
            if pid:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


class ForkServer:
    """One host's fork server process and the launcher's end of its socket."""

    def __init__(self, proc: asyncio.subprocess.Process, control: socket.socket) -> None:
        self._proc = proc
        self._control = control
        self._lock = asyncio.Lock()
        self._sessions: set[int] = set()  # every worker forked: each leads a session of its own
        self._ready = False
        self.open = True  # False once closed: its workers are still reaped, no new one is forked

    @classmethod
    async def start(cls, env: dict[str, str], script: str, args: list[str]) -> ForkServer:
        """Start the server with the environment every worker shares (it imports torch under it); its command
        line, which its forks keep, ends with the script and its arguments, so ``ps`` and ``pkill -f`` find
        the workers by them as they would workers started by exec."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-u", "-m", "deadpool.worker.forkserver", str(theirs.fileno()), "--", script, *args,
                env=env, pass_fds=(theirs.fileno(),))
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(FORK_TIMEOUT)
        normal_priority(proc.pid)  # and so do its forks
        return cls(proc, ours)

    async def _wait_ready(self) -> None:
        """Wait until the server has imported everything; raises ForkServerError if it cannot start."""
        reply = await asyncio.to_thread(self._receive, READY_TIMEOUT)
        if not isinstance(reply, forks.ServerReady):
            raise ForkServerError(f"the fork server did not start: {_why(reply)}")
        self._ready = True

    async def spawn(self, script: str, args: list[str], env: dict[str, str]) -> ForkedWorker:
        """One worker running `script`, its output and errors on a new pipe read by the returned handle."""
        if not self.open:
            raise ForkServerError("the fork server is closed")
        if not self._ready:
            await self._wait_ready()
        request = forks.encode(forks.ForkRequest(script, list(args), env, os.getcwd()))
        read_end, write_end = os.pipe()
        try:
            async with self._lock:
                reply = await asyncio.to_thread(self._exchange, request, write_end)
        finally:
            os.close(write_end)
        if not isinstance(reply, forks.Forked):
            os.close(read_end)
            raise ForkServerError(f"the fork server did not start {script}: {_why(reply)}")
        self._sessions.add(reply.pid)
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_end, "rb", 0))
        return ForkedWorker(reply.pid, reader)

    def _exchange(self, request: bytes, output: int) -> forks.Reply:
        try:
            socket.send_fds(self._control, [request], [output])
        except OSError as err:
            raise ForkServerError(f"the fork server is gone: {err}") from None
        return self._receive(FORK_TIMEOUT)

    def _receive(self, timeout: float) -> forks.Reply:
        self._control.settimeout(timeout)
        try:
            data = self._control.recv(forks.MAX_MESSAGE)
        except TimeoutError:
            raise ForkServerError(f"the fork server did not answer within {timeout:.0f} s") from None
        except OSError as err:
            raise ForkServerError(f"the fork server is gone: {err}") from None
        if not data:
            raise ForkServerError("the fork server exited (its output above says why)")
        try:
            return forks.decode_reply(data)
        except forks.ForkProtocolError as err:
            raise ForkServerError(str(err)) from None

    async def reap_orphans(self) -> None:
        """Reap, for ever, the zombies a worker's session leaves with this launcher (run as a task)."""
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            for pid in orphaned_zombies(self._sessions):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    async def close(self) -> None:
        """End the server (closing its socket ends it); the workers it forked are not touched."""
        if not self.open:
            return
        self.open = False
        self._control.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._proc.wait(), 5.0)
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()


class Starter:
    """Starts this host's workers: forks of the fork server (``--start-method fork``) while it serves, fresh
    interpreters otherwise (``exec``, or where the server cannot start or the kernel cannot adopt its forks)."""

    def __init__(self) -> None:
        self._server: ForkServer | None = None

    async def open(self, method: str, env: dict[str, str], script: str, args: list[str]) -> None:
        """Start the fork server under `env` (what every worker shares) if `method` is fork."""
        if method != "fork":
            return
        if not become_subreaper():
            _say("this kernel cannot make the launcher a subreaper: every worker starts as a fresh interpreter")
            return
        try:
            self._server = await ForkServer.start(env, script, args)
        except OSError as err:
            _say(f"the fork server did not start ({err}): every worker starts as a fresh interpreter")

    async def start(self, script: str, args: list[str],
                    env: dict[str, str]) -> asyncio.subprocess.Process | ForkedWorker:
        """One worker running `script` with `env`, its output and errors on a pipe the handle reads; it runs
        at the default priority even though the launcher raised its own."""
        if self._server is not None and self._server.open:
            try:
                return await self._server.spawn(script, args, env)
            except ForkServerError as err:
                _say(f"{err}; this host's workers start as fresh interpreters")
                await self._server.close()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-u", script, *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        normal_priority(proc.pid)
        return proc

    async def close(self) -> None:
        """No more workers will start: the fork server ends (its workers are still reaped)."""
        if self._server is not None:
            await self._server.close()

    async def reap_orphans(self) -> None:
        """Reap, for ever, what the forked workers' sessions leave with this launcher (run as a task)."""
        if self._server is not None:
            await self._server.reap_orphans()


def _why(reply: forks.Reply) -> str:
    """What a reply other than the one expected says."""
    return reply.why if isinstance(reply, forks.ForkRefused) else f"it answered {type(reply).__name__}"


def normal_priority(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, 0)


def _say(line: str) -> None:
    print(f"deadpool: {line}", file=sys.stderr, flush=True)


def orphaned_zombies(sessions: set[int]) -> list[int]:
    """This process's ended children that belong to a worker's session but are not a worker themselves."""
    found = []
    for pid in _children():
        if pid in sessions:
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, session, ...
        if fields[0] == "Z" and int(fields[3]) in sessions:
            found.append(pid)
    return found


def _children() -> set[int]:
    children: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                children.update(int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split())
    return children
