"""Every entry of distamp/torch_compat.py does what distamp relies on, on the torch this runs on.

CI runs this on torch 2.11.0, 2.13.0 and 2.15.0 (.ci/run; 2.14.1 where no
Python 3.12 is found), so each version-dependent branch is taken on some
torch of the matrix; it passed on 2.12.1 and 2.14.1 as well.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from distamp import torch_compat as tc
from tests.multiprocess import run_workers


def _release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def test_fused_list_ops_compute_what_their_loops_compute():
    a, b = [torch.ones(3), torch.full((2,), 2.0)], [torch.full((3,), 4.0), torch.ones(2)]
    tc.foreach_add_(a, b)
    assert [t.tolist() for t in a] == [[5.0] * 3, [3.0] * 2]
    tc.foreach_mul_(a, 0.5)
    assert [t.tolist() for t in a] == [[2.5] * 3, [1.5] * 2]
    assert [n.item() for n in tc.foreach_norm(a, float("inf"))] == [2.5, 1.5]
    # An empty tensor (a stage-3 shard of a parameter with fewer rows than ranks) has norm 0, any ord.
    empty = [torch.ones(2), torch.ones(0, dtype=torch.bfloat16), -torch.full((1,), 3.0)]
    for ord_ in (float("inf"), 2.0):
        norms = tc.foreach_norm(empty, ord_)
        assert [n.item() for n in norms] == pytest.approx([1.0 if ord_ == float("inf") else 2**0.5, 0.0, 3.0])
        assert norms[1].dtype == torch.bfloat16
        assert [n.item() for n in tc.foreach_norm([torch.ones(0), torch.ones(0, 4)], ord_)] == [0.0, 0.0]
    tc.foreach_copy_(a, b)
    assert [t.tolist() for t in a] == [t.tolist() for t in b]
    tc.foreach_zero_(a)
    assert all(not t.any() for t in a)


def test_fused_unscale_sets_the_flag_only_for_a_non_finite_gradient():
    grads, found = [torch.tensor([2.0, 4.0])], torch.zeros(1)
    tc.amp_foreach_non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    assert grads[0].tolist() == [1.0, 2.0]
    assert found.item() == 0.0
    tc.amp_foreach_non_finite_check_and_unscale_([torch.tensor([float("inf")])], found, torch.tensor(1.0))
    assert found.item() == 1.0


def test_function_mode_stack_lists_the_active_modes_and_disable_torch_function_bypasses_them():
    calls = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    mode = Count()
    assert mode not in tc.current_function_mode_stack()
    with mode:
        assert tc.current_function_mode_stack()[-1] is mode
        torch.add(torch.ones(1), 1)
        seen = len(calls)
        with tc.DisableTorchFunction():
            torch.add(torch.ones(1), 1)
        assert len(calls) == seen > 0


def test_pytree_helpers_reach_nested_tensors():
    tree = {"a": [torch.ones(1), (torch.zeros(2), 3)]}
    assert len(tc.tree_leaves(tree)) == 3
    leaves, _ = tc.tree_flatten(tree)
    assert leaves[2] == 3
    doubled = tc.tree_map_only(torch.Tensor, lambda t: t + 1, tree)
    assert doubled["a"][0].item() == 2.0
    assert doubled["a"][1][1] == 3


def test_norm_base_is_batch_and_instance_norm_and_not_layer_norm():
    assert issubclass(nn.BatchNorm2d, tc.NormBase)
    assert issubclass(nn.SyncBatchNorm, tc.NormBase)
    assert issubclass(nn.InstanceNorm1d, tc.NormBase)
    assert not issubclass(nn.LayerNorm, tc.NormBase)


def test_tensor_version_counts_in_place_writes_and_is_view_tells_views():
    t = torch.zeros(4)
    before = tc.tensor_version(t)
    t.add_(1)
    assert tc.tensor_version(t) == before + 1
    assert tc.is_view(t[1:])
    assert not tc.is_view(t)


def test_autograd_callback_runs_once_when_the_backward_ends():
    order = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: tc.queue_autograd_callback(lambda: order.append("end")) or order.append("hook"))
    y.sum().backward()
    assert order == ["hook", "end"]


def test_first_bucket_is_one_mebibyte():
    assert tc.DEFAULT_FIRST_BUCKET_BYTES == 1024 * 1024


def test_ddp_keywords_are_the_installed_ddps_and_follow_its_release():
    assert {"process_group", "broadcast_buffers", "find_unused_parameters", "static_graph"} <= set(tc.DDP_KEYWORDS)
    assert not {"self", "module"} & set(tc.DDP_KEYWORDS)
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert ("forward_sync_buffers" in tc.DDP_KEYWORDS) == (release >= (2, 13))


def test_launch_config_takes_the_grace_period_where_torch_has_it():
    from torch.distributed.launcher.api import LaunchConfig

    kwargs = tc.launch_config_shutdown_timeout(7)
    if _release() >= (2, 12):
        assert tc.grace_period_supported()
        assert kwargs == {"shutdown_timeout": 7}
    else:  # torch 2.11: no such field, the agent always waits 30 s
        assert not tc.grace_period_supported()
        assert kwargs == {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, **kwargs)
    if kwargs:
        assert dataclasses.asdict(config)["shutdown_timeout"] == 7
    assert tc.TORCH_DEFAULT_GRACE_PERIOD == 30


def _group_entries(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    store = tc.default_store()
    store.set(f"k{rank}", str(rank))
    store.wait([f"k{1 - rank}"], timedelta(seconds=30))
    timeout = tc.group_timeout(dist.group.WORLD, torch.device("cpu"))
    args, kwargs = tc.to_kwargs((torch.ones(1), [torch.zeros(1)]), {"k": torch.ones(1)}, torch.device("cpu"))
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    rebuilt = [tc.ddp_has_rebuilt_buckets(ddp)]
    for _ in range(2):
        ddp(torch.ones(3, 4)).sum().backward()
        rebuilt.append(tc.ddp_has_rebuilt_buckets(ddp))
    return {"other": store.get(f"k{1 - rank}").decode(), "timeout": timeout,
            "moved": (len(args), len(args[1]), sorted(kwargs)), "rebuilt": rebuilt}


@pytest.mark.timeout(120)
def test_store_timeout_input_moves_and_bucket_rebuild_on_a_real_group():
    out = run_workers(_group_entries, 2, timeout=100, pg_timeout=77)
    for rank in (0, 1):
        assert out[rank]["other"] == str(1 - rank)
        assert out[rank]["timeout"] == timedelta(seconds=77)
        assert out[rank]["moved"] == (2, 1, ["k"])
        # DDP rebuilds its buckets in the forward after the first backward.
        assert out[rank]["rebuilt"] == [False, False, True]


def _fsdp_entries(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:  # before the first forward nothing is gathered: the same as a renamed attribute, so it raises
        before = str(list(tc.fsdp_unsharded_parameters(model)))
    except RuntimeError as exc:
        before = str(exc)
    model(torch.ones(3, 4)).sum().backward()
    after = list(tc.fsdp_unsharded_parameters(model))
    weight = model[0].weight
    local = tc.dtensor_local(weight)
    try:  # a plain tensor times a sharded parameter: DTensor's refusal
        torch.ones(2, 6) @ weight
        mixed = None
    except RuntimeError as exc:
        mixed = exc
    return {
        "mixed_error": mixed is not None and tc.is_mixed_dtensor_error(mixed),
        "other_error": tc.is_mixed_dtensor_error(RuntimeError("shape mismatch")),
        "dtensor": isinstance(weight, DTensor),
        "local_is_stored": local.data_ptr() == weight.to_local().data_ptr() and local.grad_fn is None,
        "local_shape": tuple(local.shape),
        "before": before,
        "after": [(tuple(s.shape), tuple(u.shape)) for s, u in after],
        "sharded_are_params": all(any(s is p for p in model.parameters()) for s, _ in after),
        "comm_bases": (tc.FSDPAllGather.__name__, tc.FSDPReduceScatter.__name__),
    }


@pytest.mark.timeout(120)
def test_fsdp2_unsharded_parameters_and_comm_interfaces_on_a_real_group():
    out = run_workers(_fsdp_entries, 2, timeout=100)
    for rank in (0, 1):
        assert out[rank]["dtensor"]
        assert out[rank]["mixed_error"]
        assert not out[rank]["other_error"]
        assert out[rank]["local_is_stored"]
        assert out[rank]["local_shape"] == (3, 4)  # 6 rows over 2 ranks
        assert "none of FSDP2's 4 parameters has _unsharded_param" in out[rank]["before"]
        # (sharded DTensor's global shape, unsharded shape) of each parameter
        assert sorted(out[rank]["after"]) == sorted([((6, 4), (6, 4)), ((6,), (6,)), ((2, 6), (2, 6)), ((2,), (2,))])
        assert out[rank]["sharded_are_params"]
        assert out[rank]["comm_bases"] == ("AllGather", "ReduceScatter")


def _fsdp_unfrozen_group(rank, world_size, rederive):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model[0].requires_grad_(False)
    model(torch.ones(3, 4)).float().sum().backward()  # FSDP2's lazy init: group 0 has nothing trainable
    model[0].requires_grad_(True)
    groups = tc.fsdp_param_groups(model)
    if rederive:
        for group, _ in groups:
            tc.fsdp_rederive_grad_dtypes(group)
    try:
        model(torch.ones(3, 4)).float().sum().backward()
        outcome = str(model[0].weight.grad.dtype)
    except RuntimeError as exc:
        outcome = str(exc)
    return {"groups": [len(params) for _, params in groups],
            "params_are_the_models": all(any(p is q for q in model.parameters()) for _, ps in groups for p in ps),
            "outcome": outcome}


@pytest.mark.timeout(120)
def test_fsdp2_groups_and_gradient_dtypes_derived_again_after_unfreezing():
    """What sharding stage 3 relies on for gradual unfreezing, on plain FSDP2: before torch 2.15, without deriving
    the dtypes again the unfrozen group's BF16 gradient meets its FP32 shard (2.15 derives them from every
    floating-point parameter when none is trainable, so there it changes nothing)."""
    fixed_in_torch = torch.torch_version.TorchVersion(torch.__version__) >= "2.15"
    for rederive, outcome in ((False, "torch.float32" if fixed_in_torch else "grad_dtype"), (True, "torch.float32")):
        for out in run_workers(_fsdp_unfrozen_group, 2, rederive, timeout=100):
            assert sorted(out["groups"]) == [2, 2]
            assert out["params_are_the_models"]
            assert outcome in out["outcome"], (rederive, out["outcome"])


def test_a_renamed_fsdp_attribute_fails_loudly():
    class State:  # neither 2.11's _fsdp_param_group nor 2.12+'s _fsdp_param_groups
        pass

    with pytest.raises(RuntimeError, match=r"neither _fsdp_param_groups nor _fsdp_param_group.*2\.11-2\.15"):
        tc._fsdp_param_groups(State())


def test_aot_autograd_cache_switch_and_the_version_whose_key_has_the_autocast_dtype():
    import torch._functorch.config as aot_config

    assert tc.aot_autograd_cache_keys_autocast_dtype() == (_release() >= (2, 13))
    saved = aot_config.enable_autograd_cache, aot_config.enable_remote_autograd_cache
    try:
        tc.disable_aot_autograd_cache()
        assert (aot_config.enable_autograd_cache, aot_config.enable_remote_autograd_cache) == (False, False)
    finally:
        aot_config.enable_autograd_cache, aot_config.enable_remote_autograd_cache = saved


def test_step_hooks_run_once_around_an_update_whose_steps_run_without_them():
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from distamp.torch_compat import unhooked_step, with_step_hooks

    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.5)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre"))
    try:
        param.grad = torch.ones(3)
        unhooked_step(opt)()
        assert calls == []
        assert torch.equal(param.detach(), torch.full((3,), 0.5))

        def update(o: torch.optim.Optimizer) -> None:
            calls.append("update")
            unhooked_step(o)()
            unhooked_step(o)()

        with_step_hooks(update)(opt)
        assert calls == ["global pre", "pre", "update", "post"]
        assert torch.equal(param.detach(), torch.full((3,), -0.5))
    finally:
        handle.remove()


def test_a_step_that_is_not_torchs_hooked_wrapper_is_refused_naming_the_class():
    class Replaced(torch.optim.SGD):
        pass

    opt = Replaced([nn.Parameter(torch.ones(1))], lr=0.1)
    Replaced.step = lambda self, closure=None: None  # replaced after torch patched it
    from distamp.torch_compat import unhooked_step

    with pytest.raises(RuntimeError, match=r"^Replaced\.step is not torch's hooked step wrapper"):
        unhooked_step(opt)


def test_ddp_ready_twice_error_is_told_by_torchs_message():
    assert tc.is_ddp_ready_twice_error(RuntimeError("Expected to mark a variable ready only once. This error ..."))
    assert not tc.is_ddp_ready_twice_error(RuntimeError("Expected all tensors to be on the same device"))
    assert not tc.is_ddp_ready_twice_error(ValueError("Expected to mark a variable ready only once."))
