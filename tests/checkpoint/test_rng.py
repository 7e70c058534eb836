"""distamp.checkpoint.rng: each rank saves and restores its own generators, CUDA's on its current device."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from distamp.checkpoint import rng


def draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_cpu_states_round_trip():
    state = rng.get_rng_state()
    assert set(state) == {"python", "torch", "numpy"}  # no CUDA in use
    first = draw()
    assert rng.set_rng_state(state) == []
    assert draw() == first


class FakeCuda:
    """Just enough of ``torch.cuda`` for the RNG code: devices with one state each."""

    def __init__(self, monkeypatch, available=True, current=1, count=2):
        self.states = {d: torch.full((8,), d, dtype=torch.uint8) for d in range(count)}
        self.set_calls = []
        self.current = current
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count if available else 0)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[device].clone())
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [self.states[d] for d in range(count)])
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": self.set_calls.append(
            (state.clone(), device)))


def test_the_current_devices_state_is_saved_not_every_visible_devices(monkeypatch):
    FakeCuda(monkeypatch, current=1)
    state = rng.get_rng_state()
    assert state["cuda"]["device"] == 1
    assert torch.equal(state["cuda"]["state"], torch.full((8,), 1, dtype=torch.uint8))


def test_it_is_restored_onto_the_current_device_whatever_its_index(monkeypatch):
    cuda = FakeCuda(monkeypatch, current=1)
    state = rng.get_rng_state()
    cuda.current = 0  # the restarted rank got another GPU
    assert rng.set_rng_state(state) == []
    ((restored, device),) = cuda.set_calls
    assert device == 0
    assert torch.equal(restored, torch.full((8,), 1, dtype=torch.uint8))


def test_a_cuda_state_without_cuda_is_reported_unrestored(monkeypatch):
    FakeCuda(monkeypatch)
    state = rng.get_rng_state()
    monkeypatch.undo()
    FakeCuda(monkeypatch, available=False)
    assert rng.set_rng_state(state) == ["cuda"]


def test_cuda_in_use_without_a_saved_state_is_reported_unrestored(monkeypatch):
    state = rng.get_rng_state()
    cuda = FakeCuda(monkeypatch)
    assert rng.set_rng_state(state) == ["cuda"]
    assert cuda.set_calls == []


def test_format_1_states_of_every_device_restore_the_current_ones(monkeypatch):
    cuda = FakeCuda(monkeypatch, current=1, count=2)
    state = {**rng.get_rng_state(), "cuda": [torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)]}
    assert rng.set_rng_state(state) == []
    assert cuda.set_calls[0][1] == 1
    assert torch.equal(cuda.set_calls[0][0], torch.ones(8, dtype=torch.uint8))
    cuda.current = 2
    assert rng.set_rng_state(state) == ["cuda"]


@pytest.mark.cuda
def test_the_cuda_generator_round_trips_on_a_gpu():
    torch.cuda.init()
    torch.cuda.manual_seed(3)
    state = rng.get_rng_state()
    assert state["cuda"]["device"] == torch.cuda.current_device()
    first = torch.rand(4, device="cuda").tolist()
    torch.rand(100, device="cuda")  # move on, then come back
    assert rng.set_rng_state(state) == []
    assert torch.rand(4, device="cuda").tolist() == first


@pytest.mark.cuda
def test_a_checkpoint_restores_the_cuda_generator(tmp_path):
    from torch import nn

    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    model = nn.Linear(4, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.cuda.manual_seed(5)
    save_checkpoint(tmp_path, 1, model=model, optimizer=opt)
    expected = torch.rand(4, device="cuda").tolist()
    torch.cuda.manual_seed(6)
    info = load_latest_checkpoint(tmp_path, model=model, optimizer=opt)
    assert info.rng_restored
    assert torch.rand(4, device="cuda").tolist() == expected
