"""Keeping ``torch.compile``'s cached graphs of one autocast dtype from being reused under another.

AOTAutograd traces a compiled region under the autocast state that is active
when it is first called, so the graph it caches has the casts to that dtype
built in. Before torch 2.13 its cache key (``AOTAutogradCacheDetails``)
recorded only *whether* autocast was on, not the dtype: a graph compiled
under FP16 autocast was handed back under BF16 autocast, and the "BF16"
forward ran in FP16. Dynamo itself guards on the dtype and recompiles; it is
the recompile that hits the stale entry, both in the same process (compile,
then switch dtype) and across runs (the cache is on disk, under
``TORCHINDUCTOR_CACHE_DIR``). Reproduced on CPU with torch 2.11; torch 2.13
keys on the dtype (pytorch/pytorch#181564).

On such a torch, :func:`keep_autocast_dtypes_apart` switches that cache off
for the process (inductor's own FX-graph cache, keyed on the traced graph
with its casts, stays on): every process traces its graphs again, which
costs compile time, never precision.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["cache_key_has_autocast_dtype", "keep_autocast_dtypes_apart"]

_FIXED_IN = "2.13"  # the first release whose AOTAutograd cache key has the autocast dtype (2.12 unchecked)
_logger = logging.getLogger(__name__)
_switched_off = False


def cache_key_has_autocast_dtype() -> bool:
    """True when this torch's AOTAutograd cache tells autocast dtypes apart (torch >= 2.13)."""
    return bool(torch.__version__ >= _FIXED_IN)


def keep_autocast_dtypes_apart() -> None:
    """Switch AOTAutograd's compiled-graph cache off (once per process) where its key lacks the autocast dtype.

    Called by ``auto_cast`` before its region runs, so no compiled region
    under a distamp autocast ever reads a graph traced under another dtype.
    A no-op on torch >= 2.13.
    """
    global _switched_off
    if _switched_off or cache_key_has_autocast_dtype():
        return
    # The one private torch name here: the cache has no public switch read after import
    # (TORCHINDUCTOR_AUTOGRAD_CACHE is read when torch._functorch.config is imported; a user who set
    # it to 1 keeps the cache on, as torch lets that variable override this assignment).
    import torch._functorch.config as aot_autograd_config

    aot_autograd_config.enable_autograd_cache = False
    aot_autograd_config.enable_remote_autograd_cache = False
    _switched_off = True
    _logger.info(
        "torch %s keys AOTAutograd's compiled-graph cache on whether autocast is on, not on its dtype, so a "
        "graph compiled under one dtype would be reused under the other; that cache is now off for this "
        "process (torch.compile traces again in each process; inductor's own cache stays on)",
        torch.__version__,
    )
