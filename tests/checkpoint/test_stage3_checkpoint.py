"""Stage 3 checkpoints: each rank writes its own shards, and they resume at any world size and stage.

Two ranks train BF16 (two param groups, a StepLR) unsharded, with stage 2
and with stage 3, save at step 3 and go on to step 6. Two ranks resume each
bitwise at its own stage; one rank unsharded and four ranks at stage 3
resume the stage-3 checkpoint, and two ranks resume unsharded and stage-2
checkpoints at stage 3 and the stage-3 one at stage 2, within BF16 rounding
of the uninterrupted run (the global batch is the same; its gradient is
summed over another number of ranks, or in another order).

A stage-3 save hands its DTensors to torch.distributed.checkpoint: each rank
writes one file holding only its rows, and nothing is gathered; what any world size and stage loads from it (or from an
unsharded or stage-2 checkpoint into stage 3) is bitwise the saved state,
in O1 and O2, with AdamW and with SGD with momentum.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter

import pytest
import torch

from tests.checkpoint.test_flat_state import assert_same_state
from tests.checkpoint.test_sharded_checkpoint import (
    END,
    SAVE_AT,
    _build,
    _save_and_resume_at_the_same_size,
    _train,
    recording_reads,
)
from tests.multiprocess import run_workers
from tests.sharding.test_sharding import assert_within_bf16_rounding

SHAPES = {"0.weight": [16, 6], "0.bias": [16], "1.weight": [16], "1.bias": [16], "3.weight": [3, 16], "3.bias": [3]}
"""The parameters of ``tests.sharding.test_sharding._model``, in order."""


def _fp32(wrapped, opt) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in opt.fp32_state_dict(wrapped).values()])


def _exported(model, wrapped, opt) -> torch.Tensor:
    return _fp32(wrapped, opt)


def _resume(rank, world, root, plan):
    from distamp.checkpoint import load_latest_checkpoint

    out = {}
    for saved, stage in plan:
        _, wrapped, opt, scheduler = _build(stage)
        info = load_latest_checkpoint(os.path.join(root, f"stage{saved}"), model=wrapped, optimizer=opt,
                                      scheduler=scheduler)
        assert info.step == SAVE_AT
        assert [g["lr"] for g in opt.param_groups] == [5e-3, 2.5e-3]  # the scheduler's state came back
        _train(rank, world, wrapped, opt, scheduler, SAVE_AT, END)
        out[saved, stage] = _fp32(wrapped, opt)
    return out


@pytest.mark.timeout(300)
def test_stage3_checkpoint_resumes_bitwise_at_two_ranks_and_within_bf16_on_one_and_four(tmp_path):
    saved = run_workers(_save_and_resume_at_the_same_size, 2, str(tmp_path), (0, 2, 3), _exported, timeout=150)
    for stage in (0, 2, 3):
        uninterrupted, resumed = saved[0][stage]
        assert torch.equal(resumed, uninterrupted), stage
        assert torch.equal(saved[1][stage][1], uninterrupted)
    payloads = [n.split(".")[1] for n in sorted(os.listdir(tmp_path / "stage3")) if n.endswith(".pt")]
    assert payloads == ["common"]
    assert _dcp_files(tmp_path / "stage3") == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # a file per rank

    (one,) = run_workers(_resume, 1, str(tmp_path), [(3, 0), (3, 3)], timeout=120)
    four = run_workers(_resume, 4, str(tmp_path), [(3, 3)], timeout=200)
    two = run_workers(_resume, 2, str(tmp_path), [(0, 3), (2, 3), (3, 2)], timeout=150)
    assert_within_bf16_rounding(one[3, 0], saved[0][3][0])  # 2-rank stage 3 -> 1 rank unsharded
    assert_within_bf16_rounding(one[3, 3], saved[0][3][0])
    for r in four:
        assert_within_bf16_rounding(r[3, 3], saved[0][3][0])
        assert torch.equal(r[3, 3], four[0][3, 3])
    for r in two:
        assert_within_bf16_rounding(r[0, 3], saved[0][0][0])  # unsharded -> stage 3
        assert_within_bf16_rounding(r[2, 3], saved[0][2][0])  # stage 2 -> stage 3
        assert_within_bf16_rounding(r[3, 2], saved[0][3][0])  # stage 3 -> stage 2


@pytest.mark.timeout(300)
def test_a_four_rank_stage3_checkpoint_resumes_bitwise_on_four_and_within_bf16_on_two(tmp_path):
    four = run_workers(_save_and_resume_at_the_same_size, 4, str(tmp_path), (3,), _exported, timeout=200)
    uninterrupted = four[0][3][0]
    assert all(torch.equal(r[3][1], uninterrupted) for r in four)  # same world size: bitwise
    assert _dcp_files(tmp_path / "stage3") == [".metadata", *[f"__{r}_0.distcp" for r in range(4)]]
    for r in run_workers(_resume, 2, str(tmp_path), [(3, 3)], timeout=150):
        assert_within_bf16_rounding(r[3, 3], uninterrupted)  # 4-rank stage 3 -> 2 ranks at stage 3


def _save_fails_on_rank_1(rank, world, root):
    import torch.distributed.checkpoint as dcp

    from distamp.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint

    _, wrapped, opt, scheduler = _build(3)
    _train(rank, world, wrapped, opt, scheduler, 0, SAVE_AT)
    save_checkpoint(root, SAVE_AT, model=wrapped, optimizer=opt, scheduler=scheduler)
    _train(rank, world, wrapped, opt, scheduler, SAVE_AT, SAVE_AT + 1)
    if rank == 1:  # rank 1's disk is full: its DCP write fails, rank 0's succeeds
        def full(self, plan, planner):
            raise OSError(28, "No space left on device")
        dcp.FileSystemWriter.write_data = full
    with pytest.raises(RuntimeError) as failed:
        save_checkpoint(root, SAVE_AT + 1, model=wrapped, optimizer=opt, scheduler=scheduler)
    left = sorted(os.listdir(root))
    _, wrapped, opt, scheduler = _build(3)
    info = load_latest_checkpoint(root, model=wrapped, optimizer=opt, scheduler=scheduler)
    return str(failed.value), left, list_checkpoints(root), info.step


@pytest.mark.timeout(150)
def test_a_stage3_save_that_fails_on_one_rank_raises_everywhere_and_leaves_the_previous_checkpoint(tmp_path):
    for message, left, steps, resumed in run_workers(_save_fails_on_rank_1, 2, str(tmp_path), timeout=120):
        assert f"could not save checkpoint {SAVE_AT + 1}" in message
        assert "No space left on device" in message
        assert not [n for n in left if n.startswith(f"step-{SAVE_AT + 1:08d}")]  # the failed save's DCP files gone
        assert steps == [SAVE_AT]
        assert resumed == SAVE_AT


def _save_into_unshared_directories(rank, world, root):
    from distamp.checkpoint import save_checkpoint

    _, wrapped, opt, scheduler = _build(3)
    _train(rank, world, wrapped, opt, scheduler, 0, 1)
    with pytest.raises(RuntimeError) as failed:  # each rank its own directory, as on nodes that share none
        save_checkpoint(os.path.join(root, f"node{rank}"), 1, model=wrapped, optimizer=opt, scheduler=scheduler)
    return str(failed.value)


@pytest.mark.timeout(120)
def test_a_stage3_save_into_directories_the_ranks_do_not_share_is_refused_on_every_rank(tmp_path):
    for message in run_workers(_save_into_unshared_directories, 2, str(tmp_path), timeout=100):
        assert "rank 1 sees the DCP files ['__1_0.distcp'], rank 0 ['.metadata', '__0_0.distcp']" in message
        assert "must be on a file system shared by every node" in message
    assert not list((tmp_path / "node0").glob("*.json"))  # nothing committed


@contextlib.contextmanager
def _counting_gathers():
    """Yields a Counter of the calls that make whole tensors out of shards: DTensor gathers and all-gathers."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor

    calls: Counter = Counter()
    patched = [(DTensor, "full_tensor"), (DTensor, "redistribute"), (dist, "all_gather"),
               (dist, "all_gather_into_tensor"), (funcol, "all_gather_tensor")]
    originals = [getattr(owner, name) for owner, name in patched]

    def counting(name, original):
        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return call

    for (owner, name), original in zip(patched, originals, strict=True):
        setattr(owner, name, counting(name, original))
    try:
        yield calls
    finally:
        for (owner, name), original in zip(patched, originals, strict=True):
            setattr(owner, name, original)


def _whole_state(opt, stage):
    """The optimizer's state as whole tensors (stages 0 and 3), None at stages 1 and 2 (slices)."""
    return opt.state_dict() if stage in (0, 3) else None


def _save_at(rank, world, root, stages, pure, sgd):
    """Per stage: the FP32 model, the whole optimizer state and the gathers a save at step SAVE_AT made."""
    from distamp.checkpoint import save_checkpoint

    out = {}
    for stage in stages:
        _, wrapped, opt, scheduler = _build(stage, pure, sgd)
        _train(rank, world, wrapped, opt, scheduler, 0, SAVE_AT)
        with _counting_gathers() as during_save:
            save_checkpoint(os.path.join(root, f"stage{stage}"), SAVE_AT, model=wrapped, optimizer=opt,
                            scheduler=scheduler)
        with _counting_gathers() as exporting:
            fp32 = _fp32(wrapped, opt)
        assert stage != 3 or exporting["full_tensor"]  # the spy sees a gather where there is one
        out[stage] = (fp32, _whole_state(opt, stage), dict(during_save))
        if stage == 3:
            _local_state_round_trip(opt)
    return out


def _local_state_round_trip(opt):
    """``local_state_dict()`` loads back on its own rank and is refused, with the fix, on another."""
    whole = opt.state_dict()
    local = opt.local_state_dict()
    opt.load_state_dict(local)
    _assert_same_optimizer_state(opt.state_dict(), whole)
    other = {**local, "sharding": {**local["sharding"], "rank": 1 - local["sharding"]["rank"]}}
    with pytest.raises(ValueError, match=r"not this rank's stage-3 shards .* load_latest_checkpoint, which re-slice"):
        opt.load_state_dict(other)


def _load_from(rank, world, root, plan, pure, sgd):
    """Per (saved stage, stage): the FP32 model and the whole optimizer state right after loading, and the parts
    this rank read."""
    from distamp.checkpoint import load_latest_checkpoint

    out = {}
    with recording_reads() as read:
        for saved, stage in plan:
            read.clear()
            _, wrapped, opt, scheduler = _build(stage, pure, sgd)
            info = load_latest_checkpoint(os.path.join(root, f"stage{saved}"), model=wrapped, optimizer=opt,
                                          scheduler=scheduler)
            assert info.step == SAVE_AT
            out[saved, stage] = (_fp32(wrapped, opt), _whole_state(opt, stage), sorted(read))
    return out


def _rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """The rows of dim 0 that torch.chunk (FSDP2's cut) gives ``rank`` of ``world``."""
    chunks = torch.arange(dim0).chunk(world)
    if rank >= len(chunks):
        return dim0, dim0
    return int(chunks[rank][0]), int(chunks[rank][-1]) + 1


def _assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert_same_state(a, b)
    assert (a["counters"], a["loss_scaler"]) == (b["counters"], b["loss_scaler"])


def _dcp_directory(directory):
    (name,) = [n for n in os.listdir(directory) if ".dcp-" in n]
    return directory / name


def _dcp_files(directory) -> list[str]:
    return sorted(os.listdir(_dcp_directory(directory)))


def _payloads(directory) -> dict[str, dict]:
    return {n.split(".")[1]: torch.load(directory / n, weights_only=True)
            for n in sorted(os.listdir(directory)) if n.endswith(".pt")}


@pytest.mark.timeout(200)
def test_a_stage3_save_writes_each_ranks_own_rows_through_dcp_and_gathers_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp

    saved = run_workers(_save_at, 2, str(tmp_path), (3,), True, False, timeout=120)
    assert [s[3][2] for s in saved] == [{}, {}]  # no full_tensor, redistribute or all-gather during the save
    payloads = _payloads(tmp_path / "stage3")
    assert sorted(payloads) == ["common"]
    common = payloads["common"]
    assert not any(isinstance(common["model"].get(name), torch.Tensor) for name in SHAPES)  # slots, not tensors
    metadata = dcp.FileSystemReader(str(_dcp_directory(tmp_path / "stage3"))).read_metadata()
    keys = {f"model/{name}" for name in SHAPES}
    # The masters are the model's FP32 parameters (FSDP2 keeps them sharded): written once, under the model's key.
    assert set(metadata.state_dict_metadata) == keys | {f"optimizer/state/{i}/{k}" for i in range(len(SHAPES))
                                                        for k in ("exp_avg", "exp_avg_sq")}
    files: dict[str, set] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(index.fqn, set()).add((tuple(index.offset), info.relative_path))
    for name, shape in SHAPES.items():
        # Each rank wrote the rows it holds, into its own file.
        expected = {((_rows(shape[0], 2, r)[0], *[0] * (len(shape) - 1)), f"__{r}_0.distcp") for r in (0, 1)}
        for key in (f"model/{name}", f"optimizer/state/{list(SHAPES).index(name)}/exp_avg"):
            assert files[key] == expected, key
            sizes = sorted(tuple(c.sizes) for c in metadata.state_dict_metadata[key].chunks)
            cuts = [_rows(shape[0], 2, r) for r in (0, 1)]
            assert sizes == sorted((stop - start, *shape[1:]) for start, stop in cuts)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("pure", "sgd"), [(True, False), (False, False), (True, True), (False, True)],
                         ids=["O2-AdamW", "O1-AdamW", "O2-SGD-momentum", "O1-SGD-momentum"])
def test_c_d_stage3_checkpoints_load_bitwise_at_any_size_and_stage(tmp_path, pure, sgd):
    saved = run_workers(_save_at, 2, str(tmp_path), (0, 2, 3), pure, sgd, timeout=150)
    assert saved[0][3][2] == {}
    assert _dcp_files(tmp_path / "stage3") == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    (one,) = run_workers(_load_from, 1, str(tmp_path), [(3, 0), (3, 3)], pure, sgd, timeout=120)
    three = run_workers(_load_from, 3, str(tmp_path), [(3, 3), (0, 3), (2, 3), (3, 2)], pure, sgd, timeout=200)
    for results in (one, *three):
        for (source, stage), (fp32, whole, read) in results.items():
            assert torch.equal(fp32, saved[0][source][0]), (source, stage)
            if whole is not None and saved[0][source][1] is not None:
                _assert_same_optimizer_state(whole, saved[0][source][1])
            if source == 3:
                assert read == ["common"]  # the tensors come through dcp.load


def _load_before_sharding(rank, world, root):
    import torch.nn.functional as F
    from torch import nn

    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint

    strategy = fleet.DistributedStrategy(amp=True, sharding=True)
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    strategy.sharding_configs = {"stage": 3}
    fleet.init(strategy=strategy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    errors = []
    for load in (lambda: load_latest_checkpoint(root, model=model, optimizer=opt),
                 lambda: opt.load_state_dict(opt.state_dict())):
        try:
            load()
        except RuntimeError as exc:
            errors.append(str(exc))
    wrapped = fleet.distributed_model(model, strategy)  # the fix: shard first, then load
    assert load_latest_checkpoint(root, model=wrapped, optimizer=opt) is None  # nothing saved yet
    with fleet.auto_cast():
        loss = F.mse_loss(wrapped(torch.randn(4, 6)).float(), torch.zeros(4, 3))
    opt.backward(loss)
    return errors, opt.step()


@pytest.mark.timeout(120)
def test_loading_before_the_model_is_sharded_is_refused_with_the_fix(tmp_path):
    # It used to be taken and then fail at the first step with torch's "mixed torch.Tensor and DTensor".
    for errors, stepped in run_workers(_load_before_sharding, 2, str(tmp_path), timeout=100):
        assert len(errors) == 2
        for message in errors:
            assert "not sharded yet: call model = fleet.distributed_model(model) first" in message
        assert "loading a checkpoint needs the shards" in errors[0]
        assert "then load it" in errors[0]
        assert stepped


def _tied_head_round_trip(rank, world, root, stage):
    """Two steps of the tied-head model at ``stage`` and a save; or (``stage`` None) a load at stage 3."""
    import torch.nn.functional as F

    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint
    from tests.sharding.test_sharding_stage3 import _strategy, _TiedHead

    torch.manual_seed(0)
    model = _TiedHead()
    strategy = _strategy(3 if stage is None else stage, use_pure_fp16=True, dtype="bfloat16")
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    if stage is None:
        info = load_latest_checkpoint(root, model=wrapped, optimizer=opt)
        return info.step, opt.fp32_state_dict(wrapped)
    for step in range(2):
        x = torch.randint(0, 31, (2, 5), generator=torch.Generator().manual_seed(10 * step + rank))
        with fleet.auto_cast():
            loss = F.cross_entropy(wrapped(x).float().flatten(0, 1), x.flatten())
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()
    save_checkpoint(root, 2, model=wrapped, optimizer=opt)
    return 2, opt.fp32_state_dict(wrapped)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("saved_at", [0, 2])
def test_an_unsharded_or_stage2_checkpoint_of_tied_weights_loads_at_stage_3(tmp_path, saved_at):
    # Was: RuntimeError 'aten.copy_.default got mixed torch.Tensor and DTensor' for 'head.weight': the
    # stage-3 load hook made DTensors of each parameter's first name only, and the tied head's stayed whole.
    saved = run_workers(_tied_head_round_trip, 2, str(tmp_path), saved_at, timeout=100)
    loaded = run_workers(_tied_head_round_trip, 2, str(tmp_path), None, timeout=100)
    for (step, state), (saved_step, saved_state) in zip(loaded, saved, strict=True):
        assert step == saved_step == 2
        assert state.keys() == saved_state.keys()
        for name, value in state.items():
            assert torch.equal(value, saved_state[name]), name


_OTHER_PARAMETERS = {
    "all": lambda m: m.parameters(),
    "groups": lambda m: [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}],
    "reversed": lambda m: list(m.parameters())[::-1],
}


def _sgd_build(at: int, pure: bool, params: str):
    """(model, wrapped, optimizer): BF16 SGD with momentum over ``_OTHER_PARAMETERS[params]`` at stage ``at``."""
    from torch import nn

    from distamp import fleet

    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": pure}
    if at:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": at}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = fleet.distributed_optimizer(torch.optim.SGD(_OTHER_PARAMETERS[params](model), lr=0.1, momentum=0.9),
                                      strategy)
    return model, fleet.distributed_model(model), opt


def _save_stage3(root: str, pure: bool) -> None:
    """A stage-3 checkpoint of one SGD param group after one step."""
    from distamp import fleet
    from distamp.checkpoint import save_checkpoint

    fleet.init()
    _, wrapped, opt = _sgd_build(3, pure, "all")
    with fleet.auto_cast():
        opt.backward(wrapped(torch.randn(4, 6)).float().square().mean())
    opt.step()
    save_checkpoint(root, 1, model=wrapped, optimizer=opt)


def _misfit_after_stage3(rank, world, root, stage, pure, params):
    """Save a stage-3 checkpoint of one SGD param group, resume it at ``stage`` with ``_OTHER_PARAMETERS[params]``;
    what the refusal said and whether the model was left as it was."""
    from distamp.checkpoint import load_latest_checkpoint
    from tests.checkpoint.test_load import _same

    _save_stage3(root, pure)
    model, wrapped, opt = _sgd_build(stage, pure, params)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError) as refused:
        load_latest_checkpoint(root, model=wrapped, optimizer=opt)
    return str(refused.value), _same(before, {k: v.detach().clone() for k, v in model.state_dict().items()})


@pytest.mark.parametrize(("stage", "pure", "params", "match"), [
    (3, True, "groups", "1 param groups of sizes [4], this one 2 of sizes [2, 2]"),
], ids=["other-param-groups-at-stage-3"])
def test_a_stage3_checkpoint_for_other_parameters_is_refused_before_anything_is_loaded(tmp_path, stage, pure, params,
                                                                                     match):
    """Stage 3 -> 3 with other param groups loaded the model, then torch refused the groups."""
    results = run_workers(_misfit_after_stage3, 2, str(tmp_path), stage, pure, params, timeout=150)
    for error, untouched in results:
        assert match in error
        assert untouched


def _momentum_after_stage3(rank, world, root):
    """Resume a stage-3 O1 checkpoint unsharded, over the parameters in their order and reversed: each
    parameter's momentum by name."""
    from distamp.checkpoint import load_latest_checkpoint

    _save_stage3(root, pure=False)
    out = {}
    for params in ("all", "reversed"):
        model, wrapped, opt = _sgd_build(0, False, params)
        load_latest_checkpoint(root, model=wrapped, optimizer=opt)
        out[params] = {name: opt.inner_opt.state[p]["momentum_buffer"].clone() for name, p in model.named_parameters()}
    return out


def test_a_stage3_checkpoint_resumes_an_optimizer_listing_the_parameters_in_another_order(tmp_path):
    """Stage 3 -> 0 in O1 with the parameters reversed loaded momentum of the wrong shapes and failed at the first
    step, then was refused; it follows the parameter names now (``tests/checkpoint/test_param_names.py``)."""
    for result in run_workers(_momentum_after_stage3, 2, str(tmp_path), timeout=150):
        assert result["all"].keys() == result["reversed"].keys()
        for name, momentum in result["all"].items():
            assert torch.equal(result["reversed"][name], momentum), name
