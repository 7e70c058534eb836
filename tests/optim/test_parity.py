"""O1 with default lists is bitwise torch.autocast + GradScaler on the models people train."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.amp import auto_cast
from distamp.optim import AmpOptimizer
from distamp.strategy import DistributedStrategy


class ConvBN(nn.Module):
    """conv-BN-ReLU x3, global pool, linear: BatchNorm's statistics and buffers included."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for cin, cout, stride in ((3, 4, 1), (4, 8, 2), (8, 8, 1)):
            layers += [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class TinyGPT(nn.Module):
    """Tied embeddings, pre-LayerNorm blocks with SDPA causal attention and a GELU MLP."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, blocks: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
                           "ln2": nn.LayerNorm(d), "up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d)})
            for _ in range(blocks)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        h = self.tok(idx) + self.pos[:t]
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](h)).view(b, t, 3, self.heads, -1).unbind(2)
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            h = h + blk["proj"](att.transpose(1, 2).reshape(b, t, -1))
            h = h + blk["down"](F.gelu(blk["up"](blk["ln2"](h))))
        return self.head(self.ln_f(h))


def _convbn_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(steps)]


def _gpt_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 32, (2, 9), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


FAMILIES = {"convbn": (ConvBN, _convbn_batches), "gpt": (TinyGPT, _gpt_batches)}
OVERFLOW_STEP = 2


def _scale_for(step: int, loss: torch.Tensor) -> torch.Tensor:
    # An inf in the loss at one step makes both loops skip it and back off.
    return loss * float("inf") if step == OVERFLOW_STEP else loss


def _distamp_run(model: nn.Module, batches, dtype: torch.dtype, inner_cls, scale: float) -> tuple[list[bool], float]:
    strategy = DistributedStrategy(amp=True)
    scaling = {"init_loss_scaling": scale, "decr_every_n_nan_or_inf": 1, "incr_every_n_steps": 2}
    strategy.amp_configs = {"dtype": "float16", **scaling} if dtype == torch.float16 else {"dtype": "bfloat16"}
    opt = AmpOptimizer(inner_cls(model.parameters()), strategy)
    applied = []
    for step, (x, y) in enumerate(batches):
        with auto_cast(dtype=dtype):
            loss = _scale_for(step, _loss(model(x), y))
        opt.zero_grad()
        opt.backward(loss)
        applied.append(opt.step())
    return applied, opt.get_loss_scaling()


def _torch_run(model: nn.Module, batches, dtype: torch.dtype, inner_cls, scale: float) -> tuple[list[bool], float]:
    opt = inner_cls(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=2, enabled=dtype == torch.float16)
    applied = []
    for step, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=dtype):
            loss = _scale_for(step, _loss(model(x), y))
        opt.zero_grad()
        scaler.scale(loss).backward()
        before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(opt)
        scaler.update()
        if scaler.is_enabled():
            applied.append(scaler.get_scale() >= before)
        else:
            applied.append(all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None))
    return applied, scaler.get_scale() if scaler.is_enabled() else 1.0


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("inner", ["sgd_momentum", "adamw"])
def test_o1_is_bitwise_torch_autocast_and_grad_scaler(family, dtype, inner):
    build, batches_fn = FAMILIES[family]
    inner_cls = {
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    }[inner]
    torch.manual_seed(0)
    ours = build()
    theirs = copy.deepcopy(ours)
    batches = batches_fn(5)
    applied, scale = _distamp_run(ours, batches, dtype, inner_cls, 1024.0)
    if dtype == torch.bfloat16:
        # BF16 has no loss scaling; torch has no GradScaler for it, so skip the overflow there.
        expected_applied = [step != OVERFLOW_STEP for step in range(len(batches))]
        assert applied == expected_applied
        assert scale == 1.0
        _torch_bf16_reference(theirs, batches, inner_cls)
    else:
        expected = _torch_run(theirs, batches, dtype, inner_cls, 1024.0)
        assert (applied, scale) == expected
        assert applied[OVERFLOW_STEP] is False
    for (name, p), q in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def _torch_bf16_reference(model: nn.Module, batches, inner_cls) -> None:
    """torch.autocast(bfloat16), skipping the step whose gradients are not finite."""
    opt = inner_cls(model.parameters())
    for step, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _scale_for(step, _loss(model(x), y))
        opt.zero_grad()
        loss.float().backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):
            opt.step()
