"""The replica check (``strategy.check_replicas_every``): the hash, and real 2-rank gloo jobs that drift.

The hash is checked against an independent reference written here with
Python integers (the bytes read as little-endian 64-bit words, summed modulo
2**64). The jobs train the same small model on both ranks; one element of
what rank 1 holds is changed by 1e-3 between steps, and every rank must stop
within N steps with the same error naming the parameter, the ranks and the
step, while an unperturbed job (and one with the check off) trains through.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.distributed.replica_check import ReplicaDivergenceError, compare_replicas, tensor_hash
from tests.multiprocess import run_workers

_MASK = 2**64 - 1


def _reference_hash(tensor: torch.Tensor) -> list[int]:
    """The two sums of :func:`tensor_hash`, computed from the raw bytes with Python integers."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    data += bytes(-len(data) % 8)
    words = struct.unpack(f"<{len(data) // 8}q", data)
    total = sum(words) & _MASK
    weighted = sum((j % 251 + 1) * w for j, w in enumerate(words)) & _MASK
    return [w - 2**64 if w >= 2**63 else w for w in (total, weighted)]


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64, torch.int8, torch.bool])
@pytest.mark.parametrize("numel", [0, 1, 3, 250, 251, 252, 251 * 4 + 5, 10_007])
def test_hash_matches_an_independent_reference(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=g) * 1e3
    tensor = values > 0 if dtype is torch.bool else values.to(dtype)
    assert tensor_hash(tensor).tolist() == _reference_hash(tensor)


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_tensors_hash_equal_whatever_their_layout(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(37, 29, generator=g).to(dtype)
    flat = torch.zeros(3 + a.numel(), dtype=dtype)
    flat[3:] = a.reshape(-1)
    at_odd_offset = flat[3:].view(37, 29)  # a view into a flat buffer, as O2 masters are
    transposed = a.t().contiguous().t()  # not contiguous
    assert tensor_hash(a).tolist() == tensor_hash(a.clone()).tolist()
    assert tensor_hash(at_odd_offset).tolist() == tensor_hash(a).tolist()
    assert tensor_hash(transposed).tolist() == tensor_hash(a).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_change_of_1e_3_in_any_one_element_changes_the_hash(dtype):
    g = torch.Generator().manual_seed(1)
    base = (torch.rand(4099, generator=g) * 0.1).to(dtype)  # small values: 1e-3 survives 16-bit rounding
    before = tensor_hash(base).tolist()
    for index in range(base.numel()):
        changed = base.clone()
        changed[index] += 1e-3
        assert not torch.equal(changed, base)
        assert tensor_hash(changed).tolist() != before, index


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_flipped_bit_anywhere_changes_the_hash(dtype):
    base = torch.linspace(-2, 2, 1003).to(dtype)
    words = base.view(torch.int16 if dtype != torch.float32 else torch.int32)
    before = tensor_hash(base).tolist()
    for index in (0, 1, 500, 1002):
        for bit in range(words.element_size() * 8):
            flipped = words.clone()
            flipped[index] ^= (1 << bit) if bit < words.element_size() * 8 - 1 else -(1 << bit)
            assert tensor_hash(flipped.view(dtype)).tolist() != before, (index, bit)


def test_signed_zeros_and_nan_payloads_are_told_apart_equal_bits_are_not():
    assert tensor_hash(torch.tensor([0.0])).tolist() != tensor_hash(torch.tensor([-0.0])).tolist()
    quiet = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(quiet).all()
    assert torch.isnan(payload).all()
    assert tensor_hash(quiet).tolist() != tensor_hash(payload).tolist()
    assert tensor_hash(quiet).tolist() == tensor_hash(quiet.clone()).tolist()


def test_swapped_elements_change_the_hash():
    base = torch.arange(1, 2001, dtype=torch.float32)
    for i, j in ((0, 1), (5, 6), (10, 1500), (0, 1999)):
        swapped = base.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert tensor_hash(swapped).tolist() != tensor_hash(base).tolist(), (i, j)


def test_compare_is_a_no_op_in_a_one_process_world():
    compare_replicas(["w"], [tensor_hash(torch.ones(3))], step=1, applied_step=1)


# --------------------------------------------------------------------------- real 2-rank jobs

STEPS, PER_RANK = 12, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _strategy(stage: int, every: int, dtype: str | None = "bfloat16", powersgd: bool = False):
    """O2 in ``dtype`` (AMP off for None) at sharding ``stage``, checking every ``every`` steps."""
    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=dtype is not None, check_replicas_every=every)
    if dtype is not None:
        scaling = {"init_loss_scaling": 1024.0} if dtype == "float16" else {}
        strategy.amp_configs = {"use_pure_fp16": True, "dtype": dtype, **scaling}
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage, **({"units": ["2"]} if stage == 3 else {})}
    if powersgd:
        strategy.powersgd = True
        strategy.powersgd_configs = {"rank": 2, "start_step": 2, "min_compression_rate": 1.0}
    return strategy


def _smallest_element(tensor: torch.Tensor) -> tuple[int, int]:
    """The index of the element nearest zero, where 1e-3 survives 16-bit rounding."""
    flat = int(tensor.detach().float().abs().argmin())
    return flat // tensor.shape[1], flat % tensor.shape[1]


def _perturb(tensor: torch.Tensor) -> None:
    """Add 1e-3 to one element, and make sure it changed (else the test could not fail)."""
    index = _smallest_element(tensor)
    with torch.no_grad():
        before = tensor[index].clone()
        tensor[index] += 1e-3
        assert not torch.equal(tensor[index], before)


def _job(rank, world, stage, every, target, perturb_after, dtype="bfloat16", powersgd=False, compiled=False):
    """Train STEPS steps; rank 1 perturbs ``target`` of ``2.weight`` after step ``perturb_after``.

    ``target``: ``"param"`` (the model's parameter, once), ``"param each step"``
    (the same after every step from then on: a rank that keeps computing with
    other values), ``"master"`` (its FP32 master, O2 unsharded),
    ``"gathered"`` (stage 3: rank 1's gathered copy, in each forward from
    then on), ``"shard"`` (stage 3: rank 1's FP32 shard). ``compiled``: the model is compiled (the eager
    backend) before fleet's calls.
    Returns the step that raised and the message, the checks run and the final parameters.
    """
    from distamp import fleet
    from distamp.sharding.fully_sharded_precision import local_shard

    fleet.init()
    model = _model()
    perturbing = [False]
    if target == "gathered" and rank == 1:
        # Before fully_shard, whose pre-hook goes first (prepend): this one runs on the gathered weight,
        # before the replica check's hook.
        model[2].register_forward_pre_hook(lambda module, args: _perturb(module.weight) if perturbing[0] else None)
    given = torch.compile(model, backend="eager") if compiled else model
    opt = fleet.distributed_optimizer(torch.optim.SGD(given.parameters(), lr=0.05, momentum=0.9),
                                      _strategy(stage, every, dtype, powersgd))
    wrapped = fleet.distributed_model(given)
    g = torch.Generator().manual_seed(1)
    raised = None
    for step in range(1, STEPS + 1):
        x, y = torch.randn(PER_RANK * world, 6, generator=g), torch.randn(PER_RANK * world, 3, generator=g)
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        try:
            assert opt.step()
        except ReplicaDivergenceError as error:
            raised = (step, str(error))
            break
        if rank == 1 and step >= perturb_after and target == "param each step":
            _perturb(model[2].weight)
        if rank == 1 and step == perturb_after:
            weight = model[2].weight
            if target == "param":
                _perturb(weight)
            elif target == "master":
                _perturb(opt.master_weights.master_for(weight))
            elif target == "shard":
                _perturb(local_shard(weight))
            elif target == "gathered":
                perturbing[0] = True
    return {"raised": raised, "checks": opt.replicas.checks, "hooks": opt.replicas.gathered is not None,
            "held": opt.replicas.last_held,
            "params": None if raised else {k: v.clone() for k, v in opt.fp32_state_dict(wrapped).items()}}


def _check_stopped(results, every: int, perturb_after: int, name: str):
    """Both ranks raised the same error, at the first check step after the perturbation."""
    expected = (perturb_after // every + 1) * every  # the first check step after the perturbation
    assert expected - perturb_after <= every
    for result in results:
        assert result["raised"] is not None, result
        step, message = result["raised"]
        assert step == expected
        assert f"at step {expected} (applied step {expected})" in message
        assert f"no longer hold the same {name!r}" in message
        assert "ranks 0 and 1 hold different values" in message
    assert results[0]["raised"] == results[1]["raised"]


CASES = [
    # stage, target, after which step, the name the error gives, dtype
    pytest.param(0, "param", 5, "2.weight", None, id="stage0-fp32-param"),
    # An edit of the 16-bit copy is a write the next step takes into the rank's master (training continues from
    # what the model holds), so rank 1 trains on from it alone.
    pytest.param(0, "param", 5, "2.weight", "bfloat16", id="stage0-O2-bf16-param"),
    # Step 6 copies the perturbed master into the 16-bit parameter, which is reported first.
    pytest.param(0, "master", 5, "2.weight", "float16", id="stage0-O2-fp16-master"),
    # Perturbed after step 7 and checked before step 8's update: only the master differs yet.
    pytest.param(0, "master", 7, "2.weight (FP32 master)", "bfloat16", id="stage0-O2-bf16-master"),
    # Stages 1-2 rewrite every 16-bit parameter from its owner's master at each update: the forward of
    # step 8 ran with the edit made after step 7, or with one that recurs.
    pytest.param(2, "param", 7, "2.weight", "bfloat16", id="stage2-O2-bf16-param"),
    pytest.param(2, "param each step", 5, "2.weight", "bfloat16", id="stage2-O2-bf16-param-each-step"),
    pytest.param(2, "param", 7, "2.weight", None, id="stage2-fp32-param"),
    pytest.param(3, "gathered", 5, "2.weight (as gathered for the forward)", "bfloat16",
                 id="stage3-O2-bf16-gathered"),
    pytest.param(3, "gathered", 5, "2.weight (as gathered for the forward)", None, id="stage3-fp32-gathered"),
]


@pytest.mark.parametrize(("stage", "target", "perturb_after", "name", "dtype"), CASES)
def test_a_perturbed_element_on_one_rank_stops_every_rank_within_n_steps(stage, target, perturb_after, name, dtype):
    every = 4
    results = run_workers(_job, 2, stage, every, target, perturb_after, dtype, timeout=180)
    _check_stopped(results, every, perturb_after, name)
    assert [r["checks"] for r in results] == [2, 2]  # steps 4 (passed) and 8 (raised)


@pytest.mark.parametrize(("stage", "target", "name"), [(0, "param", "2.weight"),
                                                      (3, "gathered", "2.weight (as gathered for the forward)")])
def test_a_model_compiled_before_fleet_is_reported_by_the_names_of_the_model_inside(stage, target, name):
    """torch.compile(model) first: the replica check names '2.weight', not '_orig_mod.2.weight'; at stage 3
    the units pattern '2' names the model's module too."""
    every = 4
    results = run_workers(_job, 2, stage, every, target, 5, "bfloat16", False, True, timeout=180)
    _check_stopped(results, every, 5, name)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_without_perturbation_every_check_passes(stage):
    results = run_workers(_job, 2, stage, 3, None, 0, timeout=180)
    assert [r["raised"] for r in results] == [None, None]
    assert [r["checks"] for r in results] == [STEPS // 3] * 2
    assert [r["hooks"] for r in results] == [stage == 3] * 2
    # 6 parameters, and beside each its FP32 master when unsharded; BF16's fixed scale has no state.
    assert [r["held"] for r in results] == [12 if stage == 0 else 6] * 2
    for key, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][key]), key


@pytest.mark.parametrize(("stage", "target"), [(0, "master"), (3, "gathered")])
def test_check_replicas_every_0_does_nothing(stage, target):
    results = run_workers(_job, 2, stage, 0, target, 2, timeout=180)
    assert [r["raised"] for r in results] == [None, None]
    assert [r["checks"] for r in results] == [0, 0]
    assert [r["hooks"] for r in results] == [False, False]
    if stage == 0:  # the drift is real, and silent without the check
        assert not torch.equal(results[0]["params"]["2.weight"], results[1]["params"]["2.weight"])


def test_stage2_o2_gathers_every_slice_from_its_owner_so_a_one_rank_edit_is_no_divergence():
    """Edited on rank 1 after step 5, the 16-bit copy is taken into the masters only where rank 1 owns the
    parameter, and step 6 gathers every slice from its owner into every rank: no rank holds another value."""
    results = run_workers(_job, 2, 2, 4, "param", 5, timeout=180)
    assert [r["raised"] for r in results] == [None, None]
    assert [r["checks"] for r in results] == [STEPS // 4] * 2
    for key, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][key]), key


def test_stage3_a_shard_has_no_replica_so_editing_it_is_no_divergence():
    """Rank 1's FP32 shard is the only copy: every rank gathers the edited value, so the ranks still agree."""
    results = run_workers(_job, 2, 3, 2, "shard", 3, timeout=180)
    assert [r["raised"] for r in results] == [None, None]
    assert [r["checks"] for r in results] == [STEPS // 2] * 2


def test_with_powersgd_a_perturbed_master_stops_every_rank(monkeypatch):
    monkeypatch.setenv("DISTAMP_POWERSGD_KERNELS", "torch")
    every, perturb_after = 3, 4
    results = run_workers(_job, 2, 0, every, "master", perturb_after, "bfloat16", True, timeout=180)
    # The master was perturbed after step 4; step 5 copied it into the 16-bit parameter, which comes first.
    _check_stopped(results, every, perturb_after, "2.weight")
    assert re.search(r"1 more differ: '2\.weight \(FP32 master\)'\. Every rank stops here", results[0]["raised"][1])


def test_the_message_groups_more_ranks_by_value_and_names_the_others():
    from distamp.distributed.replica_check import _message

    same, other = [1, 5, 6], [1, 7, 8]
    per_rank = [[same, same, same], [same, other, other], [same, same, same], [[0, 0, 0], other, same]]
    message = _message(["a", "b", "c"], per_rank, [1, 2], step=9, applied_step=7)
    assert message.startswith("replica check (strategy.check_replicas_every) at step 9 (applied step 7): the "
                              "data-parallel ranks no longer hold the same 'b': ranks grouped by the value they "
                              "hold: [0, 2] | [1, 3]. 1 more differ: 'c'. Every rank stops here")
    missing = _message(["a"], [[same], [[0, 0, 0]], [same]], [0], step=1, applied_step=1)
    assert "hold the same 'a': ranks grouped by the value they hold: [0, 2]; rank(s) [1] did not hold it." in missing


def test_the_setting_is_part_of_the_set_up_fingerprint():
    from distamp import fleet
    from distamp.distributed.fingerprint import fingerprint

    assert fingerprint(fleet.DistributedStrategy(check_replicas_every=5), _model())["check_replicas_every"] == "5"


def _compiled_stage3(rank, world, every):
    """Four O2 BF16 steps of a torch.compile'd stage-3 model: losses, checks run, tensors held at the last."""
    from distamp import fleet

    strategy = _strategy(3, every)
    fleet.init(strategy=strategy)
    model = _model()
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    forward = torch.compile(fleet.distributed_model(model, strategy))
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(PER_RANK, 6, generator=g), torch.randn(PER_RANK, 3, generator=g)
        with fleet.auto_cast():
            loss = F.mse_loss(forward(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses, opt.replicas.checks, opt.replicas.last_held


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compiled_stage3_model_is_checked_and_trains_as_without_the_check():
    """The stage-3 hooks are installed for check steps only and run eagerly (inductor cannot compile the hash)."""
    checked = run_workers(_compiled_stage3, 2, 2, timeout=280)
    unchecked = run_workers(_compiled_stage3, 2, 0, timeout=280)
    assert [c[1:] for c in checked] == [(2, 6), (2, 6)]
    assert [c[0] for c in checked] == [u[0] for u in unchecked]


def _resumed_stage3(rank, world):
    """Three steps, then a new optimizer loads their state: its next step (the 4th) is a check step."""
    from distamp import fleet

    fleet.init()
    g = torch.Generator().manual_seed(1)

    def steps(opt, wrapped, count):
        for _ in range(count):
            x, y = torch.randn(PER_RANK, 6, generator=g), torch.randn(PER_RANK, 3, generator=g)
            with fleet.auto_cast():
                loss = F.mse_loss(wrapped(x).float(), y)
            opt.zero_grad()
            opt.backward(loss)
            opt.step()

    first = fleet.distributed_optimizer(torch.optim.SGD((m := _model()).parameters(), lr=0.05), _strategy(3, 4))
    wrapped = fleet.distributed_model(m)
    steps(first, wrapped, 3)
    state = first.state_dict()
    second = fleet.distributed_optimizer(torch.optim.SGD((m2 := _model()).parameters(), lr=0.05), _strategy(3, 4))
    wrapped2 = fleet.distributed_model(m2)
    second.load_state_dict(state)
    steps(second, wrapped2, 1)
    return first.replicas.checks, second.replicas.checks, second.replicas.last_held


def test_stage3_after_load_state_dict_the_next_check_step_hashes_what_was_gathered():
    assert run_workers(_resumed_stage3, 2, timeout=180) == [(0, 1, 6)] * 2
