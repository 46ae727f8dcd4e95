"""The element-wise scaled metric of adaptive sharpness."""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple, Union

import torch
from geoopt.tensor import ManifoldTensor
from geoopt.utils import size2shape

from .._checks import check_nonnegative_float
from ._linalg import block_length, capped, compute_dtype
from ._random import standard_normal
from .base import QuotientManifold

__all__ = ["AdaptiveEuclidean"]


class AdaptiveEuclidean(QuotientManifold):
    r"""Euclidean space with the element-wise scaled metric of adaptive sharpness.

    .. math::

        \langle \eta, \nu \rangle_w = \sum_i \frac{\eta_i \nu_i}{c_i^2},
        \qquad c = |w| + \varepsilon,

    so that the ball :math:`|\xi|_w \le \rho` is the adaptive-sharpness ball
    :math:`|\delta / c|_2 \le \rho` of Kwon et al. (2021) and Andriushchenko et al.
    (2023). :meth:`retr` is the straight line :math:`w + \xi` (their perturbation).
    :meth:`expmap` is the exact geodesic: with :math:`\varepsilon > 0` the coordinate
    :math:`\varphi = \operatorname{sign}(w)\log(1 + |w|/\varepsilon)` is flat, and with
    :math:`\varepsilon = 0` it is :math:`w \odot \exp(\xi / w)`.

    Entries with :math:`c_i = 0` (a zero weight and ``eps=0``) admit no perturbation:
    they are *frozen*, i.e. every tangent vector is zero there, and contribute nothing
    to inner products (no NaN).

    Parameters
    ----------
    eps : float
        Offset :math:`\varepsilon \ge 0` of the scale (default 0).
    ndim : int
        Number of trailing dimensions reduced by :meth:`inner` (default 0:
        element-wise).

    Raises
    ------
    ValueError
        For a negative or non-finite ``eps``, or an ``ndim`` that is not an int >= 0.

    References
    ----------
    Kwon et al. (2021) :cite:`kwon2021asam`; Andriushchenko et al. (2023), "A Modern Look
    at the Relationship between Sharpness and Generalization", ICML
    :cite:`andriushchenko2023modern`.

    Examples
    --------
    A zero weight is frozen; the others are measured relative to their size:

    >>> import torch
    >>> from geoopt_quotient import AdaptiveEuclidean
    >>> manifold = AdaptiveEuclidean(ndim=1)
    >>> w = torch.tensor([2.0, -0.5, 0.0], dtype=torch.float64)
    >>> xi = manifold.proju(w, torch.ones(3, dtype=torch.float64))
    >>> xi
    tensor([1., 1., 0.], dtype=torch.float64)
    >>> expected = torch.tensor((1 / 2.0) ** 2 + (1 / 0.5) ** 2, dtype=torch.float64).sqrt()
    >>> torch.allclose(manifold.norm(w, xi), expected)
    True
    >>> manifold.retr(w, xi)
    tensor([3.0000, 0.5000, 0.0000], dtype=torch.float64)
    """

    name = "AdaptiveEuclidean"
    ndim = 0
    reversible = True
    elementwise_metric = True
    acts_per_point = True
    #: :meth:`retr` is :math:`w + \xi`.
    straight_retraction = True

    def __init__(self, eps: float = 0.0, ndim: int = 0):
        super().__init__()
        self.eps = check_nonnegative_float(eps, "eps")
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 0:
            raise ValueError(f"`ndim` must be an int >= 0, got {ndim!r}")
        self.ndim = ndim

    def extra_repr(self) -> str:
        return f"eps={self.eps}, ndim={self.ndim}"

    def scale(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The per-entry scale :math:`c = |w| + \\varepsilon`, a new tensor or written into
        ``out``."""
        c = torch.abs(x, out=out)
        return c.add_(self.eps) if self.eps else c

    def tangent_space(self, x: torch.Tensor):
        r"""The tangent space at ``x``; its weights :math:`c^{\pm 2}` are recomputed block by
        block when used, never stored (see :class:`_ScaleState`)."""
        from .tangent import CachedTangentSpace

        return CachedTangentSpace(self, x, _ScaleState(self, x))

    def _reduce(self, value: torch.Tensor, keepdim: bool) -> torch.Tensor:
        if self.ndim > 0:
            return value.sum(dim=tuple(range(-self.ndim, 0)), keepdim=keepdim)
        return value

    def _check_point_on_manifold(
        self, x: torch.Tensor, *, atol=1e-5, rtol=1e-5
    ) -> Union[Tuple[bool, str | None], bool]:
        if not torch.isfinite(x).all():
            return False, "point has non-finite entries"
        return True, None

    def _check_vector_on_tangent(
        self, x: torch.Tensor, u: torch.Tensor, *, atol=1e-5, rtol=1e-5
    ) -> Union[Tuple[bool, str | None], bool]:
        frozen = self.scale(x) == 0
        if bool((u.abs() > atol).logical_and(frozen).any()):
            return False, "`u` is non-zero on frozen entries (zero weights with eps=0)"
        return True, None

    def inner(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None, *, keepdim=False
    ) -> torch.Tensor:
        return self._inner(_ScaleState(self, x), u, v, keepdim)

    def _inner(
        self, st: _ScaleState, u: torch.Tensor, v: torch.Tensor | None, keepdim: bool
    ) -> torch.Tensor:
        v = u if v is None else v
        value = self._reduce(st.weighted_product(u, v), keepdim)
        return value.to(torch.promote_types(u.dtype, v.dtype))

    def _inner_sum(self, st: _ScaleState, u: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """:meth:`inner` summed over all entries, without a product of the point's size."""
        return st.weighted_sum(u, u if v is None else v).to(
            torch.promote_types(u.dtype, u.dtype if v is None else v.dtype)
        )

    def _gram(self, st: _ScaleState, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
        r"""The matrix :math:`G_{ij} = \langle u_i, u_j \rangle_w` of tangent vectors,
        summed over all entries, in float64: one read of the point and the vectors."""
        gram = st.gram(vectors)
        if gram is None:
            return torch.stack(
                [torch.stack([st.weighted_sum(u, v) for v in vectors]) for u in vectors]
            ).double()
        return gram

    def component_inner(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.inner(x, u, v, keepdim=True)

    def norm(self, x: torch.Tensor, u: torch.Tensor, *, keepdim=False) -> torch.Tensor:
        return self.inner(x, u, keepdim=keepdim).clamp_min(0).sqrt()

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Zero the frozen entries; everything else is tangent."""
        return self._proju(_ScaleState(self, x), u)

    def _proju(self, st: _ScaleState, u: torch.Tensor) -> torch.Tensor:
        if self.eps > 0:
            return u.expand(torch.broadcast_shapes(st.x.shape, u.shape))
        return torch.where(st.frozen, torch.zeros_like(u), u)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Riemannian gradient :math:`c^2 \odot \nabla` (zero on frozen entries)."""
        return self._egrad2rgrad(_ScaleState(self, x), u)

    def _egrad2rgrad(self, st: _ScaleState, u: torch.Tensor) -> torch.Tensor:
        return st.rescaled(u)

    def _egrad2rgrad_(self, st: _ScaleState, u: torch.Tensor) -> torch.Tensor:
        """:meth:`egrad2rgrad` written into ``u`` where it splits into blocks (the same
        values); a new tensor otherwise."""
        return st.rescaled_(u)

    def _egrad2rgrad_gram_(
        self, st: _ScaleState, vectors: Sequence[torch.Tensor], index: int
    ) -> Tuple[torch.Tensor, torch.Tensor] | None:
        r""":meth:`_egrad2rgrad_` of ``vectors[index]`` (in place) and the Gram matrix of
        ``vectors`` with the Riemannian gradient in its place, in one sweep
        (:meth:`_ScaleState.rescaled_gram_`); ``None`` (nothing changed) where that
        sweep does not apply."""
        gram = st.rescaled_gram_(vectors, index)
        return None if gram is None else (vectors[index], gram)

    def _egrad2rgrad_column_(
        self, st: _ScaleState, vectors: Sequence[torch.Tensor], index: int
    ) -> Tuple[torch.Tensor, torch.Tensor] | None:
        r""":meth:`_egrad2rgrad_` of ``vectors[index]`` (in place) and its inner products
        with all ``vectors``, in one sweep (:meth:`_ScaleState.rescaled_column_`);
        ``None`` (nothing changed) where that sweep does not apply."""
        column = st.rescaled_column_(vectors, index)
        return None if column is None else (vectors[index], column)

    def _gradient_sweep(
        self, st: _ScaleState, vectors: Sequence[torch.Tensor], index: int, kind: str
    ) -> GradientSweep | None:
        """The sweep of :meth:`_egrad2rgrad_column_` or :meth:`_egrad2rgrad_gram_`, to
        run as ``vectors[index]`` arrives (:meth:`_ScaleState.sweep`)."""
        return st.sweep(vectors, index, kind)

    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Straight line :math:`w + \\xi`."""
        return x + u

    def expmap(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Exact geodesic at time 1."""
        if self.eps > 0:
            phi = torch.sign(x) * torch.log1p(x.abs() / self.eps) + u / self.scale(x)
            return torch.sign(phi) * self.eps * torch.expm1(phi.abs())
        safe = torch.where(x == 0, torch.ones_like(x), x)
        return torch.where(x == 0, x, x * torch.exp(u / safe))

    def random_tangent(
        self, x: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """A standard Gaussian vector in the metric (zero on frozen entries)."""
        return self._random_tangent(_ScaleState(self, x), x, generator)

    def _random_tangent(
        self, st: _ScaleState, x: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor:
        noise = standard_normal(x, generator)
        return (noise * self.scale(x)).to(x.dtype)

    def random(self, *size, dtype=None, device=None, std: float = 1.0) -> ManifoldTensor:
        """A point with standard normal entries times ``std``.

        Raises
        ------
        ValueError
            For a shape with fewer than :attr:`ndim` dimensions (as Geoopt's ``Euclidean``).
        """
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        return ManifoldTensor(torch.randn(shape, dtype=dtype, device=device) * std, manifold=self)

    random_normal = random

    def origin(self, *size, dtype=None, device=None, seed: int | None = 42) -> ManifoldTensor:
        """The all-ones point (the zero point would be frozen everywhere with eps=0).

        Raises
        ------
        ValueError
            For a shape with fewer than :attr:`ndim` dimensions (as Geoopt's ``Euclidean``).
        """
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        return ManifoldTensor(torch.ones(shape, dtype=dtype, device=device), manifold=self)


class _ScaleState:
    r"""The per-entry metric weights at one point, recomputed block by block when used.

    Nothing of the point's size is stored: a cached :math:`c^2` or :math:`1 / c^2` would
    be one more copy of a model-sized point. Recomputed on blocks of :data:`BLOCK`
    entries, which stay in the processor's cache for the few operations involved, they
    cost about as much as reading a cached copy. Results are exactly those of the
    whole-tensor formulas, which serve as fallback when the operands do not split into
    matching blocks (broadcasting, non-contiguous tensors, mixed dtypes).
    """

    def __init__(self, manifold: AdaptiveEuclidean, x: torch.Tensor):
        self.x = x
        self.manifold = manifold
        self.dtype = compute_dtype(x.dtype)

    def scale_squared(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """:math:`c^2` (zero where frozen) of the point's entries ``x``, a new tensor or
        written into ``out`` (of the working dtype)."""
        return self.manifold.scale(x.to(self.dtype), out=out).pow_(2)

    def weight(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`1 / c^2` of the entries ``x``, with frozen entries mapped to 0 instead of inf.

        In place, except where autograd records the operations (``x`` requires a
        gradient): there the reciprocal, which its derivative reads, is not overwritten,
        and the frozen entries' reciprocal is never formed, so that their derivative is
        zero (not NaN). The values are the same either way.
        """
        c2 = self.scale_squared(x)
        frozen = (c2 > 0).logical_not_()  # also NaN, as torch.where(c2 > 0, ...) would
        if c2.requires_grad:
            return c2.masked_fill(frozen, 1.0).reciprocal().masked_fill(frozen, 0.0)
        return c2.reciprocal_().masked_fill_(frozen, 0.0)

    def weighted_product(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r""":math:`u \odot v / c^2`, computed as ``(w * u) * v`` in the working dtype."""
        out = _blockwise(self._weighted_product, self.dtype, self.x, u, v)
        if out is None:  # u, v may broadcast against the point: not in place
            return self.weight(self.x) * u.to(self.dtype) * v.to(self.dtype)
        return out

    def weighted_sum(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r""":math:`\sum_i u_i v_i / c_i^2` of tangent vectors, block by block in the working
        dtype: :math:`(u / c) \cdot (v / c)`, with :math:`c` clamped to the smallest normal
        number so that frozen entries, where tangent vectors are zero, add nothing.

        Three passes over the entries for a squared norm (scale, quotient, dot), where
        :meth:`weighted_product` takes nine; the sum's rounding differs from that of the
        summed product.
        """
        if v is u:
            parts = _blockwise_sums(self._squared_block, self.x, u)
        else:
            parts = _blockwise_sums(self._dot_block, self.x, u, v)
        if parts is None:
            return self.weighted_product(u, v).sum()
        return parts

    def _over_scale(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        scale = self.manifold.scale(x.to(self.dtype)).clamp_min_(torch.finfo(self.dtype).tiny)
        return u.to(self.dtype) / scale, scale

    def _squared_block(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ratio, _ = self._over_scale(x, u)
        return torch.dot(ratio, ratio)

    def _dot_block(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ratio, scale = self._over_scale(x, u)
        return torch.dot(ratio.div_(scale), v.to(self.dtype))

    def rescaled(self, u: torch.Tensor) -> torch.Tensor:
        r""":math:`c^2 \odot u` in ``u``'s dtype, computed in the working dtype."""
        out = None
        if compute_dtype(u.dtype) == self.dtype:
            out = _blockwise(self._rescaled, u.dtype, self.x, u)
        if out is None:
            return (u.to(compute_dtype(u.dtype)) * self.scale_squared(self.x)).to(u.dtype)
        return out

    def _readable(self, vectors: Sequence[torch.Tensor]) -> bool:
        """Whether ``vectors`` are all of one dtype that the block kernels read into the
        working dtype: the working one, or a coarser one (bfloat16 vectors of a
        sharpness ball's bfloat16 state, each result rounded once when written)."""
        dtype = vectors[0].dtype
        return all(u.dtype == dtype for u in vectors) and compute_dtype(dtype) == self.dtype

    def rescaled_(self, u: torch.Tensor) -> torch.Tensor:
        """:meth:`rescaled` in place in ``u`` where it splits into blocks of the point's
        shape in a dtype the working one reads (:meth:`_readable`); otherwise (and
        without changing ``u``) a new tensor."""
        if not self._readable([u]) or not _splittable(self.x, u):
            return self.rescaled(u)
        flat_x, flat_u = self.x.reshape(-1), u.view(-1)
        step = block_length(u.numel(), BLOCK, u.device)
        for start in range(0, u.numel(), step):
            block = slice(start, start + step)
            flat_u[block].mul_(self.scale_squared(flat_x[block]))
        return u

    def gram(self, vectors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        r"""The Gram matrix :math:`\sum_i u_i v_i / c_i^2` of ``vectors``, in float64.

        Block by block: per block of :data:`GRAM_BLOCK` entries (:data:`DEVICE_GRAM_BLOCK`
        off the CPU, where no more than ``_linalg.MAX_BLOCKS`` blocks are made),
        :math:`c` is formed once,
        the quotients :math:`u / c` of all vectors are written to a buffer that stays in
        cache, and their products come from one matrix product; the block sums are added
        in float64. Frozen entries add nothing (as in :meth:`weighted_sum`). ``None``
        where the operands do not split into blocks.
        """
        if not vectors or not _splittable(self.x, *vectors):
            return None
        if any(u.dtype != vectors[0].dtype for u in vectors):
            return None
        return self._gram_sweep(vectors, None)

    def rescaled_gram_(self, vectors: Sequence[torch.Tensor], index: int) -> torch.Tensor | None:
        r""":meth:`rescaled_` of ``vectors[index]`` (in place) and then the :meth:`gram` of
        ``vectors``, in one sweep over the entries.

        Per block, :math:`c` is formed once and serves both: the block of
        ``vectors[index]`` is multiplied by :math:`c^2` while it is in cache, and its
        quotient by :math:`c` is taken from there. Each vector and the point are read
        once and the rescaled one written once, instead of a second read of the point
        and of the rescaled vector by a separate :meth:`gram`. The values are those of
        :meth:`rescaled_` followed by :meth:`gram`, bit for bit. ``None`` (nothing
        changed) where the operands do not split into blocks or are not all in one dtype
        the working one reads (:meth:`_readable`).
        """
        if not vectors or not _splittable(self.x, *vectors):
            return None
        if not self._readable(vectors):
            return None
        return self._gram_sweep(vectors, index)

    def _gram_sweep(self, vectors: Sequence[torch.Tensor], rescale: int | None) -> torch.Tensor:
        """:meth:`gram`, with ``vectors[rescale]`` multiplied by :math:`c^2` first, block
        by block (none if ``rescale`` is ``None``)."""
        return GradientSweep(self, vectors, rescale, "gram").finish()

    def rescaled_column_(self, vectors: Sequence[torch.Tensor], index: int) -> torch.Tensor | None:
        r""":meth:`rescaled_` of ``g = vectors[index]`` (in place) and the column
        :math:`\langle u_j, c^2 \odot g \rangle_w` of the Gram matrix it lies in, for
        all ``vectors`` :math:`u_j` (``g``'s own entry with the rescaled ``g``), in
        float64, in one sweep over the entries.

        The metric's weights cancel against the rescaling,

        .. math::

            \langle u, c^2 \odot g \rangle_w = \sum_i u_i g_i, \qquad
            \langle c^2 \odot g, c^2 \odot g \rangle_w = \sum_i (c_i^2 g_i)\, g_i,

        for tangent :math:`u` (zero on frozen entries, where :math:`c^2 \odot g` is zero
        too): per block of :data:`GRAM_BLOCK` entries, :math:`c^2` is formed once, the
        other vectors' dot products with ``g`` are taken before ``g`` is rescaled, and
        ``g``'s own from its rescaled block, in cache; no quotient by :math:`c`. Seven
        operations per block, where :meth:`rescaled_gram_` takes thirteen for the whole
        matrix. The rescaled ``g`` is that of :meth:`rescaled_`, bit for bit; the column
        equals :meth:`rescaled_gram_`'s to rounding. ``None`` (nothing changed) where the
        operands do not split into blocks or are not all in the working dtype.
        """
        if not vectors or not _splittable(self.x, *vectors):
            return None
        if any(u.dtype != self.dtype for u in vectors):
            return None
        return GradientSweep(self, vectors, index, "column").finish()

    def sweep(self, vectors: Sequence[torch.Tensor], index: int, kind: str) -> GradientSweep | None:
        """The sweep of :meth:`rescaled_column_` (``kind="column"``) or
        :meth:`rescaled_gram_` (``"gram"``), to run block by block as the entries of
        ``vectors[index]`` arrive (:class:`GradientSweep`); ``None`` where those methods
        would not apply, or where blocks are :func:`~._linalg.capped` (few and large: a
        block per arrival would add operators and save nothing)."""
        if capped(self.x.device) or not vectors or not _splittable(self.x, *vectors):
            return None
        working = all(u.dtype == self.dtype for u in vectors)
        if not (working or (kind == "gram" and self._readable(vectors))):
            return None
        return GradientSweep(self, vectors, index, kind)

    @property
    def frozen(self) -> torch.Tensor:
        return self.x == 0

    def _weighted_product(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.weight(x).mul_(u.to(self.dtype)).mul_(v.to(self.dtype))

    def _rescaled(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.scale_squared(x).mul_(u.to(self.dtype))


class GradientSweep:
    r"""One sweep of :class:`_ScaleState` over the blocks of :data:`GRAM_BLOCK` entries
    (:data:`DEVICE_GRAM_BLOCK` off the CPU): with ``kind="column"`` that of
    :meth:`_ScaleState.rescaled_column_`, with ``"gram"`` that of
    :meth:`_ScaleState.gram` (``rescale`` ``None``) or
    :meth:`_ScaleState.rescaled_gram_` (``rescale`` the index of the vector multiplied by
    :math:`c^2` first).

    The blocks are independent: :meth:`block` computes one block's part (and rescales
    that block of ``vectors[rescale]`` in place), in any order, each at most once;
    :meth:`finish` computes the blocks not done yet and adds the parts up in block
    order, so that the result is the same, bit for bit, whatever the order in which the
    blocks were done. The Auto-PGD evaluation computes each block of the gradient as soon
    as the backward pass has written it, while it is in cache
    (:class:`~geoopt_quotient.sharpness.layout.BallLayout`): the flat gradient is then
    written once and never read again by the sweep.
    """

    def __init__(
        self, state: _ScaleState, vectors: Sequence[torch.Tensor], rescale: int | None, kind: str
    ):
        self.state, self.vectors, self.rescale, self.kind = state, tuple(vectors), rescale, kind
        flat_x = state.x.reshape(-1)
        step = GRAM_BLOCK if flat_x.device.type == "cpu" else DEVICE_GRAM_BLOCK
        self.step = block_length(flat_x.numel(), step, flat_x.device)
        self.numel = flat_x.numel()
        self._x = flat_x.split(self.step)
        self._flats = [u.view(-1).split(self.step) for u in vectors]
        size, dtype, device = min(self.step, flat_x.numel()), state.dtype, flat_x.device
        # block-sized buffers, written in place: a new one per block would be mapped and
        # faulted in anew at every block by the allocator (the Gram matrix's quotients
        # u / c of all vectors, and two scratch rows)
        rows = len(vectors) if kind == "gram" else 0
        self._ratios = torch.empty(rows, size, dtype=dtype, device=device)
        self._scratch = torch.empty(2, size, dtype=dtype, device=device)
        self._parts: List[List[torch.Tensor] | None] = [None] * len(self._x)
        self._pairwise = not capped(device)

    @property
    def blocks(self) -> int:
        """The number of blocks."""
        return len(self._x)

    def matches(self, vectors: Sequence[torch.Tensor], rescale: int | None, kind: str) -> bool:
        """Whether this is the sweep of ``vectors`` (the same tensors) ``rescale`` and
        ``kind`` ask for."""
        return (
            kind == self.kind
            and rescale == self.rescale
            and len(vectors) == len(self.vectors)
            and all(a is b for a, b in zip(vectors, self.vectors))
        )

    def block(self, index: int) -> None:
        """Compute block ``index`` (once; nothing if it is done)."""
        if self._parts[index] is None:
            sweep = self._column_block if self.kind == "column" else self._gram_block
            self._parts[index] = sweep(index)

    def finish(self) -> torch.Tensor:
        r"""The blocks not done yet, then the result (float64): the column
        :math:`\langle u_j, c^2 \odot g \rangle_w` or the Gram matrix."""
        for index in range(self.blocks):
            self.block(index)
        parts = [part for block in self._parts for part in block]  # type: ignore[union-attr]
        if self.kind == "column":
            return torch.stack(parts).view(-1, len(self.vectors)).double().sum(0)
        total = torch.zeros(
            len(self.vectors), len(self.vectors), dtype=torch.float64, device=parts[0].device
        )
        for part in parts:
            total += part
        return total

    def _column_block(self, block: int) -> List[torch.Tensor]:
        """:meth:`_ScaleState.rescaled_column_`'s sums of one block."""
        state, index = self.state, self.rescale
        g = self._flats[index][block]
        c2 = state.scale_squared(self._x[block], out=self._scratch[0, : g.numel()])
        column = [torch.dot(u[block], g) if i != index else g for i, u in enumerate(self._flats)]
        rescaled = torch.mul(g, c2, out=self._scratch[1, : g.numel()])
        column[index] = torch.dot(rescaled, g)  # after the others: g is then rescaled
        g.copy_(rescaled)
        return column

    def _gram_block(self, block: int) -> List[torch.Tensor]:
        """:meth:`_ScaleState.gram`'s matrix of one block (``rescale``: that vector's
        block multiplied by :math:`c^2` first)."""
        state = self.state
        x = self._x[block].to(state.dtype)
        scratch = self._scratch[:, : x.numel()]
        scale = state.manifold.scale(x, out=scratch[0])  # a reused buffer
        if self.rescale is not None:  # as rescaled_: c^2 unclamped (zero where frozen)
            self._flats[self.rescale][block].mul_(torch.pow(scale, 2, out=scratch[1]))
        scale.clamp_min_(torch.finfo(state.dtype).tiny)
        rows = self._ratios[:, : scale.numel()]
        for row, flat in zip(rows, self._flats):
            torch.div(flat[block], scale, out=row)
        return [_rows_gram(rows, self._pairwise).double()]


#: Entries per block of :class:`_ScaleState`'s element-wise kernels.
BLOCK = 1 << 20
#: Entries per block of :meth:`_ScaleState.gram` on the CPU: a block of each vector (1 MiB
#: in float32) stays in a core's cache across the block's operations, and the blocks are
#: few enough that their dispatch costs little (on the 11M-entry vectors of an 11M BERT,
#: one thread: the gradient's column sweep 22 ms with blocks of 64k entries, 16 ms with
#: 256k, 19 ms with 1M). In a whole iteration the fastest size depends on the CPU's
#: caches: ``benchmarks/bench_block_sizes.py`` compares sizes in one process.
GRAM_BLOCK = 1 << 18
#: The same on an accelerator, where each block costs kernel launches, not cache misses.
DEVICE_GRAM_BLOCK = 1 << 22
#: Entries per part of the rows in :func:`_rows_gram`'s batched product on an accelerator:
#: a block of :data:`DEVICE_GRAM_BLOCK` entries makes 256 parts, enough thread blocks to
#: stream the rows at the memory's bandwidth.
GRAM_PART = 1 << 14


def _rows_gram(rows: torch.Tensor, pairwise: bool) -> torch.Tensor:
    r""":math:`R R^\top` of a few long rows, in their dtype: with ``pairwise`` its
    :math:`k (k + 1) / 2` distinct entries as dot products, else one batched matrix
    product over parts of the rows.

    On the CPU the dot products cost less than a product, whose output is too small for
    the matrix library's fast path (3 rows of 64k entries: about 46 against 65 us, 1
    thread). Where each operator costs a kernel launch, the rows are split into parts of
    :data:`GRAM_PART` entries, :math:`R = [R_1, \dots, R_p, T]`, and
    :math:`R R^\top = \sum_j R_j R_j^\top + T T^\top`, the :math:`R_j R_j^\top` from
    one batched product of strided views (no copy): a single product of rows this long
    has a :math:`k \times k` output, one tile, which the matrix library computes on one
    thread block, at a small share of the memory bandwidth (on an H200, BERT-base's
    adaptive Gram sweeps took 4 to 5 ms of GPU time per Auto-PGD iteration that way).
    """
    if pairwise:
        k, parts = rows.shape[0], rows.unbind()
        upper = {(i, j): torch.dot(parts[i], parts[j]) for i in range(k) for j in range(i, k)}
        entries = [upper[min(i, j), max(i, j)] for i in range(k) for j in range(k)]
        return torch.stack(entries).view(k, k)
    k, length = rows.shape
    split = length - length % GRAM_PART
    if split == 0:
        return rows @ rows.mT
    head = rows[:, :split].view(k, split // GRAM_PART, GRAM_PART).transpose(0, 1)
    total = torch.bmm(head, head.mT).sum(0)
    if split < length:
        tail = rows[:, split:]
        total.addmm_(tail, tail.mT)
    return total


def _splittable(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the operands split into matching blocks: same shape and device as ``x``,
    contiguous, and no operation on them recorded by autograd."""
    operands = (x, *others)
    if any(t.shape != x.shape or t.device != x.device for t in others):
        return False
    if not all(t.is_contiguous() for t in operands):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in operands))


def _blockwise(
    fn: Callable[..., torch.Tensor], dtype: torch.dtype, x: torch.Tensor, *others: torch.Tensor
) -> torch.Tensor | None:
    """``fn(x, *others)`` evaluated on matching blocks of the flattened tensors and written
    into a new tensor of ``x``'s shape and ``dtype``; ``None`` where the operands do not
    split into matching blocks (other shapes or devices, not contiguous) or when autograd
    records an operation on them.

    Exact for element-wise ``fn``: each entry sees the same operations as with whole
    tensors.
    """
    if not _splittable(x, *others):
        return None
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    flat = [t.reshape(-1) for t in (out, x, *others)]
    for start in range(0, x.numel(), BLOCK):
        block, *inputs = (f[start : start + BLOCK] for f in flat)
        block.copy_(fn(*inputs))
    return out


def _blockwise_sums(fn: Callable[..., torch.Tensor], x: torch.Tensor, *others: torch.Tensor):
    """The sum of the scalars ``fn`` returns on :data:`BLOCK`-sized blocks of the flattened
    operands (nothing of the point's size is written); ``None`` where :func:`_blockwise`
    would not split them."""
    if not _splittable(x, *others):
        return None
    flat = [t.reshape(-1) for t in (x, *others)]
    if x.numel() <= BLOCK:
        return fn(*flat)
    starts = range(0, x.numel(), BLOCK)
    return torch.stack([fn(*(f[start : start + BLOCK] for f in flat)) for start in starts]).sum()
