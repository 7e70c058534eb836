"""Old import paths re-export the very objects of the modules they moved to."""

from __future__ import annotations

import importlib

import pytest

SHIMS = {
    "distamp.amp.master_weights": "distamp.optim.master_weights",
    "distamp.amp.op_lists": "distamp.amp.op_names",
    "distamp.amp.loss_scaler": "distamp.optim.loss_scaler",
    "distamp.parallel": "distamp.distributed.data_parallel",
    "distamp.comm_hooks": "distamp.distributed.comm_hooks",
    "distamp.optimizer": "distamp.optim.optimizer",
    "distamp.process_group": "distamp.distributed.process_group",
}


@pytest.mark.parametrize(("old", "new"), sorted(SHIMS.items()))
def test_old_path_re_exports_the_same_objects(old, new):
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    assert old_module.__all__, old
    for name in old_module.__all__:
        assert getattr(old_module, name) is getattr(new_module, name), f"{old}.{name}"
