"""overlap_param_gather never lets a forward read a stale parameter, whoever reads it.

Each model reads some parameter outside the module that owns it: torch's
``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling
``out_proj``; ``nn.TransformerEncoderLayer`` and ``nn.Transformer`` hold
such attentions; one model ties a weight into a later module and has a
module read a sibling's weight through a plain reference. Two ranks train
each in O2 BF16 AdamW with sharding stage 2, with and without
``overlap_param_gather``, on gathers of many small rounds: bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers
from tests.sharding.test_sharding import _flat, _strategy

STEPS, PER_RANK, D = 6, 2, 8


class AttentionLast(nn.Module):
    """Parameters listed ``inp``, ``post``, ``attn``; the forward runs ``inp`` -> ``attn`` -> ``post``.

    ``post`` ends rank 0's slice of the flat space and ``out_proj`` rank 1's, so both are in the last round, after
    the one that finishes ``attn``'s own ``in_proj``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.post = nn.Linear(D, 4 * D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.post(self.attn(h, h, h, need_weights=False)[0])


class Reader(nn.Module):
    """Reads another module's weight through a reference the module tree does not see."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        self.source = [source]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.source[0].weight, self.source[0].bias)


class Shared(nn.Module):
    """``late``'s parameters sit at the end of the flat space but are read first, by ``reader``; ``head`` ties
    ``inp``'s weight; the root reads ``late.weight`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.head = nn.Linear(D, D)
        self.head.weight = self.inp.weight
        self.mid = nn.Linear(D, D)
        self.late = nn.Linear(D, D)
        self.reader = Reader(self.late)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.reader(x)
        h = self.mid(torch.tanh(self.inp(h)))
        return self.head(h @ self.late.weight)


def _models():
    return {
        "attention_last": AttentionLast,
        "encoder_layer": lambda: nn.TransformerEncoderLayer(D, 2, dim_feedforward=16, dropout=0.0, batch_first=True),
        "transformer": lambda: nn.Transformer(D, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
                                              dropout=0.0, batch_first=True),
        "shared": Shared,
    }


def _call(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x, x.flip(1)) if name == "transformer" else model(x)


def _train(rank, world, name, overlap):
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = _models()[name]()
    strategy = _strategy(2, use_pure_fp16=True, dtype="bfloat16", overlap=overlap)
    strategy.fuse_grad_size_in_MB = 0.0002  # the gather runs in many rounds of 200 bytes
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(PER_RANK * world, 3, D, generator=g)[rank * PER_RANK:(rank + 1) * PER_RANK]
        with fleet.auto_cast():
            loss = _call(name, wrapped, x).float().square().mean()
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()
    opt.finish_param_gather()
    return _flat(model)


def _both(rank, world):
    return {name: (_train(rank, world, name, False), _train(rank, world, name, True)) for name in _models()}


@pytest.mark.timeout(120)
def test_models_that_read_parameters_outside_their_modules_train_bitwise_as_without_overlap():
    results = run_workers(_both, 2, timeout=100)
    equal = {name: [torch.equal(r[name][1], r[name][0]) for r in results] for name in _models()}
    assert equal == {name: [True, True] for name in _models()}
    assert all(torch.equal(results[1][name][0], results[0][name][0]) for name in _models())
