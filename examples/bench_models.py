"""Model families the benchmark trains (``examples/benchmark.py``, via ``bench_modes``).

A :class:`ModelFamily` says what is trained: how the model is built, what a
batch looks like and which loss it takes. ``FAMILIES`` names them: MLPs on
``(batch, 1024)`` features (``mlp``, ``shallow``, ``deep``), a conv net with
BatchNorm on 64x64 images (``cnn``) and decoder-only transformers on token
sequences (``gpt``, and ``tiny_gpt`` where per-op overhead dominates).
:func:`family` gives one with other sizes.
"""

import abc
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CLASSES",
    "FAMILIES",
    "IN_FEATURES",
    "CNNFamily",
    "GPTFamily",
    "LossFn",
    "MLPFamily",
    "ModelFamily",
    "family",
]

IN_FEATURES = 1024
CLASSES = 10

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
