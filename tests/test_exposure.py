"""Exposure of a single-node ``distrun`` job: what listens on TCP, and where.

A real ``distrun --nproc_per_node 2`` job forms its gloo group, all-reduces
and then waits while the test lists the listening TCP sockets of distrun
and every process under it (``/proc/<pid>/fd`` socket inodes joined with
``/proc/<pid>/net/tcp`` and ``tcp6``).

With torch 2.13, a ``TCPStore`` server binds to every interface
(``0.0.0.0``/``::``) whatever host it is given. distamp keeps both of a
single-node job's stores off the network: distrun's c10d rendezvous uses a
file store (no port at all), and ``fleet.init`` hands rank 0's
process-group store a socket already bound to the loopback MASTER_ADDR
(``master_listen_fd``). gloo's mesh listeners are on 127.0.0.1 because
distrun sets ``GLOO_SOCKET_IFNAME=lo`` for single-node jobs.

So the test asserts that nothing listens beyond loopback, and that every
worker does have a loopback listener (so the inspection sees its sockets).
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.processes import descendants

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch, torch.distributed as dist
    from distamp import fleet

    fleet.init()
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == dist.get_world_size()
    out = sys.argv[1]
    info = {"pid": os.getpid(), "rank": dist.get_rank(),
            "master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])]}
    with open(os.path.join(out, f"ready.{dist.get_rank()}.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(out, f"ready.{dist.get_rank()}.tmp"), os.path.join(out, f"ready.{dist.get_rank()}"))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    """
)


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order.
    fixed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(fixed))


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets ``pid`` holds in LISTEN state."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                addr, port = local.split(":")
                found.append((_address(addr), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def is_wildcard(address: str) -> bool:
    return ipaddress.ip_address(address).is_unspecified


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_single_node_job_listens_only_on_loopback_except_torchs_stores(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "distamp.launcher", "--nproc_per_node", "2", "--tee", "none",
         "--log_dir", str(tmp_path / "log"), "worker.py", str(tmp_path)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
            if proc.poll() is not None or time.monotonic() > deadline:
                _, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
                logs = {p.name: p.read_text() for p in (tmp_path / "log").glob("workerlog.*")}
                pytest.fail(f"workers never got ready (exit {proc.poll()}):\n{err}\n{logs}")
            time.sleep(0.1)
        ranks = {r: json.loads((tmp_path / f"ready.{r}").read_text()) for r in range(2)}
        listeners = {pid: listening_sockets(pid) for pid in descendants(proc.pid)}
    finally:
        (tmp_path / "release").write_text("")
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"distrun did not finish after the release:\n{err}")
    assert proc.returncode == 0, err

    table = "\n".join(f"pid {pid}: {socks}" for pid, socks in listeners.items() if socks)
    worker_pids = {info["pid"]: r for r, info in ranks.items()}
    assert set(worker_pids) <= set(listeners), (worker_pids, table)
    for pid, socks in listeners.items():
        specific = [s for s in socks if not is_loopback(s[0]) and not is_wildcard(s[0])]
        assert not specific, f"pid {pid} listens on a non-loopback address: {specific}\n{table}"
        wildcard = [s for s in socks if is_wildcard(s[0])]
        assert not wildcard, f"pid {pid} (rank {worker_pids.get(pid)}) listens on all interfaces\n{table}"
    for pid, rank in worker_pids.items():
        # gloo's mesh listener: proves the inspection sees the workers' sockets at all
        assert any(is_loopback(a) for a, _ in listeners[pid]), f"rank {rank}: no loopback listener\n{table}"
