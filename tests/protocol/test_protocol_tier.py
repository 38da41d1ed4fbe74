"""The tier guard (conftest.py) in this tier: sockets and stores on the loopback only, and no process."""

from __future__ import annotations

import socket
import subprocess

import pytest
from conftest import TierError


def test_loopback_sockets_serve_and_other_addresses_and_processes_are_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
    with socket.socket() as sock, pytest.raises(TierError, match="binds a socket off the loopback"):
        sock.bind(("0.0.0.0", 0))
    with pytest.raises(TierError, match="starts a process"):
        subprocess.run(["true"], check=False)
