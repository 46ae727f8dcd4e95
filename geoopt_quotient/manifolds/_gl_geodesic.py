r"""The exponential map of :class:`~geoopt_quotient.GLQuotient` at a fixed point, as a
few batched products and in-place updates per Runge-Kutta stage.

The reference (:meth:`~geoopt_quotient.GLQuotient.geodesic`) integrates
:math:`\ddot X = -\Gamma_X(\dot X, \dot X)` with classical RK4: per stage a new
:class:`~geoopt_quotient.manifolds.gl_quotient.PointState` (a Cholesky factor and an
inverse per factor), the Christoffel term factor by factor, and every stage's input and
the steps' sums as new tensors. Here, for points in their own high precision (float64:
the path gap's, :mod:`~geoopt_quotient.sharpness.path_gap`), the same discretisation runs
on the batch of both factors at once: with the factors' products of
:class:`~geoopt_quotient.manifolds._gl_tangent._Split` (one batched product for both
where the factors have equal rows),

- the Gram matrices :math:`S_F = F^\top F + \varepsilon I`, one batched Cholesky
  factorisation and one batched inverse for both factors (for ``mix`` in exchanged
  order, each factor's slot holding the other's, as its coefficients need);
- :math:`M_F = K_F + K_F^\top` with :math:`K_F = F^\top \xi_F`, :math:`B_F = \xi_F^\top
  \xi_F` and :math:`\Gamma_F = \xi_F X_F + F Y_F`, with inv: :math:`X_F = -S_F^{-1}
  M_F`, :math:`Y_F = S_F^{-1} B_F`; mix: :math:`X_G = M_H S_H^{-1}`, :math:`Y_G = -B_H
  S_H^{-1}` and the same with the factors exchanged (the reference's
  :meth:`~geoopt_quotient.GLQuotient._christoffel_coefficients`);
- the stage inputs :math:`X + c\,h\,k` and the step's weighted sums written into
  buffers kept over the integration (one operation each).

The values are the reference's up to the order of float rounding; the integration's
checks (speed kept, every factorisation positive definite) are the reference's.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from ._gl_tangent import _Split


def applies(manifold, x: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether :func:`geodesic` integrates ``manifold``'s geodesic from ``x`` along ``u``:
    the reference's Christoffel term and integrator (no subclass of its own), a point in
    its own high precision (float64), contiguous tensors of one shape, dtype and device,
    and nothing for autograd to record."""
    from .gl_quotient import GLQuotient

    cls = type(manifold)
    return (
        cls.geodesic is GLQuotient.geodesic
        and cls._christoffel is GLQuotient._christoffel
        and cls._christoffel_coefficients is GLQuotient._christoffel_coefficients
        and x.dtype == torch.float64
        and x.dim() >= 2
        and u.shape == x.shape
        and u.dtype == x.dtype
        and u.device == x.device
        and x.is_contiguous()
        and u.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or u.requires_grad))
    )


class _Christoffel:
    r""":math:`\Gamma_X(\xi, \xi)` of a batch of points ``(B, n + m, h)``, both factors at
    once; the Cholesky factorisations' ``info`` kept in ``failures``."""

    def __init__(self, manifold, split: _Split, failures: List[torch.Tensor]):
        self.mix = manifold.metric == "mix"
        self.eps = manifold.eps
        self.split = split
        self.failures = failures

    def inverses(self, p: torch.Tensor) -> torch.Tensor:
        r""":math:`S_F^{-1}` of each factor (``(2 B, h, h)``; for mix the other factor's)."""
        s = self.split.inner(p, p, swapped=self.mix)
        if self.eps:
            s.diagonal(dim1=-2, dim2=-1).add_(self.eps)
        chol, info = torch.linalg.cholesky_ex(s)
        self.failures.append(info)
        return torch.cholesky_inverse(chol)

    def into(self, out: torch.Tensor, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r""":math:`\Gamma_p(v, v)` written into ``out`` (not ``p`` or ``v``); returns it."""
        split, mix = self.split, self.mix
        inverses = self.inverses(p)
        k = split.inner(p, v, swapped=mix)
        m, b = k + k.mT, split.inner(v, v, swapped=mix)
        if mix:
            x_coef, y_coef = torch.bmm(m, inverses), torch.bmm(b, inverses).neg_()
        else:
            x_coef, y_coef = torch.bmm(inverses, m).neg_(), torch.bmm(inverses, b)
        for o, f, w in zip(split.factors(out), split.factors(v), split.small(x_coef)):
            torch.bmm(f, w, out=o)
        split.add_times_(out, p, y_coef, 1.0)
        return out


def geodesic(
    manifold, x: torch.Tensor, u: torch.Tensor, t: float, steps: int
) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    r"""``(position, velocity, failures)`` at time ``t`` of the geodesic from ``x`` along
    ``u`` (:func:`applies`), ``steps`` classical RK4 steps as the reference's:

    .. math::

        k_1 = f(X, V),\ k_2 = f(X + \tfrac{h}{2} k_1^X, V + \tfrac{h}{2} k_1^V),\ \dots,
        \quad X \mathrel{+}= \tfrac{h}{6}(k_1 + 2 k_2 + 2 k_3 + k_4)

    with :math:`f(X, V) = (V, -\Gamma_X(V, V))`. ``failures`` holds the ``info`` of every
    Cholesky factorisation on the way, for the reference's check."""
    shape = x.shape
    rows, rank = shape[-2:]
    flat = (-1, rows, rank)
    split = _Split(manifold.n, manifold.m)
    failures: List[torch.Tensor] = []
    gamma = _Christoffel(manifold, split, failures)
    pos = x.reshape(flat).clone()
    vel = u.reshape(flat).clone()
    stage_p, stage_v = torch.empty_like(pos), torch.empty_like(pos)
    next_p, next_v = torch.empty_like(pos), torch.empty_like(pos)
    sum_v, term = torch.empty_like(pos), torch.empty_like(pos)
    sum_p = torch.empty_like(pos)
    dt = t / steps
    for _ in range(steps):
        # stage 1 at (pos, vel): k1 = (vel, -gamma_1)
        gamma.into(sum_v, pos, vel)
        torch.add(pos, vel, alpha=0.5 * dt, out=stage_p)
        torch.add(vel, sum_v, alpha=-0.5 * dt, out=stage_v)
        # stages 2 and 3: k = (stage_v, -gamma); the next stage from pos and vel
        for weight in (0.5 * dt, dt):
            gamma.into(term, stage_p, stage_v)
            sum_v.add_(term, alpha=2)
            if weight == 0.5 * dt:
                torch.add(vel, stage_v, alpha=2, out=sum_p)
            else:
                sum_p.add_(stage_v, alpha=2)
            torch.add(pos, stage_v, alpha=weight, out=next_p)
            torch.add(vel, term, alpha=-weight, out=next_v)
            stage_p, next_p, stage_v, next_v = next_p, stage_p, next_v, stage_v
        # stage 4
        gamma.into(term, stage_p, stage_v)
        sum_v.add_(term)
        sum_p.add_(stage_v)
        pos.add_(sum_p, alpha=dt / 6)
        vel.add_(sum_v, alpha=-dt / 6)
    return pos.view(shape), vel.view(shape), failures
