"""The DEADPOOL_* contract of a worker, parsed in one place: config.WorkerEnv."""

from __future__ import annotations

import pytest

from deadpool.chaos import ChaosAction, ChaosPoint
from deadpool.config import WorkerEnv
from deadpool.errors import MisuseError
from deadpool.protocol.messages import Role

BASE = {"DEADPOOL_COORDINATOR": "tcp://127.0.0.1:5555"}


def test_an_active_worker_gets_what_launch_set() -> None:
    env = WorkerEnv.from_env({
        **BASE, "DEADPOOL_MEMBER_ID": "h:1", "DEADPOOL_ROLE": "active", "RANK": "2", "WORLD_SIZE": "4",
        "DEADPOOL_HOST": "host-a", "DEADPOOL_BIND_HOST": "10.0.0.5", "DEADPOOL_EVENTS": "/tmp/ev.jsonl",
        "DEADPOOL_CHAOS": "kill:rank=2:step=20,stop:rank=1:step=3:at=allreduce", "DEADPOOL_FAILURE_TIMEOUT": "3.5",
    })
    assert (env.coordinator, env.member, env.role, env.initial_rank, env.world_size) == (
        "tcp://127.0.0.1:5555", "h:1", Role.ACTIVE, 2, 4)
    assert (env.host, env.bind_host, env.events_path) == ("host-a", "10.0.0.5", "/tmp/ev.jsonl")
    assert [(s.action, s.rank, s.step, s.at) for s in env.chaos] == [
        (ChaosAction.KILL, 2, 20, ChaosPoint.BOUNDARY), (ChaosAction.STOP, 1, 3, ChaosPoint.ALLREDUCE)]
    assert env.config.failure_timeout == 3.5


def test_a_spare_has_no_initial_rank_and_defaults_fill_the_rest() -> None:
    env = WorkerEnv.from_env({**BASE, "DEADPOOL_ROLE": "spare", "RANK": "5", "DEADPOOL_SPARE_INDEX": "1"})
    assert (env.role, env.initial_rank, env.spare_index) == (Role.SPARE, -1, 1)
    assert (env.world_size, env.bind_host, env.events_path, env.chaos) == (1, "127.0.0.1", None, ())
    assert env.member and env.host  # generated / this host's name


def test_without_a_coordinator_the_script_was_not_launched_by_deadpool() -> None:
    with pytest.raises(MisuseError, match="deadpool launch"):
        WorkerEnv.from_env({})


@pytest.mark.parametrize(("name", "value", "match"), [
    ("DEADPOOL_ROLE", "leader", "DEADPOOL_ROLE must be 'active' or 'spare'"),
    ("RANK", "two", "RANK='two' is not a valid int"),
    ("DEADPOOL_CHAOS", "explode:rank=1:step=2", "action must be one of"),
    ("DEADPOOL_COPY_TIMEOUT", "soon", "DEADPOOL_COPY_TIMEOUT='soon' is not a valid float"),
])
def test_a_bad_variable_is_named(name: str, value: str, match: str) -> None:
    with pytest.raises(MisuseError, match=match):
        WorkerEnv.from_env({**BASE, name: value})
