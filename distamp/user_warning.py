"""Warnings that point at the user's line, not at the distamp line that noticed the problem.

Frames of distamp and of torch are passed over: ``optimizer.step()`` reaches
distamp through torch's optimizer wrapper, a forward hook through
``Module.__call__``; the line to show is the user's call.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

import torch

__all__ = ["warn_user"]

_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))


def _inside_library(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    if filename == "<string>":  # a dataclass's generated __init__
        return True
    return os.path.abspath(filename).startswith(_LIBRARY_DIRS)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first calling frame outside distamp and torch."""
    frame: FrameType | None = sys._getframe(1)  # warn_user's caller: stacklevel 2
    level = 2
    while frame is not None and _inside_library(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
