"""PowerSGD on real 2-rank gloo groups: the math, the verdict-gated state, merge, retries, checkpoints.

The point of distamp's PowerSGD is that an overflow on one rank costs one
skipped step, not the run: the last tests inject an inf into one gradient
element on one rank after ``start_step`` and check that exactly that step
is skipped on every rank, with the compressor state left bitwise as it
was, and (the control) that torch's ``powerSGD_hook`` + ``GradScaler`` in
the same scenario keeps skipping.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.compression.low_rank import effective_rank, fixed_order_product, matrix_shape, orthogonalize_, start_q
from distamp.compression.low_rank_kernels import KERNELS_ENV
from distamp.distributed.grad_layout import as_indexed, memory_order, relayout
from tests.compression.test_low_rank_kernels import (
    compiler_present,
    reference_orthogonalize,
    reference_product,
    reference_project,
    reference_start,
)
from tests.multiprocess import free_port, run_workers

pytestmark = pytest.mark.timeout(120)


def _mlp(seed: int = 0, width: int = 24) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _strategy(amp=True, dtype="float16", o2=False, merge=1, amp_extra=None, **powersgd):
    from distamp import fleet

    s = fleet.DistributedStrategy()
    s.amp = amp
    if amp:
        s.amp_configs = {"dtype": dtype, "use_pure_fp16": o2,
                         **({"init_loss_scaling": 1024.0} if dtype == "float16" else {}),
                         **(amp_extra or {})}
    if merge > 1:
        s.gradient_merge = True
        s.gradient_merge_configs = {"k_steps": merge}
    s.powersgd = True
    s.powersgd_configs = {"rank": 2, "start_step": 2, **powersgd}
    return s


def _build(strategy, model=None, lr=0.1):
    from distamp import fleet

    fleet.init()
    model = model if model is not None else _mlp()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), strategy)
    wrapped = fleet.distributed_model(model)
    return model, wrapped, opt


def _train_step(wrapped, opt, x, y, clip=None):
    from distamp import fleet

    with fleet.auto_cast():
        loss = F.cross_entropy(wrapped(x), y)
    opt.zero_grad()
    opt.backward(loss)
    if clip is not None:
        opt.clip_grad_norm_(clip)
    return opt.step()


def _flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _snapshot(compressor):
    return copy.deepcopy(compressor.state_dict())


def _same_state(a, b) -> bool:
    if a.keys() != b.keys() or a["applied_steps"] != b["applied_steps"]:
        return False
    return all(a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in ("error", "q"))


def _gather(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


# ----------------------------------------------------------------------------- the matrix side, no process group


def _gram_schmidt(a: torch.Tensor) -> torch.Tensor:
    """The textbook loop, column by column."""
    a = a.clone()
    for i in range(a.shape[1]):
        a[:, i] /= a[:, i].norm()
        for j in range(i + 1, a.shape[1]):
            a[:, j] -= (a[:, i] @ a[:, j]) * a[:, i]
    return a


def test_orthogonalize_matches_textbook_gram_schmidt_and_qr():
    a = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    ours = orthogonalize_(a.clone())
    torch.testing.assert_close(ours, _gram_schmidt(a), rtol=1e-5, atol=1e-6)
    q, r = torch.linalg.qr(a)
    torch.testing.assert_close(ours, q * torch.sign(torch.diagonal(r)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.t() @ ours, torch.eye(4), rtol=0, atol=1e-5)


def test_an_all_zero_column_stays_zero_instead_of_nan():
    a = torch.randn(10, 3, generator=torch.Generator().manual_seed(1))
    a[:, 1] = 0
    out = orthogonalize_(a.clone())
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 1], torch.zeros(10))
    assert torch.equal(orthogonalize_(torch.zeros(6, 2)), torch.zeros(6, 2))
    with pytest.raises(TypeError, match="float32"):
        orthogonalize_(torch.zeros(4, 2, dtype=torch.float16))


def test_shapes_and_the_start_q():
    assert matrix_shape((8, 3, 3)) == (8, 9)
    assert matrix_shape((8,)) is None
    assert effective_rank(3, 100, 4) == 3
    q = start_q("0.weight", 20, 3, seed=5, device=torch.device("cpu"))
    assert torch.equal(q, start_q("0.weight", 20, 3, seed=5, device=torch.device("cpu")))
    assert not torch.equal(q, start_q("2.weight", 20, 3, seed=5, device=torch.device("cpu")))
    torch.testing.assert_close(q.t() @ q, torch.eye(3), rtol=0, atol=1e-5)


def test_the_product_is_the_rank_ordered_sum_of_fp32_outer_products():
    g = torch.Generator().manual_seed(3)
    p, qt = torch.randn(300, 4, generator=g), torch.randn(4, 200, generator=g) * 1e-3
    expected = p[:, 0:1] * qt[0:1]
    for k in range(1, 4):
        expected = expected + p[:, k : k + 1] * qt[k : k + 1]
    assert torch.equal(fixed_order_product(p, qt), expected)
    out, work = torch.empty(300, 200), torch.empty(300, 200)
    assert fixed_order_product(p, qt, out=out, work=work) is out
    assert torch.equal(out, expected)
    assert torch.equal(fixed_order_product(p[:, :1].contiguous(), qt[:1].contiguous()), p[:, :1] * qt[:1])
    torch.testing.assert_close(out.double(), p.double() @ qt.double(), rtol=1e-5, atol=1e-9)


def _row_block_worker(rank, world_size, block_rows, dtype):
    import distamp.compression.powersgd as powersgd
    from distamp.strategy import PowerSGDConfig

    os.environ[KERNELS_ENV] = "torch"
    rows, cols = 203, 150
    powersgd._CACHE_BLOCK_ELEMENTS = block_rows * cols
    compressor = powersgd.PowerSGD(PowerSGDConfig(rank=4, start_step=0), {}, dtype)
    g = torch.Generator().manual_seed(5)
    grads = []
    for _ in range(3):  # warm-started Q and error feedback carried between steps
        grad = (torch.randn(rows * cols, generator=g) * 1e-3).to(dtype) * 1024
        compressor.compress([("w", grad, rows, cols)], 1024.0)
        compressor.resolve(True)
        grads.append(grad)
    return grads, compressor.state_dict()["error"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_torch_op_write_back_in_row_blocks_gives_the_whole_matrix_bits(dtype):
    (whole,) = run_workers(_row_block_worker, 1, 10**6, dtype, timeout=100)
    (blocks,) = run_workers(_row_block_worker, 1, 4, dtype, timeout=100)  # 4-row blocks, a 3-row tail
    for a, b in zip(whole[0], blocks[0], strict=True):
        assert torch.equal(a, b)
    assert whole[1].keys() == blocks[1].keys() == {"w"}
    for name, error in whole[1].items():
        assert torch.equal(error, blocks[1][name]), name


def _gram_schmidt_64(a: torch.Tensor) -> torch.Tensor:
    """Textbook Gram-Schmidt in float64 (a zero column left zero)."""
    a = a.double().clone()
    for i in range(a.shape[1]):
        norm = a[:, i].norm()
        if norm > 0:
            a[:, i] /= norm
        for j in range(i + 1, a.shape[1]):
            a[:, j] -= (a[:, i] @ a[:, j]) * a[:, i]
    return a


def _reference_start_q(name: str, cols: int, rank: int, seed: int) -> torch.Tensor:
    """The documented start Q: a normal draw from a generator seeded by the step count and the name, orthonormalised."""
    import zlib

    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return _gram_schmidt_64(torch.randn(cols, rank, generator=generator))


def test_the_start_q_is_the_seeded_draw_orthonormalised():
    q = start_q("0.weight", 40, 3, seed=5, device=torch.device("cpu"))
    torch.testing.assert_close(q.double(), _reference_start_q("0.weight", 40, 3, 5), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the math against a reference


def _math_worker(rank, world_size, low_rank, kernels, batch=8, transposed=False):
    """FP32 (amp off): one Linear, compressed from step 1; compare with PowerSGD done by hand on gathered grads.

    ``kernels``: "auto" (the compiled CPU passes, compared with their stated
    order of operations) or "torch" (torch ops, compared with torch's products).
    ``transposed``: the weight is stored column-major (strides ``(1, 16)``),
    so DDP's bucket holds its gradient transposed; the matrix is still the
    weight's rows by its columns.
    """
    os.environ[KERNELS_ENV] = kernels
    torch.manual_seed(0)
    model = nn.Linear(16, 12)
    reference = nn.Linear(16, 12)
    reference.load_state_dict(model.state_dict())
    if transposed:
        model.weight = nn.Parameter(model.weight.detach().t().contiguous().t())
    strategy = _strategy(amp=False, rank=low_rank, start_step=0, min_compression_rate=1.0)
    model, wrapped, opt = _build(strategy, model, lr=0.0)
    x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(rank))
    F.mse_loss(reference(x), torch.zeros(batch, 12)).backward()
    local_w, local_b = reference.weight.grad, reference.bias.grad
    opt.zero_grad()
    opt.backward(F.mse_loss(wrapped(x), torch.zeros(batch, 12)))
    reduced_w, reduced_b = model.weight.grad.clone(), model.bias.grad.clone()
    opt.step()

    ms = _gather(local_w.contiguous())
    r = effective_rank(12, 16, low_rank)
    compressor = opt.policy.compressor
    bias = sum(b / world_size for b in _gather(local_b.contiguous()))
    result = {"kernels": compressor.kernels is not None, "bias_exact": torch.equal(reduced_b, bias),
              "same_on_every_rank": all(torch.equal(w, reduced_w) for w in _gather(reduced_w)),
              # amp off, scale 1: the gradient is P Q^T as written, the error M - P Q^T with M the local gradient
              "error_exact": torch.equal(compressor.error["weight"], local_w - reduced_w),
              "mean_error": (reduced_w - sum(ms) / world_size).abs().max().item(), "stats": opt.stats()}
    if compressor.kernels is None:
        # Independent of the code under test: PowerSGD in float64 from the documented start Q.
        q0 = _reference_start_q("weight", 16, r, seed=0)
        p_hat = _gram_schmidt_64(sum(m.double() @ q0 for m in ms))
        qt = sum(p_hat.t() @ m.double() for m in ms) / world_size  # Q^T = P^T M, the layout the hook keeps
        approx = p_hat @ qt
        scale = approx.abs().max().item()
        result["weight_exact"] = torch.allclose(reduced_w.double(), approx, rtol=1e-5, atol=1e-6 * scale)
        result["q_exact"] = torch.allclose(compressor.q["weight"].double(), qt, rtol=1e-5, atol=1e-6 * scale)
    else:
        # The kernels' stated order of operations, from the start Q the hook was given.
        q0 = start_q("weight", 16, r, seed=0, device=torch.device("cpu"))
        p = sum(reference_start(m, None, q0.t(), 1.0)[1] for m in ms)
        p_hat = reference_orthogonalize(list(p.t())).t()
        qt = sum(reference_project(m, p_hat) for m in ms) / world_size
        approx = reference_product(p_hat, qt)
        result["weight_exact"] = torch.equal(reduced_w, approx)
        result["q_exact"] = torch.equal(compressor.q["weight"], qt)
    return result


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_compressed_gradient_is_powersgd_of_the_rank_gradients(kernels, transposed):
    out = run_workers(_math_worker, 2, 2, kernels, 8, transposed, timeout=100)
    for result in out:
        assert result["kernels"] == (kernels == "auto" and compiler_present())
        assert result["weight_exact"]
        assert result["bias_exact"]
        assert result["same_on_every_rank"]
        assert result["error_exact"]
        assert result["q_exact"]
        assert result["mean_error"] > 1e-4  # rank 2 of a rank-12 matrix: lossy, as it should be
        # 12x16 at rank 2: P and Q are 2*(12+16) FP32 values; the bias 12 FP32; against 12*16+12 FP32.
        assert result["stats"]["bytes_sent"] == 4 * (2 * 28 + 12)
        assert result["stats"]["compression_rate"] == pytest.approx((12 * 16 + 12) / (2 * 28 + 12))


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_gradient_of_rank_at_most_rank_is_reproduced(kernels):
    # One example per rank: each weight gradient is an outer product, their mean has rank <= 2, so a
    # rank-2 P spans its column space and P P^T M = M up to rounding.
    out = run_workers(_math_worker, 2, 2, kernels, 1, timeout=100)
    for result in out:
        assert result["weight_exact"]
        assert result["q_exact"]
        assert result["mean_error"] < 1e-6


# ----------------------------------------------------------------------------- an inf on one rank


INF_STEP = 4  # 1-based; compression starts after start_step=2 applied steps


def _poison(model, rank, step_box):
    """Rank 1 puts an inf into one element of the first weight's gradient at INF_STEP (before communication)."""
    _poison_at(model, rank, step_box, INF_STEP)


def _poison_at(model, rank, step_box, at):
    def hook(grad):
        if rank == 1 and step_box[0] == at:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad
    model[0].weight.register_hook(hook)


def _inf_worker(rank, world_size, dtype, o2, kernels, steps=8):
    os.environ[KERNELS_ENV] = kernels
    strategy = _strategy(dtype=dtype, o2=o2)
    model, wrapped, opt = _build(strategy)
    step_box = [0]
    _poison(model, rank, step_box)
    compressor = opt.policy.compressor
    applied, scales, states = [], [], [_snapshot(compressor)]
    for step in range(1, steps + 1):
        step_box[0] = step
        applied.append(_train_step(wrapped, opt, *_batch(rank, step)))
        scales.append(opt.get_loss_scaling())
        states.append(_snapshot(compressor))
    finite = all(torch.isfinite(t).all() for s in states for k in ("error", "q") for t in s[k].values())
    return {"applied": applied, "scales": scales, "params": _flat(model),
            "unchanged": _same_state(states[INF_STEP - 1], states[INF_STEP]), "finite": finite,
            "compressed": bool(states[-1]["error"]), "last_overflow": opt.stats()["last_overflow"]}


@pytest.mark.parametrize(("dtype", "o2", "kernels"), [("float16", False, "auto"), ("float16", True, "auto"),
                                                     ("bfloat16", True, "auto"), ("float16", False, "torch"),
                                                     ("bfloat16", True, "torch")])
def test_an_inf_on_one_rank_skips_that_step_only(dtype, o2, kernels):
    out = run_workers(_inf_worker, 2, dtype, o2, kernels, timeout=100)
    expected = [step != INF_STEP for step in range(1, 9)]
    for result in out:
        assert result["applied"] == expected
        assert result["unchanged"], "the skipped step changed the compressor state"
        assert result["finite"]
        assert result["compressed"]
        assert result["last_overflow"] == {"step": INF_STEP, "params": ["0.weight"]}
    assert out[0]["scales"] == out[1]["scales"]
    assert torch.equal(out[0]["params"], out[1]["params"])
    assert torch.isfinite(out[0]["params"]).all()


SKIPPED_STEP = 3  # 1-based; compression starts after start_step=1 applied step


def _skip_or_omit_run(rank, low_rank, o2, skip):
    """Five batches; the third overflows on rank 1 (``skip``) or is never run. Returns what a rank keeps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 40),
                          nn.ReLU(), nn.Linear(40, 4))
    strategy = _strategy(dtype="bfloat16" if o2 else "float16", o2=o2, rank=low_rank, start_step=1,
                         min_compression_rate=1.0)
    model, wrapped, opt = _build(strategy, model)
    step_box = [0]
    _poison_at(model, rank, step_box, SKIPPED_STEP)
    for step in range(1, 6):
        step_box[0] = step
        if step == SKIPPED_STEP and not skip:
            continue
        applied = _train_step(wrapped, opt, *_batch(rank, step))
        assert applied == (step != SKIPPED_STEP)
    compressor = opt.policy.compressor
    masters = [m.detach().clone() for m in opt.master_weights.masters]
    return {"params": _flat(model), "masters": masters, "state": _snapshot(compressor),
            "rank": max(q.shape[0] for q in compressor.q.values())}


def _skip_worker(rank, world_size, kernels, o2):
    os.environ[KERNELS_ENV] = kernels
    out = {}
    for low_rank in (1, 2, 8):
        skipped, omitted = (_skip_or_omit_run(rank, low_rank, o2, skip) for skip in (True, False))
        out[low_rank] = {
            "rank_used": skipped["rank"],
            "params": torch.equal(skipped["params"], omitted["params"]),
            "masters": all(torch.equal(a, b) for a, b in zip(skipped["masters"], omitted["masters"], strict=True)),
            "state": _same_state(skipped["state"], omitted["state"]),
        }
    return out


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("o2", [False, True], ids=["O1-fp16", "O2-bf16"])
def test_a_skipped_step_is_bitwise_no_step(kernels, o2):
    """For ranks 1, 2 and 8: the overflowed step leaves params, masters, error feedback and Q as if never run."""
    out = run_workers(_skip_worker, 2, kernels, o2, timeout=110)
    for result in out:
        assert [result[r]["rank_used"] for r in (1, 2, 8)] == [1, 2, 8]
        for low_rank in (1, 2, 8):
            assert result[low_rank] == {"rank_used": low_rank, "params": True, "masters": True, "state": True}, low_rank


def _torch_control_worker(rank, world_size, steps=8):
    """torch-native DDP + powerSGD_hook + GradScaler (FP16) with the same inf: the error memory is poisoned."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    step_box = [0]
    _poison(model, rank, step_box)
    ddp = DDP(model)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                   min_compression_rate=2.0)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    applied = []
    for step in range(1, steps + 1):
        step_box[0] = step
        x, y = _batch(rank, step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        applied.append(scaler.get_scale() >= before)
    return applied


def test_control_torch_powersgd_with_gradscaler_keeps_skipping():
    out = run_workers(_torch_control_worker, 2, timeout=100)
    for applied in out:
        assert all(applied[: INF_STEP - 1])
        assert not any(applied[INF_STEP - 1 :]), applied  # every step from the inf on is skipped


# ----------------------------------------------------------------------------- retries, merge, clipping, zero grads


def _retry_worker(rank, world_size):
    from distamp import fleet

    strategy = _strategy(dtype="float16", amp_extra={"overflow_retries": 1})
    model, wrapped, opt = _build(strategy)
    step_box = [0]
    attempts = [0]

    def hook(grad):
        if rank == 1 and step_box[0] == INF_STEP and attempts[0] == 1:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad
    model[0].weight.register_hook(hook)
    sent = []
    for step in range(1, 7):
        step_box[0], attempts[0] = step, 0
        x, y = _batch(rank, step)

        def closure(x=x, y=y):
            attempts[0] += 1
            opt.zero_grad()
            with fleet.auto_cast():
                loss = F.cross_entropy(wrapped(x), y)
            opt.backward(loss)
            return loss

        opt.step(closure)
        assert not opt.step_was_skipped
        sent.append(opt.stats()["bytes_sent"])
    state = opt.policy.compressor.state_dict()
    return {"params": _flat(model), "retries": opt.stats()["retries"], "applied": opt.steps_applied,
            "finite": all(torch.isfinite(t).all() for k in ("error", "q") for t in state[k].values()),
            "compressor_steps": state["applied_steps"], "sent": sent}


def test_overflow_retry_discards_the_attempt():
    out = run_workers(_retry_worker, 2, timeout=100)
    for result in out:
        assert result["retries"] == 1
        assert result["applied"] == 6
        assert result["compressor_steps"] == 6
        assert result["finite"]
        # The retried step sent its gradients twice, both attempts compressed (steps 3 to 6 compress).
        sent = result["sent"]
        assert sent[2] == sent[4] == sent[5], sent
        assert sent[INF_STEP - 1] == 2 * sent[2], sent
    assert torch.equal(out[0]["params"], out[1]["params"])


def _two_optimizers_worker(rank, world_size, order):
    """A second optimizer on a compressed model: refused before any collective, the first left working."""
    import torch.distributed as dist

    from distamp import fleet

    fleet.init()
    model = _mlp()
    strategy = _strategy(dtype="float16", start_step=1)
    collectives: list[str] = []
    names = ("all_gather", "all_gather_object", "all_reduce", "broadcast", "broadcast_object_list", "barrier")
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            collectives.append(name)
            return originals[name](*args, **kwargs)
        return call

    first = fleet.distributed_optimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model) if order == "after" else None
    for name in names:
        setattr(dist, name, counting(name))
    second = None  # held: fleet keeps optimizers weakly, and one nobody holds may be collected at any moment
    try:
        second = fleet.distributed_optimizer(torch.optim.SGD(model[2].parameters(), lr=0.1), strategy)
        if order == "before":
            fleet.distributed_model(model)
        message = ""
    except RuntimeError as err:
        message = str(err)
    finally:
        for name in names:
            setattr(dist, name, originals[name])
    result = {"message": message, "collectives": collectives, "second_built": second is not None}
    if wrapped is not None:
        result["applied"] = [_train_step(wrapped, first, *_batch(rank, step)) for step in range(1, 4)]
        result["params"] = _flat(model)
    return result


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_second_optimizer_is_refused_before_any_collective(order):
    out = run_workers(_two_optimizers_worker, 2, order, timeout=100)
    for result in out:
        assert "exactly one fleet.distributed_optimizer per model" in result["message"]
        assert result["second_built"] == (order == "before")
        assert result["collectives"] == []
    if order == "after":
        # The refused optimizer was never attached: the first one trains on, compressed from step 2.
        assert out[0]["applied"] == [True] * 3
        assert torch.equal(out[0]["params"], out[1]["params"])


def _merge_worker(rank, world_size):
    strategy = _strategy(dtype="bfloat16", o2=True, merge=2, start_step=1)
    model, wrapped, opt = _build(strategy)
    from distamp import fleet

    calls, norms = [], []
    for step in range(1, 5):
        for micro in range(2):
            with fleet.auto_cast():
                loss = F.cross_entropy(wrapped(_batch(rank, 10 * step + micro)[0]), _batch(rank, step)[1])
            opt.zero_grad()
            opt.backward(loss)
        before = wrapped.comm_stats.calls
        norms.append(float(opt.clip_grad_norm_(0.5)))
        assert opt.step()
        calls.append(wrapped.comm_stats.calls - before)
    return {"params": _flat(model), "norms": norms, "stats": opt.stats(), "calls": wrapped.comm_stats.calls}


def test_gradient_merge_compresses_once_per_window_and_clipping_works():
    out = run_workers(_merge_worker, 2, timeout=100)
    assert torch.equal(out[0]["params"], out[1]["params"])
    assert out[0]["norms"] == out[1]["norms"]
    for result in out:
        # one bucket: step 1 one all-reduce (warm-up), then per window the biases plus the factors (2 calls)
        assert result["calls"] == 1 + 3 * 2
        assert result["stats"]["compression_rate"] > 1.0


def _accumulation_run(rank, first_backward):
    """Three steps of two backward passes each; the first pass ``"local"`` (no_sync), ``"synced"`` or
    ``"discarded"`` (synced, then ``zero_grad()``). Returns each step's unscaled reduced gradients and the params."""
    strategy = _strategy(start_step=1)
    model, wrapped, opt = _build(strategy)
    from distamp import fleet

    grads = []
    for step in range(1, 4):
        opt.zero_grad()
        for micro in range(2):
            x, y = _batch(rank, 10 * step + micro)
            local = micro == 0 and first_backward == "local"
            with wrapped.no_sync() if local else contextlib.nullcontext():
                with fleet.auto_cast():
                    loss = F.cross_entropy(wrapped(x), y)
                opt.backward(loss)
            if micro == 0 and first_backward == "discarded":
                opt.zero_grad()
        scale = opt.get_loss_scaling()
        grads.append([p.grad.double() / scale for p in model.parameters()])
        assert opt.step()
    return {"grads": grads, "params": _flat(model), "state": _snapshot(opt.policy.compressor)}


def _accumulation_worker(rank, world_size, kernels):
    os.environ[KERNELS_ENV] = kernels
    local, synced, discarded = (_accumulation_run(rank, first) for first in ("local", "synced", "discarded"))
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                 for sa, sb in zip(synced["grads"], local["grads"], strict=True)
                 for a, b in zip(sa, sb, strict=True))
    # One backward per step with the same second batches: what the discarded run must equal, bit for bit.
    single = _accumulation_run_single(rank)
    return {"worst": worst, "params_close": torch.allclose(synced["params"], local["params"], rtol=1e-3, atol=1e-5),
            "discarded_is_single": torch.equal(discarded["params"], single["params"])
            and _same_state(discarded["state"], single["state"])}


def _accumulation_run_single(rank):
    strategy = _strategy(start_step=1)
    model, wrapped, opt = _build(strategy)
    for step in range(1, 4):
        assert _train_step(wrapped, opt, *_batch(rank, 10 * step + 1))
    return {"params": _flat(model), "state": _snapshot(opt.policy.compressor)}


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_backward_passes_that_each_communicate_compress_the_accumulated_gradient_once(kernels):
    """Two synced backward passes before a step: the same compressed step as no_sync on the first (FP16 O1).

    The second pass re-sends the gradient the first one wrote, which already carried the error feedback;
    adding the error again counted it twice (relative difference 0.5-1.4 on the compressed steps).
    Gradients cleared between the passes make the step the second pass's alone.
    """
    out = run_workers(_accumulation_worker, 2, kernels, timeout=110)
    for result in out:
        # What remains is the FP16 wire's rounding of the uncompressed gradients, sent twice (1e-3 seen).
        assert result["worst"] < 5e-3, result["worst"]
        assert result["params_close"]
        assert result["discarded_is_single"]


def _zero_grad_worker(rank, world_size):
    """A layer whose weight gradient is all zero (its input is zero): torch's epsilon-0 Gram-Schmidt makes NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4))
    strategy = _strategy(amp=False, start_step=0)
    model, wrapped, opt = _build(strategy, model)
    applied = []
    for step in range(1, 4):
        x, y = _batch(rank, step)
        applied.append(_train_step(wrapped, opt, torch.zeros_like(x), y))
    return applied, _flat(model)


def test_an_all_zero_gradient_makes_no_nan():
    out = run_workers(_zero_grad_worker, 2, timeout=100)
    for applied, params in out:
        assert applied == [True, True, True]
        assert torch.isfinite(params).all()


class _Float64Head(nn.Module):
    """FP32 layers, then a float64 matrix."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 24), nn.ReLU())
        self.head = nn.Linear(24, 4).double()

    def forward(self, x):
        return self.head(self.body(x).double())


def _float64_worker(rank, world_size, start_step):
    """AMP off: the float64 matrix's gradient is the exact mean, before and after start_step."""
    import torch.distributed as dist

    x, y = _batch(rank, 1)
    local = _Float64Head()
    F.cross_entropy(local(x), y).backward()
    want = local.head.weight.grad.clone()
    dist.all_reduce(want)
    want /= world_size
    model, wrapped, opt = _build(_strategy(amp=False, start_step=start_step), _Float64Head())
    opt.zero_grad()
    opt.backward(F.cross_entropy(wrapped(x), y))
    return model.head.weight.grad.dtype, torch.equal(model.head.weight.grad, want)


@pytest.mark.parametrize("start_step", [0, 5])
def test_a_float64_gradient_is_averaged_in_float64_and_not_compressed(start_step):
    # Was: from start_step on, the C kernels refused it ("low-rank kernel argument grad: expected ... dtype in
    # (torch.bfloat16, torch.float32)") in the first backward; before it, it crossed the wire rounded to FP32.
    out = run_workers(_float64_worker, 2, start_step, timeout=100)
    assert out == [(torch.float64, True)] * 2


# ----------------------------------------------------------------------------- checkpoints


def _checkpoint_worker(rank, world_size, directory, resume):
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    strategy = _strategy(dtype="float16", o2=True)
    model, wrapped, opt = _build(strategy)
    start = 0
    if resume:
        info = load_latest_checkpoint(directory, model=wrapped, optimizer=opt)
        start = info.step
    for step in range(start + 1, 8):
        _train_step(wrapped, opt, *_batch(rank, step), clip=1000.0)
        if step == 4 and not resume:
            save_checkpoint(directory, step, model=wrapped, optimizer=opt)
    return {"params": _flat(model), "state": opt.policy.compressor.state_dict(), "scale": opt.get_loss_scaling()}


def test_checkpoint_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    directory = str(tmp_path / "ckpt")
    clean = run_workers(_checkpoint_worker, 2, directory, False, timeout=100)
    parts = sorted(p.name.split(".")[1] for p in (tmp_path / "ckpt").glob("step-00000004.*.pt"))
    assert parts == ["common", "rank-00000", "rank-00001"]  # each rank's own error feedback
    resumed = run_workers(_checkpoint_worker, 2, directory, True, timeout=100)
    for a, b in zip(clean, resumed, strict=True):
        assert torch.equal(a["params"], b["params"])
        assert a["scale"] == b["scale"]
        assert _same_state(a["state"], b["state"])
    assert not torch.equal(clean[0]["state"]["error"]["0.weight"], clean[1]["state"]["error"]["0.weight"])


def _world_size_worker(rank, world_size):
    strategy = _strategy(dtype="bfloat16", o2=True, start_step=0)
    _, wrapped, opt = _build(strategy)
    _train_step(wrapped, opt, *_batch(rank, 1))
    state = opt.state_dict()
    state["powersgd"] = {**state["powersgd"], "world_size": 4}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(state)
    compressor = opt.policy.compressor
    return [str(w.message) for w in caught], bool(compressor.error), bool(compressor.q), compressor.applied_steps


def test_another_world_size_drops_the_error_feedback_with_one_warning():
    out = run_workers(_world_size_worker, 2, timeout=100)
    messages, has_error, has_q, steps = out[0]
    assert len(messages) == 1
    assert "PowerSGD error feedback dropped" in messages[0]
    assert "saved by 4 rank(s) and is resumed by 2" in messages[0]
    assert (has_error, has_q, steps) == (False, True, 1)
    assert out[1][0] == []  # rank 0 warns, once


def _compiled_names_state_worker(rank, world_size):
    """A state saved when a compiled model's parameters were named "_orig_mod.<name>" loads under the names."""
    strategy = _strategy(dtype="bfloat16", o2=True, start_step=0)
    _, wrapped, opt = _build(strategy)
    for step in range(1, 3):
        _train_step(wrapped, opt, *_batch(rank, step))
    compressor = opt.policy.compressor
    own = {"q": dict(compressor.q), "error": dict(compressor.error)}
    state = opt.state_dict()
    for key in ("q", "error"):
        state["powersgd"][key] = {f"_orig_mod.{name}": t for name, t in state["powersgd"][key].items()}
    opt.load_state_dict(state)
    return {key: sorted(own[key]) == sorted(getattr(compressor, key)) and all(
        torch.equal(getattr(compressor, key)[name], t) for name, t in own[key].items()) for key in own}


def test_a_state_named_inside_torch_compiles_wrapper_resumes_under_the_models_names():
    for kept in run_workers(_compiled_names_state_worker, 2, timeout=100):
        assert kept == {"q": True, "error": True}


def _rank0_state_worker(rank, world_size):
    """torch's DDP idiom: rank 0's optimizer.state_dict() loaded on every rank."""
    import torch.distributed as dist

    strategy = _strategy(dtype="bfloat16", o2=True, start_step=0)
    _, wrapped, opt = _build(strategy)
    for step in range(1, 3):
        _train_step(wrapped, opt, *_batch(rank, step))
    compressor = opt.policy.compressor
    own_error = {name: t.clone() for name, t in compressor.error.items()}
    box = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(box[0])
    same_as_own = compressor.error.keys() == own_error.keys() and all(
        torch.equal(compressor.error[name], own_error[name]) for name in own_error)
    applied = _train_step(wrapped, opt, *_batch(rank, 3))
    return {"messages": [str(w.message) for w in caught], "error_kept": same_as_own,
            "has_error": bool(compressor.error), "has_q": bool(compressor.q), "applied": applied}


def test_another_ranks_state_drops_the_error_feedback_with_a_warning():
    out = run_workers(_rank0_state_worker, 2, timeout=100)
    # Rank 0 loaded its own state: its error feedback is kept, silently.
    assert out[0]["messages"] == []
    assert out[0]["error_kept"]
    # Rank 1 loaded rank 0's: rank 0's residual is not rank 1's; it restarts from zero, with a warning.
    assert not out[1]["error_kept"]
    assert len(out[1]["messages"]) == 1
    assert "PowerSGD error feedback dropped on rank 1" in out[1]["messages"][0]
    assert "saved by rank 0" in out[1]["messages"][0]
    assert out[1]["has_q"]
    assert out[0]["applied"]
    assert out[1]["applied"]


# ----------------------------------------------------------------------------- compile, check_nan_inf


def _compiled_worker(rank, world_size):
    strategy = _strategy(dtype="bfloat16", o2=True, start_step=1)
    model, wrapped, opt = _build(strategy)
    compiled = torch.compile(wrapped)
    applied = [_train_step(compiled, opt, *_batch(rank, step)) for step in range(1, 5)]
    return applied, _flat(model), opt.stats()["compression_rate"]


@pytest.mark.timeout(240)
def test_a_compiled_model_trains_compressed():
    out = run_workers(_compiled_worker, 2, timeout=220)
    for applied, _, rate in out:
        assert applied == [True] * 4
        assert rate > 1.0
    assert torch.equal(out[0][1], out[1][1])


def _check_nan_inf_worker(rank, world_size):
    strategy = _strategy(dtype="float16", o2=True, start_step=1, amp_extra={"check_nan_inf": True})
    model, wrapped, opt = _build(strategy)
    applied = [_train_step(wrapped, opt, *_batch(rank, step)) for step in range(1, 4)]
    return applied, _flat(model)


def test_check_nan_inf_sees_no_false_alarm_from_compression():
    out = run_workers(_check_nan_inf_worker, 2, timeout=100)
    for applied, params in out:
        assert applied == [True] * 3
        assert torch.isfinite(params).all()
    assert torch.equal(out[0][1], out[1][1])


# ----------------------------------------------------------------------------- the CPU kernels, agreed by every rank


def _agreement_worker(rank, world_size):
    os.environ[KERNELS_ENV] = "torch" if rank == 1 else "auto"
    strategy = _strategy(dtype="bfloat16", o2=True, start_step=1)
    model, wrapped, opt = _build(strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied = [_train_step(wrapped, opt, *_batch(rank, step)) for step in range(1, 4)]
    return opt.policy.compressor.kernels is None, applied, _flat(model), [str(w.message) for w in caught]


def test_a_rank_without_the_kernels_makes_every_rank_use_torch_ops():
    # The two paths round the products differently: a mix would give the ranks different mean gradients.
    out = run_workers(_agreement_worker, 2, timeout=100)
    for torch_ops, applied, _, messages in out:
        assert torch_ops
        assert applied == [True] * 3
        if compiler_present():
            assert not [m for m in messages if "kernels" in m]  # asked for on rank 1: nothing to warn about
    assert torch.equal(out[0][2], out[1][2])


# ----------------------------------------------------------------------------- ranks on different instruction sets


def test_ranks_on_different_instruction_sets_end_bitwise_equal_on_torch_ops(tmp_path):
    """Rank 0 alone runs torch's portable kernels (no vector ISA) and oneDNN capped at AVX2; rank 1 the host's best.

    The torch-op path (every GPU, and wherever a rank lacks the kernels)
    must still leave both ranks with the same bits: only what each rank
    computes from the all-reduced P and Q must be the same function
    everywhere, and that is built from elementwise ops.
    """
    port = free_port()
    out = str(tmp_path / "params")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        base.pop(name, None)
    portable = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r), **(portable if r == 0 else {})} for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.compression.powersgd_isa_job", out], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for env in envs]
    try:
        logs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    ranks = [torch.load(f"{out}-{rank}.pt") for rank in range(2)]
    assert ranks[0]["capability"] == "DEFAULT"
    assert ranks[0]["compression_rate"] > 1.0
    for name in ("params", "masters"):
        for a, b in zip(ranks[0][name], ranks[1][name], strict=True):
            assert torch.equal(a, b), f"{name} differ between the ranks: max {(a.float() - b.float()).abs().max()}"


def _fingerprint_worker(rank, world_size, directory):
    """Rank 1 builds its kernels with FP contraction on (as a compiler defaulting to it would); rank 0 as usual."""
    from distamp.compression import low_rank_kernels

    os.environ[KERNELS_ENV] = "auto"
    os.environ["DISTAMP_CACHE_DIR"] = os.path.join(directory, f"cache-{rank}")
    if rank == 1:
        wrapper = os.path.join(directory, "contracting-cc")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec {" ".join(low_rank_kernels.find_compiler())} "$@" -ffp-contract=fast\n')
        os.chmod(wrapper, 0o755)
        os.environ["CC"] = wrapper
    built = low_rank_kernels.load()
    strategy = _strategy(dtype="bfloat16", o2=True, start_step=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, wrapped, opt = _build(strategy)
        applied = [_train_step(wrapped, opt, *_batch(rank, step)) for step in range(1, 4)]
    return {"fingerprint": built.fingerprint, "kernels": opt.policy.compressor.kernels is not None,
            "applied": applied, "params": _flat(model), "messages": [str(w.message) for w in caught]}


def test_kernels_built_to_other_bits_make_every_rank_use_torch_ops(tmp_path):
    if not compiler_present():
        pytest.skip("no C compiler: no kernels to tell apart")
    out = run_workers(_fingerprint_worker, 2, str(tmp_path), timeout=110)
    if out[0]["fingerprint"] == out[1]["fingerprint"]:
        pytest.skip("this CPU or compiler has no fused multiply-add: -ffp-contract=fast builds the same bits")
    for result in out:
        assert not result["kernels"]
        assert result["applied"] == [True] * 3
        warned = [m for m in result["messages"] if "compute other bits on other ranks" in m]
        assert len(warned) == 1, result["messages"]
        assert f"rank 0: {out[0]['fingerprint']:015x}, rank 1: {out[1]['fingerprint']:015x}" in warned[0]
        assert "-ffp-contract=fast" in warned[0]
    assert torch.equal(out[0]["params"], out[1]["params"])


# ----------------------------------------------------------------------------- memory formats


def _conv_net(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _conv_batch(rank: int, step: int, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 4, 8, 8, generator=g)
    y = torch.randint(0, 4, (8,), generator=g)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x, y


def _format_worker(rank, world_size, channels_last, saved=None, in_memory_order=False):
    """Six steps (saving the states after the third), or the last three resumed from ``saved``.

    ``in_memory_order``: ``saved``'s PowerSGD state is rewritten as the
    format before held it (the conv weight's matrices in channels_last
    memory order, labelled ``distamp.PowerSGD/1``).
    """
    strategy = _strategy(amp=False, rank=1, start_step=0, min_compression_rate=1.0)
    model, wrapped, opt = _build(strategy, model=_conv_net(channels_last))
    states = None
    if saved is not None:
        model.load_state_dict(saved[rank]["model"])
        optimizer_state = copy.deepcopy(saved[rank]["optimizer"])
        if in_memory_order:
            psgd = optimizer_state["powersgd"]
            psgd["format"] = "distamp.PowerSGD/1"
            psgd["error"]["0.weight"] = psgd["error"]["0.weight"].view(8, 4, 3, 3).permute(0, 2, 3, 1).reshape(8, 36)
            psgd["q"]["0.weight"] = psgd["q"]["0.weight"].view(1, 4, 3, 3).permute(0, 2, 3, 1).reshape(1, 36)
        opt.load_state_dict(optimizer_state)
    for step in range(1 if saved is None else 4, 7):
        assert _train_step(wrapped, opt, *_conv_batch(rank, step, channels_last))
        if step == 3:
            states = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    compressor = opt.policy.compressor
    return {"params": _flat(model), "states": states, "error": compressor.error["0.weight"].clone(),
            "q": compressor.q["0.weight"].clone()}


def test_a_channels_last_model_compresses_what_a_contiguous_one_does():
    """DDP's hook sees a channels_last gradient in (O, H, W, C) order; the matrix is still (O, C*H*W)."""
    contiguous = run_workers(_format_worker, 2, False, timeout=100)
    channels_last = run_workers(_format_worker, 2, True, timeout=100)
    for a, b in zip(contiguous, channels_last, strict=True):
        # The convolutions round differently in the two formats; the rest is the same computation.
        torch.testing.assert_close(b["params"], a["params"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b["error"], a["error"], rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(b["q"], a["q"], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("resume_channels_last", [False, True])
def test_a_state_saved_channels_last_resumes_in_either_memory_format(resume_channels_last):
    clean = run_workers(_format_worker, 2, True, timeout=100)
    saved = [out["states"] for out in clean]
    assert saved[0]["optimizer"]["powersgd"]["format"] == "distamp.PowerSGD/2"
    resumed = run_workers(_format_worker, 2, resume_channels_last, saved, timeout=100)
    for a, b in zip(clean, resumed, strict=True):
        if resume_channels_last:
            assert torch.equal(a["params"], b["params"])
            assert torch.equal(a["error"], b["error"])
        else:  # the convolutions round differently in the two formats
            torch.testing.assert_close(b["params"], a["params"], rtol=1e-4, atol=1e-6)
    assert not torch.equal(clean[0]["error"], clean[1]["error"])


def test_a_state_of_the_format_before_is_moved_out_of_memory_order_at_the_first_backward():
    """distamp.PowerSGD/1 held a channels_last weight's error and Q in memory order: resumed bitwise."""
    clean = run_workers(_format_worker, 2, True, timeout=100)
    resumed = run_workers(_format_worker, 2, True, [out["states"] for out in clean], True, timeout=100)
    for a, b in zip(clean, resumed, strict=True):
        assert torch.equal(a["params"], b["params"])
        assert torch.equal(a["error"], b["error"])
        assert torch.equal(a["q"], b["q"])


def _strided_worker(rank, world_size, kernels, dtype):
    """Three hook calls on one gradient given contiguous and channels_last: the gradients written and the
    error feedback, per format."""
    import distamp.compression.powersgd as powersgd
    from distamp.strategy import PowerSGDConfig

    os.environ[KERNELS_ENV] = kernels
    g = torch.Generator().manual_seed(5)
    logical = [(torch.randn(8, 4, 3, 3, generator=g) * 1e-3).to(dtype) * 1024 for _ in range(3)]
    out = {}
    for memory_format in (torch.contiguous_format, torch.channels_last):
        param = torch.empty(8, 4, 3, 3).contiguous(memory_format=memory_format)
        compressor = powersgd.PowerSGD(PowerSGDConfig(rank=2, start_step=0), {"w": param}, dtype)
        written = []
        for grad in logical:
            grad = grad.clone(memory_format=memory_format)
            hook_view = grad.permute(memory_order(param)).reshape(8, 4, 3, 3)  # as DDP's hook sees it
            compressed, _ = compressor.split([hook_view], [param])
            compressor.compress(compressed, 1024.0)
            compressor.resolve(True)
            written.append(hook_view.as_strided(grad.shape, grad.stride()).clone())
        out[str(memory_format)] = (written, compressor.state_dict()["error"]["w"])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_strided_gradient_is_compressed_to_the_bits_of_the_contiguous_one(kernels, dtype):
    (out,) = run_workers(_strided_worker, 1, kernels, dtype, timeout=100)
    (contiguous, error), (channels_last, cl_error) = out.values()
    assert all(torch.equal(a, b) for a, b in zip(contiguous, channels_last, strict=True))
    assert torch.equal(error, cl_error)
    assert not torch.equal(contiguous[0], contiguous[1])


def test_relayout_moves_each_entry_to_its_element_and_back():
    grad = torch.randn(8, 4, 3, 3)
    cl = (0, 2, 3, 1)
    hook_cl = grad.permute(cl).reshape(-1)  # a channels_last gradient's memory, in order
    hook = grad.reshape(-1)
    assert memory_order(grad.contiguous(memory_format=torch.channels_last)) == cl
    assert memory_order(grad) == (0, 1, 2, 3)
    assert memory_order(grad.transpose(0, 1)) == (1, 0, 2, 3)
    assert memory_order(grad[:, ::2]) == (0, 1, 2, 3)  # not dense: the reducer gives it a contiguous gradient
    assert torch.equal(relayout(hook_cl, grad.shape, cl, (0, 1, 2, 3)), hook)
    assert torch.equal(relayout(hook, grad.shape, (0, 1, 2, 3), cl), hook_cl)
    # Q^T's columns are the parameter's dims after the first: (rank, C*H*W) <-> (rank, H*W*C).
    qt = torch.randn(2, 4, 3, 3)
    qt_cl = qt.permute(0, 2, 3, 1).reshape(2, 36)
    assert torch.equal(relayout(qt_cl, (4, 3, 3), (1, 2, 0), (0, 1, 2)), qt.reshape(2, 36))
    with pytest.raises(ValueError, match=r"memory orders \(0, 1\) and \(0, 1, 2, 3\) must each be a permutation"):
        relayout(hook, grad.shape, (0, 1), (0, 1, 2, 3))


def _hook_view_worker(rank, world_size):
    conv = nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
    linear = nn.Linear(8 * 6 * 6, 5)
    linear.weight = nn.Parameter(linear.weight.detach().t().contiguous().t())  # column-major
    model = nn.Sequential(conv, nn.Flatten(), linear)
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    seen = {}

    def hook(state, bucket):  # unannotated: DDP refuses the string annotations of this module
        for grad, param in zip(bucket.gradients(), bucket.parameters(), strict=True):
            seen[id(param)] = (grad.clone(), as_indexed(grad, param).clone())
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    ddp.register_comm_hook(None, hook)
    ddp(torch.randn(2, 4, 8, 8).contiguous(memory_format=torch.channels_last)).sum().backward()
    out = {}
    for name, param in model.named_parameters():
        hook_view, indexed = seen[id(param)]
        in_memory = torch.equal(hook_view.reshape(-1), param.grad.permute(memory_order(param)).reshape(-1))
        out[name] = (memory_order(param), in_memory, torch.equal(indexed, param.grad))
    return out


def test_ddps_hook_sees_the_gradient_in_memory_order_and_as_indexed_as_the_parameter():
    """What the hook's matrices rest on, checked on each torch of the range."""
    (out,) = run_workers(_hook_view_worker, 1, timeout=60)
    assert out == {"0.weight": ((0, 2, 3, 1), True, True), "0.bias": ((0,), True, True),
                   "2.weight": ((1, 0), True, True), "2.bias": ((0,), True, True)}
