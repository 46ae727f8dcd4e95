"""The tangent space at a fixed point, for repeated use (a sharpness ball, a Hessian).

Auto-PGD evaluates metric norms, projections and gradient conversions many times at
one base point. :func:`tangent_space` returns an object that does so; for this
package's manifolds it computes what depends on the point only and is small (Gram
matrices and their inverses) once. Nothing as large as the point is kept: the adaptive
metric's weights are recomputed block by block when used.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple

import torch
from geoopt.manifolds.base import Manifold

from ._random import standard_normal

__all__ = ["CachedTangentSpace", "TangentSpace", "tangent_space"]


class TangentSpace:
    """Metric, projection, gradient conversion and sampling at a fixed point ``x``.

    This base version calls the manifold's own methods (geoopt's manifolds).
    """

    #: Whether the space keeps values derived from its vectors while their version
    #: counter is unchanged (:meth:`combination`): a sharpness ball then gives its
    #: vectors buffers of their own, since all views of one buffer share one counter.
    own_buffer = False
    #: Whether :meth:`expmap` integrates the geodesic equation numerically, with the
    #: manifold's ``expmap_steps`` RK4 steps, and the space integrates it for any number
    #: of steps too (``expmaps(u)``, ``span_geodesic(u)``: a step-doubling error
    #: control, :func:`~geoopt_quotient.sharpness.path_gap.path_gap`); ``False`` here.
    integrates_geodesic = False

    def __init__(self, manifold: Manifold, x: torch.Tensor):
        self.manifold = manifold
        self.x = x

    def at_same_point(self) -> TangentSpace:
        """A new tangent space at this point that shares what this one computed from the
        point alone (for this package's manifolds: Gram matrices and their
        factorisations), and nothing it derived from tangent vectors: its results are
        those of a space made afresh, without factorising the point again."""
        return tangent_space(self.manifold, self.x)

    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        """The inner product, summed over batch dimensions (a scalar)."""
        return self.manifold.inner(self.x, u, v).sum()

    def gram(self, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
        r"""The matrix :math:`G_{ij} = \langle u_i, u_j \rangle` of tangent vectors, each
        summed over batch dimensions, in float64 (of shape ``(k, k)``)."""
        rows = [[None] * len(vectors) for _ in vectors]
        for i, u in enumerate(vectors):
            for j in range(i, len(vectors)):
                rows[i][j] = rows[j][i] = self.inner(u, vectors[j]).double()
        return torch.stack([torch.stack(row) for row in rows])

    def proju(self, u: torch.Tensor) -> torch.Tensor:
        return self.manifold.proju(self.x, u)

    def egrad2rgrad(self, u: torch.Tensor) -> torch.Tensor:
        return self.manifold.egrad2rgrad(self.x, u)

    def egrad2rgrad_(self, u: torch.Tensor) -> torch.Tensor:
        """:meth:`egrad2rgrad`, written into ``u`` where the manifold can (the same values);
        ``u`` must then belong to the caller alone."""
        return self.egrad2rgrad(u)

    def egrad2rgrad_gram_(
        self, vectors: Sequence[torch.Tensor], index: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r""":meth:`egrad2rgrad_` of ``vectors[index]`` and the :meth:`gram` of ``vectors``
        with that Riemannian gradient in its place: ``(rgrad, gram)``. Where the manifold
        can, one sweep over the vectors does both (the same values)."""
        vectors = list(vectors)
        vectors[index] = self.egrad2rgrad_(vectors[index])
        return vectors[index], self.gram(vectors)

    def egrad2rgrad_column_(
        self, vectors: Sequence[torch.Tensor], index: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r""":meth:`egrad2rgrad_` of ``vectors[index]`` and its inner products with all
        ``vectors`` (its own with itself): ``(rgrad, column)``, the column ``index`` of
        :meth:`egrad2rgrad_gram_`'s Gram matrix, in float64 (of shape ``(k,)``). Where
        the manifold can, one sweep that skips the other entries of the matrix."""
        rgrad, gram = self.egrad2rgrad_gram_(vectors, index)
        return rgrad, gram[:, index]

    def gradient_sweep(self, vectors: Sequence[torch.Tensor], index: int, kind: str):
        r"""The sweep of :meth:`egrad2rgrad_column_` (``kind="column"``) or
        :meth:`egrad2rgrad_gram_` (``"gram"``) of ``vectors``, made before
        ``vectors[index]`` is written, to run block by block as its entries arrive
        (:class:`~geoopt_quotient.manifolds.adaptive.GradientSweep`); ``None`` where the
        manifold has none (this base version)."""
        return None

    @property
    def straight_retraction(self) -> bool:
        """Whether :meth:`retr` is the straight line :math:`x + u`."""
        return bool(getattr(self.manifold, "straight_retraction", False))

    def retr(self, u: torch.Tensor) -> torch.Tensor:
        return self.manifold.retr(self.x, u)

    def expmap(self, u: torch.Tensor) -> torch.Tensor:
        return self.manifold.expmap(self.x, u)

    def known_zero(self, u: torch.Tensor) -> None:
        """``u`` is the zero vector (a search's first iterate): keep what follows about it
        (nothing here), as the space would after computing with it."""

    def retraction_corrections(self, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor] | None:
        r"""Per point of the batch (one value where the inner product is not per point),
        :math:`|c|^2` and :math:`|u|^2` in the metric, where :math:`c = x + u - R_x(u)` is
        the correction that :meth:`retr` applies to the straight line, computed without
        the retracted point where the geometry has a closed form for it; ``None`` here
        (compute :meth:`retr`)."""
        return None

    def retr_vjp(
        self, u: torch.Tensor, out: torch.Tensor
    ) -> Tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
        r""":meth:`retr` of ``u`` written into ``out``, with its pullback
        :math:`c \mapsto (D_u R_x)^\top c` (written into ``c``, which must belong to the
        caller), computed without autograd; ``None`` where the manifold has no such
        explicit form for these tensors (then differentiate :meth:`retr`)."""
        return None

    def combination(
        self, vectors: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
    ) -> Callable[[torch.Tensor], None] | None:
        r"""Called before the linear combination :math:`\sum_i w_i v_i` of ``vectors``
        (``weights`` 0-dim tensors) is written into a tensor: a function to call with
        that tensor once it is written, by which the space keeps what it derives of the
        combination from what it knows of the vectors; ``None``: nothing (this base
        version)."""
        return None

    def random(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """A standard Gaussian tangent vector in the metric.

        The manifold's ``random_tangent`` where its class has one; for geoopt's own
        manifolds the embedded Gaussian projected to the tangent space (exact for
        embedded metrics).
        """
        if getattr(type(self.manifold), "random_tangent", None) is not None:
            return self.manifold.random_tangent(self.x, generator=generator)
        noise = standard_normal(self.x, generator)
        return self.manifold.proju(self.x, noise)


class CachedTangentSpace(TangentSpace):
    """Tangent space of this package's manifolds, with the point's state built once.

    ``state`` is what the manifold's private ``_inner``, ``_proju``, ``_egrad2rgrad`` and
    ``_random_tangent`` take in place of the point.
    """

    def __init__(self, manifold: Manifold, x: torch.Tensor, state: Any):
        super().__init__(manifold, x)
        self.state = state

    def at_same_point(self) -> CachedTangentSpace:
        return type(self)(self.manifold, self.x, self.state)

    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        summed = getattr(self.manifold, "_inner_sum", None)
        if summed is not None:
            return summed(self.state, u, v)
        return self.manifold._inner(self.state, u, v, False).sum()

    def proju(self, u: torch.Tensor) -> torch.Tensor:
        return self.manifold._proju(self.state, u)

    def egrad2rgrad(self, u: torch.Tensor) -> torch.Tensor:
        return self.manifold._egrad2rgrad(self.state, u)

    def egrad2rgrad_(self, u: torch.Tensor) -> torch.Tensor:
        in_place = getattr(self.manifold, "_egrad2rgrad_", None)
        return self.egrad2rgrad(u) if in_place is None else in_place(self.state, u)

    def gram(self, vectors: Sequence[torch.Tensor]) -> torch.Tensor:
        fused = getattr(self.manifold, "_gram", None)
        return super().gram(vectors) if fused is None else fused(self.state, vectors)

    def egrad2rgrad_gram_(
        self, vectors: Sequence[torch.Tensor], index: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        fallback = super().egrad2rgrad_gram_
        return self._fused_sweep("_egrad2rgrad_gram_", fallback, vectors, index)

    def egrad2rgrad_column_(
        self, vectors: Sequence[torch.Tensor], index: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        fallback = super().egrad2rgrad_column_
        return self._fused_sweep("_egrad2rgrad_column_", fallback, vectors, index)

    def _fused_sweep(
        self, name: str, fallback: Callable, vectors: Sequence[torch.Tensor], index: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The manifold's one-sweep method ``name`` where it has one that applies (it
        returns ``None`` otherwise, changing nothing), else ``fallback``."""
        fused = getattr(self.manifold, name, None)
        result = None if fused is None else fused(self.state, vectors, index)
        return fallback(vectors, index) if result is None else result

    def gradient_sweep(self, vectors: Sequence[torch.Tensor], index: int, kind: str):
        made = getattr(self.manifold, "_gradient_sweep", None)
        return None if made is None else made(self.state, vectors, index, kind)

    def retr(self, u: torch.Tensor) -> torch.Tensor:
        retract = getattr(self.manifold, "_retr", None)
        return self.manifold.retr(self.x, u) if retract is None else retract(self.state, u)

    def retr_vjp(self, u: torch.Tensor, out: torch.Tensor):
        explicit = getattr(self.manifold, "_retr_vjp", None)
        return None if explicit is None else explicit(self.state, u, out)

    def random(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.manifold._random_tangent(self.state, self.x, generator)


def tangent_space(manifold: Manifold, x: torch.Tensor) -> TangentSpace:
    """The manifold's own (cached) tangent space at ``x`` if it has one, else the default.

    Looked up on the class, so a ``geoopt.Scaled`` wrapper (whose metric differs from its
    base's) gets the default, correct one.
    """
    factory = getattr(type(manifold), "tangent_space", None)
    if factory is not None:
        return factory(manifold, x)
    return TangentSpace(manifold, x)
