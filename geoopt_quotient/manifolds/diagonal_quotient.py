"""The quotient of pairs of vectors by element-wise GL(1) (diagonal linear networks)."""

from __future__ import annotations

import copy
from typing import Sequence, Tuple, Union

import torch
from geoopt.tensor import ManifoldTensor
from geoopt.utils import size2shape

from .._checks import METRICS, RETRACTIONS, check_choice
from ._linalg import compute_dtype
from ._random import standard_normal
from ._validation import GeodesicDomainError
from .base import QuotientManifold
from .groups import nonzero_scalars

__all__ = ["DiagonalQuotient", "GeodesicDomainError"]


class DiagonalQuotient(QuotientManifold):
    r"""Pairs :math:`(u, v) \in (\mathbb{R} \setminus 0)^d \times (\mathbb{R} \setminus 0)^d`
    modulo the element-wise action :math:`(\alpha \odot u, v / \alpha)`.

    The invariant is :math:`\beta = u \odot v`, e.g. a diagonal linear network
    :math:`y = x^\top (u \odot v)`. A point is one tensor of shape ``(..., 2, d)``:
    row 0 is :math:`u`, row 1 is :math:`v`. This is :class:`GLQuotient` with
    :math:`n = m = h = 1` for every coordinate, written element-wise:

    .. math::

        \text{inv:}\ \langle \eta, \nu \rangle = \sum_i \frac{\eta_{u,i}\nu_{u,i}}{u_i^2}
            + \frac{\eta_{v,i}\nu_{v,i}}{v_i^2}, \qquad
        \text{mix:}\ \langle \eta, \nu \rangle = \sum_i \eta_{u,i}\nu_{u,i} v_i^2
            + \eta_{v,i}\nu_{v,i} u_i^2 .

    For both metrics a vector is horizontal iff :math:`\eta_u / u = \eta_v / v =: B`,
    and the horizontal geodesics have closed forms

    .. math::

        \text{inv:}\ (u, v)(t) = (u, v)\, e^{B t}, \qquad
        \text{mix:}\ (u, v)(t) = (u, v) \sqrt{1 + 2 B t}.

    :meth:`expmap` is exact for every tangent vector, horizontal or not: the inv
    metric decouples into the flat coordinates :math:`\log|u|, \log|v|`, and the mix
    metric :math:`v^2 du^2 + u^2 dv^2 = \tfrac12 |dw|^2` is flat in the complex
    coordinate :math:`w = |uv|\, e^{i \log|u/v|}`, so its geodesics are straight lines in
    :math:`w`. A mix geodesic leaves the manifold iff it is horizontal with
    :math:`1 + 2B \le 0`; :meth:`expmap` raises :class:`GeodesicDomainError` then.

    Parameters
    ----------
    metric : {"mix", "inv"}
        The GL(1)-invariant metric above (default ``"mix"``).
    retraction : {"second_order", "first_order"}
        :meth:`retr` is :math:`X + \xi - \tfrac12\Gamma_X(\xi,\xi)` (default) or
        :math:`X + \xi`.

    References
    ----------
    da Silva, Dangel & Oore (2025) :cite:`dasilva2025hide`; diagonal linear networks:
    Woodworth et al. (2020), "Kernel and Rich Regimes in Overparametrized Models", COLT
    :cite:`woodworth2020kernel`.

    Examples
    --------
    On a horizontal vector the inv geodesic scales :math:`\beta` by :math:`e^{2B}`:

    >>> import torch
    >>> from geoopt_quotient import DiagonalQuotient
    >>> manifold = DiagonalQuotient(metric="inv")
    >>> x = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)
    >>> manifold.product(x)
    tensor([ 0.5000, -6.0000], dtype=torch.float64)
    >>> u = manifold.proju(x, torch.tensor([[0.1, 0.2], [0.3, -0.1]], dtype=torch.float64))
    >>> rate = u[0] / x[0]
    >>> torch.allclose(rate, u[1] / x[1])
    True
    >>> y = manifold.expmap(x, u)
    >>> torch.allclose(manifold.product(y), manifold.product(x) * torch.exp(2 * rate))
    True
    """

    name = "DiagonalQuotient"
    ndim = 2
    reversible = False
    has_group = True

    def __init__(self, metric: str = "mix", *, retraction: str = "second_order"):
        super().__init__()
        self.metric = check_choice(metric, METRICS, "metric")
        self.retraction = check_choice(retraction, RETRACTIONS, "retraction")

    def extra_repr(self) -> str:
        return f"metric={self.metric!r}, retraction={self.retraction!r}"

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def factors(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The rows :math:`u` and :math:`v` of a point (or tangent vector)."""
        u, v = x.unbind(dim=-2)
        return u, v

    @staticmethod
    def from_factors(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Stack :math:`u` and :math:`v` (each ``(..., d)``) into a point ``(..., 2, d)``."""
        return torch.stack((u, v), dim=-2)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        r"""The invariant :math:`\beta = u \odot v`."""
        u, v = self.factors(x)
        return u * v

    def act(self, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        r"""Group action :math:`(u, v) \mapsto (\alpha u, v / \alpha)`; maps tangent vectors too."""
        u, v = self.factors(x)
        return self.from_factors(u * alpha, v / alpha)

    def inverse_element(self, alpha: torch.Tensor) -> torch.Tensor:
        r""":math:`1 / \alpha`."""
        return alpha.reciprocal()

    def act_on_first_factor(self, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        r""":math:`(u, v) \mapsto (\alpha u, v)`: no symmetry of :math:`u \odot v` (a control)."""
        u, v = self.factors(x)
        return self.from_factors(u * alpha, v)

    def random_element(
        self,
        batch_shape: Sequence[int],
        *,
        h: int,
        max_condition: float = 4.0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        r"""Random :math:`\alpha \in (\mathbb R^*)^h` per point: random signs, magnitudes
        log-uniform with ratio ``max_condition`` between the extremes
        (:func:`~geoopt_quotient.manifolds.groups.nonzero_scalars`, drawn in float64).

        Parameters
        ----------
        batch_shape : sequence of int
            Leading shape (one element per point).
        h : int
            The number of coordinates :math:`d` of a point.
        max_condition : float
            Ratio of the largest to the smallest magnitude.
        generator : torch.Generator, optional
            Source of randomness.
        dtype : torch.dtype
            Dtype of the result.

        Returns
        -------
        torch.Tensor
            Shape ``(*batch_shape, h)``.
        """
        shape = (*tuple(batch_shape), h)
        return nonzero_scalars(shape, condition=max_condition, generator=generator).to(dtype)

    def identity_element(
        self,
        batch_shape: Sequence[int],
        *,
        h: int,
        dtype: torch.dtype = torch.float64,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """Ones, shape ``(*batch_shape, h)``."""
        return torch.ones(*batch_shape, h, dtype=dtype, device=device)

    def with_metric(self, metric: str, eps: float = 0.0) -> DiagonalQuotient:
        """A copy in ``metric`` (``eps`` does not apply: the metric needs no relaxation)."""
        other = copy.copy(self)
        other.metric = check_choice(metric, METRICS, "metric")
        return other

    def group_label(self, rank: int) -> str:
        """``"GL(1)^d [d]"``: one non-zero scalar per coordinate."""
        return f"GL(1)^{rank} [{rank}]"

    def _weights(self, x: torch.Tensor) -> torch.Tensor:
        """Per-entry metric weights, shape of ``x``: inv (1/u², 1/v²), mix (v², u²)."""
        x = x.to(compute_dtype(x.dtype))
        if self.metric == "inv":
            return x.pow(-2)
        return x.flip(-2).pow(2)

    @staticmethod
    def horizontal_rate(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Per-coordinate rate :math:`B = \tfrac12(\eta_u / u + \eta_v / v)` of the projection."""
        return 0.5 * (u / x).sum(-2)

    # ------------------------------------------------------------------ checks
    def _check_shape(
        self, shape: Tuple[int, ...], name: str
    ) -> Union[Tuple[bool, str | None], bool]:
        ok, reason = super()._check_shape(shape, name)
        if not ok:
            return False, reason
        if shape[-2] != 2:
            return (
                False,
                f"`{name}` must have shape (..., 2, d), got trailing shape {tuple(shape[-2:])}",
            )
        return True, None

    def _check_point_on_manifold(
        self, x: torch.Tensor, *, atol=1e-5, rtol=1e-5
    ) -> Union[Tuple[bool, str | None], bool]:
        if not torch.isfinite(x).all():
            return False, "point has non-finite entries"
        zeros = (x == 0).sum().item()
        if zeros:
            return False, (
                f"{zeros} zero entries in u or v: the diagonal quotient needs u_i != 0 and "
                "v_i != 0 for every coordinate"
            )
        return True, None

    def _check_vector_on_tangent(
        self, x: torch.Tensor, u: torch.Tensor, *, atol=1e-5, rtol=1e-5
    ) -> Union[Tuple[bool, str | None], bool]:
        # eta_u / u = eta_v / v  <=>  eta_u v = eta_v u
        left = u[..., 0, :] * x[..., 1, :]
        right = u[..., 1, :] * x[..., 0, :]
        if not torch.allclose(left, right, atol=atol, rtol=rtol):
            err = (left - right).abs().max().item()
            return False, f"`u` is not horizontal: max |eta_u v - eta_v u| = {err:.3g}"
        return True, None

    # ------------------------------------------------------------------ metric
    def inner(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None, *, keepdim=False
    ) -> torch.Tensor:
        v = u if v is None else v
        w = self._weights(x)
        value = (w * u.to(w.dtype) * v.to(w.dtype)).sum((-2, -1), keepdim=keepdim)
        return value.to(torch.promote_types(u.dtype, v.dtype))

    def component_inner(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One metric inner product per point, shape ``(..., 1, 1)``."""
        return self.inner(x, u, v, keepdim=True)

    def norm(self, x: torch.Tensor, u: torch.Tensor, *, keepdim=False) -> torch.Tensor:
        return self.inner(x, u, keepdim=keepdim).clamp_min(0).sqrt()

    # ------------------------------------------------------------------ projections
    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Horizontal projection :math:`(B u, B v)`, the same for both metrics."""
        return self.horizontal_rate(x, u).unsqueeze(-2) * x

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        """Every pair without zero entries is a point: returned unchanged."""
        return x

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""inv: :math:`(g_u u^2, g_v v^2)`; mix: :math:`(g_u / v^2, g_v / u^2)`; then projected."""
        return self.proju(x, (u.to(compute_dtype(u.dtype)) / self._weights(x)).to(u.dtype))

    # ------------------------------------------------------------------ geodesics
    def christoffel(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r""":math:`\Gamma_X(\xi,\xi)`: inv :math:`-\xi_u^2 / u`;
        mix :math:`(2\xi_u\xi_v v - u\xi_v^2) / v^2` (and :math:`u \leftrightarrow v`)."""
        if self.metric == "inv":
            return -u.pow(2) / x
        xf, uf = x.flip(-2), u.flip(-2)
        return (2 * u * uf * xf - x * uf.pow(2)) / xf.pow(2)

    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if self.retraction == "first_order":
            return x + u
        return x + u - 0.5 * self.christoffel(x, u)

    def expmap(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Exact geodesic at time 1 (closed form, any tangent vector)."""
        rates = u / x
        if self.metric == "inv":
            return x * torch.exp(rates)
        # w(t) = w0 (1 + t c), c = (B_u + B_v) + i (B_u - B_v)
        b_u, b_v = rates[..., 0, :], rates[..., 1, :]
        re, im = 1 + b_u + b_v, b_u - b_v
        # "horizontal" up to rounding: a vector from proju, or a multiple of one, has
        # b_u and b_v equal only to a few ulps, and the end point then depends on the
        # sign of that rounding error (arg(1 + c) jumps from -pi to pi).
        horizontal = im.abs() <= 16 * torch.finfo(rates.dtype).eps * (b_u.abs() + b_v.abs())
        if bool((horizontal & (re <= 0)).any()):
            raise GeodesicDomainError(
                "mix geodesic leaves the manifold: 1 + 2 B <= 0 for a horizontal rate B = "
                "eta_u / u; shorten the tangent vector (e.g. a smaller rho)"
            )
        half_log_mod = 0.25 * torch.log(re.pow(2) + im.pow(2))
        half_arg = 0.5 * torch.atan2(im, re)
        scale = torch.stack((half_log_mod + half_arg, half_log_mod - half_arg), dim=-2)
        return x * torch.exp(scale)

    # ------------------------------------------------------------------ sampling
    def random_tangent(
        self, x: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """A standard Gaussian horizontal vector in the metric."""
        noise = standard_normal(x, generator)
        return self.proju(x, (noise / self._weights(x).sqrt()).to(x.dtype))

    def random(self, *size, dtype=None, device=None, std: float = 1.0) -> ManifoldTensor:
        """Random point with i.i.d. Gaussian entries (no zero entry with probability one)."""
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        return ManifoldTensor(torch.randn(*shape, dtype=dtype, device=device) * std, manifold=self)

    random_normal = random

    def origin(self, *size, dtype=None, device=None, seed: int | None = 42) -> ManifoldTensor:
        """The point :math:`u = v = 1`."""
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        return ManifoldTensor(torch.ones(*shape, dtype=dtype, device=device), manifold=self)
