"""Gradient compression (``strategy.powersgd``): PowerSGD with error feedback on DDP's comm hook.

``powersgd`` is the hook (it satisfies ``distamp.core.attached.GradCompressor``:
its state follows the agreed step verdict), ``low_rank`` its FP32 matrix
side, ``low_rank_kernels`` (``.py`` and ``.c``) its CPU passes, compiled on
first use, ``grad_layout`` which parameter element each entry of the hook's
matrix is (so that saved state follows its element across memory formats). It imports the core, never another capability.
"""
