"""Linear regression with the diagonal reparametrisation beta = u * v."""

from __future__ import annotations

from typing import Optional

import torch
from geoopt import ManifoldParameter
from torch import nn

from .._checks import check_positive_int
from ..manifolds import DiagonalQuotient

__all__ = ["DiagonalLinear"]


class DiagonalLinear(nn.Module):
    r"""The diagonal linear network :math:`y = x^\top (u \odot v)`.

    ``uv`` is one :class:`geoopt.ManifoldParameter` of shape ``(2, d)`` on
    :class:`~geoopt_quotient.DiagonalQuotient` (row 0 is :math:`u`, row 1 is :math:`v`);
    the function depends only on :math:`\beta = u \odot v`, invariant under
    :math:`(u, v) \mapsto (\alpha \odot u, v / \alpha)`.

    Parameters
    ----------
    d : int
        Number of input features.
    metric : {"mix", "inv"}
        The invariant metric of the quotient.
    init_scale : float
        Initialisation :math:`u = \text{init\_scale}\cdot\mathbf 1`,
        :math:`v = \text{init\_scale}\cdot \sigma`, i.e.
        :math:`\beta_0 = \text{init\_scale}^2 \sigma` (the scale sets the implicit bias
        of gradient descent in diagonal networks). Must be non-zero.
    signs : torch.Tensor, optional
        :math:`\sigma \in \{\pm 1\}^d`, the signs of :math:`\beta` (default all
        :math:`+1`). See the warning.
    device, dtype
        Factory keyword arguments.

    Warnings
    --------
    The quotient of pairs of *non-zero* numbers has one component per sign pattern:
    no path on it changes the sign of any :math:`\beta_i`, so :math:`\beta` keeps the
    signs it was initialised with. Under the inv metric
    (:math:`d\beta^2 / \beta^2`-like, complete) a coefficient whose target has the
    other sign decays towards 0 and stalls; under the mix metric
    (:math:`|d\beta|^2`-like, incomplete) :math:`\beta_i = 0` is at finite distance
    and a fixed-step optimizer overshoots it (the factors blow up or become NaN).
    Choose ``signs`` accordingly, or use two layers for
    :math:`u \odot v - u' \odot v'`.

    Notes
    -----
    ``forward`` maps ``(..., d)`` to ``(...)``.
    """

    def __init__(
        self,
        d: int,
        metric: str = "mix",
        init_scale: float = 1.0,
        *,
        signs: Optional[torch.Tensor] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.d = check_positive_int(d, "d")
        if init_scale == 0:
            raise ValueError("`init_scale` must be non-zero: u = v = 0 is not on the quotient")
        self.init_scale = float(init_scale)
        self.manifold = DiagonalQuotient(metric)
        point = self.manifold.origin(2, d, device=device, dtype=dtype) * self.init_scale
        if signs is not None:
            signs = torch.as_tensor(signs, dtype=point.dtype, device=point.device)
            if signs.shape != (d,) or not bool((signs.abs() == 1).all()):
                raise ValueError("`signs` must be a tensor of shape (d,) with entries +-1")
            point[1] = point[1] * signs
        self.uv = ManifoldParameter(point, manifold=self.manifold)

    @property
    def beta(self) -> torch.Tensor:
        r"""The regression coefficients :math:`\beta = u \odot v`, shape ``(d,)``."""
        return self.manifold.product(self.uv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.beta

    def extra_repr(self) -> str:
        return f"d={self.d}, metric={self.manifold.metric!r}, init_scale={self.init_scale}"
