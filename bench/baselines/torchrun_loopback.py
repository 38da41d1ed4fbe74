"""``torchrun`` with every TCPStore server it hosts listening on 127.0.0.1 only.

Why: a c10d ``TCPStore`` server binds the wildcard address (``*:PORT``, every
interface) whatever ``host_name`` says, and torchrun's agent hosts one for the
rendezvous (static: on ``--master-port``; c10d: on the ``--rdzv-endpoint`` port
plus a shared bootstrap store on a free port).  No torchrun flag or environment
variable changes that.  ``TCPStore`` accepts an already listening socket
(``master_listen_fd``); this shim binds that socket to 127.0.0.1 and otherwise
runs torchrun unchanged (same arguments, same agent, same restarts)::

    python bench/baselines/torchrun_loopback.py --nproc-per-node 4 --max-restarts 1 ... SCRIPT ARGS
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import torch.distributed as dist

LOOPBACK = "127.0.0.1"
_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]


def _listen(port: int) -> tuple[int, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, port))
        sock.listen(1024)
        bound = int(sock.getsockname()[1])
    except OSError:
        sock.close()
        raise
    return sock.detach(), bound


def create_store(
    host_name: str,
    port: int,
    world_size: int | None = None,
    is_master: bool = False,
    timeout: Any = None,
    wait_for_workers: bool = True,
    multi_tenant: bool = False,
    master_listen_fd: int | None = None,
    use_libuv: bool = True,
) -> Any:
    """``TCPStore`` with the same signature; a server listens on loopback only.

    A client (``is_master=False``) is created unchanged but pointed at 127.0.0.1,
    since every server of this job is there.
    """
    kwargs: dict[str, Any] = {
        "world_size": world_size,
        "is_master": is_master,
        "wait_for_workers": wait_for_workers,
        "multi_tenant": multi_tenant,
        "use_libuv": True,  # a non-libuv server given a listening fd hung in a test here
    }
    if timeout is not None:
        kwargs["timeout"] = timeout
    if is_master and master_listen_fd is None:
        fd, port = _listen(port)
        kwargs["master_listen_fd"] = fd
    elif master_listen_fd is not None:
        kwargs["master_listen_fd"] = master_listen_fd
    return _TCPStore(LOOPBACK, port, **kwargs)


def patch_torch_elastic() -> None:
    """Route every TCPStore the elastic agent creates through ``create_store``."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    static_tcp_rendezvous.TCPStore = create_store  # type: ignore[attr-defined, assignment]
    c10d_rendezvous_backend.TCPStore = create_store  # type: ignore[attr-defined, assignment]
    # dynamic_rendezvous and elastic.utils.distributed call ``dist.TCPStore`` directly.
    dist.TCPStore = create_store  # type: ignore[attr-defined, assignment]


def main() -> None:
    patch_torch_elastic()
    from torch.distributed.run import main as torchrun_main

    torchrun_main()


if __name__ == "__main__":
    main()
    sys.exit(0)
