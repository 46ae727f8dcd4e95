r"""Random, well-conditioned elements of the groups the quotient manifolds divide by.

Each quotient manifold draws its own group's elements (:meth:`QuotientManifold.random_element`)
with these samplers: invertible matrices of a chosen condition number for
:math:`\mathrm{GL}(h)`, and non-zero (or positive) scalars for its one-dimensional tori.
Everything is drawn in float64 on the generator's device and cast afterwards, so one seed
gives the same elements in every dtype and on every device.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = ["general_linear", "log_spread", "nonzero_scalars", "positive_scalars"]


def log_spread(
    shape: Sequence[int],
    condition: float,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    r"""Positive values, log-uniform in :math:`[\kappa^{-1/2}, \kappa^{1/2}]`.

    Along the last axis (if it has at least two entries) the extremes are pinned to the
    ends, so the ratio of the largest to the smallest value is exactly
    :math:`\kappa` = ``condition``.

    Parameters
    ----------
    shape : sequence of int
        Shape of the result.
    condition : float
        :math:`\kappa \ge 1`.
    generator : torch.Generator or None
        Random number generator (``None``: torch's global one).
    dtype : torch.dtype
        Dtype of the result.

    Returns
    -------
    torch.Tensor
        The values, of ``shape``.
    """
    _check_condition(condition)
    half = 0.5 * math.log(condition)
    logs = (2 * torch.rand(tuple(shape), generator=generator, dtype=dtype) - 1) * half
    if len(shape) and shape[-1] >= 2:
        logs[..., 0] = half
        logs[..., -1] = -half
    return logs.exp()


def general_linear(
    batch_shape: Sequence[int],
    dim: int,
    *,
    condition: float = 10.0,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    r"""Random :math:`A = U \operatorname{diag}(s) V^\top \in \mathrm{GL}(\text{dim})`.

    :math:`U, V` are Haar-orthogonal (so :math:`\det A` has a random sign) and :math:`s`
    comes from :func:`log_spread`: the condition number is exactly :math:`\kappa` =
    ``condition`` for ``dim >= 2``; for ``dim == 1``, :math:`|A|` is log-uniform in
    :math:`[\kappa^{-1/2}, \kappa^{1/2}]`.

    Parameters
    ----------
    batch_shape : sequence of int
        Leading shape: one independent element per index.
    dim : int
        Size :math:`h` of the matrices.
    condition : float
        Condition number :math:`\kappa \ge 1`.
    generator : torch.Generator or None
        Random number generator (``None``: torch's global one).
    dtype : torch.dtype
        Floating-point dtype of the result.

    Returns
    -------
    torch.Tensor
        Shape ``(*batch_shape, dim, dim)``.
    """
    _check_condition(condition)
    shape = (*tuple(batch_shape), dim, dim)

    def haar() -> torch.Tensor:
        q, r = torch.linalg.qr(torch.randn(shape, generator=generator, dtype=dtype))
        return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)

    u, v = haar(), haar()
    if dim == 1:
        half = 0.5 * math.log(condition)
        s = ((2 * torch.rand(shape[:-1], generator=generator, dtype=dtype) - 1) * half).exp()
    else:
        s = log_spread(shape[:-1], condition, generator, dtype)
    return (u * s.unsqueeze(-2)) @ v.mT


def nonzero_scalars(
    shape: Sequence[int],
    *,
    condition: float = 10.0,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    r"""Non-zero :math:`\alpha` of random signs with :math:`\max|\alpha| / \min|\alpha| = \kappa`.

    Elements of :math:`(\mathrm{GL}(1))^d = (\mathbb R^*)^d`: magnitudes from
    :func:`log_spread` over all entries (extremes attained), shuffled.

    Parameters
    ----------
    shape : sequence of int
        Shape of the result.
    condition : float
        :math:`\kappa \ge 1`.
    generator : torch.Generator or None
        Random number generator (``None``: torch's global one).
    dtype : torch.dtype
        Dtype of the result.

    Returns
    -------
    torch.Tensor
        The scalars, of ``shape``.
    """
    shape = tuple(shape)
    signs = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0).to(dtype)
    flat = log_spread((math.prod(shape),), condition, generator, dtype)
    flat = flat[torch.randperm(flat.numel(), generator=generator)]
    return signs * flat.reshape(shape)


def positive_scalars(
    shape: Sequence[int],
    *,
    condition: float = 10.0,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    r"""Positive :math:`a` with :math:`\log a` uniform in :math:`[-\tfrac12\log\kappa,
    \tfrac12\log\kappa]`: elements of :math:`\mathbb R_{>0}`, the identity component of
    :math:`\mathrm{GL}(1)`.

    Parameters
    ----------
    shape : sequence of int
        Shape of the result.
    condition : float
        :math:`\kappa \ge 1`: bound on the ratio of two elements.
    generator : torch.Generator or None
        Random number generator (``None``: torch's global one).
    dtype : torch.dtype
        Dtype of the result (drawn in float64).

    Returns
    -------
    torch.Tensor
        The scalars, of ``shape``.
    """
    _check_condition(condition)
    log = torch.rand(tuple(shape), generator=generator, dtype=torch.float64) - 0.5
    return (condition**log).to(dtype)


def _check_condition(condition: float) -> None:
    if not condition >= 1:
        raise ValueError(f"the condition number must be >= 1, got {condition}")
