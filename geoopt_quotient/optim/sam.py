r"""Sharpness-aware minimisation on the symmetry quotient (and SAM, ASAM by one switch).

SAM (Foret et al. 2021) minimises :math:`\max_{|\delta| \le \rho} L(w + \delta)` with
one ascent step to the perturbed point and a descent step with the gradient taken there.
Its ascent :math:`\delta = \rho \nabla L / |\nabla L|` (SAM) or
:math:`\rho T^2 \nabla L / |T \nabla L|`, :math:`T = \operatorname{diag}(|w| + \eta)`
(ASAM, Kwon et al. 2021) is taken in raw or element-wise scaled parameters, so under the
attention symmetries :math:`(W_q, W_k) \mapsto (W_q A^{-1}, W_k A^\top)` two
representatives of the same network are perturbed to *different* functions.

:class:`GeodesicSAM` takes the ascent on the quotient ("Hide & Seek", da Silva, Dangel &
Oore 2025): the Riemannian gradient in the GL-invariant metric, which is horizontal,
scaled to metric norm :math:`\rho`, and applied through the second-order retraction,

.. math::

    \xi = \rho\, \frac{\operatorname{grad} L(w)}{|\operatorname{grad} L(w)|_w}, \qquad
    w' = R_w(\xi), \qquad w \leftarrow \mathrm{base\ step}\big(w, \nabla L(w')\big).

The perturbed function is then the same for every representative. Parameters outside the
symmetry groups use the adaptive geometry (ASAM's ascent for them).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Dict, Iterable, List, Tuple

import geoopt
import torch

from .._checks import GEODESIC_PATHS, check_choice, check_positive_float
from ..errors import GeooptQuotientWarning
from ..manifolds._linalg import compute_dtype
from ..manifolds.base import has_elementwise_metric, is_plain_euclidean
from ..manifolds.tangent import tangent_space
from ..sharpness.apgd import NonFiniteError
from ..sharpness.measure import Symmetries, zero_weight_cause, zero_weight_parameters
from ..sharpness.precision import AutocastState
from ..symmetry import find_symmetries
from ..symmetry.plan import (
    BoundPlan,
    SymmetryGroup,
    SymmetryPlan,
    whole_parameter_group,
)

__all__ = ["BALLS", "GeodesicSAM", "SAMAscent", "ZeroAscentWarning"]

BALLS = ("geodesic", "adaptive", "euclidean")


class ZeroAscentWarning(GeooptQuotientWarning, UserWarning):
    """GeodesicSAM's ascent step was skipped: the gradient is 0 in the ball's metric."""


class GeodesicSAM(torch.optim.Optimizer):
    r"""Sharpness-aware minimisation whose ascent step is invariant under the symmetries.

    Parameters
    ----------
    model : torch.nn.Module
        Its trainable parameters are optimised (``nn.Module``s, Hugging Face models and
        this package's ``ManifoldParameter`` layers alike).
    base_optimizer_cls : type
        The descent step, e.g. :class:`torch.optim.SGD` or
        :class:`~geoopt_quotient.optim.RiemannianSGD`; built on this optimizer's
        parameter groups with ``**base_kwargs``.
    rho : float
        Radius of the ascent step, in the ball's metric.
    metric : {"mix", "inv"}
        Metric of the discovered quotients (``ball="geodesic"``).
    symmetries : SymmetryPlan, list of SymmetryGroup, BoundPlan or None
        As for :func:`~geoopt_quotient.geodesic_sharpness`; ``None`` discovers them.
    ball : {"geodesic", "adaptive", "euclidean"}
        ``"geodesic"``: the quotient metric and its retraction (this class's purpose);
        ``"adaptive"``: ASAM, :math:`\xi = \rho T^2 g / |T g|` with
        :math:`T = |w| + \varepsilon`; ``"euclidean"``: SAM, :math:`\xi = \rho g / |g|`.
        The last two ignore ``metric`` and ``symmetries``.
    eps : float
        :math:`\varepsilon` of the adaptive metric :math:`\sum \xi^2 / (|w| + \varepsilon)^2`
        of every parameter outside the symmetry groups (ASAM's :math:`\eta`, 0.01 in Kwon
        et al.; with 0, parameters at exactly 0 are not perturbed). The discovered
        quotients stay exact (GL-invariant); a relaxed geometry comes with ``symmetries``.
    path : {"second_order", "exact"}
        Retraction of the geodesic ball (the exponential map with ``"exact"``).
    **base_kwargs
        Passed to ``base_optimizer_cls`` (``lr``, ``momentum``, ...).

    Raises
    ------
    ValueError
        For an unknown ``ball`` or ``path``, or a non-positive ``rho``.
    NonFiniteError
        From :meth:`first_step` (and :meth:`step`) when the ascent point would have a
        NaN/Inf entry (NaN/Inf gradients, or a gradient too small to scale to ``rho``);
        the message names the groups and the likely cause, and no parameter is changed.

    Warns
    -----
    ZeroAscentWarning
        From :meth:`first_step` when the gradient is 0 in the ball's metric: there is no
        ascent direction, so :math:`w' = w` and the step is the base optimizer's alone.
        With ``eps=0`` this happens when the gradient lives only on weights that are
        exactly 0 (a freshly initialised LoRA adapter, :math:`B = 0`): the adaptive metric
        :math:`\sum \xi^2 / |w|^2` cannot move them. The warning names them; ``eps > 0``
        perturbs them.

    Notes
    -----
    Use as the common SAM implementations::

        loss_fn(model(x), y).backward()
        optimizer.first_step(zero_grad=True)   # to w' = R_w(xi)
        loss_fn(model(x), y).backward()
        optimizer.second_step(zero_grad=True)  # back to w, base step with grad L(w')

    or ``optimizer.step(closure)`` with a closure that zeroes nothing, computes the loss
    and calls ``backward`` (called twice: at :math:`w` and at :math:`w'`). A step costs two
    forward and backward passes, as SAM; the geometry adds small :math:`h \times h` algebra
    per attention head, and :meth:`first_step` reads two flags from the device (is the
    ascent finite, is it zero). :meth:`first_step` keeps a copy of the parameters, which
    :meth:`second_step` writes back bitwise. After :meth:`first_step`,
    :attr:`last_ascent` holds :math:`\xi` (one tangent vector per group of :attr:`plan`).
    ``state_dict()`` is the base optimizer's.

    References
    ----------
    da Silva, Dangel & Oore (2025), "Hide & Seek: Transformer Symmetries Obscure
    Sharpness & Riemannian Geometry Finds It", ICML :cite:`dasilva2025hide`; SAM:
    Foret et al. (2021), "Sharpness-Aware Minimization for Efficiently Improving
    Generalization", ICLR :cite:`foret2021sam`; ASAM: Kwon et al. (2021)
    :cite:`kwon2021asam`.

    Examples
    --------
    >>> import torch
    >>> from geoopt_quotient.optim import GeodesicSAM
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    >>> x = torch.randn(4, 5, 8, dtype=torch.float64)
    >>> optimizer = GeodesicSAM(model, torch.optim.SGD, rho=0.05, lr=0.5)
    >>> [group.kind for group in optimizer.plan.symmetric_groups]
    ['query-key', 'value-output']
    >>> def closure():
    ...     out, _ = model(x, x, x)
    ...     loss = out.pow(2).mean()
    ...     loss.backward()
    ...     return loss
    >>> losses = []
    >>> for _ in range(5):
    ...     optimizer.zero_grad()
    ...     losses.append(optimizer.step(closure).item())
    >>> losses[-1] < losses[0]
    True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        base_optimizer_cls: Callable[..., torch.optim.Optimizer],
        *,
        rho: float,
        metric: str = "mix",
        symmetries: Symmetries = None,
        ball: str = "geodesic",
        eps: float = 0.0,
        path: str = "second_order",
        **base_kwargs: Any,
    ):
        rho = check_positive_float(rho, "rho")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        super().__init__([p for _, p in named], dict(rho=float(rho)))
        self.base_optimizer = base_optimizer_cls(self.param_groups, **base_kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)
        self.ascent = SAMAscent(
            model, metric=metric, symmetries=symmetries, ball=ball, eps=eps, path=path
        )
        self.plan, self.ball, self.path = self.ascent.plan, ball, path

    @property
    def last_ascent(self) -> List[torch.Tensor]:
        r""":math:`\xi` of the last :meth:`first_step`, one tangent vector per plan group."""
        return self.ascent.last_ascent

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        r"""Move the parameters to :math:`w' = R_w(\xi)`, :math:`\xi` the normalised
        Riemannian gradient of metric norm :math:`\rho`; gradients must be those at
        :math:`w`."""
        self.ascent.perturb(self.param_groups[0]["rho"])
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        """Put the parameters back to :math:`w` and take the base optimizer's step with
        the gradients now stored (those at :math:`w'`)."""
        self.ascent.restore()
        self.base_optimizer.step()
        # torch's LR schedulers check this flag (set by a wrapped step()) to warn about a
        # scheduler stepped before its optimizer; step() is not called on this path
        self._opt_called = True
        if zero_grad:
            self.zero_grad()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """A whole SAM step; ``closure`` computes the loss and calls ``backward``.

        Returns the loss at :math:`w` (the closure's first value).
        """
        if closure is None:
            raise ValueError(
                "GeodesicSAM.step needs a closure that computes the loss and calls "
                "backward(); or call first_step() and second_step() around your own passes "
                "(with the Hugging Face Trainer: geoopt_quotient.integrations."
                "GeodesicSAMTrainer)"
            )
        with torch.enable_grad():
            loss = closure()
        self.first_step(zero_grad=True)
        with torch.enable_grad():
            closure()
        self.second_step()
        return loss

    def state_dict(self) -> Dict[str, Any]:
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups


class SAMAscent:
    r"""The ascent half of a SAM step: move a model to :math:`w' = R_w(\xi)` and back.

    :class:`GeodesicSAM` and
    :class:`~geoopt_quotient.integrations.GeodesicSAMTrainer` share it; use it to put
    the ascent into a training loop whose descent step is someone else's (any
    optimizer, a gradient scaler, gradient accumulation). With the gradients at
    :math:`w` in ``.grad``, :meth:`perturb` moves the trainable parameters to

    .. math::

        w' = R_w(\xi), \qquad \xi = \rho\, \frac{\operatorname{grad} L(w)}
            {|\operatorname{grad} L(w)|_w},

    the Riemannian gradient in the ball's metric (quotient, adaptive or Euclidean),
    and :meth:`restore` writes :math:`w` back bitwise.

    Parameters
    ----------
    model : torch.nn.Module
        Its parameters with ``requires_grad`` are perturbed.
    metric, symmetries, ball, eps, path
        As for :class:`GeodesicSAM`.

    Raises
    ------
    ValueError
        For an unknown ``ball`` or ``path``.

    Notes
    -----
    The guarantees are :class:`GeodesicSAM`'s: a zero gradient in the ball's metric
    skips the ascent with a :class:`ZeroAscentWarning` naming the weights at exactly 0,
    and a non-finite ascent raises
    :class:`~geoopt_quotient.sharpness.NonFiniteError` before any parameter is written.
    The direction is invariant under scaling the gradients by a positive constant (a
    loss scale, a division by the accumulation steps).

    Examples
    --------
    >>> import torch
    >>> from geoopt_quotient.optim import SAMAscent
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(3, 1)
    >>> ascent = SAMAscent(model, ball="euclidean")
    >>> model(torch.randn(4, 3)).pow(2).mean().backward()
    >>> before = model.weight.detach().clone()
    >>> ascent.perturb(0.1)  # |xi| = 0.1 over weight and bias together
    >>> ascent.perturbed, bool((model.weight - before).norm() <= 0.1 + 1e-6)
    (True, True)
    >>> ascent.restore()
    >>> torch.equal(model.weight, before)
    True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        metric: str = "mix",
        symmetries: Symmetries = None,
        ball: str = "geodesic",
        eps: float = 0.0,
        path: str = "second_order",
    ):
        check_choice(ball, BALLS, "ball")
        check_choice(path, GEODESIC_PATHS, "path")
        self._named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.plan = _ball_plan(model, ball, symmetries, metric, eps)
        self.ball, self.path = ball, path
        self._saved: Dict[torch.Tensor, torch.Tensor] = {}
        self.last_ascent: List[torch.Tensor] = []

    @property
    def perturbed(self) -> bool:
        """Whether the parameters are at :math:`w'` (between :meth:`perturb` and
        :meth:`restore`)."""
        return bool(self._saved)

    @torch.no_grad()
    def perturb(self, rho: float) -> None:
        r"""Move the parameters to :math:`w'`, the ascent of metric norm ``rho`` along
        the gradients now in ``.grad`` (missing gradients count as 0)."""
        if self._saved:
            raise RuntimeError(
                "first_step() (perturb()) twice without second_step() (restore()) in between"
            )
        with AutocastState.capture().disabled():
            moved = self._ascend(rho)
        for name, value in self.plan.scatter(moved, self._current()).items():
            param = self._named[name]
            self._saved[param] = param.detach().clone()
            param.copy_(value)

    @torch.no_grad()
    def restore(self) -> None:
        """Write the parameters saved by :meth:`perturb` back (bitwise)."""
        if not self._saved:
            raise RuntimeError(
                "second_step() (restore()) without first_step() (perturb()) before it"
            )
        for param, saved in self._saved.items():
            param.copy_(saved)
        self._saved.clear()

    def _current(self) -> Dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self._named.items()}

    def _ascend(self, rho: float) -> List[torch.Tensor]:
        r"""The perturbed points, one per plan group; sets :attr:`last_ascent`.

        Element-wise groups (adaptive :math:`c = |w| + \varepsilon`, Euclidean
        :math:`c = 1`; the metric :math:`\sum \xi^2 / c^2`) are done together with
        ``torch._foreach`` kernels: their Riemannian gradient is :math:`c^2 g`, its squared
        norm :math:`\sum (c g)^2`. The quotient groups use their tangent spaces.
        """
        params = self._current()
        grads = {n: _grad_or_zeros(p) for n, p in self._named.items()}
        points, egrads = self.plan.gather(params), self.plan.gather(grads)
        dtypes = [x.dtype for x in points]
        points = [x.to(compute_dtype(x.dtype)) for x in points]
        egrads = [e.to(x.dtype) for e, x in zip(egrads, points)]
        flat = [i for i, g in enumerate(self.plan.groups) if _is_elementwise(g)]
        other = sorted(set(range(len(points))) - set(flat))
        scales = _elementwise_scales([self.plan.groups[i] for i in flat], [points[i] for i in flat])
        scaled = [egrads[i] for i in flat]  # c g
        if scales is not None:
            scaled = torch._foreach_mul(scaled, scales)
        spaces = {i: tangent_space(self.plan.groups[i].manifold, points[i]) for i in other}
        rgrads = {i: spaces[i].egrad2rgrad(egrads[i]) for i in other}
        squares = [n.pow(2) for n in torch._foreach_norm(scaled)] if scaled else []
        squares += [spaces[i].inner(r, r) for i, r in rgrads.items()]
        norm = torch.stack([q.to(torch.float64) for q in squares]).sum().sqrt()
        # a zero gradient in the ball's metric has no ascent direction: xi = 0, w' = w
        factor = torch.where(norm > 0, rho / norm.clamp_min(torch.finfo(norm.dtype).tiny), 0.0)
        ascent: List[torch.Tensor] = [None] * len(points)  # type: ignore[list-item]
        moved: List[torch.Tensor] = [None] * len(points)  # type: ignore[list-item]
        if scales is not None:  # c^2 g, in new tensors
            steps = torch._foreach_mul(scaled, scales)
            torch._foreach_mul_(steps, [factor.to(t.dtype) for t in steps])
        else:  # the gradients themselves (views of .grad): not in place
            steps = [g * factor.to(g.dtype) for g in scaled]
        for i, step in zip(flat, steps):
            ascent[i] = step
            moved[i] = points[i] + step
        for i, r in rgrads.items():
            ascent[i] = r * factor.to(r.dtype)
            moved[i] = self._move(spaces[i], ascent[i])
        self.last_ascent = ascent
        moved = [m.to(d) for m, d in zip(moved, dtypes)]
        finite = torch.stack([torch.isfinite(m).all() for m in moved]).all()
        no_ascent, bad = torch.stack([norm == 0, ~finite]).tolist()  # one host read
        if bad:
            raise NonFiniteError(self._non_finite_message(moved, grads, float(norm), rho))
        if no_ascent:
            warnings.warn(self._no_ascent_message(params), ZeroAscentWarning, stacklevel=5)
        return moved

    def _non_finite_message(
        self, moved: List[torch.Tensor], grads: Dict[str, torch.Tensor], norm: float, rho: float
    ) -> str:
        groups = self.plan.groups
        where = [g.name for g, m in zip(groups, moved) if not torch.isfinite(m).all()]
        text = (
            f"GeodesicSAM: the ascent step to w' is not finite in {', '.join(where)}; no "
            "parameter was changed. "
        )
        bad_grads = [n for n, g in grads.items() if not torch.isfinite(g).all()]
        if bad_grads:
            return text + (
                f"The gradients at w have NaN/Inf entries ({', '.join(bad_grads[:4])}): the "
                "loss or its backward pass overflowed; check the loss at w"
            )
        return text + (
            f"The gradient's norm in the ball's metric is {norm:.3g}, too small to scale to "
            f"rho = {rho:g} in the parameters' dtype (weights at or "
            "near 0 with `eps=0`?); pass `eps > 0` (ASAM's 0.01) or use a larger dtype"
        )

    def _no_ascent_message(self, params: Dict[str, torch.Tensor]) -> str:
        text = (
            "GeodesicSAM: the gradient is 0 in the ball's metric, so the ascent step is "
            "skipped (w' = w) and this step is the base optimizer's alone"
        )
        zero = zero_weight_parameters(self.plan, params)
        return f"{text}. Likely cause: {zero_weight_cause(zero)}" if zero else text

    def _move(self, space, u: torch.Tensor) -> torch.Tensor:
        """The path of a quotient group (only the geodesic ball has any)."""
        return space.expmap(u) if self.path == "exact" else space.retr(u)


def _is_elementwise(group: SymmetryGroup) -> bool:
    """A whole parameter in the adaptive or the Euclidean metric (element-wise weights)."""
    return group.is_whole_parameter and (
        has_elementwise_metric(group.manifold) or is_plain_euclidean(group.manifold)
    )


def _elementwise_scales(
    groups: List[SymmetryGroup], points: List[torch.Tensor]
) -> List[torch.Tensor] | None:
    r""":math:`c = |w| + \varepsilon` of each element-wise group (1 for Euclidean ones), or
    ``None`` when all are Euclidean."""
    adaptive = [has_elementwise_metric(g.manifold) for g in groups]
    if not any(adaptive):
        return None
    scales = torch._foreach_abs(points)
    for scale, group, is_adaptive in zip(scales, groups, adaptive):
        if is_adaptive:
            scale.add_(group.manifold.eps)
        else:
            scale.fill_(1.0)
    return scales


def _grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(param) if param.grad is None else param.grad.detach()


def _ball_plan(
    model: torch.nn.Module, ball: str, symmetries: Symmetries, metric: str, eps: float
) -> BoundPlan:
    if ball == "euclidean":
        return SymmetryPlan(_euclidean_groups(model.named_parameters())).bind(model)
    if ball == "adaptive":
        return SymmetryPlan(adaptive_eps=eps).bind(model)
    if isinstance(symmetries, BoundPlan):
        return symmetries
    if symmetries is None:
        symmetries = find_symmetries(model, metric=metric, eps=0.0)
    elif not isinstance(symmetries, SymmetryPlan):
        symmetries = SymmetryPlan(list(symmetries))
    return replace(symmetries, adaptive_eps=eps).bind(model)


def _euclidean_groups(
    named: Iterable[Tuple[str, torch.nn.Parameter]],
) -> List[SymmetryGroup]:
    euclidean = geoopt.Euclidean()
    return [
        whole_parameter_group(n, p.shape, euclidean, kind="euclidean")
        for n, p in named
        if p.requires_grad
    ]
