r"""Where the vectors of Auto-PGD's ball live: joint buffers, and their reuse along a run.

A vector of the ball (one tensor per group) is as large as the model. Auto-PGD
(:func:`~geoopt_quotient.sharpness.apgd.maximize_in_ball`) holds a few of them at once,
by role (:class:`AutoPGDVectors`): the iterates :math:`\xi_k`, :math:`\xi_{k-1}` and the
best :math:`\xi`, the gradient at :math:`\xi_k` and, optionally, the gradient at the best
:math:`\xi`. This module decides which buffer each new vector is written into, so that a
run stops allocating once it holds as many vectors as it ever needs at once: a
model-sized buffer allocated anew is faulted in page by page, which costs several
copies' worth of time. None of it changes a value: the algorithm reads the same vectors
whichever buffer holds them.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

#: Nothing here is meant for users: the names are the sharpness engine's internal interface.
__all__: List[str] = []

#: Alignment in bytes of the views of :func:`joint_buffer` (a cache line, and what
#: PyTorch's CPU allocator gives each tensor).
ALIGNMENT = 64

Vector = List[torch.Tensor]


def joint_buffer(
    like: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype] | None = None,
    zero: bool = False,
    apart: Sequence[bool] | None = None,
) -> Vector:
    """New tensors shaped like ``like`` (in ``dtypes``, default theirs), views of one flat
    buffer per dtype and device, but those marked in ``apart``, each in a buffer of its
    own: the views of one buffer share one version counter, so that a write into one of
    them would drop what a tangent space keeps about another while its counter is
    unchanged (:attr:`~geoopt_quotient.manifolds.tangent.TangentSpace.own_buffer`).

    A vector of the ball lives for several iterations, next to per-parameter buffers that
    come and go in every forward and backward pass. In one allocation of its own, as large
    as the model, it stays out of the allocator's pool of small blocks, and is returned
    whole when freed, instead of pinning that pool at its high-water mark. Each view
    starts at a multiple of :data:`ALIGNMENT` bytes, as a tensor of its own would: a
    weight matrix perturbed in a view that starts mid-cache-line slows the model's
    matrix products.
    """
    dtypes = [t.dtype for t in like] if dtypes is None else dtypes
    apart = [False] * len(like) if apart is None else apart
    keys = [
        (dtype, t.device, index if alone else -1)
        for index, (dtype, t, alone) in enumerate(zip(dtypes, like, apart))
    ]
    starts, sizes = [], {}
    for key, t in zip(keys, like):
        step = max(ALIGNMENT // key[0].itemsize, 1)
        start = -(-sizes.get(key, 0) // step) * step
        starts.append(start)
        sizes[key] = start + t.numel()
    make = torch.zeros if zero else torch.empty
    flat = {key: make(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
    return [
        flat[key][start : start + t.numel()].view(t.shape)
        for key, start, t in zip(keys, starts, like)
    ]


def _is_free(vector: Vector, in_use: Sequence[Vector | None]) -> bool:
    """Whether ``vector`` is none of ``in_use`` (compared by identity)."""
    return all(vector is not other for other in in_use)


class AutoPGDVectors:
    r"""The vectors of the ball that Auto-PGD holds, by role, and the buffers of new ones.

    Each role holds a vector (a list of tensors, one per group) or ``None``; several roles
    may hold one vector (the best iterate is often the current one). Vectors are compared
    by identity, never by value. The algorithm moves vectors between roles
    (:meth:`advance`, :meth:`set_gradient`, :meth:`take_best`, :meth:`restart`,
    :meth:`set_riemannian`); a vector that leaves its last role goes to :attr:`free`,
    from which the next update's output (:meth:`output`) and the next evaluation's
    gradient (the ``recycled`` argument of
    :func:`~geoopt_quotient.sharpness.apgd.evaluate_in_ball`) take their buffers.

    Parameters
    ----------
    xi : list of torch.Tensor
        The first iterate :math:`\xi_0`, in a buffer of its own (it is written over once
        free); also the previous and the best iterate.
    apart : sequence of bool
        Per group, whether its tensors get buffers of their own (:func:`joint_buffer`).
    keep_best_gradient : bool
        Whether :attr:`best_rgrads` keeps the gradient at the best iterate.

    Attributes
    ----------
    xi, xi_prev, best_xi : list of torch.Tensor
        The current iterate :math:`\xi_k`, the previous one :math:`\xi_{k-1}`, the best.
    grads : list of torch.Tensor or None
        The last evaluation's gradient, until it is made Riemannian (in place).
    rgrads : list of torch.Tensor or None
        The Riemannian gradient at :attr:`xi`, which the next update reads.
    best_rgrads : list of torch.Tensor or None
        With ``keep_best_gradient``: the Riemannian gradient at :attr:`best_xi`.
    free : list of list of torch.Tensor
        Vectors no role holds any more, to be written over. An evaluation may take one
        for its gradient, or release them all before the objective runs.
    lent : list of torch.Tensor or None
        The objective's own vector, where an evaluation returned its gradient there
        (``own_vector`` of :func:`~geoopt_quotient.sharpness.apgd.evaluate_in_ball`):
        the objective writes over it at its next evaluation, so it is only ever the
        gradient, read by the next update; never an update's output, never free.
    """

    def __init__(self, xi: Vector, apart: Sequence[bool], keep_best_gradient: bool):
        self.xi = self.xi_prev = self.best_xi = xi
        self.grads: Vector | None = None
        self.rgrads: Vector | None = None
        self.best_rgrads: Vector | None = None
        self.free: List[Vector] = []
        self.lent: Vector | None = None
        self.apart = list(apart)
        self.keep_best_gradient = keep_best_gradient

    def output(self) -> Vector:
        """The buffer the next update writes :math:`\\xi_{k+1}` into, and the gradient it
        reads moved to :attr:`free` where no role keeps it.

        In this order: the previous iterate where no role but its own holds it (the update
        reads each of its entries before writing it), else a free vector (not the
        gradient, which the update would stage), else the gradient unless it is the kept
        one or :attr:`lent`, else a new buffer.
        """
        rgrads = self.rgrads
        ours = rgrads is not self.best_rgrads and not self.is_lent(rgrads)
        if _is_free(self.xi_prev, (self.xi, self.best_xi)):
            out = self.xi_prev
        elif self.free:
            out = self.free.pop()
        elif ours:
            out = rgrads
        else:
            out = joint_buffer(self.xi, apart=self.apart)
        if out is not rgrads and ours:
            self.free.append(rgrads)  # read by the update, then free
        return out

    def is_lent(self, vector: Vector | None) -> bool:
        """Whether ``vector`` holds a tensor of :attr:`lent` (a list made anew from it,
        such as its Riemannian gradient, holds its tensors)."""
        lent = self.lent
        return lent is not None and vector is not None and any(a is b for a, b in zip(vector, lent))

    def advance(self, xi_next: Vector) -> None:
        """:math:`\\xi_{k+1}` (written into :meth:`output`) becomes the current iterate,
        the current one the previous; no gradient is known at the new one yet."""
        self.xi_prev, self.xi, self.rgrads = self.xi, xi_next, None

    def set_gradient(self, grads: Vector | None) -> None:
        """The gradient of the last evaluation (at :attr:`xi`), or ``None``."""
        self.grads = grads

    def set_riemannian(self, rgrads: Vector) -> None:
        """:attr:`grads` made Riemannian (the same list, converted in place)."""
        self.rgrads, self.grads = rgrads, None

    def take_best(self) -> None:
        """The current iterate is the best: the earlier best one is freed (unless it is
        the previous iterate), and its kept gradient replaced by the current gradient."""
        if _is_free(self.best_xi, (self.xi, self.xi_prev)):
            self.free.append(self.best_xi)
        self.best_xi = self.xi
        if self.keep_best_gradient and self.grads is not None:
            if self.best_rgrads is not None:
                self.free.append(self.best_rgrads)
            self.best_rgrads = self.grads  # made Riemannian in place with it

    def restart(self) -> None:
        """Back to the best iterate: the current one and its gradient are freed; the
        gradient there is the kept one (:attr:`rgrads`), or ``None`` to be recomputed."""
        # the iterate left behind and its gradient
        self.free += [v for v in (self.xi, self.grads) if v is not None and not self.is_lent(v)]
        self.xi, self.grads, self.rgrads = self.best_xi, None, self.best_rgrads
