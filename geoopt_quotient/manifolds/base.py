r"""The vocabulary the package's manifolds share, declared once.

Each manifold is a quotient :math:`\mathcal M = \overline{\mathcal M} / G` of a total space
by a group acting on it, written on the total space (a point is a representative, a
tangent vector its horizontal lift):

* the *vertical* space at :math:`x` is the tangent space of the orbit :math:`G x`;
* the *horizontal* space is its orthogonal complement in the total-space metric, which
  is :math:`G`-invariant, so it identifies with the quotient's tangent space;
* :meth:`~geoopt.manifolds.Manifold.proju` is the horizontal projection, and
  :meth:`transp` transports a vector by projecting it onto the horizontal space at the
  destination (equivariant, since the projection is).

:class:`~geoopt_quotient.AdaptiveEuclidean` is the trivial case (no group: every vector
is horizontal, except on entries it freezes).
"""

from __future__ import annotations

from typing import Tuple

import torch
from geoopt.manifolds.base import Manifold

__all__ = ["QuotientManifold"]


class QuotientManifold(Manifold):
    """A :class:`geoopt.manifolds.Manifold` whose :meth:`proju` is the horizontal projection."""

    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vector transport: horizontal projection at ``y``."""
        return self.proju(y, v)

    def retr_transp(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        y = self.retr(x, u)
        return y, self.transp(x, y, v)

    def expmap_transp(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        y = self.expmap(x, u)
        return y, self.transp(x, y, v)
