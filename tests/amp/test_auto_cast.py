"""auto_cast: op-list dtypes, custom lists, gray ops, gradients, nesting, arguments."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.amp.auto_cast import (
    auto_cast,
    current_autocast_dtype,
    enter_fp32_region,
    exit_fp32_region,
    is_autocast_active,
)
from distamp.amp.op_lists import BLACK_OPS, WHITE_OPS

LOW_DTYPES = [torch.float16, torch.bfloat16]


def _maker(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def t(*shape, lo=-1.0, hi=1.0):
        return (torch.rand(*shape, generator=gen) * (hi - lo) + lo).to(dtype)

    return t


def _spd(t):
    a = t(3, 3).float()
    return (a @ a.T + 3 * torch.eye(3)).to(t(1).dtype)


def _long(*values):
    return torch.tensor(values, dtype=torch.long)


# op name -> (function, args builder). Args are built outside the context in
# the dtype under test; the function is called inside it.
WHITE_CALLS = {
    "matmul": (torch.matmul, lambda t: (t(2, 3), t(3, 2))),
    "linear": (F.linear, lambda t: (t(2, 3), t(4, 3), t(4))),
    "conv1d": (F.conv1d, lambda t: (t(1, 2, 5), t(3, 2, 2))),
    "conv2d": (F.conv2d, lambda t: (t(1, 2, 4, 4), t(3, 2, 2, 2))),
    "conv3d": (F.conv3d, lambda t: (t(1, 1, 3, 3, 3), t(2, 1, 2, 2, 2))),
    "conv_transpose1d": (F.conv_transpose1d, lambda t: (t(1, 2, 4), t(2, 3, 2))),
    "conv_transpose2d": (F.conv_transpose2d, lambda t: (t(1, 2, 3, 3), t(2, 3, 2, 2))),
    "conv_transpose3d": (F.conv_transpose3d, lambda t: (t(1, 1, 2, 2, 2), t(1, 2, 2, 2, 2))),
    "conv_tbc": (torch.conv_tbc, lambda t: (t(5, 1, 2), t(2, 2, 3), t(3))),
    "convolution": (
        lambda x, w: torch.convolution(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
        lambda t: (t(1, 2, 4, 4), t(3, 2, 2, 2)),
    ),
    "bmm": (torch.bmm, lambda t: (t(2, 2, 3), t(2, 3, 2))),
    "mm": (torch.mm, lambda t: (t(2, 3), t(3, 2))),
    "mv": (torch.mv, lambda t: (t(2, 3), t(3))),
    "addmm": (torch.addmm, lambda t: (t(2, 2), t(2, 3), t(3, 2))),
    "addmv": (torch.addmv, lambda t: (t(2), t(2, 3), t(3))),
    "addbmm": (torch.addbmm, lambda t: (t(2, 2), t(3, 2, 4), t(3, 4, 2))),
    "addr": (torch.addr, lambda t: (t(2, 3), t(2), t(3))),
    "baddbmm": (torch.baddbmm, lambda t: (t(2, 2, 2), t(2, 2, 3), t(2, 3, 2))),
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), lambda t: (t(2, 3), t(3, 2))),
    "chain_matmul": (torch.chain_matmul, lambda t: (t(2, 3), t(3, 2))),
    "multi_dot": (lambda a, b: torch.linalg.multi_dot([a, b]), lambda t: (t(2, 3), t(3, 2))),
    "vecdot": (torch.linalg.vecdot, lambda t: (t(2, 3), t(2, 3))),
    "prelu": (F.prelu, lambda t: (t(2, 3), t(1))),
    "scaled_dot_product_attention": (
        F.scaled_dot_product_attention,
        lambda t: (t(1, 2, 3, 4), t(1, 2, 3, 4), t(1, 2, 3, 4)),
    ),
    "lstm_cell": (
        lambda x, h, c, wi, wh, bi, bh: torch.lstm_cell(x, (h, c), wi, wh, bi, bh),
        lambda t: (t(2, 3), t(2, 4), t(2, 4), t(16, 3), t(16, 4), t(16), t(16)),
    ),
    "gru_cell": (torch.gru_cell, lambda t: (t(2, 3), t(2, 4), t(12, 3), t(12, 4), t(12), t(12))),
    "rnn_tanh_cell": (torch.rnn_tanh_cell, lambda t: (t(2, 3), t(2, 4), t(4, 3), t(4, 4), t(4), t(4))),
    "rnn_relu_cell": (torch.rnn_relu_cell, lambda t: (t(2, 3), t(2, 4), t(4, 3), t(4, 4), t(4), t(4))),
}

BLACK_CALLS = {
    # exponentials, logarithms and friends
    "exp": (torch.exp, lambda t: (t(3),)),
    "expm1": (torch.expm1, lambda t: (t(3),)),
    "log": (torch.log, lambda t: (t(3, lo=0.5, hi=2),)),
    "log1p": (torch.log1p, lambda t: (t(3, lo=0.5, hi=2),)),
    "log2": (torch.log2, lambda t: (t(3, lo=0.5, hi=2),)),
    "log10": (torch.log10, lambda t: (t(3, lo=0.5, hi=2),)),
    "pow": (torch.pow, lambda t: (t(3), 2)),
    "reciprocal": (torch.reciprocal, lambda t: (t(3, lo=0.5, hi=2),)),
    "rsqrt": (torch.rsqrt, lambda t: (t(3, lo=0.5, hi=2),)),
    "acos": (torch.acos, lambda t: (t(3, lo=-0.9, hi=0.9),)),
    "asin": (torch.asin, lambda t: (t(3, lo=-0.9, hi=0.9),)),
    "cosh": (torch.cosh, lambda t: (t(3),)),
    "sinh": (torch.sinh, lambda t: (t(3),)),
    "tan": (torch.tan, lambda t: (t(3),)),
    "erfinv": (torch.erfinv, lambda t: (t(3, lo=-0.9, hi=0.9),)),
    "softplus": (F.softplus, lambda t: (t(3),)),
    # reductions and statistics
    "sum": (torch.sum, lambda t: (t(3),)),
    "nansum": (torch.nansum, lambda t: (t(3),)),
    "mean": (torch.mean, lambda t: (t(3),)),
    "nanmean": (torch.nanmean, lambda t: (t(3),)),
    "prod": (torch.prod, lambda t: (t(3),)),
    "cumsum": (torch.cumsum, lambda t: (t(3), 0)),
    "cumprod": (torch.cumprod, lambda t: (t(3), 0)),
    "logsumexp": (torch.logsumexp, lambda t: (t(3), 0)),
    "logcumsumexp": (torch.logcumsumexp, lambda t: (t(3), 0)),
    "var": (torch.var, lambda t: (t(3),)),
    "std": (torch.std, lambda t: (t(3),)),
    "var_mean": (torch.var_mean, lambda t: (t(3),)),
    "std_mean": (torch.std_mean, lambda t: (t(3),)),
    "softmax": (F.softmax, lambda t: (t(2, 3), -1)),
    "log_softmax": (F.log_softmax, lambda t: (t(2, 3), -1)),
    "softmin": (F.softmin, lambda t: (t(2, 3), -1)),
    # norms, distances, normalisation layers
    "norm": (torch.norm, lambda t: (t(3),)),
    "vector_norm": (torch.linalg.vector_norm, lambda t: (t(3),)),
    "matrix_norm": (torch.linalg.matrix_norm, lambda t: (t(3, 3),)),
    "frobenius_norm": (lambda a: torch.frobenius_norm(a, dim=(0, 1)), lambda t: (t(3, 3),)),
    "nuclear_norm": (torch.nuclear_norm, lambda t: (t(3, 3),)),
    "renorm": (torch.renorm, lambda t: (t(3, 3), 2, 0, 1.0)),
    "normalize": (F.normalize, lambda t: (t(2, 3),)),
    "dist": (torch.dist, lambda t: (t(3), t(3))),
    "pdist": (F.pdist, lambda t: (t(3, 2),)),
    "cdist": (torch.cdist, lambda t: (t(2, 3), t(2, 3))),
    "pairwise_distance": (F.pairwise_distance, lambda t: (t(2, 3), t(2, 3))),
    "cosine_similarity": (F.cosine_similarity, lambda t: (t(2, 3), t(2, 3))),
    "layer_norm": (F.layer_norm, lambda t: (t(2, 3), (3,))),
    "batch_norm": (
        lambda x: F.batch_norm(x, torch.zeros(3), torch.ones(3), training=True),
        lambda t: (t(4, 3),),
    ),
    "group_norm": (F.group_norm, lambda t: (t(2, 4), 2)),
    "instance_norm": (F.instance_norm, lambda t: (t(2, 3, 4),)),
    "rms_norm": (F.rms_norm, lambda t: (t(2, 3), (3,))),
    "local_response_norm": (F.local_response_norm, lambda t: (t(1, 4, 3), 2)),
    # losses
    "cross_entropy": (F.cross_entropy, lambda t: (t(2, 3), _long(0, 2))),
    "linear_cross_entropy": (F.linear_cross_entropy, lambda t: (t(2, 3), t(4, 3), _long(0, 3))),
    "nll_loss": (F.nll_loss, lambda t: (t(2, 3), _long(0, 2))),
    "mse_loss": (F.mse_loss, lambda t: (t(3), t(3))),
    "l1_loss": (F.l1_loss, lambda t: (t(3), t(3))),
    "smooth_l1_loss": (F.smooth_l1_loss, lambda t: (t(3), t(3))),
    "huber_loss": (F.huber_loss, lambda t: (t(3), t(3))),
    "kl_div": (
        lambda a, b: F.kl_div(a, b, reduction="batchmean"),
        lambda t: (t(3), t(3, lo=0.1, hi=0.9)),
    ),
    "binary_cross_entropy": (
        F.binary_cross_entropy,
        lambda t: (t(3, lo=0.1, hi=0.9), t(3, lo=0.0, hi=1.0)),
    ),
    "binary_cross_entropy_with_logits": (
        F.binary_cross_entropy_with_logits,
        lambda t: (t(3), t(3, lo=0.0, hi=1.0)),
    ),
    "poisson_nll_loss": (F.poisson_nll_loss, lambda t: (t(3), t(3, lo=0.0, hi=2.0))),
    "gaussian_nll_loss": (F.gaussian_nll_loss, lambda t: (t(3), t(3), t(3, lo=0.5, hi=1.0))),
    "ctc_loss": (
        lambda lp: F.ctc_loss(lp, _long(1, 2).view(1, 2), [5], [2]),
        lambda t: (t(5, 1, 3),),
    ),
    "cosine_embedding_loss": (
        F.cosine_embedding_loss,
        lambda t: (t(2, 3), t(2, 3), _long(1, -1)),
    ),
    "hinge_embedding_loss": (F.hinge_embedding_loss, lambda t: (t(3), _long(1, -1, 1))),
    "margin_ranking_loss": (F.margin_ranking_loss, lambda t: (t(3), t(3), _long(1, -1, 1))),
    "multi_margin_loss": (F.multi_margin_loss, lambda t: (t(2, 3), _long(0, 2))),
    "multilabel_margin_loss": (
        F.multilabel_margin_loss,
        lambda t: (t(2, 3), torch.tensor([[0, 2, -1], [1, -1, 0]])),
    ),
    "multilabel_soft_margin_loss": (
        F.multilabel_soft_margin_loss,
        lambda t: (t(2, 3), t(2, 3, lo=0.0, hi=1.0)),
    ),
    "soft_margin_loss": (F.soft_margin_loss, lambda t: (t(3), _long(1, -1, 1).to(t(1).dtype))),
    "triplet_margin_loss": (F.triplet_margin_loss, lambda t: (t(2, 3), t(2, 3), t(2, 3))),
    "triplet_margin_with_distance_loss": (
        F.triplet_margin_with_distance_loss,
        lambda t: (t(2, 3), t(2, 3), t(2, 3)),
    ),
    # linear algebra
    "inverse": (torch.inverse, lambda t: (_spd(t),)),
    "inv": (torch.linalg.inv, lambda t: (_spd(t),)),
    "pinverse": (torch.pinverse, lambda t: (t(3, 2),)),
    "pinv": (torch.linalg.pinv, lambda t: (t(3, 2),)),
    "det": (torch.det, lambda t: (_spd(t),)),
    "slogdet": (torch.slogdet, lambda t: (_spd(t),)),
    "logdet": (torch.logdet, lambda t: (_spd(t),)),
    "cholesky": (torch.linalg.cholesky, lambda t: (_spd(t),)),
    "solve": (torch.linalg.solve, lambda t: (_spd(t), t(3, 1))),
    "lstsq": (torch.linalg.lstsq, lambda t: (t(3, 2), t(3, 1))),
    "qr": (torch.linalg.qr, lambda t: (t(3, 3),)),
    "svd": (torch.linalg.svd, lambda t: (t(3, 3),)),
    "svdvals": (torch.linalg.svdvals, lambda t: (t(3, 3),)),
    "eigh": (torch.linalg.eigh, lambda t: (_spd(t),)),
    "eigvalsh": (torch.linalg.eigvalsh, lambda t: (_spd(t),)),
    "matrix_exp": (torch.linalg.matrix_exp, lambda t: (t(3, 3),)),
    "trace": (torch.trace, lambda t: (t(3, 3),)),
}


def _float_outputs(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.dtype.is_floating_point else []
    return [o for item in out for o in _float_outputs(item)]


def test_every_listed_op_has_a_dtype_check():
    assert set(WHITE_CALLS) == set(WHITE_OPS)
    assert set(BLACK_CALLS) == set(BLACK_OPS)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(WHITE_CALLS))
def test_white_op_runs_in_low_precision(name, dtype):
    fn, make_args = WHITE_CALLS[name]
    args = make_args(_maker(torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # chain_matmul is deprecated
        with auto_cast(dtype=dtype):
            outs = _float_outputs(fn(*args))
    assert outs
    assert all(o.dtype == dtype for o in outs), [o.dtype for o in outs]


@pytest.mark.filterwarnings("ignore:.*(frobenius|nuclear)_norm is deprecated")
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(BLACK_CALLS))
def test_black_op_runs_in_fp32(name, dtype):
    fn, make_args = BLACK_CALLS[name]
    args = make_args(_maker(dtype))
    with auto_cast(dtype=dtype):
        out = fn(*args)
    outs = _float_outputs(out)
    assert outs
    assert all(o.dtype == torch.float32 for o in outs), [o.dtype for o in outs]
    # The op really ran on the float32 upcast of its inputs: bitwise, except
    # for LAPACK's least-squares driver, whose result on this CPU varies by
    # an ulp or so with the buffers' addresses (seen in repeated runs).
    tol = 1e-5 if name == "lstsq" else 0.0
    up = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args)
    for got, want in zip(outs, _float_outputs(fn(*up))):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_method_and_operator_forms_follow_the_lists(dtype):
    t = _maker(torch.float32)
    x, w = t(2, 3), t(3, 3)
    xl = x.to(dtype)
    with auto_cast(dtype=dtype):
        white = [x @ w, x.matmul(w), nn.Linear(3, 2)(x), w.__rmatmul__(x)]
        black = [
            xl**2, 2**xl, xl.pow(2), xl.exp(), xl.sum(), xl.mean(), xl.softmax(-1),
            xl.norm(), torch.special.expm1(xl), torch.special.log_softmax(xl, -1),
            nn.LayerNorm(3)(xl), nn.CrossEntropyLoss()(xl, _long(0, 1)),
        ]
    assert [o.dtype for o in white] == [dtype] * len(white)
    assert [o.dtype for o in black] == [torch.float32] * len(black)


def test_gray_op_follows_its_input():
    x = _maker(torch.float32)(2, 3)
    with auto_cast(dtype=torch.bfloat16):
        assert F.relu(x).dtype == torch.float32
        assert F.relu(x.bfloat16()).dtype == torch.bfloat16
        assert F.gelu(x @ x.T).dtype == torch.bfloat16


def test_gray_op_widens_mixed_inputs_so_non_promoting_ops_work():
    t = _maker(torch.float32)
    a, b = t(4), t(4)
    with pytest.raises(RuntimeError):
        torch.dot(a, b.bfloat16())  # torch.dot does not type-promote
    with auto_cast(dtype="bfloat16"):
        out = torch.dot(a, b.bfloat16())
        mixed = torch.add(a.half(), b.bfloat16())
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.dot(a, b.bfloat16().float()))
    assert mixed.dtype == torch.float32  # the widest of float16 and bfloat16


def test_gray_zero_dim_tensors_follow_torch_type_promotion():
    t = _maker(torch.float32)
    x, scale = t(5).bfloat16(), torch.tensor(0.1)
    with auto_cast(dtype="bfloat16"):
        got = x * scale
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, x * scale)  # same as without auto_cast


def test_inplace_ops_non_floating_float64_and_out_are_never_cast():
    t = _maker(torch.float32)
    x, y = t(2, 3), t(2, 3).bfloat16()
    ints = torch.arange(6).view(2, 3)
    doubles = t(2, 3).double()
    out = torch.empty(2, 2)
    with auto_cast(dtype="bfloat16"):
        same = x.add_(y)
        x[0] = y[1]
        assert torch.matmul(ints, ints.T).dtype == torch.int64
        assert torch.matmul(doubles, doubles.T).dtype == torch.float64
        assert (doubles.exp()).dtype == torch.float64
        torch.matmul(x, x.T, out=out)
        assert x.type_as(y).dtype == torch.bfloat16
    assert same is x and x.dtype == torch.float32
    assert torch.equal(x[0], y[1].float())
    assert torch.equal(out, x @ x.T)


def test_black_batch_norm_still_updates_fp32_running_stats():
    x = _maker(torch.bfloat16)(4, 3)
    mean, var = torch.zeros(3), torch.ones(3)
    with auto_cast(dtype="bfloat16"):
        out = F.batch_norm(x, mean, var, training=True, momentum=1.0)
    assert out.dtype == torch.float32
    assert torch.equal(mean, x.float().mean(0))


def test_ops_are_classified_once_and_getters_pass_straight_through():
    from distamp.amp.auto_cast import _PASS, _WHITE

    ctx = auto_cast(dtype="bfloat16")
    categories = ctx._policy.categories
    x = torch.ones(2, 2)
    with ctx:
        x.shape  # noqa: B018
        x.add_(1)
        x @ x
        x @ x
    getter = torch.Tensor.shape.__get__
    assert categories[getter] == _PASS
    assert categories[torch.Tensor.add_] == _PASS
    assert categories[torch.Tensor.matmul] == _WHITE  # what `x @ x` dispatches as
    assert auto_cast(dtype="bfloat16")._policy is ctx._policy  # the cache is shared


def test_custom_lists_move_ops_both_ways():
    t = _maker(torch.float32)
    x, w = t(2, 3), t(3, 3)
    img, k = t(1, 1, 3, 3), t(1, 1, 2, 2)
    with auto_cast(dtype="bfloat16", custom_black_list=["matmul"], custom_white_list=["softmax"]):
        assert (x @ w).dtype == torch.float32
        assert (x.bfloat16() @ w).dtype == torch.float32
        assert F.softmax(x, -1).dtype == torch.bfloat16
        assert F.linear(x, w).dtype == torch.bfloat16  # untouched white op
        assert x.bfloat16().exp().dtype == torch.float32  # untouched black op
    with auto_cast(dtype="float16", custom_black_list=["conv"], custom_white_list=["F.gelu"]):
        assert F.conv2d(img, k).dtype == torch.float32
        assert F.conv_transpose2d(img, k).dtype == torch.float32
        assert F.gelu(x).dtype == torch.float16  # gray -> white
    with auto_cast(dtype="float16", custom_black_list=["Tensor.__matmul__"]):
        assert torch.matmul(x, w).dtype == torch.float32


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_matches_torch_autocast_bitwise(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.randn(5, 3)

    def run(ctx):
        model.zero_grad(set_to_none=True)
        with ctx:
            out = model(x)
            loss = F.mse_loss(out, y)
        loss.backward()
        return out, loss, [p.grad for p in model.parameters()]

    ours = run(auto_cast(dtype=dtype))
    ref = run(torch.autocast("cpu", dtype=dtype))
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    for got, want in zip(ours[2], ref[2]):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)


def test_tied_weight_is_cast_once_like_torch_autocast():
    # torch.autocast caches the cast of a leaf parameter, so the two uses'
    # BF16 gradients are summed before the cast back to FP32; ours does too.
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4)

    def grad(ctx):
        w.grad = None
        with ctx:
            loss = F.linear(F.linear(x, w), w).float().sum()
        loss.backward()
        return w.grad

    assert torch.equal(grad(auto_cast(dtype="bfloat16")), grad(torch.autocast("cpu", torch.bfloat16)))


def test_weight_cast_cache_sees_in_place_updates():
    w = nn.Parameter(torch.ones(2, 2))
    x = torch.ones(1, 2)
    with auto_cast(dtype="bfloat16"):
        before = F.linear(x, w)
        with torch.no_grad():
            w.mul_(2)
        after = F.linear(x, w)
    assert torch.equal(after, 2 * before)


def test_gradients_flow_back_in_each_parameter_dtype():
    torch.manual_seed(0)
    w32 = nn.Parameter(torch.randn(3, 3))
    w16 = nn.Parameter(torch.randn(3, 3).bfloat16())
    x = torch.randn(2, 3)
    with auto_cast(dtype="bfloat16"):
        h = F.linear(x, w32)
        loss = (h @ w16).exp().sum()
    loss.backward()
    assert w32.grad.dtype == torch.float32
    assert w16.grad.dtype == torch.bfloat16
    assert torch.isfinite(w32.grad).all() and torch.isfinite(w16.grad).all()


def _matmul_dtype():
    a = torch.ones(2, 2)
    return (a @ a).dtype


def test_nested_contexts_restore_the_outer_state():
    assert _matmul_dtype() == torch.float32
    with auto_cast(dtype="float16"):
        assert _matmul_dtype() == torch.float16
        with auto_cast(dtype="bfloat16", custom_black_list=["linear"]):
            assert _matmul_dtype() == torch.bfloat16
            assert current_autocast_dtype() == torch.bfloat16
        assert _matmul_dtype() == torch.float16
        with auto_cast(enable=False):
            assert _matmul_dtype() == torch.float32
            assert not is_autocast_active()
        assert _matmul_dtype() == torch.float16
        assert current_autocast_dtype() == torch.float16
    assert _matmul_dtype() == torch.float32
    assert not is_autocast_active() and current_autocast_dtype() is None
    assert torch._C._len_torch_function_stack() == 0


def test_state_is_restored_after_an_exception():
    with auto_cast(dtype="float16"):
        with pytest.raises(ZeroDivisionError), auto_cast(dtype="bfloat16"):
            1 / 0  # noqa: B018
        assert _matmul_dtype() == torch.float16
        with pytest.raises(ZeroDivisionError), auto_cast(enable=False):
            1 / 0  # noqa: B018
        assert _matmul_dtype() == torch.float16
    with pytest.raises(ZeroDivisionError), auto_cast(dtype="float16"):
        1 / 0  # noqa: B018
    assert _matmul_dtype() == torch.float32
    assert torch._C._len_torch_function_stack() == 0


def test_disabled_context_is_a_clean_no_op():
    with auto_cast(enable=False):
        assert torch._C._len_torch_function_stack() == 0
        assert _matmul_dtype() == torch.float32
        with auto_cast(dtype="bfloat16"):
            assert _matmul_dtype() == torch.bfloat16
        assert torch._C._len_torch_function_stack() == 0


def test_fp32_region_suspends_low_precision_casting():
    x = torch.ones(2, 2).bfloat16()
    with auto_cast(dtype="bfloat16"):
        token = enter_fp32_region()
        assert not is_autocast_active()
        assert _matmul_dtype() == torch.float32
        assert (x @ x).dtype == torch.float32  # white ops cast up there
        exit_fp32_region(token)
        assert _matmul_dtype() == torch.bfloat16


def test_decorator_and_threads():
    @auto_cast(dtype="bfloat16")
    def f(depth):
        return f(depth - 1) if depth else _matmul_dtype()

    assert f(3) == torch.bfloat16
    assert _matmul_dtype() == torch.float32
    seen = []
    with auto_cast(dtype="bfloat16"):
        worker = threading.Thread(target=lambda: seen.append(_matmul_dtype()))
        worker.start()
        worker.join()
    assert seen == [torch.float32]  # casting is per thread, like torch.autocast


def test_bad_arguments_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match=r"dtype=.*'float32'"):
        auto_cast(dtype="float32")
    with pytest.raises(ValueError, match=r"Did you mean 'bfloat16'\?"):
        auto_cast(dtype="bfloat")
    with pytest.raises(ValueError, match=r"torch\.float32"):
        auto_cast(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"custom_white_list.*'softmx'.*Did you mean 'softmax'\?"):
        auto_cast(custom_white_list=["softmx"])
    with pytest.raises(TypeError, match=r"custom_black_list=\['exp'\]"):
        auto_cast(custom_black_list="exp")
    with pytest.raises(TypeError, match=r"strings, got 3"):
        auto_cast(custom_black_list=[3])
    with pytest.raises(ValueError, match=r"\['matmul'\] are on both"):
        auto_cast(custom_white_list=["matmul"], custom_black_list=["torch.matmul"])
    with pytest.raises(ValueError, match=r"'conv2d'.*on both"):
        auto_cast(custom_white_list=["conv"], custom_black_list=["conv2d"])
    with pytest.raises(TypeError, match=r"enable=.*'yes'"):
        auto_cast(enable="yes")
