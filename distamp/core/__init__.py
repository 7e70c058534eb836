"""The core every capability builds on: the precision plugin and the interfaces, as in Fleet's meta-optimizer base.

A capability plugs into the meta-optimizer (``distamp.optim``) and the model
wrappers (``distamp.model``, stage 3's ``FullyShardedModel``) only through
what is defined here:

* :class:`~distamp.core.precision.FullPrecision` (``core/precision.py``): the
  optimizer-side plugin. At bind time the composer picks one per strategy
  (``optim/precision_choice.py``); at backward it scales the loss
  (``scale_loss``) and hears when a merge window closes (``after_backward``);
  at step it unscales and checks (``unscale_and_check``), runs the inner
  step and writes masters back on an applied step (``apply_update``; O2 chunk
  by chunk, :mod:`~distamp.core.chunked_update`), applies the agreed verdict
  to its scaler (``update``), ends the step (``end_step``: stage 3 frees its
  gradient shards there) and clips (``clip_grad_norm_``); at save and
  load it gives and takes its state (``checkpoint_state`` /
  ``load_checkpoint_state``) and says where that state lies in the flat
  parameter space (``checkpoint_layout``: whole, a slice, or per-parameter
  rows), which is all ``distamp.checkpoint`` needs to re-slice it. ``MixedPrecision`` (O1) and
  ``PureLowPrecision`` (O2) are here; sharding's plugins subclass them.
* :mod:`~distamp.core.attached`: the model side's protocols
  (``AttachedOptimizer``, ``FullyShardedOptimizer``: what a wrapper reads of
  the optimizer), ``GradCompressor`` (what the optimizer needs of a
  gradient compressor: bind to the loss scale, resolve each verdict, state)
  and ``ModelPrecision`` (what a wrapper needs of ``distamp.amp``).
* :mod:`~distamp.core.master_weights` and :mod:`~distamp.core.grad_accumulator`:
  O2's FP32 masters and FP32 gradient merge, which the plugins hold;
  :mod:`~distamp.core.reused_leaf_grads`: O2 lets autograd sum a tied
  parameter's gradients in place (one copy fewer of the largest gradient);
  :mod:`~distamp.core.flat_layout` (the parameters laid end to end, cut into
  one slice per rank) and :mod:`~distamp.core.shard_rows` (the dim-0 rows of
  FSDP2's shards): the two layouts sharded state comes in, shared by
  ``distamp.sharding`` and ``distamp.checkpoint``.

Whether a capability applies to a strategy is decided before any of this
runs, by ``distamp.strategy.applicability`` (Fleet's ``_can_apply``).
"""
