"""StoreExchange: gather/broadcast/all_gather/decide/present_ranks through the store, named timeouts, key cleanup."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distamp.distributed import store_exchange
from distamp.distributed.store_exchange import (
    StoreExchange,
    StoreTimeoutError,
    rank_and_world,
)
from tests.multiprocess import run_workers


def test_without_a_process_group_every_method_is_local():
    assert rank_and_world() == (0, 1)
    ex = StoreExchange("t.local", "do things", timedelta(seconds=1))
    assert (ex.rank, ex.world_size) == (0, 1)
    assert ex.gather(3) == [3]
    assert ex.broadcast("x") == "x"
    assert ex.all_gather({"a": 1}) == [{"a": 1}]
    assert ex.present_ranks() == [0]
    assert ex.decide(4, lambda vs: sum(vs) * 10) == 40


def test_values_round_trip_and_code_is_refused():
    value = {"t": torch.arange(3), "s": "x", "n": [1, 2.5, None]}
    back = store_exchange._decode(store_exchange._encode(value))
    assert torch.equal(back["t"], value["t"])
    assert back["s"] == "x"
    assert back["n"] == [1, 2.5, None]
    with pytest.raises(Exception, match="Weights only load failed"):
        store_exchange._decode(store_exchange._encode(test_values_round_trip_and_code_is_refused))


def _worker(rank, world_size):
    out = {}
    assert rank_and_world() == (rank, world_size)
    ex = StoreExchange("t.ok", "step 1", timedelta(seconds=20))
    out["gather"] = ex.gather(torch.tensor([rank, 10 * rank]))
    out["broadcast"] = ex.broadcast({"from": rank})
    out["all_gather"] = ex.all_gather(f"r{rank}")
    out["decide"] = ex.decide(rank + 1, lambda vs: max(vs))
    out["present"] = ex.present_ranks()
    # A second exchange of the same namespace and operation gets its own keys.
    again = StoreExchange("t.ok", "step 1", timedelta(seconds=20))
    out["prefixes"] = (ex._prefix, again._prefix)
    out["again"] = again.all_gather(rank * 3)
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    # The first exchange's gather keys were deleted once rank 0 had read them.
    out["gather_key_left"] = store.check([f"{ex._prefix}/0/1"])
    # Timeouts name the missing rank: rank 0 waits for a gather rank 1 never joins.
    late = StoreExchange("t.late", "save step 9", timedelta(milliseconds=300), hint="Look at rank 1.")
    if rank == 0:
        try:
            late.gather(1)
        except StoreTimeoutError as exc:
            out["error"] = str(exc)
    else:
        try:
            late.broadcast()  # rank 0 never broadcasts in this exchange
        except StoreTimeoutError as exc:
            out["error"] = str(exc)
    dist.barrier()
    return out


@pytest.mark.timeout(60)
def test_two_ranks():
    r0, r1 = run_workers(_worker, 2, timeout=50)
    assert [t.tolist() for t in r0["gather"]] == [[0, 0], [1, 10]]
    assert r1["gather"] is None
    assert r0["broadcast"] == r1["broadcast"] == {"from": 0}
    assert r0["all_gather"] == r1["all_gather"] == ["r0", "r1"]
    assert r0["decide"] == r1["decide"] == 2
    assert r0["present"] == r1["present"] == [0, 1]
    assert r0["prefixes"] == r1["prefixes"]
    assert r0["prefixes"][0] != r0["prefixes"][1]
    assert r0["prefixes"][0].endswith("/step-1")
    assert r0["again"] == r1["again"] == [0, 3]
    assert not r0["gather_key_left"]
    assert r0["error"].startswith("rank 0 waited 0:00:00.300000 during save step 9 and rank(s) [1] did not arrive (")
    assert r0["error"].endswith(". Look at rank 1.")
    assert r1["error"].startswith("rank 1 waited 0:00:00.300000 during save step 9 and rank(s) [0] did not arrive (")
