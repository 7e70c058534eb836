"""Reading the launcher's environment: which variables decide rank, world and GPU."""

from __future__ import annotations

import pytest

from distamp.distributed.process_group import WorldInfo, world_info_from_env

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


def test_no_launcher_variables_is_a_one_process_world(env):
    assert world_info_from_env() == WorldInfo()


def test_local_rank_comes_from_local_rank_only(env):
    env(RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4)
    assert world_info_from_env() == WorldInfo(5, 8, 1, 4, from_env=True)


@pytest.mark.parametrize(
    "values",
    [
        # Rank 1 of 2 with one GPU per node has local rank 0, not 1.
        {"RANK": 1, "WORLD_SIZE": 2},
        # Rank 5 on the second of two 4-GPU nodes has local rank 1.
        {"RANK": 5, "WORLD_SIZE": 8, "LOCAL_WORLD_SIZE": 4},
        {"RANK": 1, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2},
    ],
)
def test_missing_local_rank_on_a_job_that_may_span_nodes_is_refused(env, values):
    env(**values)
    with pytest.raises(ValueError, match=r"LOCAL_RANK is not set.*RANK=\d.*WORLD_SIZE=\d.*set LOCAL_RANK"):
        world_info_from_env()


@pytest.mark.parametrize(
    ("values", "local_rank"),
    [
        ({"RANK": 0, "WORLD_SIZE": 1}, 0),
        ({"RANK": 2, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 4}, 2),
    ],
)
def test_missing_local_rank_is_the_rank_when_every_worker_is_on_this_node(env, values, local_rank):
    env(**values)
    assert world_info_from_env().local_rank == local_rank


def test_local_rank_outside_the_local_world_is_refused(env):
    env(RANK=3, WORLD_SIZE=4, LOCAL_RANK=2, LOCAL_WORLD_SIZE=2)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 must be in \[0, LOCAL_WORLD_SIZE=2\)"):
        world_info_from_env()
