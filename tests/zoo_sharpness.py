"""Geodesic against adaptive sharpness of a tiny zoo model and a copy moved by a group
element, and random group elements written by hand: what the zoo's layout tests share."""

from __future__ import annotations

import copy
from typing import Dict, Tuple

import torch

from geoopt_quotient import adaptive_sharpness, find_symmetries, geodesic_sharpness

F64 = torch.float64


def random_factors(shape, generator) -> torch.Tensor:
    """Nonzero scalars of either sign, magnitudes in [1/4, 4]."""
    magnitude = 4.0 ** (2 * torch.rand(shape, generator=generator, dtype=F64) - 1)
    sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0).to(F64)
    return magnitude * sign


def random_matrices(count: int, size: int, generator) -> torch.Tensor:
    """Well-conditioned invertible matrices ``(count, size, size)``."""
    a = torch.randn(count, size, size, generator=generator, dtype=F64) / size**0.5
    return a + 2 * torch.eye(size, dtype=F64)


def next_token_loss(model, batch):
    logits = model(**batch).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1)
    )


def sharpness_before_and_after(
    model: torch.nn.Module,
    moved: Dict[str, torch.Tensor],
    batch: dict,
    *,
    kinds: str = "default",
    adaptive_eps: float = 0.0,
) -> Tuple[Dict[str, Tuple[float, float]], Tuple[float, float]]:
    """Geodesic sharpness (per metric) and adaptive sharpness (with ``adaptive_eps``) of
    ``model`` and of a copy with the parameters ``moved``, a few Auto-PGD steps each.

    Returns
    -------
    tuple
        ``({metric: (before, after)}, (adaptive before, adaptive after))``.
    """
    other = copy.deepcopy(model)
    other.load_state_dict(moved, strict=False)
    kw = dict(rho=0.05, iters=3)

    def geodesic(m, metric):
        plan = find_symmetries(m, metric=metric, kinds=kinds)
        return geodesic_sharpness(
            m, next_token_loss, [batch], metric=metric, symmetries=plan, **kw
        ).value

    values = {
        metric: (geodesic(model, metric), geodesic(other, metric)) for metric in ("mix", "inv")
    }
    adaptive = tuple(
        adaptive_sharpness(m, next_token_loss, [batch], eps=adaptive_eps, **kw).value
        for m in (model, other)
    )
    return values, adaptive
