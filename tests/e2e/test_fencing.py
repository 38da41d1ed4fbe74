"""Bad input and zombies against a live job: clear rejections, never a crash, digest unchanged.

Real processes, real ZeroMQ sockets on 127.0.0.1, real SIGSTOP / SIGCONT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from launch_util import (
    DEMO,
    GPT_WORKLOAD,
    REFERENCE_STEPS,
    REPO,
    LaunchResult,
    assert_no_survivors,
    read_events,
    wait_for,
)

from deadpool.protocol import codec
from deadpool.protocol.messages import PROTOCOL_VERSION, CommitView, Heartbeat, Join, Prepare, SnapshotHeader
from deadpool.protocol.view import View

STEPS = REFERENCE_STEPS  # their digests are the shared reference run's (gpt_reference)
SECRET = "test-secret-0123456789"


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deadpool", "launch", "--events", str(events), *args, str(DEMO),
         "--steps", str(STEPS), *GPT_WORKLOAD, "--step-delay", "0.4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "DEADPOOL_SECRET": SECRET},
    )
    return proc, events


def finish(proc: subprocess.Popen[str], events: Path, timeout: float = 240) -> LaunchResult:
    output, _ = proc.communicate(timeout=timeout)
    result = LaunchResult(proc.returncode, output, read_events(events), 0.0)
    assert_no_survivors(result)
    return result


@pytest.fixture(scope="module")
def baseline(gpt_reference: LaunchResult) -> LaunchResult:
    return gpt_reference


def garbage_frames() -> list[list[bytes]]:
    secret = SECRET.encode()
    view = View(1, ["x"], [], 0, "epoch-1", "h:1", {}, {}, [0], {})
    join = Join("intruder", "active", 0, 4, 1, "h", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9")
    frames = [
        [os.urandom(64)],
        [b"DP"],
        [b"DP\x09\x00" + os.urandom(20)],  # wrong protocol version
        [b"DP" + bytes((PROTOCOL_VERSION, 0)) + b"\x92\x7f\x90"],  # unknown tag, unauthenticated
        [codec.encode(join)],  # no HMAC where one is required
        [codec.encode(join, b"wrong-secret")],  # wrong shared secret
        [codec.encode(Heartbeat("stranger", 1, 1, 1, 1, 0.0, ""), secret)],  # authenticated but unknown peer
        [codec.encode(CommitView(view), secret)],  # stale epoch view (epoch 1) to a worker at a later epoch
        [codec.encode(Prepare(0, [0], "stale"), secret)],  # stale prepare
        [codec.encode(SnapshotHeader("stranger", 99, 0, 1, 3, b""), secret), b"abc"],  # bulk from a stranger
        [b"\x00" * (2 << 20)],  # oversized: ZeroMQ drops it and disconnects the sender
    ]
    return frames


def test_garbage_and_wrong_secret_do_not_disturb_training(tmp_path: Path, baseline: LaunchResult) -> None:
    proc, events_path = start(tmp_path, "--nproc", "4", "--spares", "1")
    try:
        events = wait_for(events_path, lambda ev: any(e["event"] == "step_finished" and e["step"] >= 2 for e in ev),
                          120)
        targets = [e["address"] for e in events if e["event"] == "coordinator_started"]
        for e in events:
            if e["event"] == "member_joined" and e.get("source_process") == "worker":
                targets += [e["control_addr"], e["bulk_addr"]]
        assert len(targets) == 11
        context = zmq.Context()
        sent = 0
        try:
            for _ in range(3):
                for address in targets:
                    for frames in garbage_frames():
                        sock = context.socket(zmq.PUSH)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.setsockopt(zmq.SNDTIMEO, 1000)
                        sock.connect(address)
                        try:
                            sock.send_multipart(frames)
                            sent += 1
                        except zmq.Again:
                            pass
                        sock.close(linger=200)
        finally:
            context.term()
        assert sent > 100
    finally:
        result = finish(proc, events_path)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest
    reasons = {e.get("reason") for e in result.of("rejected")}
    for expected in ("bad_magic", "truncated", "bad_version", "unauthenticated", "bad_mac", "unknown_peer",
                     "stale_view", "stale_prepare"):
        assert expected in reasons, f"no '{expected}' rejection logged; got {sorted(map(str, reasons))}"
    assert not result.of("member_failed")


def test_sigstopped_member_replaced_then_sigcont_zombie_exits_without_harm(tmp_path: Path,
                                                                          baseline: LaunchResult) -> None:
    proc, events_path = start(tmp_path, "--nproc", "4", "--spares", "1", "--no-fence-kill",
                              "--chaos", "stop:rank=1:step=6")
    try:
        events = wait_for(events_path, lambda ev: any(e["event"] == "swap_completed" for e in ev), 120)
        zombie = next(e for e in events if e["event"] == "member_joined" and e.get("source_process") == "worker"
                      and ":rank1:" in e["member"])
        os.kill(zombie["pid"], signal.SIGCONT)
        wait_for(events_path, lambda ev: any(e["event"] == "fenced_exit" for e in ev), 60)
    finally:
        result = finish(proc, events_path)
    assert result.returncode == 0, result.output[-4000:]
    assert result.digest == baseline.digest
    assert [f["detected_by"] for f in result.of("member_failed")] == ["heartbeat"]
    assert result.of("fenced") and result.of("fenced")[0]["member"] == zombie["member"]
    assert "was declared dead" in result.output
    # After it woke up, the zombie changed nothing: no step, no snapshot, no view accepted from it.
    woke = next(e["ts"] for e in result.of("fenced"))
    assert not [e for e in result.of("step_finished") if e["member"] == zombie["member"] and e["ts"] > woke]
