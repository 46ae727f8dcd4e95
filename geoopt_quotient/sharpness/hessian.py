r"""The Riemannian Hessian of the loss on the quotient, and its Euclidean counterpart.

For a second-order retraction :math:`R`, the Riemannian Hessian at :math:`w` is the
Hessian of the pullback :math:`\xi \mapsto L(R_w(\xi))` at :math:`\xi = 0` on the inner
product space :math:`(T_w, \langle\cdot,\cdot\rangle_w)`, restricted to horizontal
vectors (Absil, Mahony & Sepulchre 2008, Prop. 5.5.5). A Hessian-vector product is
thus a Euclidean HVP of the pullback, then ``egrad2rgrad`` (metric raise and
horizontal projection). Trace (Hutchinson, horizontal metric-Gaussian probes) and top
eigenvalue (power iteration in the metric) are then invariant under the group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Sequence

import geoopt
import torch
from geoopt.manifolds.base import Manifold
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._checks import check_positive_int
from .._model_state import preserved_model_state
from ..manifolds.tangent import tangent_space
from ..symmetry.plan import BoundPlan, SymmetryPlan
from .apgd import NonFiniteError, as_scalar, seeded_generator
from .ball import check_parameters, check_points
from .functional import (
    RESOLUTION,
    PerturbedLoss,
    check_batches,
    check_depends_on_perturbation,
    noting_batch,
    trainable_parameters,
)
from .measure import LossFn, Symmetries, loss_probe, resolve_plan
from .precision import AutocastState
from .ranks import BatchShare
from .sharded import refuse_sharded

__all__ = [
    "HessianResult",
    "hessian_top_eigenvalue",
    "hessian_trace",
    "riemannian_hvp",
    "second_order_retraction",
]


def second_order_retraction(manifold: Manifold, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r""":math:`x + u - \tfrac12\Gamma_x(u, u)` where the manifold exposes ``christoffel``;
    the exponential map otherwise (geoopt's own manifolds)."""
    christoffel = getattr(manifold, "christoffel", None)
    if christoffel is not None:
        return x + u - 0.5 * christoffel(x, u)
    return manifold.expmap(x, u)


class _Pullback:
    """:math:`\\xi \\mapsto L(R_w(\\xi))` for one batch, with its gradient and HVP at 0."""

    def __init__(
        self,
        model: torch.nn.Module,
        perturbed_loss: PerturbedLoss,
        batch: Any,
        plan: BoundPlan,
        riemannian: bool,
        autocast: AutocastState,
    ):
        self.perturbed_loss, self.batch, self.plan = perturbed_loss, batch, plan
        self.autocast = autocast
        self.base = trainable_parameters(model)
        self.riemannian = riemannian
        if riemannian:
            self.points = [p.detach() for p in plan.gather(self.base)]
            manifolds = [g.manifold for g in plan.groups]
        else:
            self.points = list(self.base.values())
            manifolds = [geoopt.Euclidean()] * len(self.points)
        self.spaces = [tangent_space(m, x) for m, x in zip(manifolds, self.points)]

    def loss(self, xi: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.riemannian:
            moved = [
                second_order_retraction(s.manifold, x, u)
                for s, x, u in zip(self.spaces, self.points, xi)
            ]
            params = self.plan.scatter(moved, self.base)
        else:
            params = {n: x + u for (n, x), u in zip(self.base.items(), xi)}
        with self.autocast.restored():
            value = as_scalar(self.perturbed_loss(params, self.batch))
        return _finite(value, "the loss")

    def hvp(self, vectors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Euclidean HVP of the pullback at 0 (double backward)."""
        zeros = [torch.zeros_like(x).requires_grad_(True) for x in self.points]
        # fused attention kernels have no double backward; the math kernel has
        with torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]):
            value = self.loss(zeros)
            check_depends_on_perturbation(value, grads_found=True)
            grads = torch.autograd.grad(value, zeros, create_graph=True, allow_unused=True)
            check_depends_on_perturbation(value, any(g is not None for g in grads))
            dot = sum((g * v).sum() for g, v in zip(grads, vectors) if g is not None)
            if not dot.requires_grad:  # the loss is linear in the parameters it uses
                return [torch.zeros_like(x) for x in self.points]
            hv = torch.autograd.grad(dot, zeros, allow_unused=True)
        return [torch.zeros_like(x) if h is None else h.detach() for x, h in zip(zeros, hv)]

    def raise_index(self, covectors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return [s.egrad2rgrad(c) for s, c in zip(self.spaces, covectors)]

    def inner(self, u: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum(s.inner(a, b) for s, a, b in zip(self.spaces, u, v))

    def probe(self, generator: torch.Generator) -> List[torch.Tensor]:
        """Standard Gaussian in the metric (``N(0, I)`` for the Euclidean Hessian)."""
        return [s.random(generator) for s in self.spaces]


@dataclass
class HessianResult:
    r"""A Hessian statistic: the mean over batches and the per-batch (or per-probe) values.

    Attributes
    ----------
    value : float
        Mean of :attr:`per_batch` over the batches.
    per_batch : list of float
        The statistic of each batch: the mean of its Hutchinson samples
        (:func:`hessian_trace`) or its last Ritz value (:func:`hessian_top_eigenvalue`).
    samples : list of list of float
        Per batch, every Hutchinson sample :math:`\langle v_p, \operatorname{Hess} L[v_p]
        \rangle`, or the Ritz estimate of the top eigenvalue after each Lanczos step.
    """

    value: float
    per_batch: List[float]
    samples: List[List[float]]


def _pullbacks(model, loss_fn, batches, symmetries, metric, riemannian, autocast):
    """One pullback per batch, after the same checks as the sharpness functions."""
    check_batches(batches)
    refuse_sharded(model, "the Riemannian Hessian functions")
    loss = PerturbedLoss(model, loss_fn)  # checks that loss_fn is callable
    probe = loss_probe(loss_fn, batches)
    plan = resolve_plan(model, symmetries, metric, probe=probe) if riemannian else None
    plan = plan or SymmetryPlan().bind(model)
    base = trainable_parameters(model)
    check_parameters(base)
    refuse_low_precision(base)
    if riemannian:
        check_points(plan.groups, plan.gather(base))
    pulls = [_Pullback(model, loss, b, plan, riemannian, autocast) for b in batches]
    if not pulls:
        raise ValueError("`batches` is empty: give at least one batch")
    return pulls


def refuse_low_precision(params: Dict[str, torch.Tensor]) -> None:
    """Second derivatives of a bfloat16/float16 model are refused, not estimated."""
    low = sorted({str(p.dtype) for p in params.values() if p.dtype in RESOLUTION})
    if low:
        raise TypeError(
            f"the model has {', '.join(low)} parameters: a Hessian by double backward in that "
            "precision (8 to 11 significant bits) is dominated by rounding, so it is not "
            "estimated; measure a float32 copy, model.float() (under torch.autocast for speed: "
            "only loss_fn runs in low precision there)"
        )


@contextlib.contextmanager
def _full_precision(model: torch.nn.Module) -> Iterator[AutocastState]:
    """The model's state preserved, autocast off; yields the caller's autocast state,
    which the pullbacks restore around ``loss_fn`` only."""
    autocast = AutocastState.capture()
    with preserved_model_state(model), autocast.disabled():
        yield autocast


def _finite(value: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(value).all()):
        raise NonFiniteError(
            f"{what} is not finite: check the loss on unperturbed parameters (NaN/Inf loss "
            "or overflow)"
        )
    return value


def riemannian_hvp(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batch: Any,
    vectors: Sequence[torch.Tensor],
    *,
    symmetries: Symmetries = None,
    metric: str = "mix",
) -> List[torch.Tensor]:
    r"""Riemannian Hessian-vector product, one tangent vector per plan group.

    For the second-order retraction :math:`R` of the quotients,

    .. math::

        \operatorname{Hess} L(w)[v] = \operatorname{egrad2rgrad}_w\big(\nabla^2
            (L \circ R_w)(0)\, v\big),

    the Euclidean Hessian-vector product of the pullback :math:`\xi \mapsto L(R_w(\xi))`
    at 0 (double backward), with the metric's index raised and projected onto the
    horizontal space (Absil, Mahony & Sepulchre 2008, Prop. 5.5.5).

    Parameters
    ----------
    model : torch.nn.Module
        The model at :math:`w`; restored on return, as for
        :func:`~geoopt_quotient.geodesic_sharpness`.
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``.
    batch : object
        The batch passed to ``loss_fn``.
    vectors : sequence of torch.Tensor
        The tangent vector :math:`v`: one tensor per group of the bound plan, in the
        order of ``plan.groups`` and with their shapes (horizontal for the quotient
        groups).
    symmetries : SymmetryPlan, list of SymmetryGroup, BoundPlan or None
        As for :func:`~geoopt_quotient.geodesic_sharpness`; ``None`` discovers them.
    metric : {"mix", "inv"}
        Metric of the discovered quotients.

    Returns
    -------
    list of torch.Tensor
        :math:`\operatorname{Hess} L(w)[v]`, one tangent vector per plan group.

    Raises
    ------
    TypeError
        For a bfloat16/float16 model (second derivatives in that precision are refused).
    ShardingError
        For a sharded (FSDP2/DTensor) model: no sharded path yet.
    NonFiniteError
        When the loss is NaN/Inf.

    References
    ----------
    Absil, Mahony & Sepulchre (2008), "Optimization Algorithms on Matrix Manifolds"
    :cite:`absil2008optimization`; Boumal (2023), "An Introduction to Optimization on
    Smooth Manifolds" :cite:`boumal2023introduction`.
    """
    with _full_precision(model) as autocast:
        pull = _pullbacks(model, loss_fn, [batch], symmetries, metric, True, autocast)[0]
        return pull.raise_index(pull.hvp(vectors))


def hessian_trace(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Sequence[Any],
    *,
    symmetries: Symmetries = None,
    metric: str = "mix",
    riemannian: bool = True,
    probes: int = 10,
    seed: int = 0,
    probe_vectors: Callable[[int, int], Sequence[torch.Tensor]] | None = None,
    process_group: Any = None,
) -> HessianResult:
    r"""Hutchinson estimate of the trace of the (Riemannian or Euclidean) Hessian.

    .. math::

        \operatorname{tr} \operatorname{Hess} L \approx \frac1P \sum_{p=1}^P
            \langle v_p, \operatorname{Hess} L[v_p] \rangle_w
            = \frac1P \sum_{p=1}^P v_p^\top \nabla^2 (L \circ R_w)(0)\, v_p,

    unbiased for :math:`\mathbb E[v v^\top] = I` in the metric: :math:`v_p` standard
    Gaussian in the metric on the horizontal space (``riemannian=True``; the trace over
    the quotient's tangent space, invariant under the symmetries) or
    :math:`\mathcal N(0, I)` in parameter space (the Euclidean Hessian). Per batch,
    then averaged over batches.

    ``loss_fn`` is called as by :func:`geodesic_sharpness` (any use of the model inside
    it sees the perturbed parameters). A bfloat16/float16 model raises ``TypeError``:
    measure ``model.float()``, under ``torch.autocast`` for speed.

    Parameters
    ----------
    model : torch.nn.Module
        The model at :math:`w`; restored on return.
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``.
    batches : sequence
        The batches; the result is the mean of their traces.
    symmetries : SymmetryPlan, list of SymmetryGroup, BoundPlan or None
        As for :func:`geodesic_sharpness`; ``None`` discovers them. Unused when
        ``riemannian=False``.
    metric : {"mix", "inv"}
        Metric of the discovered quotients.
    riemannian : bool
        The Riemannian Hessian on the quotient (default), or the Euclidean Hessian of
        the trainable parameters.
    probes : int
        Number :math:`P` of probe vectors per batch (default 10).
    seed : int
        Seed of the probes' generator (on the model's device).
    probe_vectors : callable or None
        ``probe_vectors(batch_index, probe_index)`` returns the probe :math:`v_p` instead
        of a random one: one tensor per plan group (Riemannian) or per trainable
        parameter (Euclidean).
    process_group : ProcessGroup or None
        Estimate over the ranks of this ``torch.distributed`` process group, each rank
        passing its share of the batches: of :math:`B` global batches on :math:`W`
        ranks, rank :math:`r` passes the global batches :math:`r, r + W, \dots`
        (``all_batches[r::W]``, as :class:`~torch.utils.data.DistributedSampler` with
        ``shuffle=False`` deals them out; none empty). The probes are those of one
        process on all batches (every rank draws the other ranks' probes too, and
        ``probe_vectors`` gets the global batch index), and every rank returns the same
        result, in global order. A rank that raises makes every other raise
        :class:`~geoopt_quotient.sharpness.ranks.RankFailedError`. ``None`` (default):
        no communication.

    Returns
    -------
    HessianResult
        The estimate in ``value``, per batch in ``per_batch``, every sample
        :math:`\langle v_p, \operatorname{Hess} L[v_p]\rangle` in ``samples``.

    Raises
    ------
    TypeError
        For a bfloat16/float16 model.
    ValueError
        For a non-positive ``probes``, no batches, or parameters with NaN/Inf entries.
    ShardingError
        For a sharded (FSDP2/DTensor) model: no sharded path yet.
    NonFiniteError
        When a loss or a Hutchinson sample is NaN/Inf.

    References
    ----------
    Hutchinson (1989), "A stochastic estimator of the trace of the influence matrix for
    Laplacian smoothing splines" :cite:`hutchinson1989stochastic`; the Riemannian Hessian:
    Absil, Mahony & Sepulchre (2008) :cite:`absil2008optimization`.

    Examples
    --------
    The Euclidean Hessian of a least-squares loss is :math:`2 X^\top X / n`:

    >>> import torch
    >>> from geoopt_quotient import hessian_trace
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(3, 1, bias=False, dtype=torch.float64)
    >>> x, y = torch.randn(32, 3, dtype=torch.float64), torch.randn(32, 1, dtype=torch.float64)
    >>> def loss_fn(model, batch):
    ...     inputs, targets = batch
    ...     return (model(inputs) - targets).pow(2).mean()
    >>> exact = float(torch.trace(2 * x.T @ x / 32))
    >>> result = hessian_trace(model, loss_fn, [(x, y)], riemannian=False, probes=100)
    >>> abs(result.value / exact - 1) < 0.3
    True

    With the basis vectors as probes the mean of the samples is the trace over 3:

    >>> basis = torch.eye(3, dtype=torch.float64)
    >>> result = hessian_trace(
    ...     model, loss_fn, [(x, y)], riemannian=False, probes=3,
    ...     probe_vectors=lambda batch, probe: [basis[probe].reshape(1, 3)],
    ... )
    >>> abs(3 * result.value - exact) < 1e-10
    True
    """
    probes = check_positive_int(probes, "probes")
    records: List[Dict[str, Any]] = []
    with _full_precision(model) as autocast:
        share = None if process_group is None else BatchShare(batches, process_group)
        local = batches if share is None else share.local
        pulls = _pullbacks(model, loss_fn, local, symmetries, metric, riemannian, autocast)
        generator = seeded_generator(pulls[0].points[0].device, seed)  # on the model's device

        def trace_of(b: int, pull: _Pullback) -> None:
            values = []
            for p in range(probes):
                v = probe_vectors(b, p) if probe_vectors else pull.probe(generator)
                sample = sum((h * a).sum() for h, a in zip(pull.hvp(v), v))
                values.append(_finite(sample, "a Hutchinson sample"))
            values = torch.stack(values).tolist()
            records.append(dict(index=b, value=sum(values) / len(values), samples=values))

        def skip(b: int) -> None:  # another rank's batch: its probes are drawn all the same
            for _ in range(0 if probe_vectors else probes):
                pulls[0].probe(generator)

        _each_batch(pulls, trace_of, share, skip)
    return _hessian_result(records, share)


def hessian_top_eigenvalue(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Sequence[Any],
    *,
    symmetries: Symmetries = None,
    metric: str = "mix",
    riemannian: bool = True,
    iters: int = 20,
    seed: int = 0,
    start_vectors: Callable[[int], Sequence[torch.Tensor]] | None = None,
    process_group: Any = None,
) -> HessianResult:
    r"""Largest eigenvalue of the Hessian by Lanczos in the metric (per batch, averaged).

    Lanczos with full reorthogonalisation in :math:`\langle\cdot,\cdot\rangle_w` (the
    Riemannian Hessian is self-adjoint in it) for ``iters`` steps; it stores ``iters``
    tangent vectors. From :math:`q_1 = v / |v|_w`,

    .. math::

        \alpha_k = \langle q_k, \operatorname{Hess} L[q_k] \rangle_w, \qquad
        \beta_k q_{k+1} = \operatorname{Hess} L[q_k]
            - \sum_{j \le k} \langle q_j, \operatorname{Hess} L[q_k] \rangle_w\, q_j,

    and the estimate after :math:`k` steps is the largest eigenvalue of the tridiagonal
    matrix of the :math:`\alpha` and :math:`\beta` (a Ritz value, a lower bound that
    increases with :math:`k`). It stops early when :math:`\beta_k` vanishes (an
    invariant subspace: the estimate is exact).

    Parameters
    ----------
    model : torch.nn.Module
        The model at :math:`w`; restored on return.
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``, as for :func:`geodesic_sharpness`.
    batches : sequence
        The batches; the result is the mean of their top eigenvalues.
    symmetries : SymmetryPlan, list of SymmetryGroup, BoundPlan or None
        As for :func:`geodesic_sharpness`; unused when ``riemannian=False``.
    metric : {"mix", "inv"}
        Metric of the discovered quotients.
    riemannian : bool
        The Riemannian Hessian on the quotient (default), or the Euclidean Hessian.
    iters : int
        Number of Lanczos steps (Hessian-vector products) per batch; default 20.
    seed : int
        Seed of the random start vectors (standard Gaussian in the metric).
    start_vectors : callable or None
        ``start_vectors(batch_index)`` returns the start vector :math:`v` instead (one
        tensor per plan group, or per trainable parameter when Euclidean).
    process_group : ProcessGroup or None
        Each rank passes its share of the batches (``all_batches[rank::world_size]``), as
        for :func:`hessian_trace`: the statistic is per batch (each batch's top
        eigenvalue, then their mean), so every rank runs Lanczos on its own batches,
        from the start vectors of one process (``start_vectors`` gets the global batch
        index), and every rank returns the same result. ``None`` (default): no
        communication.

    Returns
    -------
    HessianResult
        The mean top eigenvalue in ``value``, the final Ritz value of each batch in
        ``per_batch``, and the Ritz value after each step in ``samples``.

    Raises
    ------
    TypeError
        For a bfloat16/float16 model.
    ValueError
        For a non-positive ``iters``, no batches, or parameters with NaN/Inf entries.
    ShardingError
        For a sharded (FSDP2/DTensor) model: no sharded path yet.
    NonFiniteError
        When a loss or a Lanczos coefficient is NaN/Inf.

    References
    ----------
    Absil, Mahony & Sepulchre (2008), "Optimization Algorithms on Matrix Manifolds"
    :cite:`absil2008optimization`; Boumal (2023) :cite:`boumal2023introduction`.
    """
    iters = check_positive_int(iters, "iters")
    records: List[Dict[str, Any]] = []
    with _full_precision(model) as autocast:
        share = None if process_group is None else BatchShare(batches, process_group)
        local = batches if share is None else share.local
        pulls = _pullbacks(model, loss_fn, local, symmetries, metric, riemannian, autocast)
        generator = seeded_generator(pulls[0].points[0].device, seed)  # on the model's device

        def top_of(b: int, pull: _Pullback) -> None:
            v = start_vectors(b) if start_vectors else pull.probe(generator)
            estimates = _lanczos(pull, v, iters)
            records.append(dict(index=b, value=estimates[-1], samples=estimates))

        def skip(b: int) -> None:  # another rank's batch: its start is drawn all the same
            if not start_vectors:
                pulls[0].probe(generator)

        _each_batch(pulls, top_of, share, skip)
    return _hessian_result(records, share)


def _each_batch(
    pulls: List[_Pullback],
    measure: Callable[[int, _Pullback], None],
    share: BatchShare | None,
    skip: Callable[[int], None],
) -> None:
    """``measure(index, pull)`` for every local batch: in order, or in the rounds of
    ``share`` with global indices (``skip`` for the other ranks' batches)."""
    if share is not None:
        share.run(measure, pulls, skip)
        return
    for b, pull in enumerate(pulls):
        with noting_batch(b):
            measure(b, pull)


def _hessian_result(records: List[Dict[str, Any]], share: BatchShare | None) -> HessianResult:
    """The mean over the batches' records (every rank's, in global order, with ``share``)."""
    if share is not None:
        records = share.gather(records)
    per_batch = [r["value"] for r in records]
    samples = [r["samples"] for r in records]
    return HessianResult(sum(per_batch) / len(per_batch), per_batch, samples)


def _lanczos(pull: _Pullback, start: Sequence[torch.Tensor], steps: int) -> List[float]:
    """Ritz estimates of the top eigenvalue after each Lanczos step."""
    basis: List[List[torch.Tensor]] = []
    alphas: List[torch.Tensor] = []
    betas: List[torch.Tensor] = []
    q = _normalised(pull, start)
    estimates = []
    for _ in range(steps):
        basis.append(q)
        w = pull.raise_index(pull.hvp(q))
        alphas.append(_finite(pull.inner(q, w), "a Lanczos coefficient"))
        for old in basis:  # full reorthogonalisation, in the metric
            c = pull.inner(old, w)
            w = [a - c * o for a, o in zip(w, old)]
        tri = torch.diag(torch.stack(alphas))
        if betas:
            off = torch.stack(betas)
            tri = tri + torch.diag(off, 1) + torch.diag(off, -1)
        estimates.append(float(torch.linalg.eigvalsh(tri)[-1]))
        beta = pull.inner(w, w).clamp_min(0).sqrt()
        if float(beta) <= 1e-12 * max(1.0, abs(estimates[-1])):
            break  # invariant subspace found: the estimate is exact
        betas.append(beta)
        q = [a / beta for a in w]
    return estimates


def _normalised(pull: _Pullback, v: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    norm = pull.inner(v, v).clamp_min(0).sqrt()
    return [a / norm for a in v]
