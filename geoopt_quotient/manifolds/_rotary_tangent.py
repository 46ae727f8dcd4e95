r"""The horizontal projection of :class:`~geoopt_quotient.RotaryGLQuotient` at a fixed
point, as a few batched products per call.

The reference (:meth:`~geoopt_quotient.RotaryGLQuotient._omega`) finds
:math:`\Omega^* \in \mathfrak s` from the right-hand side :math:`B(\xi)` by reading the
rotary coordinates :math:`\langle B, E_l\rangle_F` entry by entry, solving the Schur
system in its eigenbasis and writing :math:`R = \sum_l c_l E_l` back entry by entry. All
of that is linear in :math:`B` and, per point, the same every call; here it is kept as
matrices (:class:`RotaryProjection`, built once per base point):

- the coordinates are one product :math:`b = \operatorname{vec}(B)\, E` with the
  :math:`h^2 \times r` matrix :math:`E` of the basis (:math:`E_{(a_s, b_s), l} =
  c_{ls}`), shared by every head;
- the Schur solve is one batched product with :math:`K^+ = V \operatorname{diag}(w)
  V^\top`, :math:`w_i = 1/\lambda_i` (zero where :math:`\lambda_i` vanishes to rounding,
  as the reference's minimum-norm choice);
- :math:`R` is one product :math:`\operatorname{vec}(R) = E c`;
- the non-rotary block (:math:`k = h - r > 0`) is the reference's Sylvester elimination,
  batched products of the same kept matrices.

Built by :meth:`~geoopt_quotient.RotaryGLQuotient.batched_kernels`
for :class:`~geoopt_quotient.manifolds._gl_tangent.GLTangentSpace`, which reads it with
:math:`B` in transposed form (:meth:`RotaryProjection.transposed_omega`): for the
Riemannian gradient, :math:`B(\nabla_F K_F) = D^\top`, :math:`D = H^\top\nabla_H -
\nabla_G^\top G` (the metric's factors cancel the conversion's).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class RotaryProjection(NamedTuple):
    r"""The point's matrices of the projection, flattened to one batch dimension ``B``
    (the heads), in the projection's precision (float64 for float32 points).

    ``basis`` is :math:`E` with rows in the order of :math:`\operatorname{vec}(B^\top)`
    (so that :math:`D` is read without a transpose), ``(h^2, r)``; ``pseudo_inverse``
    :math:`K^+`, ``(B, r, r)``; the rest the reference's Sylvester data of the
    non-rotary block (``None`` for :math:`k = 0`)."""

    basis: torch.Tensor
    pseudo_inverse: torch.Tensor
    rotary_dim: int
    left: Optional[torch.Tensor] = None  # P_L (B, k, k)
    right: Optional[torch.Tensor] = None  # P_R
    denom: Optional[torch.Tensor] = None  # lambda_i + mu_j (inf where degenerate)
    ta1: Optional[torch.Tensor] = None  # P_L^T A1[N, :]   (B, k, h)
    ta2: Optional[torch.Tensor] = None  # P_L^T A2[N, :]
    tb1: Optional[torch.Tensor] = None  # B1[:, N] P_R     (B, h, k)
    tb2: Optional[torch.Tensor] = None  # B2[:, N] P_R

    def part(self, start: int, stop: int) -> RotaryProjection:
        """The matrices of the heads ``start:stop`` (the basis shared)."""
        sliced = (None if t is None else t[start:stop] for t in self[3:])
        return RotaryProjection(
            self.basis, self.pseudo_inverse[start:stop], self.rotary_dim, *sliced
        )

    def transposed_omega(self, d: torch.Tensor) -> torch.Tensor:
        r""":math:`T = \Omega^{*\top}` (``(B, h, h)``) for the right-hand side :math:`B =
        d^\top`, ``d`` contiguous ``(B, h, h)`` in any dtype (computed in the
        projection's): the interface of
        :class:`~geoopt_quotient.manifolds._gl_tangent.ProjectionKernel`."""
        return self.omega_of_transposed(d.to(self.basis.dtype)).mT

    def omega_of_transposed(self, d: torch.Tensor) -> torch.Tensor:
        r""":math:`\Omega^*` (``(B, h, h)``, a new tensor) for the right-hand side
        :math:`B = d^\top`, ``d`` contiguous ``(B, h, h)`` in the projection's dtype."""
        count, rank = d.shape[0], d.shape[-1]
        coordinates = d.view(count, rank * rank) @ self.basis  # <B, E_l>
        r = self.rotary_dim
        y0 = None
        if self.left is not None:
            rhs_n = d[:, r:, r:].mT
            y0 = torch.bmm(torch.bmm(self.left.mT, rhs_n), self.right) / self.denom
            # <Z_l, Y0> = <A~1^T Y0 B~1^T + A~2^T Y0 B~2^T, E_l>, read from its transpose
            seen = torch.bmm(torch.bmm(self.tb1, y0.mT), self.ta1)
            seen = torch.baddbmm(seen, torch.bmm(self.tb2, y0.mT), self.ta2)
            coordinates = torch.addmm(
                coordinates, seen.view(count, -1), self.basis, beta=1, alpha=-1
            )
        c = torch.bmm(coordinates.unsqueeze(1), self.pseudo_inverse)  # K^+ symmetric
        omega = (c.view(count, -1) @ self.basis.T).view(count, rank, rank).mT
        if y0 is None:
            return omega
        omega = omega.contiguous()
        moved = torch.bmm(torch.bmm(self.ta1, omega), self.tb1)
        moved = torch.baddbmm(moved, torch.bmm(self.ta2, omega), self.tb2)
        block = torch.bmm(torch.bmm(self.left, y0 - moved / self.denom), self.right.mT)
        omega[:, r:, r:] = block
        return omega


def rotary_projection(system, basis, rotary_dim: int) -> RotaryProjection:
    """The :class:`RotaryProjection` of a :class:`~geoopt_quotient.RotaryGLQuotient` at
    one point from the reference's factorised system there (``system``, with the
    coefficients ``a1`` and the Schur system's eigenbasis ``schur_values``,
    ``schur_vectors``; for ``rotary_dim`` below the rank, the Sylvester data ``left,
    right, denom, ta1, ta2, tb1, tb2`` of the non-rotary block) and the rotary basis of
    the Lie algebra (``basis``: ``rows``, ``cols``, ``coefs``), built once per point."""
    high, rank = system.a1.dtype, system.a1.shape[-1]
    heads = system.schur_values.shape[:-1]

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, *t.shape[len(heads) :])

    values, vectors = flat(system.schur_values), flat(system.schur_vectors)
    scale = values.abs().amax(-1, keepdim=True)
    ok = values > values.shape[-1] * torch.finfo(values.dtype).eps * scale
    weights = torch.where(ok, 1 / torch.where(ok, values, torch.ones_like(values)), 0.0)
    pseudo_inverse = (vectors * weights[:, None, :]) @ vectors.mT
    matrix = _basis_matrix(basis, rank, high, values.device)
    if rank == rotary_dim:
        return RotaryProjection(matrix, pseudo_inverse, rotary_dim)
    sylvester = (system.left, system.right, system.denom, system.ta1, system.ta2)
    sylvester += (system.tb1, system.tb2)
    return RotaryProjection(matrix, pseudo_inverse, rotary_dim, *map(flat, sylvester))


def _basis_matrix(basis, rank: int, dtype: torch.dtype, device) -> torch.Tensor:
    r""":math:`E`, ``(h^2, r)``, of the rotary ``basis``: row :math:`b h + a` (the entry
    :math:`(b, a)` of :math:`B^\top`) of column :math:`l` is :math:`\sum_s c_{ls}
    [(a_{ls}, b_{ls}) = (a, b)]`."""
    out = torch.zeros(rank * rank, basis.rows.shape[0], dtype=torch.float64)
    columns = torch.arange(basis.rows.shape[0])
    for s in range(2):
        out.index_put_(
            (basis.cols[:, s] * rank + basis.rows[:, s], columns),
            basis.coefs[:, s],
            accumulate=True,
        )
    return out.to(device=device, dtype=dtype)
