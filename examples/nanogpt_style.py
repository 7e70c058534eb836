"""nanoGPT's training loop with distamp's strategy flags (README: "Adding distamp to existing data-parallel code").

The loop keeps nanoGPT's shape: the precision context is built once at start-up,
before the optimizer and the strategy exist, and entered every micro-step;
gradient accumulation switches DDP's ``require_backward_grad_sync``; the model
has its own ``LayerNorm`` class (with an optional bias); gradients are unscaled
and clipped with torch's own ``clip_grad_norm_``. Each torch AMP call it
replaces is noted beside distamp's.

    distrun --nproc_per_node 2 examples/nanogpt_style.py                  # O2 BF16: warns about the norms
    distrun --nproc_per_node 2 examples/nanogpt_style.py --black_norms    # ... kept FP32 with custom_black_varnames
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from distamp import fleet

VOCAB, CONTEXT, WIDTH = 16, 8, 32
NORM_PATTERNS = ["transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"]


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm: torch's, but with an optional bias."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(WIDTH, bias=False)
        self.attn = nn.Linear(WIDTH, WIDTH)  # a stand-in for attention: the loop is the point here
        self.ln_2 = LayerNorm(WIDTH, bias=False)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(VOCAB, WIDTH),
            "wpe": nn.Embedding(CONTEXT, WIDTH),
            "h": nn.ModuleList(Block() for _ in range(layers)),
            "ln_f": LayerNorm(WIDTH, bias=True),
        })
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def get_batch(generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences counting up modulo VOCAB from a random start: the next token is learnable."""
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
    seq = (start + torch.arange(CONTEXT + 1)) % VOCAB
    return seq[:, :-1].to(fleet.device()), seq[:, 1:].to(fleet.device())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--o1", action="store_true", help="FP32 weights (O1) instead of O2")
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--black_norms", action="store_true", help="keep the custom LayerNorms in FP32")
    args = parser.parse_args()

    fleet.init()                                          # init_process_group(backend)
    ctx = fleet.auto_cast()                               # ctx = torch.autocast(device_type, dtype): built once
    torch.manual_seed(1337)
    model = GPT().to(fleet.device())
    strategy = fleet.DistributedStrategy()                # scaler = torch.amp.GradScaler(...)
    strategy.amp = True
    strategy.amp_configs = {"dtype": args.dtype, "use_pure_fp16": not args.o1,
                            "custom_black_varnames": NORM_PATTERNS if args.black_norms else []}
    optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), strategy)
    model = fleet.distributed_model(model)                # model = DDP(model, device_ids=[local_rank])

    generator = torch.Generator().manual_seed(fleet.worker_index())
    X, Y = get_batch(generator, 16)
    calls_per_step, first_loss = [], None
    for it in range(args.steps):
        calls_before = model.comm_stats.calls
        for micro_step in range(args.accum):
            model.require_backward_grad_sync = micro_step == args.accum - 1
            with ctx:
                logits = model(X)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), Y.reshape(-1)) / args.accum
            X, Y = get_batch(generator, 16)
            optimizer.backward(loss)                      # scaler.scale(loss).backward()
        if args.grad_clip:
            optimizer.unscale_()                          # scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()                                  # scaler.step(optimizer); scaler.update()
        optimizer.zero_grad(set_to_none=True)
        calls_per_step.append(model.comm_stats.calls - calls_before)
        first_loss = first_loss if first_loss is not None else loss.item() * args.accum
        if fleet.is_first_worker() and (it % 10 == 0 or it == args.steps - 1):
            print(f"iter {it}: loss {loss.item() * args.accum:.4f}, loss scale {optimizer.get_loss_scaling():g}")

    weight = "transformer.h.0.attn.weight"
    if fleet.is_first_worker():
        print(f"first loss {first_loss:.4f}, last loss {loss.item() * args.accum:.4f}")
        print(f"gradient all-reduce calls per optimizer step: {sorted(set(calls_per_step))}")
        print(f"model.state_dict()[{weight!r}]: {model.module.state_dict()[weight].dtype}; "
              f"optimizer.fp32_state_dict(model)[{weight!r}]: {optimizer.fp32_state_dict(model)[weight].dtype}")
        norms = {p.dtype for name, p in model.module.named_parameters() if ".ln_" in name}
        print(f"custom LayerNorm parameters: {sorted(str(d) for d in norms)}")


if __name__ == "__main__":
    main()
