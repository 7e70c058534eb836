"""The replica check's hash on a CUDA GPU (``pytest -m cuda tests/cuda``): the same bits as on the CPU.

Off the CPU the hash takes its weighted sum elementwise (CUDA has no int64
matrix-vector product); sums modulo 2**64 do not depend on the order, so a
GPU and a CPU must give the same two numbers for the same bytes.
"""

from __future__ import annotations

import pytest
import torch

from distamp.distributed.replica_check import tensor_hash

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8])
@pytest.mark.parametrize("numel", [0, 1, 7, 251, 252, 251 * 40 + 3, 1_000_003])
def test_cuda_hash_equals_cpu_hash(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    values = (torch.randn(numel + 3, generator=g) * 1e3).to(dtype)
    for tensor in (values[:numel], values[3:]):  # at offset 0 and at an odd offset of the same storage
        assert tensor_hash(tensor.cuda()).tolist() == tensor_hash(tensor).tolist()
