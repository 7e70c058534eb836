"""One rank's random-number generator states, saved and restored.

Saved: Python's ``random``, NumPy's global generator (when NumPy is
installed), torch's CPU generator and, once CUDA is in use, the generator
of this rank's current CUDA device, the one its kernels draw from. It is
restored onto the current device of the resuming rank, whatever its index:
the stream belongs to the rank, not to a physical GPU.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, cast

import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain numbers (``weights_only``-loadable)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy_state = _numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    # Only once CUDA is initialised: asking earlier would initialise it in a CPU job.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        state["cuda"] = {"device": int(device), "state": torch.cuda.get_rng_state(device)}
    return state


def set_rng_state(state: Mapping[str, Any]) -> list[str]:
    """Restore what :func:`get_rng_state` saved; returns the generators left unrestored.

    ``"cuda"`` is in the result when the checkpoint has a CUDA state but no
    CUDA device is available here, or when this process uses CUDA but the
    checkpoint has no CUDA state (it was saved by a CPU job).
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    missing = []
    if "numpy" in state and not _set_numpy_state(state["numpy"]):
        missing.append("numpy")
    if not _set_cuda_state(state.get("cuda")):
        missing.append("cuda")
    return missing


def _numpy_state() -> dict[str, Any] | None:
    try:
        import numpy as np
    except ImportError:
        return None
    # legacy=True (the default) always gives the tuple form; the stub's return type includes the dict form.
    kind, keys, pos, has_gauss, cached = cast("tuple[str, Any, int, int, float]", np.random.get_state())
    return {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _set_numpy_state(s: Mapping[str, Any]) -> bool:
    try:
        import numpy as np
    except ImportError:
        return False
    np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                         s["cached_gaussian"]))
    return True


def _set_cuda_state(saved: Any) -> bool:
    """Restore the current device's CUDA generator; False when that was not possible."""
    if saved is None:
        # Nothing saved: fine unless this process draws from a CUDA generator.
        return not (torch.cuda.is_available() and torch.cuda.is_initialized())
    if not torch.cuda.is_available():
        return False
    device = torch.cuda.current_device()
    if isinstance(saved, (list, tuple)):
        # Checkpoints of format 1 saved every visible device's state; a rank
        # drew from its current device, so that index is the best match.
        if device >= len(saved):
            return False
        saved = {"state": saved[device]}
    torch.cuda.set_rng_state(saved["state"], device)
    return True
