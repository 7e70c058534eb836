"""Finished jobs exit 0: many short jobs under distrun, three at a time.

``dist.destroy_process_group()`` leaves the group alive while something
holds it (``fleet.distributed_model``'s DDP does), and distamp's comm hook
finishes each all-reduce in a Python callback run by a gloo worker thread.
A gloo thread still releasing that callback when the interpreter started
finalizing took the GIL too late: Python ended the thread with
``pthread_exit``, whose unwinding reached a ``noexcept`` destructor, and a
job that had finished exited 134 ("terminate called without an active
exception"); about one job in six here before the fix (4 of 20, 2 of 12),
so 9 jobs catch a regression with probability ~0.8 at a CI cost of about a
minute. Several jobs run at once to load the machine as the failing runs
were loaded.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from tests.launcher.test_distrun import distrun_cmd, worker_env

# The end of a training step with distamp's comm hook, condensed: the last
# all-reduce finishes in a Python callback on a gloo thread, the group is
# still referenced (as by the DDP model), and the script ends right away.
JOB = """
    import torch, torch.distributed as dist
    from distamp import fleet

    fleet.init()
    group = dist.group.WORLD  # what fleet.distributed_model's DDP keeps
    grads = torch.ones(1 << 12)
    work = dist.all_reduce(grads, async_op=True)
    work.get_future().then(lambda fut: fut.value()[0].div_(2)).wait()
    dist.destroy_process_group()
"""
JOBS, AT_ONCE = 9, 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_fleet_jobs_exit_0(tmp_path):
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    failures, running = [], []

    def start(i):
        cmd = distrun_cmd("--nproc_per_node", "2", "--tee", "none", "--log_dir", f"log{i}", "job.py")
        return i, subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=worker_env())

    try:
        for i in range(JOBS):
            running.append(start(i))
            if len(running) == AT_ONCE or i == JOBS - 1:
                for j, proc in running:
                    _, err = proc.communicate(timeout=300)
                    if proc.returncode != 0:
                        failures.append(f"job {j} exited {proc.returncode}:\n{err[-1500:]}")
                running = []
    finally:
        for _, proc in running:
            proc.kill()
            proc.communicate()
    assert not failures, f"{len(failures)} of {JOBS} jobs failed:\n" + "\n".join(failures)
