"""launcher.nodes.resolve_nodes and its helpers, called directly on Namespaces (not through the parser)."""

from __future__ import annotations

import argparse
import re
import socket
from unittest import mock

import pytest

from distamp.launcher import nodes
from distamp.launcher.nodes import DEFAULT_MASTER_PORT, resolve_nodes
from distamp.launcher.usage import UsageError
from tests.multiprocess import free_port

LOCAL = {"127.0.0.1", "127.0.0.2"}
REAL_IS_THIS_HOST = nodes._is_this_host
REAL_PORT_IN_USE = nodes._port_in_use


@pytest.fixture(autouse=True)
def only_loopback_is_local():
    """Which addresses are "this host" is the test's choice, not the CI machine's (which may own TEST-NET ones),
    and the fixed ports below are free whatever else runs on it."""
    with mock.patch.object(nodes, "_is_this_host", side_effect=lambda host: host in LOCAL), \
            mock.patch.object(nodes, "_port_in_use", return_value=False):
        yield


@pytest.fixture
def real_host():
    with mock.patch.object(nodes, "_is_this_host", REAL_IS_THIS_HOST):
        yield


def ns(nnodes=None, node_rank=None, master=None, ips=None):
    return argparse.Namespace(nnodes=nnodes, node_rank=node_rank, master=master, ips=ips)


def test_local_job_defaults():
    assert resolve_nodes(ns()) == (1, 0, None, None)


def test_master_of_this_host_with_node_rank_0():
    assert resolve_nodes(ns(nnodes=2, master="127.0.0.1:1234")) == (2, 0, "127.0.0.1", 1234)


def test_other_node_does_not_need_to_be_the_master():
    assert resolve_nodes(ns(nnodes=3, node_rank=2, master="203.0.113.7:29501")) == (3, 2, "203.0.113.7", 29501)


def test_bracketed_ipv6_master():
    assert nodes._parse_master("[::1]:80") == ("::1", 80)


def test_nnodes_below_one():
    with pytest.raises(UsageError, match=r"^--nnodes 0 is invalid: it must be an integer >= 1\.$"):
        resolve_nodes(ns(nnodes=0))


def test_several_nodes_need_an_address():
    with pytest.raises(UsageError, match=r"^--nnodes 2 needs a rendezvous address: add --master HOST:PORT"):
        resolve_nodes(ns(nnodes=2))


@pytest.mark.parametrize(("node_rank", "nnodes"), [(2, 2), (-1, 2), (1, None)])
def test_node_rank_out_of_range(node_rank, nnodes):
    master = "127.0.0.1:29500" if nnodes else None
    n = nnodes or 1
    message = rf"^--node_rank {node_rank} is out of range: with {n} node\(s\) it must be from 0 to {n - 1}\.$"
    with pytest.raises(UsageError, match=message):
        resolve_nodes(ns(nnodes=nnodes, node_rank=node_rank, master=master))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10.0.0.1", r"^--master '10\.0\.0\.1' is malformed: expected HOST:PORT\. Use --master HOST:PORT"),
        (":29500", r"^--master ':29500' is malformed"),
        ("10.0.0.1:", r"^--master '10\.0\.0\.1:' is malformed"),
        ("h:0", r"^--master 'h:0' has port '0': it must be an integer from 1 to 65535\. "),
        ("h:65536", r"^--master 'h:65536' has port '65536'"),
        ("h:-1", r"^--master 'h:-1' has port '-1'"),
        ("h:x", r"^--master 'h:x' has port 'x'"),
        ("h:\u00b2", r"^--master 'h:\u00b2' has port '\u00b2'"),  # isdigit() but not int()
        ("h:\u0663", r"^--master 'h:\u0663' has port '\u0663'"),  # int() takes it; a port it is not
        ("bad host:1", (r"^--master 'bad host:1' has an invalid host 'bad host'\. Use --master HOST:PORT, "
                        r"e\.g\. --master 10\.0\.0\.1:29500\.$")),
        ("-h:1", r"^--master '-h:1' has an invalid host '-h'"),
    ],
)
def test_malformed_master(text, message):
    with pytest.raises(UsageError, match=message):
        nodes._parse_master(text)


def test_port_edges_are_accepted():
    assert nodes._parse_master("h:1") == ("h", 1)
    assert nodes._parse_master("h:65535") == ("h", 65535)


@pytest.mark.parametrize(
    ("host", "valid"),
    [("10.0.0.1", True), ("::1", True), ("node-1.example", True), ("a", True), ("a" * 253, True),
     ("a" * 254, False), ("-node", False), ("node.", False), ("", False), ("a b", False)],
)
def test_valid_host(host, valid):
    assert nodes._valid_host(host) is valid


def test_loopback_is_this_host_and_an_unresolvable_name_is_not(real_host):
    assert nodes._is_this_host("127.0.0.1")
    assert not nodes._is_this_host("no-such-host.invalid")


def test_ips_with_node_rank():
    assert resolve_nodes(ns(ips="203.0.113.1, 203.0.113.2", node_rank=1)) == (2, 1, "203.0.113.1", DEFAULT_MASTER_PORT)


def test_ips_finds_this_host():
    assert resolve_nodes(ns(ips="203.0.113.1,127.0.0.1")) == (2, 1, "203.0.113.1", 29500)


def test_ips_with_a_matching_master_takes_its_port():
    assert resolve_nodes(ns(ips="127.0.0.1,203.0.113.2", master="127.0.0.1:1234")) == (2, 0, "127.0.0.1", 1234)


A, B = "203.0.113.1", "203.0.113.2"  # TEST-NET-3
EA, EB = re.escape(A), re.escape(B)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ips": f"{A},bad host"}, (rf"^--ips '{EA},bad host' has an invalid host 'bad host': expected comma-"
                                    r"separated host names or addresses, e\.g\. --ips 10\.0\.0\.1,10\.0\.0\.2\.$")),
        ({"ips": f"{A},"}, rf"^--ips '{EA},' has an invalid host ''"),
        ({"ips": f"{A}, {A}"}, rf"^--ips '{EA}, {EA}' lists a host more than once\.$"),
        ({"ips": f"{A},{B}", "nnodes": 3},
         rf"^--nnodes 3 conflicts with --ips '{EA},{EB}', which names 2 node\(s\); drop --nnodes\.$"),
        ({"ips": f"{A},{B}", "master": f"{B}:1"},
         (rf"^--master '{EB}:1' conflicts with --ips '{EA},{EB}': the master is the first "
          rf"host of --ips \('{EA}'\)\.$")),
        ({"ips": f"{A},{B}", "node_rank": 2},
         r"^--node_rank 2 is out of range: with 2 node\(s\) it must be from 0 to 1\.$"),
    ],
)
def test_bad_ips(kwargs, message):
    with pytest.raises(UsageError, match=message):
        resolve_nodes(ns(**kwargs))


def test_ips_naming_no_address_of_this_host():
    message = (rf"^--ips '203\.0\.113\.1,203\.0\.113\.2': cannot tell which entry is this host "
               rf"\({re.escape(repr(socket.gethostname()))}\); none matched\. Pass --node_rank\.$")
    with pytest.raises(UsageError, match=message):
        resolve_nodes(ns(ips="203.0.113.1,203.0.113.2"))


def test_ips_naming_this_host_twice():
    message = r"several \(\['127\.0\.0\.1', '127\.0\.0\.2'\]\) matched\. Pass --node_rank\.$"
    with pytest.raises(UsageError, match=message):
        resolve_nodes(ns(ips="127.0.0.1,127.0.0.2"))


def test_master_that_does_not_resolve():
    message = (r"^--master 'no-such-host\.invalid:1': the master host 'no-such-host\.invalid' cannot be resolved "
               r"to an address; check the name or give an IP address\.$")
    with pytest.raises(UsageError, match=message):
        resolve_nodes(ns(nnodes=2, node_rank=1, master="no-such-host.invalid:1"))


def test_node_rank_0_must_be_the_master():
    message = (rf"^--master '{EA}:1': node rank 0 hosts the rendezvous, but the master '{EA}' is not "
               rf"an address of this host \({re.escape(repr(socket.gethostname()))}\)\. Run node rank 0 on "
               rf"'203\.0\.113\.1', or pass this node's --node_rank\.$")
    with pytest.raises(UsageError, match=message):
        resolve_nodes(ns(nnodes=2, master="203.0.113.1:1"))


def test_the_ips_form_is_named_in_master_host_errors():
    with pytest.raises(UsageError, match=r"^--ips '203\.0\.113\.1,127\.0\.0\.1': node rank 0 hosts the rendezvous"):
        resolve_nodes(ns(ips="203.0.113.1,127.0.0.1", node_rank=0))


def test_this_host_check_is_skipped_off_node_rank_0():
    with mock.patch.object(nodes, "_is_this_host", side_effect=AssertionError("called")):
        assert resolve_nodes(ns(nnodes=2, node_rank=1, master="203.0.113.1:5")) == (2, 1, "203.0.113.1", 5)


def test_real_loopback_master_on_node_rank_0(real_host):
    assert resolve_nodes(ns(nnodes=2, master="127.0.0.1:29500")) == (2, 0, "127.0.0.1", 29500)


def test_a_master_port_in_use_on_node_rank_0_is_refused(real_host):
    with mock.patch.object(nodes, "_port_in_use", REAL_PORT_IN_USE), \
            socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(UsageError, match=(
            rf"^--master '127\.0\.0\.1:{port}': port {port} is already in use on this host, and node rank 0 "
            rf"must listen there for the rendezvous .*Choose a free port: --master 127\.0\.0\.1:PORT on every node\.$"
        )):
            resolve_nodes(ns(nnodes=2, master=f"127.0.0.1:{port}"))
        # Only node rank 0 listens there; the others connect to it.
        assert resolve_nodes(ns(nnodes=2, node_rank=1, master=f"127.0.0.1:{port}")) == (2, 1, "127.0.0.1", port)
        assert not REAL_PORT_IN_USE("127.0.0.1", free_port())
