"""Start a validated :class:`LaunchPlan` with torch's elastic agent.

The agent (``torch.distributed.launcher.api.elastic_launch``) does the
process management: rendezvous, start, monitor, fail the group together
(SIGTERM, then SIGKILL after the grace period), restart up to
``max_restarts`` times, and stop everything on SIGINT/SIGTERM/SIGHUP/SIGQUIT.
This module chooses the rendezvous, wires in :class:`RankLogs` and a
:class:`~distamp.launcher.reaper.Reaper` (so nothing a worker started
outlives the job), and turns the outcome into an exit code and a report a
user can act on.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Mapping
from typing import TextIO, TypedDict

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.multiprocessing import ProcessFailure, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from distamp.launcher import _bootstrap
from distamp.launcher.env import build_worker_env, patched_environ
from distamp.launcher.logs import LogDirInUseError, RankLogs, claim_log_dir, log_path, say, tail_lines
from distamp.launcher.plan import LaunchPlan
from distamp.launcher.reaper import Reaper
from distamp.launcher.stop_signals import ignore_stop_signals, stop_signals_raise
from distamp.suggest import listed
from distamp.torch_compat import launch_config_shutdown_timeout

__all__ = ["describe_failure", "exit_code_of", "launch", "launch_config"]

TAIL_LINES = 20
_RENDEZVOUS_TIMEOUT = 900  # seconds the nodes wait for each other (torch's default)
_LEFTOVERS_SHOWN = 5
# Seconds a stop signal waits, once this node's workers have all exited, for
# the agent to return before distrun counts it as blocked in the exit barrier.
_BARRIER_GRACE = 5.0


class _CommonLaunchArgs(TypedDict):
    """The ``LaunchConfig`` arguments every rendezvous kind shares."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: RankLogs
    max_restarts: int
    monitor_interval: float
    start_method: str


def launch_config(plan: LaunchPlan, logs: RankLogs, store_dir: str) -> LaunchConfig:
    """The torch ``LaunchConfig`` for ``plan``.

    - One node without ``--master``: c10d rendezvous on a file store in
      ``store_dir``, and MASTER_ADDR is loopback. A TCPStore would listen on
      every interface whatever address it is given (tests/test_exposure.py);
      a file store opens no port at all, so it has no port race either.
    - Several nodes, no restarts: static rendezvous at ``--master``; node
      rank ``--node_rank`` hosts the store, so node ranks are the user's.
    - Several nodes with ``--max_restarts``: c10d rendezvous at ``--master``
      (hosted by node rank 0). Torch's static rendezvous cannot restart a
      multi-node group (its restarted workers hang in process-group set-up);
      c10d makes every node restart together, but orders nodes itself.
    """
    common: _CommonLaunchArgs = {
        "min_nodes": plan.nnodes,
        "max_nodes": plan.nnodes,
        "nproc_per_node": plan.nproc_per_node,
        "logs_specs": logs,
        "max_restarts": plan.max_restarts,
        "monitor_interval": 0.1,
        "start_method": "spawn",
    }
    master = plan.master_addr
    if master is None:  # plan.local_rendezvous
        return LaunchConfig(
            run_id=f"distrun-{uuid.uuid4().hex}",
            rdzv_backend="c10d",
            rdzv_endpoint=os.path.join(store_dir, "rendezvous"),
            rdzv_configs={"timeout": _RENDEZVOUS_TIMEOUT, "store_type": "file"},
            local_addr="127.0.0.1",
            **common,
            **launch_config_shutdown_timeout(plan.grace_period),
        )
    endpoint = f"[{master}]:{plan.master_port}" if ":" in master else f"{master}:{plan.master_port}"
    if plan.max_restarts == 0:
        return LaunchConfig(
            run_id="distrun",
            rdzv_backend="static",
            rdzv_endpoint=endpoint,
            rdzv_configs={"rank": plan.node_rank, "timeout": _RENDEZVOUS_TIMEOUT},
            **common,
            **launch_config_shutdown_timeout(plan.grace_period),
        )
    return LaunchConfig(
        run_id="distrun",
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": plan.node_rank == 0, "timeout": _RENDEZVOUS_TIMEOUT},
        local_addr=_address_towards(master, plan.node_rank),
        **common,
        **launch_config_shutdown_timeout(plan.grace_period),
    )


def _address_towards(master: str, node_rank: int) -> str:
    """This node's address as the other nodes should use it for MASTER_ADDR.

    Node rank 0 is the master, which every node can reach by that name. Any
    other node uses the local address of its route to the master (a UDP
    ``connect`` picks the route without sending anything), which avoids
    relying on this host's name resolving on the other nodes.
    """
    if node_rank == 0:
        return master
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.getfqdn()


def exit_code_of(failure: ProcessFailure) -> int:
    """The shell-style exit code of a failed worker (128 + signal number)."""
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode


# Text in a log tail that shows a worker failed because a peer died first.
_PEER_FAILURE_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker",
    "Broken pipe",
    "NCCL communicator was aborted",
)


def _first_failure(
    plan: LaunchPlan, error: ChildFailedError, exits: Mapping[int, float]
) -> tuple[int, ProcessFailure]:
    """The root-cause failure among the workers the agent saw fail.

    What a failure shows about itself decides first, when it happened second
    (see :func:`_evidence`): a worker that failed on its own comes before one
    the agent stopped (SIGTERM), which comes before one whose log reports a
    lost peer. A worker whose failure starts with closing its connections
    (``destroy_process_group()`` in a ``finally``) and that is slow to exit
    makes its peer fail and exit first; the agent then stops it, so neither
    the exit order nor the agent's stamps point at it.

    Within a class the earliest exit wins: the guardian's stamp in ``exits``,
    else the agent's, which is truncated to the second; then the order in
    which the agent recorded them.
    """
    peer_is_local = plan.nnodes == 1 and not exits.keys() - error.failures.keys()
    items = list(error.failures.items())

    def key(indexed: tuple[int, tuple[int, ProcessFailure]]) -> tuple[int, float, int]:
        index, (rank, failure) = indexed
        evidence = _evidence(plan, rank, failure, peer_is_local)
        return (evidence, exits.get(rank, float(failure.timestamp)), index)

    return min(enumerate(items), key=key)[1]


def _evidence(plan: LaunchPlan, rank: int, failure: ProcessFailure, peer_is_local: bool) -> int:
    """How likely ``rank``'s failure is a consequence of another's: 0 (its own) to 2.

    2 when its log tail reports a lost peer; 1 when the agent stopped it
    (SIGTERM), a bystander or a worker still exiting from its own failure.
    A lost peer outranks a stop only when the peer must be a failed worker
    here (``peer_is_local``: one node, and no worker here exited 0); a peer
    on another node, or one that left early, makes the stopped workers
    bystanders, and then the two tie.
    """
    tail = "\n".join(tail_lines(log_path(plan.log_dir, rank), TAIL_LINES))
    if any(sign in tail for sign in _PEER_FAILURE_SIGNS):
        return 2 if peer_is_local else 1
    return 1 if failure.exitcode == -int(signal.SIGTERM) else 0


def _how(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"was killed by {name} (signal {-failure.exitcode})"
    return f"exited with code {failure.exitcode}"


def _early_exit(
    error: ChildFailedError, exits: Mapping[int, float], failing: int, failure: ProcessFailure
) -> tuple[int, float] | None:
    """The first rank on this node that exited 0 before the root-cause failure.

    The agent treats an exit 0 as success and reports failures only, but a
    rank that leaves early (fewer steps, a ``break``) makes its peers fail
    in their next collective: that exit is the cause to report. ``exits``
    are the guardians' stamps; a failure without one falls back to the
    agent's stamp, which is truncated to the second and so never later.
    """
    fail_time = exits.get(failing, float(failure.timestamp))
    successes = [(t, r) for r, t in exits.items() if r not in error.failures and t < fail_time]
    return (min(successes)[1], min(successes)[0]) if successes else None


def _ranks_phrase(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} was"
    if len(ranks) <= 4:
        return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]} were"
    return f"{len(ranks)} other ranks were"


def describe_failure(
    plan: LaunchPlan,
    error: ChildFailedError,
    exits: Mapping[int, float] | None = None,
    started_at: float | None = None,
) -> tuple[int, str]:
    """Exit code and report for a job whose workers failed.

    The report ends with the log tail and then a summary line naming the
    root cause and its log file: the first failing rank, or, when a rank on
    this node exited 0 while the others were still running and they failed
    after it, that rank's early exit ("rank 1 exited 0 at 12.3 s while rank
    0 was still running; rank 0 then failed: ...").

    Args:
        plan: the launch.
        error: what the agent raised.
        exits: ``time.time()`` of each local worker's exit by global rank
            (from the bootstrap's guardians), when known.
        started_at: ``time.time()`` when the workers were started.
    """
    exits = exits or {}
    rank, failure = _first_failure(plan, error, exits)
    path = log_path(plan.log_dir, rank)
    code = exit_code_of(failure)
    early = _early_exit(error, exits, rank, failure)
    others = [
        f"rank {r} {_how(f)}"
        for r, f in sorted(error.failures.items())
        if r != rank and f.exitcode != -int(signal.SIGTERM)
    ]
    lines = [f"distrun: ----- last {TAIL_LINES} lines of {path} (rank {rank}) -----"]
    lines += [f"  {line}" for line in tail_lines(path, TAIL_LINES)]
    lines.append(f"distrun: ----- end of {path} -----")
    if others:
        lines.append(f"distrun: also failed: {'; '.join(others)}.")
    restarts = (
        f" after {plan.max_restarts} restart(s) (--max_restarts {plan.max_restarts})"
        if plan.max_restarts
        else ""
    )
    failed = (
        f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) "
        f"{_how(failure)}{restarts}; full log: {path}."
    )
    if early is None:
        lines.append(
            f"distrun: {failed} The other workers were stopped; exiting with code {code}."
        )
        return code, "\n".join(lines)
    first, when = early
    running = sorted(r for r in error.failures.keys() | exits.keys() if exits.get(r, when + 1) > when)
    at = f" at {when - started_at:.1f} s" if started_at else ""
    lines.append(
        f"distrun: rank {first} exited 0{at} while {_ranks_phrase(running)} still running; "
        f"rank {rank} then failed: {failed} A rank that exits 0 while others still run "
        f"usually skipped collectives they wait for (fewer steps or batches, an early "
        f"break); see {log_path(plan.log_dir, first)}. The other workers were stopped; "
        f"exiting with code {code}."
    )
    return code, "\n".join(lines)


def _summary(plan: LaunchPlan) -> str:
    where = (
        "127.0.0.1 (a free port)"
        if plan.local_rendezvous
        else f"{plan.master_addr}:{plan.master_port}, node rank {plan.node_rank} of {plan.nnodes}"
    )
    gpus = f", GPUs {','.join(plan.gpus)}" if plan.gpus is not None else ""
    if not plan.local_rendezvous and plan.max_restarts:
        where += (
            " (c10d, so all nodes restart together; the rendezvous orders the nodes, "
            "so global ranks may not follow --node_rank)"
        )
    tee = "all" if plan.tee is None else ",".join(map(str, sorted(plan.tee))) or "none"
    world = (f"world size {plan.world_size}" if plan.world_size is not None
             else "world size from the rendezvous")
    return (
        f"distrun: {plan.nproc_per_node} worker(s) on this node, {world}{gpus}; rendezvous {where}; "
        f"logs {plan.log_dir}/workerlog.N; console shows rank(s) {tee}."
    )


def _rendezvous_result(plan: LaunchPlan, world_size: int, ranks: tuple[int, ...]) -> list[str]:
    """What distrun says once a several-node rendezvous has set the world size."""
    lines = [f"distrun: world size {world_size}; this node runs rank(s) {','.join(map(str, ranks))}."]
    missing = sorted(r for r in plan.tee or () if r >= world_size)
    if missing:
        lines.append(f"distrun: --tee names rank {missing[0]}, but the world size is {world_size} "
                     f"(ranks 0 to {world_size - 1}); no worker has that rank.")
    return lines


def _leftovers_note(killed: list[str]) -> str:
    return (
        f"distrun: killed {len(killed)} process(es) that the workers had started and left "
        f"running: {listed(killed, _LEFTOVERS_SHOWN)}."
    )


def launch(plan: LaunchPlan, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``plan`` to completion and return distrun's exit code.

    0 when every worker succeeded; the first failing worker's code (128 +
    signal number for a signal) when they failed; 128 + signal number when
    distrun itself was interrupted; 1 when the rendezvous failed; 2, with
    nothing started, when ``--log_dir`` cannot be created or a live job on
    this node rank writes there. Whatever
    the outcome, every process the workers started is gone when it returns
    (SIGKILL for what the agent did not already stop), and between restarts
    nothing of the previous attempt is left running.
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        os.makedirs(plan.log_dir, exist_ok=True)
    except OSError as exc:
        say(err, f"distrun: error: --log_dir {plan.log_dir!r} cannot be created: {exc}")
        return 2
    try:
        with claim_log_dir(plan.log_dir, plan.node_rank):
            return _launch_claimed(plan, out, err)
    except LogDirInUseError as exc:
        say(err, f"distrun: error: {exc}")
        return 2


def _launch_claimed(plan: LaunchPlan, out: TextIO, err: TextIO) -> int:
    """:func:`launch`, once this job holds its log directory."""
    worker_env = build_worker_env(plan, os.environ, launcher_pid=os.getpid())
    say(err, _summary(plan))
    for note in worker_env.notes:
        say(err, f"distrun: {note}")
    reaper = Reaper()

    announced_world = 0

    def before_start() -> None:
        nonlocal announced_world
        killed = reaper.kill_leftovers()
        if killed:
            say(err, _leftovers_note(killed) + " (before restarting)")
        if plan.world_size is None and logs.world_size != announced_world:
            announced_world = logs.world_size
            for line in _rendezvous_result(plan, logs.world_size, logs.ranks):
                say(err, line)

    logs = RankLogs(plan.log_dir, plan.tee, out=out, before_start=before_start)
    store_dir = tempfile.mkdtemp(prefix="distrun-")
    launch_returned = threading.Event()

    def stop_blocked_launch(sigval: signal.Signals) -> None:
        """A stop signal while the main thread waits in C++ for the other nodes: in the
        rendezvous (no worker started yet), or in torch's exit barrier (this node's workers
        have all exited; the others' are still running)."""
        if logs.attempts:
            if not set(logs.ranks) <= logs.exit_times().keys():
                return  # workers are running: the agent's own handler stops them
            # All exited: the agent may also be finishing a stop it handled; give it time.
            if launch_returned.wait(_BARRIER_GRACE):
                return
        reaper.kill_leftovers()
        logs.close()
        shutil.rmtree(store_dir, ignore_errors=True)
        say(err, _interrupted(plan, sigval, logs.attempts, waiting_for_nodes=True))
        os._exit(128 + int(sigval))  # the main thread cannot be woken

    bootstrap = os.path.abspath(_bootstrap.__file__)
    killed: list[str] = []
    try:
        with stop_signals_raise(stop_blocked_launch), reaper, patched_environ(worker_env.variables):
            try:
                try:
                    elastic_launch(launch_config(plan, logs, store_dir), sys.executable)(bootstrap)
                finally:
                    launch_returned.set()
                code, message = 0, None
            except ChildFailedError as error:
                # Every exit is stamped, except where the agent's SIGKILL took
                # the guardian too.
                killed_by_agent = {r for r, f in error.failures.items() if f.exitcode == -int(signal.SIGKILL)}
                exits = logs.exit_times(wait_for=set(logs.ranks) - killed_by_agent)
                code, message = describe_failure(plan, error, exits, logs.started_at)
            except SignalException as error:
                code, message = 128 + int(error.sigval), _interrupted(plan, error.sigval, logs.attempts)
            except KeyboardInterrupt:
                # Only where distrun could not install its handlers (not the
                # main thread) and torch's were not installed yet.
                code, message = 128 + int(signal.SIGINT), "distrun: interrupted before the workers started."
            except (RendezvousError, DistNetworkError, DistStoreError) as error:
                # The store errors come from the static rendezvous's store: its
                # port taken since the plan checked it, or a master that never answered.
                code, message = 1, _rendezvous_failed(plan, error)
            finally:
                ignore_stop_signals()
                killed = reaper.kill_leftovers()
    finally:
        logs.close()  # flush the tee before the report
        shutil.rmtree(store_dir, ignore_errors=True)
    if killed:
        say(err, _leftovers_note(killed))
    if message is not None:
        say(err, message)
    return code


def _rendezvous_failed(plan: LaunchPlan, error: Exception) -> str:
    where = "" if plan.local_rendezvous else f" at {plan.master_addr}:{plan.master_port}"
    # c10d's RendezvousConnectionError says only "see inner exception".
    cause = f" ({error.__cause__})" if error.__cause__ is not None else ""
    return f"distrun: rendezvous failed{where}: {error}{cause}"


def _interrupted(
    plan: LaunchPlan, sigval: signal.Signals, attempts: int, waiting_for_nodes: bool = False
) -> str:
    if attempts == 0:
        return f"distrun: received {sigval.name} before the workers started; nothing was left running."
    if waiting_for_nodes:
        return (f"distrun: received {sigval.name} after this node's workers had exited, while waiting for "
                f"the other nodes to finish; nothing was left running here (logs in {plan.log_dir}).")
    return f"distrun: received {sigval.name}; stopped every worker (logs in {plan.log_dir})."
