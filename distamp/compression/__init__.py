"""Gradient compression (``strategy.powersgd``): PowerSGD with error feedback on DDP's comm hook.

``powersgd`` is the hook (it satisfies ``distamp.core.attached.GradCompressor``:
its state follows the agreed step verdict), ``low_rank`` its FP32 matrix
side, ``low_rank_kernels`` (``.py`` and ``.c``) its CPU passes, compiled on
first use (the gradient indexed as its parameter whatever the memory
format comes from ``distamp.distributed.grad_layout``). It imports the
core, never another capability.
"""
