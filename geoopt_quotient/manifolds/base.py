r"""The vocabulary the package's manifolds share, declared once.

Each manifold is a quotient :math:`\mathcal M = \overline{\mathcal M} / G` of a total space
by a group acting on it, written on the total space (a point is a representative, a
tangent vector its horizontal lift):

* the *vertical* space at :math:`x` is the tangent space of the orbit :math:`G x`;
* the *horizontal* space is its orthogonal complement in the total-space metric, which
  is :math:`G`-invariant, so it identifies with the quotient's tangent space;
* :meth:`~geoopt.manifolds.Manifold.proju` is the horizontal projection, and
  :meth:`transp` transports a vector by projecting it onto the horizontal space at the
  destination (equivariant, since the projection is).

The group itself is the manifold's too, so that code outside the manifolds never asks
which class it holds: :meth:`QuotientManifold.random_element` draws a well-conditioned
element, :meth:`~QuotientManifold.identity_element` is the identity,
:meth:`~QuotientManifold.act` moves a point (or a tangent vector) along its orbit,
:meth:`~QuotientManifold.act_on_first_factor` moves one factor only (which is *not* a
symmetry: a control for invariance checks) and :meth:`~QuotientManifold.group_label`
names the group. :func:`random_group_element` and :func:`group_label` answer for any
Geoopt manifold (``None`` and ``"-"`` where there is no group).

:class:`~geoopt_quotient.AdaptiveEuclidean` is the trivial case (no group: every vector
is horizontal, except on entries it freezes).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from geoopt.manifolds.base import Manifold
from geoopt.manifolds.euclidean import Euclidean

__all__ = [
    "QuotientManifold",
    "acts_per_point",
    "group_label",
    "has_elementwise_metric",
    "has_group",
    "is_plain_euclidean",
    "random_group_element",
    "stack_key",
]


class QuotientManifold(Manifold):
    """A :class:`geoopt.manifolds.Manifold` whose :meth:`proju` is the horizontal projection,
    and which owns the group it divides by.

    The base class is the trivial group (no element, label ``"-"``); the quotients
    override the group methods. A point's trailing size is its *rank* ``h`` (the head
    size of an attention pair, the number of coordinates of a diagonal pair).

    The class attributes below describe the geometry to the sharpness engine, which
    picks its fast paths by them instead of by class:

    * ``has_group``: the group is not trivial (:meth:`random_element` draws elements);
    * ``elementwise_metric``: the metric is diagonal in the entries of the point, its
      weights a function of each entry alone (the adaptive geometry);
    * ``acts_per_point``: every operation acts on each leading index of a batch of
      points on its own, so a batch can be cut along its first dimension.
    """

    has_group: bool = False
    elementwise_metric: bool = False
    acts_per_point: bool = False

    # ------------------------------------------------------------------ the group
    def random_element(
        self,
        batch_shape: Sequence[int],
        *,
        h: int,
        max_condition: float = 4.0,
        generator: Optional[torch.Generator] = None,
        dtype: torch.dtype = torch.float64,
    ) -> Optional[torch.Tensor]:
        """A random element of the group per point of a batch, ``None`` for the trivial group.

        Parameters
        ----------
        batch_shape : sequence of int
            Leading shape of the points (one element each).
        h : int
            The points' rank (trailing size).
        max_condition : float
            Bound on the element's condition number (ratio of its extreme singular
            values or scalars).
        generator : torch.Generator or None
            Random number generator (drawn on its device, in float64).
        dtype : torch.dtype
            Dtype of the result.

        Returns
        -------
        torch.Tensor or None
            Elements in the shape :meth:`act` takes.
        """
        return None

    def identity_element(
        self,
        batch_shape: Sequence[int],
        *,
        h: int,
        dtype: torch.dtype = torch.float64,
        device: Optional[torch.device] = None,
    ) -> Optional[torch.Tensor]:
        """The identity of the group for a batch of points (``None``: trivial group).

        Parameters
        ----------
        batch_shape : sequence of int
            Leading shape of the points.
        h : int
            The points' rank.
        dtype, device
            Of the result.

        Returns
        -------
        torch.Tensor or None
            Elements in the shape :meth:`act` takes.
        """
        return None

    def act(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The group element ``a`` applied to the point (or tangent vector) ``x``."""
        raise NotImplementedError(f"{type(self).__name__} has no group action")

    def inverse_element(self, a: torch.Tensor) -> torch.Tensor:
        """The inverse of the group element ``a``, in the shape :meth:`act` takes:
        ``act(act(x, a), inverse_element(a))`` is ``x`` up to rounding."""
        raise NotImplementedError(f"{type(self).__name__} has no group action")

    def act_on_first_factor(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``a`` applied to the first factor of ``x`` only, the second left as it is.

        Not a symmetry of the product the quotient keeps: a check of invariance uses it
        as a control that must change a model's outputs.
        """
        raise NotImplementedError(f"{type(self).__name__} has no group action")

    def group_label(self, rank: int) -> str:
        """The group acting on one block of rank ``rank``, with its dimension, e.g.
        ``"GL(8) [64]"``; ``"-"`` for the trivial group."""
        return "-"

    def with_metric(self, metric: str, eps: float = 0.0) -> QuotientManifold:
        """This geometry with the invariant metric ``metric`` and a relaxation of at least
        ``eps`` (a new manifold; the group, the retraction and the shape settings are kept).
        Geometries without a choice of metric return themselves."""
        return self

    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vector transport: horizontal projection at ``y``."""
        return self.proju(y, v)

    def retr_transp(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        y = self.retr(x, u)
        return y, self.transp(x, y, v)

    def expmap_transp(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        y = self.expmap(x, u)
        return y, self.transp(x, y, v)


def has_group(manifold: Manifold) -> bool:
    """Whether ``manifold`` is a quotient by a non-trivial group this package can act with.

    Parameters
    ----------
    manifold : geoopt.manifolds.Manifold
        Any manifold (Geoopt's own have no group here).

    Returns
    -------
    bool
        :attr:`QuotientManifold.has_group`, ``False`` for other manifolds.
    """
    return bool(getattr(manifold, "has_group", False))


def random_group_element(
    manifold: Manifold,
    batch_shape: Sequence[int],
    *,
    h: int,
    max_condition: float = 4.0,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float64,
) -> Optional[torch.Tensor]:
    """:meth:`QuotientManifold.random_element` of any manifold.

    Parameters
    ----------
    manifold : geoopt.manifolds.Manifold
        Any manifold.
    batch_shape : sequence of int
        Leading shape of the points (one element each).
    h : int
        The points' rank (trailing size).
    max_condition : float
        Bound on the elements' condition number.
    generator : torch.Generator or None
        Random number generator.
    dtype : torch.dtype
        Dtype of the result.

    Returns
    -------
    torch.Tensor or None
        The elements; ``None`` for a manifold with no group this package knows (Geoopt's
        own manifolds, the adaptive geometry).
    """
    if not isinstance(manifold, QuotientManifold):
        return None
    return manifold.random_element(
        batch_shape, h=h, max_condition=max_condition, generator=generator, dtype=dtype
    )


def group_label(manifold: Manifold, rank: int) -> str:
    """:meth:`QuotientManifold.group_label` of any manifold.

    Parameters
    ----------
    manifold : geoopt.manifolds.Manifold
        Any manifold.
    rank : int
        The trailing size of its points.

    Returns
    -------
    str
        The group acting on one block with its dimension; ``"-"`` without a known group.
    """
    return manifold.group_label(rank) if isinstance(manifold, QuotientManifold) else "-"


def has_elementwise_metric(manifold: Manifold) -> bool:
    """:attr:`QuotientManifold.elementwise_metric` of any manifold (``False`` for others)."""
    return bool(getattr(manifold, "elementwise_metric", False))


def acts_per_point(manifold: object) -> bool:
    """:attr:`QuotientManifold.acts_per_point` of any object (``False`` for others)."""
    return bool(getattr(manifold, "acts_per_point", False))


def is_plain_euclidean(manifold: Manifold) -> bool:
    """Whether ``manifold`` is Geoopt's own :class:`~geoopt.Euclidean` (identity metric)."""
    return type(manifold) is Euclidean


def stack_key(manifold: Manifold) -> Optional[Tuple]:
    """What must agree for points of ``manifold`` to be stacked into one batch of the
    batched GL(h) kernels (``GLQuotient.stack_key``); ``None``: never."""
    key = getattr(manifold, "stack_key", None)
    return None if key is None else key()
