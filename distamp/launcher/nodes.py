"""``--nnodes``, ``--node_rank``, ``--master`` and ``--ips``: the nodes of a job and its rendezvous address."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import re
import socket

from distamp.launcher.usage import UsageError, at_least

__all__ = ["DEFAULT_MASTER_PORT", "resolve_nodes"]

#: Port used with ``--ips`` when ``--master`` is not given (torchrun's default).
DEFAULT_MASTER_PORT = 29500

_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def resolve_nodes(args: argparse.Namespace) -> tuple[int, int, str | None, int | None]:
    """(nnodes, node_rank, master host, master port); host and port are ``None`` for a local job."""
    host: str | None
    port: int | None
    if args.ips is not None:
        nnodes, node_rank, host, port = _resolve_ips(args)
    else:
        nnodes = at_least("--nnodes", args.nnodes if args.nnodes is not None else 1, 1)
        node_rank = args.node_rank if args.node_rank is not None else 0
        host, port = _parse_master(args.master) if args.master is not None else (None, None)
        if nnodes > 1 and host is None:
            raise UsageError(
                f"--nnodes {nnodes!r} needs a rendezvous address: add "
                f"--master HOST:PORT (the host of node rank 0) or --ips h1,h2,..."
            )
    if not 0 <= node_rank < nnodes:
        raise UsageError(
            f"--node_rank {node_rank!r} is out of range: with {nnodes} node(s) it "
            f"must be from 0 to {nnodes - 1}."
        )
    if host is not None:
        given = f"--ips {args.ips!r}" if args.ips is not None else f"--master {args.master!r}"
        _check_master_host(given, host, node_rank)
        if node_rank == 0 and port is not None and _port_in_use(host, port):
            raise UsageError(
                f"{given}: port {port} is already in use on this host, and node rank 0 must listen "
                f"there for the rendezvous (another job, or one that has not exited yet, may hold "
                f"it). Choose a free port: --master {host}:PORT on every node."
            )
    return nnodes, node_rank, host, port


def _resolve_ips(args: argparse.Namespace) -> tuple[int, int, str, int]:
    """``--ips`` to (nnodes, node_rank, master host, master port)."""
    ips = [h.strip() for h in args.ips.split(",")]
    bad = [h for h in ips if not _valid_host(h)]
    if bad:
        raise UsageError(
            f"--ips {args.ips!r} has an invalid host {bad[0]!r}: expected "
            f"comma-separated host names or addresses, e.g. --ips 10.0.0.1,10.0.0.2."
        )
    if len(set(ips)) != len(ips):
        raise UsageError(f"--ips {args.ips!r} lists a host more than once.")
    if args.nnodes is not None and args.nnodes != len(ips):
        raise UsageError(
            f"--nnodes {args.nnodes!r} conflicts with --ips {args.ips!r}, which "
            f"names {len(ips)} node(s); drop --nnodes."
        )
    host, port = ips[0], DEFAULT_MASTER_PORT
    if args.master is not None:
        host, port = _parse_master(args.master)
        if host != ips[0]:
            raise UsageError(
                f"--master {args.master!r} conflicts with --ips {args.ips!r}: "
                f"the master is the first host of --ips ({ips[0]!r})."
            )
    if args.node_rank is not None:
        node_rank = args.node_rank
    else:
        mine = [i for i, h in enumerate(ips) if _is_this_host(h)]
        if len(mine) != 1:
            found = "none" if not mine else f"several ({[ips[i] for i in mine]})"
            raise UsageError(
                f"--ips {args.ips!r}: cannot tell which entry is this host "
                f"({socket.gethostname()!r}); {found} matched. Pass --node_rank."
            )
        node_rank = mine[0]
    return len(ips), node_rank, host, port


def _check_master_host(given: str, host: str, node_rank: int) -> None:
    """The master must resolve, and node rank 0 (which hosts the store) must be it."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise UsageError(
            f"{given}: the master host {host!r} cannot be resolved to an address; "
            f"check the name or give an IP address."
        ) from None
    if node_rank == 0 and not _is_this_host(host):
        raise UsageError(
            f"{given}: node rank 0 hosts the rendezvous, but the master {host!r} is "
            f"not an address of this host ({socket.gethostname()!r}). Run node rank 0 "
            f"on {host!r}, or pass this node's --node_rank."
        )


def _port_in_use(host: str, port: int) -> bool:
    """True when something already listens on ``port`` of this host.

    Torch's rendezvous store listens on every interface whatever host it
    is given, so the wildcard address is tried; ``SO_REUSEADDR`` (which the
    store sets too) keeps a port that a finished job left in TIME_WAIT
    usable. Binding without listening opens nothing.
    """
    family, wildcard = (socket.AF_INET6, "::") if ":" in host else (socket.AF_INET, "0.0.0.0")
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((wildcard, port))
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False


def _parse_master(text: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    fix = "Use --master HOST:PORT, e.g. --master 10.0.0.1:29500."
    if not sep or not host or not port_text:
        raise UsageError(f"--master {text!r} is malformed: expected HOST:PORT. {fix}")
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise UsageError(
            f"--master {text!r} has port {port_text!r}: it must be an integer "
            f"from 1 to 65535. {fix}"
        )
    if not _valid_host(host):
        raise UsageError(f"--master {text!r} has an invalid host {host!r}. {fix}")
    return host, int(port_text)


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(_HOST_NAME.match(host)) and len(host) <= 253
    else:
        return True


def _is_this_host(host: str) -> bool:
    """True when ``host`` names an address of this machine.

    Binding a socket (without listening) succeeds only for local addresses,
    which avoids listing interfaces.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError:
            continue
        else:
            return True
    return False
