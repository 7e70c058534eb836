"""The ``distrun`` command line: parse, validate, then launch.

Examples::

    distrun --gpus 0,1,2,3 train.py --lr 0.1
    distrun --nproc_per_node 2 train.py                     # CPU workers
    distrun --nnodes 2 --node_rank 0 --master 10.0.0.1:29500 --gpus 0,1,2,3 train.py
    distrun --ips 10.0.0.1,10.0.0.2 --gpus 0,1 -m mypkg.train
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from distamp.launcher.plan import WORKERS_PER_CPU, LaunchPlan, UsageError, build_plan
from distamp.suggest import did_you_mean

__all__ = ["build_parser", "main", "parse_plan"]

USAGE_EXIT_CODE = 2


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _spellings(flag: str) -> tuple[str, str]:
    """``flag`` and its dashed spelling (``--nproc_per_node``, ``--nproc-per-node``), as torchrun accepts both."""
    return flag, "--" + flag[2:].replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The ``distrun`` argument parser, with flags grouped by concern."""
    parser = _Parser(
        prog="distrun",
        description="Start a multi-process training job (one worker per GPU or CPU "
        "process) on one or several nodes, built on torch.distributed.elastic.",
        epilog="Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT (as with torchrun), DISTAMP_SELECTED_GPUS and "
        "TORCHELASTIC_RESTART_COUNT.",
        allow_abbrev=False,
    )
    workers = parser.add_argument_group("workers on this node")
    workers.add_argument(
        "--gpus", metavar="IDS",
        help="comma-separated GPU ids, one worker per id, e.g. 0,1,2,3 (indices into "
        "CUDA_VISIBLE_DEVICES when it is set); worker i uses cuda:i",
    )
    workers.add_argument(
        *_spellings("--nproc_per_node"), type=int, metavar="N",
        help="number of workers on this node, CPU or GPU (default: 1, or one per --gpus id); "
        f"more than {WORKERS_PER_CPU} per CPU of this host is refused unless "
        "--allow_oversubscribe is given",
    )
    workers.add_argument(
        *_spellings("--allow_oversubscribe"), action="store_true",
        help=f"allow --nproc_per_node above {WORKERS_PER_CPU} workers per CPU (e.g. many "
        "tiny test workers); without it such a count exits with code 2 before anything starts",
    )
    nodes = parser.add_argument_group("several nodes")
    nodes.add_argument("--nnodes", type=int, metavar="N", help="number of nodes (default: 1)")
    nodes.add_argument(
        *_spellings("--node_rank"), type=int, metavar="R", help="rank of this node, 0..nnodes-1 (default: 0)"
    )
    nodes.add_argument(
        "--master", metavar="HOST:PORT",
        help="rendezvous address, on node rank 0; one node without it uses "
        "127.0.0.1 and a free port",
    )
    nodes.add_argument(
        "--ips", metavar="H1,H2,...",
        help="all nodes' hosts (Fleet style): nnodes is their number, the master is the "
        "first, and this node's rank is its position in the list",
    )
    logs = parser.add_argument_group("logs and failures")
    logs.add_argument(
        *_spellings("--log_dir"), default="log", metavar="DIR",
        help="per-rank logs DIR/workerlog.N (stdout and stderr) (default: log)",
    )
    logs.add_argument(
        "--tee", default="0", metavar="RANKS",
        help="ranks whose output also goes to the console, prefixed with the rank: "
        "comma-separated ranks, 'all' or 'none' (default: 0)",
    )
    logs.add_argument(
        *_spellings("--max_restarts"), type=int, default=0, metavar="N",
        help="restart the whole group up to N times after a failure (default: 0)",
    )
    logs.add_argument(
        *_spellings("--grace_period"), type=int, default=30, metavar="SECONDS",
        help="when distrun is interrupted (SIGINT/SIGTERM), seconds the workers get to "
        "exit before SIGKILL (default: 30; after a worker failure torch always waits 30)",
    )
    what = parser.add_argument_group("what to run")
    what.add_argument(
        "-m", "--module", action="store_true",
        help="run SCRIPT as a module (python -m SCRIPT)",
    )
    what.add_argument("script", nargs="?", metavar="SCRIPT", help="training script (or module with -m)")
    what.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS",
        help="arguments passed to the script untouched",
    )
    return parser


def _split_argv(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into distrun's options and ``[SCRIPT, *ARGS]``.

    The script is the first word that is neither an option nor an option's
    value (``--`` may mark it). Everything after it is returned verbatim:
    ``argparse.REMAINDER`` would drop a ``--`` right after the script.
    """
    takes_value = {
        opt: action.nargs != 0 for action in parser._actions for opt in action.option_strings
    }
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if not word.startswith("-") or word == "-":
            return argv[:i], argv[i:]
        if takes_value.get(word, False):
            i += 1  # its value, whatever it looks like
        i += 1
    return argv, []


def parse_plan(argv: Sequence[str]) -> LaunchPlan:
    """Parse and validate ``argv`` (without the program name); start nothing.

    Raises:
        UsageError: for any bad input, naming the flag and value.
    """
    parser = build_parser()
    own, command = _split_argv(parser, list(argv))
    args, unknown = parser.parse_known_args(own)
    if unknown:
        flags = [o for a in parser._actions for o in a.option_strings]
        first = unknown[0].partition("=")[0]
        raise UsageError(
            f"unrecognized option {first!r} (arguments: {' '.join(unknown)!r})."
            f"{did_you_mean(first, flags)} Options for your script go after SCRIPT."
        )
    args.script, args.script_args = (command[0], command[1:]) if command else (None, [])
    return build_plan(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``distrun``; returns the process exit code.

    2 for bad input (nothing was started), otherwise what
    :func:`distamp.launcher.run.launch` returns.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        plan = parse_plan(argv)
    except UsageError as exc:
        print(f"distrun: error: {exc}", file=sys.stderr)
        print("Run 'distrun --help' for the options.", file=sys.stderr)
        return USAGE_EXIT_CODE
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    from distamp.launcher.run import launch  # deferred: imports torch

    return launch(plan)


if __name__ == "__main__":
    sys.exit(main())
