"""launcher.workers.resolve_workers and its helpers, called directly with fake GPU and CPU counts."""

from __future__ import annotations

import argparse
import os
from unittest import mock

import pytest

from distamp.launcher import workers
from distamp.launcher.usage import UsageError
from distamp.launcher.workers import (
    WORKERS_PER_CPU,
    available_cpus,
    resolve_workers,
    visible_gpu_count,
)


def ns(nproc_per_node=None, gpus=None, allow_oversubscribe=False):
    return argparse.Namespace(nproc_per_node=nproc_per_node, gpus=gpus, allow_oversubscribe=allow_oversubscribe)


def resolve(args, environ=None, gpus=0, cpus=2):
    return resolve_workers(args, environ or {}, lambda: gpus, lambda: cpus)


def untouched():
    raise AssertionError("must not be asked")


def test_one_cpu_worker_by_default():
    assert resolve(ns()) == (1, None)


def test_limit_is_workers_per_cpu_times_cpus():
    assert WORKERS_PER_CPU == 4
    assert resolve(ns(nproc_per_node=8), cpus=2) == (8, None)
    message = (r"^--nproc_per_node 9 is more than 4 workers per CPU: this host has 2 CPU\(s\), so at most 8 workers "
               r"start without --allow_oversubscribe\. Use --nproc_per_node 2 \(one per CPU\), or add "
               r"--allow_oversubscribe if you really want 9 processes here\.$")
    with pytest.raises(UsageError, match=message):
        resolve(ns(nproc_per_node=9), cpus=2)


def test_allow_oversubscribe_lifts_the_limit():
    assert resolve(ns(nproc_per_node=100, allow_oversubscribe=True), cpus=1) == (100, None)


@pytest.mark.parametrize("nproc", [0, -3])
def test_nproc_below_one(nproc):
    with pytest.raises(UsageError, match=rf"^--nproc_per_node {nproc} is invalid: it must be an integer >= 1\.$"):
        resolve(ns(nproc_per_node=nproc))


def test_gpus_without_cuda_visible_devices_are_the_ids():
    assert resolve(ns(gpus="2,0"), gpus=4) == (2, ("2", "0"))


def test_gpus_map_through_cuda_visible_devices():
    environ = {"CUDA_VISIBLE_DEVICES": "5, 7,GPU-abc"}
    assert resolve(ns(gpus="2,0"), environ, gpus=3) == (2, ("GPU-abc", "5"))


def test_gpus_ignore_the_cpu_limit():
    assert resolve_workers(ns(gpus="0,1,2"), {}, lambda: 3, untouched) == (3, ("0", "1", "2"))


def test_gpus_agreeing_with_nproc():
    assert resolve(ns(gpus=" 1 ,0", nproc_per_node=2), gpus=2) == (2, ("1", "0"))


def test_gpus_conflicting_with_nproc_fail_before_looking_at_the_hardware():
    message = (r"^--gpus '0,1' starts one worker per GPU \(2\), which conflicts with --nproc_per_node 3; "
               r"use only one of them\.$")
    with pytest.raises(UsageError, match=message):
        resolve_workers(ns(gpus="0,1", nproc_per_node=3), {}, untouched, untouched)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,,1", r"^--gpus '0,,1' is invalid: expected comma-separated GPU ids such as '0,1,2,3', got ''\.$"),
        ("a", r"^--gpus 'a' is invalid: expected comma-separated GPU ids such as '0,1,2,3', got 'a'\.$"),
        ("-1", r"got '-1'\.$"),
        ("\u00b2", r"got '\u00b2'\.$"),  # str.isdigit() is True for superscripts, int() refuses them
        ("\u0663", r"got '\u0663'\.$"),  # an Arabic-Indic digit: not an id CUDA_VISIBLE_DEVICES would take
        ("1,0,1,0", r"^--gpus '1,0,1,0' lists GPU 0 more than once; give each id once\.$"),
    ],
)
def test_bad_gpu_ids(text, message):
    with pytest.raises(UsageError, match=message):
        resolve_workers(ns(gpus=text), {}, untouched, untouched)


def test_gpus_without_cuda():
    message = (r"^--gpus '0,1': no CUDA GPU is visible on this machine \(torch\.cuda\.is_available\(\) is False\)\. "
               r"To run CPU workers, use --nproc_per_node 2 instead of --gpus\.$")
    with pytest.raises(UsageError, match=message):
        resolve(ns(gpus="0,1"), gpus=0)


def test_gpu_not_visible_names_cuda_visible_devices():
    message = (r"^--gpus '0,3,2': GPU 3 is not visible; this process sees 2 GPU\(s\), ids 0 to 1 "
               r"\(CUDA_VISIBLE_DEVICES='4,5'\)\.$")
    with pytest.raises(UsageError, match=message):
        resolve(ns(gpus="0,3,2"), {"CUDA_VISIBLE_DEVICES": "4,5"}, gpus=2)


def test_gpu_not_visible_without_cuda_visible_devices():
    message = r"^--gpus '1': GPU 1 is not visible; this process sees 1 GPU\(s\), ids 0 to 0\.$"
    with pytest.raises(UsageError, match=message):
        resolve(ns(gpus="1"), gpus=1)


def test_available_cpus_is_the_affinity_mask():
    assert available_cpus() == len(os.sched_getaffinity(0))


def test_available_cpus_off_linux_is_cpu_count():
    with mock.patch.object(workers.os, "sched_getaffinity", side_effect=AttributeError, create=True), \
            mock.patch.object(workers.os, "cpu_count", return_value=None):
        assert available_cpus() == 1


def test_visible_gpu_count():
    import torch

    with mock.patch.object(torch.cuda, "is_available", return_value=False), \
            mock.patch.object(torch.cuda, "device_count", return_value=3):
        assert visible_gpu_count() == 0
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=3):
        assert visible_gpu_count() == 3
