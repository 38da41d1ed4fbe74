"""One authenticated request and its reply between an operator tool and a live job's coordinator.

An operator tool is a short-lived endpoint of the control plane: it binds its own
transport, sends one request (``StatusRequest``, ``ChaosCommand``) naming that endpoint as
``reply_to``, and waits for the answer carrying the same nonce, never longer than
``--timeout``.  It speaks the job's protocol with the job's secret (found by
``deadpool.agent.jobfile.resolve``), so the coordinator treats a wrong secret like any other
unauthenticated frame: dropped and logged, and the tool reports a timeout that names the
secret as a likely cause.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import secrets
import socket
from collections.abc import Callable
from typing import Any

from deadpool.agent import jobfile
from deadpool.errors import MisuseError, PeerFailure, WaitTimeout
from deadpool.protocol import codec
from deadpool.protocol.messages import Message, StatusReply, StatusRequest
from deadpool.protocol.transport import CONTROL_LIMITS, TransportError, address_host, open_transport

log = logging.getLogger("deadpool.tools.request")

DEFAULT_TIMEOUT = 5.0  # seconds for one request/reply; the coordinator answers in milliseconds


def _reply_host(coordinator: str) -> str:
    """The local address the coordinator can answer to: loopback for a local job, else the routed one.

    Raises:
        MisuseError: no local address routes to the coordinator's host.
    """
    host = address_host(coordinator).strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            local: str = probe.getsockname()[0]
            return local
    except OSError as err:
        raise MisuseError(f"cannot find a local address that reaches {coordinator} ({err}); pass --bind-host") from None


async def exchange(job: jobfile.JobInfo, build: Callable[[str, int], Message], expect: type[Message],
                   timeout: float, bind_host: str = "") -> Message:
    """Send one request and return the reply with its nonce, within `timeout` seconds in all.

    `build(reply_to, nonce)` makes the request.

    Raises:
        WaitTimeout: the coordinator did not accept or did not answer within `timeout`.
    """
    secret = job.secret.encode() or None
    transport = open_transport(f"tcp://{bind_host or _reply_host(job.coordinator)}:0", CONTROL_LIMITS)
    nonce = secrets.randbits(62)
    frame = codec.encode(build(transport.address, nonce), secret)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    reply: Message | None = None
    failure: WaitTimeout | None = None
    async with asyncio.TaskGroup() as tasks:
        reader = tasks.create_task(transport.run())
        try:
            await transport.send(job.coordinator, [frame], timeout)
            while reply is None:
                frames = await asyncio.wait_for(transport.recv(), max(0.0, deadline - loop.time()))
                decoded = codec.decode(frames[0], secret, CONTROL_LIMITS.max_frame_bytes)
                if isinstance(decoded, codec.DecodeError):
                    log.warning("dropped a frame: %s (%s)", decoded.reason, decoded.detail)
                elif isinstance(decoded, expect) and getattr(decoded, "nonce", None) == nonce:
                    reply = decoded
        except TransportError as err:
            failure = WaitTimeout(
                f"could not reach the coordinator at {job.coordinator} within {timeout:g}s ({err}). "
                "Nothing was changed. Is the job still running? `deadpool launch` prints the address."
            )
        except TimeoutError:
            failure = WaitTimeout(
                f"no answer from the coordinator at {job.coordinator} within {timeout:g}s. Nothing is known to have "
                "changed. Either the job ended, or the secret differs from the job's (set DEADPOOL_SECRET or "
                "--secret-file to the job's secret)."
            )
        finally:
            await transport.close()
            reader.cancel()
    if failure is not None:
        raise failure
    assert reply is not None
    return reply


async def fetch_status(job: jobfile.JobInfo, timeout: float = DEFAULT_TIMEOUT, bind_host: str = "") -> dict[str, Any]:
    """The live state (``Coordinator.status()``) of the job's active coordinator, as a dict.

    The job's coordinators are asked in turn: the job file's address, then the others it lists.
    A standby answers with the address of the active coordinator it watches, which is asked
    next; when only a standby answers (the active is lost and not yet taken over from), its own
    state is returned (``role``: ``standby``).

    Raises:
        WaitTimeout: no coordinator answered within `timeout` each.
        PeerFailure: an answer is not a JSON object.
    """
    return (await locate(job, timeout, bind_host))[1]


async def locate(job: jobfile.JobInfo, timeout: float = DEFAULT_TIMEOUT,
                 bind_host: str = "") -> tuple[jobfile.JobInfo, dict[str, Any]]:
    """The job as reached at its active coordinator, and that coordinator's status (see `fetch_status`).

    Raises:
        WaitTimeout: no coordinator answered.
        PeerFailure: an answer is not a JSON object.
    """
    queue, tried = [job.coordinator, *job.coordinators], set()
    standby: tuple[jobfile.JobInfo, dict[str, Any]] | None = None
    failure: WaitTimeout | None = None
    while queue:
        address = queue.pop(0)
        if not address or address in tried:
            continue
        tried.add(address)
        candidate = dataclasses.replace(job, coordinator=address)
        try:
            document = await _status_of(candidate, timeout, bind_host)
        except WaitTimeout as err:
            failure = failure or err
            continue
        if document.get("role") != "standby":
            return candidate, document
        standby = standby or (candidate, document)
        queue.insert(0, str(document.get("active", "")))
    if standby is not None:
        return standby
    assert failure is not None
    raise failure


async def _status_of(job: jobfile.JobInfo, timeout: float, bind_host: str) -> dict[str, Any]:
    reply = await exchange(job, lambda addr, nonce: StatusRequest(addr, nonce), StatusReply, timeout, bind_host)
    assert isinstance(reply, StatusReply)
    try:
        document = json.loads(reply.json)
    except json.JSONDecodeError as err:
        raise PeerFailure(f"the coordinator's status is not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise PeerFailure("the coordinator's status is not a JSON object")
    return document


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--coordinator``, ``--secret-file``, ``--timeout`` and ``--bind-host``, shared by every operator tool."""
    parser.add_argument("--coordinator", default="",
                        help="coordinator address tcp://HOST:PORT (default: the job started on this host)")
    parser.add_argument("--secret-file", default="", help="file holding the job's secret (default: DEADPOOL_SECRET, "
                                                          "or the job file of that address on this host)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds to wait for each answer")
    parser.add_argument("--bind-host", default="", help="local address the coordinator answers to (default: routed)")


def job_of(args: argparse.Namespace) -> jobfile.JobInfo:
    """The job the connection arguments name.

    Raises:
        MisuseError: a bad --timeout, an unreadable --secret-file, or no job given or found.
    """
    if not args.timeout > 0:
        raise MisuseError(f"--timeout must be positive, got {args.timeout}")
    return jobfile.resolve(args.coordinator, args.secret_file)
