"""Random tensors on a chosen device, drawn on their generator's device.

``torch.randn(..., generator=g, device=d)`` fails when ``g`` lives on another device
than ``d``. These helpers draw on the generator's device and copy the result over, so a
CPU generator may seed samplers for tensors on the GPU (and gives the same numbers
there as on the CPU).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["randn", "standard_normal", "uniform"]


def _source(generator: torch.Generator | None, device: torch.device | None):
    return device if generator is None else generator.device


def randn(
    shape: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """:math:`\\mathcal N(0, 1)` entries of ``shape`` on ``device``."""
    noise = torch.randn(shape, generator=generator, dtype=dtype, device=_source(generator, device))
    return noise.to(device)


def standard_normal(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """:math:`\\mathcal N(0, 1)` entries shaped like ``like``, on its device, in its dtype."""
    return randn(like.shape, generator=generator, dtype=like.dtype, device=like.device)


def uniform(
    like: torch.Tensor, low: float, high: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Entries uniform on ``[low, high)`` shaped like ``like``, on its device, in its dtype."""
    source = torch.empty(like.shape, dtype=like.dtype, device=_source(generator, like.device))
    return source.uniform_(low, high, generator=generator).to(like.device)
