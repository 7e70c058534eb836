"""How many bytes one collective of the sharded path may send, per backend.

gloo's TCP transport sends each peer's part of an ``all_to_all`` or
``all_gather`` as one message. Over a link limited to 1 Gbit/s (the
``--link_gbit 1`` namespaces of ``examples/benchmark.py``, 2 ranks), one
``all_to_all_single`` sending 6.56 MB per rank took 58 to 104 ms (median
103 ms, 15 runs) where the line rate allows 52 ms; the same bytes as 16
``all_to_all_single`` of 410 KB each, launched together, took 54.2 to
54.6 ms, and as 64 of 102 KB, 54.8 ms. gloo's ring all-reduce cuts its
messages itself (13.12 MB sent: 109.5 ms, steady). So on gloo the sharded
path cuts its reduce-scatter and its all-gather into rounds of at most
:data:`GLOO_ROUND_BYTES` sent per rank, all launched at once (gloo runs
them in order). NCCL pipelines large messages itself and gets whole
buckets.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["GLOO_ROUND_BYTES", "round_bytes"]

GLOO_ROUND_BYTES = 512 * 1024
"""Most bytes one rank sends in one all-to-all or all-gather round on gloo."""


def round_bytes(group: dist.ProcessGroup | None) -> int | None:
    """The most bytes a rank should send in one round on ``group``'s backend; ``None``: no limit.

    ``None`` also for a one-process world without a process group.
    """
    if not dist.is_initialized():
        return None
    return GLOO_ROUND_BYTES if dist.get_backend(group) == "gloo" else None
