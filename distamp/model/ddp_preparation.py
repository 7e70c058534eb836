"""Preparing a data-parallel model once: the checks, the start-up broadcast, DDP and its comm hook.

:class:`DDPPreparation` is what ``DataParallel.prepare`` runs, once, when the
first optimizer is attached or at the first forward: by then parameter
dtypes are final, so DDP (whose buckets are per dtype) is built exactly once.
Sharding stage 2 gets no DDP but distamp's own reducer
(:mod:`distamp.sharding.slice_reducer`), which keeps no full-size gradient.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distamp.compression.powersgd import PowerSGD
from distamp.core.attached import AttachedOptimizer
from distamp.distributed.comm_hooks import LowPrecisionAllReduce, PendingFp32Grads
from distamp.distributed.comm_threads import check_gloo_workers_found, wait_for_comm_threads
from distamp.distributed.fingerprint import check_ranks_agree
from distamp.distributed.timeouts import named_collective
from distamp.model_views import CONTIGUOUS_FIX, non_contiguous, parameters_device, unwrap_model
from distamp.sharding.buffer_broadcast import buffer_sync
from distamp.sharding.reduce_scatter import ShardedGradReduce, reduce_bucket_bytes
from distamp.sharding.slice_owner import SliceOwner
from distamp.sharding.slice_reducer import SliceReducer
from distamp.strategy import DistributedStrategy
from distamp.torch_compat import DDP_KEYWORDS, DEFAULT_FIRST_BUCKET_BYTES

__all__ = [
    "STAGE2_DDP_KWARGS", "STAGE3_DDP_KWARGS", "DDPPreparation", "PreparedDDP", "later_torch_reason",
    "refuse_stage2_kwargs", "refuse_stage3_kwargs",
]

_LATER_TORCH_DDP_KWARGS = {
    "batched_grad_copy": "2.13",
    "forward_sync_buffers": "2.13",
    "lazy_bucket_allocation": "2.15",
}
"""DDP keyword arguments missing from distamp's oldest supported torch, each with the torch it was checked on."""

STAGE2_DDP_KWARGS = tuple(name for name in ("broadcast_buffers", "forward_sync_buffers", "init_sync", "static_graph")
                          if name in DDP_KEYWORDS)
"""DDP keyword arguments sharding stage 2 (which replaces DDP) honours; ``static_graph`` needs nothing from it."""

STAGE3_DDP_KWARGS = tuple(name for name in ("broadcast_buffers", "forward_sync_buffers") if name in DDP_KEYWORDS)
"""DDP keyword arguments sharding stage 3 (FSDP2, no DDP) honours: its wrapper keeps DDP's buffer broadcast."""

_CHECK_REDUCTION = "deprecated in torch's DDP, where it does nothing: remove it"
_WHOLE_INPUTS = ("not needed: each rank's model gets its inputs whole; DDP's dim only splits them over several "
                 "device_ids")
_AMP_INSTEAD = "set the precision with strategy.amp = True and amp_configs"

_STAGE2_DEVICE = ("stage 2's reducer works on the device distamp trains on (fleet.device(): cuda:LOCAL_RANK with CUDA, "
                  "else the CPU) and moves a CUDA model's inputs there, as DDP's device_ids would")
_STAGE2_BUCKETS = "the bucket size is strategy.fuse_grad_size_in_MB: set that instead"
_STAGE2_NO_DELAY = ("no DDP all-reduce to delay: stage 2's reducer reduce-scatters each bucket as soon as its "
                    "gradients are accumulated")
_STAGE2_INSTEAD = {
    "device_ids": _STAGE2_DEVICE,
    "output_device": _STAGE2_DEVICE,
    "dim": _WHOLE_INPUTS,
    "check_reduction": _CHECK_REDUCTION,
    "gradient_as_bucket_view": "not needed: stage 2's reducer copies each gradient into its 16-bit bucket and frees "
                               ".grad at once, so no full-size gradient is kept to be a view",
    "bucket_cap_mb": _STAGE2_BUCKETS,
    "bucket_cap_mb_list": _STAGE2_BUCKETS,
    "delay_all_reduce_named_params": _STAGE2_NO_DELAY,
    "param_to_hook_all_reduce": _STAGE2_NO_DELAY,
    "mixed_precision": _AMP_INSTEAD,
    "device_mesh": "stage 2's reducer reduces over fleet.distributed_model's process group (the world by default), "
                   "not a DeviceMesh: remove it",
    "skip_all_reduce_unused_params": "not taken: stage 2's reducer reduces every bucket whole (a parameter no rank "
                                     "used as zeros); with find_unused_parameters=True such a parameter keeps "
                                     "grad None in the optimizer, as with DDP",
    "batched_grad_copy": "no DDP buckets: stage 2's reducer copies each gradient into its bucket when autograd has "
                         "accumulated it",
    "lazy_bucket_allocation": "not needed: stage 2's reducer allocates each bucket at its first gradient and frees "
                              "it once reduce-scattered",
}
"""Why stage 2 refuses each DDP keyword argument of torch 2.11-2.15 it does not take, or what to set instead."""

_STAGE3_DEVICE = ("stage 3 shards on the device distamp trains on (fleet.device(): cuda:LOCAL_RANK with CUDA, else "
                  "the CPU)")
_STAGE3_GROUP = "stage 3 shards over every rank fleet.init() started (FSDP2's mesh is built from that group)"
_STAGE3_BUCKETS = "no DDP buckets: sharding_configs['units'] decide what is gathered and reduced together"
_STAGE3_NO_DELAY = ("no DDP all-reduce to delay: FSDP2 reduce-scatters each unit's gradients after its backward; "
                    "sharding_configs['units'] decide which are reduced together")
_STAGE3_INSTEAD = {
    "device_ids": _STAGE3_DEVICE,
    "output_device": _STAGE3_DEVICE,
    "dim": _WHOLE_INPUTS,
    "init_sync": "the parameters are always broadcast from rank 0 before fully_shard",
    "process_group": _STAGE3_GROUP,
    "find_unused_parameters": "not needed: FSDP2 reduce-scatters each unit's gradients after its backward and a "
                              "parameter no rank used keeps none, but every rank must run the same units (a branch "
                              "only some ranks take needs stage 2 with find_unused_parameters)",
    "check_reduction": _CHECK_REDUCTION,
    "static_graph": "not needed: FSDP2 takes no hint",
    "bucket_cap_mb": _STAGE3_BUCKETS,
    "bucket_cap_mb_list": _STAGE3_BUCKETS,
    "gradient_as_bucket_view": "no DDP buckets: each gradient is reduce-scattered into its shard",
    "delay_all_reduce_named_params": _STAGE3_NO_DELAY,
    "param_to_hook_all_reduce": _STAGE3_NO_DELAY,
    "mixed_precision": f"{_AMP_INSTEAD}: stage 3 gives FSDP2 its MixedPrecisionPolicy from them",
    "device_mesh": _STAGE3_GROUP,
    "skip_all_reduce_unused_params": "not needed: FSDP2 reduces only the units whose backward ran (every rank must "
                                     "run the same units)",
    "batched_grad_copy": "no DDP buckets: FSDP2 copies each unit's gradients into its reduce-scatter input at once",
    "lazy_bucket_allocation": "not needed: FSDP2 allocates each unit's reduce-scatter buffer when the unit's "
                              "backward is done and frees it after",
}
"""Why stage 3 refuses each DDP keyword argument of torch 2.11-2.15 it does not take, or what to set instead."""


def later_torch_reason(name: str) -> str | None:
    """Why ``name`` is refused where the installed torch's DDP lacks it; ``None`` for any other name."""
    if name in DDP_KEYWORDS or name not in _LATER_TORCH_DDP_KWARGS:
        return None
    return (f"DDP in the installed torch {torch.__version__} has no such argument (torch "
            f"{_LATER_TORCH_DDP_KWARGS[name]}'s DDP has it): upgrade torch to use it")


def refuse_stage2_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` for DDP keyword arguments of ``fleet.distributed_model`` that stage 2 cannot honour.

    Stage 2 replaces DDP by distamp's reducer; of DDP's options it keeps
    :data:`STAGE2_DDP_KWARGS`. Each other one is named with why it is not
    needed or what to set instead, where there is more to say than that.
    """
    refused = sorted(set(kwargs) - set(STAGE2_DDP_KWARGS))
    if refused:
        reasons = [f"{name}: {_STAGE2_INSTEAD[name]}" for name in refused if name in _STAGE2_INSTEAD]
        raise ValueError(
            f"{refused} are DDP options, but sharding stage 2 replaces DDP by distamp's reducer, which takes only "
            f"{list(STAGE2_DDP_KWARGS)} (and find_unused_parameters); remove the others"
            + (f" ({'; '.join(reasons)})" if reasons else "")
        )


def refuse_stage3_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` for DDP keyword arguments of ``fleet.distributed_model`` that stage 3 cannot honour.

    Stage 3 shards with FSDP2 and builds no DDP; of DDP's options it keeps
    the buffer broadcast (:data:`STAGE3_DDP_KWARGS`). Each other one is
    named with why it is not needed or what to set instead; a buffer option
    the installed torch's DDP lacks, with that.
    """
    refused = [name for name in kwargs if name not in STAGE3_DDP_KWARGS]
    if refused:
        reasons = "; ".join(f"{name}: {_stage3_reason(name)}" for name in refused)
        raise ValueError(
            f"fleet.distributed_model(..., {', '.join(f'{name}=...' for name in refused)}): sharding stage 3 shards "
            f"with torch's FSDP2 and builds no DDP ({reasons}); remove them. Of DDP's keyword arguments stage 3 "
            f"takes only {list(STAGE3_DDP_KWARGS)}"
        )


def _stage3_reason(name: str) -> str:
    if name not in DDP_KEYWORDS and name not in _LATER_TORCH_DDP_KWARGS:
        return "no keyword argument of DDP's"
    return later_torch_reason(name) or _STAGE3_INSTEAD.get(name, "not taken at stage 3")


@dataclass
class PreparedDDP:
    """What a preparation built: DDP and its gradient comm hook (if any), or stage 2's reducer."""

    ddp: DistributedDataParallel | None
    comm_hook: LowPrecisionAllReduce | ShardedGradReduce | PowerSGD | None
    reduce_scatter: bool
    """Sharding stage 1 or 2: every backward communicates, gradient merge's micro-batches included."""
    reducer: SliceReducer | None = None
    """Sharding stage 2: distamp's reducer instead of DDP."""


@dataclass
class DDPPreparation:
    """How ``DataParallel`` builds DDP around its module.

    Args:
        module: the wrapped model, parameter dtypes final.
        strategy: the model's strategy (wire dtype, pre-division, bucket size, sharding).
        process_group: the data-parallel group; ``None`` is the world.
        device: the device this process trains on; ``None``: the parameters' device.
        find_unused_parameters: passed to DDP.
        ddp_kwargs: further keyword arguments for DDP.
    """

    module: nn.Module
    strategy: DistributedStrategy
    process_group: dist.ProcessGroup | None
    device: torch.device | None
    find_unused_parameters: bool
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self, optimizers: list[AttachedOptimizer]) -> PreparedDDP:
        """Check the ranks agree, make them identical and build DDP with its comm hook (collective)."""
        stage = self.check_sharding(optimizers)
        # 0. Ranks that disagree on the strategy or the model fail here, naming the difference,
        #    instead of summing FP16 with BF16 bit patterns or hanging in mismatched collectives.
        check_ranks_agree(self.strategy, self.module)
        with named_collective("the start-up broadcast of parameters from rank 0"):
            # 1. Every rank takes rank 0's FP32 masters; the 16-bit parameters follow from them.
            for opt in optimizers:
                if opt.master_weights.enabled:
                    opt.master_weights.broadcast(src=0, group=self.process_group)
            # 2. DDP (or stage 2's reducer) on the final dtypes; it broadcasts the rest.
            if stage == 2:
                reducer = self._build_reducer(optimizers)
                return PreparedDDP(None, None, True, reducer)
            # Stage 1's buckets are reduce-scattered: sized as stage 2's, so the exchanges stay small, but
            # never below DDP's first bucket: torch.compile's DDPOptimizer refuses later buckets smaller than it.
            cap = self.strategy.fuse_grad_size_in_MB
            if stage == 1:
                cap = max(self._bucket_bytes(), DEFAULT_FIRST_BUCKET_BYTES) / 2**20
            ddp = self._build_ddp(cap)
        comm_hook = self._comm_hook(optimizers, stage == 1)
        if comm_hook is not None:
            comm_hook.register(ddp)
        return PreparedDDP(ddp, comm_hook, stage == 1)

    def _training_device(self) -> torch.device:
        """The device this process trains on: the given one, else the parameters'."""
        return self.device or parameters_device(self.module)

    def _wire_dtype(self) -> torch.dtype:
        return self.strategy.amp_config.comm_torch_dtype if self.strategy.amp else torch.float32

    def _bucket_bytes(self) -> int:
        """The sharded stages' bucket size for this model's gradient (see ``reduce_bucket_bytes``)."""
        numel = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        return reduce_bucket_bytes(numel * self._wire_dtype().itemsize, self.strategy.fuse_grad_size_in_MB)

    def _build_reducer(self, optimizers: list[AttachedOptimizer]) -> SliceReducer:
        """Stage 2: hooks that reduce-scatter 16-bit buckets as gradients arrive (no DDP, no full-size gradient)."""
        # check_sharding made every optimizer stage 2, whose masters are sharded.
        shards: list[SliceOwner] = [opt.master_weights for opt in optimizers]
        buffers = buffer_sync(self.ddp_kwargs.get("broadcast_buffers"), self.ddp_kwargs.get("forward_sync_buffers"))
        reducer = SliceReducer(
            self.module, shards, self._wire_dtype(), self.process_group, PendingFp32Grads(optimizers),
            bucket_bytes=self._bucket_bytes(),
            find_unused_parameters=self.find_unused_parameters,
            broadcast_buffers=buffers.before_forward,
            device=self._training_device(),
        )
        if self.ddp_kwargs.get("init_sync", True):
            reducer.broadcast_from_rank0(buffers=buffers.at_build)
        return reducer

    def _build_ddp(self, bucket_cap_mb: float) -> DistributedDataParallel:
        device = self._training_device()
        ddp = DistributedDataParallel(
            self.module,
            # A single-device CUDA module: DDP moves inputs to device_ids[0]
            # and its reducer works on that device; CPU modules must pass None.
            device_ids=[device] if device.type == "cuda" else None,
            process_group=self.process_group,
            find_unused_parameters=self.find_unused_parameters,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=True,
            **self.ddp_kwargs,
        )
        # torch.compile's DDPOptimizer cuts the forward graph every ddp.bucket_bytes_cap bytes and asserts that
        # torch's default first bucket (1 MiB) is no larger, although DDP given a cap uses that cap for its
        # first bucket too: below 1 MiB compiling would fail (torch-native DDP fails alike). The reducer's
        # buckets were fixed above; this value only sets where the compiled graph is cut.
        ddp.bucket_bytes_cap = max(ddp.bucket_bytes_cap, DEFAULT_FIRST_BUCKET_BYTES)
        # Before the reducer (perhaps the process group's last owner) is freed, let gloo's threads
        # release the comm hook's Python continuations: see wait_for_comm_threads.
        check_gloo_workers_found(self.process_group)
        weakref.finalize(ddp, wait_for_comm_threads)
        return ddp

    def _comm_hook(
        self, optimizers: list[AttachedOptimizer], reduce_scatter: bool
    ) -> LowPrecisionAllReduce | ShardedGradReduce | PowerSGD | None:
        """Stage 1: reduce-scatter into the owners' FP32 slices; PowerSGD; AMP: a 16-bit all-reduce; else DDP's own."""
        cfg = self.strategy.amp_config
        pending = PendingFp32Grads(optimizers)
        if reduce_scatter:
            # check_sharding made every optimizer stage 1, whose masters are sharded.
            shards: list[SliceOwner] = [opt.master_weights for opt in optimizers]
            return ShardedGradReduce(shards, self._wire_dtype(), self.process_group, pending, self._bucket_bytes())
        if self.strategy.powersgd:
            # The optimizer binds itself (DataParallel.bind_compressor): it reports each step's verdict.
            wire = cfg.comm_torch_dtype if self.strategy.amp else None  # AMP off: FP32, float64 kept
            predivide = cfg.gradient_predivide_factor if self.strategy.amp else None
            device = self._training_device()
            # Keyed by the names of the model inside torch.compile's wrapper: its state fits the eager model too.
            params = dict(unwrap_model(self.module).named_parameters())
            return PowerSGD(self.strategy.powersgd_config, params, wire, predivide,
                            self.process_group, pending, device)
        if self.strategy.amp:
            return LowPrecisionAllReduce(
                cfg.comm_torch_dtype, cfg.gradient_predivide_factor, self.process_group, pending
            )
        return None

    def check_sharding(self, optimizers: list[AttachedOptimizer]) -> int:
        """The sharding stage (0: off); raises before any collective on a mismatch.

        Stages 1 and 2 reduce-scatter gradients into the optimizers' slices,
        so model and optimizers must agree on the stage, and every parameter
        that gets a gradient needs an owner.

        Raises:
            RuntimeError: the model's strategy and an attached optimizer's
                disagree on the stage, or a parameter that gets a gradient
                belongs to no sharded optimizer (nobody would own its sum).
            ValueError: a parameter of a sharded optimizer is no longer
                contiguous (see :func:`_check_still_contiguous`).
        """
        strategy = self.strategy
        model_stage = strategy.sharding_config.stage if strategy.sharding else 0
        for opt in optimizers:
            opt_stage = opt.precision.stage
            if opt_stage != model_stage:
                raise RuntimeError(
                    f"the optimizer's strategy has sharding stage {opt_stage or 'off'} but the model's "
                    f"(fleet.distributed_model) has stage {model_stage or 'off'}; stages 1 and 2 change how the "
                    "model communicates gradients (reduce-scattered to the optimizer's slices), so both must use "
                    "the same stage. Pass the same strategy to both calls"
                )
        if model_stage == 0:
            return 0
        owned = {id(p) for opt in optimizers for p in opt.master_weights.model_params}
        missing = [name for name, p in unwrap_model(self.module).named_parameters()
                   if p.requires_grad and id(p) not in owned]
        if missing:
            raise RuntimeError(
                f"sharding stage {model_stage} reduce-scatters each gradient to the optimizer slice that owns it, "
                f"but {missing[:5]} (of {len(missing)}) belong to no optimizer built with "
                "fleet.distributed_optimizer for this model. Give every trainable parameter to such an optimizer, "
                "or set requires_grad=False on the others"
            )
        _check_still_contiguous(self.module, owned, model_stage)
        return model_stage


def _check_still_contiguous(module: nn.Module, owned: set[int], stage: int) -> None:
    """Refuse sharded parameters made non-contiguous after ``fleet.distributed_optimizer`` refused none, by name.

    The optimizer's slices are flat ranges of each parameter; a model moved
    to ``channels_last`` (or given a transposed ``.data``) between the two
    calls failed in the first ``step()`` with torch's "view size is not
    compatible with input tensor's size and stride".

    Raises:
        ValueError: naming each such parameter with its shape and strides, and the fix.
    """
    strided = non_contiguous((name, p) for name, p in unwrap_model(module).named_parameters() if id(p) in owned)
    if strided:
        raise ValueError(
            f"sharding stage {stage}: parameters {', '.join(strided)} are not contiguous (channels_last, or a "
            "transposed view) although they were when fleet.distributed_optimizer cut them into slices, which are "
            "flat ranges of each parameter. Change the memory format before building the optimizer and keep it, "
            f"or make them contiguous again: {CONTIGUOUS_FIX}"
        )
