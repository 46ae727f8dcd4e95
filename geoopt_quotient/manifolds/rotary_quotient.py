"""The quotient of matrix pairs by the subgroup of GL(h) that commutes with rotary rotations."""

from __future__ import annotations

import functools
from typing import NamedTuple, Tuple, Union

import torch

from .._checks import check_choice, check_positive_int
from ._gl_tangent import BatchedKernels
from ._rotary_tangent import RotaryProjection, rotary_projection
from .gl_quotient import GLQuotient, PointState

__all__ = ["RotaryGLQuotient"]

#: How a rotary embedding pairs the dimensions of a head into rotation planes.
PAIRINGS = ("half", "interleaved")
#: Entries of the temporary of :meth:`RotaryGLQuotient._schur_correction` (float64:
#: 128 MiB), over the heads it handles at once.
SCHUR_CHUNK_ENTRIES = 1 << 24


class _Basis(NamedTuple):
    """The rotary part of the Lie algebra: ``2 * planes`` matrices, each the sum of two
    elementary matrices :math:`\\sum_s c_s e_{a_s} e_{b_s}^\\top`."""

    rows: torch.Tensor  # (d, 2): a_s
    cols: torch.Tensor  # (d, 2): b_s
    coefs: torch.Tensor  # (d, 2): c_s


class _System(NamedTuple):
    """What the projection needs at one point, batched: the coefficients of the
    operator :math:`L`, the eigenbases of the non-rotary block and the Schur system."""

    a1: torch.Tensor
    b1: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    left: torch.Tensor  # P_L (k x k)
    right: torch.Tensor  # P_R (k x k)
    denom: torch.Tensor  # lambda_i + mu_j (k x k)
    ta1: torch.Tensor  # P_L^T A1[N, :] (k x h)
    ta2: torch.Tensor  # P_L^T A2[N, :]
    tb1: torch.Tensor  # B1[:, N] P_R (h x k)
    tb2: torch.Tensor  # B2[:, N] P_R
    schur_values: torch.Tensor
    schur_vectors: torch.Tensor


class RotaryGLQuotient(GLQuotient):
    r"""Pairs of full-rank matrices modulo the rotary-commuting subgroup of :math:`\mathrm{GL}(h)`.

    The total space, its metrics (inv or mix) and its Christoffel symbols are those of
    :class:`GLQuotient`; only the group is smaller. Rotary position embeddings rotate
    the first ``rotary_dim`` = :math:`r` dimensions of each query and key head in
    :math:`r/2` planes, by angles proportional to the position. The matrices
    :math:`A` with :math:`(G A^{-1}, H A^\top)` still leaving the attention scores
    unchanged are those that commute with every such rotation: on each plane
    :math:`p` a block :math:`a_p I + b_p J` (:math:`J` the rotation by a right angle,
    :math:`a_p + i b_p \in \mathbb{C}^*`), and on the :math:`k = h - r` dimensions that
    do not rotate any invertible matrix, block-diagonally:

    .. math::

        S = (\mathbb{C}^*)^{r/2} \times \mathrm{GL}(k), \qquad
        \dim S = r + k^2 .

    ``pairing="half"`` is the convention of Hugging Face's ``rotate_half`` (dimension
    :math:`j` with :math:`j + r/2`, Llama, GPT-NeoX, Phi); ``"interleaved"`` pairs
    :math:`2j` with :math:`2j + 1` (GPT-J's ``rotate_every_two``).

    **Vertical space.** :math:`\{v(\Omega) = (-G\Omega, H\Omega^\top) : \Omega \in
    \mathfrak s\}`, with :math:`\mathfrak s` the Lie algebra of :math:`S`.

    **Horizontal projection.** :math:`\xi \mapsto \xi - v(\Omega^*)` with
    :math:`\Omega^* \in \mathfrak s` making the result metric-orthogonal to
    :math:`v(\mathfrak s)`. With the metric's right factors :math:`W_G, W_H`
    (inv: :math:`S_G^{-1}, S_H^{-1}`; mix: :math:`S_H, S_G`), orthogonality to
    :math:`v(E)` reads :math:`\langle E, L(\Omega^*) - B(\xi)\rangle_F = 0` for every
    :math:`E \in \mathfrak s`, where

    .. math::

        B(\xi) = W_H \xi_H^\top H - G^\top \xi_G W_G, \qquad
        L(\Omega) = G^\top G\, \Omega\, W_G + W_H\, \Omega\, H^\top H

    (:math:`L` is Frobenius-self-adjoint and positive definite: :math:`\langle E,
    L(\Omega)\rangle_F = \langle v(E), v(\Omega)\rangle`). Writing :math:`\Omega = R +
    N` (:math:`R` on the rotary planes, :math:`r` coefficients; :math:`N` the
    non-rotary block), the :math:`N` block is a generalised Sylvester equation
    :math:`A_1 N B_1 + A_2 N B_2 = C` solved in the eigenbases of its two pencils, and
    eliminating it leaves an :math:`r \times r` symmetric positive definite Schur
    system for :math:`R`. Both are factorised once per point (:math:`O(r^2 k^2 + k^3)`
    per head) and reused by every projection at that point.

    **Geodesics.** :math:`S` acts by isometries of the total space, so a total-space
    geodesic with horizontal initial velocity stays horizontal and projects to a
    geodesic of the quotient; the second-order retraction :math:`X + \xi -
    \tfrac12\Gamma_X(\xi, \xi)` and the RK4 exponential map of :class:`GLQuotient`
    (whose :math:`\Gamma` is the total space's Levi-Civita connection, valid for every
    vector, not only GL(h)-horizontal ones) therefore serve unchanged.

    Parameters
    ----------
    n, m : int
        Rows of :math:`G` and :math:`H`.
    rotary_dim : int
        The even number :math:`r \ge 2` of rotating dimensions, the first ones of each
        head; :math:`r \le h`.
    pairing : {"half", "interleaved"}
        Which dimensions share a rotation plane (see above).
    metric, eps, retraction, expmap_steps
        As for :class:`GLQuotient`.

    Examples
    --------
    A rotary-commuting element leaves :math:`G H^\top` and the metric unchanged:

    >>> import torch
    >>> from geoopt_quotient import RotaryGLQuotient
    >>> _ = torch.manual_seed(0)
    >>> manifold = RotaryGLQuotient(6, 5, rotary_dim=2, metric="inv")
    >>> x = manifold.random(6 + 5, 3, dtype=torch.float64)
    >>> u = manifold.proju(x, torch.randn_like(x))
    >>> a = manifold.random_element((), dtype=torch.float64, h=3)
    >>> y, v = manifold.act(x, a), manifold.act(u, a)
    >>> torch.allclose(manifold.product(x), manifold.product(y))
    True
    >>> torch.allclose(manifold.norm(x, u), manifold.norm(y, v))
    True
    >>> manifold.dim(3)  # (n + m) h - (r + k^2)
    30
    """

    name = "RotaryGLQuotient"

    def __init__(
        self,
        n: int,
        m: int,
        rotary_dim: int,
        pairing: str = "half",
        metric: str = "mix",
        eps: float = 0.0,
        *,
        retraction: str = "second_order",
        expmap_steps: int = 16,
    ):
        super().__init__(n, m, metric, eps, retraction=retraction, expmap_steps=expmap_steps)
        self.rotary_dim = check_positive_int(rotary_dim, "rotary_dim")
        if rotary_dim % 2:
            raise ValueError(f"`rotary_dim` must be even, got {rotary_dim}")
        self.pairing = check_choice(pairing, PAIRINGS, "pairing")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rotary_dim={self.rotary_dim}, pairing={self.pairing!r}"

    @property
    def subgroup(self) -> str:
        """A readable name of the group, e.g. ``"rotary C*^4 x GL(k)"``."""
        return f"rotary C*^{self.rotary_dim // 2} x GL(h-{self.rotary_dim})"

    # ------------------------------------------------------------------ the group
    def planes(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The two dimensions of each rotation plane (two integer tensors of length r/2)."""
        half = self.rotary_dim // 2
        j = torch.arange(half)
        if self.pairing == "half":
            return j, j + half
        return 2 * j, 2 * j + 1

    @functools.cached_property
    def _basis(self) -> _Basis:
        first, second = self.planes()
        one = torch.ones_like(first, dtype=torch.float64)
        # a_p: e_j e_j^T + e_j' e_j'^T;  b_p: e_j' e_j^T - e_j e_j'^T
        rows = torch.cat((torch.stack((first, second), -1), torch.stack((second, first), -1)))
        cols = torch.cat((torch.stack((first, second), -1), torch.stack((first, second), -1)))
        coefs = torch.cat((torch.stack((one, one), -1), torch.stack((one, -one), -1)))
        return _Basis(rows, cols, coefs)

    def project_algebra(self, omega: torch.Tensor) -> torch.Tensor:
        r"""Frobenius-orthogonal projection of :math:`h \times h` matrices onto
        :math:`\mathfrak s`: per rotary plane the nearest :math:`aI + bJ`, the
        non-rotary block kept, every other entry zeroed."""
        first, second = self.planes()
        out = torch.zeros_like(omega)
        r = self.rotary_dim
        out[..., r:, r:] = omega[..., r:, r:]
        a = 0.5 * (omega[..., first, first] + omega[..., second, second])
        b = 0.5 * (omega[..., second, first] - omega[..., first, second])
        out[..., first, first] = a
        out[..., second, second] = a
        out[..., second, first] = b
        out[..., first, second] = -b
        return out

    def random_element(
        self,
        batch_shape: Tuple[int, ...],
        *,
        h: int,
        max_condition: float = 4.0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        r"""Random elements of :math:`S` with spectral condition number at most
        ``max_condition``: per plane :math:`|a + ib|` log-uniform in
        :math:`[c^{-1/2}, c^{1/2}]` at a uniform angle, and on the non-rotary block
        :math:`U \Sigma V^\top` with singular values in the same range.

        Parameters
        ----------
        batch_shape : tuple of int
            Leading shape (one element per point of a batch).
        h : int
            The rank (head size), at least ``rotary_dim``.
        max_condition : float
            Bound on the spectral condition number of each element.
        generator : torch.Generator, optional
            Source of randomness.
        dtype : torch.dtype
            Dtype of the result (drawn in float64).

        Returns
        -------
        torch.Tensor
            Shape ``(*batch_shape, h, h)``, block-diagonal in the rotary planes and the
            non-rotary block.
        """
        self._check_rank(h)
        first, second = self.planes()
        shape = tuple(batch_shape)
        f64 = torch.float64
        half = self.rotary_dim // 2
        modulus = max_condition ** (torch.rand(*shape, half, generator=generator, dtype=f64) - 0.5)
        angle = 2 * torch.pi * torch.rand(*shape, half, generator=generator, dtype=f64)
        a, b = modulus * torch.cos(angle), modulus * torch.sin(angle)
        out = torch.zeros(*shape, h, h, dtype=f64)
        out[..., first, first], out[..., second, second] = a, a
        out[..., second, first], out[..., first, second] = b, -b
        k = h - self.rotary_dim
        if k:
            u, _ = torch.linalg.qr(torch.randn(*shape, k, k, generator=generator, dtype=f64))
            v, _ = torch.linalg.qr(torch.randn(*shape, k, k, generator=generator, dtype=f64))
            s = max_condition ** (torch.rand(*shape, k, generator=generator, dtype=f64) - 0.5)
            out[..., self.rotary_dim :, self.rotary_dim :] = u @ torch.diag_embed(s) @ v.mT
        return out.to(dtype)

    def group_label(self, rank: int) -> str:
        """``"rotary C*^(r/2) x GL(k) [r + k²]"`` (``k = h - r`` non-rotating dimensions)."""
        r, k = self.rotary_dim, rank - self.rotary_dim
        rest = f" x GL({k})" if k else ""
        return f"rotary C*^{r // 2}{rest} [{r + k * k}]"

    def stack_key(self) -> None:
        """``None``: rotary points are never stacked with the GL(h) kernels' batches."""
        return None

    def dim(self, rank: int) -> int:
        r"""Dimension :math:`(n + m) h - r - (h - r)^2` of the quotient for rank ``h``."""
        self._check_rank(rank)
        k = rank - self.rotary_dim
        return (self.n + self.m) * rank - self.rotary_dim - k * k

    def _check_rank(self, rank: int) -> None:
        if rank < self.rotary_dim:
            raise ValueError(f"rank h = {rank} is below rotary_dim = {self.rotary_dim}")

    def _check_shape(
        self, shape: Tuple[int, ...], name: str
    ) -> Union[Tuple[bool, str | None], bool]:
        ok, reason = super()._check_shape(shape, name)
        if ok and shape[-1] < self.rotary_dim:
            return False, (
                f"`{name}` has rank h = {shape[-1]}, below rotary_dim = {self.rotary_dim}"
            )
        return ok, reason

    # ------------------------------------------------------------------ projection
    def _horizontality_terms(
        self, x: torch.Tensor, u: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """:math:`P_{\\mathfrak s} B(\\xi)` and zero: equal iff ``u`` is horizontal."""
        st = PointState(self, x)
        u_g, u_h = self.factors(u.to(st.dtype))
        w_g, w_h = self._blocks(st)
        residual = self.project_algebra(w_h @ (u_h.mT @ st.h) - (st.g.mT @ u_g) @ w_g)
        return residual, torch.zeros_like(residual)

    def _prepare(self, st: PointState) -> None:
        super()._prepare(st)
        self._system(st)

    def _system(self, st: PointState) -> _System:
        """The factorised projection equations at ``st`` (built once, kept in ``st``)."""
        system = st.__dict__.get("_rotary_system")
        if system is None:
            system = self._build_system(st)
            st.__dict__["_rotary_system"] = system
        return system

    def _build_system(self, st: PointState) -> _System:
        high = st.high
        gtg, hth = (s.to(high) for s in st.grams_unrelaxed)
        s_g, s_h = st.grams_exact
        if self.metric == "inv":
            w_g, w_h = (torch.cholesky_inverse(torch.linalg.cholesky(s)) for s in (s_g, s_h))
        else:
            w_g, w_h = s_h, s_g
        a1, b1, a2, b2 = gtg, w_g, w_h, hth
        schur = self._rotary_block(a1, b1, a2, b2)
        r, k = self.rotary_dim, a1.shape[-1] - self.rotary_dim
        if k:
            left = _pencil_basis(a2[..., r:, r:], a1[..., r:, r:])
            right = _pencil_basis(b1[..., r:, r:], b2[..., r:, r:])
            lam = (left.mT @ a1[..., r:, r:] @ left).diagonal(dim1=-2, dim2=-1)
            mu = (right.mT @ b2[..., r:, r:] @ right).diagonal(dim1=-2, dim2=-1)
            denom = lam[..., :, None] + mu[..., None, :]
            # directions where both pencils vanish (relaxed rank-deficient points) move
            # nothing: dividing by infinity gives them the minimum-norm zero
            tol = k * torch.finfo(high).eps * denom.amax((-2, -1), keepdim=True)
            denom = torch.where(denom > tol, denom, torch.full_like(denom, torch.inf))
            mixed = (
                left.mT @ a1[..., r:, :],
                left.mT @ a2[..., r:, :],
                b1[..., :, r:] @ right,
                b2[..., :, r:] @ right,
            )
            schur = schur - self._schur_correction(mixed, denom)
        else:
            empty = a1.new_zeros(*a1.shape[:-2], 0, 0)
            left = right = denom = empty
            mixed = (a1.new_zeros(*a1.shape[:-2], 0, a1.shape[-1]),) * 2
            mixed += (a1.new_zeros(*a1.shape[:-2], a1.shape[-1], 0),) * 2
        values, vectors = torch.linalg.eigh(0.5 * (schur + schur.mT))
        return _System(a1, b1, a2, b2, left, right, denom, *mixed, values, vectors)

    def _rotary_block(self, a1, b1, a2, b2) -> torch.Tensor:
        r""":math:`K_{lk} = \langle L(E_k), E_l\rangle_F` on the rotary basis, from the
        entries of the coefficients: :math:`\sum_{s,t} c_{ks} c_{lt} (A_1[a_{lt}, a_{ks}]
        B_1[b_{ks}, b_{lt}] + A_2[\cdot] B_2[\cdot])`, :math:`O(r^2)` per head."""
        basis = self._basis
        rows, cols = basis.rows.to(a1.device), basis.cols.to(a1.device)
        coefs = basis.coefs.to(device=a1.device, dtype=a1.dtype)
        out = 0
        for s in range(2):
            for t in range(2):
                ra, ca = rows[:, t][:, None], rows[:, s][None, :]
                rb, cb = cols[:, s][None, :], cols[:, t][:, None]
                weight = coefs[:, t][:, None] * coefs[:, s][None, :]
                first = a1[..., ra, ca] * b1[..., rb, cb]
                out = out + weight * (first + a2[..., ra, ca] * b2[..., rb, cb])
        return out

    def _schur_correction(self, mixed, denom: torch.Tensor) -> torch.Tensor:
        r""":math:`\sum_{ij} Z_l[i, j] Z_k[i, j] / D_{ij}`, with :math:`Z_l = P_L^\top
        [L(E_l)]_{NN} P_R = \sum_s c_{ls}(\tilde A_1[:, a_{ls}] \tilde B_1[b_{ls}, :] +
        \tilde A_2[:, a_{ls}] \tilde B_2[b_{ls}, :])`: the :math:`Z` of a few heads at a
        time (:math:`r k^2` entries per head), never of the whole batch."""
        ta1, ta2, tb1, tb2 = (t.reshape(-1, *t.shape[-2:]) for t in mixed)
        flat_denom = denom.reshape(-1, denom.shape[-2] * denom.shape[-1])
        basis = self._basis
        rows, cols = basis.rows.to(ta1.device), basis.cols.to(ta1.device)
        coefs = basis.coefs.to(device=ta1.device, dtype=ta1.dtype)
        per = max(1, SCHUR_CHUNK_ENTRIES // (rows.shape[0] * flat_denom.shape[-1]))
        parts = []
        for start in range(0, ta1.shape[0], per):
            chunk = slice(start, start + per)
            z = 0
            for s in range(2):
                a_idx, b_idx, c = rows[:, s], cols[:, s], coefs[:, s][:, None, None]
                z = z + c * (
                    ta1[chunk][..., a_idx].mT[..., :, :, None] * tb1[chunk][..., b_idx, None, :]
                    + ta2[chunk][..., a_idx].mT[..., :, :, None] * tb2[chunk][..., b_idx, None, :]
                )
            z = z.flatten(-2)
            parts.append((z / flat_denom[chunk][:, None, :]) @ z.mT)
        return torch.cat(parts).reshape(*denom.shape[:-2], rows.shape[0], rows.shape[0])

    def batched_kernels(self) -> BatchedKernels:
        """GL(h)'s :meth:`~GLQuotient.batched_kernels` with the subgroup's horizontal
        projection (:class:`~geoopt_quotient.manifolds._rotary_tangent.RotaryProjection`,
        built from the factorised system of :meth:`_omega`) in place of GL(h)'s; the
        geodesic is the total space's, GL(h)'s (class docstring).

        Returns
        -------
        BatchedKernels
            The rotary projection's kernel and ``span_geodesic=True``.
        """
        return BatchedKernels(self._rotary_projection, True)

    def _rotary_projection(self, st: PointState) -> RotaryProjection:
        """The batched kernel of the horizontal projection at ``st``'s point."""
        return rotary_projection(self._system(st), self._basis, self.rotary_dim)

    def _proju(self, st: PointState, u: torch.Tensor) -> torch.Tensor:
        u_g, u_h = self.factors(u.to(st.dtype))
        omega = self._omega(st, u_g, u_h)
        return self._shift_along_orbit(st, u_g, u_h, omega.to(st.dtype)).to(u.dtype)

    def _omega(self, st: PointState, u_g: torch.Tensor, u_h: torch.Tensor) -> torch.Tensor:
        r""":math:`\Omega^* \in \mathfrak s` with :math:`P_{\mathfrak s} L(\Omega^*) =
        P_{\mathfrak s} B(\xi)` (see the class docstring)."""
        sy = self._system(st)
        high = sy.a1.dtype
        g, h = st.g.to(high), st.h.to(high)
        rhs = sy.a2 @ (u_h.to(high).mT @ h) - (g.mT @ u_g.to(high)) @ sy.b1
        basis = self._basis
        rows, cols = basis.rows.to(rhs.device), basis.cols.to(rhs.device)
        coefs = basis.coefs.to(device=rhs.device, dtype=high)
        b_rot = (coefs * rhs[..., rows, cols]).sum(-1)  # <B, E_l>
        r = self.rotary_dim
        k = rhs.shape[-1] - r
        if k:
            y0 = (sy.left.mT @ rhs[..., r:, r:] @ sy.right) / sy.denom
            # <Z_l, Y0> = sum_s c_ls (A~1^T Y0 B~1^T + A~2^T Y0 B~2^T)[a_ls, b_ls]
            seen = sy.ta1.mT @ y0 @ sy.tb1.mT + sy.ta2.mT @ y0 @ sy.tb2.mT
            b_rot = b_rot - (coefs * seen[..., rows, cols]).sum(-1)
        c = sy.schur_vectors @ _safe_divide(sy.schur_vectors.mT @ b_rot[..., None], sy.schur_values)
        c = c[..., 0]
        omega = torch.zeros_like(rhs)
        # R = sum_l c_l E_l
        for s in range(2):
            omega[..., rows[:, s], cols[:, s]] += coefs[:, s] * c
        if k:
            # sum_l c_l Z_l = A~1 R B~1 + A~2 R B~2, R the rotary part of omega so far
            moved = sy.ta1 @ omega @ sy.tb1 + sy.ta2 @ omega @ sy.tb2
            omega[..., r:, r:] = sy.left @ (y0 - moved / sy.denom) @ sy.right.mT
        return omega


def _pencil_basis(spd: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    r""":math:`P` with :math:`P^\top \text{spd}\, P = I` and :math:`P^\top \text{other}\, P`
    diagonal (``spd = C C^T``; :math:`P = C^{-\top} Q` with :math:`Q` the eigenvectors
    of :math:`C^{-1}\,\text{other}\,C^{-\top}`)."""
    chol = torch.linalg.cholesky(spd)
    inner = torch.linalg.solve_triangular(chol, other, upper=False)
    inner = torch.linalg.solve_triangular(chol, inner.mT, upper=False)
    _, q = torch.linalg.eigh(0.5 * (inner + inner.mT))
    return torch.linalg.solve_triangular(chol.mT, q, upper=True)


def _safe_divide(numerator: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``numerator / values[..., :, None]``, zero where ``values`` vanish to rounding (a
    degenerate orbit of a relaxed, rank-deficient point: every choice gives the same
    vertical vector, and zero is the minimum-norm one)."""
    scale = values.abs().amax(-1, keepdim=True)
    tol = values.shape[-1] * torch.finfo(values.dtype).eps * scale
    ok = values > tol
    safe = torch.where(ok, values, torch.ones_like(values))
    return torch.where(ok[..., None], numerator / safe[..., None], 0.0)
