"""Small batched linear-algebra kernels shared by the quotient manifolds.

Everything here works on tensors of shape ``(..., h, h)`` on the tensor's own
device; no SciPy, no Python loop over the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "CAP_ON_CPU",
    "MAX_BLOCKS",
    "Eigenbasis",
    "add_product",
    "block_length",
    "capped",
    "compute_dtype",
    "eigenbasis_spd_product",
    "gram",
    "safe_divide_eigensum",
    "solve_sylvester_eigenbases",
    "solve_sylvester_shifted",
    "sym",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which h x h linear algebra runs: at least float32."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


#: Largest product per batch entry (rows x inner x columns multiply-adds) that
#: :func:`add_product` forms in a new tensor on the CPU (see there).
SMALL_PRODUCT_FLOPS = 1 << 18


def add_product(
    out: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0
) -> torch.Tensor:
    r"""``out`` :math:`= \text{base} + \alpha\, a b` for 3-D batches (``base`` may be
    ``out`` itself); returns ``out``.

    ``baddbmm`` is one kernel call for the whole batch on a GPU, but on a CPU it runs one
    matrix product per batch entry when it accumulates into an existing or strided
    output. For small products (at most :data:`SMALL_PRODUCT_FLOPS` multiply-adds each,
    e.g. the h x h coefficients of heads with h <= 32) that dispatch costs more than the
    product: there the product goes into a new tensor (one batched call) and is added.
    Measured with 1 thread (``benchmarks/bench_small_kernels.py``), :math:`n \times h`
    by :math:`h \times h`: 8 heads with n = 33, h = 8, 14.8 us against 5.5 us; 144 heads
    with n = 65, h = 16, 252 us against 94 us; 4 heads with n = 769, h = 64, 182 us
    against 209 us (so ``baddbmm`` there).
    """
    small = a.shape[-2] * a.shape[-1] * b.shape[-1] <= SMALL_PRODUCT_FLOPS
    if out.device.type == "cpu" and small:
        return torch.add(base, torch.bmm(a, b), alpha=alpha, out=out)
    if base is out:
        return out.baddbmm_(a, b, alpha=alpha)
    return torch.baddbmm(base, a, b, alpha=alpha, out=out)


_CONVERT_CHUNK_BYTES = 1 << 22


def gram(factor: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    r"""Gram matrix :math:`F^\top F` of ``factor`` (``(..., r, h)``).

    Computed in ``dtype``, by default :func:`compute_dtype` of the factor's dtype.
    """
    dtype = compute_dtype(factor.dtype) if dtype is None else dtype
    if factor.dtype == dtype or factor.dim() < 3:
        f = factor.to(dtype)
        return f.mT @ f
    return _converted_gram(factor, dtype)


def _converted_gram(factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r""":math:`F^\top F` in ``dtype`` for a batch of factors of another dtype.

    The factors are converted a few matrices at a time (about 4 MiB of converted copy
    per batched product), so the converted copy never exists in full: that would add a
    pass over the factor and a freshly allocated (page-faulted) buffer of its size.
    """
    flat = factor.reshape(-1, *factor.shape[-2:])
    per_matrix = factor.shape[-2] * factor.shape[-1] * dtype.itemsize
    grams = []
    for chunk in flat.split(max(1, _CONVERT_CHUNK_BYTES // max(1, per_matrix))):
        converted = chunk.to(dtype)
        grams.append(converted.mT @ converted)
    return torch.cat(grams).reshape(*factor.shape[:-2], *grams[0].shape[-2:])


def sym(a: torch.Tensor) -> torch.Tensor:
    """Symmetric part of a batch of square matrices."""
    return 0.5 * (a + a.mT)


class Eigenbasis(NamedTuple):
    r"""A batch of diagonalisable matrices :math:`A = P \operatorname{diag}(\lambda) P^{-1}`."""

    values: torch.Tensor
    r"""The eigenvalues :math:`\lambda`, shape ``(..., h)``."""
    vectors: torch.Tensor
    """The eigenvectors :math:`P` (columns), shape ``(..., h, h)``."""
    inverse: torch.Tensor
    """:math:`P^{-1}`, shape ``(..., h, h)``."""

    def transpose(self) -> Eigenbasis:
        r"""The eigenbasis of :math:`A^\top = P^{-\top} \operatorname{diag}(\lambda) P^\top`."""
        return Eigenbasis(self.values, self.inverse.mT, self.vectors.mT)


def eigenbasis_spd_product(s: torch.Tensor, p: torch.Tensor) -> Eigenbasis:
    r"""Eigenbasis of :math:`A = S P` for :math:`S` SPD and :math:`P` symmetric PSD.

    With :math:`S = L L^\top` (Cholesky), :math:`A = L (L^\top P L) L^{-1}` is similar to
    the symmetric :math:`L^\top P L = Q \Lambda Q^\top` (``eigh``), so
    :math:`A = (L Q) \Lambda (L Q)^{-1}` with :math:`(L Q)^{-1} = Q^\top L^{-1}
    = (L^{-\top} Q)^\top`: real, non-negative eigenvalues. One batched Cholesky, one
    batched ``eigh`` and one triangular solve; everything after that is matrix products.
    """
    chol = torch.linalg.cholesky(s)
    values, q = torch.linalg.eigh(chol.mT @ p @ chol)
    inverse = torch.linalg.solve_triangular(chol.mT, q, upper=True).mT
    return Eigenbasis(values, chol @ q, inverse)


def solve_sylvester_eigenbases(
    a: Eigenbasis, b: Eigenbasis, rhs: torch.Tensor, *, degenerate: bool = False
) -> torch.Tensor:
    r"""Solve :math:`A Y + Y B = R` for diagonalised :math:`A` and :math:`B`.

    With :math:`A = P_a \Lambda P_a^{-1}` and :math:`B = P_b M P_b^{-1}`,

    .. math::

        Y = P_a W P_b^{-1}, \qquad
        W_{ij} = \frac{(P_a^{-1} R P_b)_{ij}}{\lambda_i + \mu_j}.

    Four batched :math:`h \times h` products. ``degenerate=True`` sets :math:`W_{ij} = 0`
    where :math:`\lambda_i + \mu_j` vanishes (see :func:`safe_divide_eigensum`);
    otherwise every :math:`\lambda_i + \mu_j` must be nonzero.
    """
    w = a.inverse @ rhs @ b.vectors
    if degenerate:
        w = safe_divide_eigensum(w, a.values, b.values)
    else:
        w = w / (a.values[..., :, None] + b.values[..., None, :])
    return a.vectors @ w @ b.inverse


def safe_divide_eigensum(
    numerator: torch.Tensor, row_vals: torch.Tensor, col_vals: torch.Tensor
) -> torch.Tensor:
    r"""``numerator[i, j] / (row_vals[i] + col_vals[j])``, and 0 where the sum vanishes.

    The sum vanishes (to rounding) only for directions in which both factors are
    rank-deficient; the orbit is degenerate there, every value of the unknown gives the
    same (zero) vertical vector, and 0 is the minimum-norm choice.
    """
    denom = row_vals.clamp_min(0)[..., :, None] + col_vals.clamp_min(0)[..., None, :]
    scale = denom.amax(dim=(-2, -1), keepdim=True)
    tol = denom.shape[-1] * torch.finfo(denom.dtype).eps * scale
    ok = denom > tol
    return torch.where(ok, numerator / torch.where(ok, denom, torch.ones_like(denom)), 0.0)


def solve_sylvester_shifted(
    s_g: torch.Tensor, s_h: torch.Tensor, rhs: torch.Tensor, eps: float
) -> torch.Tensor:
    r"""Solve :math:`(I - \varepsilon S_G^{-1}) X + X (I - \varepsilon S_H^{-1}) = B`.

    This is the mix-metric horizontal-projection equation
    :math:`G^\top G\, X S_H + S_G X H^\top H = S_G B S_H` for relaxed Gram matrices
    :math:`S = F^\top F + \varepsilon I`. Both coefficient matrices are symmetric and
    diagonalised by the eigenvectors of :math:`S_G` and :math:`S_H`.
    """
    sig, u_g = torch.linalg.eigh(s_g)
    tau, u_h = torch.linalg.eigh(s_h)
    a = (sig - eps) / sig
    b = (tau - eps) / tau
    y = safe_divide_eigensum(u_g.mT @ rhs @ u_h, a, b)
    return u_g @ y @ u_h.mT


#: On an accelerator, at most this many blocks (or batch slices) per vector in the kernels
#: of an Auto-PGD iteration (the adaptive metric's Gram matrix and gradient, the
#: quotients' fused operations, the update's combination): there each block costs kernel
#: launches, so their number stays constant per ball, whatever the model's size; larger
#: vectors get larger blocks.
MAX_BLOCKS = 2
#: ... but never more entries per block than this: a block's temporaries (three of them
#: for the Gram matrix) stay small next to a vector of a large model.
MAX_BLOCK_ENTRIES = 1 << 23
#: Cap the blocks on the CPU too. Off by default: on the CPU a block costs a few
#: microseconds of dispatch and cache-sized blocks save passes over memory, so the blocks
#: keep their cache size there. The operator-count tests turn it on, to count on the CPU
#: the operators that a launch-bound device dispatches.
CAP_ON_CPU = False


def capped(device: torch.device) -> bool:
    """Whether blocks on ``device`` are capped at :data:`MAX_BLOCKS` per vector."""
    return device.type != "cpu" or CAP_ON_CPU


def block_length(numel: int, block: int, device: torch.device) -> int:
    """Entries per block for a vector of ``numel`` entries on ``device``: ``block``, or,
    where blocks are :func:`capped`, more where that would make more than
    :data:`MAX_BLOCKS` blocks, up to :data:`MAX_BLOCK_ENTRIES`."""
    if not capped(device):
        return max(block, 1)
    return max(block, min(-(-numel // MAX_BLOCKS), MAX_BLOCK_ENTRIES), 1)
