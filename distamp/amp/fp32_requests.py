"""Where the user's configuration switched an enabled autocast off: FP32 on request, not by omission.

A ``custom_black_varnames`` module, an op on ``custom_black_list`` and a
nested ``fleet.auto_cast(enable=False)`` each run in FP32 *inside* an
autocast region, on purpose. A forward whose every matrix product runs in
such a place looks, in its autograd graph, like a forward with no region at
all; :data:`FP32_REQUESTS` counts these switch-offs so the optimizer's check
for a forgotten autocast region (``distamp.optim.autocast_watch``) can tell
the two apart::

    before = FP32_REQUESTS.count
    with auto_cast():
        loss = model(x)          # a black module ran: FP32_REQUESTS.count > before
"""

from __future__ import annotations

import torch

__all__ = ["FP32_REQUESTS", "FP32Requests"]


class FP32Requests:
    """How many times an enabled autocast was switched off because the configuration asked for FP32."""

    def __init__(self) -> None:
        self.count = 0

    def record(self) -> None:
        """One region or op ran in FP32 inside an enabled autocast, as configured.

        Not counted while ``torch.compile`` traces: a compiled region is
        recognised in the graph by itself, and a counter bumped in traced code
        would be a side effect of every compiled call.
        """
        if not torch.compiler.is_compiling():
            self.count += 1


FP32_REQUESTS = FP32Requests()
"""Every switch-off of an enabled autocast that the configuration asked for, in this process."""
