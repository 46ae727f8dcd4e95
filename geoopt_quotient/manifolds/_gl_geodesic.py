r"""The exponential map of :class:`~geoopt_quotient.GLQuotient` at a fixed point,
integrated in the span of its start: a few products of :math:`2h \times 2h` matrices per
Runge-Kutta stage, whatever the number of rows.

The reference (:meth:`~geoopt_quotient.GLQuotient.geodesic`) integrates
:math:`\ddot X = -\Gamma_X(\dot X, \dot X)` with classical RK4 on the point itself: per
stage, per factor, a Gram matrix, a Cholesky factor and an inverse, and the Christoffel
term :math:`\Gamma_F = \xi_F X_F + F Y_F` (:math:`h \times h` coefficients
:math:`X_F, Y_F` of the Gram matrices :math:`F^\top F, F^\top \xi_F, \xi_F^\top \xi_F`,
:meth:`~geoopt_quotient.GLQuotient._christoffel_coefficients`): five products of
:math:`n h^2` multiply-adds per factor and stage, and every stage's input a new tensor.

Both :math:`\dot F = \xi_F` and :math:`\dot \xi_F = -\xi_F X_F - F Y_F` multiply
:math:`[F, \xi_F]` from the right, so position and velocity stay in the column span of
the start: with the thin QR factorisation :math:`[F_0, \xi_{F,0}] = Q_F R_F`
(:math:`Q_F` of orthonormal columns, :math:`n \times 2h`), :math:`[F, \xi_F] = Q_F M_F`
with :math:`M_F = [P, V]` (:math:`2h \times 2h`, :math:`R_F` at the start), and RK4's
stages, linear combinations of states, keep that form:

.. math::

    f(M) = [V, -(V X + P Y)],

with the coefficients from :math:`F^\top F = P^\top P`, :math:`F^\top \xi_F = P^\top V`,
:math:`\xi_F^\top \xi_F = V^\top V` (:math:`Q_F^\top Q_F = I`): per stage and factor
:math:`10 h^3` multiply-adds in place of :math:`5 n h^2`, and the point's rows are read
once at the start (the QR factorisation) and once at the end (:math:`Q_F (M_F - R_F)`
added to the start). Both factors of a batch of points are one batch of such matrices;
the Cholesky factorisations and inverses are one batched call each.

The discretisation is the reference's; the values are its own up to float rounding
(the order of sums), and the integration's checks (speed kept, every factorisation
positive definite) are the reference's.
"""

from __future__ import annotations

from typing import List, Tuple

import torch


def applies(manifold, x: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether :func:`geodesic` integrates ``manifold``'s geodesic from ``x`` along ``u``:
    the reference's Christoffel term and integrator (no subclass of its own), a point in
    its own high precision (float64), contiguous tensors of one shape, dtype and device,
    nothing for autograd to record, and at least :math:`2h` rows in each factor (the
    span's orthonormal basis; the span's stages are then the cheaper)."""
    from .gl_quotient import GLQuotient

    cls = type(manifold)
    return (
        cls.geodesic is GLQuotient.geodesic
        and cls._christoffel is GLQuotient._christoffel
        and cls._christoffel_coefficients is GLQuotient._christoffel_coefficients
        and x.dtype == torch.float64
        and x.dim() >= 2
        and min(manifold.n, manifold.m) >= 2 * x.shape[-1]
        and u.shape == x.shape
        and u.dtype == x.dtype
        and u.device == x.device
        and x.is_contiguous()
        and u.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or u.requires_grad))
    )


def geodesic(
    manifold, x: torch.Tensor, u: torch.Tensor, t: float, steps: int
) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    r"""``(position, velocity, failures)`` at time ``t`` of the geodesic from ``x`` along
    ``u`` (where :func:`applies`), ``steps`` classical RK4 steps as the reference's,

    .. math::

        k_1 = f(M),\ k_2 = f(M + \tfrac{h}{2} k_1),\ k_3 = f(M + \tfrac{h}{2} k_2),\
        k_4 = f(M + h k_3), \qquad M \mathrel{+}= \tfrac{h}{6}(k_1 + 2 k_2 + 2 k_3 + k_4),

    in the span's orthonormal coordinates (module docstring); ``failures`` holds the
    ``info`` of every Cholesky factorisation on the way, for the reference's check.

    The state is kept transposed, ``(2 B, 2h, 2h)`` (the factors :math:`G, H` of each
    point): rows :math:`P^\top` then :math:`V^\top`, so that each half of :math:`f` is
    a block of whole rows.
    """
    return SpanGeodesic(manifold, x, u)(t, steps)


class SpanGeodesic:
    """:func:`geodesic` from ``x`` along ``u`` with the span's factorisation made once
    (at construction), integrated for any ``t`` and ``steps`` by calling it."""

    def __init__(self, manifold, x: torch.Tensor, u: torch.Tensor):
        self.manifold, self.shape = manifold, x.shape
        rows, rank = x.shape[-2:]
        flat = (-1, rows, rank)
        self.x, self.u = x.reshape(flat), u.reshape(flat)
        count, width = self.x.shape[0], 2 * rank
        frames, start = [], x.new_empty(count, 2, width, width)
        for index, (x_f, u_f) in enumerate(zip(manifold.factors(self.x), manifold.factors(self.u))):
            frame, coordinates = torch.linalg.qr(torch.cat((x_f, u_f), -1))
            frames.append(frame)
            start[:, index] = coordinates.mT
        self.frames, self.start = frames, start.view(2 * count, width, width)
        self._first: Tuple[torch.Tensor, torch.Tensor] | None = None  # Gamma^T at the start

    def _first_stage(self, gamma: _SpanChristoffel, failures: List[torch.Tensor]):
        r""":math:`\Gamma^\top` at the start (a new tensor), computed on the first call
        only: every integration's first stage."""
        if self._first is None:
            terms = gamma(self.start)
            self._first = (terms.clone(), failures[-1])
            return terms
        failures.append(self._first[1])
        return self._first[0].clone()

    def __call__(
        self, t: float, steps: int, with_velocity: bool = True
    ) -> Tuple[torch.Tensor, torch.Tensor | None, List[torch.Tensor]]:
        """``(position, velocity, failures)`` as :func:`geodesic`'s; the velocity
        ``None`` unless asked for."""
        start, rank = self.start, self.x.shape[-1]
        count, width = self.x.shape[0], 2 * rank
        state = start.clone()
        failures: List[torch.Tensor] = []
        gamma = _SpanChristoffel(self.manifold, rank, failures)
        stage, spare = torch.empty_like(state), torch.empty_like(state)
        dt = t / steps
        for step in range(steps):
            terms = self._first_stage(gamma, failures) if step == 0 else gamma(state)
            velocity = state[:, rank:]
            sum_p, sum_g = velocity.clone(), terms  # k1 = (V, -Gamma)
            for weight, factor in ((0.5 * dt, 2), (0.5 * dt, 2), (dt, 1)):
                torch.add(state[:, :rank], velocity, alpha=weight, out=stage[:, :rank])
                torch.add(state[:, rank:], terms, alpha=-weight, out=stage[:, rank:])
                velocity, terms = stage[:, rank:], gamma(stage)
                sum_p.add_(velocity, alpha=factor)
                sum_g.add_(terms, alpha=factor)
                stage, spare = spare, stage
            state[:, :rank].add_(sum_p, alpha=dt / 6)
            state[:, rank:].add_(sum_g, alpha=-dt / 6)
        change = (state - start).view(count, 2, width, width)  # from (x, u): small
        ends = []
        for base, part in ((self.x, slice(0, rank)), (self.u, slice(rank, None))):
            moved = [torch.bmm(frame, change[:, f, part].mT) for f, frame in enumerate(self.frames)]
            ends.append(torch.cat(moved, -2).add_(base).view(self.shape))
            if not with_velocity:
                return ends[0], None, failures
        return ends[0], ends[1], failures


class _SpanChristoffel:
    r""":math:`\Gamma^\top` of :func:`geodesic`'s transposed state in the orthonormal
    coordinates (a new tensor ``(2 B, h, 2h)``)."""

    def __init__(self, manifold, rank: int, failures: List[torch.Tensor]):
        self.mix, self.eps, self.rank = manifold.metric == "mix", manifold.eps, rank
        self.failures = failures

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        rank = self.rank
        top = torch.bmm(w[:, :rank], w.mT)  # P^T M = [F^T F, F^T xi]
        b = torch.bmm(w[:, rank:], w[:, rank:].mT)  # V^T V = xi^T xi
        if self.mix:  # each factor's coefficients from the other factor's blocks
            top, b = exchanged(top), exchanged(b)
        s, k = top[..., :rank], top[..., rank:]
        if self.eps:
            s = s + self.eps * torch.eye(rank, dtype=s.dtype, device=s.device)
        chol, info = torch.linalg.cholesky_ex(s)
        self.failures.append(info)
        inverses = torch.cholesky_inverse(chol)
        sym_k = k + k.mT
        # transposed coefficients: inv X = -S^-1 M, Y = S^-1 B; mix X = M S^-1, Y = -B S^-1
        if self.mix:
            x_t, y_t = torch.bmm(inverses, sym_k), torch.bmm(inverses, b).neg_()
        else:
            x_t, y_t = torch.bmm(sym_k, inverses).neg_(), torch.bmm(b, inverses)
        return torch.bmm(torch.cat((y_t, x_t), -1), w)  # Y^T P^T + X^T V^T


def exchanged(t: torch.Tensor) -> torch.Tensor:
    """``(2 B, ...)`` matrices ``(G, H)`` of each point in the other order (a new
    tensor): the other factor's, as the mix metric reads them."""
    return t.view(-1, 2, *t.shape[1:]).flip(1).reshape(t.shape)
