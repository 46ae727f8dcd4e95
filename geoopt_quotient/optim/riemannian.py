r"""Geoopt optimizers with the fixes that training on a quotient needs.

:class:`RiemannianSGD`
    geoopt 0.5.1 seeds the momentum buffer with the raw Euclidean gradient
    (``state["momentum_buffer"] = grad.clone()``, *before* ``egrad2rgrad``), so the first
    step moves along :math:`\mu\,\nabla f + \operatorname{grad} f`. The Euclidean
    gradient of the factors transforms like :math:`(\nabla_G A^\top, \nabla_H A^{-1})`,
    not like a tangent vector :math:`(\xi_G A^{-1}, \xi_H A^\top)`, and it is not
    horizontal, so two representatives of the same point take different steps and
    end in different functions. Here the buffer starts so that after the first step
    it equals the Riemannian gradient, as :class:`torch.optim.SGD` does with the
    Euclidean one.
:class:`RiemannianAdam`
    geoopt's update itself is equivariant (the moments start at zero and the second
    moment accumulates ``component_inner``, one invariant scalar per quotient point),
    but after ``load_state_dict`` :meth:`torch.optim.Adam.__setstate__` turns each
    ``state["step"]`` into a float32 tensor (unless the default dtype is float64), and
    geoopt then computes the bias corrections :math:`1 - \beta^t` in float32: a resumed
    float64 run departs from the uninterrupted one at float32 precision (outputs differ
    by ~3e-6 after 20 more steps in ``tests/test_nn.py``). Here the step count is kept
    a Python ``int`` and resuming is exact. Also, geoopt silently ignores ``maximize`` and
    ``decoupled_weight_decay``; here they raise.

With both, ``weight_decay > 0`` adds :math:`\lambda X` to the Euclidean gradient of the
factors: the penalty :math:`\tfrac\lambda2(|G|^2 + |H|^2)` is not GL-invariant, so it
(deliberately) prefers balanced representatives and training is then no longer
independent of the representative.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional

import geoopt
import torch
from geoopt.tensor import ManifoldParameter, ManifoldTensor

from ..errors import GeooptQuotientError

__all__ = ["RiemannianAdam", "RiemannianSGD", "StepSizeError"]


class StepSizeError(GeooptQuotientError, torch.linalg.LinAlgError):
    """A step of a Riemannian optimizer left a point where its geometry cannot be computed.

    On :class:`~geoopt_quotient.GLQuotient` and its subgroups a step too large for the
    curvature can throw the factors off the manifold (a factor loses rank, or its
    entries overflow), and the next Cholesky factorisation of a Gram matrix fails. The
    message names the optimizer's learning rate and the parameter. Also a
    :class:`torch.linalg.LinAlgError`, the error it replaces.
    """


@contextlib.contextmanager
def _step_size_errors(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Turn a :class:`torch.linalg.LinAlgError` of a step into a :class:`StepSizeError`."""
    try:
        yield
    except torch.linalg.LinAlgError as error:
        if isinstance(error, StepSizeError):
            raise
        raise StepSizeError(_step_size_message(optimizer, error)) from error


def _off_manifold(optimizer: torch.optim.Optimizer) -> List[str]:
    """Where the optimizer's manifold parameters are off their manifolds (a check per
    point: only on the error path)."""
    found = []
    for g, group in enumerate(optimizer.param_groups):
        for i, point in enumerate(group["params"]):
            if not isinstance(point, (ManifoldParameter, ManifoldTensor)):
                continue
            ok, reason = point.manifold.check_point_on_manifold(point.detach(), explain=True)
            if not ok:
                found.append(f"parameter {i} of group {g} on {point.manifold!r}: {reason}")
    return found


def _step_size_message(optimizer: torch.optim.Optimizer, error: Exception) -> str:
    rates = sorted({group["lr"] for group in optimizer.param_groups})
    lr = ", ".join(f"lr={rate:g}" for rate in rates)
    off = _off_manifold(optimizer)
    where = "; ".join(off[:3]) + (f" (and {len(off) - 3} more)" if len(off) > 3 else "")
    cause = str(error).splitlines()[0]
    return (
        f"{type(optimizer).__name__} ({lr}): the geometry at a point could not be "
        f"computed ({cause})"
        + (f"; off the manifold: {where}" if off else "")
        + ". A step too large for the curvature throws a point off its manifold (a factor "
        "loses rank or its entries overflow): lower the learning rate "
        f"(e.g. lr={rates[-1] / 10:g}), clip the gradient's norm, or relax the geometry "
        "with eps > 0. If this was the first step, the starting point is not on the "
        "manifold."
    )


class RiemannianSGD(geoopt.optim.RiemannianSGD):
    r""":class:`geoopt.optim.RiemannianSGD` whose momentum starts from the Riemannian gradient.

    The update is, with :math:`g_t = \operatorname{egrad2rgrad}(x_t, \nabla f(x_t) +
    \lambda x_t)`,

    .. math::

        m_1 = g_1, \qquad m_t = \mu\, \mathcal T(m_{t-1}) + (1 - \tau) g_t, \qquad
        x_{t+1} = R_{x_t}(-\eta\, m_t)

    (Nesterov: :math:`-\eta (g_t + \mu m_t)`), where :math:`\mathcal T` is the vector
    transport of the manifold. This is exactly :class:`torch.optim.SGD` on Euclidean
    parameters. geoopt 0.5.1 instead starts from :math:`m_1 = \mu \nabla f + (1-\tau) g_1`,
    which is neither horizontal nor equivariant (and double-counts the first gradient
    even on Euclidean parameters).

    The fix is a pre-step seed of the buffer that geoopt then updates: zero when
    ``dampening == 0`` (then :math:`m_1 = g_1` after geoopt's update), otherwise
    :math:`(\tau/\mu)\, g_1`. Arguments are those of :class:`geoopt.optim.RiemannianSGD`.

    Parameters
    ----------
    params : iterable
        Parameters or parameter groups; a :class:`geoopt.ManifoldParameter` is updated
        on its manifold, any other tensor as a Euclidean one.
    lr : float
        Learning rate :math:`\eta`.
    momentum : float
        Momentum :math:`\mu \ge 0` (default 0).
    dampening : float
        Dampening :math:`\tau` of the momentum (default 0).
    weight_decay : float
        :math:`\lambda \ge 0`, added as :math:`\lambda x` to the Euclidean gradient
        (default 0; not GL-invariant, see the module notes).
    nesterov : bool
        Nesterov momentum (default ``False``; needs ``momentum > 0`` and no dampening).
    stabilize : int or None
        Every ``stabilize`` steps geoopt projects the points back onto their
        manifolds (``projx``) and the buffers onto the tangent spaces; default ``None``,
        never.

    Raises
    ------
    StepSizeError
        From :meth:`step`, where a step left a point at which the geometry cannot be
        computed (the learning rate was too large).
    """

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._seed_momentum()
        with _step_size_errors(self):
            super().step()
        return loss

    @torch.no_grad()
    def _seed_momentum(self) -> None:
        for group in self.param_groups:
            momentum, dampening = group["momentum"], group["dampening"]
            if momentum <= 0:
                continue
            for point in group["params"]:
                if point.grad is None or len(self.state[point]) != 0:
                    continue
                if dampening == 0:
                    buffer = torch.zeros_like(point)
                else:
                    if isinstance(point, (ManifoldParameter, ManifoldTensor)):
                        manifold = point.manifold
                    else:
                        manifold = self._default_manifold
                    grad = point.grad.add(point, alpha=group["weight_decay"])
                    buffer = manifold.egrad2rgrad(point, grad).mul_(dampening / momentum)
                self.state[point]["momentum_buffer"] = buffer


class RiemannianAdam(geoopt.optim.RiemannianAdam):
    r""":class:`geoopt.optim.RiemannianAdam` that resumes exactly from a state dict.

    On a quotient manifold whose ``component_inner`` returns one invariant scalar per
    point (:class:`~geoopt_quotient.GLQuotient`, :class:`~geoopt_quotient.DiagonalQuotient`)
    the update

    .. math::

        m_t = \beta_1 \mathcal T(m_{t-1}) + (1-\beta_1) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) \langle g_t, g_t \rangle_{x_t}, \quad
        x_{t+1} = R_{x_t}\Big(-\eta\, \frac{m_t / (1-\beta_1^t)}
            {\sqrt{v_t / (1-\beta_2^t)} + \epsilon}\Big)

    is GL-equivariant as in geoopt. This subclass only keeps ``state["step"]`` an
    ``int`` after :meth:`load_state_dict` (torch turns it into a float32 tensor, which
    makes geoopt compute the bias corrections in float32), and raises on
    ``maximize=True`` and ``decoupled_weight_decay=True``, which geoopt ignores.

    Parameters
    ----------
    params : iterable
        Parameters or parameter groups; a :class:`geoopt.ManifoldParameter` is updated
        on its manifold, any other tensor as a Euclidean one.
    *args, **kwargs
        The arguments of :class:`geoopt.optim.RiemannianAdam` (those of
        :class:`torch.optim.Adam`: ``lr``, ``betas``, ``eps``, ``weight_decay``,
        ``amsgrad``, and geoopt's ``stabilize``).

    Raises
    ------
    ValueError
        For ``maximize=True`` or ``decoupled_weight_decay=True``.
    StepSizeError
        From :meth:`step`, where a step left a point at which the geometry cannot be
        computed (the learning rate was too large).
    """

    def __init__(self, params, *args: Any, **kwargs: Any):
        for flag in ("maximize", "decoupled_weight_decay"):
            if kwargs.get(flag, False):
                raise ValueError(f"RiemannianAdam does not implement `{flag}=True`")
        super().__init__(params, *args, **kwargs)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        with _step_size_errors(self):
            return super().step(closure)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        for param_state in self.state.values():
            step = param_state.get("step") if isinstance(param_state, dict) else None
            if torch.is_tensor(step):
                param_state["step"] = int(step.item())
