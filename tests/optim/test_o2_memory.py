"""O2 saves memory: peak live tensor bytes of a parameter-heavy language model against torch's own autocast.

Per parameter, torch-native BF16 autocast with AdamW holds 4 (FP32 weights)
+ 4 (FP32 gradients) + 8 (moments) and, during forward and backward, 2
(cast weights); O2 holds 2 (BF16 weights) + 2 (BF16 gradients) + 4 (FP32
masters) + 8 (moments), and builds the FP32 gradients the update needs one
chunk at a time. One process, three AdamW steps, peak of the tensor bytes
allocated from building the model on (torch.profiler's allocation events).

With SGD and momentum (4 bytes of state) the peak is in backward, where the
tied head's gradient and the embedding's are summed: O2 must sum them in
place there (as torch does with FP32 weights), not into a third copy.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.amp import auto_cast
from distamp.optim import AmpOptimizer
from distamp.strategy import DistributedStrategy
from tests.cpu_features import needs_native_bf16

VOCAB, WIDTH, SEQ, BATCH = 8192, 256, 16, 2


class _TiedLM(nn.Module):
    """Embedding, two MLP blocks with LayerNorm, head tied to the embedding: 2.65M parameters, 79% embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                                    nn.Linear(2 * WIDTH, WIDTH)) for _ in range(2)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(self.blocks(self.tok(tokens)), self.tok.weight)


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _sgd_momentum(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _peak_bytes(mode: str, make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = _adamw
                ) -> tuple[float, int]:
    """Peak live tensor bytes of 3 steps in ``mode`` ("torch", "o1" or "o2"), and the parameter count."""
    gc.collect()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
               for _ in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = _TiedLM()
        n_params = sum(p.numel() for p in model.parameters())
        inner = make_optimizer(model.parameters())
        if mode == "torch":
            for x, y in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                inner.zero_grad()
                loss.backward()
                inner.step()
        else:
            strategy = DistributedStrategy(amp=True)
            strategy.amp_configs = {"use_pure_fp16": mode == "o2", "dtype": "bfloat16"}
            opt = AmpOptimizer(inner, strategy)
            for x, y in batches:
                with auto_cast(dtype="bfloat16"):
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad()
                opt.backward(loss)
                assert opt.step()
        del model, inner, loss
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return float(peak), n_params


@pytest.mark.timeout(300)
def test_o2_bf16_peaks_below_torch_native_autocast_and_o1_matches_it():
    torch_peak, n = _peak_bytes("torch")
    o1_peak, _ = _peak_bytes("o1")
    o2_peak, _ = _peak_bytes("o2")
    per_param = {mode: round(peak / n, 2) for mode, peak in (("torch", torch_peak), ("o1", o1_peak), ("o2", o2_peak))}
    print(f"peak bytes per parameter: {per_param}")
    assert 2.6e6 < n < 2.7e6
    assert torch_peak / n >= 18  # FP32 weights and gradients, moments, cast weights
    assert o1_peak <= 1.01 * torch_peak, per_param
    assert o2_peak <= 0.95 * torch_peak, per_param


@needs_native_bf16
@pytest.mark.timeout(300)
def test_o2_bf16_sums_the_tied_gradients_in_place_and_peaks_below_torch_native():
    # Peak in backward: 10 B/param and the other gradients, plus the head's and the embedding's
    # gradients (2 B per embedding parameter each); summed out of place, a third copy made it 0.999x.
    torch_peak, n = _peak_bytes("torch", _sgd_momentum)
    o1_peak, _ = _peak_bytes("o1", _sgd_momentum)
    o2_peak, _ = _peak_bytes("o2", _sgd_momentum)
    per_param = {mode: round(peak / n, 2) for mode, peak in (("torch", torch_peak), ("o1", o1_peak), ("o2", o2_peak))}
    print(f"peak bytes per parameter: {per_param}")
    assert o1_peak <= 1.01 * torch_peak, per_param
    assert o2_peak <= 0.95 * torch_peak, per_param
