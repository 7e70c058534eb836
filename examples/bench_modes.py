"""Model families and training-step builders compared by ``benchmark.py``.

A :class:`ModelFamily` says what is trained: how the model is built, what a
batch looks like and which loss it takes. ``FAMILIES`` names them: MLPs on
``(batch, 1024)`` features (``mlp``, ``shallow``, ``deep``), a conv net with
BatchNorm on 64x64 images (``cnn``) and decoder-only transformers on token
sequences (``gpt``, and ``tiny_gpt`` where per-op overhead dominates).

Every mode trains the same model on the same batch with SGD + momentum:

- ``fp32``: plain ``DistributedDataParallel`` (one process: the bare model, see below).
- ``torch_bf16``: DDP + ``torch.autocast(bfloat16)`` + :func:`bf16_gloo_compress_hook`.
- ``torch_fp16``: DDP + ``torch.autocast(float16)`` + ``GradScaler`` + torch's ``fp16_compress_hook``.
- ``distamp_o{1,2}_{bf16,fp16}``: distamp's meta-optimizer and ``distributed_model``.
- ``distamp_o2_bf16_stage{1,2}``: the same with ``strategy.sharding`` stage 1 or 2.
- ``torch_bf16_zero``: ``torch_bf16`` with torch's ``ZeroRedundancyOptimizer`` (optimizer
  state sharded by whole parameters), the torch-native counterpart of the stage modes.

In a one-process world the torch-native modes use the bare model (no DDP),
as distamp's ``DataParallel`` does, so neither side pays for a reducer that
has nothing to reduce. With ``compiled=True`` each mode's model goes
through ``torch.compile``: the DDP (or bare) model for torch-native modes,
the ``fleet.distributed_model`` wrapper for distamp.
"""

import abc
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Self

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
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

IN_FEATURES = 1024
CLASSES = 10

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------- model families

class ModelFamily(abc.ABC):
    """What a benchmark trains: a model, the batches it takes and its loss.

    Subclasses are frozen dataclasses whose fields are the sizes, so a
    family with other sizes is ``dataclasses.replace(family, ...)``.
    """

    default_batch: int
    """Per-rank batch when ``--batch`` is not given."""

    SIZES: ClassVar[tuple[str, ...]] = ()
    """Fields that :func:`family` may override (the benchmark's size options)."""

    def build(self, seed: int) -> nn.Module:
        """The model with weights drawn from ``seed`` (on the CPU, in FP32)."""
        torch.manual_seed(seed)
        return self._module()

    @abc.abstractmethod
    def _module(self) -> nn.Module: ...

    @abc.abstractmethod
    def make_batch(self, batch_size: int, generator: torch.Generator,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of ``batch_size`` samples drawn from ``generator``, on ``device``."""

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss of the model's ``output`` against targets ``y``."""
        return F.cross_entropy(output, y)

    @abc.abstractmethod
    def describe(self) -> str:
        """A few words on the architecture and its sizes (for the report)."""


def _mlp(sizes: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class MLPFamily(ModelFamily):
    """Linear-ReLU stacks on random ``(batch, sizes[0])`` features, ``sizes[-1]`` classes."""

    sizes: tuple[int, ...]
    default_batch: int = 64

    def _module(self) -> nn.Module:
        return _mlp(self.sizes)

    def make_batch(self, batch_size, generator, device):
        x = torch.randn(batch_size, self.sizes[0], generator=generator)
        y = torch.randint(0, self.sizes[-1], (batch_size,), generator=generator)
        return x.to(device), y.to(device)

    def describe(self) -> str:
        return f"MLP, {len(self.sizes) - 1} Linear layers, {self.sizes[0]} features, {self.sizes[-1]} classes"


@dataclass(frozen=True)
class CNNFamily(ModelFamily):
    """conv3x3-BatchNorm-ReLU blocks, global average pool, Linear; random images and labels.

    ``strides`` downsample where they are 2. BatchNorm is what separates
    precision engines on conv nets: under ``torch.autocast`` it keeps its
    input's dtype, so activations stay 16-bit between convolutions.
    """

    channels: tuple[int, ...] = (32, 32, 64, 64, 64, 128, 128)
    strides: tuple[int, ...] = (1, 1, 2, 1, 1, 2, 1)
    image_size: int = 64
    classes: int = CLASSES
    default_batch: int = 32

    SIZES: ClassVar[tuple[str, ...]] = ("image_size",)

    def __post_init__(self) -> None:
        if not isinstance(self.image_size, int) or self.image_size < 1:
            raise ValueError(f"CNN image_size must be an integer >= 1, got {self.image_size!r}")

    def _module(self) -> nn.Module:
        layers: list[nn.Module] = []
        for c_in, c_out, stride in zip((3, *self.channels[:-1]), self.channels, self.strides, strict=True):
            layers += [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
                       nn.BatchNorm2d(c_out), nn.ReLU()]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(self.channels[-1], self.classes)]
        return nn.Sequential(*layers)

    def make_batch(self, batch_size, generator, device):
        x = torch.randn(batch_size, 3, self.image_size, self.image_size, generator=generator)
        y = torch.randint(0, self.classes, (batch_size,), generator=generator)
        return x.to(device), y.to(device)

    def describe(self) -> str:
        return (f"CNN, {len(self.channels)} conv3x3-BN-ReLU ({'-'.join(map(str, self.channels))} channels), "
                f"{self.image_size}x{self.image_size} images")


class _CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    """Token + learned position embeddings, blocks, final LayerNorm, head tied to the token embedding."""

    def __init__(self, cfg: "GPTFamily") -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.Sequential(*(_Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers)))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # GPT-2's initialisation: N(0, 0.02) weights (N(0, 1) embeddings would make the
        # tied head's first logits huge), zero biases.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.blocks(self.tok(tokens) + self.pos(positions))
        return F.linear(self.ln_f(h), self.tok.weight)


@dataclass(frozen=True)
class GPTFamily(ModelFamily):
    """A small GPT trained on next-token prediction over random token sequences.

    Causal self-attention is ``F.scaled_dot_product_attention(is_causal=True)``
    (the fused kernel autocast knows); the MLP is Linear-GELU-Linear, 4x wide.
    """

    vocab: int = 4096
    seq_len: int = 128
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    default_batch: int = 8

    SIZES: ClassVar[tuple[str, ...]] = ("vocab", "seq_len", "d_model", "layers", "heads")

    def __post_init__(self) -> None:
        for name in self.SIZES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT {name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.heads:
            raise ValueError(f"GPT d_model={self.d_model!r} must be a multiple of heads={self.heads!r}")

    def _module(self) -> nn.Module:
        return _GPT(self)

    def make_batch(self, batch_size, generator, device):
        tokens = torch.randint(0, self.vocab, (batch_size, self.seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), y.flatten())

    def describe(self) -> str:
        return (f"GPT, d_model {self.d_model}, {self.layers} layers, {self.heads} heads, "
                f"vocab {self.vocab}, sequence {self.seq_len}")


FAMILIES: dict[str, ModelFamily] = {
    # 6.56M parameters, about 13 MB of 16-bit gradients per step.
    "mlp": MLPFamily((IN_FEATURES, 2048, 2048, 128, CLASSES)),
    # Few, large tensors (4): per-parameter overhead is negligible.
    "shallow": MLPFamily((IN_FEATURES, 4096, CLASSES)),
    # 66 small linear layers (132 tensors): exposes per-parameter Python overhead.
    "deep": MLPFamily((IN_FEATURES, *[256] * 65, CLASSES)),
    # 0.33M parameters, activation-bound: BatchNorm decides how many bytes each activation takes.
    "cnn": CNNFamily(),
    # About 4.2M parameters (1M of them the tied embedding).
    "gpt": GPTFamily(),
    # About 0.1M parameters in many small ops: per-op overhead dominates (measure with --threads 1).
    "tiny_gpt": GPTFamily(vocab=256, seq_len=64, d_model=32, layers=6, heads=4, default_batch=2),
}


def family(name: str, **sizes: int) -> ModelFamily:
    """The family called ``name``, with ``sizes`` (names from its ``SIZES``) replacing its own.

    Raises:
        ValueError: an unknown name, a size the family does not take, or
            a size out of range.
    """
    if name not in FAMILIES:
        raise ValueError(f"model must be one of {sorted(FAMILIES)!r}, got {name!r}")
    base = FAMILIES[name]
    unknown = sorted(set(sizes) - set(base.SIZES))
    if unknown:
        allowed = f"it takes {list(base.SIZES)!r}" if base.SIZES else "it has none to override"
        raise ValueError(f"model {name!r} does not take the sizes {unknown!r}; {allowed}")
    return dataclasses.replace(base, **sizes) if sizes else base


# ----------------------------------------------------------------------------- modes

DEFAULT_MODES = ("fp32", "torch_bf16", "torch_fp16",
                 "distamp_o1_bf16", "distamp_o2_bf16", "distamp_o1_fp16", "distamp_o2_fp16")
SHARDING_MODES = ("torch_bf16_zero", "distamp_o2_bf16_stage1", "distamp_o2_bf16_stage2")
MODES = DEFAULT_MODES + SHARDING_MODES

# The torch-native way of doing what each distamp mode does.
COUNTERPART = {"distamp_o1_bf16": "torch_bf16", "distamp_o2_bf16": "torch_bf16",
               "distamp_o1_fp16": "torch_fp16", "distamp_o2_fp16": "torch_fp16",
               "distamp_o2_bf16_stage1": "torch_bf16_zero", "distamp_o2_bf16_stage2": "torch_bf16_zero"}


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

    ``model`` is what the step calls (compiled when asked). ``ddp`` is the
    torch-native modes' DDP, where a probe may register a hook; ``None`` for
    distamp (which registers its own) and in a one-process world. Call
    ``select()`` before a run of this mode's steps when runners of other
    modes were built since: ``fleet.auto_cast()`` follows the latest strategy.
    """

    mode: str
    model: nn.Module
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ddp: DDP | None = None
    select: Callable[[], None] = lambda: None


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _torch_runner(mode: str, model: nn.Module, loss_fn: LossFn, device: torch.device, lr: float,
                  bucket_mb: float, compiled: bool) -> Runner:
    dtype = {"fp32": None, "torch_bf16": torch.bfloat16, "torch_fp16": torch.float16,
             "torch_bf16_zero": torch.bfloat16}[mode]
    ddp = None
    if _multi_rank():  # one process: the bare model, as distamp's DataParallel calls it
        ids = [device.index] if device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids, bucket_cap_mb=bucket_mb)
        if dtype is torch.bfloat16:
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

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_fn(forward(x), y)
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    return Runner(mode, forward, step, ddp)


def _distamp_runner(mode: str, model: nn.Module, loss_fn: LossFn, lr: float, bucket_mb: float,
                    compiled: bool) -> Runner:
    from distamp import fleet

    _, level, short, *stage = mode.split("_")
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"use_pure_fp16": level == "o2",
                            "dtype": {"bf16": "bfloat16", "fp16": "float16"}[short]}
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": int(stage[0].removeprefix("stage"))}
    strategy.fuse_grad_size_in_MB = bucket_mb
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    forward = torch.compile(wrapped) if compiled else wrapped

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with fleet.auto_cast():
            loss = loss_fn(forward(x), y)
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.step()
        return loss.detach()

    return Runner(mode, forward, step, select=lambda: fleet.init(strategy=strategy))


def build_runner(mode: str, fam: ModelFamily, device: torch.device, *, seed: int = 0, lr: float = 0.01,
                 bucket_mb: float = 25.0, compiled: bool = False) -> Runner:
    """A fresh model of ``fam`` (same seed for every mode), set up for data parallelism in ``mode``.

    ``compiled``: ``torch.compile`` the model the step calls; compilation
    happens at its first steps.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)!r}, got {mode!r}")
    model = fam.build(seed).to(device)
    if mode.startswith("distamp_"):
        return _distamp_runner(mode, model, fam.loss, lr, bucket_mb, compiled)
    return _torch_runner(mode, model, fam.loss, device, lr, bucket_mb, compiled)


# ----------------------------------------------------------------------------- wire bytes

def _tensor_bytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_tensor_bytes(a) for a in arg)
    return 0


class WireCounter:
    """Counts the bytes each rank sends in every collective issued through ``ProcessGroup`` while active.

    ``dist.all_reduce``, DDP comm hooks and torch's compression hooks all
    call these methods; DDP's built-in C++ all-reduce (no hook registered)
    does not, so a probe registers torch's ``allreduce_hook`` there, which
    sends the same bytes. What a rank sends is derived from its input
    payload S with W ranks, as bandwidth-optimal (ring / pairwise)
    algorithms move it: all-reduce 2(W-1)/W x S (each element leaves twice,
    once reduced), reduce-scatter and all-to-all (W-1)/W x S (each element
    once, but the rank's own share), all-gather (W-1) x S (its slice to every
    other rank), broadcast (W-1)/W x S (the root's S reaches W-1 ranks; every
    rank calls it, so this is the mean over ranks). At W=2 an all-reduce
    sends exactly its payload.
    """

    # Per ProcessGroup method: the positional argument holding the input, and
    # the bytes sent per input byte as a function of the world size.
    _SENT: ClassVar[dict[str, tuple[int, Callable[[int], float]]]] = {
        **dict.fromkeys(("allreduce", "allreduce_coalesced"), (0, lambda w: 2 * (w - 1) / w)),
        "broadcast": (0, lambda w: (w - 1) / w),
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
