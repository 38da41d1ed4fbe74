"""The fork server: one process per host imports torch and DeadPool once, and every worker is a fork of it.

A worker started as a fresh interpreter spends about 4 s of CPU importing torch and ``torch._dynamo``
(which every optimizer loads) before its script's first line; a host's workers and spares do that at
once, and a spare started late pays it while the job waits. The launcher starts this server first and
asks it for each worker. The server forks twice so that the worker's parent exits at once and the worker
is adopted by the launcher (its child subreaper): the launcher then waits for it, signals it and reads
its exit status as for a process it started itself. In the fork the worker becomes what
``python -u SCRIPT ARGS`` would have been: a session of its own, the launcher's pipe as stdout and stderr,
the request's environment, working directory, ``sys.argv`` and ``sys.path[0]``, then the script runs as
``__main__``. The server never touches CUDA (it checks), so a forked worker starts CUDA as a fresh one.

    python -u -m deadpool.worker.forkserver FD -- SCRIPT ARGS   # FD: the launcher's SOCK_SEQPACKET end

(SCRIPT and ARGS are only shown: ``ps`` lists every worker with them, as it would a worker started by exec.)
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import struct
import sys
import time

from deadpool.protocol import forks

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch.utils.data",
           "deadpool.worker.runtime")
ADOPTION_TIMEOUT = 10.0  # seconds a new worker waits for its short-lived parent to exit


def preload() -> None:
    """Import what every worker imports, without running anything that starts threads or CUDA."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised while preloading: a fork of this process could not use it")


def serve(control: socket.socket) -> forks.ForkRequest:
    """Answer fork requests until the launcher closes its end; returns only in a new worker, with its request."""
    _tell(control, forks.ServerReady(os.getpid()))
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(control, forks.MAX_MESSAGE, 1)
        except OSError:
            data, fds = b"", []
        if not data:
            os._exit(0)  # the launcher is gone
        try:
            request = forks.decode_request(data)
            if len(fds) != 1:
                raise forks.ForkProtocolError(f"a fork request needs 1 output pipe beside it, it had {len(fds)}")
        except forks.ForkProtocolError as err:
            for fd in fds:
                os.close(fd)
            _tell(control, forks.ForkRefused(str(err)))
            continue
        found, reply = _fork(control, fds[0], request)
        if found is not None:
            return found
        _tell(control, reply)


def _tell(control: socket.socket, reply: forks.ServerReady | forks.Forked | forks.ForkRefused) -> None:
    """Answer the launcher; one that is gone (stopped while this server started) ends the server quietly."""
    try:
        control.send(forks.encode(reply))
    except OSError:
        os._exit(0)


def _fork(control: socket.socket, output: int,
          request: forks.ForkRequest) -> tuple[forks.ForkRequest | None, forks.Forked | forks.ForkRefused]:
    """Fork the worker through a parent that exits at once; (request, _) in the worker, (None, reply) here."""
    read_end, write_end = os.pipe()
    try:
        middle = os.fork()
    except OSError as err:
        os.close(output)
        os.close(read_end)
        os.close(write_end)
        return None, forks.ForkRefused(f"fork failed: {err}")
    if middle == 0:
        os.close(read_end)
        middle = os.getpid()
        worker = os.fork()
        if worker == 0:
            os.close(write_end)
            _become_worker(control, output, request, middle)
            return request, forks.Forked(os.getpid())
        os.write(write_end, struct.pack("q", worker))
        os._exit(0)
    os.close(write_end)
    os.close(output)
    data = os.read(read_end, 8)
    os.close(read_end)
    os.waitpid(middle, 0)  # once it is reaped, its child belongs to the launcher
    if len(data) != 8:
        return None, forks.ForkRefused("the second fork failed")
    return None, forks.Forked(struct.unpack("q", data)[0])


def _become_worker(control: socket.socket, output: int, request: forks.ForkRequest, middle: int) -> None:
    """Turn this fork into the process ``python -u SCRIPT ARGS`` would have started."""
    control.close()
    os.setsid()
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    sys.argv = [request.script, *request.args]
    sys.path[0] = os.path.dirname(os.path.realpath(request.script))
    if "numpy" in sys.modules:  # a fresh interpreter's global numpy generator starts from OS entropy
        sys.modules["numpy"].random.seed()
    deadline = time.monotonic() + ADOPTION_TIMEOUT
    while os.getppid() == middle and time.monotonic() < deadline:  # the launcher must be this worker's parent
        time.sleep(0.001)


def main() -> forks.ForkRequest:
    control = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    try:
        preload()
    except BaseException as err:
        _tell(control, forks.ForkRefused(f"preloading failed: {type(err).__name__}: {err}"))
        os._exit(1)
    return serve(control)


if __name__ == "__main__":
    _request = main()
    runpy.run_path(_request.script, run_name="__main__")
