"""Mixed-precision building blocks: op lists and ``auto_cast``, loss scalers, master weights.

Most users reach these through :mod:`distamp.fleet`; they are usable alone::

    from distamp.amp import auto_cast
    with auto_cast(dtype="bfloat16", custom_black_list=["gelu"]):
        y = model(x)
"""
