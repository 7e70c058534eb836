"""``auto_cast``: ``torch.autocast`` plus Paddle's custom op lists.

Example::

    model = Net()                                   # FP32 parameters ("O1")
    for x, y in loader:
        with auto_cast(dtype="bfloat16"):
            loss = F.cross_entropy(model(x), y)     # torch.autocast's lists decide per op
        loss.backward()                             # parameter grads are FP32

With no custom list, ``auto_cast(...)`` *is* a ``torch.autocast`` object: the
same op lists (torch's, per device: CUDA and CPU differ), the same weight-cast
cache, the same results bit for bit, and everything built for autocast
composes with it: ``torch.compile``, ``torch.utils.checkpoint``,
``torch.amp.custom_fwd``, fused attention, ``torch.is_autocast_enabled()``.

``custom_white_list`` / ``custom_black_list`` move single ops between low
precision and FP32 on top of torch's lists (see
:mod:`distamp.amp.op_list_mode`); only then is a torch function mode added.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from distamp.amp.compile_cache import keep_autocast_dtypes_apart
from distamp.amp.op_list_mode import OpListMode
from distamp.strategy.op_checks import validate_dtype, validate_op_lists

if TYPE_CHECKING:
    # typing.Self is Python 3.11+; mypy checks for 3.10 (setup.cfg).
    import typing_extensions

__all__ = ["AutocastWithOpLists", "auto_cast", "default_device_type"]


def default_device_type() -> str:
    """``"cuda"`` when CUDA is available, else ``"cpu"``: where training computes."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class AutocastWithOpLists(contextlib.ContextDecorator):
    """``torch.autocast`` and an :class:`~distamp.amp.op_list_mode.OpListMode`, entered together.

    Returned by :func:`auto_cast` when a custom op list is given. Usable as a
    context manager or a decorator; re-entrant (each entry makes its own
    autocast context and mode), so nesting and recursion unwind in order.

    Args:
        mode: the op lists, with the device type and dtype autocast uses.
        cache_enabled: ``torch.autocast``'s weight-cast cache.
    """

    def __init__(self, mode: OpListMode, cache_enabled: bool = True) -> None:
        self.mode = mode
        self.cache_enabled = cache_enabled
        self._entered: list[tuple[torch.autocast, OpListMode]] = []

    # Entered and left eagerly, also when met inside a compiled function: dynamo cannot enter this
    # context manager, and tracing __enter__ would replay torch.autocast's own __enter__ symbolically,
    # leaving the real object without the state its eager __exit__ restores ("'autocast' object has
    # no attribute 'prev'"). Code inside the region is still compiled.
    @torch.compiler.disable
    def __enter__(self) -> typing_extensions.Self:
        autocast = torch.autocast(self.mode.device_type, dtype=self.mode.dtype, cache_enabled=self.cache_enabled)
        mode = self.mode.copy()
        autocast.__enter__()
        try:
            mode.__enter__()
        except BaseException:
            autocast.__exit__(None, None, None)
            raise
        self._entered.append((autocast, mode))
        return self

    @torch.compiler.disable
    def __exit__(self, *exc_info: object) -> None:
        autocast, mode = self._entered.pop()
        try:
            mode.__exit__(*exc_info)
        finally:
            autocast.__exit__(*exc_info)

    def __repr__(self) -> str:
        return f"AutocastWithOpLists({self.mode!r}, cache_enabled={self.cache_enabled})"


def auto_cast(
    enable: bool = True,
    dtype: str | torch.dtype = "float16",
    custom_white_list: Iterable[str] | None = None,
    custom_black_list: Iterable[str] | None = None,
    *,
    device_type: str | None = None,
    cache_enabled: bool = True,
) -> torch.autocast | AutocastWithOpLists:
    """Mixed precision for the ops in the region: ``torch.autocast`` with optional custom lists.

    Use it around the forward pass and the loss, not the backward pass or the
    optimizer step::

        with auto_cast(dtype="float16", custom_black_list=["gelu"]):
            loss = loss_fn(model(x), y)

    Args:
        enable: ``False`` switches autocast off in the region (also inside an
            enclosing enabled region), as ``torch.autocast(enabled=False)``.
        dtype: ``"float16"`` (default) or ``"bfloat16"`` (or the torch dtypes).
        custom_white_list: op names (torch's, e.g. ``"softmax"``,
            ``"torch.matmul"``, ``"F.gelu"``; ``"conv"`` means every
            convolution) to run in ``dtype`` even where torch's list says FP32.
        custom_black_list: op names to run in FP32. An op may not be on both.
        device_type: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` when CUDA is
            available, else ``"cpu"``. Autocast affects tensors of that device
            type only.
        cache_enabled: ``torch.autocast``'s weight-cast cache (default True).

    On torch < 2.13 an enabled ``auto_cast`` switches AOTAutograd's
    compiled-graph cache off for the process, whose key there lacks the
    autocast dtype (see :mod:`distamp.amp.compile_cache`).

    Returns:
        A ``torch.autocast`` when no custom list is given (and when ``enable``
        is False); otherwise an :class:`AutocastWithOpLists`.

    Raises:
        ValueError: a bad dtype, device type or op name (with the closest valid
            name), or an op on both lists.
        TypeError: ``enable`` or ``cache_enabled`` is not a bool.
    """
    for name, value in (("enable", enable), ("cache_enabled", cache_enabled)):
        if not isinstance(value, bool):
            raise TypeError(f"auto_cast({name}=...) must be True or False, got {value!r}")
    low = getattr(torch, validate_dtype("auto_cast()", "dtype", dtype))
    device_type = _check_device_type(device_type)
    white, black = validate_op_lists("auto_cast()", custom_white_list or (), custom_black_list or ())
    if enable:
        keep_autocast_dtypes_apart()  # torch < 2.13 would reuse a graph compiled under the other dtype
    autocast = torch.autocast(device_type, dtype=low, enabled=enable, cache_enabled=cache_enabled)
    if not enable or not (white or black):
        return autocast
    return AutocastWithOpLists(OpListMode(device_type, low, frozenset(white), frozenset(black)), cache_enabled)


def _check_device_type(device_type: str | None) -> str:
    if device_type is None:
        return default_device_type()
    if not isinstance(device_type, str) or device_type not in ("cpu", "cuda"):
        raise ValueError(f"auto_cast(device_type=...) must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("auto_cast(device_type='cuda'): CUDA is not available here; use device_type='cpu'")
    return device_type
