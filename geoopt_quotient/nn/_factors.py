"""Helpers that build well-placed representatives of a :class:`GLQuotient` point."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..manifolds._random import randn

__all__ = ["balance", "balanced_factors", "orthonormal_frame"]


def balanced_factors(w: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Balanced factors of the best rank-``rank`` approximation of ``w``.

    With the truncated SVD :math:`W \approx U_r \Sigma_r V_r^\top` this returns
    :math:`G = U_r \Sigma_r^{1/2}`, :math:`H = V_r \Sigma_r^{1/2}`, so that
    :math:`G H^\top` is the Eckart-Young approximation and
    :math:`G^\top G = H^\top H = \Sigma_r` (balanced).

    Parameters
    ----------
    w : torch.Tensor
        Matrices of shape ``(..., n, m)``.
    rank : int
        Number :math:`r \le \min(n, m)` of singular triplets kept.

    Returns
    -------
    g, h : torch.Tensor
        Shapes ``(..., n, r)`` and ``(..., m, r)``.
    """
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    root = s[..., :rank].sqrt().unsqueeze(-2)
    return u[..., :rank] * root, vh[..., :rank, :].mT * root


def balance(g: torch.Tensor, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""The balanced representative of the orbit of :math:`(G, H)`.

    With :math:`G = Q_G R_G`, :math:`H = Q_H R_H` (thin QR) and
    :math:`R_G R_H^\top = U \Sigma V^\top` the result is
    :math:`(Q_G U \Sigma^{1/2}, Q_H V \Sigma^{1/2})`: it has the same product
    :math:`G H^\top`, differs from :math:`(G, H)` by an element of
    :math:`\mathrm{GL}(h)` when both are of full rank, and satisfies
    :math:`G^\top G = H^\top H = \Sigma`. Costs :math:`O((n + m) h^2)`.

    Parameters
    ----------
    g : torch.Tensor
        The factor :math:`G`, shape ``(..., n, h)`` with :math:`h \le n`.
    h : torch.Tensor
        The factor :math:`H`, shape ``(..., m, h)`` with :math:`h \le m`.

    Returns
    -------
    g, h : torch.Tensor
        The balanced factors, of the shapes of the inputs.
    """
    q_g, r_g = torch.linalg.qr(g)
    q_h, r_h = torch.linalg.qr(h)
    u, s, vh = torch.linalg.svd(r_g @ r_h.mT)
    root = s.sqrt().unsqueeze(-2)
    return q_g @ (u * root), q_h @ (vh.mT * root)


def orthonormal_frame(
    rows: int,
    cols: int,
    *,
    generator: Optional[torch.Generator] = None,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """A Haar-random ``(rows, cols)`` matrix with orthonormal columns (``cols <= rows``)."""
    z = randn((rows, cols), generator=generator, dtype=dtype, device=device)
    q, r = torch.linalg.qr(z)
    # fix the signs so that the distribution is Haar (diag(R) > 0)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(-2)
