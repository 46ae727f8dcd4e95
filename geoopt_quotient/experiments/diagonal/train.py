r"""A population of diagonal linear networks trained by full-batch gradient descent.

Every model is :math:`f(x) = x^\top (u \odot v)`, trained on

.. math::

    L(u, v) = \frac{1}{2n} |X (u \odot v) - y|^2, \qquad
    u \leftarrow u - \eta\, g \odot v, \quad v \leftarrow v - \eta\, g \odot u, \quad
    g = \tfrac1n X^\top (X (u \odot v) - y),

until :math:`L \le 10^{-5}` (or a step budget, recorded per model). The population is
one ``(M, 2, d)`` tensor (row 0 :math:`u`, row 1 :math:`v`, as in
:class:`~geoopt_quotient.DiagonalQuotient`), so training is vectorised over models.

Initialisation
--------------
:math:`u_0 = \alpha\mathbf 1`, :math:`v_0 = 0`, so :math:`\beta_0 = 0`. With
:math:`a = (u + v)/2`, :math:`b = (u - v)/2` this is the parametrisation
:math:`\beta = a^2 - b^2` with :math:`a_0 = b_0 = \alpha / 2`, and gradient descent on
:math:`(u, v)` with step :math:`\eta` is gradient descent on :math:`(a, b)` with step
:math:`\eta / 2`: the setting of Woodworth et al. (2020), whose gradient flow converges
to the interpolant minimising the hyperbolic entropy
:math:`\sum_i \alpha_W^2\, q(\beta_i / \alpha_W^2)`, :math:`\alpha_W = \alpha / 2`:
close to minimum :math:`\ell_1` for :math:`\alpha_W^2 \ll |\beta_i|` ("rich" regime),
minimum :math:`\ell_2` for :math:`\alpha_W^2 \gg |\beta_i|` ("kernel" regime). (The
symmetric :math:`u_0 = v_0 = \alpha\mathbf 1` would keep :math:`|u| = |v|`, hence
:math:`\beta \ge 0`, forever; random signs would freeze a random sign pattern.)

The default :math:`\alpha` is log-uniform on :math:`[0.01, 1]`: from deep in the rich
regime (:math:`\alpha_W^2 = 2.5\cdot10^{-5}`) to its end (:math:`\alpha_W^2 = 0.25`, the
size of a typical non-zero :math:`|\beta^*_i| \approx 1/\sqrt s`). Larger scales all
give the same minimum-:math:`\ell_2` interpolant, i.e. ties that carry no information.

Step sizes
----------
Gradient flow conserves :math:`u_i^2 - v_i^2 = \alpha^2`, so
:math:`u_i^2 + v_i^2 = \sqrt{\alpha^4 + 4\beta_i^2} \le \alpha^2 + 2|\beta_i|`, and the
loss Hessian in :math:`(u, v)` has largest eigenvalue at most
:math:`\lambda_{\max}(X^\top X / n)\,\max_i (u_i^2 + v_i^2)`. With the scale
:math:`\hat\beta = \operatorname{rms}(y)` of the coefficients (:math:`\approx |\beta^*|`)
the step is

.. math::

    \eta = \frac{f}{\lambda_{\max}(X^\top X / n)\,(\alpha^2 + 2\hat\beta)}, \qquad
    f \sim \text{log-uniform}[0.2, 1],

so :math:`\eta\lambda_{\max} \lesssim f < 2` (stable) while the step, which also shapes the
implicit bias (Even et al., 2023), varies five-fold between models. A model whose loss
becomes non-finite or grows :math:`10^3`-fold restarts from its initialisation with half
the step (counted in ``restarts``).

The ``step-size`` population
----------------------------
:func:`train_schedule_population` trains the population of ``reproduce diagonal --setup
step-size``: one initialisation :math:`u_0 = 0.1\cdot\mathbf 1`, :math:`v_0 = 0` for
every model, models alternating between full-batch GD and SGD with one sample per step,
each with its own step size (log-uniform on :data:`STEP_SIZE_RANGES`), divided by
:data:`DEFAULT_STEP_DECAY` after :data:`DEFAULT_LARGE_STEPS` steps. Large SGD steps keep
the iterates bouncing across the valley of the loss, which biases them towards sparse
solutions (Andriushchenko et al., 2023); large GD steps do not: here generalization is
set by the training dynamics, not by the initialisation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np
import torch
from tqdm.auto import tqdm

from .data import SparseRegression

__all__ = [
    "DEFAULT_INIT_RANGE",
    "DEFAULT_STEP_FACTOR_RANGE",
    "STEP_SIZE_RANGES",
    "TrainedPopulation",
    "initial_points",
    "sample_hyperparameters",
    "sample_step_size_hyperparameters",
    "step_sizes_for",
    "train_population",
    "train_schedule_population",
]

DEFAULT_INIT_RANGE = (0.01, 1.0)
DEFAULT_STEP_FACTOR_RANGE = (0.2, 1.0)
DEFAULT_TARGET_LOSS = 1e-5
DEFAULT_MAX_STEPS = 200_000
#: Log-uniform step-size ranges of the ``step-size`` population, per algorithm: from the
#: public notebook's gradient-flow step (0.01) to its largest scheduled steps for
#: n = 80, d = 200 (full-batch GD 2.72) and its constant SGD step (0.25).
STEP_SIZE_RANGES: Dict[str, Tuple[float, float]] = {"gd": (0.01, 2.72), "sgd": (0.01, 0.25)}
#: Initialisation scale of the ``step-size`` population: u0 = 0.1 * 1, v0 = 0.
STEP_SIZE_INIT = 0.1
#: The step is divided by ``DEFAULT_STEP_DECAY`` after ``DEFAULT_LARGE_STEPS`` steps.
DEFAULT_LARGE_STEPS = 10_000
DEFAULT_STEP_DECAY = 4.8


@dataclass
class TrainedPopulation:
    """The trained models and how they were trained.

    Attributes
    ----------
    points : torch.Tensor
        ``(M, 2, d)``: :math:`u` and :math:`v` of every model.
    init_scales, step_sizes : torch.Tensor
        ``(M,)``: :math:`\\alpha` and the step :math:`\\eta` finally used.
    steps : torch.Tensor
        ``(M,)`` gradient steps of the final run.
    restarts : torch.Tensor
        ``(M,)`` restarts after divergence.
    converged : torch.Tensor
        ``(M,)`` bool: reached ``target_loss`` within ``max_steps``.
    train_loss : torch.Tensor
        ``(M,)`` final training loss.
    target_loss : float
        The stopping threshold on the training loss.
    max_steps : int
        The step budget per model.
    seconds : float
        Wall time of the training.
    stochastic : torch.Tensor, optional
        ``(M,)`` bool: trained by SGD with batch size 1 (``None``: every model by
        full-batch gradient descent).
    """

    points: torch.Tensor
    init_scales: torch.Tensor
    step_sizes: torch.Tensor
    steps: torch.Tensor
    restarts: torch.Tensor
    converged: torch.Tensor
    train_loss: torch.Tensor
    target_loss: float
    max_steps: int
    seconds: float
    stochastic: torch.Tensor | None = None

    @property
    def beta(self) -> torch.Tensor:
        r""":math:`\beta = u \odot v`, ``(M, d)``."""
        return self.points[:, 0] * self.points[:, 1]

    def __len__(self) -> int:
        return self.points.shape[0]


def _log_uniform(rng: np.random.Generator, low: float, high: float, size: int) -> np.ndarray:
    if not 0 < low <= high:
        raise ValueError(f"a log-uniform range needs 0 < low <= high, got ({low}, {high})")
    return np.exp(rng.uniform(math.log(low), math.log(high), size))


def sample_hyperparameters(
    models: int,
    *,
    seed: int = 0,
    init_range: Tuple[float, float] = DEFAULT_INIT_RANGE,
    step_factor_range: Tuple[float, float] = DEFAULT_STEP_FACTOR_RANGE,
) -> Tuple[np.ndarray, np.ndarray]:
    r"""Log-uniform initialisation scales :math:`\alpha` and step factors :math:`f`.

    Drawn from :class:`numpy.random.Generator` seeded with ``(seed, 2)`` (independent of
    the data's stream).

    Parameters
    ----------
    models : int
        Number :math:`M` of models.
    seed : int
        The population's seed.
    init_range : (float, float)
        Range of the initialisation scale :math:`\alpha` (:math:`u_0 = \alpha\mathbf 1`);
        default (0.01, 1).
    step_factor_range : (float, float)
        Range of the step factor :math:`f` of :func:`step_sizes_for`; default (0.2, 1).

    Returns
    -------
    init_scales : numpy.ndarray
        ``(M,)`` initialisation scales :math:`\alpha`.
    step_factors : numpy.ndarray
        ``(M,)`` step factors :math:`f`.

    Raises
    ------
    ValueError
        For a range that is not ``0 < low <= high``.
    """
    rng = np.random.default_rng([seed, 2])
    return _log_uniform(rng, *init_range, models), _log_uniform(rng, *step_factor_range, models)


def step_sizes_for(
    data: SparseRegression, init_scales: torch.Tensor, factors: torch.Tensor
) -> torch.Tensor:
    r""":math:`\eta = f / (\lambda_{\max}(X^\top X/n)(\alpha^2 + 2\operatorname{rms}(y)))`."""
    x = data.x_train
    curvature = torch.linalg.eigvalsh(x.T @ x / data.n_train).max()
    scale = data.y_train.pow(2).mean().sqrt()
    return factors / (curvature * (init_scales**2 + 2 * scale))


def initial_points(init_scales: torch.Tensor, dim: int) -> torch.Tensor:
    r""":math:`u_0 = \alpha\mathbf 1`, :math:`v_0 = 0`: shape ``(M, 2, d)``."""
    u = init_scales[:, None].expand(-1, dim)
    return torch.stack((u, torch.zeros_like(u)), dim=1).clone()


def _restart_diverged(
    diverged: torch.Tensor,
    eta: torch.Tensor,
    restarts: torch.Tensor,
    steps: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    init_scales: torch.Tensor,
    max_restarts: int,
) -> Tuple[torch.Tensor, ...]:
    """Halve the step size of the ``diverged`` models and restart them from their
    initialisation; a FloatingPointError after ``max_restarts`` restarts."""
    if int(restarts[diverged].max()) >= max_restarts:
        raise FloatingPointError(
            f"{int(diverged.sum())} model(s) still diverge after {max_restarts} "
            "restarts with halved step sizes"
        )
    eta = torch.where(diverged, eta / 2, eta)
    restarts = restarts + diverged.long()
    steps = torch.where(diverged, torch.zeros_like(steps), steps)
    u = torch.where(diverged[:, None], init_scales[:, None].expand_as(u), u)
    v = torch.where(diverged[:, None], torch.zeros_like(v), v)
    return eta, restarts, steps, u, v


def train_population(
    data: SparseRegression,
    init_scales: torch.Tensor,
    step_sizes: torch.Tensor,
    *,
    target_loss: float = DEFAULT_TARGET_LOSS,
    max_steps: int = DEFAULT_MAX_STEPS,
    divergence_factor: float = 1e3,
    max_restarts: int = 10,
    progress: bool = False,
) -> TrainedPopulation:
    r"""Full-batch gradient descent of every model until :math:`L \le` ``target_loss``.

    Parameters
    ----------
    data : SparseRegression
        The training data (``x_train``, ``y_train``).
    init_scales, step_sizes : torch.Tensor
        ``(M,)``: :math:`\alpha` and :math:`\eta` per model.
    target_loss : float
        A model stops at the first iterate with training loss at most this.
    max_steps : int
        Step budget per model (per run, restarts start from zero).
    divergence_factor : float
        Restart (with half the step) a model whose loss exceeds this factor times its
        initial loss, or is not finite.
    max_restarts : int
        Give up (raise) after this many restarts of one model.
    progress : bool
        Show a tqdm bar (on a terminal only).

    Returns
    -------
    TrainedPopulation
        The trained ``(M, 2, d)`` points, with per-model losses, steps and restarts.
    """
    if not (target_loss > 0 and max_steps >= 1):
        raise ValueError(f"need target_loss > 0 and max_steps >= 1, got {target_loss}, {max_steps}")
    x, y, n = data.x_train, data.y_train, data.n_train
    init_scales = init_scales.to(x)
    eta = step_sizes.to(x).clone()
    models = init_scales.shape[0]
    start = time.perf_counter()
    points = initial_points(init_scales, data.dim)
    u, v = points[:, 0].clone(), points[:, 1].clone()
    steps = torch.zeros(models, dtype=torch.long, device=x.device)
    restarts = torch.zeros_like(steps)
    done = torch.zeros(models, dtype=torch.bool, device=x.device)
    initial_loss = data.train_loss(u * v)
    bar = tqdm(
        total=max_steps,
        desc="training",
        unit="step",
        disable=None if progress else True,
        leave=False,
        mininterval=0.5,
    )
    chunk = 0
    loss = initial_loss
    while True:
        residual = (u * v) @ x.T - y
        loss = residual.pow(2).sum(-1) / (2 * n)
        diverged = ~torch.isfinite(loss) | (loss > divergence_factor * initial_loss)
        if bool(diverged.any()):
            eta, restarts, steps, u, v = _restart_diverged(
                diverged, eta, restarts, steps, u, v, init_scales, max_restarts
            )
            continue
        done = loss <= target_loss
        active = ~done & (steps < max_steps)
        if not bool(active.any()):
            break
        grad = residual @ x / n
        rate = (eta * active)[:, None] * grad
        u, v = u - rate * v, v - rate * u
        steps += active.long()
        chunk += 1
        if chunk == 1000:
            bar.update(min(chunk, max_steps - bar.n))
            bar.set_postfix(converged=f"{int(done.sum())}/{models}", refresh=False)
            chunk = 0
    bar.close()
    return TrainedPopulation(
        points=torch.stack((u, v), dim=1),
        init_scales=init_scales,
        step_sizes=eta,
        steps=steps,
        restarts=restarts,
        converged=done,
        train_loss=loss,
        target_loss=float(target_loss),
        max_steps=int(max_steps),
        seconds=time.perf_counter() - start,
    )


def sample_step_size_hyperparameters(
    models: int,
    *,
    seed: int = 0,
    ranges: Dict[str, Tuple[float, float]] = STEP_SIZE_RANGES,
) -> Tuple[np.ndarray, np.ndarray]:
    r"""The algorithm and the step size of every model of the ``step-size`` population.

    Models alternate between full-batch gradient descent (even indices) and SGD with
    batch size 1 (odd indices); each step size is log-uniform on its algorithm's range
    in ``ranges``, drawn from :class:`numpy.random.Generator` seeded with ``(seed, 2)``.

    Parameters
    ----------
    models : int
        Number :math:`M` of models.
    seed : int
        The population's seed.
    ranges : dict
        ``{"gd": (low, high), "sgd": (low, high)}``: the step-size range of each
        algorithm (default :data:`STEP_SIZE_RANGES`).

    Returns
    -------
    stochastic : numpy.ndarray
        ``(M,)`` bool, ``True`` for SGD.
    step_sizes : numpy.ndarray
        ``(M,)``.

    Raises
    ------
    ValueError
        For a range that is not ``0 < low <= high``.
    """
    rng = np.random.default_rng([seed, 2])
    stochastic = np.arange(models) % 2 == 1
    unit = rng.uniform(0.0, 1.0, models)
    low = np.where(stochastic, ranges["sgd"][0], ranges["gd"][0])
    high = np.where(stochastic, ranges["sgd"][1], ranges["gd"][1])
    if not (np.all(low > 0) and np.all(low <= high)):
        raise ValueError(f"step-size ranges need 0 < low <= high, got {ranges}")
    return stochastic, np.exp(np.log(low) + unit * (np.log(high) - np.log(low)))


class _SampleStream:
    """One training-sample index per model and step, from a seeded numpy stream."""

    def __init__(self, n: int, models: int, seed: int, device: torch.device, block: int = 1024):
        self._rng = np.random.default_rng([seed, 3])
        self._shape = (block, models)
        self._n, self._device = n, device
        self._block = torch.empty(0)
        self._next = block

    def draw(self) -> torch.Tensor:
        if self._next == self._shape[0]:
            indices = self._rng.integers(0, self._n, size=self._shape)
            self._block = torch.as_tensor(indices, device=self._device)
            self._next = 0
        self._next += 1
        return self._block[self._next - 1]


def train_schedule_population(
    data: SparseRegression,
    stochastic: torch.Tensor,
    step_sizes: torch.Tensor,
    *,
    init_scale: float = STEP_SIZE_INIT,
    large_steps: int = DEFAULT_LARGE_STEPS,
    decay: float = DEFAULT_STEP_DECAY,
    target_loss: float = DEFAULT_TARGET_LOSS,
    max_steps: int = DEFAULT_MAX_STEPS,
    seed: int = 0,
    divergence_factor: float = 1e3,
    max_restarts: int = 10,
    progress: bool = False,
) -> TrainedPopulation:
    r"""GD or SGD (batch size 1) with a step decay, every model until :math:`L \le` ``target_loss``.

    Every model starts at :math:`u_0 = \alpha\mathbf 1`, :math:`v_0 = 0`
    (:math:`\alpha` = ``init_scale``) and takes steps :math:`(u, v) \leftarrow (u - \eta_t
    g \odot v, v - \eta_t g \odot u)` with :math:`\eta_t = \eta` for the first
    ``large_steps`` steps and :math:`\eta / \text{decay}` after. Full-batch models use
    :math:`g = X^\top r / n`, SGD models :math:`g = r_i x_i` for one sample :math:`i`
    drawn uniformly (with replacement) per step, the gradient of
    :math:`(x_i^\top\beta - y_i)^2 / 2` and an unbiased estimate of the full one
    (:math:`r = X\beta - y`). The sample indices come from
    :class:`numpy.random.Generator` seeded with ``(seed, 3)``. A model stops at the first
    iterate whose full training loss is at most ``target_loss``; one whose loss is not
    finite or exceeds ``divergence_factor`` times its initial loss restarts from its
    initialisation with half the step.

    Parameters
    ----------
    data : SparseRegression
        The training data (``x_train``, ``y_train``).
    stochastic : torch.Tensor
        ``(M,)`` bool: SGD (``True``) or full-batch gradient descent.
    step_sizes : torch.Tensor
        ``(M,)`` initial steps :math:`\eta`.
    init_scale, large_steps, decay
        As above.
    target_loss, max_steps, divergence_factor, max_restarts, progress
        As in :func:`train_population`.
    seed : int
        Seed of the SGD samples.

    Returns
    -------
    TrainedPopulation
        ``step_sizes`` are the initial steps finally used (halved by restarts).
    """
    if not (target_loss > 0 and max_steps >= 1 and large_steps >= 0 and decay > 0):
        raise ValueError(
            "need target_loss > 0, max_steps >= 1, large_steps >= 0 and decay > 0, got "
            f"{target_loss}, {max_steps}, {large_steps}, {decay}"
        )
    x, y, n = data.x_train, data.y_train, data.n_train
    stochastic = stochastic.to(device=x.device, dtype=torch.bool)
    eta = step_sizes.to(x).clone()
    models = eta.shape[0]
    init_scales = torch.full((models,), float(init_scale), dtype=x.dtype, device=x.device)
    start = time.perf_counter()
    u, v = initial_points(init_scales, data.dim).unbind(1)
    steps = torch.zeros(models, dtype=torch.long, device=x.device)
    restarts = torch.zeros_like(steps)
    initial_loss = data.train_loss(u * v)
    samples = _SampleStream(n, models, seed, x.device)
    bar = tqdm(
        total=max_steps,
        desc="training",
        unit="step",
        disable=None if progress else True,
        leave=False,
        mininterval=0.5,
    )
    while True:
        residual = (u * v) @ x.T - y
        loss = residual.pow(2).sum(-1) / (2 * n)
        diverged = ~torch.isfinite(loss) | (loss > divergence_factor * initial_loss)
        if bool(diverged.any()):
            eta, restarts, steps, u, v = _restart_diverged(
                diverged, eta, restarts, steps, u, v, init_scales, max_restarts
            )
            continue
        done = loss <= target_loss
        active = ~done & (steps < max_steps)
        if not bool(active.any()):
            break
        index = samples.draw()
        single = residual.gather(1, index[:, None]) * x[index]
        grad = torch.where(stochastic[:, None], single, residual @ x / n)
        rate = torch.where(steps < large_steps, eta, eta / decay) * active
        u, v = u - rate[:, None] * grad * v, v - rate[:, None] * grad * u
        steps += active.long()
        if int(steps.max()) % 1000 == 0:
            bar.n = int(steps.max())
            bar.set_postfix(converged=f"{int(done.sum())}/{models}", refresh=True)
    bar.close()
    return TrainedPopulation(
        points=torch.stack((u, v), dim=1),
        init_scales=init_scales,
        step_sizes=eta,
        steps=steps,
        restarts=restarts,
        converged=done,
        train_loss=loss,
        target_loss=float(target_loss),
        max_steps=int(max_steps),
        seconds=time.perf_counter() - start,
        stochastic=stochastic,
    )
