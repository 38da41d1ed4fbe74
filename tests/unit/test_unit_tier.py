"""The tier guard (conftest.py) holds in this tier: no process, no socket, no torch.distributed group here."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess

import pytest
import torch._C._distributed_c10d as c10d
import zmq
from conftest import TierError


def test_a_process_start_is_refused_naming_the_tier_to_move_to() -> None:
    with pytest.raises(TierError, match=r"tests/unit/ starts a process.*belongs in tests/e2e"):
        subprocess.run(["true"], check=False)
    with pytest.raises(TierError):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_sockets_stores_and_groups_are_refused_even_on_the_loopback() -> None:
    with socket.socket() as sock, pytest.raises(TierError, match="binds a socket"):
        sock.bind(("127.0.0.1", 0))
    context = zmq.Context()
    try:
        with context.socket(zmq.PAIR) as pair, pytest.raises(TierError, match="binds a socket"):
            pair.bind("tcp://127.0.0.1:*")
    finally:
        context.term()
    with pytest.raises(TierError, match="opens a TCPStore"):
        c10d.TCPStore("127.0.0.1", 0, 1, True)
    with pytest.raises(TierError, match="builds a torch.distributed group"):
        c10d.ProcessGroupGloo(c10d.HashStore(), 0, 1)
