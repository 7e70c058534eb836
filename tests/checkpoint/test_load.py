"""load_latest_checkpoint: one fallback rule, applied by all ranks together.

A checkpoint that cannot be read (damaged or edited manifest, a payload
that fails its hash or that ``weights_only`` refuses) is skipped with a
warning; one that reads but does not fit the model raises, on every rank.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings

import pytest
import torch
from torch import nn

from distamp.checkpoint import load_latest_checkpoint, save, save_checkpoint
from distamp.checkpoint.rng import get_rng_state
from distamp.checkpoint.state import build_payload
from tests.checkpoint.test_checkpoint import build, payload, save_steps
from tests.checkpoint.test_rng import FakeCuda
from tests.multiprocess import run_workers


class Opaque:
    """A class ``torch.load(..., weights_only=True)`` refuses to rebuild."""


def load(directory):
    model, opt, sched = build(3)
    return load_latest_checkpoint(directory, model=model, optimizer=opt, scheduler=sched)


def save_refused_payload(directory, step, monkeypatch):
    """A checkpoint with a valid manifest and hash whose payload weights_only cannot unpickle."""
    model, opt, sched = build(0)
    with monkeypatch.context() as patch:
        patch.setattr(save, "check_extra", dict)  # let the foreign object through
        save_checkpoint(directory, step, model=model, optimizer=opt, scheduler=sched, extra={"obj": Opaque()})


def test_a_payload_weights_only_refuses_falls_back_with_a_warning(tmp_path, monkeypatch):
    save_steps(tmp_path, [10])
    save_refused_payload(tmp_path, 20, monkeypatch)
    bad = re.escape(str(payload(tmp_path, 20)))
    with pytest.warns(UserWarning, match=rf"skipping bad checkpoint {bad}: torch.load\(\.\.\., weights_only=True\) "
                      r"refused it \(WeightsUnpickler error: Unsupported global: GLOBAL .*Opaque"):
        info = load(tmp_path)
    assert info.step == 10
    assert len(info.skipped) == 1


def test_a_newest_checkpoint_of_another_model_raises_instead_of_falling_back(tmp_path):
    save_steps(tmp_path, [10])
    model = nn.Sequential(nn.Linear(6, 5), nn.Dropout(0.25), nn.ReLU(), nn.Linear(5, 3))
    save_checkpoint(tmp_path, 20, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    plain = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.25), nn.ReLU(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(RuntimeError, match=r"(?s)could not resume from .*step-00000020\.common\..*size mismatch"):
            load_latest_checkpoint(tmp_path, model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1))


def tamper(directory, step, recompute_checksum: bool):
    """Change a weight in the payload and "repair" the manifest's size and hash to match."""
    path = payload(directory, step)
    state = torch.load(path, weights_only=True)
    next(iter(state["model"].values())).add_(1.0)
    torch.save(state, path)
    data = path.read_bytes()
    manifest_path = directory / f"step-{step:08d}.json"
    meta = json.loads(manifest_path.read_text())
    meta["files"][0].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    if recompute_checksum:  # the whole manifest rewritten consistently, but not the payload's name
        body = {k: v for k, v in meta.items() if k != "manifest_sha256"}
        meta["manifest_sha256"] = hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    manifest_path.write_text(json.dumps(meta))
    return manifest_path


@pytest.mark.parametrize(
    ("recompute_checksum", "reason"),
    [(False, "manifest checksum mismatch"), (True, "whose name does not carry its SHA-256")],
)
def test_a_payload_changed_under_a_repaired_manifest_is_detected(tmp_path, recompute_checksum, reason):
    save_steps(tmp_path, [10, 20])
    manifest_path = tamper(tmp_path, 20, recompute_checksum)
    with pytest.warns(UserWarning, match=rf"skipping bad checkpoint {re.escape(str(manifest_path))}: .*{reason}"):
        info = load(tmp_path)
    assert info.step == 10


def test_a_cuda_rng_state_this_process_cannot_take_is_reported_not_restored(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        FakeCuda(patch)
        save_steps(tmp_path, [1])
    with pytest.warns(UserWarning, match=r"rank 0: the cuda RNG state was not restored from .*step-00000001"):
        info = load(tmp_path)
    assert info.step == 1
    assert not info.rng_restored


def test_a_format_1_checkpoint_still_loads(tmp_path):
    model, opt, sched = build(0)
    rng_states = [get_rng_state(), get_rng_state()]
    state = build_payload(7, 2, model, type(opt).__name__, opt.state_dict(), sched.state_dict(), rng_states, {"e": 7})
    state["format"] = "distamp.checkpoint/1"
    torch.save(state, tmp_path / "step-00000007.pt")
    data = (tmp_path / "step-00000007.pt").read_bytes()
    (tmp_path / "step-00000007.json").write_text(json.dumps({
        "format": "distamp.checkpoint/1", "step": 7, "file": "step-00000007.pt", "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(), "world_size": 2}))
    with pytest.warns(UserWarning, match=r"saved by 2 rank\(s\) and is resumed by 1"):
        info = load(tmp_path)
    assert (info.step, info.extra, info.world_size, info.path) == (7, {"e": 7}, 2, str(tmp_path / "step-00000007.pt"))


def _fallback_then_mismatch(rank, world_size, base):
    model, opt, sched = build(3, distributed=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        info = load_latest_checkpoint(f"{base}/refused", model=model, optimizer=opt, scheduler=sched)
    try:
        load_latest_checkpoint(f"{base}/other", model=nn.Linear(2, 2), optimizer=opt, scheduler=sched)
    except RuntimeError as exc:
        error = str(exc)
    return info.step, [str(w.message) for w in record], error


@pytest.mark.timeout(120)
def test_all_ranks_fall_back_together_and_fail_together(tmp_path, monkeypatch):
    save_steps(tmp_path / "refused", [10])
    save_refused_payload(tmp_path / "refused", 20, monkeypatch)
    save_steps(tmp_path / "other", [10])
    out = run_workers(_fallback_then_mismatch, 2, str(tmp_path), timeout=100)
    for step, messages, error in out:
        assert step == 10
        assert any("skipping bad checkpoint" in m and "Opaque" in m for m in messages)
        assert error == out[0][2]
        assert "rank 0: RuntimeError" in error
        assert "rank 1: RuntimeError" in error


def test_an_unlistable_directory_raises(tmp_path, monkeypatch):
    from distamp.checkpoint import storage

    def refuse(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(storage, "list_checkpoints", refuse)
    with pytest.raises(RuntimeError, match=r"rank 0 could not list checkpoints in .*Permission denied"):
        load(tmp_path)


def test_the_verdict_skips_a_file_only_one_rank_read_and_raises_on_one_another_rank_read_intact():
    from distamp.checkpoint.load import _verdict

    common = {"step-00000015.json": "m" * 64, "step-00000015.common.aa.pt": "a" * 64}
    shard0, shard1 = {"step-00000015.rank-00000.bb.pt": "b" * 64}, {"step-00000015.rank-00001.cc.pt": "c" * 64}
    name1 = next(iter(shard1))
    rank0_ok = ("ok", None, None, {**common, **shard0})
    rank1_bad = ("bad", f"/c/{name1}: payload missing", name1, common)
    assert _verdict([rank0_ok, rank1_bad]) == ("skip", f"/c/{name1}: payload missing (as rank 1 read it)")
    assert _verdict([rank0_ok, ("ok", None, None, {**common, **shard1})]) == ("use", None)
    # Rank 2 read the shard rank 1 finds bad, intact: the ranks see different files.
    verdict, message = _verdict([rank0_ok, rank1_bad, ("ok", None, None, {**common, **shard1})])
    assert verdict == "raise"
    assert message.startswith(f"rank 1 sees a different file than rank 2, which read it intact: /c/{name1}")
    assert message.endswith("must be on a file system shared by every node")
    # Rank 0 finds the common payload bad where rank 1 verified it: different files, whichever rank is 0.
    rank0_bad = ("bad", "/c/step-00000015.common.aa.pt: corrupted", "step-00000015.common.aa.pt",
                 {"step-00000015.json": "m" * 64})
    verdict, message = _verdict([rank0_bad, ("ok", None, None, {**common, **shard1})])
    assert verdict == "raise"
    assert message.startswith("rank 0 sees a different file than rank 1, which read it intact")
    # Both intact, but not the same manifest: each rank reads a directory of its own.
    verdict, message = _verdict([rank0_ok, ("ok", None, None, {**common, "step-00000015.json": "n" * 64})])
    assert verdict == "raise"
    assert message.startswith("rank 1 sees a different file than rank 0: step-00000015.json has SHA-256 nnnnnnnnnnnn")
    assert _verdict([rank0_ok, ("error", "MemoryError: ", None, {})]) == ("raise", "rank 1: MemoryError: ")
    # A payload that matches its checksum on every rank but that torch.load refuses: the same bytes, skipped.
    refused = ("bad", "/c/step-00000015.common.aa.pt: refused", "step-00000015.common.aa.pt", common)
    assert _verdict([refused, ("ok", None, None, {**common, **shard1})])[0] == "skip"


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _o2(model, inner=torch.optim.AdamW, pure=True):
    from distamp.optim.optimizer import AmpOptimizer
    from tests.checkpoint.test_checkpoint import make_strategy

    strategy = make_strategy()
    strategy.amp_configs = {**strategy.amp_configs, "use_pure_fp16": pure}
    return AmpOptimizer(inner(model.parameters(), lr=1e-2), strategy)


def _net(last: int = 3, more: bool = False) -> nn.Module:
    layers = [nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, last)]
    return nn.Sequential(*layers, *([nn.Linear(last, 2)] if more else []))


@pytest.mark.parametrize(("other", "match"), [
    # Parameters on one side only: named as the optimizer's, before the model is compared.
    (lambda: (m := _net(more=True), _o2(m)), r"this one has parameters '3\.weight', '3\.bias', which the "
                                             r"checkpoint lacks"),
    (lambda: (m := nn.Sequential(nn.Linear(6, 8)), _o2(m)),
     r"the checkpoint has parameters '2\.weight', '2\.bias', which this one lacks"),
    (lambda: (m := _net(last=4), _o2(m)),
     r"size mismatch for 2\.weight: copying a param with shape torch\.Size\(\[3, 8\]\) from checkpoint"),
    (lambda: (m := _net(), _o2(m, torch.optim.Adam)), r"around AdamW, this one is around Adam"),
    (lambda: (m := _net(), _o2(m, pure=False)), r"disagree on use_pure_fp16"),
], ids=["extra-layer", "fewer-layers", "other-shape", "other-inner-optimizer", "o1-into-o2-checkpoint"])
def test_a_refused_checkpoint_leaves_the_model_and_optimizer_untouched(tmp_path, other, match):
    model = _net()
    optimizer = _o2(model)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer)
    torch.manual_seed(7)
    model, optimizer = other()
    before = {k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict()
    with pytest.raises(RuntimeError, match=match):
        load_latest_checkpoint(tmp_path, model=model, optimizer=optimizer)
    # torch's load_state_dict copies every entry that fits before it raises: nothing may be loaded at all.
    assert _same(before[0], model.state_dict())
    assert _same(before[1], optimizer.state_dict())


def _amp(params, pure):
    from distamp.optim.optimizer import AmpOptimizer
    from tests.checkpoint.test_checkpoint import make_strategy

    strategy = make_strategy()
    strategy.amp_configs = {**strategy.amp_configs, "use_pure_fp16": pure}
    return AmpOptimizer(torch.optim.AdamW(params, lr=1e-2), strategy)


def _trained(pure):
    model = _net()
    optimizer = _amp(model.parameters(), pure)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 6, dtype=model[0].weight.dtype)).float().square().mean()
    optimizer.backward(loss)
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("pure", [True, False], ids=["O2", "O1"])
@pytest.mark.parametrize(("params", "match"), [
    (lambda m: list(m.parameters())[1:], r"the checkpoint has parameter '0\.weight', which this one lacks"),
    (lambda m: [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}],
     r"1 param groups of sizes \[4\], this one 2 of sizes \[2, 2\]"),
], ids=["a-parameter-left-out", "other-param-groups"])
def test_an_optimizer_of_other_parameters_is_refused_before_the_model_is_loaded(tmp_path, pure, params, match):
    """An unsharded checkpoint went to torch's load_state_dict, which refuses other group sizes only after the
    model (and the loss scaler) had been loaded from the checkpoint."""
    model, optimizer = _trained(pure)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer)
    torch.manual_seed(7)
    model = _net()
    optimizer = _amp(params(model), pure)
    before = {k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict()
    with pytest.raises(RuntimeError, match=match):
        load_latest_checkpoint(tmp_path, model=model, optimizer=optimizer)
    assert _same(before[0], model.state_dict())
    assert _same(before[1], optimizer.state_dict())


def test_an_o2_optimizer_of_reordered_parameters_resumes_each_ones_own_state(tmp_path):
    """It was refused for its shapes (was: and with equal shapes, loaded each position's state into another
    parameter); the state follows the names now (``tests/checkpoint/test_param_names.py``)."""
    model, optimizer = _trained(pure=True)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer)
    saved = dict(zip(model.state_dict(), optimizer.state_dict()["master_weights"], strict=True))
    model = _net()
    optimizer = _amp(list(model.parameters())[::-1], pure=True)
    load_latest_checkpoint(tmp_path, model=model, optimizer=optimizer)
    masters = dict(zip([n for n, _ in model.named_parameters()][::-1], optimizer.state_dict()["master_weights"],
                       strict=True))
    assert masters.keys() == saved.keys()
    assert all(torch.equal(masters[name], saved[name]) for name in saved)


def _only_rank_1_misfits(rank, world_size, directory):
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = _net()
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), make_strategy_o2())
    save_checkpoint(directory, 1, model=model, optimizer=optimizer)
    torch.manual_seed(5)
    model = _net(last=3 if rank == 0 else 4)
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), make_strategy_o2())
    before = {k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict()
    with pytest.raises(RuntimeError) as refused:
        load_latest_checkpoint(directory, model=model, optimizer=optimizer)
    return str(refused.value), (_same(before[0], model.state_dict()), _same(before[1], optimizer.state_dict()))


def make_strategy_o2():
    from tests.checkpoint.test_checkpoint import make_strategy

    return make_strategy()


@pytest.mark.timeout(120)
def test_a_checkpoint_one_rank_cannot_take_is_loaded_by_no_rank(tmp_path):
    (error0, untouched0), (error1, untouched1) = run_workers(_only_rank_1_misfits, 2, str(tmp_path), timeout=100)
    assert error0 == error1
    assert "rank 1: RuntimeError: Error(s) in loading state_dict for Sequential" in error0
    assert "size mismatch for 2.weight" in error0
    assert untouched0 == untouched1 == (True, True)  # rank 0, which could have loaded it, did not either
