"""The workers' OpenMP threads: 1 when a host starts more than one worker and none is set (torchrun's rule)."""

from __future__ import annotations

from deadpool.agent.threadenv import omp_threads_env


def test_more_than_one_process_gets_one_thread_each_and_a_notice() -> None:
    env, notice = omp_threads_env({"PATH": "/usr/bin"}, processes=3)  # --nproc 2 --spares 1
    assert env == {"OMP_NUM_THREADS": "1"}
    assert "OMP_NUM_THREADS=1" in notice and "3 worker processes" in notice and "\n" not in notice


def test_the_users_setting_wins_and_one_process_is_left_alone() -> None:
    assert omp_threads_env({"OMP_NUM_THREADS": "4"}, processes=8) == ({}, "")
    assert omp_threads_env({"OMP_NUM_THREADS": ""}, processes=8) == ({}, ""), "set, even empty: the user's choice"
    assert omp_threads_env({}, processes=1) == ({}, "")  # --nproc 1, no spare: torch's own default
