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

import time

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


def _forward_backward(rank, world, wrapped, opt, g) -> torch.Tensor:
    """This rank's part of the next global batch of ``D`` features through ``wrapped``; returns the loss."""
    from distamp import fleet

    x = torch.randn(PER_RANK * world, D, generator=g)[rank * PER_RANK:(rank + 1) * PER_RANK]
    with fleet.auto_cast():
        loss = wrapped(x).float().square().mean()
    opt.zero_grad()
    opt.backward(loss)
    return loss.detach()


def _load_after_step(rank, world, stage, mode, overlap):
    """Two steps, ``model.load_state_dict`` of the start values right after the second, two more steps."""
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4 * D), nn.Tanh(), nn.Linear(4 * D, D))
    amp = {"O1": {"dtype": "bfloat16"}, "O2": {"use_pure_fp16": True, "dtype": "bfloat16"}}.get(mode)
    strategy = _strategy(stage, amp=amp is not None, overlap=overlap, **(amp or {}))
    strategy.fuse_grad_size_in_MB = 0.0002
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    gather, late = opt.master_weights.gather, []
    if rank == 1:  # rank 1's messages leave after rank 0 has loaded: they land on top of the load unless finished
        launch = gather.start
        gather.start = lambda *a, **kw: (time.sleep(0.5 if late else 0), launch(*a, **kw))[1]
    g = torch.Generator().manual_seed(1)
    losses, running_after_load = [], None
    for step in range(4):
        losses.append(_forward_backward(rank, world, wrapped, opt, g))
        late[:] = [step == 1]
        assert opt.step()
        late.clear()
        if step == 1:
            model.load_state_dict(start)  # e.g. a rollback: the gather must not land on top of it
            running_after_load = opt.master_weights.gather_running
            opt.finish_param_gather()
            loaded = _flat(model)
    opt.finish_param_gather()
    return {"losses": torch.stack(losses), "params": _flat(model), "loaded": loaded,
            "start": torch.cat([v.float().reshape(-1) for v in start.values()]), "running": running_after_load}


def _loads(rank, world):
    return {(stage, mode, overlap): _load_after_step(rank, world, stage, mode, overlap)
            for stage in (1, 2) for mode in ("off", "O1") for overlap in (False, True)}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_models_load_state_dict_right_after_step_is_not_overwritten_by_the_gather():
    """Was: the model's load_state_dict() right after step() left the gather running, and its messages (on gloo
    written into the parameters as they land; in O1 and AMP off this rank's slice sent from the parameters) then
    overwrote the loaded values wherever they landed after the load, so the next forward trained on the step's
    values instead. Rank 1 here posts its messages late, so they land after rank 0's load."""
    results = run_workers(_loads, 2, timeout=130)
    for rank, out in enumerate(results):
        for stage in (1, 2):
            for mode in ("off", "O1"):
                plain, overlapped = out[stage, mode, False], out[stage, mode, True]
                assert overlapped["running"] is False, (rank, stage, mode)
                assert torch.equal(overlapped["loaded"], overlapped["start"]), (rank, stage, mode)
                assert torch.equal(plain["loaded"], plain["start"])
                assert torch.equal(overlapped["losses"], plain["losses"]), (rank, stage, mode)
                assert torch.equal(overlapped["params"], plain["params"]), (rank, stage, mode)
                assert torch.equal(overlapped["params"], results[0][stage, mode, True]["params"])


def _copies(rank, world):
    """Per stage and overlap: a deepcopy and a pickled copy of the model after a step, and the training around."""
    import copy
    import io

    from distamp import fleet

    out = {}
    for stage in (1, 2):
        for overlap in (False, True):
            fleet.init()
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(D, 4 * D), nn.Tanh(), nn.Linear(4 * D, D))
            strategy = _strategy(stage, use_pure_fp16=True, dtype="bfloat16", overlap=overlap)
            strategy.fuse_grad_size_in_MB = 0.0002
            opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
            wrapped = fleet.distributed_model(model, strategy)
            g = torch.Generator().manual_seed(1)
            copies, running = [], []
            for step in range(3):
                x = torch.randn(PER_RANK * world, D, generator=g)[rank * PER_RANK:(rank + 1) * PER_RANK]
                with fleet.auto_cast():
                    loss = wrapped(x).float().square().mean()
                opt.zero_grad()
                opt.backward(loss)
                assert opt.step()
                if step == 1:
                    opt.finish_param_gather()  # the copies read the parameters outside a forward
                    ema = copy.deepcopy(model)
                    buffer = io.BytesIO()
                    torch.save(model, buffer)
                    buffer.seek(0)
                    pickled = torch.load(buffer, weights_only=False)
                    copies = [_flat(ema), _flat(pickled)]
            # The copies' forwards run hooks that finish nothing: the original's gather is still running.
            with torch.no_grad():
                outputs = [ema(x.bfloat16()).float(), pickled(x.bfloat16()).float()]
            running.append(opt.master_weights.gather_running)
            opt.finish_param_gather()
            out[stage, overlap] = {"params": _flat(model), "copies": copies, "outputs": outputs, "running": running}
    return out


@pytest.mark.timeout(150)
def test_a_copy_of_the_model_is_made_as_without_overlap_and_its_forward_finishes_nothing():
    """Was: copy.deepcopy(model) (an EMA, a best-model snapshot) and torch.save(model) failed with overlap_param_gather
    on ('AmpOptimizer is not picklable; save optimizer.state_dict() instead': the forward hooks held the
    optimizer), while they work without it."""
    results = run_workers(_copies, 2, timeout=130)
    for out in results:
        for stage in (1, 2):
            plain, overlapped = out[stage, False], out[stage, True]
            assert torch.equal(overlapped["params"], plain["params"]), stage
            for ours, theirs in zip(overlapped["copies"] + overlapped["outputs"], plain["copies"] + plain["outputs"],
                                    strict=True):
                assert torch.equal(ours, theirs), stage
            assert overlapped["running"] == [True]
            assert plain["running"] == [False]


def _compiled(rank, world, overlap):
    """Six steps of a compiled model (each hooked module a graph of its own: the hooks break the graph)."""
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4 * D), nn.Tanh(), nn.Linear(4 * D, D), nn.Tanh(), nn.Linear(D, D))
    strategy = _strategy(2, use_pure_fp16=True, dtype="bfloat16", overlap=overlap)
    strategy.fuse_grad_size_in_MB = 0.0002
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = torch.compile(fleet.distributed_model(model, strategy))
    g = torch.Generator().manual_seed(1)
    losses, running = [], []
    for _ in range(STEPS):
        losses.append(_forward_backward(rank, world, wrapped, opt, g))
        assert opt.step()
        running.append(opt.master_weights.gather_running)
    opt.finish_param_gather()
    return {"losses": torch.stack(losses), "params": _flat(model), "running": running}


def _compiled_runs(rank, world):
    return [_compiled(rank, world, overlap) for overlap in (False, True)]


@pytest.mark.timeout(240)
def test_a_compiled_model_trains_as_without_overlap():
    """Compiled code is not watched op by op, so every hook finishes the whole gather before its module runs.

    With the compiled hooks finishing nothing, the second step's loss already differs (checked by hand)."""
    for plain, overlapped in run_workers(_compiled_runs, 2, timeout=220):
        assert torch.equal(overlapped["losses"], plain["losses"])
        assert torch.equal(overlapped["params"], plain["params"])
        assert overlapped["running"] == [True] * STEPS  # step() did leave the gather to the forward
        assert plain["running"] == [False] * STEPS


def _submodule_state_after_step(rank, world, stage):
    """O2 FP16 with overlap: right after a step, a submodule's ``state_dict()`` (through ``model.module``), and
    right after the next, its ``load_state_dict()`` of its start values while rank 1's messages are late."""
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4 * D), nn.Tanh(), nn.Linear(4 * D, D))
    strategy = _strategy(stage, overlap=True, use_pure_fp16=True, dtype="float16")
    strategy.fuse_grad_size_in_MB = 0.0002
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    start = {k: v.clone() for k, v in model[2].state_dict().items()}
    gather, late = opt.master_weights.gather, []
    if rank == 1:
        launch = gather.start
        gather.start = lambda *a, **kw: (time.sleep(0.5 if late else 0), launch(*a, **kw))[1]
    g = torch.Generator().manual_seed(1)
    _forward_backward(rank, world, wrapped, opt, g)
    assert opt.step()
    saved = {name: {k: v.clone() for k, v in wrapped.module[name].state_dict().items()} for name in (0, 2)}
    masters = {k: v.half() for k, v in opt.fp32_state_dict(wrapped).items()}
    _forward_backward(rank, world, wrapped, opt, g)
    late[:] = [True]
    assert opt.step()
    late.clear()
    wrapped.module[2].load_state_dict(start)  # e.g. a head reset: the gather must not land on top of it
    opt.finish_param_gather()
    return {"saved": all(torch.equal(v, masters[f"{name}.{k}"]) for name, sd in saved.items() for k, v in sd.items()),
            "loaded": all(torch.equal(v, start[k]) for k, v in model[2].state_dict().items())}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_submodules_state_dict_and_load_right_after_step_finish_the_gather_first(stage):
    """Was: only the model's own state_dict() and load_state_dict() finished the gather, so
    model.module[0].state_dict() right after step() returned the last step's values where this rank had not yet
    received them, and model.module[2].load_state_dict() was overwritten by the messages landing after it."""
    for rank, out in enumerate(run_workers(_submodule_state_after_step, 2, stage, timeout=100)):
        assert out == {"saved": True, "loaded": True}, rank
