"""The environment every worker of a launch inherits.

The elastic agent adds the per-worker part of the torch contract (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT). This module computes what is the same for every
worker on the node; :func:`distamp.launcher.run.launch` applies it to the
launcher's own environment for the duration of the launch, which the
workers inherit.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager

from distamp.distributed.process_group import SELECTED_GPUS_VAR
from distamp.launcher import _bootstrap
from distamp.launcher.plan import LaunchPlan, available_cpus

__all__ = ["WorkerEnv", "build_worker_env", "patched_environ"]


class WorkerEnv:
    """Variables to set for a launch, and one-line notes to show the user."""

    def __init__(self) -> None:
        self.variables: dict[str, str] = {}
        self.notes: list[str] = []


def _loopback_interface() -> str | None:
    """Name of the interface holding 127.0.0.1 (``lo`` on Linux), if any."""
    names = dict(socket.if_nameindex()) if hasattr(socket, "if_nameindex") else {}
    for name in names.values():
        if name in ("lo", "lo0"):
            return name
    return None


def build_worker_env(plan: LaunchPlan, environ: Mapping[str, str], launcher_pid: int) -> WorkerEnv:
    """What every worker of ``plan`` on this node gets on top of ``environ``.

    Args:
        plan: the validated launch.
        environ: the launcher's environment (user settings win where noted).
        launcher_pid: pid of the process that will start the workers; the
            bootstrap uses it to notice a launcher that died before it armed
            its death signal.
    """
    env = WorkerEnv()
    v = env.variables
    v["PYTHONUNBUFFERED"] = "1"
    # Each restart builds its process group on a fresh store. With the shared
    # rendezvous store, restarted gloo groups failed in connectFullMesh or hung
    # (3 of 4 restarts after a SIGKILL; 4 of 4 resumed with this set). The agent
    # reads this too: it must be set in the launcher's own environment, not only
    # passed to workers.
    v["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    v[SELECTED_GPUS_VAR] = ",".join(plan.gpus) if plan.gpus is not None else ""
    if plan.gpus is not None:
        # Workers see exactly the selected devices, so cuda:LOCAL_RANK is theirs.
        v["CUDA_VISIBLE_DEVICES"] = ",".join(plan.gpus)
    if "OMP_NUM_THREADS" not in environ:
        cores = available_cpus()
        threads = max(1, cores // plan.nproc_per_node)
        v["OMP_NUM_THREADS"] = str(threads)
        env.notes.append(
            f"OMP_NUM_THREADS={threads} for each worker ({cores} cores / "
            f"{plan.nproc_per_node} workers); set OMP_NUM_THREADS to override."
        )
    if plan.local_rendezvous:
        # Keep gloo/NCCL's own sockets on loopback for a one-node job, whatever
        # the host name resolves to.
        lo = _loopback_interface()
        if lo is not None:
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if var not in environ:
                    v[var] = lo
    v[_bootstrap.COMMAND_VAR] = json.dumps(list(plan.command))
    v[_bootstrap.LOG_DIR_VAR] = os.path.abspath(plan.log_dir)
    v[_bootstrap.LAUNCHER_PID_VAR] = str(launcher_pid)
    return env


@contextmanager
def patched_environ(
    variables: Mapping[str, str], environ: MutableMapping[str, str] = os.environ
) -> Iterator[None]:
    """Set ``variables`` in ``environ`` for the block, then restore it exactly."""
    saved = {k: environ.get(k) for k in variables}
    environ.update(variables)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                environ.pop(key, None)
            else:
                environ[key] = old
