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
the start: with an orthonormal basis :math:`Q_F = A_F L_F^{-\top}` of the span of
:math:`A_F = [F_0, \xi_{F,0}]` (:math:`n \times 2h`; :math:`L_F` the Cholesky factor of
its Gram matrix, :math:`A_F^\top A_F = L_F L_F^\top`), :math:`[F, \xi_F] = Q_F M_F`
with :math:`M_F = [P, V]` (:math:`2h \times 2h`, :math:`L_F^\top` at the start), and
RK4's stages, linear combinations of states, keep that form:

.. math::

    f(M) = [V, -(V X + P Y)],

with the coefficients from :math:`F^\top F = P^\top P`, :math:`F^\top \xi_F = P^\top V`,
:math:`\xi_F^\top \xi_F = V^\top V` (:math:`Q_F^\top Q_F = I`): per stage and factor
:math:`10 h^3` multiply-adds in place of :math:`5 n h^2`, and the point's rows are read
once at the start (the Gram matrix, from :math:`F_0^\top F_0, F_0^\top \xi_{F,0},
\xi_{F,0}^\top \xi_{F,0}`) and once at the end (:math:`Q_F (M_F - L_F^\top) = A_F
L_F^{-\top} (M_F - L_F^\top) = F_0 C_1 + \xi_{F,0} C_2`, a triangular solve of
:math:`2h \times 2h` matrices and two products, added to the start); neither
:math:`Q_F` nor :math:`A_F` is formed. Both factors of a batch
of points are one batch of such matrices; the Cholesky factorisations and the solves
are one batched call each, as are the coefficients' (batched triangular solves where
blocks are capped: on a GPU a batched QR of many rows or a batched ``cholesky_inverse``
runs one solver call per matrix).

A span of lower rank (:math:`\xi_F` of rank below :math:`h`, such as the gradient of a
batch of fewer tokens than the head dimension, or :math:`\xi_F = 0`) has a singular Gram
matrix. Its diagonal :math:`D` is raised, :math:`L L^\top = A^\top A + \tau D + \Pi`
with :math:`\tau = n \epsilon` and :math:`\Pi` a unit entry for each zero column of
:math:`A` (taken out of the start :math:`M_0 = L^\top - \Pi`). Then :math:`Q = A
L^{-\top}` has :math:`Q^\top Q = I - L^{-1} (\tau D + \Pi) L^{-\top}`, and since every
state is :math:`M_0 \Phi` (the flow multiplies from the right), the integration's Gram
matrices :math:`\Phi^\top M_0^\top M_0 \Phi` are the true ones plus :math:`\tau\,
\Phi^\top D \Phi`: a relative change of :math:`\tau` of their diagonals (at the start
exactly), below the rounding of the Gram matrix itself (up to :math:`n \epsilon`). The
end :math:`A L^{-\top} (M - M_0)` stays accurate however ill-conditioned :math:`L`:
:math:`\|A L^{-\top}\| \le 1`. Only a non-finite Gram matrix falls back to the thin QR
factorisation.

The discretisation is the reference's; the values are its own up to float rounding
(the order of sums), and the integration's checks (speed kept, every factorisation
positive definite) are the reference's, evaluated in the coordinates
(:meth:`SpanGeodesic.check`): the metric speed :math:`|\xi|_X^2 = \sum_F
\operatorname{tr}(W_F\, \xi_F^\top \xi_F)` needs only :math:`F^\top F = P^\top P` and
:math:`\xi_F^\top \xi_F = V^\top V`, so the end velocity is not mapped back to the rows.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from ._linalg import capped
from ._validation import check_speeds, integration_error

__all__ = ["SpanGeodesic", "applies", "exchanged", "geodesic"]


def applies(manifold, x: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether :func:`geodesic` integrates ``manifold``'s geodesic from ``x`` along ``u``:
    the manifold's geodesic is GL(h)'s (``span_geodesic`` of its
    :meth:`~geoopt_quotient.GLQuotient.batched_kernels`), a point in its own high
    precision (float64), contiguous tensors of one shape, dtype and device, nothing for
    autograd to record, and at least :math:`2h` rows in each factor (the span's
    orthonormal basis; the span's stages are then the cheaper)."""
    return (
        manifold.batched_kernels().span_geodesic
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
    r""":func:`geodesic` from ``x`` along ``u`` with the span's factorisation made once
    (at construction), integrated for any ``t`` and ``steps`` by calling it.

    The span's orthonormal coordinates come from the Cholesky factor of its Gram matrix
    (:func:`_cholesky_coordinates`, the module docstring); where that fails (non-finite
    entries), from the thin QR factorisation (Householder), the spans then replaced by
    their orthonormal frames."""

    def __init__(self, manifold, x: torch.Tensor, u: torch.Tensor):
        self.manifold, self.shape = manifold, x.shape
        rows, rank = x.shape[-2:]
        flat = (-1, rows, rank)
        self.x, self.u = x.reshape(flat), u.reshape(flat)
        count = self.x.shape[0]
        self.spans = factor_spans(manifold, self.x, self.u)
        grams = stacked_factors([span_gram(*span) for span in self.spans], count)
        self.lower = _cholesky_coordinates(grams, max(f.shape[-2] for f, _ in self.spans))
        #: the spans' orthonormal frames where the Cholesky factorisation fails
        self.frames: List[torch.Tensor] | None = None
        if self.lower is None:  # Householder: the spans' orthonormal frames
            factors = [torch.linalg.qr(torch.cat(span, -1)) for span in self.spans]
            self.frames = [frame for frame, _ in factors]
            self.start = stacked_factors([r.mT for _, r in factors], count)
        else:  # M_0^T = L - Pi
            self.start = self.lower.clone()
            self.start.diagonal(dim1=-2, dim2=-1).masked_fill_(
                grams.diagonal(dim1=-2, dim2=-1) == 0, 0.0
            )
        self._first: Tuple[torch.Tensor, torch.Tensor] | None = None  # Gamma^T at the start
        self._start_weights: torch.Tensor | None = None  # W_F at the start
        self._start_speeds: Tuple[torch.Tensor, List[torch.Tensor]] | None = None

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
        state, failures = self.integrate(t, steps)
        ends = self.ends(state, with_velocity)
        return ends[0], (ends[1] if with_velocity else None), failures

    def integrate(self, t: float, steps: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        r"""``(state, failures)``: the transposed state :math:`M^\top` ``(2 B, 2h, 2h)``
        at time ``t`` after ``steps`` RK4 steps (:func:`geodesic`), in the span's
        coordinates, and the ``info`` of every Cholesky factorisation on the way."""
        start, rank = self.start, self.x.shape[-1]
        state = start.clone()
        failures: List[torch.Tensor] = []
        gamma = _SpanChristoffel(self.manifold, rank, failures, state.device)
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
        return state, failures

    def ends(self, state: torch.Tensor, with_velocity: bool = False) -> List[torch.Tensor]:
        """The end point of the state of :meth:`integrate` in the point's coordinates
        (and its velocity with ``with_velocity``), new tensors of the point's shape."""
        kept = slice(None) if with_velocity else slice(0, self.x.shape[-1])  # P^T (and V^T)
        change = state[:, kept] - self.start[:, kept]  # small
        return self._moved(change)

    def squared_speeds(self, state: torch.Tensor, failures: List[torch.Tensor]) -> torch.Tensor:
        r"""The squared metric speed :math:`|\dot X|_X^2` of each point (batch shape
        ``(B,)``) at a state of :meth:`integrate` (or :attr:`start`), from its
        coordinates: with :math:`[F, \xi_F] = Q_F [P, V]` and :math:`Q_F^\top Q_F = I`
        (up to the raised diagonal, a relative :math:`n \epsilon`), :math:`F^\top F =
        P^\top P` and :math:`\xi_F^\top \xi_F = V^\top V`, so

        .. math::

            |\xi|_X^2 = \sum_F \operatorname{tr}(W_F\, V_F^\top V_F), \qquad
            W_G = S_G^{-1},\ W_H = S_H^{-1}\ \text{(inv)}, \quad
            W_G = S_H,\ W_H = S_G\ \text{(mix)},

        :math:`S_F = P_F^\top P_F + \varepsilon I`: :math:`8 h^3` multiply-adds per
        factor in place of the rows' :math:`n h^2`. The ``info`` of the inv metric's
        Cholesky factorisation of :math:`S_F` is appended to ``failures`` (a factor that
        lost rank), as :class:`~geoopt_quotient.GLQuotient`'s check of the integration
        does at the end point."""
        rank = self.x.shape[-1]
        velocity = state[:, rank:]
        b = torch.bmm(velocity, velocity.mT)  # V^T V
        squares = (self._weights(state, failures) * b).sum((-2, -1))  # tr(W B), symmetric
        return squares.view(-1, 2).sum(1)

    def _weights(self, state: torch.Tensor, failures: List[torch.Tensor]) -> torch.Tensor:
        r"""The metric's :math:`W_F` (:meth:`squared_speeds`) at a state, ``(2 B, h, h)``;
        the inv metric's Cholesky ``info`` appended to ``failures``."""
        rank = self.x.shape[-1]
        position = state[:, :rank]
        s = torch.bmm(position, position.mT)  # P^T P
        if self.manifold.eps:
            s.diagonal(dim1=-2, dim2=-1).add_(self.manifold.eps)
        if self.manifold.metric == "mix":
            return exchanged(s)
        chol, info = torch.linalg.cholesky_ex(s)
        failures.append(info)
        return torch.cholesky_inverse(chol)

    def end_point(
        self, steps: int, checked: bool = True
    ) -> Tuple[torch.Tensor, torch.Tensor | None]:
        r"""``(state, position)`` at time 1 after ``steps`` RK4 steps: the state of
        :meth:`integrate` and, with ``checked``, the end point, the integration checked
        as :class:`~geoopt_quotient.GLQuotient` checks its own (:meth:`check`); without,
        the position is ``None`` (:meth:`ends` makes it) and nothing is checked.

        Raises
        ------
        GeodesicDomainError
            Where the checked integration breaks down."""
        try:
            state, failures = self.integrate(1.0, steps)
            if not checked:
                return state, None
            (position,) = self.ends(state)
            self.check(state, failures, steps, position)
        except torch.linalg.LinAlgError as error:  # the CPU's inverse of a failed factor
            raise integration_error(steps) from error
        return state, position

    def check(
        self, state: torch.Tensor, failures: List[torch.Tensor], steps: int, position: torch.Tensor
    ) -> None:
        r"""The reference's check of an integration
        (:meth:`~geoopt_quotient.GLQuotient._check_integration`) from the coordinates: a
        finite end ``position`` and ``state``, each point's squared speed
        (:meth:`squared_speeds`) within 2% of its start's, and every Cholesky
        factorisation of ``failures`` and of the speeds positive definite
        (:func:`~geoopt_quotient.manifolds._validation.check_speeds`). Raises
        :class:`~geoopt_quotient.manifolds.GeodesicDomainError` otherwise."""
        start, start_failures = self.start_speeds()
        end = self.squared_speeds(state, failures)
        check_speeds(steps, start, end, [*start_failures, *failures], position, state)

    def start_speeds(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """:meth:`squared_speeds` at the start, :math:`|u|_x^2` of each point, and the
        ``info`` of its factorisations: computed on the first call only."""
        if self._start_speeds is None:
            failures: List[torch.Tensor] = []
            self._start_speeds = (self.squared_speeds(self.start, failures), failures)
        return self._start_speeds

    def squared_change(self, a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        r""":math:`|X_a - X_b|_w^2`, summed over the batch, of the end points of two states
        of :meth:`integrate` (:math:`X_b = 0` for ``b=None``: :math:`|x|_x^2` at
        :attr:`start`), in the metric at the start :math:`w` and from the
        coordinates: :math:`X_a - X_b = Q (P_a - P_b)` per factor, so
        :math:`|X_a - X_b|_w^2 = \sum_F \operatorname{tr}(W_F\, \Delta_F^\top \Delta_F)`
        with :math:`\Delta_F^\top \Delta_F = (P_a - P_b)^\top (P_a - P_b)` (up to the raised
        diagonal, a relative :math:`n \epsilon`) and :math:`W_F` as in
        :meth:`squared_speeds`, from :math:`S_F` at the start: a 0-dim tensor (not read
        from the device). Neither end point is formed."""
        rank = self.x.shape[-1]
        if self._start_weights is None:
            self._start_weights = self._weights(self.start, [])
        change = a[:, :rank] if b is None else a[:, :rank] - b[:, :rank]
        return (self._start_weights * torch.bmm(change, change.mT)).sum()

    def _moved(self, change: torch.Tensor) -> List[torch.Tensor]:
        r"""The end points ``[x + Q M_x, u + Q M_u]`` (as many as ``change`` has blocks of
        :math:`h` rows) of the transposed change :math:`(M - M_0)^\top` of the state."""
        count, rank = self.x.shape[0], self.x.shape[-1]
        coefficients = change.mT  # coordinates in the basis spans[f]
        if self.lower is not None:  # in [F_0, xi_F0]: L^-T (M - M_0)
            coefficients = torch.linalg.solve_triangular(self.lower.mT, coefficients, upper=True)
        if len(self.spans) == 2:
            coefficients = coefficients.view(count, 2, *coefficients.shape[1:])
        ends = []
        for index in range(change.shape[1] // rank):
            part = slice(index * rank, (index + 1) * rank)
            if len(self.spans) == 1:
                moved = self._moved_factor(0, coefficients[..., part], index)
            else:
                moved = torch.cat(
                    [self._moved_factor(f, coefficients[:, f, :, part], index) for f in (0, 1)],
                    -2,
                )
            ends.append(moved.view(self.shape))
        return ends

    def _moved_factor(self, f: int, coefficients: torch.Tensor, index: int) -> torch.Tensor:
        r""":math:`B + Q c` (a new tensor) for span ``f``, ``B`` its :math:`F_0` (``index``
        0) or :math:`\xi_{F,0}` (1): with the Cholesky coordinates :math:`Q c = F_0 c_1 +
        \xi_{F,0} c_2` (:math:`c = [c_1; c_2]`), two products of the span's halves, the
        span :math:`[F_0, \xi_{F,0}]` never formed; with the Householder frame, its
        product."""
        span = self.spans[f]
        if self.frames is not None:
            return torch.bmm(self.frames[f], coefficients).add_(span[index])
        rank = self.x.shape[-1]
        moved = torch.bmm(span[0], coefficients[:, :rank])  # Q c first: B + Q c rounds once
        return moved.baddbmm_(span[1], coefficients[:, rank:]).add_(span[index])


def factor_spans(
    manifold, x: torch.Tensor, u: torch.Tensor
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    r"""The halves :math:`(F_0, \xi_{F,0})` of the span :math:`[F_0, \xi_{F,0}]` of both
    factors of each point (views): one batch ``(2 B, n, h)`` each (the factors
    :math:`G, H` of each point in turn) where both have :math:`n` rows, else one pair
    ``(B, n_F, h)`` per factor."""
    count, rows, rank = x.shape
    if 2 * manifold.n == rows:
        return [(x.view(2 * count, -1, rank), u.view(2 * count, -1, rank))]
    return list(zip(manifold.factors(x), manifold.factors(u)))


def span_gram(f: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    r"""The Gram matrix of the span :math:`[F, \xi]`, :math:`\begin{pmatrix} F^\top F &
    F^\top \xi \\ \xi^\top F & \xi^\top \xi \end{pmatrix}`, from three products of
    its halves (the span is not formed)."""
    cross = torch.bmm(f.mT, v)
    top = torch.cat((torch.bmm(f.mT, f), cross), -1)
    return torch.cat((top, torch.cat((cross.mT, torch.bmm(v.mT, v)), -1)), -2)


def stacked_factors(matrices: List[torch.Tensor], count: int) -> torch.Tensor:
    """The ``(2 B, ...)`` batch of both factors' matrices (a list as :func:`factor_spans`)."""
    if len(matrices) == 1:
        return matrices[0]
    return torch.stack(matrices, 1).view(2 * count, *matrices[0].shape[1:])


def _cholesky_coordinates(grams: torch.Tensor, rows: int) -> torch.Tensor | None:
    r"""The transposed start :math:`M_0^\top = L` of the span's coordinates from the
    Cholesky factor of its Gram matrix :math:`G` with the diagonal raised
    (:class:`SpanGeodesic`): :math:`L L^\top = G + \tau D + \Pi`, :math:`D` the
    diagonal of :math:`G`, :math:`\tau = n \epsilon` (``rows`` :math:`= n`), :math:`\Pi`
    a unit diagonal entry for each zero column of the span, whose diagonal entry of
    :math:`L` is then taken out of the start. ``None`` where a factorisation fails all
    the same (non-finite entries): one host synchronisation. A factor with non-finite
    entries counts as failed too: the GPU's solvers can report success on a matrix
    with NaN entries."""
    diagonal = grams.diagonal(dim1=-2, dim2=-1)
    empty = diagonal == 0
    shift = torch.where(empty, 1.0, diagonal * (rows * torch.finfo(grams.dtype).eps))
    lower, info = torch.linalg.cholesky_ex(grams + torch.diag_embed(shift))
    if not bool((info == 0).all() & lower.isfinite().all()):
        return None
    return lower


class _SpanChristoffel:
    r""":math:`\Gamma^\top` of :func:`geodesic`'s transposed state in the orthonormal
    coordinates (a new tensor ``(2 B, h, 2h)``). Where blocks are
    :func:`~geoopt_quotient.manifolds._linalg.capped` (an accelerator), the coefficients'
    :math:`S^{-1}` as two batched triangular solves with the Cholesky factor: a batched
    ``cholesky_inverse`` loops over its matrices there (one solver call each). On the CPU
    the explicit inverse, the faster."""

    def __init__(self, manifold, rank: int, failures: List[torch.Tensor], device: torch.device):
        self.mix, self.eps, self.rank = manifold.metric == "mix", manifold.eps, rank
        self.failures, self.solves = failures, capped(device)

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
        coefficients = self._solved if self.solves else self._inverted
        return torch.bmm(coefficients(chol, k, b), w)  # Y^T P^T + X^T V^T

    def _inverted(self, chol: torch.Tensor, k: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        r"""The transposed coefficients :math:`[Y^\top, X^\top]` (inv :math:`X = -S^{-1}
        M`, :math:`Y = S^{-1} B`; mix :math:`X = M S^{-1}`, :math:`Y = -B S^{-1}`;
        :math:`M = K + K^\top`) from the explicit inverse."""
        inverses = torch.cholesky_inverse(chol)
        sym_k = k + k.mT
        if self.mix:
            x_t, y_t = torch.bmm(inverses, sym_k), torch.bmm(inverses, b).neg_()
        else:
            x_t, y_t = torch.bmm(sym_k, inverses).neg_(), torch.bmm(b, inverses)
        return torch.cat((y_t, x_t), -1)

    def _solved(self, chol: torch.Tensor, k: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """:meth:`_inverted` by triangular solves: :math:`S^{-1} [B, M]`, transposed
        for inv (:math:`B, M, S` symmetric)."""
        rank = self.rank
        solved = torch.cat((b, k), -1)
        solved[..., rank:].add_(k.mT)
        solved = torch.linalg.solve_triangular(chol, solved, upper=False)
        solved = torch.linalg.solve_triangular(chol.mT, solved, upper=True)
        if self.mix:  # [Y^T, X^T] = [-S^-1 B, S^-1 M]
            solved[..., :rank].neg_()
            return solved
        # inv: [Y^T, X^T] = [B S^-1, -M S^-1] = [(S^-1 B)^T, -(S^-1 M)^T]
        return torch.cat((solved[..., :rank].mT, solved[..., rank:].mT.neg()), -1)


def exchanged(t: torch.Tensor) -> torch.Tensor:
    """``(2 B, ...)`` matrices ``(G, H)`` of each point in the other order (a new
    tensor): the other factor's, as the mix metric reads them."""
    return t.view(-1, 2, *t.shape[1:]).flip(1).reshape(t.shape)
