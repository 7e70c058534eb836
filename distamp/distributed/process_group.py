"""Reading the launcher's environment and setting up the process group.

``distrun`` and ``torchrun`` describe the job with the variables RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. A
script started without them (plain ``python train.py``) is a one-process
world: a process group of one rank on an in-memory store.
"""

from __future__ import annotations

import atexit
import ipaddress
import math
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distamp.distributed.comm_threads import check_gloo_workers_found, wait_for_comm_threads
from distamp.distributed.store_exchange import StoreExchange

__all__ = [
    "DEFAULT_TIMEOUT",
    "SELECTED_GPUS_VAR",
    "WorldInfo",
    "default_backend",
    "default_device",
    "init_process_group",
    "select_device",
    "validate_timeout",
    "world_info_from_env",
    "world_info_from_group",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long a collective or the store may wait, for NCCL and gloo alike.

torch's own defaults are 30 minutes for gloo but 10 for NCCL, whose
watchdog then aborts the job; a rank that writes a checkpoint or compiles a
model while the others wait in a collective can take longer than 10."""

SELECTED_GPUS_VAR = "DISTAMP_SELECTED_GPUS"
"""Set by ``distrun`` in every worker's environment (the ``--gpus`` it was given, or empty): a worker
started by distrun can tell so, e.g. to leave the rank prefix of log lines to distrun's console tee."""


@dataclass(frozen=True)
class WorldInfo:
    """Where this process sits in the job.

    Args:
        rank: global index of this worker, 0 <= rank < world_size.
        world_size: number of workers in the job.
        local_rank: index of this worker on its host (selects its GPU).
        local_world_size: number of workers on this host.
        from_env: True when the values came from a launcher's environment.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    from_env: bool = False


def _env_int(name: str, default: int | None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(
                f"environment variable {name} is not set, but RANK is; a launcher "
                "must set RANK, WORLD_SIZE and LOCAL_RANK together (use distrun or torchrun)"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; "
            "it must be set by distrun or torchrun"
        ) from None


def _local_rank(rank: int, world_size: int) -> int:
    """LOCAL_RANK, or RANK where that provably is the same GPU.

    The global rank is only a valid local rank when every worker is on this
    node: WORLD_SIZE is 1, or the launcher says LOCAL_WORLD_SIZE equals
    WORLD_SIZE. Anywhere else (rank 5 on the second 4-GPU node has local
    rank 1) guessing would put two workers on one GPU, so refuse.
    """
    if "LOCAL_RANK" in os.environ:
        return _env_int("LOCAL_RANK", None)
    local_world_size = os.environ.get("LOCAL_WORLD_SIZE")
    if world_size == 1 or local_world_size == str(world_size):
        return rank
    raise ValueError(
        f"LOCAL_RANK is not set (RANK={rank}, WORLD_SIZE={world_size}, "
        f"LOCAL_WORLD_SIZE={local_world_size if local_world_size is not None else 'not set'}), so the "
        "GPU of this worker is unknown on a job that may span several nodes. Start it with distrun "
        "or torchrun, or set LOCAL_RANK (this worker's index on its node); for a single-node job "
        "LOCAL_WORLD_SIZE=WORLD_SIZE also works"
    )


def world_info_from_env() -> WorldInfo:
    """Read this worker's place in the job from the launcher's environment.

    Returns a one-process :class:`WorldInfo` when RANK is not set.
    LOCAL_RANK selects the GPU; without it the job must be single-node
    (WORLD_SIZE 1, or LOCAL_WORLD_SIZE equal to WORLD_SIZE).
    Raises ``ValueError`` for a partial or inconsistent environment.
    """
    if "RANK" not in os.environ:
        return WorldInfo()
    rank = _env_int("RANK", None)
    world_size = _env_int("WORLD_SIZE", None)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size!r} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank!r} must be in [0, WORLD_SIZE={world_size})")
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    local_rank = _checked_local_rank(_local_rank(rank, world_size), local_world_size)
    return WorldInfo(rank, world_size, local_rank, local_world_size, from_env=True)


def _checked_local_rank(local_rank: int, local_world_size: int) -> int:
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank!r} must be in [0, LOCAL_WORLD_SIZE={local_world_size})")
    return local_rank


def world_info_from_group(timeout: timedelta = DEFAULT_TIMEOUT) -> WorldInfo:
    """This worker's place in a process group the user created (e.g. under ``mp.spawn``, no RANK set).

    Rank and world size come from the group. The local rank (which GPU is
    this worker's) is LOCAL_RANK when that is set; otherwise the ranks
    exchange their host names through the group's store (collective: every
    rank calls ``fleet.init``), and the local rank is this worker's index
    among the ranks on its host, in global-rank order, as torchrun numbers
    them. The store, not a collective, carries the names: an NCCL collective
    would need each rank's GPU, which is what is being worked out.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if "LOCAL_RANK" in os.environ:
        local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
        local_rank = _checked_local_rank(_env_int("LOCAL_RANK", None), local_world_size)
        return WorldInfo(rank, world_size, local_rank, local_world_size)
    exchange = StoreExchange("distamp.fleet", "fleet.init's host-name exchange", timeout,
                             hint="every rank of the group must call fleet.init()")
    hosts = exchange.all_gather(socket.gethostname())
    same_host = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    return WorldInfo(rank, world_size, same_host.index(rank), len(same_host))


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_device(local_rank: int = 0) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible; "
                "start at most that many workers per host (distrun --gpus ...) "
                "or check CUDA_VISIBLE_DEVICES"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def select_device(local_rank: int) -> torch.device:
    """:func:`default_device`, made CUDA's current device when it is a GPU; returns it.

    torch's NCCL paths that take no tensor use the current device: object
    collectives (``all_gather_object``, which ``dcp.save`` uses), ``barrier``,
    and each rank's CUDA generator saved in a checkpoint. torch leaves
    choosing it to the user ("it is the user's responsibility to ensure that
    this is set so that each rank has an individual GPU, via
    ``torch.cuda.set_device()``", ``all_gather_object``'s docstring); left
    at ``cuda:0``, every rank would use GPU 0 there.
    """
    device = default_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def validate_timeout(timeout: float | timedelta | None) -> timedelta:
    """``timeout`` (seconds or a ``timedelta``) as a ``timedelta``; ``None`` is :data:`DEFAULT_TIMEOUT`.

    Raises ``TypeError`` for another type and ``ValueError`` for a value
    that is not positive and finite.
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(
            f"timeout must be a number of seconds or a datetime.timedelta, got "
            f"{type(timeout).__name__} {timeout!r}; e.g. timeout=1800 or timedelta(minutes=30)"
        )
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"timeout={timeout!r} must be a positive, finite number of seconds (or timedelta); "
            f"the default is {DEFAULT_TIMEOUT.total_seconds():.0f} s"
        )
    try:
        return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"timeout={timeout!r} seconds is too large for a datetime.timedelta") from None


def init_process_group(world: WorldInfo, timeout: timedelta = DEFAULT_TIMEOUT) -> bool:
    """Initialise torch.distributed for ``world`` unless a group exists.

    With the launcher's variables, joins its job (the launcher's
    MASTER_ADDR/MASTER_PORT store). Without them, creates a one-process
    group on an in-memory store, so ``DistributedSampler``,
    ``dist.get_rank()`` and collectives work in a plain ``python train.py``.
    The backend is NCCL when CUDA is available, after selecting the CUDA
    device from LOCAL_RANK (so NCCL does not put every rank's context on
    GPU 0), and gloo otherwise. ``timeout`` bounds collectives and the
    store. Idempotent: an existing group is kept when it agrees with
    ``world``.

    Returns True when a process group exists afterwards (False only when
    this build of PyTorch has no torch.distributed and ``world`` is a
    single process).
    """
    if dist.is_available() and dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (world.rank, world.world_size) and world.from_env:
            raise RuntimeError(
                f"a process group already exists with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {world.rank} "
                f"of {world.world_size}"
            )
        return True
    if not dist.is_available():
        if not world.from_env:
            return False
        raise RuntimeError("this build of PyTorch has no torch.distributed support")
    if world.from_env:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise ValueError(
                    f"environment variable {name} is not set; start the job with distrun or torchrun"
                )
    device = select_device(world.local_rank)
    kwargs: dict[str, Any] = {"rank": world.rank, "world_size": world.world_size, "timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if not world.from_env:
        _init_one_process_group(timeout, kwargs)
        return True
    store = _loopback_store(world, timeout)
    rendezvous: dict[str, Any] = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(default_backend(), **rendezvous, **kwargs)
    _tear_down_at_exit(dist.group.WORLD)
    return True


def _init_one_process_group(timeout: timedelta, kwargs: dict[str, Any]) -> None:
    """A 1-rank group on an in-memory store, destroyed at exit.

    No port is opened for the store; gloo's and NCCL's own listeners go on
    the loopback interface unless the user chose one. Destroying the group
    at exit spares the user NCCL's "destroy_process_group() was not called"
    warning for a group they never created.
    """
    store = dist.HashStore()
    store.set_timeout(timeout)
    lo = _loopback_interface()
    chosen = {var: lo for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if lo and var not in os.environ}
    os.environ.update(chosen)
    try:
        dist.init_process_group(default_backend(), store=store, **kwargs)
    finally:
        for var in chosen:
            os.environ.pop(var, None)
    _tear_down_at_exit(dist.group.WORLD)


def _tear_down_at_exit(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group``, the one ``init`` created, when the interpreter exits (unless the user did).

    Fleet scripts, like Paddle's, never call ``destroy_process_group()``;
    without it NCCL's destructor warns "destroy_process_group() was not
    called before program exit" and aborts its communicators instead of
    flushing them. Registered right after the group is created, so a
    user's own exit handlers registered later still find it (atexit runs
    them last-in, first-out).
    """
    check_gloo_workers_found(group)
    atexit.register(_destroy_at_exit, group)


def _destroy_at_exit(group: dist.ProcessGroup | None) -> None:
    # gloo's threads first (GIL released): freeing the group joins them with the GIL held.
    wait_for_comm_threads()
    if not (dist.is_initialized() and dist.group.WORLD is group):
        return  # destroyed by the user already (and any group made since is theirs)
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        # An uncaught exception ends this rank; its peers may be gone or mid-collective, and
        # NCCL's shutdown flushes outstanding work where torch's destructor aborts it.
        return
    dist.destroy_process_group()


def _loopback_interface() -> str | None:
    """Name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), if any."""
    names = dict(socket.if_nameindex()).values() if hasattr(socket, "if_nameindex") else ()
    return next((name for name in names if name in ("lo", "lo0")), None)


def _loopback_store(world: WorldInfo, timeout: timedelta) -> dist.TCPStore | None:
    """The process-group store, listening on loopback only when MASTER_ADDR is loopback.

    torch's env:// store binds its server to every interface whatever
    MASTER_ADDR says; handing it a socket already bound to MASTER_ADDR keeps
    a single-node job off the network. ``None`` means: use env:// as usual.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None  # the agent hosts the store; workers are only clients
    try:
        if not ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        if host != "localhost":
            return None
        host = "127.0.0.1"
    if world.rank != 0:
        return dist.TCPStore(host, port, world.world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(
            f"rank 0 cannot listen on MASTER_ADDR:MASTER_PORT={host}:{port} for the process-group "
            f"store: {exc}. Choose a free MASTER_PORT (distrun picks one by default)"
        ) from exc
    return dist.TCPStore(host, port, world.world_size, True, timeout=timeout,
                         multi_tenant=True, master_listen_fd=sock.detach())
