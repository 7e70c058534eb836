"""GradientMerge: the window's counters, loss divisor, when the next backward communicates, and listeners."""

from __future__ import annotations

from distamp.optim.accumulation import GradientMerge
from distamp.strategy import DistributedStrategy


class Listener:
    def __init__(self):
        self.calls = []

    def set_grad_sync(self, owner, flag):
        self.calls.append((owner, flag))


def test_without_merging_every_backward_communicates_and_steps():
    merge = GradientMerge()
    assert (merge.k_steps, merge.loss_divisor) == (1, 1)
    for _ in range(3):
        assert merge.sync_next_backward
        merge.count_backward()
        assert not merge.is_accumulating
        assert merge.window_complete
        merge.reset()


def test_a_window_of_three():
    merge = GradientMerge(3)
    assert merge.loss_divisor == 3
    seen = []
    for _ in range(3):
        seen.append((merge.sync_next_backward, merge.micro_steps))
        merge.count_backward()
        seen.append((merge.is_accumulating, merge.window_complete))
    assert seen == [(False, 0), (True, False), (False, 1), (True, False), (True, 2), (False, True)]
    merge.reset()
    assert merge.micro_steps == 0
    assert not merge.sync_next_backward


def test_a_full_window_not_stepped_starts_a_new_one():
    merge = GradientMerge(2)
    merge.count_backward()
    merge.count_backward()
    assert merge.window_complete
    assert not merge.sync_next_backward  # the next backward opens a new window
    merge.count_backward()
    assert merge.micro_steps == 1
    assert merge.is_accumulating
    assert merge.sync_next_backward


def test_sum_instead_of_mean():
    assert GradientMerge(4, avg=False).loss_divisor == 1


def test_from_strategy():
    strategy = DistributedStrategy()
    assert GradientMerge.from_strategy(strategy).k_steps == 1
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 4, "avg": False}
    merge = GradientMerge.from_strategy(strategy)
    assert (merge.k_steps, merge.avg, merge.loss_divisor) == (4, False, 1)


def test_listeners_are_told_at_once_and_on_publish_and_held_weakly():
    merge = GradientMerge(2)
    listener, owner = Listener(), object()
    merge.add_listener(listener, owner)
    assert listener.calls == [(owner, False)]
    merge.count_backward()
    merge.publish()
    assert listener.calls[-1] == (owner, True)
    del listener
    merge.publish()  # a collected listener is gone from the registry
    assert len(merge._listeners) == 0
