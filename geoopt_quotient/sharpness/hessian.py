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
from .apgd import NonFiniteError, _generator, as_scalar
from .functional import (
    RESOLUTION,
    PerturbedLoss,
    check_depends_on_perturbation,
    noting_batch,
    trainable_parameters,
)
from .measure import LossFn, Symmetries, check_parameters, check_points, resolve_plan
from .precision import AutocastState

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
    """A Hessian statistic: the mean over batches and the per-batch (or per-probe) values."""

    value: float
    per_batch: List[float]
    samples: List[List[float]]


def _pullbacks(model, loss_fn, batches, symmetries, metric, riemannian, autocast):
    """One pullback per batch, after the same checks as the sharpness functions."""
    loss = PerturbedLoss(model, loss_fn)  # checks that loss_fn is callable
    plan = resolve_plan(model, symmetries, metric) if riemannian else SymmetryPlan().bind(model)
    base = trainable_parameters(model)
    check_parameters(base)
    refuse_low_precision(base)
    if riemannian:
        check_points(plan, plan.gather(base))
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
    """Riemannian Hessian-vector product, one tangent vector per plan group."""
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
) -> HessianResult:
    r"""Hutchinson estimate of the trace of the (Riemannian or Euclidean) Hessian.

    :math:`\operatorname{tr} \operatorname{Hess} L \approx \frac1P \sum_p \langle v_p,
    \operatorname{Hess} L[v_p] \rangle_w = \frac1P \sum_p v_p^\top \nabla^2 (L \circ R_w)(0) v_p`
    with :math:`v_p` standard Gaussian in the metric on the horizontal space
    (``riemannian=True``) or :math:`\mathcal N(0, I)` in parameter space.
    ``probe_vectors(batch_index, probe_index)`` may supply the probes instead (one per
    plan group, or per trainable parameter when Euclidean).

    ``loss_fn`` is called as by :func:`geodesic_sharpness` (any use of the model inside
    it sees the perturbed parameters). A bfloat16/float16 model raises ``TypeError``:
    measure ``model.float()``, under ``torch.autocast`` for speed.
    """
    probes = check_positive_int(probes, "probes")
    per_batch, samples = [], []
    with _full_precision(model) as autocast:
        pulls = _pullbacks(model, loss_fn, batches, symmetries, metric, riemannian, autocast)
        generator = _generator(pulls[0].points[0].device, seed)  # on the model's device
        for b, pull in enumerate(pulls):
            values = []
            with noting_batch(b):
                for p in range(probes):
                    v = probe_vectors(b, p) if probe_vectors else pull.probe(generator)
                    sample = sum((h * a).sum() for h, a in zip(pull.hvp(v), v))
                    values.append(_finite(sample, "a Hutchinson sample"))
            values = torch.stack(values).tolist()
            samples.append(values)
            per_batch.append(sum(values) / len(values))
    return HessianResult(sum(per_batch) / len(per_batch), per_batch, samples)


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
) -> HessianResult:
    r"""Largest eigenvalue of the Hessian by Lanczos in the metric (per batch, averaged).

    Lanczos with full reorthogonalisation in :math:`\langle\cdot,\cdot\rangle_w` (the
    Riemannian Hessian is self-adjoint in it) for ``iters`` steps; it stores ``iters``
    tangent vectors. ``samples`` holds the Ritz estimate after each step.
    ``start_vectors(batch_index)`` may supply the start vector.
    """
    iters = check_positive_int(iters, "iters")
    per_batch, samples = [], []
    with _full_precision(model) as autocast:
        pulls = _pullbacks(model, loss_fn, batches, symmetries, metric, riemannian, autocast)
        generator = _generator(pulls[0].points[0].device, seed)  # on the model's device
        for b, pull in enumerate(pulls):
            v = start_vectors(b) if start_vectors else pull.probe(generator)
            with noting_batch(b):
                estimates = _lanczos(pull, v, iters)
            samples.append(estimates)
            per_batch.append(estimates[-1])
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
