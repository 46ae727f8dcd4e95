"""Rank-one pairs modulo positive scalings: the symmetry of a ReLU unit."""

from __future__ import annotations

from typing import Tuple

import torch

from .gl_quotient import GLQuotient
from .groups import positive_scalars

__all__ = ["PositiveScalingQuotient"]


class PositiveScalingQuotient(GLQuotient):
    r"""Pairs :math:`(g, h)` of nonzero vectors modulo :math:`(g, h) \mapsto (g / a, h a)`,
    :math:`a > 0`.

    A ReLU unit is positively homogeneous: scaling its input weights (and bias) by
    :math:`1/a` and its output weights by :math:`a` leaves the network unchanged for
    :math:`a > 0` only. The group :math:`\mathbb R_{>0}` is the identity component of
    :math:`\mathrm{GL}(1)`: the same Lie algebra, hence the same vertical and horizontal
    spaces, metrics, projection and geodesics as :class:`GLQuotient` of rank
    :math:`h = 1`; only the group elements differ (:meth:`random_element` draws positive
    ones, as symmetry verification needs).

    Parameters
    ----------
    n, m, metric, eps, retraction, expmap_steps
        As for :class:`GLQuotient`; points have rank :math:`h = 1`.

    Examples
    --------
    >>> import torch
    >>> from geoopt_quotient import PositiveScalingQuotient
    >>> manifold = PositiveScalingQuotient(3, 2)
    >>> a = manifold.random_element((4,), h=1, generator=torch.Generator().manual_seed(0))
    >>> bool((a > 0).all()), tuple(a.shape)
    (True, (4, 1, 1))
    """

    name = "PositiveScalingQuotient"

    def random_element(
        self,
        batch_shape: Tuple[int, ...],
        *,
        h: int = 1,
        max_condition: float = 4.0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        r"""Random positive scalings :math:`a` with :math:`\log a` uniform in
        :math:`[-\tfrac12 \log c, \tfrac12 \log c]`, ``c = max_condition``.

        Parameters
        ----------
        batch_shape : tuple of int
            Leading shape (one element per point).
        h : int
            The rank, 1.
        max_condition : float
            Bound on the ratio of two elements.
        generator : torch.Generator, optional
            Source of randomness.
        dtype : torch.dtype
            Dtype of the result.

        Returns
        -------
        torch.Tensor
            Shape ``(*batch_shape, 1, 1)``.
        """
        if h != 1:
            raise ValueError(f"PositiveScalingQuotient has rank 1, got h = {h}")
        shape = (*tuple(batch_shape), 1, 1)
        return positive_scalars(shape, condition=max_condition, generator=generator, dtype=dtype)

    def group_label(self, rank: int) -> str:
        """``"GL(1)+ [1]"``: positive scalings."""
        return "GL(1)+ [1]"

    def stack_key(self) -> None:
        """``None``: never stacked with the GL(h) kernels' batches."""
        return None

    def _check_shape(self, shape, name):
        ok, reason = super()._check_shape(shape, name)
        if ok and shape[-1] != 1:
            return False, f"`{name}` must have rank h = 1, got {shape[-1]}"
        return ok, reason
