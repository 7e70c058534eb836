"""Ranks that disagree fail fast, naming what differs.

A strategy that differs between ranks (a wrong environment variable, a
per-host config file, a stale script on one node) is the most common way a
multi-node job goes wrong, and data parallelism never says so by itself:
FP16 and BF16 bit patterns get summed together, a size mismatch aborts
gloo, different gradient-merge windows hang. So, once, when the
data-parallel model is prepared (before any gradient is communicated),
every rank sends a fingerprint of what must agree (every strategy setting
that changes communication or numerics, and the model's structure) through
the store, and every rank raises the same ``ValueError`` naming each
differing key with each rank's value.

Cost: one small exchange through the process group's store at set-up.
"""

from __future__ import annotations

import collections
import hashlib
from datetime import timedelta

from torch import nn

from distamp.distributed.store_exchange import StoreExchange
from distamp.strategy import DistributedStrategy

__all__ = ["HANDSHAKE_TIMEOUT", "check_ranks_agree", "fingerprint"]

HANDSHAKE_TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for the others at the set-up handshake (ranks may start minutes apart)."""

_SHOWN_VALUE = 120  # characters of a value shown in the error


def fingerprint(strategy: DistributedStrategy, model: nn.Module) -> dict[str, str]:
    """What every rank of a data-parallel job must agree on, as ``{setting: repr(value)}``.

    Every strategy attribute and every key of its configs (named as a user
    writes them, ``amp_configs['dtype']``), plus the model's parameter
    count, element count, dtypes and a digest of the shapes.
    """
    values: dict[str, str] = {}
    for name, value in strategy.to_dict().items():
        if isinstance(value, dict):
            values.update({f"{name}[{key!r}]": repr(item) for key, item in value.items()})
        else:
            values[name] = repr(value)
    params = list(model.parameters())
    shapes = ";".join(",".join(map(str, p.shape)) for p in params)
    dtypes = collections.Counter(str(p.dtype).replace("torch.", "") for p in params)
    values["model: parameter tensors"] = str(len(params))
    values["model: parameter elements"] = str(sum(p.numel() for p in params))
    values["model: parameter dtypes"] = ", ".join(f"{n} {d}" for d, n in sorted(dtypes.items()))
    values["model: parameter shapes (sha256)"] = hashlib.sha256(shapes.encode()).hexdigest()[:16]
    return values


def _disagreements(per_rank: list[dict[str, str]]) -> list[str]:
    keys = sorted({key for values in per_rank for key in values})
    lines = []
    for key in keys:
        seen = [values.get(key, "<missing>") for values in per_rank]
        if len(set(seen)) > 1:
            shown = ", ".join(f"rank {r} {v[:_SHOWN_VALUE]}" for r, v in enumerate(seen))
            lines.append(f"{key}: {shown}")
    return lines


def check_ranks_agree(strategy: DistributedStrategy, model: nn.Module, timeout: timedelta = HANDSHAKE_TIMEOUT) -> None:
    """Raise the same ``ValueError`` on every rank when their fingerprints differ.

    A no-op in a one-process world.

    Raises:
        ValueError: naming each differing setting with each rank's value.
        StoreTimeoutError: a rank did not reach the handshake within
            ``timeout`` (the message names it).
    """
    exchange = StoreExchange(
        "distamp.setup", "the set-up handshake (preparing the data-parallel model)", timeout,
        hint="Every rank must call fleet.distributed_optimizer and fleet.distributed_model; check the other "
        "ranks' logs.",
    )
    if exchange.world_size == 1:
        return
    per_rank = exchange.all_gather(fingerprint(strategy, model))
    lines = _disagreements(per_rank)
    if lines:
        raise ValueError(
            "the ranks of this job disagree on their set-up, so their gradients cannot be combined:\n  "
            + "\n  ".join(lines)
            + "\nEvery rank must run the same strategy and model: check the environment variables, config "
            "files and script version each node uses."
        )
