"""torch.compile under auto_cast: 16-bit where torch.autocast is, and no graph break from distamp."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from distamp.amp import auto_cast, keep_in_fp32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = F.gelu(self.fc1(x))
        return {"hidden": hidden, "out": self.head(self.norm(hidden))}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _dtypes(outputs: dict[str, torch.Tensor]) -> dict[str, torch.dtype]:
    return {k: v.dtype for k, v in outputs.items()}


def test_compiled_model_is_16_bit_where_torch_autocast_is_even_when_called_first():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    compiled = torch.compile(model)
    with auto_cast(dtype="bfloat16"):          # the compiled model is the first thing called
        got = compiled(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    assert _dtypes(got) == _dtypes(expected) == {"hidden": torch.bfloat16, "out": torch.bfloat16}
    got["out"].float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert not counters["graph_break"]


def test_custom_lists_and_black_modules_are_compiled_without_graph_breaks():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    keep_in_fp32(model, ["head"])
    compiled = torch.compile(model)
    with auto_cast(dtype="bfloat16", custom_black_list=["gelu"]):
        got = compiled(x)
    assert _dtypes(got) == {"hidden": torch.float32, "out": torch.float32}
    with auto_cast(dtype="bfloat16"):          # other lists: dynamo guards on the mode and recompiles
        assert compiled(x)["hidden"].dtype == torch.bfloat16
    assert not counters["graph_break"]


def test_auto_cast_inside_a_compiled_function():
    torch.manual_seed(0)
    model = Net()

    @torch.compile
    def forward(x):
        with auto_cast(dtype="bfloat16"):
            return model(x)["out"]

    assert forward(torch.randn(4, 8)).dtype == torch.bfloat16
    assert not counters["graph_break"]


@pytest.mark.parametrize("built", ["outside", "inside"])
def test_auto_cast_with_custom_lists_inside_a_compiled_function(built):
    """A compiled training step that enters auto_cast with a custom list runs and matches eager."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    region = auto_cast(dtype="bfloat16", custom_black_list=["gelu"])

    def forward(x):
        with region if built == "outside" else auto_cast(dtype="bfloat16", custom_black_list=["gelu"]):
            return model(x)

    expected = forward(x)
    got = torch.compile(forward)(x)
    assert _dtypes(got) == _dtypes(expected) == {"hidden": torch.float32, "out": torch.bfloat16}
    assert not torch.is_autocast_enabled("cpu")
    # The region ran where it was entered: gelu in FP32 on fc1's BF16 output, as the list asks
    # (inductor's fused gelu may differ from eager's in the last bit).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = F.gelu(model.fc1(x).float())
    torch.testing.assert_close(got["hidden"], hidden, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["out"], expected["out"])


def _compile_stats(step) -> tuple[int, int]:
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        step()
    return counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]


def test_a_compiled_o1_model_is_one_graph_with_the_calls_of_compiled_torch_autocast():
    """What the README claims of compiled distamp: the forward graph torch.autocast gives, and no other."""
    from distamp import fleet

    x = torch.randn(4, 8)
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"dtype": "bfloat16"}
    torch.manual_seed(0)
    ours_model = Net()
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(ours_model.parameters(), lr=0.1), strategy)
    ours_compiled = torch.compile(ours_model)

    def ours():
        with fleet.auto_cast():
            out = ours_compiled(x)["out"]
        optimizer.zero_grad()
        optimizer.backward(out.float().sum())
        optimizer.step()

    torch.manual_seed(0)
    theirs_model = Net()
    theirs_optimizer = torch.optim.SGD(theirs_model.parameters(), lr=0.1)
    theirs_compiled = torch.compile(theirs_model)

    def theirs():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = theirs_compiled(x)["out"]
        theirs_optimizer.zero_grad()
        out.float().sum().backward()
        theirs_optimizer.step()

    ours_graphs, ours_calls = _compile_stats(ours)
    assert not counters["graph_break"]
    theirs_graphs, theirs_calls = _compile_stats(theirs)
    assert ours_graphs == theirs_graphs == 1
    assert ours_calls == theirs_calls > 0
    for a, b in zip(ours_model.parameters(), theirs_model.parameters(), strict=True):
        assert torch.equal(a, b)  # and the same training


# fleet.auto_cast under one dtype, then another (a new strategy), in one process, and a second process
# under the second dtype on the same on-disk compile cache: each forward runs in its own dtype. Before
# torch 2.13 AOTAutograd's cache key had no autocast dtype (see distamp.amp.compile_cache): without
# distamp's switch the second and third forwards ran in the first dtype.
_SWITCH_DTYPE = """
import sys, torch
from torch import nn
from distamp import fleet

def strategy(dtype):
    s = fleet.DistributedStrategy(amp=True)
    s.amp_configs = {"dtype": dtype}
    return s

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
compiled = torch.compile(model, backend="inductor")
x = torch.randn(2, 8)
with torch.no_grad():
    for dtype in sys.argv[1:]:
        fleet.init(strategy=strategy(dtype))
        with fleet.auto_cast():
            print(dtype, compiled(x).dtype, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_model_compiled_under_one_dtype_runs_in_the_next_dtype_too(tmp_path):
    script = tmp_path / "switch.py"
    script.write_text(_SWITCH_DTYPE)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    env.pop("TORCHINDUCTOR_AUTOGRAD_CACHE", None)
    runs = [("float16", "bfloat16"), ("bfloat16",)]
    for dtypes in runs:
        proc = subprocess.run([sys.executable, str(script), *dtypes], capture_output=True, text=True,
                              env=env, timeout=500, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.splitlines() == [f"{d} torch.{d}" for d in dtypes], proc.stdout


def _o2_fp16_run(compile_first: bool) -> tuple[dict, list[float], dict, dict]:
    """O2 FP16 with the head black-listed, three steps on a model compiled (or not) before fleet's calls;
    the third step overflows. Returns the parameter dtypes by name, the losses, the FP32 model and the
    optimizer's stats."""
    from distamp import fleet

    torch.manual_seed(0)
    model = Net()
    given = torch.compile(model, backend="eager") if compile_first else model
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "float16", "custom_black_varnames": ["head"],
                            "init_loss_scaling": 128.0}
    fleet.init(strategy=strategy)
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(given.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(given)
    g = torch.Generator().manual_seed(1)
    losses = []
    for scale in (1.0, 1.0, 1e6):
        with fleet.auto_cast():
            out = wrapped(torch.randn(4, 8, generator=g))
            loss = out["out"].float().sum() * scale
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    return dtypes, losses, optimizer.fp32_state_dict(wrapped), optimizer.stats()


def test_a_model_compiled_before_fleet_is_named_and_trains_bitwise_like_the_eager_model():
    """custom_black_varnames and last_overflow use the model's names, not torch.compile's "_orig_mod." ones."""
    eager = _o2_fp16_run(compile_first=False)
    torch._dynamo.reset()
    dtypes, losses, state, stats = _o2_fp16_run(compile_first=True)
    assert dtypes == eager[0]
    assert dtypes["head.weight"] == torch.float32
    assert dtypes["fc1.weight"] == torch.float16
    assert losses == eager[1]
    assert state.keys() == eager[2].keys()
    for name, value in eager[2].items():
        assert torch.equal(state[name], value), name
    assert stats["last_overflow"] == eager[3]["last_overflow"]
    assert stats["last_overflow"]["step"] == 3
    assert "fc1.weight" in stats["last_overflow"]["params"]
    assert stats["steps_applied"] == eager[3]["steps_applied"] == 2


def test_a_compiled_model_learnt_at_its_first_forward_is_named_like_the_eager_model():
    """Without fleet.distributed_model the optimizer learns the model at its first forward: the compiled
    wrapper's. custom_black_varnames and the parameter names are still the model's."""
    from distamp import fleet

    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="eager")
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16", "custom_black_varnames": ["head"]}
    fleet.init(strategy=strategy)
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(compiled.parameters(), lr=0.1), strategy)
    with fleet.auto_cast():
        out = compiled(torch.randn(4, 8))
    assert out["out"].dtype == torch.float32
    assert out["hidden"].dtype == torch.bfloat16
    assert model.head.weight.dtype == torch.float32
    assert model.fc1.weight.dtype == torch.bfloat16
    assert [optimizer.binding.name_of(p, i) for i, p in enumerate(model.parameters())] == [
        name for name, _ in model.named_parameters()]
