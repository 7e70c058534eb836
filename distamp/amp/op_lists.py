"""Moved to :mod:`distamp.amp.op_names`; this name keeps old imports working.

distamp no longer keeps its own white and black op lists: ``auto_cast`` is
``torch.autocast``, whose per-device lists are the defaults.
"""

from distamp.amp.op_names import (
    OP_ALIASES,
    canonical_op_name,
    expand_op_names,
    is_inplace_op_name,
    is_known_op,
    known_op_names,
)

__all__ = ["OP_ALIASES", "canonical_op_name", "expand_op_names", "is_inplace_op_name", "is_known_op", "known_op_names"]
