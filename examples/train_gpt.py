"""A small GPT trained with distamp: AdamW, warmup + cosine schedule, clipping, gradient merge.

What a language-model loop looks like with distamp::

    distrun --nproc_per_node 2 examples/train_gpt.py                          # BF16, O2
    distrun --nproc_per_node 2 examples/train_gpt.py --dtype float16 --o1     # FP16 with loss scaling
    distrun --nproc_per_node 2 examples/train_gpt.py --no_amp                 # FP32 baseline
    distrun --nproc_per_node 2 examples/train_gpt.py --powersgd_rank 4 --check_replicas_every 50   # PowerSGD
    distrun --nproc_per_node 2 examples/train_gpt.py --sharding_stage 3       # parameters sharded (FSDP2)

The text is synthetic, so nothing is downloaded: sequences drawn from a
random Markov chain over a small vocabulary, whose entropy rate (the best
loss any model can reach) is printed at the end. The loop
steps the LR scheduler only when the optimizer applied the update, clips
the unscaled gradient norm with ``optimizer.clip_grad_norm_``, and merges
``--merge`` micro-batches per step through ``strategy.gradient_merge``.
Rank 0 prints ``final_loss=...`` and ``entropy=...``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distamp import fleet


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention (SDPA) and a GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(batch, time, d_model)``."""
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and learned position embeddings, N blocks, final LayerNorm, output tied to the embedding.

    Args:
        vocab: vocabulary size.
        d_model: width.
        heads: attention heads (``d_model`` must be divisible by it).
        layers: number of blocks.
        seq_len: longest sequence.
    """

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, time, vocab)`` for token ids of shape ``(batch, time)``."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def markov_corpus(vocab: int, sequences: int, seq_len: int, seed: int) -> tuple[torch.Tensor, float]:
    """``sequences`` token sequences of length ``seq_len + 1`` and the chain's mean entropy (nats).

    Each next token depends on the one before it, through peaked random
    transition probabilities (normalised gamma draws, i.e. a Dirichlet with
    small concentration); the same on every rank for the same ``seed``.
    """
    g = torch.Generator().manual_seed(seed)
    draws = -torch.rand(vocab, vocab, generator=g).log() ** 10    # heavy-tailed, so rows are peaked
    probs = draws / draws.sum(-1, keepdim=True)
    tokens = torch.empty(sequences, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (sequences,), generator=g)
    for t in range(1, seq_len + 1):
        tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1).mean().item()
    return tokens, entropy


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line of the example; ``--help`` lists every option."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16")
    p.add_argument("--o1", action="store_true", help="O1 (FP32 weights) instead of O2")
    p.add_argument("--no_amp", action="store_true", help="FP32 baseline, AMP off")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: %(default)s)")
    p.add_argument("--merge", type=int, default=2, help="micro-batches per step (default: %(default)s)")
    p.add_argument("--batch_size", type=int, default=8, help="micro-batch per rank (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps (default: %(default)s)")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (default: %(default)s)")
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--powersgd_rank", type=int, default=0,
                   help="compress gradients with PowerSGD at this rank (0: off, the default)")
    p.add_argument("--powersgd_start", type=int, default=20,
                   help="with --powersgd_rank: applied steps of plain all-reduce first (default: %(default)s)")
    p.add_argument("--check_replicas_every", type=int, default=0, metavar="N",
                   help="every N applied steps the ranks compare hashes of their parameters and stop together "
                        "if they differ (0: off, the default)")
    p.add_argument("--sharding_stage", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO sharding stage (0: off, the default; 3: parameters sharded too, each block a unit)")
    args = p.parse_args(argv)
    if args.powersgd_rank and args.sharding_stage:
        p.error("--powersgd_rank and --sharding_stage cannot be combined (distamp refuses PowerSGD with sharding)")
    if args.powersgd_rank < 0 or args.powersgd_start < 0:
        p.error(f"--powersgd_rank and --powersgd_start must be >= 0, got {args.powersgd_rank!r} and "
                f"{args.powersgd_start!r}")
    if args.check_replicas_every < 0:
        p.error(f"--check_replicas_every must be >= 0, got {args.check_replicas_every!r}")
    for name in ("steps", "merge", "batch_size", "warmup", "d_model", "layers", "heads", "vocab", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)!r}")
    if args.d_model % args.heads:
        p.error(f"--d_model {args.d_model} must be divisible by --heads {args.heads}")
    return args


def build_strategy(args: argparse.Namespace) -> fleet.DistributedStrategy:
    """AMP as asked, with gradient merge of ``--merge`` micro-batches."""
    strategy = fleet.DistributedStrategy(amp=not args.no_amp, check_replicas_every=args.check_replicas_every)
    if strategy.amp:
        strategy.amp_configs = {"dtype": args.dtype, "use_pure_fp16": not args.o1}
    if args.merge > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": args.merge, "avg": True}
    if args.powersgd_rank:
        strategy.powersgd = True
        strategy.powersgd_configs = {"rank": args.powersgd_rank, "start_step": args.powersgd_start}
    if args.sharding_stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": args.sharding_stage}
    return strategy


def warmup_cosine(warmup: int, total: int):
    """LR multiplier: linear warmup, then cosine decay to 10% of the peak."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return factor


def main(argv: Sequence[str] | None = None) -> float:
    """Train and return rank 0's mean loss over the last 20 steps (the same value on every rank)."""
    args = parse_args(argv)
    strategy = build_strategy(args)
    fleet.init(strategy=strategy)
    tokens, entropy = markov_corpus(args.vocab, 4096, args.seq_len, args.seed)
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq_len).to(fleet.device())
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = fleet.distributed_optimizer(inner, strategy)
    model = fleet.distributed_model(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))

    step, epoch, recent = 0, 0, []
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(fleet.device()), y.to(fleet.device())
            with fleet.auto_cast():
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            optimizer.zero_grad()           # a no-op inside a gradient-merge window
            optimizer.backward(loss)
            if optimizer.is_accumulating:   # not the last micro-batch of the window yet
                continue
            optimizer.clip_grad_norm_(args.clip)
            if optimizer.step():            # False: skipped on every rank, keep the schedule in step
                scheduler.step()
            step += 1
            recent = [*recent[-19:], loss.item()]
            if step == args.steps:
                break
        epoch += 1
    final = sum(recent) / len(recent)
    if fleet.is_first_worker():
        stats = optimizer.stats()
        print(f"steps_applied={stats['steps_applied']} steps_skipped={stats['steps_skipped']} "
              f"lr={scheduler.get_last_lr()[0]:.2e} grad_norm={stats['grad_norm']:.3f}", flush=True)
        if args.powersgd_rank:
            print(f"powersgd_rank={args.powersgd_rank} bytes_sent_last_step={stats['bytes_sent']} "
                  f"compression_rate={stats['compression_rate']:.2f}", flush=True)
        print(f"final_loss={final:.4f} entropy={entropy:.4f} uniform={math.log(args.vocab):.4f}", flush=True)
    fleet.barrier_worker()
    return final


if __name__ == "__main__":
    main()
