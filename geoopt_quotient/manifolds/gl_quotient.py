"""The quotient of full-rank matrix pairs by GL(h)."""

from __future__ import annotations

import copy
import functools
from typing import Callable, Iterator, List, Sequence, Tuple, Union

import torch
from geoopt.tensor import ManifoldTensor
from geoopt.utils import size2shape

from .._checks import (
    METRICS,
    RETRACTIONS,
    check_choice,
    check_nonnegative_float,
    check_positive_int,
)
from ._gl_tangent import BatchedKernels, GLTangentSpace, sylvester_projection
from ._linalg import (
    Eigenbasis,
    add_product,
    capped,
    compute_dtype,
    eigenbasis_spd_product,
    gram,
    solve_sylvester_eigenbases,
    solve_sylvester_shifted,
    sym,
)
from ._random import standard_normal
from ._validation import check_speeds, integration_error, is_finite, rank_report
from .base import QuotientManifold
from .groups import general_linear

__all__ = ["GLQuotient", "PointState"]


#: Bytes of the slice of a batch of points that the fused operations of a sharpness
#: loop (:meth:`GLQuotient._retr_vjp`, :meth:`GLQuotient._egrad2rgrad_`,
#: :meth:`GLQuotient._gram`) handle at once on the CPU: the slice's temporaries stay in
#: cache.
CHUNK_BYTES = 1 << 21
#: The same on an accelerator, where each slice costs kernel launches, not cache misses.
DEVICE_CHUNK_BYTES = 1 << 28
#: At most this many slices per call where blocks are capped (``_linalg.capped``: on an
#: accelerator), whatever the batch's size: each slice costs some hundred kernel launches,
#: and an Auto-PGD iteration's should not grow with the model's depth (the symmetry groups
#: stack all layers into one batch). Larger batches get larger slices.
MAX_SLICES = 1


#: The methods of :class:`GLQuotient` whose formulas its batched kernels compute
#: (:meth:`GLQuotient.batched_kernels`): the horizontal projection and the geodesic.
KERNEL_FORMULAS = ("_proju", "geodesic", "_christoffel", "_christoffel_coefficients")


class PointState:
    """What the geometry at one point needs, each piece computed once, on first use.

    The public methods of :class:`GLQuotient` build one per call; its
    :meth:`~GLQuotient.tangent_space` keeps one for repeated use at a fixed point (the
    base point of a sharpness ball), so Gram matrices, Cholesky factors and inverses are
    not recomputed. Everything is in :func:`compute_dtype` (float32 at least).
    """

    def __init__(
        self, manifold: GLQuotient, x: torch.Tensor, failures: List[torch.Tensor] | None = None
    ):
        self.eps = manifold.eps
        self.x = x
        self.failures = failures
        self.dtype = compute_dtype(x.dtype)
        #: The manifold's :meth:`~GLQuotient.factors`: a tensor like the point split
        #: into its :math:`G` and :math:`H` rows (views)
        self.factors_of = manifold.factors

    @functools.cached_property
    def working_x(self) -> torch.Tensor:
        """The point in :attr:`dtype`: ``x`` itself, or, for a low-precision point, a
        copy made on first use (the batched kernels convert it a slice at a time instead,
        so that a sharpness ball at a bfloat16 model holds no float32 copy of it)."""
        return self.x.to(self.dtype)

    @functools.cached_property
    def g(self) -> torch.Tensor:
        """:math:`G` in :attr:`dtype` (a view of :attr:`working_x`)."""
        return self.factors_of(self.working_x)[0]

    @functools.cached_property
    def h(self) -> torch.Tensor:
        """:math:`H` in :attr:`dtype` (a view of :attr:`working_x`)."""
        return self.factors_of(self.working_x)[1]

    def batch_slice(self, start: int, stop: int) -> PointState:
        """This state for the points ``start:stop`` of its flattened batch: every piece
        computed so far sliced, none recomputed (a single point is a batch of one). Kept:
        the next call for the same slice returns the same state."""
        kept = self.__dict__.setdefault("_batch_slices", {})
        part = kept.get((start, stop))
        if part is None:
            part = object.__new__(PointState)
            dims = self.x.dim() - 2
            part.__dict__.update(
                {
                    k: _batch_slice(v, dims, start, stop)
                    for k, v in self.__dict__.items()
                    if k != "_batch_slices"
                }
            )
            kept[(start, stop)] = part
        return part

    @functools.cached_property
    def high(self) -> torch.dtype:
        """The dtype of the Gram matrices and their factorisations: float64 for float32
        (and lower) inputs, because the Gram matrix squares the condition number."""
        return torch.float64 if self.dtype == torch.float32 else self.dtype

    @functools.cached_property
    def grams_unrelaxed(self) -> Tuple[torch.Tensor, torch.Tensor]:
        r""":math:`G^\top G, H^\top H` in :attr:`high` precision."""
        g, h = self.factors_of(self.x)  # converted by gram, a few matrices at a time
        return gram(g, dtype=self.high), gram(h, dtype=self.high)

    @functools.cached_property
    def grams_exact(self) -> Tuple[torch.Tensor, torch.Tensor]:
        r""":math:`S_G, S_H` in :attr:`high` precision (float64 for float32 inputs)."""
        if not self.eps:
            return self.grams_unrelaxed
        eye = torch.eye(self.x.shape[-1], dtype=self.high, device=self.x.device)
        return tuple(s + self.eps * eye for s in self.grams_unrelaxed)

    @functools.cached_property
    def grams(self) -> Tuple[torch.Tensor, torch.Tensor]:
        r""":math:`S_G, S_H` in the working dtype."""
        return tuple(s.to(self.dtype) for s in self.grams_exact)

    def _cholesky(self, s: torch.Tensor) -> torch.Tensor:
        """Cholesky factor of a Gram matrix. A failure raises at once (a host read), or,
        with a ``failures`` list, is recorded in it for one check later (none here)."""
        if self.failures is None:
            return torch.linalg.cholesky(s)
        chol, info = torch.linalg.cholesky_ex(s)
        self.failures.append(info)
        return chol

    @functools.cached_property
    def cholesky(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return tuple(self._cholesky(s).to(self.dtype) for s in self.grams_exact)

    @functools.cached_property
    def inverses(self) -> Tuple[torch.Tensor, torch.Tensor]:
        r""":math:`S_G^{-1}, S_H^{-1}`: one small inverse, then a batched matmul per use is
        much faster than a triangular solve with an :math:`n \times h` right-hand side."""
        exact = (self._cholesky(s) for s in self.grams_exact)
        return tuple(torch.cholesky_inverse(c).to(self.dtype) for c in exact)

    @functools.cached_property
    def inv_sylvester_bases(self) -> Tuple[Eigenbasis, Eigenbasis]:
        r"""Eigenbases of the coefficients of the inv-metric projection equation
        :math:`(S_G H^\top H)\, Y + Y\, (G^\top G S_H) = R`, in :attr:`high` precision.

        The left one is that of :math:`S_G \cdot H^\top H`, the right one the transpose
        of that of :math:`S_H \cdot G^\top G`; for ``eps = 0`` both coefficients are
        :math:`S_G S_H` and one eigendecomposition serves both sides.
        """
        (s_g, s_h), (gtg, hth) = self.grams_exact, self.grams_unrelaxed
        left = eigenbasis_spd_product(s_g, hth)
        if not self.eps:
            return left, left
        return left, eigenbasis_spd_product(s_h, gtg).transpose()


def _eye_like(a: torch.Tensor) -> torch.Tensor:
    """The identity of ``a``'s trailing size, dtype and device."""
    return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)


def _batch_slice(value, dims: int, start: int, stop: int):
    """``value`` (a tensor with ``dims`` batch dimensions, or tuples of them; anything
    else is returned as is) with the batch flattened and sliced."""
    if isinstance(value, torch.Tensor):
        flat = value.flatten(0, dims - 1) if dims else value.unsqueeze(0)
        return flat[start:stop]
    if isinstance(value, tuple):
        parts = [_batch_slice(v, dims, start, stop) for v in value]
        return type(value)(*parts) if hasattr(value, "_fields") else tuple(parts)
    return value


class GLQuotient(QuotientManifold):
    r"""Pairs of full-rank matrices modulo :math:`\mathrm{GL}(h)`.

    A point is a pair :math:`G \in \mathbb{R}^{n \times h}`,
    :math:`H \in \mathbb{R}^{m \times h}` of full column rank, stored as one tensor
    :math:`X = [G; H]` of shape ``(..., n + m, h)`` (rows ``:n`` are :math:`G`).
    The group acts by

    .. math::

        (G, H) \mapsto (G A^{-1}, H A^\top), \qquad A \in \mathrm{GL}(h),

    leaving :math:`G H^\top` invariant, e.g. the query/key or value/output weights of
    one attention head. With :math:`S_G = G^\top G + \varepsilon I` and
    :math:`S_H = H^\top H + \varepsilon I` the two GL-invariant metrics are

    .. math::

        \text{inv:}\quad \langle \eta, \zeta \rangle
            = \operatorname{tr}(S_G^{-1} \eta_G^\top \zeta_G)
            + \operatorname{tr}(S_H^{-1} \eta_H^\top \zeta_H), \qquad
        \text{mix:}\quad \langle \eta, \zeta \rangle
            = \operatorname{tr}(S_H \eta_G^\top \zeta_G)
            + \operatorname{tr}(S_G \eta_H^\top \zeta_H).

    The vertical space is :math:`\{(-G\Omega, H\Omega^\top)\}`; tangent vectors of the
    quotient are represented by their horizontal lifts (metric-orthogonal to it).

    Parameters
    ----------
    n, m : int
        Number of rows of :math:`G` and of :math:`H`; the rank :math:`h` is the
        trailing dimension of the tensors and must satisfy :math:`h \le \min(n, m)`.
    metric : {"mix", "inv"}
        The GL-invariant metric (default ``"mix"``).
    eps : float
        Relaxation :math:`\varepsilon \ge 0` added to both Gram matrices.
        ``eps=0`` (default) is the exact geometry and needs full-rank factors.
    retraction : {"second_order", "first_order"}
        :meth:`retr` is :math:`X + \xi - \tfrac12 \Gamma_X(\xi, \xi)` (default) or the
        straight line :math:`X + \xi`.
    expmap_steps : int
        Default number of RK4 steps used by :meth:`expmap` to integrate the geodesic
        equation :math:`\ddot X + \Gamma_X(\dot X, \dot X) = 0` on :math:`[0, 1]`.

    Notes
    -----
    The inv-metric horizontal projection solves the Sylvester equation
    :math:`\Omega^\top A + A \Omega^\top = S_G H^\top \eta_H - \eta_G^\top G S_H`,
    :math:`A = S_G S_H`, batched with one Cholesky and one ``eigh``. Half-precision
    inputs get their :math:`h \times h` algebra in float32. See also Manopt's
    ``fixedrankfactory_2factors`` (inv) and ``..._preconditioned`` (mix).

    References
    ----------
    da Silva, Dangel & Oore (2025), "Hide & Seek: Transformer Symmetries Obscure
    Sharpness & Riemannian Geometry Finds It", ICML :cite:`dasilva2025hide`; quotient
    manifolds: Absil, Mahony & Sepulchre (2008) :cite:`absil2008optimization` and Boumal
    (2023) :cite:`boumal2023introduction`; Geoopt: Kochurov, Karimov & Kozlukov (2020)
    :cite:`kochurov2020geoopt`.

    Examples
    --------
    Two representatives of one point, and a horizontal vector moved along with them:
    the product :math:`G H^\top` and the metric do not tell them apart.

    >>> import torch
    >>> from geoopt_quotient import GLQuotient
    >>> _ = torch.manual_seed(0)
    >>> manifold = GLQuotient(5, 4, metric="mix")
    >>> x = manifold.random(5 + 4, 2, dtype=torch.float64)
    >>> u = manifold.proju(x, torch.randn_like(x))
    >>> a = torch.tensor([[2.0, 1.0], [0.0, 0.5]], dtype=torch.float64)
    >>> y, v = manifold.act(x, a), manifold.act(u, a)
    >>> torch.allclose(manifold.product(x), manifold.product(y))
    True
    >>> torch.allclose(manifold.norm(x, u), manifold.norm(y, v))
    True
    >>> manifold.retr(x, 0.1 * u).shape
    torch.Size([9, 2])
    """

    name = "GLQuotient"
    ndim = 2
    reversible = False
    has_group = True
    acts_per_point = True

    def __init__(
        self,
        n: int,
        m: int,
        metric: str = "mix",
        eps: float = 0.0,
        *,
        retraction: str = "second_order",
        expmap_steps: int = 16,
    ):
        super().__init__()
        self.n = check_positive_int(n, "n")
        self.m = check_positive_int(m, "m")
        self.metric = check_choice(metric, METRICS, "metric")
        self.eps = check_nonnegative_float(eps, "eps")
        self.retraction = check_choice(retraction, RETRACTIONS, "retraction")
        self.expmap_steps = check_positive_int(expmap_steps, "expmap_steps")

    def extra_repr(self) -> str:
        return (
            f"n={self.n}, m={self.m}, metric={self.metric!r}, eps={self.eps}, "
            f"retraction={self.retraction!r}"
        )

    # ------------------------------------------------------------------ helpers
    def factors(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Split ``x`` (or a tangent vector) into its :math:`G` and :math:`H` blocks.

        ``split`` rather than slicing: its backward concatenates the two gradients,
        where slicing would zero-fill a full-size buffer per block.
        """
        g, h = x.split((self.n, x.shape[-2] - self.n), dim=-2)
        return g, h

    def from_factors(self, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Stack :math:`G` (``(..., n, h)``) and :math:`H` (``(..., m, h)``) into a point."""
        return torch.cat((g, h), dim=-2)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        r"""The invariant :math:`G H^\top`, shape ``(..., n, m)``."""
        g, h = self.factors(x)
        return g @ h.mT

    def act(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        r"""Group action :math:`(G, H) \mapsto (G A^{-1}, H A^\top)`; also maps tangent vectors."""
        g, h = self.factors(x)
        return torch.cat((torch.linalg.solve(a, g, left=False), h @ a.mT), dim=-2)

    def inverse_element(self, a: torch.Tensor) -> torch.Tensor:
        r""":math:`A^{-1}`."""
        return torch.linalg.inv(a)

    def act_on_first_factor(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        r""":math:`(G, H) \mapsto (G A^{-1}, H)`: not a symmetry of :math:`G H^\top` (a control)."""
        g, h = self.factors(x)
        return torch.cat((torch.linalg.solve(a, g, left=False), h), dim=-2)

    def random_element(
        self,
        batch_shape: Sequence[int],
        *,
        h: int,
        max_condition: float = 4.0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        r"""Random :math:`A = U \operatorname{diag}(s) V^\top \in \mathrm{GL}(h)` with
        Haar-orthogonal :math:`U, V` and condition number ``max_condition``
        (:func:`~geoopt_quotient.manifolds.groups.general_linear`, drawn in float64).

        Parameters
        ----------
        batch_shape : sequence of int
            Leading shape (one element per point).
        h : int
            The rank.
        max_condition : float
            Condition number of each element (attained for :math:`h \ge 2`).
        generator : torch.Generator, optional
            Source of randomness.
        dtype : torch.dtype
            Dtype of the result.

        Returns
        -------
        torch.Tensor
            Shape ``(*batch_shape, h, h)``.
        """
        a = general_linear(batch_shape, h, condition=max_condition, generator=generator)
        return a.to(dtype)

    def identity_element(
        self,
        batch_shape: Sequence[int],
        *,
        h: int,
        dtype: torch.dtype = torch.float64,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """Identity matrices, shape ``(*batch_shape, h, h)``."""
        eye = torch.eye(h, dtype=dtype, device=device)
        return eye.expand(*batch_shape, h, h).clone()

    def with_metric(self, metric: str, eps: float = 0.0) -> GLQuotient:
        """A copy in ``metric`` with relaxation ``max(eps, self.eps)`` (same group, rows,
        retraction)."""
        other = copy.copy(self)
        other.metric = check_choice(metric, METRICS, "metric")
        other.eps = max(check_nonnegative_float(eps, "eps"), self.eps)
        return other

    def group_label(self, rank: int) -> str:
        """``"GL(h) [h²]"``: the group acting on one block and its dimension."""
        return f"GL({rank}) [{rank * rank}]"

    def stack_key(self) -> Tuple | None:
        """What must agree for points of this geometry to be stacked into one batch and
        handled by the batched GL(h) kernels; ``None``: never (subgroups of GL(h))."""
        return (self.metric, self.eps, self.retraction, self.expmap_steps)

    def stacked(self, rows: int) -> GLQuotient:
        """The geometry of a stack of points of this geometry's :meth:`stack_key`, each
        factor padded with zero rows to ``rows``: :class:`GLQuotient` ``(rows, rows)``
        with this metric, relaxation, retraction and RK4 steps (the sharpness ball's
        stacks of attention heads, whose batched kernels then multiply both factors at
        once)."""
        return GLQuotient(
            rows,
            rows,
            self.metric,
            self.eps,
            retraction=self.retraction,
            expmap_steps=self.expmap_steps,
        )

    def grams(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""Relaxed Gram matrices :math:`S_G, S_H` in at least float32."""
        return PointState(self, x).grams

    def tangent_space(self, x: torch.Tensor):
        """The tangent space at ``x``, with the point's Gram matrices computed once, and
        the operations of a sharpness iteration as batched products
        (:class:`~geoopt_quotient.manifolds._gl_tangent.GLTangentSpace`, with the
        kernels of :meth:`batched_kernels`)."""
        return GLTangentSpace(self, x, PointState(self, x))

    def batched_kernels(self) -> BatchedKernels:
        """Which batched kernels compute this geometry's operations at a fixed point
        (:meth:`tangent_space`): GL(h)'s horizontal projection
        (:func:`~geoopt_quotient.manifolds._gl_tangent.sylvester_projection`) and the
        integration of the geodesic in the span of its start
        (:mod:`~geoopt_quotient.manifolds._gl_geodesic`).

        A subclass whose own formulas replace those of the projection (``_proju``) or
        of the geodesic (:meth:`geodesic`, ``_christoffel``,
        ``_christoffel_coefficients``) says which kernels still apply by defining this
        method too (``BatchedKernels(projection=None, span_geodesic=False)``: the
        reference formulas, on the batched metric conversion); without, the class
        definition raises :class:`TypeError`.

        Returns
        -------
        BatchedKernels
            ``projection``: a function of the point's :class:`PointState` that returns
            the kernel of its horizontal projection (``None``: the manifold's own);
            ``span_geodesic``: whether the span's integration applies.
        """
        return BatchedKernels(functools.partial(sylvester_projection, self.metric, self.eps), True)

    def __init_subclass__(cls, **kwargs):
        """Hold a subclass that redefines what the batched kernels compute
        (:data:`KERNEL_FORMULAS`) to defining :meth:`batched_kernels` too: otherwise
        its tangent space would compute GL(h)'s formulas in place of its own."""
        super().__init_subclass__(**kwargs)
        changed = [name for name in KERNEL_FORMULAS if name in vars(cls)]
        if changed and "batched_kernels" not in vars(cls):
            raise TypeError(
                f"{cls.__name__} redefines {', '.join(changed)}, which GLQuotient's batched "
                "kernels compute: define `batched_kernels` as well, returning the kernels "
                "that still apply (BatchedKernels(projection=None, span_geodesic=False) "
                "for the reference formulas)"
            )

    def _blocks(self, st: PointState) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""Right factors :math:`W_G, W_H` of the metric, :math:`\langle\eta,\zeta\rangle =
        \operatorname{tr}(W_G \eta_G^\top\zeta_G) + \operatorname{tr}(W_H \eta_H^\top\zeta_H)`."""
        if self.metric == "inv":
            return st.inverses
        s_g, s_h = st.grams
        return s_h, s_g

    # ------------------------------------------------------------------ checks
    def _check_shape(
        self, shape: Tuple[int, ...], name: str
    ) -> Union[Tuple[bool, str | None], bool]:
        ok, reason = super()._check_shape(shape, name)
        if not ok:
            return False, reason
        if shape[-2] != self.n + self.m:
            return False, (
                f"`{name}` must have shape (..., n + m, h) = (..., {self.n + self.m}, h), "
                f"got trailing shape {tuple(shape[-2:])}"
            )
        rank = shape[-1]
        if rank < 1 or rank > min(self.n, self.m):
            return False, (
                f"`{name}` has rank h = {rank}, but GLQuotient(n={self.n}, m={self.m}) "
                f"needs 1 <= h <= min(n, m) = {min(self.n, self.m)}"
            )
        return True, None

    def _check_point_on_manifold(
        self, x: torch.Tensor, *, atol=1e-5, rtol=1e-5
    ) -> Union[Tuple[bool, str | None], bool]:
        if not bool(is_finite(x)):
            return False, "point has non-finite (NaN/Inf) entries"
        if self.eps > 0:
            return True, None
        g, h = self.factors(x)
        for label, factor in (("G", g), ("H", h)):
            problem = rank_report(factor, label, rtol=max(rtol, 1e-12))
            if problem is not None:
                return False, problem + "; pass eps > 0 to relax the geometry"
        return True, None

    def _check_vector_on_tangent(
        self, x: torch.Tensor, u: torch.Tensor, *, atol=1e-5, rtol=1e-5
    ) -> Union[Tuple[bool, str | None], bool]:
        left, right = self._horizontality_terms(x, u)
        ok = torch.allclose(left, right, atol=atol, rtol=rtol)
        if not ok:
            err = (left - right).abs().max().item()
            return False, f"`u` is not horizontal: residual {err:.3g} (atol={atol}, rtol={rtol})"
        return True, None

    def _horizontality_terms(
        self, x: torch.Tensor, u: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Both sides of the horizontality equation; equal iff ``u`` is horizontal."""
        st = PointState(self, x)
        u_g, u_h = self.factors(u.to(st.dtype))
        s_g, s_h = st.grams
        gtu = st.g.mT @ u_g
        htu = st.h.mT @ u_h
        if self.metric == "mix":
            return gtu @ s_h, s_g @ htu.mT
        return gtu.mT @ s_h, s_g @ htu

    # ------------------------------------------------------------------ metric
    def inner(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None, *, keepdim=False
    ) -> torch.Tensor:
        return self._inner(PointState(self, x), u, v, keepdim)

    def _inner(
        self, st: PointState, u: torch.Tensor, v: torch.Tensor | None, keepdim: bool
    ) -> torch.Tensor:
        out_dtype = u.dtype if v is None else torch.promote_types(u.dtype, v.dtype)
        v = u if v is None else v
        u_g, u_h = self.factors(u.to(st.dtype))
        v_g, v_h = self.factors(v.to(st.dtype))
        w_g, w_h = self._blocks(st)
        dims = (-2, -1)
        value = ((u_g @ w_g) * v_g).sum(dims, keepdim=keepdim)
        value = value + ((u_h @ w_h) * v_h).sum(dims, keepdim=keepdim)
        return value.to(out_dtype)

    def _gram(self, st: PointState, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
        r"""The matrix :math:`G_{ij} = \langle u_i, u_j \rangle` of tangent vectors, summed
        over batch dimensions, in float64. Per slice of the batch (:meth:`_slices`): the
        vectors stacked, weighted by the metric's blocks in one batched product, and
        paired in one matrix product per factor. Assumes the metric's blocks are
        symmetric (they are Gram matrices or their inverses)."""
        size = len(vectors)
        total = torch.zeros(size, size, dtype=torch.float64, device=st.x.device)
        whole = any(u.shape != st.x.shape for u in vectors)
        for part, pieces in [(st, vectors)] if whole else self._slices(st, *vectors):
            w_g, w_h = self._blocks(part)
            u_g, u_h = self.factors(torch.stack([u.to(part.dtype) for u in pieces]))
            gram = (u_g @ w_g).reshape(size, -1) @ u_g.reshape(size, -1).mT
            total += (gram + (u_h @ w_h).reshape(size, -1) @ u_h.reshape(size, -1).mT).double()
        return (total + total.mT) / 2  # symmetric to the last bit

    def _slices(
        self, st: PointState, *tensors: torch.Tensor
    ) -> Iterator[Tuple[PointState, List[torch.Tensor]]]:
        """The state and ``tensors`` (shaped like the point) a slice of the batch at a time,
        :data:`CHUNK_BYTES` of them each on the CPU; views of contiguous ``tensors``."""
        x = st.x
        self._prepare(st)
        flats = [t.reshape(-1, *x.shape[-2:]) for t in tensors]
        budget = CHUNK_BYTES if x.device.type == "cpu" else DEVICE_CHUNK_BYTES
        count = flats[0].shape[0]
        per = max(1, budget // (x.shape[-2] * x.shape[-1] * st.dtype.itemsize))
        if capped(x.device):
            per = max(per, -(-count // MAX_SLICES))
        for start in range(0, count, per):
            stop = min(start + per, count)
            yield st.batch_slice(start, stop), [f[start:stop] for f in flats]

    def _prepare(self, st: PointState) -> None:
        """Compute what the fused operations use of ``st`` on the whole batch, so that
        :meth:`PointState.batch_slice` slices it instead of each slice recomputing it."""
        _ = st.grams, st.inverses
        if self.metric == "inv":
            _ = st.inv_sylvester_bases
        elif self.eps:
            _ = st.grams_exact

    def _can_fuse(self, st: PointState, *tensors: torch.Tensor, converted: bool = False) -> bool:
        """Whether the fused operations apply: tensors of the point's shape, dtype (the
        working one) and device, contiguous, and nothing for autograd to record. With
        ``converted``, the point and the tensors may be of any dtype computed in the
        working one (bfloat16), which the caller converts a slice at a time
        (:class:`~geoopt_quotient.manifolds._gl_tangent.GLTangentSpace`)."""
        x = st.x
        if converted:
            dtypes = all(compute_dtype(t.dtype) == st.dtype for t in tensors)
        else:
            dtypes = x.dtype == st.dtype and all(t.dtype == x.dtype for t in tensors)
        return (
            dtypes
            and all(
                t.shape == x.shape and t.device == x.device and t.is_contiguous() for t in tensors
            )
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors)))
        )

    def component_inner(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One metric inner product per point, shape ``(..., 1, 1)``.

        Adaptive optimizers divide by this, so a horizontal direction stays horizontal.
        """
        return self.inner(x, u, v, keepdim=True)

    def norm(self, x: torch.Tensor, u: torch.Tensor, *, keepdim=False) -> torch.Tensor:
        return self.inner(x, u, keepdim=keepdim).clamp_min(0).sqrt()

    # ------------------------------------------------------------------ projections
    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Horizontal projection :math:`(\eta_G + G\Omega, \eta_H - H\Omega^\top)`.

        mix: :math:`\Omega = \tfrac12(\eta_H^\top H S_H^{-1} - S_G^{-1} G^\top \eta_G)`;
        inv: :math:`\Omega^\top` solves :math:`\Omega^\top A + A\Omega^\top = S_G H^\top\eta_H
        - \eta_G^\top G S_H` with :math:`A = S_G S_H` (the printed form of this equation in
        the seed paper is transposed).
        """
        return self._proju(PointState(self, x), u)

    def _proju(self, st: PointState, u: torch.Tensor) -> torch.Tensor:
        u_g, u_h = self.factors(u.to(st.dtype))
        solve = self._omega_inv if self.metric == "inv" else self._omega_mix
        omega = solve(st, u_g, u_h)
        return self._shift_along_orbit(st, u_g, u_h, omega).to(u.dtype)

    def _omega_mix(self, st: PointState, u_g: torch.Tensor, u_h: torch.Tensor) -> torch.Tensor:
        r""":math:`\Omega` of the mix projection: :math:`G^\top G\, \Omega S_H + S_G \Omega
        H^\top H = S_G D S_H` with :math:`D = \eta_H^\top H S_H^{-1} - S_G^{-1} G^\top
        \eta_G`; for ``eps = 0``, :math:`\Omega = D / 2`."""
        s_g_inv, s_h_inv = st.inverses
        diff = (u_h.mT @ st.h) @ s_h_inv - s_g_inv @ (st.g.mT @ u_g)
        if not self.eps:
            return 0.5 * diff
        omega = solve_sylvester_shifted(*st.grams_exact, diff.to(st.high), self.eps)
        return omega.to(st.dtype)

    def _omega_inv(self, st: PointState, u_g: torch.Tensor, u_h: torch.Tensor) -> torch.Tensor:
        r""":math:`\Omega` of the inv projection: :math:`Y = \Omega^\top` solves
        :math:`(S_G H^\top H)\, Y + Y\, (G^\top G S_H) = S_G H^\top \eta_H - \eta_G^\top G
        S_H` (for ``eps = 0`` both coefficients are :math:`A = S_G S_H`: :math:`Y A + A Y`),
        solved in the cached eigenbases of the two coefficients."""
        s_g, s_h = st.grams
        rhs = s_g @ (st.h.mT @ u_h) - (u_g.mT @ st.g) @ s_h
        left, right = st.inv_sylvester_bases
        y = solve_sylvester_eigenbases(left, right, rhs.to(st.high), degenerate=self.eps > 0)
        return y.mT.to(st.dtype)

    def _shift_along_orbit(
        self, st: PointState, u_g: torch.Tensor, u_h: torch.Tensor, omega: torch.Tensor
    ) -> torch.Tensor:
        r""":math:`(\eta_G + G\Omega, \eta_H - H\Omega^\top)` as one tensor.

        Without autograd each block is one ``baddbmm`` writing straight into the output
        (:func:`~geoopt_quotient.manifolds._linalg.add_product`):
        no intermediate products, no concatenation (the projection is bound by these
        :math:`(n + m) h^2` products and by the passes over its large operands).
        """
        g, h = st.g, st.h
        operands = (g, h, u_g, u_h, omega)
        if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
            return self.from_factors(u_g + g @ omega, u_h - h @ omega.mT)
        k = omega.shape[-1]
        batch = torch.broadcast_shapes(g.shape[:-2], u_g.shape[:-2], omega.shape[:-2])
        out = torch.empty(*batch, g.shape[-2] + h.shape[-2], k, dtype=st.dtype, device=g.device)
        out_g, out_h = self.factors(out.view(-1, *out.shape[-2:]))

        def flat(t: torch.Tensor) -> torch.Tensor:
            return t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:])

        omega = flat(omega)
        add_product(out_g, flat(u_g), flat(g), omega)
        add_product(out_h, flat(u_h), flat(h), omega.mT, alpha=-1)
        return out

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        """Every full-rank pair is a point: returned unchanged."""
        return x

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Riemannian gradient, horizontally projected.

        inv: :math:`(\nabla_G S_G, \nabla_H S_H)`;
        mix: :math:`(\nabla_G S_H^{-1}, \nabla_H S_G^{-1})`.
        """
        return self._egrad2rgrad(PointState(self, x), u)

    def _egrad2rgrad(self, st: PointState, u: torch.Tensor) -> torch.Tensor:
        u_g, u_h = self.factors(u.to(st.dtype))
        if self.metric == "inv":
            s_g, s_h = st.grams
            r_g, r_h = u_g @ s_g, u_h @ s_h
        else:
            s_g_inv, s_h_inv = st.inverses
            r_g, r_h = u_g @ s_h_inv, u_h @ s_g_inv
        return self._proju(st, torch.cat((r_g, r_h), dim=-2)).to(u.dtype)

    def _egrad2rgrad_(self, st: PointState, u: torch.Tensor) -> torch.Tensor:
        """:meth:`egrad2rgrad` written into ``u``, a slice of the batch at a time
        (:meth:`_slices`), where :meth:`_can_fuse`; otherwise a new tensor."""
        if not self._can_fuse(st, u):
            return self._egrad2rgrad(st, u)
        for part, (piece,) in self._slices(st, u):
            piece.copy_(self._egrad2rgrad(part, piece))
        return u

    # ------------------------------------------------------------------ geodesics
    def christoffel(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r""":math:`\Gamma_X(\xi, \xi)` of the total-space geodesic equation.

        inv (per factor, shown for G):
        :math:`-\xi_G S_G^{-1}(\xi_G^\top G + G^\top \xi_G) + G S_G^{-1} \xi_G^\top \xi_G`.
        mix: :math:`\Gamma_G = [\xi_G(\xi_H^\top H + H^\top \xi_H) - G \xi_H^\top \xi_H] S_H^{-1}`
        and symmetrically for :math:`\Gamma_H`.
        """
        return self._christoffel(PointState(self, x), u)

    def _christoffel(self, st: PointState, u: torch.Tensor) -> torch.Tensor:
        r""":math:`\Gamma_F = \xi_F X_F + F Y_F` per factor, with the coefficients of
        :meth:`_christoffel_coefficients` (those the fused retraction uses)."""
        u_g, u_h = self.factors(u.to(st.dtype))
        (x_g, y_g), (x_h, y_h) = self._christoffel_coefficients(st, u_g, u_h)
        gamma_g, gamma_h = u_g @ x_g + st.g @ y_g, u_h @ x_h + st.h @ y_h
        return torch.cat((gamma_g, gamma_h), dim=-2).to(u.dtype)

    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Second-order retraction :math:`X + \xi - \tfrac12 \Gamma_X(\xi, \xi)`.

        With ``retraction="first_order"``: the straight line :math:`X + \xi`.
        """
        return self._retr(PointState(self, x), u, x)

    def _retr(self, st: PointState, u: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        x = st.x if x is None else x
        if self.retraction == "first_order":
            return x + u
        return x + u - 0.5 * self._christoffel(st, u)

    def _retr_vjp(
        self, st: PointState, u: torch.Tensor, out: torch.Tensor
    ) -> Tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
        r""":meth:`retr` of ``u`` written into ``out``, and its pullback
        :math:`c \mapsto (D_\xi R_X)^\top c`, written into ``c``; both a slice of the
        batch at a time (:meth:`_slices`), with no autograd and no temporary as large as
        the point. ``None`` where :meth:`_can_fuse` does not hold for ``u`` and ``out``.

        Each factor's Christoffel term is :math:`\Gamma_F = \xi_F X_F + F Y_F` with
        :math:`h \times h` coefficients (:meth:`_christoffel_coefficients`), so

        .. math::

            R_X(\xi)_F = F + \xi_F (I - \tfrac12 X_F) - \tfrac12 F Y_F .

        The pullback differentiates :math:`\langle c, \Gamma \rangle` by hand: with
        :math:`M_K = \xi_K^\top K + K^\top \xi_K` and :math:`B_K = \xi_K^\top \xi_K` the
        coefficients' arguments, and :math:`\bar M_K, \bar B_K` their cotangents
        (:meth:`_coefficient_cotangents`),

        .. math::

            (D_\xi R_X)^\top c \,\big|_K = c_K (I - \tfrac12 X_K^\top)
                - \tfrac12 K (\bar M_K + \bar M_K^\top)
                - \tfrac12 \xi_K (\bar B_K + \bar B_K^\top).

        Nine products of the point's size per factor (four forward, five back), where
        autograd through :meth:`retr` records thirteen and allocates each result.
        """
        if not self._can_fuse(st, u, out):
            return None
        if self.retraction == "first_order":
            return torch.add(st.x, u, out=out), lambda c: c
        saved = []
        for part, (x_, u_, o_) in self._slices(st, st.x, u, out):
            coefficients = self._christoffel_coefficients(part, *self.factors(u_))
            saved.append(coefficients)
            for o_f, x_f, u_f, f, (c_x, c_y) in zip(
                self.factors(o_), self.factors(x_), self.factors(u_), (part.g, part.h), coefficients
            ):
                add_product(o_f, x_f, u_f, _eye_like(c_x) - 0.5 * c_x)
                add_product(o_f, o_f, f, c_y, alpha=-0.5)

        def pullback(c: torch.Tensor) -> torch.Tensor:
            if not self._can_fuse(st, c):
                raise ValueError("the cotangent must be a contiguous tensor like the point")
            for (part, (u_, c_)), coefficients in zip(self._slices(st, u, c), saved):
                self._pullback_slice_(part, u_, c_, coefficients)
            return c

        return out, pullback

    def _christoffel_coefficients(
        self, st: PointState, u_g: torch.Tensor, u_h: torch.Tensor
    ) -> Tuple[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
        r""":math:`(X_G, Y_G), (X_H, Y_H)` with :math:`\Gamma_F = \xi_F X_F + F Y_F`
        (:meth:`christoffel`, regrouped): with :math:`M_K = 2 \operatorname{sym}
        (\xi_K^\top K)` and :math:`B_K = \xi_K^\top \xi_K`,

        inv: :math:`X_F = -S_F^{-1} M_F`, :math:`Y_F = S_F^{-1} B_F`;
        mix: :math:`X_G = M_H S_H^{-1}`, :math:`Y_G = -B_H S_H^{-1}`, and the same with
        :math:`G, H` exchanged.
        """
        (m_g, b_g), (m_h, b_h) = (
            (2 * sym(u.mT @ f), u.mT @ u) for u, f in ((u_g, st.g), (u_h, st.h))
        )
        s_g_inv, s_h_inv = st.inverses
        if self.metric == "inv":
            return (-s_g_inv @ m_g, s_g_inv @ b_g), (-s_h_inv @ m_h, s_h_inv @ b_h)
        return (m_h @ s_h_inv, -b_h @ s_h_inv), (m_g @ s_g_inv, -b_g @ s_g_inv)

    def _pullback_slice_(
        self,
        st: PointState,
        u: torch.Tensor,
        c: torch.Tensor,
        coefficients: Tuple[Tuple[torch.Tensor, torch.Tensor], ...],
    ) -> None:
        """The pullback of :meth:`_retr_vjp` on one slice, written into ``c``."""
        u_f, c_f = self.factors(u), self.factors(c)
        bars = self._coefficient_cotangents(st, u_f, c_f)
        for f, u_k, c_k, (c_x, _), (m_bar, b_bar) in zip(
            (st.g, st.h), u_f, c_f, coefficients, bars
        ):
            result = c_k @ (_eye_like(c_x) - 0.5 * c_x.mT)
            add_product(result, result, f, m_bar + m_bar.mT, alpha=-0.5)
            add_product(result, result, u_k, b_bar + b_bar.mT, alpha=-0.5)
            c_k.copy_(result)

    def _coefficient_cotangents(
        self,
        st: PointState,
        u_f: Tuple[torch.Tensor, torch.Tensor],
        c_f: Tuple[torch.Tensor, torch.Tensor],
    ) -> Tuple[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
        r""":math:`(\bar M_G, \bar B_G), (\bar M_H, \bar B_H)`: the cotangents of the
        arguments of :meth:`_christoffel_coefficients` for :math:`\langle c, \Gamma\rangle`,
        from :math:`\bar X_F = \xi_F^\top c_F` and :math:`\bar Y_F = F^\top c_F`:

        inv: :math:`\bar M_F = -S_F^{-1} \bar X_F`, :math:`\bar B_F = S_F^{-1} \bar Y_F`;
        mix: :math:`\bar M_H = \bar X_G S_H^{-1}`, :math:`\bar B_H = -\bar Y_G S_H^{-1}`,
        and the same with :math:`G, H` exchanged.
        """
        (x_g, y_g), (x_h, y_h) = ((u.mT @ c, f.mT @ c) for u, f, c in zip(u_f, (st.g, st.h), c_f))
        s_g_inv, s_h_inv = st.inverses
        if self.metric == "inv":
            return (-s_g_inv @ x_g, s_g_inv @ y_g), (-s_h_inv @ x_h, s_h_inv @ y_h)
        return (x_h @ s_g_inv, -y_h @ s_g_inv), (x_g @ s_h_inv, -y_g @ s_h_inv)

    def expmap(self, x: torch.Tensor, u: torch.Tensor, *, steps: int | None = None) -> torch.Tensor:
        r"""Exponential map: the geodesic ODE integrated with ``steps`` classical RK4 steps.

        The global error is :math:`O((|\xi| / \text{steps})^4)`; no closed form is known.
        Differentiable with respect to ``x`` and ``u``.
        """
        x_end, _ = self.geodesic(x, u, 1.0, steps=steps)
        return x_end

    def geodesic(
        self, x: torch.Tensor, u: torch.Tensor, t: float = 1.0, *, steps: int | None = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""Position and velocity at time ``t`` of the geodesic with :math:`X(0)=x, \dot X(0)=u`."""
        steps = self.expmap_steps if steps is None else check_positive_int(steps, "steps")
        dt = t / steps
        pos, vel = torch.broadcast_tensors(x, u)
        failures: List[torch.Tensor] = []  # of the factorisations, checked once at the end

        def rhs(p: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
            return v, -self._christoffel(PointState(self, p, failures), v)

        try:
            for _ in range(steps):
                k1p, k1v = rhs(pos, vel)
                k2p, k2v = rhs(pos + 0.5 * dt * k1p, vel + 0.5 * dt * k1v)
                k3p, k3v = rhs(pos + 0.5 * dt * k2p, vel + 0.5 * dt * k2v)
                k4p, k4v = rhs(pos + dt * k3p, vel + dt * k3v)
                pos = pos + dt / 6 * (k1p + 2 * k2p + 2 * k3p + k4p)
                vel = vel + dt / 6 * (k1v + 2 * k2v + 2 * k3v + k4v)
        except torch.linalg.LinAlgError as error:  # the CPU's inverse of a failed factor
            raise integration_error(steps) from error
        self._check_integration(x, u, pos, vel, steps, failures)
        return pos, vel

    def _check_integration(
        self, x, u, pos, vel, steps: int, failures: List[torch.Tensor], state=None
    ):
        """Geodesics keep their metric speed: a finite end point whose speed changed by more
        than 2% means the path left the manifold or the steps were too long; so does a
        Gram matrix on the way that was not positive definite (a factor lost rank). All
        of it is read from the device at once: one host synchronisation per call.
        ``state``: the :class:`PointState` of ``x`` where the caller keeps one."""
        with torch.no_grad():
            state = PointState(self, x, failures) if state is None else state
            start = self._inner(state, u, None, False)
            end = self._inner(PointState(self, pos, failures), vel, None, False)
            check_speeds(steps, start, end, failures, pos, vel)

    # ------------------------------------------------------------------ sampling
    def random_tangent(
        self, x: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """A standard Gaussian horizontal vector in the metric: E<ξ, ξ> = dim of the quotient."""
        return self._random_tangent(PointState(self, x), x, generator)

    def _random_tangent(
        self, st: PointState, x: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor:
        noise = standard_normal(x, generator)
        n_g, n_h = self.factors(noise)
        chol_g, chol_h = st.cholesky
        w_g, w_h = (chol_g, chol_h) if self.metric == "inv" else (chol_h, chol_g)
        dt = st.dtype
        if self.metric == "inv":
            # tr(S^{-1} eta^T eta) = |eps|^2 for eta = eps C^T, S = C C^T
            z_g, z_h = n_g.to(dt) @ w_g.mT, n_h.to(dt) @ w_h.mT
        else:
            # tr(S eta^T eta) = |eta C|^2 = |eps|^2 for eta = eps C^{-1}
            z_g = torch.linalg.solve_triangular(w_g, n_g.to(dt), upper=False, left=False)
            z_h = torch.linalg.solve_triangular(w_h, n_h.to(dt), upper=False, left=False)
        return self._proju(st, torch.cat((z_g, z_h), dim=-2)).to(x.dtype)

    def random(self, *size, dtype=None, device=None, std: float = 1.0) -> ManifoldTensor:
        """Random point with i.i.d. Gaussian entries (full rank with probability one)."""
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        x = torch.randn(*shape, dtype=dtype, device=device) * std
        return ManifoldTensor(x, manifold=self)

    random_normal = random

    def origin(self, *size, dtype=None, device=None, seed: int | None = 42) -> ManifoldTensor:
        r"""The point :math:`G = [I_h; 0]`, :math:`H = [I_h; 0]`."""
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        rank = shape[-1]
        x = torch.zeros(*shape, dtype=dtype, device=device)
        eye = torch.eye(rank, dtype=x.dtype, device=x.device)
        x[..., :rank, :] = eye
        x[..., self.n : self.n + rank, :] = eye
        return ManifoldTensor(x, manifold=self)

    def dim(self, rank: int) -> int:
        """Dimension :math:`(n + m) h - h^2` of the quotient for rank ``h``."""
        return (self.n + self.m) * rank - rank * rank

    @staticmethod
    def condition_number(a: torch.Tensor) -> torch.Tensor:
        """Spectral condition number of a batch of matrices (a test utility)."""
        s = torch.linalg.svdvals(a)
        return s[..., 0] / s[..., -1]
