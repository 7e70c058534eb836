"""core.chunked_update: O2's chunked check and update give today's whole-gradient results bit for bit.

The reference below is the algorithm O2 ran before chunking, written out
here: the 16-bit gradients copied whole into FP32, multiplied by the
float32 reciprocal of the scale, checked for inf/NaN, and one step of a
separate torch optimizer on separate FP32 masters, rounded into a 16-bit
copy. Chunks are made small so that every large parameter is cut.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import distamp.core.chunked_update as chunked_update
from distamp.amp import auto_cast
from distamp.core.chunked_update import SLICE_ALIGN, chunk_numel, plan_chunks, room_below_peak, steps_in_chunks
from distamp.optim import AmpOptimizer
from distamp.strategy import DistributedStrategy
from distamp.torch_compat import tree_leaves

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd_no_momentum": lambda p: torch.optim.SGD(p, lr=0.1),
    "adam_amsgrad_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=True),
    "adamw_fused_maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True, maximize=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),  # not cut: one step on whole gradients
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(600, 64), nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 10))


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 * SLICE_ALIGN elements: the 38400-element embedding is cut into 4 slices."""
    monkeypatch.setattr(chunked_update, "_MIN_CHUNK", 3 * SLICE_ALIGN)
    monkeypatch.setattr(chunked_update, "_CHUNKS", 10_000)


@pytest.fixture(params=["small_chunks", "one_chunk"])
def chunking(request, monkeypatch):
    """Small chunks (the embedding cut into slices, every chunk built twice: to check, then to step), or one
    chunk, as on a GPU with room below the peak (the check's FP32 gradients are kept and stepped on)."""
    if request.param == "small_chunks":
        request.getfixturevalue("small_chunks")
    else:
        monkeypatch.setattr(chunked_update, "room_below_peak", lambda device: 1 << 40)
    fills = []
    fill = chunked_update._Filler.fill
    monkeypatch.setattr(chunked_update._Filler, "fill", lambda self, chunk: (fills.append(1), fill(self, chunk))[1])
    return request.param, fills


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_o2_masters_state_and_skips_are_bitwise_the_whole_gradient_algorithm(chunking, name, dtype):
    low = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    how, fills = chunking
    model = _model()
    ref_masters = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    ref_opt = OPTIMIZERS[name](ref_masters)
    strategy = DistributedStrategy(amp=True)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": dtype,
                            **({"init_loss_scaling": 1024.0, "incr_every_n_steps": 2} if dtype == "float16" else {})}
    opt = AmpOptimizer(OPTIMIZERS[name](model.parameters()), strategy)
    masters = opt.master_weights.masters
    g = torch.Generator().manual_seed(1)
    decisions, ref_decisions = [], []
    for step in range(6):
        x, y = torch.randint(0, 600, (4, 3), generator=g), torch.randint(0, 10, (4, 3), generator=g)
        with auto_cast(dtype=dtype):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad()
        opt.backward(loss)
        if step == 3:
            model[0].weight.grad[5, 7] = float("inf")
        grads16 = [p.grad.clone() for p in model.parameters()]
        scale = opt.get_loss_scaling()
        fills.clear()
        decisions.append(opt.step())
        if how == "one_chunk" and name != "rmsprop":
            assert len(fills) == 1  # the check's fill; the step used its gradients
        elif how == "small_chunks" and decisions[-1] and name != "rmsprop":
            assert len(fills) == 2 * 5  # 5 chunks (the embedding in 4 slices), built to check, then to step

        # The reference: whole FP32 gradients, unscaled by GradScaler's float32 reciprocal, checked, one step.
        inv = torch.tensor(1.0 / scale, dtype=torch.float32)
        ref_grads = [g16.float() * inv for g16 in grads16]
        finite = all(bool(torch.isfinite(gr).all()) for gr in ref_grads)
        ref_decisions.append(finite)
        if finite:
            for m, gr in zip(ref_masters, ref_grads, strict=True):
                m.grad = gr
            ref_opt.step()
        for p, m, ref in zip(model.parameters(), masters, ref_masters, strict=True):
            assert torch.equal(m.detach(), ref.detach()), (step, tuple(m.shape))
            expected_model = ref.detach() if p.dtype == torch.float32 else ref.detach().to(low)
            assert torch.equal(p.detach(), expected_model)
    assert decisions == ref_decisions == [True, True, True, False, True, True]
    for m, ref in zip(masters, ref_masters, strict=True):
        state, ref_state = opt.inner_opt.state[m], ref_opt.state[ref]
        assert state.keys() == ref_state.keys()
        for key, value in ref_state.items():
            assert torch.equal(state[key], value) if torch.is_tensor(value) else state[key] == value, key
    assert opt.inner_opt.param_groups[0]["params"] == masters  # the groups are restored after each chunk
    assert all(m.grad is None for m in masters)  # no FP32 gradient outlives the step


def test_the_update_steps_per_chunk_only_sliceable_optimizers(small_chunks):
    model = _model()
    assert steps_in_chunks(torch.optim.AdamW(model.parameters()))
    assert not steps_in_chunks(torch.optim.RMSprop(model.parameters()))
    assert not steps_in_chunks(torch.optim.Adam(model.parameters(), differentiable=True))

    class Custom(torch.optim.SGD):
        pass

    assert not steps_in_chunks(Custom(model.parameters(), lr=0.1))  # a subclass may couple elements


@pytest.mark.parametrize("numels", [[10, 20, 30], [5, 100_000, 7, 7, 40_000], [70_000], [1, 12_288, 12_289]])
def test_plan_covers_every_element_once_within_the_limit(numels):
    limit = 3 * SLICE_ALIGN
    chunks = plan_chunks(numels, limit, [True] * len(numels))
    covered: dict[int, list[tuple[int, int]]] = {}
    for chunk in chunks:
        assert sum(p.hi - p.lo for p in chunk) <= limit
        for piece in chunk:
            covered.setdefault(piece.index, []).append((piece.lo, piece.hi))
            assert piece.whole == (piece.lo == 0 and piece.hi == numels[piece.index])
            assert piece.lo % SLICE_ALIGN == 0
    for index, n in enumerate(numels):
        ranges = sorted(covered[index])
        assert ranges[0][0] == 0
        assert ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert [p.index for chunk in chunks for p in chunk] == sorted(p.index for chunk in chunks for p in chunk)


def test_a_parameter_that_may_not_be_cut_is_a_chunk_of_its_own():
    chunks = plan_chunks([5, 50_000, 5], 3 * SLICE_ALIGN, [True, False, True])
    assert [[(p.index, p.lo, p.hi) for p in c] for c in chunks] == [[(0, 0, 5)], [(1, 0, 50_000)], [(2, 0, 5)]]


def test_chunk_size_is_a_sixteenth_of_the_model_at_least_64k_and_aligned():
    assert chunk_numel(1000) == 1 << 16
    assert chunk_numel(160_000_000) == 10_002_432  # 10**7 rounded up to a multiple of 4096
    assert chunk_numel(160_000_000) % SLICE_ALIGN == 0


def test_room_below_the_peak_makes_chunks_larger_up_to_the_whole_model():
    # 16 bytes an element: room for 20M elements gives chunks of 20M (aligned), room beyond the model one chunk.
    assert chunk_numel(160_000_000, room_bytes=16 * 20_000_000) == 20_000_768
    assert chunk_numel(160_000_000, room_bytes=16 * 400_000_000) == 160_002_048
    assert chunk_numel(160_000_000, room_bytes=16 * 1_000_000) == 10_002_432  # less room: a sixteenth still


def test_a_device_without_allocator_statistics_has_no_room():
    assert room_below_peak(torch.device("cpu")) == 0


def test_parameters_that_are_their_own_masters_step_and_unused_ones_stay(small_chunks):
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    own = nn.Parameter(torch.randn(3, dtype=torch.float64))  # float64: no separate FP32 master
    unused = nn.Parameter(torch.randn(5))
    ref_own = nn.Parameter(own.detach().clone())
    unused_before = unused.detach().clone()
    strategy = DistributedStrategy(amp=True)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16"}
    opt = AmpOptimizer(torch.optim.AdamW([*linear.parameters(), own, unused], lr=0.1), strategy)
    with auto_cast(dtype="bfloat16"):
        loss = linear(torch.ones(2, 4)).float().sum() + (own**2).sum().float()
    opt.backward(loss)
    ref_own.grad = own.grad.clone()
    assert opt.step()
    torch.optim.AdamW([ref_own], lr=0.1).step()
    assert torch.equal(own.detach(), ref_own.detach())
    assert torch.equal(opt.master_weights.master_for(unused).detach(), unused_before)
    assert opt.master_weights.master_for(unused) not in opt.inner_opt.state


class _Source:
    """A gradient source that is not a model parameter (as a piece of a sharded 16-bit gradient slice)."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def test_sources_that_are_not_parameters_step_their_masters_and_nothing_is_copied_back():
    g = torch.Generator().manual_seed(3)
    masters = [nn.Parameter(torch.randn(n, generator=g)) for n in (5000, 300, 9000)]
    grads16 = [torch.randn(m.numel(), generator=g).bfloat16() * 64 for m in masters]
    sources = [_Source(grad.clone()) for grad in grads16]
    reference = [nn.Parameter(m.detach().clone()) for m in masters]
    for ref, grad in zip(reference, grads16, strict=True):
        ref.grad = grad.float() / 64  # exact: a power of two
    torch.optim.AdamW(reference, lr=1e-2).step()
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    pairs = list(zip(sources, masters, strict=True))
    found, grad_max, _ = chunked_update.check_in_chunks(pairs, None, 1 / 64, True, SLICE_ALIGN)
    assert found.item() == 0
    assert grad_max.item() == max(grad.float().abs().max().item() / 64 for grad in grads16)
    chunked_update.step_in_chunks(optimizer, pairs, None, 1 / 64, SLICE_ALIGN, into_model=False)
    for master, ref in zip(masters, reference, strict=True):
        assert torch.equal(master, ref)  # elementwise: chunks of 4096 elements step as the whole
    assert all(torch.equal(s.grad, grad) for s, grad in zip(sources, grads16, strict=True))  # left as they were
    assert [m.grad for m in masters] == [None, None, None]


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "rmsprop"])
def test_stepping_and_freeing_in_chunks_is_bitwise_one_step_and_leaves_no_gradient(name):
    """Whole small parameters together, the large ones cut in slices with their state, smallest first: two steps
    (the first makes the state slice by slice) give the parameters and state of two plain ``step()`` calls, and
    every ``.grad`` is freed."""
    torch.manual_seed(0)
    shapes = [(300, 130), (7,), (64, 64), (30, 20), (5000,)]  # 39000 and 4096 elements pass a 3 * 4096 limit
    reference = [nn.Parameter(torch.randn(shape)) for shape in shapes]
    chunked = [nn.Parameter(p.detach().clone()) for p in reference]
    whole_opt, chunked_opt = OPTIMIZERS[name](reference), OPTIMIZERS[name](chunked)
    assert steps_in_chunks(chunked_opt)
    for step in range(2):
        grads = [torch.randn(shape) for shape in shapes]
        for p, q, g in zip(reference, chunked, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        chunked[1].grad = reference[1].grad = None  # a parameter without a gradient stays as it is
        outsider = nn.Parameter(torch.ones(50_000))  # not the optimizer's: not stepped, its gradient kept
        outsider.grad = torch.ones(50_000)
        whole_opt.step()
        chunked_update.step_and_free_in_chunks(chunked_opt, [*chunked, outsider], 3 * SLICE_ALIGN)
        assert all(q.grad is None for q in chunked)
        assert torch.equal(outsider, torch.ones(50_000))
        assert outsider.grad is not None
        for p, q in zip(reference, chunked, strict=True):
            assert torch.equal(p, q), (name, step)
            assert whole_opt.state[p].keys() == chunked_opt.state[q].keys()
            for key, value in whole_opt.state[p].items():
                assert torch.equal(value, chunked_opt.state[q][key]), (name, step, key)
    assert [len(g["params"]) for g in chunked_opt.param_groups] == [len(shapes)]


class _NewTensors(TorchDispatchMode):
    """Records the largest tensor any op allocates (an output sharing no input's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: torch.optim.SGD(p, lr=0.1), False),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True), False),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), False),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01), True),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), True),
    (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), True),
    (lambda p: torch.optim.Adam(p, lr=0.1), True),
    (lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True), True),
], ids=["sgd", "momentum", "momentum-foreach", "dampening", "weight-decay", "nesterov", "maximize", "adam",
        "adamw-foreach"])
def test_step_makes_temporaries_says_whether_a_step_allocates_parameter_sized_tensors(make, expected):
    # Measured, not assumed: a torch whose optimizer allocated differently would fail here.
    params = [nn.Parameter(torch.randn(4096)) for _ in range(3)]
    optimizer = make(params)
    for p in params:
        p.grad = torch.randn(4096)
    optimizer.step()  # the first step creates the state (momentum buffers, moments): not temporaries
    with _NewTensors() as seen:
        optimizer.step()
    assert (seen.largest >= 4096) is expected
    assert chunked_update.step_makes_temporaries(optimizer) is expected
