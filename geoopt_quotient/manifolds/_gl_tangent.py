r"""The tangent space of :class:`~geoopt_quotient.GLQuotient` at a fixed point, with every
operation of a sharpness iteration a few batched products.

The reference formulas (:class:`~geoopt_quotient.GLQuotient`) apply the metric, the
Riemannian gradient, the second-order retraction and its pullback factor by factor.
Here everything that depends on the point only is combined once (:class:`_Kernel`), so
that each operation is linear algebra on the tangent vectors alone: one batched product
per factor, or one for both (:class:`_Split`), and the horizontal projection of the
Riemannian gradient from :math:`D = H^\top \nabla_H - \nabla_G^\top G` through the
point's :math:`h \times h` matrices (a :class:`ProjectionKernel`: GL(h)'s
:class:`SylvesterProjection`, or the one of the manifold's subgroup). The manifold says
which kernels compute its operations
(:meth:`~geoopt_quotient.GLQuotient.batched_kernels`, a :class:`BatchedKernels`).
Products with the point are shared across the operations of an Auto-PGD iteration
(:attr:`GLTangentSpace._crosses`).

The formulas, the products and passes of one iteration and why they are as they are:
the documentation's performance page (the batched GL(h) kernels). Results equal the
reference formulas up to float rounding (the order of sums); the tests compare both in
float64.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch

from .._checks import check_positive_int
from . import _gl_geodesic
from ._linalg import capped, safe_divide_eigensum
from ._validation import GeodesicDomainError
from .tangent import CachedTangentSpace

__all__ = [
    "BatchedKernels",
    "GLTangentSpace",
    "ProjectionKernel",
    "SylvesterProjection",
    "sylvester_projection",
]


class ProjectionKernel(Protocol):
    r"""The horizontal projection of the Riemannian gradient at one point as a batched
    kernel: :math:`T = \Omega^\top` of the shift :math:`(G\Omega, -H\Omega^\top)` along
    the orbit that makes the converted gradient :math:`\nabla_F K_F` horizontal, from
    :math:`D = H^\top \nabla_H - \nabla_G^\top G` of the Euclidean gradient
    :math:`\nabla` (``(B, h, h)``, the points flattened to one batch dimension)."""

    def transposed_omega(self, d: torch.Tensor) -> torch.Tensor:
        """:math:`T` of each point, ``(B, h, h)``, for ``d`` (any dtype; computed in the
        kernel's own)."""

    def part(self, start: int, stop: int) -> ProjectionKernel:
        """The kernel of the points ``start:stop``."""


class BatchedKernels(NamedTuple):
    """Which batched kernels compute a :class:`~geoopt_quotient.GLQuotient`'s operations
    at a fixed point (:meth:`~geoopt_quotient.GLQuotient.batched_kernels`).

    Parameters
    ----------
    projection : callable or None
        A function of the point's
        :class:`~geoopt_quotient.manifolds.gl_quotient.PointState` that builds the
        :class:`ProjectionKernel` of the horizontal projection there, or ``None``: the
        manifold's own projection (``_proju``) on the batched metric conversion.
    span_geodesic : bool
        Whether the geodesic is GL(h)'s (its Christoffel term and RK4 integrator), so that
        its integration in the span of its start
        (:mod:`~geoopt_quotient.manifolds._gl_geodesic`) applies.
    """

    projection: Optional[Callable[[Any], ProjectionKernel]]
    span_geodesic: bool


class _Kernel(NamedTuple):
    r"""The point's matrices, flattened to one batch dimension: ``x`` the point
    ``(B, n + m, h)``; the others ``(B, 2, h, h)`` (rows: the :math:`G` and :math:`H`
    factor)."""

    x: torch.Tensor
    metric: torch.Tensor  # W_F: <u, v> = sum_F tr(W_F u_F^T v_F)
    convert: torch.Tensor  # K_F: the Riemannian gradient before projection, grad_F K_F
    inverses: torch.Tensor  # S_F^{-1}
    swapped: torch.Tensor  # S_F'^{-1}, F' the other factor
    projection: Optional[ProjectionKernel]  # None: the manifold's own projection

    def part(self, start: int, stop: int) -> _Kernel:
        projection = None if self.projection is None else self.projection.part(start, stop)
        return _Kernel(*(t[start:stop] for t in self[:-1]), projection)


def _stack(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return torch.stack((first, second), dim=-3)


def _kernel(x: torch.Tensor, state, metric: str, projection: Optional[ProjectionKernel]) -> _Kernel:
    """The :class:`_Kernel` of the point ``x`` (in its working dtype), its
    :class:`~geoopt_quotient.manifolds.gl_quotient.PointState` and its ``metric``, with
    the kernel of its horizontal ``projection``."""
    rank = x.shape[-1]
    s_g, s_h = state.grams
    s_g_inv, s_h_inv = state.inverses
    inverses = _stack(s_g_inv, s_h_inv)
    swapped = _stack(s_h_inv, s_g_inv)
    if metric == "inv":
        metric_weights, convert = inverses, _stack(s_g, s_h)
    else:
        metric_weights, convert = _stack(s_h, s_g), swapped
    pairs = [t.reshape(-1, 2, rank, rank) for t in (metric_weights, convert, inverses, swapped)]
    return _Kernel(x.reshape(-1, *x.shape[-2:]), *pairs, projection)


class SylvesterProjection(NamedTuple):
    r"""GL(h)'s horizontal projection at a point as :math:`T = \Omega^\top = P_l\,[(L D
    R) \odot Q]\,P_r` (:func:`sylvester_projection`), the matrices flattened to one
    batch dimension, ``(B, h, h)``, in the projection's precision."""

    left: torch.Tensor  # L
    right: torch.Tensor  # R
    quotient: Optional[torch.Tensor]  # Q: elementwise factor (None: 1)
    outer_left: Optional[torch.Tensor]  # P_l (None: the identity)
    outer_right: Optional[torch.Tensor]  # P_r

    def part(self, start: int, stop: int) -> SylvesterProjection:
        """The matrices of the points ``start:stop``."""
        return SylvesterProjection(*(None if t is None else t[start:stop] for t in self))

    def transposed_omega(self, d: torch.Tensor) -> torch.Tensor:
        """:math:`T` of each point for ``d`` (:class:`ProjectionKernel`)."""
        t = torch.bmm(torch.bmm(self.left, d.to(self.left.dtype)), self.right)
        if self.quotient is not None:
            t = t * self.quotient
        if self.outer_left is not None:
            t = torch.bmm(torch.bmm(self.outer_left, t), self.outer_right)
        return t


def sylvester_projection(metric: str, eps: float, state) -> SylvesterProjection:
    r"""The :class:`SylvesterProjection` of GL(h)'s horizontal projection in ``metric``
    with relaxation ``eps`` at the point of ``state`` (its
    :class:`~geoopt_quotient.manifolds.gl_quotient.PointState`), with the right-hand side
    :math:`S_G D S_H` (inv) or :math:`S_G^{-1} D^\top S_H^{-1}` (mix) of the projection's
    equation factored through :math:`D` (the documentation's performance page):

    inv: :math:`Y = \Omega^\top` solves :math:`A Y + Y B = S_G D S_H` in the eigenbases
    :math:`A = P_a \Lambda P_a^{-1}`, :math:`B = P_b M P_b^{-1}`:
    :math:`L = P_a^{-1} S_G`, :math:`R = S_H P_b`, :math:`Q_{ij} = 1 / (\lambda_i +
    \mu_j)`, :math:`P_l = P_a`, :math:`P_r = P_b^{-1}`.
    mix, ``eps = 0``: :math:`\Omega = \tfrac12 S_G^{-1} D^\top S_H^{-1}`, so
    :math:`L = \tfrac12 S_H^{-1}`, :math:`R = S_G^{-1}`.
    mix, ``eps > 0``: :math:`\Omega = U_G [(U_G^\top \Delta U_H) \oslash (a_i + b_j)]
    U_H^\top` with :math:`\Delta = S_G^{-1} D^\top S_H^{-1}` and the eigenbases
    :math:`S_F = U_F \operatorname{diag}(\sigma_F) U_F^\top`,
    :math:`a = 1 - \varepsilon / \sigma_G`, :math:`b = 1 - \varepsilon / \sigma_H`; so
    :math:`L = U_H^\top S_H^{-1}`, :math:`R = S_G^{-1} U_G`, :math:`P_l = U_H`,
    :math:`P_r = U_G^\top`. Degenerate sums (relaxed, rank-deficient points) get
    :math:`Q = 0`, as in the reference.
    """
    rank = state.x.shape[-1]
    return SylvesterProjection(
        *(None if t is None else t.reshape(-1, rank, rank) for t in _sylvester(metric, eps, state))
    )


def _sylvester(metric: str, eps: float, state) -> Tuple[Optional[torch.Tensor], ...]:
    """``(L, R, Q, P_l, P_r)`` of :func:`sylvester_projection`, in the point's batch
    shape."""
    high = state.high
    if metric == "inv":
        s_g, s_h = state.grams_exact
        left, right = state.inv_sylvester_bases
        q = 1.0 / (left.values[..., :, None] + right.values[..., None, :])
        if eps:
            q = safe_divide_eigensum(torch.ones_like(q), left.values, right.values)
        return left.inverse @ s_g, s_h @ right.vectors, q, left.vectors, right.inverse
    s_g_inv, s_h_inv = state.inverses
    if not eps:
        return 0.5 * s_h_inv, s_g_inv, None, None, None
    sig, u_g = torch.linalg.eigh(state.grams_exact[0])
    tau, u_h = torch.linalg.eigh(state.grams_exact[1])
    a, b = (sig - eps) / sig, (tau - eps) / tau
    q = safe_divide_eigensum(torch.ones_like(u_g), b, a)
    left = u_h.mT @ s_h_inv.to(high)
    return left, s_g_inv.to(high) @ u_g, q, u_h, u_g.mT


#: At most this many blocks of rows per point for the one-call products of :class:`_Split`.
MAX_BLOCKS = 8
#: Bytes of the batch slice handled at once on the CPU (as the reference's fused
#: operations: the slice's temporaries stay in cache).
CHUNK_BYTES = 1 << 21


class GLTangentSpace(CachedTangentSpace):
    """:class:`~geoopt_quotient.manifolds.tangent.CachedTangentSpace` of a
    :class:`~geoopt_quotient.GLQuotient` whose hot operations (:meth:`gram`,
    :meth:`egrad2rgrad_`, :meth:`retr_vjp`) run the batched formulas of this module
    where they apply (contiguous tensors of the point's shape and working dtype, nothing
    for autograd to record), and the reference ones otherwise. The horizontal
    projection is the manifold's :class:`ProjectionKernel`
    (:meth:`~geoopt_quotient.GLQuotient.batched_kernels`), or, where it has none, its
    own ``_proju`` on the batched metric conversion."""

    own_buffer = True
    integrates_geodesic = True

    def __init__(self, manifold, x: torch.Tensor, state):
        super().__init__(manifold, x, state)
        self._kernels: BatchedKernels = manifold.batched_kernels()
        self._own_projection = self._kernels.projection is None
        self._split = _Split(manifold.n, manifold.m)
        self._kernel: _Kernel | None = None
        self._slices: dict = {}  # (start, stop) -> the kernel's slice, kept
        #: :math:`F^\top v_F` of both factors of vectors :math:`v`, ``(2 B, h, h)``: the
        #: gradients the pullback of :meth:`retr_vjp` writes, their Riemannian gradients,
        #: the vectors it retracts and Auto-PGD's combinations of these (:meth:`combination`),
        #: every one still valid: a restart from an earlier iterate finds its products as
        #: they were, so that its retraction is the same whether its gradient is recomputed
        self._crosses = _Derived(size=None)
        #: :math:`\langle v, v \rangle` of the vectors of the last Gram matrices, as
        #: ``(values, position)`` (the values private to this space)
        self._norms = _Derived()
        self._orders: dict = {}  # the index tensors of egrad2rgrad_gram_
        self._grams: torch.Tensor | None = None  # F^T F of both factors, kept
        #: A buffer of the largest slice's shape (:meth:`_parts`) for the kernels'
        #: slice-sized results before they are copied into their vector: made once per
        #: point, so that an iteration allocates nothing of the vectors' size
        self._work: torch.Tensor | None = None

    def _applies(self, *tensors: torch.Tensor) -> bool:
        """Whether the batched formulas apply: tensors of the point's shape and device,
        of a dtype computed in the working one, nothing for autograd to record
        (:meth:`~geoopt_quotient.GLQuotient._can_fuse` with ``converted``): those in
        another than the working dtype (a bfloat16 point's, or a sharpness ball's
        bfloat16 state) :meth:`_parts` converts a slice at a time, rounding the written
        ones back once."""
        return self.manifold._can_fuse(self.state, *tensors, converted=True)

    def _working(self, *tensors: torch.Tensor) -> bool:
        """Whether ``tensors`` are in the working dtype (no conversion)."""
        return all(t.dtype == self.state.dtype for t in tensors)

    def _whole(self) -> _Kernel:
        if self._kernel is None:
            build = self._kernels.projection
            projection = None if build is None else build(self.state)
            whole = _kernel(self.x, self.state, self.manifold.metric, projection)
            self._kernel = self._split.keep(whole)
        return self._kernel

    def _parts(self, *tensors: torch.Tensor, written: Tuple[int, ...] = ()):
        """``(kernel, tensors)`` a slice of the batch at a time (:data:`CHUNK_BYTES` on the
        CPU, one slice where blocks are capped and nothing is converted), the tensors
        viewed as ``(B, n + m, h)`` in the working dtype: those in another are copied into
        it slice by slice, and the slices of the tensors at the indices ``written`` copied
        back (rounded once) after the caller has written them."""
        kernel, dtype = self._whole(), self.state.dtype
        count, rows, rank = kernel.x.shape
        flats = [t if t.shape == kernel.x.shape else t.view(count, rows, rank) for t in tensors]
        budget = CHUNK_BYTES if self.x.device.type == "cpu" else 1 << 28
        per = max(1, budget // (rows * rank * dtype.itemsize))
        if per >= count or (capped(self.x.device) and self._working(kernel.x, *flats)):
            yield from _converted(kernel, flats, written, dtype)
            return
        for start in range(0, count, per):
            stop = min(start + per, count)
            part = self._slices.get((start, stop))
            if part is None:
                part = self._slices[start, stop] = self._split.keep(kernel.part(start, stop))
            yield from _converted(part, [f[start:stop] for f in flats], written, dtype)

    def _workspace(self, piece: torch.Tensor) -> torch.Tensor:
        """The buffer :attr:`_work` as a tensor like ``piece`` (a slice of :meth:`_parts`),
        made at the first call (the first slice is the largest)."""
        count = piece.shape[0]
        if self._work is None or self._work.shape[0] < count or self._work.dtype != piece.dtype:
            self._work = torch.empty_like(piece, memory_format=torch.contiguous_format)
        return self._work[:count]

    def _new_crosses(self) -> torch.Tensor:
        r"""An uninitialised ``(2 B, h, h)`` tensor for :math:`F^\top v_F` of a vector,
        which the slices' kernels write into (:func:`_rows`)."""
        x = self._whole().x
        return x.new_empty(2 * x.shape[0], x.shape[-1], x.shape[-1], dtype=self.state.dtype)

    # ------------------------------------------------------------------ metric
    def gram(self, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
        if not self._applies(*vectors):
            return super().gram(vectors)
        size, split = len(vectors), self._split
        total = torch.zeros(size, size, dtype=torch.float64, device=self.x.device)
        for kernel, pieces in self._parts(*vectors):
            per_vector = [split.factors(p) for p in pieces]
            for index, weight in enumerate(split.small(kernel.metric)):
                parts = [factors[index] for factors in per_vector]
                batch, rows, rank = parts[0].shape
                stacked = torch.stack(parts, dim=1).view(batch, size * rows, rank)
                weighted = torch.bmm(stacked, weight).view(batch, size, -1)
                pairs = torch.bmm(weighted, stacked.view(batch, size, -1).mT)
                total += pairs.sum(0).double()
        return (total + total.mT) / 2

    # ------------------------------------------------------------------ gradient
    def egrad2rgrad_(self, u: torch.Tensor) -> torch.Tensor:
        if not self._applies(u) or (self._own_projection and not self._working(u)):
            return super().egrad2rgrad_(u)
        if self._own_projection:
            converted = self._split.times(u.view(self._whole().x.shape), self._whole().convert)
            return u.copy_(self.manifold._proju(self.state, converted.view(u.shape)))
        cross, start, crosses = self._crosses.get(u), 0, self._new_crosses()
        for kernel, (piece,) in self._parts(u, written=(0,)):
            stop = start + piece.shape[0]
            known, grams = _rows(cross, start, stop), _rows(self._point_grams(), start, stop)
            rgrad = self._workspace(piece)
            riemannian_gradient_batch(
                kernel, self._split, piece, known, grams, rgrad, _rows(crosses, start, stop)
            )
            piece.copy_(rgrad)
            start = stop
        if self._working(u):  # else its crosses are of the gradient before it is rounded
            self._crosses.put(u, crosses)
        return u

    def egrad2rgrad_gram_(
        self, vectors: Sequence[torch.Tensor], index: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r""":meth:`egrad2rgrad_` of ``vectors[index]`` and the :meth:`gram` of ``vectors``
        with the Riemannian gradient :math:`g` in its place; the other vectors must be
        horizontal (Auto-PGD's iterates are).

        The metric converts by the inverse of its own weights (:math:`K_F = W_F^{-1}`)
        and the horizontal projection is metric-orthogonal, so for a horizontal
        :math:`v` the row of :math:`g` is Euclidean: :math:`\langle g, v \rangle =
        \langle K\nabla, v \rangle = \langle \nabla, v \rangle_F`, and
        :math:`\langle g, g \rangle = \langle \nabla, g \rangle_F`. Only the
        other vectors' rows need the metric's products :math:`v_F W_F`, and a
        vector's own norm is kept from an earlier Gram matrix while it is unchanged
        (the previous iterate's, in Auto-PGD). Vectors in another dtype than the working
        one (a bfloat16 state) take the two steps instead, the matrix summed from the
        stored entries: the identities would hold for the gradient before its rounding."""
        if self._own_projection or not self._applies(*vectors) or not self._working(*vectors):
            return super().egrad2rgrad_gram_(vectors, index)
        grad = vectors[index]
        unique = _others(vectors, grad)
        kept = [self._norms.get(v) for v in unique]
        skip = max((i for i, k in enumerate(kept) if k is not None), default=-1)
        weighted = [i for i in range(len(unique)) if i != skip]
        # the entries computed, in this order: (i, j) for i weighted and every j, then
        # (gradient, j) for every j, then (gradient, gradient)
        pairs = [(i, j) for i in weighted for j in range(len(unique))]
        pairs += [(-1, j) for j in range(len(unique))] + [(-1, -1)]
        total = self._gradient_sweep(grad, unique, weighted)
        if skip >= 0:
            pairs.append((skip, skip))
            values, position = kept[skip]
            total = torch.cat((total, values[position : position + 1]))
        entry = {pair: n for n, pair in enumerate(pairs)}
        entry.update({(j, i): n for (i, j), n in entry.items() if (j, i) not in entry})
        for i in weighted:  # the diagonal is the same after the symmetrisation below
            self._norms.put(unique[i], (total, entry[i, i]))
        where = _positions(vectors, grad, unique, -1)
        gram = total[self._order([entry[i, j] for i in where for j in where])]
        gram = gram.view(len(vectors), -1)
        if len(weighted) > 1:  # both (i, j) and (j, i) computed
            gram = (gram + gram.mT) / 2
        return grad, gram

    def egrad2rgrad_column_(
        self, vectors: Sequence[torch.Tensor], index: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r""":meth:`egrad2rgrad_` of ``vectors[index]`` and its inner products with
        ``vectors`` (the column ``index`` of :meth:`egrad2rgrad_gram_`'s matrix, the same
        values); the other vectors must be horizontal.

        For horizontal :math:`v`, :math:`\langle g, v \rangle = \langle \nabla, v
        \rangle_F` and :math:`\langle g, g \rangle = \langle \nabla, g \rangle_F`
        (:meth:`egrad2rgrad_gram_`): the column takes no product with the metric's
        weights, only the Riemannian gradient's two and a Euclidean dot per vector."""
        if self._own_projection or not self._applies(*vectors) or not self._working(*vectors):
            return super().egrad2rgrad_column_(vectors, index)
        grad = vectors[index]
        unique = _others(vectors, grad)
        dots = self._gradient_sweep(grad, unique, [])  # (gradient, j) for each j, (g, g)
        return grad, dots[self._order(_positions(vectors, grad, unique, len(unique)))]

    def _gradient_sweep(
        self, grad: torch.Tensor, unique: Sequence[torch.Tensor], weighted: Sequence[int]
    ) -> torch.Tensor:
        r"""Writes the Riemannian gradient :math:`g` of ``grad`` (the Euclidean
        :math:`\nabla`) into it and returns, in float64 and in this order, the inner
        products :math:`\langle v_i, v_j \rangle` of ``unique`` for ``i`` in
        ``weighted`` and every ``j`` (by the metric's products :math:`v_F W_F`), then
        :math:`\langle \nabla, v_j \rangle_F` for every ``j`` and :math:`\langle
        \nabla, g \rangle_F`: one pass over the vectors a slice of the batch at a
        time, the slices' sums added in float64."""
        cross, start, total = self._crosses.get(grad), 0, None
        crosses = self._new_crosses()
        for kernel, pieces in self._parts(grad, *unique, written=(0,)):
            stop = start + pieces[0].shape[0]
            known, grams = _rows(cross, start, stop), _rows(self._point_grams(), start, stop)
            flats = [p.view(-1) for p in pieces[1:]]
            euclidean, work = pieces[0].view(-1), self._workspace(pieces[0])
            dots = []
            for i in weighted:  # the products are read before the gradient reuses the buffer
                products = self._split.times(pieces[i + 1], kernel.metric, out=work).view(-1)
                dots += [torch.dot(products, f) for f in flats]
            dots += [torch.dot(euclidean, f) for f in flats]
            rgrad = riemannian_gradient_batch(
                kernel, self._split, pieces[0], known, grams, work, _rows(crosses, start, stop)
            )
            dots.append(torch.dot(euclidean, rgrad.view(-1)))
            pieces[0].copy_(rgrad)
            part = torch.stack(dots).double()
            total = part if total is None else total + part
            start = stop
        self._crosses.put(grad, crosses)
        return total

    def _order(self, order: List[int]) -> torch.Tensor:
        """``order`` as an index tensor on the point's device, kept."""
        key = tuple(order)
        if key not in self._orders:
            self._orders[key] = torch.tensor(order, device=self.x.device)
        return self._orders[key]

    # ------------------------------------------------------------------ geodesic
    def expmap(self, u: torch.Tensor) -> torch.Tensor:
        """The reference's exponential map (RK4 on the geodesic equation), integrated in
        the span of the geodesic's start (:mod:`~geoopt_quotient.manifolds._gl_geodesic`)
        where that applies; the reference's checks of the integration either way."""
        return self._expmap(self.span_geodesic(u), u, self.manifold.expmap_steps)

    def expmaps(self, u: torch.Tensor) -> Callable[..., torch.Tensor | None]:
        """``ends(steps, checked=True)``: :meth:`expmap` of ``u`` with ``steps`` RK4 steps,
        for as many step counts as asked, the span's factorisation and first stage
        shared; ``None`` where an integration breaks down (where :meth:`expmap` raises).
        ``checked=False`` skips the check of the end point's speed (and the velocity it
        needs) where the span's integration applies: for a coarse end point that is only
        compared with a finer one."""
        span = self.span_geodesic(u)

        def ends(steps: int, checked: bool = True) -> torch.Tensor | None:
            try:
                return self._expmap(span, u, check_positive_int(steps, "steps"), checked)
            except GeodesicDomainError:
                return None

        return ends

    def span_geodesic(self, u: torch.Tensor) -> _gl_geodesic.SpanGeodesic | None:
        """The geodesic from the point along ``u`` integrated in the span of its start
        (:class:`~geoopt_quotient.manifolds._gl_geodesic.SpanGeodesic`, factorised once
        for any number of integrations), or ``None`` where that does not apply
        (:func:`~geoopt_quotient.manifolds._gl_geodesic.applies`)."""
        if not _gl_geodesic.applies(self.manifold, self.x, u):
            return None
        return _gl_geodesic.SpanGeodesic(self.manifold, self.x, u)

    def _expmap(self, span, u: torch.Tensor, steps: int, checked: bool = True) -> torch.Tensor:
        if span is None:
            return self.manifold.expmap(self.x, u, steps=steps)
        state, pos = span.end_point(steps, checked)
        return span.ends(state)[0] if pos is None else pos

    # ------------------------------------------------------------------ retraction
    def retr(self, u: torch.Tensor) -> torch.Tensor:
        r"""The second-order retraction :math:`F + \xi_F E_F - \tfrac12 F Y_F`
        (:func:`retract_batch`) into a new tensor, a slice of the batch at a time, where the
        batched formulas apply (the path gap's retraction): the same point as
        :meth:`retr_vjp`'s, without the reference's temporaries of the vectors' size;
        the reference otherwise."""
        if self.manifold.retraction == "first_order" or not self._applies(u):
            return super().retr(u)
        out = torch.empty_like(u)
        self._retract_slices(u, out, self._crosses.get(u))
        return out

    def _retract_slices(
        self, u: torch.Tensor, out: torch.Tensor, cross: torch.Tensor | None
    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        r"""The second-order retraction written into ``out`` a slice of the batch at a
        time (``cross``: :math:`F^\top u_F` where known); each slice's ``(E, K)``
        (:func:`retract_batch`), for the pullback."""
        mix = self.manifold.metric == "mix"
        start, saved = 0, []
        for kernel, (u_, o_) in self._parts(u, out, written=(1,)):
            stop = start + u_.shape[0]
            saved.append(retract_batch(kernel, self._split, u_, o_, mix, _rows(cross, start, stop)))
            start = stop
        return saved

    def known_zero(self, u: torch.Tensor) -> None:
        r""":math:`F^\top u_F = 0` of the zero vector ``u``, kept as :meth:`retr_vjp`
        keeps a retracted vector's (:attr:`_crosses`), so that the combinations made
        from it know theirs (:meth:`combination`)."""
        if self._applies(u):
            self._crosses.put(u, self._new_crosses().zero_())

    def retraction_corrections(self, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor] | None:
        r"""Per point, :math:`|c|^2` and :math:`|u|^2` in the metric, flat, where
        :math:`c = x + u - R_x(u)` is the correction of the second-order retraction
        (:meth:`retr`): from the retraction's coefficients (:func:`_coefficients`),
        :math:`c_F = u_F (I - E_F) + \tfrac12 F Y_F`, a slice of the batch at a time.
        No retracted point is made, and :math:`c` carries no rounding of :math:`x + u`
        against it (:math:`\epsilon |x|`, a floor under :math:`|c|`). Its norm is read
        from :math:`c` itself, not from the expansion of :math:`c_F^\top c_F` in the
        :math:`h \times h` matrices: where :math:`u_F (I - E_F)` and :math:`F Y_F` nearly
        cancel (an ill-conditioned factor), that expansion loses the square of what the
        sum loses. ``None`` where the batched formulas do not apply."""
        if self.manifold.retraction == "first_order" or not self._applies(u):
            return None
        mix, split = self.manifold.metric == "mix", self._split
        corrections, squares = [], []
        for kernel, (piece,) in self._parts(u):
            k, b = split.inner(kernel.x, piece), split.inner(piece, piece)
            other = _gl_geodesic.exchanged(b) if mix else b
            e, y, _ = _coefficients(kernel, split, piece, mix, k, other)
            c = split.times(piece, split.eye(e) - e, out=self._workspace(piece))
            split.add_times_(c, kernel.x, y, -0.5 if mix else 0.5)  # mix: y = -Y
            weights = split.flat(kernel.metric)
            for out, products in ((corrections, split.inner(c, c)), (squares, b)):
                out.append((weights * products).sum((-2, -1)).view(-1, 2).sum(1))
        return torch.cat(corrections), torch.cat(squares)

    def retr_vjp(
        self, u: torch.Tensor, out: torch.Tensor
    ) -> Tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
        manifold, split = self.manifold, self._split
        if manifold.retraction == "first_order" or not self._applies(u, out):
            return super().retr_vjp(u, out)
        mix = manifold.metric == "mix"
        cross = self._crosses.get(u)
        saved = self._retract_slices(u, out, cross)
        if cross is None:
            self._crosses.put(u, _joined([k for _, k in saved]))
        grams = self._point_grams()

        def pullback(c: torch.Tensor) -> torch.Tensor:
            if not self._applies(c):
                raise ValueError("the cotangent must be a contiguous tensor like the point")
            crosses, start = self._new_crosses(), 0
            for (kernel, (u_, c_)), (e, k) in zip(self._parts(u, c, written=(1,)), saved):
                stop = start + u_.shape[0]
                s, out = _rows(grams, start, stop), _rows(crosses, start, stop)
                pull_back_(kernel, split, u_, c_, e, k, s, mix, self._workspace(u_), out)
                start = stop
            if self._working(c):  # else of the cotangent before it is rounded
                self._crosses.put(c, crosses)
            return c

        return out, pullback

    def combination(
        self, vectors: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
    ) -> Callable[[torch.Tensor], None] | None:
        r""":math:`F^\top v_F` is linear in :math:`v`: where it is known for each of
        ``vectors``, that of the combination :math:`\sum_i w_i v_i` is the combination
        of theirs (``h x h`` matrices), kept for the tensor it is written into, so that
        its retraction (Auto-PGD's next iterate) takes no product with the point
        (:func:`_coefficients`). Summed in :func:`~geoopt_quotient.sharpness.apgd.combine_`'s
        order; equal to the product of the written tensor up to rounding (its entries'
        and this sum's)."""
        known = [self._crosses.get(v) for v in vectors]
        if len(vectors) != 3 or any(k is None for k in known):
            return None
        derived = torch.mul(known[2], weights[2])
        derived.addcmul_(known[0], weights[0]).addcmul_(known[1], weights[1])
        return functools.partial(self._crosses.put, value=derived)

    def _point_grams(self) -> torch.Tensor:
        r""":math:`F^\top F` of both factors of each point (unrelaxed), ``(2 B, h, h)``
        in the working dtype, kept."""
        if self._grams is None:
            pair = _stack(*self.state.grams_unrelaxed).to(self.state.dtype)
            self._grams = pair.reshape(-1, *pair.shape[-2:])
        return self._grams


def _converted(
    kernel: _Kernel, tensors: List[torch.Tensor], written: Tuple[int, ...], dtype: torch.dtype
):
    """Yield ``(kernel, tensors)`` with the kernel's point and the tensors in ``dtype``
    (copies where they are not), then copy the copies at the indices ``written`` back
    into theirs."""
    if kernel.x.dtype != dtype:
        kernel = kernel._replace(x=kernel.x.to(dtype))
    pieces = [t if t.dtype == dtype else t.to(dtype) for t in tensors]
    yield kernel, pieces
    for index in written:
        if pieces[index] is not tensors[index]:
            tensors[index].copy_(pieces[index])


def _others(vectors: Sequence[torch.Tensor], grad: torch.Tensor) -> List[torch.Tensor]:
    """The ``vectors`` other than ``grad``, each object once, in their order."""
    unique: List[torch.Tensor] = []
    for v in vectors:
        if v is not grad and all(v is not w for w in unique):
            unique.append(v)
    return unique


def _positions(
    vectors: Sequence[torch.Tensor],
    grad: torch.Tensor,
    unique: Sequence[torch.Tensor],
    grad_position: int,
) -> List[int]:
    """Where each of ``vectors`` stands: its index in ``unique`` (:func:`_others`), or
    ``grad_position`` for ``grad``."""
    return [
        grad_position if v is grad else next(i for i, w in enumerate(unique) if w is v)
        for v in vectors
    ]


def _joined(parts: List[torch.Tensor]) -> torch.Tensor:
    """The slices' ``(2 B, h, h)`` matrices as the whole batch's."""
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _rows(pairs: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """The ``(2 B, h, h)`` matrices of the points ``start:stop`` (all: no slicing)."""
    if pairs is None or (start == 0 and 2 * stop == pairs.shape[0]):
        return pairs
    return pairs[2 * start : 2 * stop]


class _Derived:
    """Values derived from tensors, each kept while its tensor is the same object and
    unchanged (its version counter, shared with its views, as it was), held by weak
    references, so that nothing here keeps a vector alive: the ``size`` latest, or
    (``None``) every one still valid."""

    def __init__(self, size: int | None = 4):
        self.size = size
        self._entries: list = []  # (weak reference, version, value)

    def get(self, tensor: torch.Tensor):
        for ref, version, value in self._entries:
            if ref() is tensor and tensor._version == version:
                return value
        return None

    def put(self, tensor: torch.Tensor, value) -> None:
        self._entries = [e for e in self._entries if _valid(e) and e[0]() is not tensor]
        self._entries.append((weakref.ref(tensor), tensor._version, value))
        if self.size is not None:
            del self._entries[: -self.size]


def _valid(entry) -> bool:
    """Whether the tensor of a :class:`_Derived` entry is alive and unchanged."""
    tensor = entry[0]()
    return tensor is not None and tensor._version == entry[1]


class _Split:
    r"""Per-factor products of tensors ``(B, n + m, h)`` with ``h x h`` matrices of each
    factor, ``(B, 2, h, h)``. Where both factors are made of a few blocks of
    :math:`b = \gcd(n, m)` rows (at most :data:`MAX_BLOCKS` in all: ``n == m``, or
    Llama's ``m = 2n`` of grouped-query attention), a tensor is one batch of ``b x h``
    blocks and each product one batched call, the matrices repeated per block;
    otherwise one call per factor."""

    def __init__(self, n: int, m: int):
        self.n, self.m = n, m
        rows = math.gcd(n, m)
        self.counts = (n // rows, m // rows)
        self.rows = rows if sum(self.counts) <= MAX_BLOCKS else 0
        self._index: dict = {}  # device, (points, device) -> the block indices, kept
        self._kept: dict = {}  # id -> (tensor, its operands): the kernel's, made once
        self._eyes: dict = {}  # (size, dtype, device) -> the identity
        self._flats: dict = {}  # id -> (tensor, its flat view): the kernel's, made once

    def keep(self, kernel: _Kernel) -> _Kernel:
        """Make the operands of ``kernel``'s tensors once (views cost a dispatch each);
        each tensor is kept with them, so that its id stays its own. Returns ``kernel``."""
        self._kept[id(kernel.x)] = (kernel.x, self._factors(kernel.x))
        for t in (kernel.metric, kernel.convert):
            self._kept[id(t)] = (t, self._small(t))
        for t in (kernel.inverses, kernel.swapped, kernel.convert):
            self._flats[id(t)] = (t, t.view(-1, *t.shape[-2:]))
        return kernel

    def flat(self, s: torch.Tensor) -> torch.Tensor:
        """``s`` (``(B, 2, h, h)``) as ``(2 B, h, h)``."""
        entry = self._flats.get(id(s))
        return entry[1] if entry is not None and entry[0] is s else s.view(-1, *s.shape[-2:])

    def eye(self, like: torch.Tensor) -> torch.Tensor:
        """The identity of ``like``'s size, dtype and device, kept."""
        key = (like.shape[-1], like.dtype, like.device)
        if key not in self._eyes:
            self._eyes[key] = torch.eye(key[0], dtype=key[1], device=key[2])
        return self._eyes[key]

    def _lookup(self, t: torch.Tensor):
        entry = self._kept.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else None

    def factors(self, t: torch.Tensor) -> List[torch.Tensor]:
        """``t`` (``(B, n + m, h)``) as the operands of one batched product per factor, or
        one for both."""
        return self._lookup(t) or self._factors(t)

    def small(self, s: torch.Tensor) -> List[torch.Tensor]:
        """``s`` (``(B, 2, h, h)``, or flattened ``(2 B, h, h)``) as the matching operands
        of :meth:`factors`."""
        return self._lookup(s) or self._small(s)

    def _factors(self, t: torch.Tensor) -> List[torch.Tensor]:
        if self.rows:
            return [t.view(-1, self.rows, t.shape[-1])]
        return list(t.split((self.n, self.m), dim=1))

    def _small(self, s: torch.Tensor) -> List[torch.Tensor]:
        rank = s.shape[-1]
        if not self.rows:
            pairs = s if s.dim() == 4 else s.view(-1, 2, rank, rank)
            return [pairs[:, 0], pairs[:, 1]]
        flat = s if s.dim() == 3 else s.view(-1, rank, rank)
        if self.counts == (1, 1):
            return [flat]
        return [flat.index_select(0, self._block_index(flat.shape[0] // 2, flat.device))]

    def _block_index(self, count: int, device, swapped: bool = False) -> torch.Tensor:
        """For ``count`` points, which of the flattened ``(2 count, h, h)`` matrices each
        block of rows belongs to (:math:`2b` for :math:`G`, :math:`2b + 1` for :math:`H`;
        exchanged if ``swapped``), kept per size and device."""
        key = (count, device, swapped)
        index = self._index.get(key)
        if index is None:
            which = self._factor_of_block(device)
            points = 2 * torch.arange(count, device=device)[:, None]
            index = self._index[key] = (points + (1 - which if swapped else which)).view(-1)
        return index

    def _factor_of_block(self, device) -> torch.Tensor:
        """Which factor (0: G, 1: H) each block of rows belongs to, kept per device."""
        index = self._index.get(device)
        if index is None:
            which = [0] * self.counts[0] + [1] * self.counts[1]
            index = self._index[device] = torch.tensor(which, device=device)
        return index

    def inner(self, a: torch.Tensor, b: torch.Tensor, swapped: bool = False) -> torch.Tensor:
        r""":math:`a_F^\top b_F` for both factors, ``(2 B, h, h)`` (:math:`G`, :math:`H` of
        each point; a sum over the blocks of a factor); the factors in the other order
        (:math:`H` first) if ``swapped``."""
        products = [torch.bmm(p.mT, q) for p, q in zip(self.factors(a), self.factors(b))]
        rank = products[0].shape[-1]
        if not self.rows:
            pairs = torch.stack(products[::-1] if swapped else products, dim=1)
            return pairs.view(-1, rank, rank)
        if self.counts == (1, 1):
            if not swapped:
                return products[0]
            return products[0].view(-1, 2, rank, rank).flip(1).view(-1, rank, rank)
        blocks = products[0]
        count = blocks.shape[0] // sum(self.counts)
        if max(self.counts) <= 2:
            # each factor's blocks summed in one call: 0 + a + b, exact in any order
            index = self._block_index(count, blocks.device, swapped)
            return blocks.new_zeros(2 * count, rank, rank).index_add_(0, index, blocks)
        blocks = blocks.view(count, -1, rank, rank)
        first = self.counts[0]
        sums = [blocks[:, :first].sum(1), blocks[:, first:].sum(1)]
        return torch.stack(sums[::-1] if swapped else sums, dim=1).view(-1, rank, rank)

    def times(
        self,
        big: torch.Tensor,
        s: torch.Tensor,
        transposed: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``big_F s_F`` (``s_F^T`` if ``transposed``) for both factors, written into
        ``out`` (contiguous, like ``big``), or a new tensor."""
        smalls = [w.mT if transposed else w for w in self.small(s)]
        if out is not None:
            for o, p, w in zip(self.factors(out), self.factors(big), smalls):
                torch.bmm(p, w, out=o)
            return out
        parts = [torch.bmm(p, w) for p, w in zip(self.factors(big), smalls)]
        return parts[0].view(big.shape) if self.rows else torch.cat(parts, dim=1)

    def add_times_(self, out: torch.Tensor, big: torch.Tensor, s: torch.Tensor, alpha: float):
        """``out_F += alpha big_F s_F`` for both factors."""
        for o, p, w in zip(self.factors(out), self.factors(big), self.small(s)):
            o.baddbmm_(p, w, alpha=alpha)

    def sum_into(self, out: torch.Tensor, base: torch.Tensor, big: torch.Tensor, s: torch.Tensor):
        """``out_F = base_F + big_F s_F`` for both factors."""
        for o, b, p, w in zip(
            self.factors(out), self.factors(base), self.factors(big), self.small(s)
        ):
            torch.baddbmm(b, p, w, out=o)


def riemannian_gradient_batch(
    kernel: _Kernel,
    split: _Split,
    grad: torch.Tensor,
    cross: torch.Tensor | None,
    grams: torch.Tensor,
    out: torch.Tensor,
    out_cross: torch.Tensor,
) -> torch.Tensor:
    r""":math:`g_F = \nabla_F K_F + F\,O_F` with :math:`O = [T^\top; -T]`, :math:`T`
    the kernel's projection of :math:`D = H^\top\nabla_H - \nabla_G^\top G`
    (:class:`ProjectionKernel`), written into ``out`` (like ``grad``, returned), and its
    :math:`F^\top g_F = (F^\top \nabla_F) K_F + F^\top F\,O_F` from ``h x h`` products
    alone, into ``out_cross``; ``cross``: :math:`F^\top \nabla_F` where known
    (:func:`pull_back_`), ``grams``: :math:`F^\top F`, all three ``(2 B, h, h)``."""
    if cross is None:
        cross = split.inner(kernel.x, grad)  # (G^T grad_G, H^T grad_H) of each point
    d = cross[1::2] - cross[0::2].mT
    t = kernel.projection.transposed_omega(d)  # rotary: B(grad_F K_F) = D^T
    t = t.to(grad.dtype)
    o = torch.stack((t.mT, -t), dim=1)
    split.times(grad, kernel.convert, out=out)
    split.add_times_(out, kernel.x, o, 1.0)
    rank = t.shape[-1]
    torch.bmm(cross, split.flat(kernel.convert), out=out_cross)
    out_cross.baddbmm_(grams, o.view(-1, rank, rank))
    return out


def _coefficients(
    kernel: _Kernel,
    split: _Split,
    u: torch.Tensor,
    mix: bool,
    k: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
):
    r"""``(E, Y', K)``, ``(2 B, h, h)`` (:math:`G`, :math:`H` of each point), of the
    retraction :math:`R_X(\xi)_F = F + \xi_F E_F - \tfrac12 F Y_F`, :math:`E_F = I -
    \tfrac12 X_F` (the Christoffel coefficients of the reference: :math:`M_F =
    \xi_F^\top F + F^\top \xi_F`, :math:`B_F = \xi_F^\top \xi_F`; inv: :math:`X_F =
    -S_F^{-1} M_F`, :math:`Y_F = S_F^{-1} B_F`; mix: :math:`X_G = M_H S_H^{-1}`,
    :math:`Y_G = -B_H S_H^{-1}` and the same with the factors exchanged); :math:`K_F =
    F^\top \xi_F`, computed unless given, as :math:`B` (mix: the other factor's) is.
    ``Y'`` is :math:`Y` up to its sign (mix: :math:`-Y`), which the retraction's product
    carries in its ``alpha`` (:func:`retract_batch`), as the pullback does: the mix
    metric's iteration then makes no operation beyond the inv metric's but the exchanges
    of the factors' :math:`h \times h` matrices."""
    if k is None:
        k = split.inner(kernel.x, u)
    swapped = _gl_geodesic.exchanged(k) if mix else k  # mix: the other factor's
    m = swapped + swapped.mT
    b = split.inner(u, u, swapped=mix) if b is None else b
    eye = split.eye(u)
    if mix:
        swapped = split.flat(kernel.swapped)
        e = torch.baddbmm(eye, m, swapped, alpha=-0.5)
        y = torch.bmm(b, swapped)  # -Y: retract_batch carries the sign
    else:
        inverses = split.flat(kernel.inverses)
        e, y = torch.baddbmm(eye, inverses, m, alpha=0.5), torch.bmm(inverses, b)
    return e, y, k


def retract_batch(
    kernel: _Kernel,
    split: _Split,
    u: torch.Tensor,
    out: torch.Tensor,
    mix: bool,
    k: torch.Tensor | None = None,
):
    """The retraction written into ``out``; returns ``(E, K)`` (:func:`_coefficients`,
    ``K`` computed unless given) for the pullback."""
    e, y, k = _coefficients(kernel, split, u, mix, k)
    split.sum_into(out, kernel.x, u, e)
    # -1/2 F Y_F from Y' = -Y for mix (negating a product's operand negates it exactly)
    split.add_times_(out, kernel.x, y, 0.5 if mix else -0.5)
    return e, k


def pull_back_(
    kernel: _Kernel,
    split: _Split,
    u: torch.Tensor,
    c: torch.Tensor,
    e: torch.Tensor,
    k: torch.Tensor,
    grams: torch.Tensor,
    mix: bool,
    work: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    r""":math:`(D_\xi R_X)^\top c`, written into ``c`` (by way of ``work``, a buffer
    like ``c``, or a new tensor): with :math:`\bar X_F = \xi_F^\top
    c_F`, :math:`\bar Y_F = F^\top c_F` and the cotangents inv: :math:`\bar M_F =
    -S_F^{-1} \bar X_F`, :math:`\bar B_F = S_F^{-1} \bar Y_F`; mix: :math:`\bar M_H = \bar
    X_G S_H^{-1}`, :math:`\bar B_H = -\bar Y_G S_H^{-1}` (and exchanged),

    .. math::

        c_F E_F^\top - \tfrac12 F (\bar M_F + \bar M_F^\top)
        - \tfrac12 \xi_F (\bar B_F + \bar B_F^\top).

    The signs of :math:`\bar M, \bar B` are carried by the products' ``alpha``.

    Returns :math:`F^\top` of the result (written into ``out`` if given), which the
    Riemannian gradient reads next
    (:func:`riemannian_gradient_batch`), from :math:`h \times h` products alone: with
    ``k`` :math:`= F^\top \xi_F` (:func:`_coefficients`) and
    ``grams`` :math:`= F^\top F`, it is :math:`\bar Y_F E_F^\top - \tfrac12 F^\top F
    (\bar M_F + \bar M_F^\top) - \tfrac12 F^\top \xi_F (\bar B_F + \bar B_F^\top)`.
    """
    x_bar, y = split.inner(u, c, swapped=mix), split.inner(kernel.x, c)
    y_bar = _gl_geodesic.exchanged(y) if mix else y
    inverses = split.flat(kernel.inverses)
    if mix:
        m_bar, b_bar = torch.bmm(x_bar, inverses), torch.bmm(y_bar, inverses)
        m_alpha, b_alpha = -0.5, 0.5
    else:
        m_bar, b_bar = torch.bmm(inverses, x_bar), torch.bmm(inverses, y_bar)
        m_alpha, b_alpha = 0.5, -0.5
    m_sym, b_sym = m_bar + m_bar.mT, b_bar + b_bar.mT
    result = split.times(c, e, transposed=True, out=work)
    split.add_times_(result, kernel.x, m_sym, m_alpha)
    split.add_times_(result, u, b_sym, b_alpha)
    c.copy_(result)
    cross = torch.bmm(y, e.mT, out=out) if out is not None else torch.bmm(y, e.mT)
    cross.baddbmm_(grams, m_sym, alpha=m_alpha)
    return cross.baddbmm_(k, b_sym, alpha=b_alpha)
