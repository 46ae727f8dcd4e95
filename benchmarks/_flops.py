"""The benchmarks' counter of the floating-point operations of matrix products.

``torch.utils.flop_counter.FlopCounterMode`` counts the out-of-place products; the
counter here also counts :data:`PRODUCTS`, which it misses by itself.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode


def _raw(op):
    return flop_counter.flop_registry[op].__wrapped__


_aten = torch.ops.aten
#: Products that ``FlopCounterMode`` does not count by itself: the in-place forms (the
#: quotient groups' kernels accumulate into their results) and the CPU's attention.
PRODUCTS = {
    _aten.baddbmm_: _raw(_aten.baddbmm),
    _aten.addmm_: _raw(_aten.addmm),
    _aten._scaled_dot_product_flash_attention_for_cpu: _raw(
        _aten._scaled_dot_product_flash_attention
    ),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _raw(
        _aten._scaled_dot_product_flash_attention_backward
    ),
}


def counter() -> FlopCounterMode:
    """A flop counter that also counts :data:`PRODUCTS`."""
    return FlopCounterMode(display=False, custom_mapping=PRODUCTS)
