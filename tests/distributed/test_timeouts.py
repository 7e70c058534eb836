"""named_collective: a collective timeout becomes CollectiveTimeoutError naming the operation and absent ranks."""

from __future__ import annotations

from datetime import timedelta

import pytest

from distamp.distributed import timeouts
from distamp.distributed.timeouts import CollectiveTimeoutError, named_collective
from tests.multiprocess import run_workers


def test_no_error_passes_through():
    with named_collective("nothing"):
        value = 1
    assert value == 1


@pytest.mark.parametrize("exc", [RuntimeError("connection reset by peer"), ValueError("timed out")])
def test_other_errors_are_re_raised_unchanged(exc):
    with pytest.raises(type(exc)) as info, named_collective("op"):
        raise exc
    assert info.value is exc


def test_an_existing_collective_timeout_is_not_wrapped_twice():
    inner = CollectiveTimeoutError("already named")
    with pytest.raises(CollectiveTimeoutError) as info, named_collective("outer"):
        raise inner
    assert info.value is inner


@pytest.mark.parametrize("text", ["Timed out waiting 1800000ms for recv operation", "Socket Timeout"])
def test_a_timeout_in_one_process_cannot_name_anyone(text):
    with pytest.raises(CollectiveTimeoutError) as info, named_collective("the inf/NaN verdict all-reduce of step 12"):
        raise RuntimeError(text)
    assert str(info.value) == (
        "rank 0: the inf/NaN verdict all-reduce of step 12 did not complete within the process group's timeout; "
        "the ranks that did not arrive could not be named. Check those ranks' logs (a crash, a hang in data "
        "loading, or a rank running other code); raise the limit with fleet.init(timeout=...) if they are only "
        f"slow. ({text})"
    )
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, RuntimeError)


def _worker(rank, world_size):
    timeouts._ROLL_CALL = timedelta(milliseconds=500)  # the survivors' roll call, short for the test
    if rank == 1:
        return None  # never reaches the collective
    try:
        with named_collective("the gradient all-reduce of step 3"):
            raise RuntimeError("Timed out waiting 1000ms for recv operation")
    except CollectiveTimeoutError as exc:
        return str(exc)


@pytest.mark.timeout(60)
def test_the_rank_that_never_came_is_named():
    message, _ = run_workers(_worker, 2, timeout=50)
    assert message.startswith(
        "rank 0: the gradient all-reduce of step 3 did not complete within the process group's timeout; "
        "rank(s) [1] did not arrive."
    )
    assert message.endswith("(Timed out waiting 1000ms for recv operation)")
