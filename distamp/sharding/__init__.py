"""Sharding (ZeRO stages 1-3, ``strategy.sharding``): everything a change to sharding touches.

Stages 1-2 (each rank owns a contiguous slice of the flat parameter space):
``sharded_precision`` (the precision plugin), ``sharded_masters`` and
``slice_grads`` (the slice's FP32 masters and gradient; the slices are
``distamp.core.flat_layout``'s), ``reduce_scatter`` (16-bit wire, FP32 sum; stage 1's DDP comm
hook), ``slice_reducer`` (stage 2's reducer instead of DDP), ``param_gather``,
``direct_gather``, ``pairwise`` and ``wire_rounds`` (the all-gather of updated
slices), ``param_gather_hooks`` (``overlap_param_gather``), ``slice_owner``
(the protocols the reducers read).

Stage 3 on torch's FSDP2: ``fully_sharded`` (``FullyShardedModel``),
``shard_units``, ``fsdp_policy``, ``fsdp_comms`` (the 16-bit wire and gloo's
gather as FSDP2 collectives), ``fully_sharded_precision`` (the plugin; the
FP32 DTensor shards are the masters), ``dtensor_state`` (state as whole
tensors or this rank's rows, ``distamp.core.shard_rows``).

Checkpoints learn where a plugin's state lies only from its
``checkpoint_layout`` (the core's interface) and re-slice it in
``distamp.checkpoint.flat_state``; they import nothing from this package.

``global_clip`` combines each rank's part of the gradient norm; ``buffer_broadcast`` keeps DDP's
``broadcast_buffers`` rule for stage 2's reducer and stage 3's model, which replace DDP. The package
imports the core (``distamp.core``, ``distamp.distributed``,
``distamp.scaling``, ``distamp.strategy``), never ``amp`` or ``compression``.
"""
