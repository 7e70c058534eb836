"""Keeping ``torch.compile``'s cached graphs of one autocast dtype from being reused under another.

AOTAutograd traces a compiled region under the autocast state that is active
when it is first called, so the graph it caches has the casts to that dtype
built in. Before torch 2.13 its cache key (``AOTAutogradCacheDetails``)
recorded only *whether* autocast was on, not the dtype: a graph compiled
under FP16 autocast was handed back under BF16 autocast, and the "BF16"
forward ran in FP16. Dynamo itself guards on the dtype and recompiles; it is
the recompile that hits the stale entry, both in the same process (compile,
then switch dtype) and across runs (the cache is on disk, under
``TORCHINDUCTOR_CACHE_DIR``). Reproduced on CPU with torch 2.11; 2.12.1's
key is 2.11's (``disable_amp`` only, read in its ``autograd_cache.py``);
torch 2.13 keys on the dtype (pytorch/pytorch#181564).

On such a torch, :func:`keep_autocast_dtypes_apart` switches that cache off
for the process (inductor's own FX-graph cache, keyed on the traced graph
with its casts, stays on): every process traces its graphs again, which
costs compile time, never precision.
"""

from __future__ import annotations

import logging

import torch

from distamp.torch_compat import aot_autograd_cache_keys_autocast_dtype, disable_aot_autograd_cache

__all__ = ["keep_autocast_dtypes_apart"]

_logger = logging.getLogger(__name__)
_switched_off = False


def keep_autocast_dtypes_apart() -> None:
    """Switch AOTAutograd's compiled-graph cache off (once per process) where its key lacks the autocast dtype.

    Called by ``auto_cast`` before its region runs, so no compiled region
    under a distamp autocast ever reads a graph traced under another dtype.
    A no-op on torch >= 2.13.
    """
    global _switched_off
    if _switched_off or aot_autograd_cache_keys_autocast_dtype():
        return
    # TORCHINDUCTOR_AUTOGRAD_CACHE=1, set by a user, keeps the cache on: torch lets it override this.
    disable_aot_autograd_cache()
    _switched_off = True
    _logger.info(
        "torch %s keys AOTAutograd's compiled-graph cache on whether autocast is on, not on its dtype, so a "
        "graph compiled under one dtype would be reused under the other; that cache is now off for this "
        "process (torch.compile traces again in each process; inductor's own cache stays on)",
        torch.__version__,
    )
