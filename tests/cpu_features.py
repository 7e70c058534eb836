"""What this host's CPU does natively, for tests whose expectation holds on one kind of host only."""

from __future__ import annotations

import pytest


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


NATIVE_BF16 = bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
"""Whether BF16 matrix products run in hardware here; elsewhere oneDNN converts them through FP32 temporaries."""

needs_native_bf16 = pytest.mark.skipif(
    not NATIVE_BF16,
    reason="the BF16 peak-memory ratio is measured where BF16 matmuls are native (avx512_bf16 or amx_bf16); "
    "this host computes them in software through FP32 temporaries, which the live-tensor peak counts",
)
