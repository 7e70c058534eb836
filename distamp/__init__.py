"""distamp: distributed mixed-precision training for PyTorch, Fleet-style.

The entry point is :mod:`distamp.fleet`::

    from distamp import fleet
    fleet.init()
"""

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
