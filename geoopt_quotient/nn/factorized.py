"""A low-rank linear layer whose factor pair lives on the GL quotient."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from geoopt import ManifoldParameter
from torch import nn

from .._checks import check_positive_int
from ..manifolds import GLQuotient
from ..manifolds._random import standard_normal, uniform
from ._factors import balance, balanced_factors

__all__ = ["FactorizedLinear"]


class FactorizedLinear(nn.Module):
    r"""Linear layer :math:`y = x W^\top + b` with :math:`W = G H^\top` of rank ``rank``.

    The factors are held as one :class:`geoopt.ManifoldParameter` ``factors`` of shape
    ``(out_features + in_features, rank)`` on
    :class:`~geoopt_quotient.GLQuotient` ``(n=out_features, m=in_features)``:

    * :math:`G \in \mathbb{R}^{\text{out} \times r}` (rows ``:out_features``) is the
      *output* factor, like the second layer of a linear network or LoRA's ``B``;
    * :math:`H \in \mathbb{R}^{\text{in} \times r}` (the remaining rows) is the *input*
      factor, the transpose of the first layer or of LoRA's ``A``.

    So :math:`W` has the shape of :attr:`torch.nn.Linear.weight` and
    :math:`y = (x H) G^\top + b` costs :math:`O(r(\text{in} + \text{out}))` per row.
    The function depends on the factors only through the class of
    :math:`(G, H) \sim (G A^{-1}, H A^\top)`, :math:`A \in \mathrm{GL}(r)`; with
    :class:`geoopt.optim.RiemannianAdam` or :class:`geoopt_quotient.optim.RiemannianSGD`
    training follows the same path in function space from every representative.

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the input and output, as for :class:`torch.nn.Linear`.
    rank : int
        :math:`r \le \min(\text{in}, \text{out})`.
    metric : {"mix", "inv"}
        The GL-invariant metric of the quotient.
    bias : bool
        Whether to learn an additive bias (an ordinary :class:`torch.nn.Parameter`).
    eps : float
        Relaxation of the quotient metric (see :class:`~geoopt_quotient.GLQuotient`).
    generator : torch.Generator, optional
        Source of randomness for the initialisation.
    device, dtype
        Factory keyword arguments, as for :class:`torch.nn.Linear`.

    Notes
    -----
    Initialisation (:meth:`reset_parameters`): :math:`G_0, H_0` have i.i.d.
    :math:`\mathcal N(0, \sigma^2)` entries with :math:`r\sigma^4 = 1 / (3\,\text{in})`,
    so that :math:`\operatorname{Var} W_{ij} = 1 / (3\,\text{in})`, the variance of
    :class:`torch.nn.Linear`'s default :math:`\mathcal U(\pm 1/\sqrt{\text{in}})`; the
    pair is then replaced by its balanced representative
    (:math:`G^\top G = H^\top H`, same product, see :func:`balance`). The bias is
    :math:`\mathcal U(\pm 1/\sqrt{\text{in}})` as in :class:`torch.nn.Linear`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        metric: str = "mix",
        bias: bool = True,
        eps: float = 0.0,
        *,
        generator: Optional[torch.Generator] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.in_features = check_positive_int(in_features, "in_features")
        self.out_features = check_positive_int(out_features, "out_features")
        self.rank = check_positive_int(rank, "rank")
        if rank > min(in_features, out_features):
            raise ValueError(
                f"`rank` must be <= min(in_features, out_features) = "
                f"{min(in_features, out_features)}, got {rank}"
            )
        self.manifold = GLQuotient(out_features, in_features, metric=metric, eps=eps)
        factory = {"device": device, "dtype": dtype}
        self.factors = ManifoldParameter(
            self.manifold.origin(out_features + in_features, rank, **factory),
            manifold=self.manifold,
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters(generator=generator)

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Re-draw the factors and the bias (see the class notes)."""
        x = self.factors
        std = (3.0 * self.in_features * self.rank) ** -0.25
        noise = standard_normal(x, generator) * std
        g, h = balance(*self.manifold.factors(noise))
        x.copy_(self.manifold.from_factors(g, h))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            self.bias.copy_(uniform(self.bias, -bound, bound, generator))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        rank: int,
        metric: str = "mix",
        eps: float = 0.0,
    ) -> FactorizedLinear:
        r"""Rank-``rank`` truncation of ``linear`` with balanced factors.

        :math:`G = U_r \Sigma_r^{1/2}`, :math:`H = V_r \Sigma_r^{1/2}` from the SVD of
        ``linear.weight`` (:func:`balanced_factors`); the bias is copied. Raises
        ``ValueError`` if the weight has fewer than ``rank`` non-negligible singular
        values (the pair would not be a point of the quotient).
        """
        weight = linear.weight.detach()
        out = cls(
            linear.in_features,
            linear.out_features,
            rank,
            metric=metric,
            bias=linear.bias is not None,
            eps=eps,
            device=weight.device,
            dtype=weight.dtype,
        )
        g, h = balanced_factors(weight, rank)
        point = out.manifold.from_factors(g, h)
        ok, reason = out.manifold.check_point_on_manifold(point, explain=True)
        if not ok:
            raise ValueError(f"the rank-{rank} truncation of `linear.weight` is invalid: {reason}")
        with torch.no_grad():
            out.factors.copy_(point)
            if linear.bias is not None:
                out.bias.copy_(linear.bias.detach())
        return out

    def factor_pair(self) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""The views :math:`(G, H)` of :attr:`factors` (output and input factor)."""
        return self.manifold.factors(self.factors)

    @property
    def weight(self) -> torch.Tensor:
        r"""The dense weight :math:`W = G H^\top`, shape ``(out_features, in_features)``."""
        return self.manifold.product(self.factors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, h = self.factor_pair()
        return F.linear(F.linear(x, h.mT), g, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.rank}, metric={self.manifold.metric!r}, bias={self.bias is not None}"
        )
