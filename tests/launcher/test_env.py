"""The environment distrun gives every worker on a node."""

from __future__ import annotations

import json
import os

from distamp.launcher import _bootstrap
from distamp.launcher.env import build_worker_env, patched_environ
from distamp.launcher.plan import LaunchPlan


def plan(**kw):
    return LaunchPlan(command=("train.py", "--lr", "$x"), nproc_per_node=kw.pop("nproc", 2), **kw)


def test_gpus_are_what_workers_see():
    env = build_worker_env(plan(gpus=("6", "4")), {"CUDA_VISIBLE_DEVICES": "4,5,6"}, 123).variables
    assert env["CUDA_VISIBLE_DEVICES"] == "6,4"
    assert env["DISTAMP_SELECTED_GPUS"] == "6,4"
    cpu = build_worker_env(plan(), {"CUDA_VISIBLE_DEVICES": "1"}, 123).variables
    assert "CUDA_VISIBLE_DEVICES" not in cpu
    assert cpu["DISTAMP_SELECTED_GPUS"] == ""


def test_fixed_variables_and_bootstrap_inputs():
    env = build_worker_env(plan(log_dir="out"), {}, 123).variables
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert json.loads(env[_bootstrap.COMMAND_VAR]) == ["train.py", "--lr", "$x"]
    assert env[_bootstrap.LOG_DIR_VAR] == os.path.abspath("out")
    assert env[_bootstrap.LAUNCHER_PID_VAR] == "123"


def test_omp_threads_split_the_cores_unless_set():
    cores = len(os.sched_getaffinity(0))
    built = build_worker_env(plan(nproc=2), {}, 1)
    assert built.variables["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert len(built.notes) == 1
    assert "set OMP_NUM_THREADS to override" in built.notes[0]
    built = build_worker_env(plan(nproc=4 * cores), {}, 1)
    assert built.variables["OMP_NUM_THREADS"] == "1"
    built = build_worker_env(plan(), {"OMP_NUM_THREADS": "7"}, 1)
    assert "OMP_NUM_THREADS" not in built.variables
    assert built.notes == []


def test_collective_sockets_stay_on_loopback_for_one_node():
    local = build_worker_env(plan(), {}, 1).variables
    assert local["GLOO_SOCKET_IFNAME"] == "lo"
    assert local["NCCL_SOCKET_IFNAME"] == "lo"
    user = build_worker_env(plan(), {"GLOO_SOCKET_IFNAME": "eth1"}, 1).variables
    assert "GLOO_SOCKET_IFNAME" not in user
    multi = build_worker_env(plan(nnodes=2, master_addr="10.0.0.1", master_port=29500), {}, 1).variables
    assert "GLOO_SOCKET_IFNAME" not in multi
    assert "NCCL_SOCKET_IFNAME" not in multi


def test_patched_environ_restores_exactly():
    environ = {"KEEP": "1", "CHANGE": "old"}
    with patched_environ({"CHANGE": "new", "ADD": "x"}, environ):
        assert environ == {"KEEP": "1", "CHANGE": "new", "ADD": "x"}
    assert environ == {"KEEP": "1", "CHANGE": "old"}
