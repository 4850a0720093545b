"""benchmarks.cpu_linear's decode-step row (``--layers``): the bytes it divides its times by are
the packed weights of every layer's linears, the same for each kernel's layout (its GB/s and the
plain read's compare like for like)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.cpu_linear import layer_stack
from kernels import cpu as native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"sgl_cpu kernels: {native.unavailable_reason()}")


@pytest.mark.parametrize("kernel", native.LINEAR_KERNELS)
def test_layer_stack_counts_the_packed_weights(kernel):
    if not native.available(kernel):
        pytest.skip(f"{kernel}: {native.unavailable_reason(kernel)}")
    # Q4_1 packs 32 weights into 20 bytes in both layouts (a 16-feature tile: 16 x 20 per block)
    shapes, layers = [(64, 32), (96, 48)], 3
    kernel_ms, sum_ms, nbytes = layer_stack(kernel, shapes, layers, torch.float32, reps=2)
    assert nbytes == layers * sum(k // 32 * 20 * n for k, n in shapes)
    assert kernel_ms > 0 and sum_ms > 0
