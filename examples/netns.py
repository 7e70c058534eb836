"""Two network namespaces joined by a rate-limited veth pair: a two-host cluster on one box.

Used by ``benchmark.py --link_gbit``. Each namespace gets its own address,
its own hostname (the workers run under ``unshare --uts``) and a hosts file
naming both, because torch's rendezvous needs the two sides to look like two
real hosts (without it torchrun's c10d rendezvous timed out across them). Needs root and iproute2.

    with LinkedNamespaces(rate_gbit=1.0) as link:
        procs = [link.popen(i, ["python", "worker.py"], env) for i in range(2)]
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Self

__all__ = ["LinkedNamespaces", "why_unavailable"]


def why_unavailable() -> str | None:
    """``None`` when namespaces can be made here, else the reason they cannot."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()}); rerun with sudo"
    missing = [tool for tool in ("ip", "tc", "unshare", "hostname") if shutil.which(tool) is None]
    if missing:
        return f"missing tools {missing!r}: install iproute2 and util-linux"
    return None


def _remove(name: str) -> None:
    """Delete namespace ``name`` (and with it its end of the veth pair) and its hosts file."""
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)!r} failed ({done.returncode}): {done.stderr.strip()}")


class LinkedNamespaces:
    """Namespaces ``<prefix>0`` and ``<prefix>1`` on 10.77.<n>.1/.2, the link shaped by ``tbf``.

    Args:
        rate_gbit: link rate in Gbit/s, applied to both directions.
        subnet: third octet of the 10.77.x.0/24 network (change it to run two at once).

    Everything is removed on ``__exit__`` (also after an exception or
    Ctrl-C); ``close()`` is idempotent and may be called from a signal handler.
    """

    def __init__(self, rate_gbit: float = 1.0, subnet: int = 0) -> None:
        if not rate_gbit > 0:
            raise ValueError(f"rate_gbit must be > 0, got {rate_gbit!r}")
        if not 0 <= subnet <= 255:
            raise ValueError(f"subnet must be in 0..255, got {subnet!r}")
        self.rate_gbit = rate_gbit
        self.names = self.names_for(os.getpid())
        self.addresses = (f"10.77.{subnet}.1", f"10.77.{subnet}.2")
        self._created: list[str] = []

    @staticmethod
    def names_for(pid: int) -> tuple[str, str]:
        """The namespaces a ``LinkedNamespaces`` made in process ``pid`` is named."""
        tag = f"{pid % 100000}"
        return (f"dampa{tag}", f"dampb{tag}")  # interface names are capped at 15 chars

    @classmethod
    def remove_leftovers(cls, pid: int) -> None:
        """Remove what process ``pid`` created and could not remove (it was killed).

        For a supervisor (a test) whose child was stopped with SIGKILL, which
        skips ``close()``. Stop the processes running in the namespaces first.
        """
        for name in cls.names_for(pid):
            _remove(name)

    def hostname(self, i: int) -> str:
        """Hostname of namespace ``i`` (resolvable inside both namespaces)."""
        return f"{self.names[i]}-host"

    def open(self) -> LinkedNamespaces:
        """Create both namespaces, the veth pair, addresses, hosts files and the shaping."""
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.addresses[i]} {self.hostname(i)}\n" for i in range(2))
        veth = [f"{name}v" for name in self.names]
        for name in self.names:
            _run("ip", "netns", "add", name)
            self._created.append(name)
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)  # bound over /etc/hosts by `ip netns exec`
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write(hosts)
        _run("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        rate = f"{self.rate_gbit * 1000:g}mbit"
        for i, name in enumerate(self.names):
            _run("ip", "link", "set", veth[i], "netns", name)
            _run("ip", "-n", name, "addr", "add", f"{self.addresses[i]}/24", "dev", veth[i])
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", name, "link", "set", veth[i], "up")
            # burst must exceed the largest (GSO) packet veth hands to the qdisc, or tbf drops it.
            _run("tc", "-n", name, "qdisc", "add", "dev", veth[i], "root", "tbf",
                 "rate", rate, "burst", "512kb", "latency", "50ms")
        return self

    def popen(self, i: int, cmd: Sequence[str], env: Mapping[str, str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside namespace ``i`` with its own UTS namespace and hostname."""
        wrapped = ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
                   'hostname "$0" && exec "$@"', self.hostname(i), *cmd]
        return subprocess.Popen(wrapped, env=dict(env), **kwargs)

    def close(self) -> None:
        """Delete the namespaces (which deletes the veth pair) and their hosts files."""
        while self._created:
            _remove(self._created.pop())

    def __enter__(self) -> Self:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
