"""The training-step builders compared by ``benchmark.py``, one per mode.

What is trained (a :class:`ModelFamily`: the model, its batches and its
loss) lives in ``bench_models``; ``FAMILIES``, :func:`family` and the family
classes are re-exported here.

Every mode trains the same model on the same batch with SGD + momentum:

- ``fp32``: plain ``DistributedDataParallel`` (one process: the bare model, see below).
- ``torch_bf16``: DDP + ``torch.autocast(bfloat16)`` + :func:`bf16_gloo_compress_hook`.
- ``torch_fp16``: DDP + ``torch.autocast(float16)`` + ``GradScaler`` + torch's ``fp16_compress_hook``.
- ``distamp_o{1,2}_{bf16,fp16}``: distamp's meta-optimizer and ``distributed_model``.
- ``distamp_o2_bf16_stage{1,2}``: the same with ``strategy.sharding`` stage 1 or 2;
  ``..._overlap`` adds ``sharding_configs["overlap_param_gather"]``.
- ``torch_bf16_zero``: ``torch_bf16`` with torch's ``ZeroRedundancyOptimizer`` (optimizer
  state sharded by whole parameters), the torch-native counterpart of the stage 1 and 2 modes.
- ``distamp_o2_bf16_stage3``: sharding stage 3 (FSDP2 underneath) with its default units;
  ``torch_bf16_fsdp2``: torch's ``fully_shard`` on the same units with the same
  ``MixedPrecisionPolicy`` (BF16 parameters, BF16 reduction; normalization layers as FP32
  units, as O2 keeps them) and ``torch.autocast(bfloat16)``,
  no loss scaling and no verdict: what distamp adds on top of FSDP2 is the difference.
- ``distamp_o2_bf16_powersgd``: O2 BF16 with ``strategy.powersgd`` (rank and start from
  ``build_runner``); ``torch_bf16_powersgd``: DDP + ``torch.autocast(bfloat16)`` + torch's
  ``powerSGD_hook`` with the same rank and start (its uncompressed tensors go in FP32). On gloo,
  torch's hook hangs when the model has more than one DDP bucket (it issues the P and Q
  all-reduces from future callbacks, so two buckets' collectives can reach the ranks in
  different orders); compare the two with a ``--bucket_mb`` that holds the whole model.

In a one-process world the torch-native modes use the bare model (no DDP),
as distamp's ``DataParallel`` does, so neither side pays for a reducer that
has nothing to reduce. With ``compiled=True`` each mode's model goes
through ``torch.compile``: the DDP (or bare) model for torch-native modes,
the ``fleet.distributed_model`` wrapper for distamp.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Self

import torch
import torch.distributed as dist
from bench_models import (
    FAMILIES,
    CNNFamily,
    GPTFamily,
    LossFn,
    MLPFamily,
    ModelFamily,
    family,
)
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = [
    "COUNTERPART",
    "DEFAULT_MODES",
    "FAMILIES",
    "MODES",
    "CNNFamily",
    "GPTFamily",
    "MLPFamily",
    "ModelFamily",
    "Runner",
    "WireCounter",
    "bf16_gloo_compress_hook",
    "build_runner",
    "family",
]


# ----------------------------------------------------------------------------- modes

DEFAULT_MODES = ("fp32", "torch_bf16", "torch_fp16",
                 "distamp_o1_bf16", "distamp_o2_bf16", "distamp_o1_fp16", "distamp_o2_fp16")
SHARDING_MODES = ("torch_bf16_zero", "distamp_o2_bf16_stage1", "distamp_o2_bf16_stage2",
                  "distamp_o2_bf16_stage1_overlap", "distamp_o2_bf16_stage2_overlap",
                  "torch_bf16_fsdp2", "distamp_o2_bf16_stage3")
POWERSGD_MODES = ("torch_bf16_powersgd", "distamp_o2_bf16_powersgd")
MODES = DEFAULT_MODES + SHARDING_MODES + POWERSGD_MODES

# The torch-native way of doing what each distamp mode does.
COUNTERPART = {"distamp_o1_bf16": "torch_bf16", "distamp_o2_bf16": "torch_bf16",
               "distamp_o1_fp16": "torch_fp16", "distamp_o2_fp16": "torch_fp16",
               **{f"distamp_o2_bf16_stage{n}{overlap}": "torch_bf16_zero"
                  for n in (1, 2) for overlap in ("", "_overlap")},
               "distamp_o2_bf16_stage3": "torch_bf16_fsdp2",
               "distamp_o2_bf16_powersgd": "torch_bf16_powersgd"}


def bf16_gloo_compress_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Like torch's ``fp16_compress_hook`` but BF16, and unlike torch's BF16 hook it runs on gloo.

    (DDP refuses any hook named ``bf16_compress_hook`` without NCCL, hence the name.)

    The bucket is cast to BF16 and pre-divided by the world size, all-reduced
    asynchronously, and written back into the FP32 bucket on completion.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


@dataclass
class Runner:
    """One mode's model and its training step; ``step(x, y)`` returns the detached loss.

    A step is three phases, which ``step_phases.py`` times apart:
    ``forward(x, y)`` (the loss under the mode's autocast), ``backward(loss)``
    (zeroing the gradients first, then the backward with the mode's loss
    scaling and gradient communication) and ``update()`` (unscaling, the
    inf/NaN verdict where the mode has one, the optimizer step).

    ``model`` is what the step calls (compiled when asked). ``ddp`` is the
    torch-native modes' DDP, where a probe may register a hook; ``None`` for
    distamp (which registers its own) and in a one-process world. Call
    ``select()`` before a run of this mode's steps when runners of other
    modes were built since: ``fleet.auto_cast()`` follows the latest strategy.
    """

    mode: str
    model: nn.Module
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    update: Callable[[], None]
    ddp: DDP | None = None
    select: Callable[[], None] = lambda: None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step on ``(x, y)``: the three phases in order; the detached loss."""
        loss = self.forward(x, y)
        self.backward(loss)
        self.update()
        return loss.detach()


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _torch_runner(mode: str, model: nn.Module, loss_fn: LossFn, device: torch.device, lr: float,
                  bucket_mb: float, compiled: bool, powersgd: tuple[int, int]) -> Runner:
    dtype = {"fp32": None, "torch_bf16": torch.bfloat16, "torch_fp16": torch.float16,
             "torch_bf16_zero": torch.bfloat16, "torch_bf16_powersgd": torch.bfloat16,
             "torch_bf16_fsdp2": torch.bfloat16}[mode]
    ddp = None
    if mode.endswith("_fsdp2"):
        _fully_shard_like_stage3(model, device)
    elif _multi_rank():  # one process: the bare model, as distamp's DataParallel calls it
        ids = [device.index] if device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids, bucket_cap_mb=bucket_mb)
        if mode.endswith("_powersgd"):
            rank, start = powersgd
            state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                                 start_powerSGD_iter=start)
            ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        elif dtype is torch.bfloat16:
            ddp.register_comm_hook(None, bf16_gloo_compress_hook)
        elif dtype is torch.float16:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    net = ddp if ddp is not None else model
    forward = torch.compile(net) if compiled else net
    if mode.endswith("_zero") and _multi_rank():
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=lr, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None

    def run_forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            return loss_fn(forward(x), y)

    def run_backward(loss: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        (loss if scaler is None else scaler.scale(loss)).backward()

    def run_update() -> None:
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    return Runner(mode, forward, run_forward, run_backward, run_update, ddp)


def _fully_shard_like_stage3(model: nn.Module, device: torch.device) -> None:
    """torch's ``fully_shard`` on stage 3's default units, then the root: BF16 parameters and reduction.

    Normalization layers are units of their own with FP32 parameters, as stage 3 makes O2's FP32
    modules (``keep_norm_fp32``): a BF16 ``BatchNorm`` weight beside its FP32 running statistics
    fails in ``batch_norm`` on CPU ("expected scalar type BFloat16 but found Float").
    """
    from distamp.amp.fp32_parameters import fp32_modules
    from distamp.sharding.shard_units import choose_units

    if not dist.is_initialized():
        raise RuntimeError("torch_bf16_fsdp2 shards over the process group: initialise it first")
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)
    norms = fp32_modules(model, (), True)
    norm_ids = {id(m) for _, m in norms}
    units = {id(m): (name, m) for name, m in [*choose_units(model, ()), *norms]}
    for _, unit in sorted(units.values(), key=lambda item: -item[0].count(".")):
        fully_shard(unit, mesh=mesh, mp_policy=fp32 if id(unit) in norm_ids else policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _distamp_runner(mode: str, model: nn.Module, loss_fn: LossFn, lr: float, bucket_mb: float,
                    compiled: bool, powersgd: tuple[int, int]) -> Runner:
    from distamp import fleet

    _, level, short, *sharding = mode.split("_")
    compress = sharding == ["powersgd"]
    if compress:
        sharding = []
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"use_pure_fp16": level == "o2",
                            "dtype": {"bf16": "bfloat16", "fp16": "float16"}[short]}
    if sharding:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": int(sharding[0].removeprefix("stage")),
                                     "overlap_param_gather": sharding[1:] == ["overlap"]}
    if compress:
        strategy.powersgd = True
        strategy.powersgd_configs = {"rank": powersgd[0], "start_step": powersgd[1]}
    if not sharding or sharding[0] != "stage3":  # stage 3 refuses it: its units set the message sizes
        strategy.fuse_grad_size_in_MB = bucket_mb
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    forward = torch.compile(wrapped) if compiled else wrapped

    def run_forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with fleet.auto_cast():
            return loss_fn(forward(x), y)

    def run_backward(loss: torch.Tensor) -> None:
        optimizer.zero_grad()
        optimizer.backward(loss)

    return Runner(mode, forward, run_forward, run_backward, optimizer.step,
                  select=lambda: fleet.init(strategy=strategy))


def build_runner(mode: str, fam: ModelFamily, device: torch.device, *, seed: int = 0, lr: float = 0.01,
                 bucket_mb: float = 25.0, compiled: bool = False, powersgd_rank: int = 4,
                 powersgd_start: int = 2) -> Runner:
    """A fresh model of ``fam`` (same seed for every mode), set up for data parallelism in ``mode``.

    ``compiled``: ``torch.compile`` the model the step calls; compilation
    happens at its first steps. ``powersgd_rank`` and ``powersgd_start``: the
    ``*_powersgd`` modes' rank and the steps of plain all-reduce before compression.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)!r}, got {mode!r}")
    model = fam.build(seed).to(device)
    if mode.startswith("distamp_"):
        return _distamp_runner(mode, model, fam.loss, lr, bucket_mb, compiled, (powersgd_rank, powersgd_start))
    return _torch_runner(mode, model, fam.loss, device, lr, bucket_mb, compiled, (powersgd_rank, powersgd_start))


# ----------------------------------------------------------------------------- wire bytes

def _tensor_bytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_tensor_bytes(a) for a in arg)
    return 0


class WireCounter:
    """Counts the bytes each rank sends in every collective and send issued through ``ProcessGroup`` while active.

    ``dist.all_reduce``, DDP comm hooks and torch's compression hooks all
    call these methods; DDP's built-in C++ all-reduce (no hook registered)
    does not, so a probe registers torch's ``allreduce_hook`` there, which
    sends the same bytes. What a rank sends is derived from its input
    payload S with W ranks, as bandwidth-optimal (ring / pairwise)
    algorithms move it: all-reduce 2(W-1)/W x S (each element leaves twice,
    once reduced), reduce-scatter and all-to-all (W-1)/W x S (each element
    once, but the rank's own share), all-gather (W-1) x S (its slice to every
    other rank), broadcast (W-1)/W x S (the root's S reaches W-1 ranks; every
    rank calls it, so this is the mean over ranks), a point-to-point send its
    payload. At W=2 an all-reduce sends exactly its payload.
    """

    # Per ProcessGroup method: the positional argument holding the input, and
    # the bytes sent per input byte as a function of the world size.
    _SENT: ClassVar[dict[str, tuple[int, Callable[[int], float]]]] = {
        **dict.fromkeys(("allreduce", "allreduce_coalesced"), (0, lambda w: 2 * (w - 1) / w)),
        "broadcast": (0, lambda w: (w - 1) / w),
        "send": (0, lambda w: 1.0),
        **dict.fromkeys(("allgather", "_allgather_base", "all_gather_single"), (1, lambda w: float(w - 1))),
        **dict.fromkeys(("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "alltoall_base",
                         "all_to_all_single"), (1, lambda w: (w - 1) / w)),
    }

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> Self:
        for name, (index, sent_per_byte) in self._SENT.items():
            original = getattr(dist.ProcessGroup, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(pg, *args, _original=original, _name=name, _index=index, _sent=sent_per_byte, **kwargs):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                if len(args) > _index:
                    sent = round(_tensor_bytes(args[_index]) * _sent(pg.size()))
                    self.bytes[_name] = self.bytes.get(_name, 0) + sent
                return _original(pg, *args, **kwargs)

            setattr(dist.ProcessGroup, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist.ProcessGroup, name, original)
        self._saved.clear()

    def reset(self) -> None:
        """Forget what was counted so far."""
        self.bytes.clear()
        self.calls.clear()

    @property
    def total_bytes(self) -> int:
        """Bytes this rank sent over all counted collectives."""
        return sum(self.bytes.values())
