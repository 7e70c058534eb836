"""``distrun``: start a multi-process (and multi-node) training job.

Built on :mod:`torch.distributed.elastic`: the elastic agent starts, watches,
restarts and stops the workers; this package adds a validated command line,
per-rank log files appended across restarts, a console tee with rank
prefixes, a failure report naming the first failing rank, and workers that
die with the launcher. Run it as ``distrun`` or ``python -m distamp.launcher``.

Modules, in the order a launch goes through them:

- :mod:`~distamp.launcher.cli`: the argument parser and ``main()``.
- :mod:`~distamp.launcher.plan`: validation into a :class:`LaunchPlan`, with
  :mod:`~distamp.launcher.nodes` (nodes, rendezvous address),
  :mod:`~distamp.launcher.workers` (workers per node, GPUs),
  :mod:`~distamp.launcher.command` (the script or module) and
  :mod:`~distamp.launcher.usage` (:class:`UsageError`).
- :mod:`~distamp.launcher.env`: the environment every worker inherits.
- :mod:`~distamp.launcher.logs`: ``log_dir/workerlog.N`` and the console tee.
- :mod:`~distamp.launcher.run`: the elastic launch and the failure report,
  with :mod:`~distamp.launcher.reaper` (what the workers left running) and
  :mod:`~distamp.launcher.stop_signals` (Ctrl-C and SIGTERM from the start).
- ``_bootstrap.py``: the first code each worker runs (death signal, log
  redirection), before it becomes the user's script via ``exec``.

This ``__init__`` imports nothing heavy on purpose: the bootstrap must start
fast in every worker.
"""
