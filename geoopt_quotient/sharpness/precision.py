r"""Mixed precision: the user's autocast for the loss, full precision for the geometry.

A sharpness call made under ``torch.autocast`` (e.g. ``torch.autocast("cuda",
dtype=torch.bfloat16)``) should run the *model* in that precision, but not the geometry:
the second-order retraction :math:`X + \xi - \tfrac12\Gamma_X(\xi, \xi)`, the horizontal
projection and the metric are matrix products that autocast would round to bfloat16,
which loses the perturbation (a few ulps of the point) and the horizontality of
:math:`\xi`. :class:`AutocastState` records the autocast state at the call, switches it
off for the geometry and switches it back on, as it was, around each evaluation of the
objective.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Tuple

import torch

__all__ = ["AutocastState"]

#: Device types whose autocast state is recorded.
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class AutocastState:
    """The enabled autocast regions at one moment: ``(device type, dtype)`` pairs."""

    enabled: Tuple[Tuple[str, torch.dtype], ...]

    @classmethod
    def capture(cls) -> AutocastState:
        return cls(
            tuple(
                (device, torch.get_autocast_dtype(device))
                for device in DEVICE_TYPES
                if torch.is_autocast_enabled(device)
            )
        )

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Autocast off for every device type on which it was on (else: nothing)."""
        with contextlib.ExitStack() as stack:
            for device, _ in self.enabled:
                stack.enter_context(torch.autocast(device, enabled=False))
            yield

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Autocast on again, with the recorded dtypes (else: nothing), without its cache of
        casts: the cache keeps the cast of a leaf tensor until the outermost autocast
        region ends, and the perturbed parameters are leaves whose values change between
        evaluations inside one region."""
        with contextlib.ExitStack() as stack:
            for device, dtype in self.enabled:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
            yield
