"""How many bytes one collective of the sharded path may send to one peer, per backend.

gloo's TCP transport sends each peer's part of an ``all_to_all`` or
``all_gather`` as one message. Over a link limited to 1 Gbit/s (the
``--link_gbit 1`` namespaces of ``examples/benchmark.py``, 2 ranks, 21 runs
each), an ``all_to_all_single`` of 26 MB (12.8 MB to the peer) took a
median 193 ms where the line allows 105 ms; cut into rounds launched
together it took 130 ms with 3.2 MB to the peer per round, 111 ms with
1 MB and 109.6 ms with 0.5 MB. On loopback the same rounds cost
14-16 ms down to 1 MB per peer and 21 ms at 0.5 MB (more collectives).
gloo's ring all-reduce cuts its messages itself. So on gloo the sharded
path cuts its reduce-scatter into rounds of at most :data:`GLOO_ROUND_BYTES`
to each peer, launched together (gloo runs them in order), and its
parameter gather into pairwise messages of at most that size
(:mod:`distamp.sharding.direct_gather`). NCCL pipelines large messages
itself and gets whole buckets.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["GLOO_ROUND_BYTES", "round_bytes"]

GLOO_ROUND_BYTES = 1 << 20
"""Most bytes one rank sends to one peer in one all-to-all or all-gather round on gloo."""


def round_bytes(group: dist.ProcessGroup | None) -> int | None:
    """The most bytes a rank should send to one peer in one round on ``group``'s backend; ``None``: no limit.

    ``None`` also for a one-process world without a process group.
    """
    if not dist.is_initialized():
        return None
    return GLOO_ROUND_BYTES if dist.get_backend(group) == "gloo" else None
