r"""Closed-form worst-case sharpness of diagonal linear networks on whitened data.

Setting
-------
A diagonal linear network :math:`f(x) = x^\top (u \odot v)` with squared loss
:math:`L(\beta) = c\,|X\beta - y|^2` (``scale`` :math:`= c`, e.g. :math:`c = 1/(2n)`).
When :math:`X^\top X = I` (orthonormal columns, :math:`n \ge d`),

.. math::

    L(\beta) = c\,\big(|\beta - \beta^*|^2 + |y|^2 - |X^\top y|^2\big),
    \qquad \beta^* = X^\top y,

so the loss increase from :math:`\beta_0 = u \odot v` to :math:`\beta'` is
:math:`c\,(|\beta' - \beta^*|^2 - |r|^2)` with :math:`r = \beta_0 - \beta^*`. Here
:math:`\beta^*` is the minimiser of the *training* loss (not a ground truth).

Every ball considered here is *separable*: a perturbation spends a budget
:math:`q_i \ge 0` on coordinate :math:`i` (:math:`\sum_i q_i \le \rho^2`), and with budget
:math:`q` the reachable :math:`\beta'_i` form an interval :math:`[\ell_i(q), h_i(q)]`
containing :math:`\beta_{0,i}`. Because :math:`(\beta'_i - \beta^*_i)^2` is convex, the
best point of an interval is one of its ends, so the worst case is

.. math::

    S(\rho) = c \max_{q \ge 0,\ \sum_i q_i \le \rho^2} \sum_i G_i(q_i), \qquad
    G_i(q) = \max_{e \in \{\ell_i(q), h_i(q)\}} (e - \beta^*_i)^2 - r_i^2 .

The intervals, for horizontal tangent vectors :math:`\eta = (B u, B v)` of
:class:`~geoopt_quotient.DiagonalQuotient` (norms :math:`|\eta|^2_{\text{inv}} = 2|B|^2`,
:math:`|\eta|^2_{\text{mix}} = 2\sum_i B_i^2 \beta_{0,i}^2`) and for the adaptive ball:

* **mix**, exact geodesic :math:`\beta(t) = \beta_0 (1 + 2Bt)`: :math:`\delta = 2B\beta_0`
  costs :math:`|\delta|^2 / 2`, so :math:`\beta' \in \beta_0 \pm \sqrt{2q}`: a Euclidean ball
  of radius :math:`\sqrt2\rho` in :math:`\beta`. Maximising the convex quadratic gives the
  closed form (:func:`mix_worst_case`)

  .. math:: S_{\text{mix}}(\rho) = c\,(2\sqrt2\,\rho\,|r| + 2\rho^2),

  attained at :math:`\delta = \sqrt2\rho\, r / |r|`. It is a *geodesic* value only while the
  geodesic stays on the quotient, :math:`1 + \delta_i / \beta_{0,i} > 0`
  (:func:`mix_closed_form_valid`); the quotient excludes :math:`\beta_i = 0`, so its
  metric ball is the Euclidean ball intersected with the closed orthant of
  :math:`\beta_0` (:func:`mix_worst_case_clamped`).
* **inv**, exact geodesic :math:`\beta(t) = \beta_0 e^{2Bt}`, :math:`|B| \le \rho/\sqrt2`:
  :math:`\beta' \in \beta_0 e^{\pm\sqrt{2q}}` (:func:`inv_worst_case`), i.e.

  .. math::

      S_{\text{inv}}(\rho) = c \max_{|B| \le \rho/\sqrt2}
          \sum_i (\beta_{0,i} e^{2B_i} - \beta^*_i)^2 - (\beta_{0,i} - \beta^*_i)^2
          \approx c\, 2\sqrt2\,\rho\,|\beta_0 \odot r| \quad (\text{first order}).

* **adaptive**, straight line on :math:`w = (u, v)` with
  :math:`\sum_i \delta_{u,i}^2/u_i^2 + \delta_{v,i}^2/v_i^2 \le \rho^2`: with
  :math:`a = \delta_u / u`, :math:`b = \delta_v / v`,
  :math:`\beta' = \beta_0 (1 + a)(1 + b)`, which depends on :math:`\beta_0` only, so
  adaptive sharpness (with :math:`\varepsilon = 0`) is *also* invariant under
  :math:`(\alpha u, v / \alpha)`. For :math:`a^2 + b^2 \le q` the multiplier
  :math:`(1+a)(1+b)` ranges over :math:`[m_-(q), (1 + \sqrt{q/2})^2]` with
  :math:`m_-(q) = (1 - \sqrt{q/2})^2` for :math:`q \le 1/2` and :math:`(1 - q)/2` beyond
  (:func:`adaptive_worst_case`). To first order :math:`\beta' \approx \beta_0(1 + a + b)`
  with :math:`|a + b| \le \sqrt2\rho`: the same ball as inv, so both share the first-order
  value :math:`c\,2\sqrt2\rho|\beta_0 \odot r|` (:func:`first_order_worst_case`) and differ
  at second order (:math:`(1 + B)^2` versus :math:`e^{2B}` per coordinate).

The separable problem is solved densely (:func:`separable_worst_case`): every
:math:`G_i` on a fine grid of :math:`t = \sqrt q \in [0, \rho]`, a Lagrange multiplier
:math:`\lambda` for the budget found by bisection, coordinate-wise
:math:`\arg\max_t G_i(t^2) - \lambda t^2`. The result carries a feasible value (attained
by an explicit :math:`\beta'`) and the Lagrangian dual bound
:math:`\min_\lambda \sum_i \max_t [G_i(t^2) - \lambda t^2] + \lambda \rho^2`, which brackets
the grid optimum; the gap is reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Tuple

import numpy as np
import torch

from ..._checks import check_positive_float

__all__ = [
    "WorstCase",
    "adaptive_interval",
    "adaptive_worst_case",
    "first_order_worst_case",
    "inv_interval",
    "inv_worst_case",
    "loss_increase",
    "mix_ball_worst_case",
    "mix_clamped_interval",
    "mix_closed_form_valid",
    "mix_interval",
    "mix_retraction_one_coordinate",
    "mix_retraction_product",
    "mix_worst_case",
    "mix_worst_case_clamped",
    "mix_worst_case_dense",
    "separable_worst_case",
]

ArrayLike = np.ndarray | torch.Tensor | list | tuple
Interval = Callable[[np.ndarray, np.ndarray], Tuple[np.ndarray, np.ndarray]]

SQRT2 = math.sqrt(2.0)


@dataclass(frozen=True)
class WorstCase:
    """Outcome of a dense worst-case computation.

    Attributes
    ----------
    value : float
        Loss increase :math:`c\\,(|\\beta' - \\beta^*|^2 - |r|^2)` at the feasible
        ``beta`` (a lower bound on the true maximum up to the grid resolution).
    upper_bound : float
        Lagrangian dual bound of the gridded problem (:math:`\\ge` ``value``).
    beta : numpy.ndarray
        The maximising perturbed coefficients :math:`\\beta'`.
    budgets : numpy.ndarray
        Per-coordinate radii :math:`t_i = \\sqrt{q_i}`, :math:`\\sum_i t_i^2 \\le \\rho^2`.
    multiplier : float
        The Lagrange multiplier :math:`\\lambda` of the budget.
    """

    value: float
    upper_bound: float
    beta: np.ndarray
    budgets: np.ndarray
    multiplier: float

    @property
    def relative_gap(self) -> float:
        """``(upper_bound - value) / |value|`` (0 when both vanish)."""
        if self.upper_bound == self.value:
            return 0.0
        return (self.upper_bound - self.value) / max(abs(self.value), 1e-300)


def _as_array(x: ArrayLike, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().to(torch.float64).numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be a vector (d,), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"`{name}` has non-finite entries")
    return arr


def _prepare(
    beta0: ArrayLike, beta_star: ArrayLike, rho: float
) -> Tuple[np.ndarray, np.ndarray, float]:
    b0, bs = _as_array(beta0, "beta0"), _as_array(beta_star, "beta_star")
    if b0.shape != bs.shape:
        raise ValueError(f"`beta0` {b0.shape} and `beta_star` {bs.shape} differ in shape")
    return b0, bs, check_positive_float(rho, "rho")


def loss_increase(
    beta: ArrayLike, beta0: ArrayLike, beta_star: ArrayLike, *, scale: float = 1.0
) -> float:
    r""":math:`c\,(|\beta - \beta^*|^2 - |\beta_0 - \beta^*|^2)`, the loss increase when
    :math:`X^\top X = I`."""
    b, b0, bs = (_as_array(a, n) for a, n in ((beta, "beta"), (beta0, "beta0"), (beta_star, "bs")))
    return float(scale * (np.sum((b - bs) ** 2) - np.sum((b0 - bs) ** 2)))


# ----------------------------------------------------------------------------- intervals
def mix_interval(beta0: np.ndarray, t: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    r"""mix, geodesic continued through zero: :math:`\beta_0 \pm \sqrt2 t`."""
    return beta0 - SQRT2 * t, beta0 + SQRT2 * t


def mix_clamped_interval(beta0: np.ndarray, t: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    r"""mix metric ball of the quotient: :math:`\beta_0 \pm \sqrt2 t` within the closed
    orthant of :math:`\beta_0` (the geodesic stops at :math:`\beta_i = 0`)."""
    lo, hi = mix_interval(beta0, t)
    positive = beta0 > 0
    return np.where(positive, np.maximum(lo, 0.0), lo), np.where(positive, hi, np.minimum(hi, 0.0))


def inv_interval(beta0: np.ndarray, t: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    r"""inv, exact geodesic: :math:`\beta_0 e^{\pm\sqrt2 t}` (sorted)."""
    a, b = beta0 * np.exp(-SQRT2 * t), beta0 * np.exp(SQRT2 * t)
    return np.minimum(a, b), np.maximum(a, b)


def adaptive_interval(beta0: np.ndarray, t: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    r"""adaptive, straight line on :math:`(u, v)`: :math:`\beta_0 [m_-(t^2), m_+(t^2)]`."""
    q = t**2
    c = t / SQRT2
    upper = (1.0 + c) ** 2
    lower = np.where(q <= 0.5, (1.0 - c) ** 2, (1.0 - q) / 2.0)
    a, b = beta0 * lower, beta0 * upper
    return np.minimum(a, b), np.maximum(a, b)


# ----------------------------------------------------------------------------- solver
def separable_worst_case(
    beta0: ArrayLike,
    beta_star: ArrayLike,
    rho: float,
    interval: Interval,
    *,
    scale: float = 1.0,
    grid: int = 4000,
    bisections: int = 100,
) -> WorstCase:
    r"""Dense worst case of a separable ball (module docstring), by Lagrangian bisection.

    Parameters
    ----------
    beta0, beta_star : array-like, shape (d,)
        The base point :math:`\beta_0 = u \odot v` and the least-squares solution.
    rho : float
        Ball radius.
    interval : callable
        ``interval(beta0[:, None], t[None, :]) -> (lo, hi)``: reachable :math:`\beta'_i`
        with per-coordinate radius :math:`t` (budget :math:`q = t^2`).
    scale : float
        The loss is :math:`c\,|X\beta - y|^2` with :math:`c =` ``scale``.
    grid : int
        Number of grid intervals on :math:`t \in [0, \rho]`.
    bisections : int
        Bisection steps on :math:`\lambda`.

    Returns
    -------
    WorstCase
    """
    b0, bs, rho = _prepare(beta0, beta_star, rho)
    if grid < 2:
        raise ValueError(f"`grid` must be >= 2, got {grid}")
    t = np.linspace(0.0, rho, grid + 1)
    lo, hi = interval(b0[:, None], t[None, :])
    r2 = (b0 - bs)[:, None] ** 2
    gain_lo, gain_hi = (lo - bs[:, None]) ** 2 - r2, (hi - bs[:, None]) ** 2 - r2
    gains = np.maximum(gain_lo, gain_hi)  # (d, grid + 1); gains[:, 0] == 0
    cost = t**2
    budget = rho**2

    def allocate(lam: float) -> Tuple[np.ndarray, float]:
        idx = np.argmax(gains - lam * cost[None, :], axis=1)
        rows = np.arange(len(b0))
        dual = float(np.sum(gains[rows, idx] - lam * cost[idx]) + lam * budget)
        return idx, dual

    # lam_hi: large enough that spending nothing is optimal everywhere
    ratios = gains[:, 1:] / cost[None, 1:]
    lam_lo, lam_hi = 0.0, max(float(ratios.max()), 0.0) * 2.0 + 1e-300
    idx, best_dual = allocate(lam_lo)
    if cost[idx].sum() <= budget:  # unconstrained optimum is feasible
        feasible_idx, lam_feasible = idx, 0.0
    else:
        feasible_idx, best_dual_hi = allocate(lam_hi)
        best_dual = min(best_dual, best_dual_hi)
        lam_feasible = lam_hi
        for _ in range(bisections):
            mid = 0.5 * (lam_lo + lam_hi)
            idx, dual = allocate(mid)
            best_dual = min(best_dual, dual)
            if cost[idx].sum() <= budget:
                lam_hi, feasible_idx, lam_feasible = mid, idx, mid
            else:
                lam_lo = mid
    rows = np.arange(len(b0))
    budgets = t[feasible_idx]
    # spend any leftover budget on the coordinate that gains most from it
    leftover = budget - float(np.sum(budgets**2))
    if leftover > 0:
        extra = np.sqrt(budgets**2 + leftover)
        extra_lo, extra_hi = interval(b0, extra)
        extra_gain = np.maximum(
            (extra_lo - bs) ** 2 - (b0 - bs) ** 2, (extra_hi - bs) ** 2 - (b0 - bs) ** 2
        )
        improvement = extra_gain - gains[rows, feasible_idx]
        j = int(np.argmax(improvement))
        if improvement[j] > 0:
            budgets = budgets.copy()
            budgets[j] = extra[j]
    end_lo, end_hi = interval(b0, budgets)
    use_hi = (end_hi - bs) ** 2 >= (end_lo - bs) ** 2
    beta = np.where(use_hi, end_hi, end_lo)
    value = float(np.sum((beta - bs) ** 2 - (b0 - bs) ** 2))
    return WorstCase(
        value=scale * value,
        upper_bound=scale * max(best_dual, value),
        beta=beta,
        budgets=budgets,
        multiplier=lam_feasible,
    )


# ----------------------------------------------------------------------------- public values
def mix_worst_case(
    beta0: ArrayLike, beta_star: ArrayLike, rho: float, *, scale: float = 1.0
) -> float:
    r"""Closed form :math:`c\,(2\sqrt2\,\rho\,|r| + 2\rho^2)` of the mix geodesic worst case.

    Exact for the exact geodesic while :func:`mix_closed_form_valid` holds (otherwise
    it is the value of the geodesic continued through :math:`\beta_i = 0`); here
    :math:`r = \beta_0 - \beta^*`.

    Parameters
    ----------
    beta0 : array-like, shape (d,)
        The network's coefficients :math:`\beta_0 = u \odot v`.
    beta_star : array-like, shape (d,)
        The least-squares solution :math:`\beta^* = X^\top y` of the training data.
    rho : float
        Radius :math:`\rho > 0` of the ball, in the metric named above.
    scale : float
        The loss is :math:`c\,|X\beta - y|^2` with :math:`c =` ``scale`` (default 1).

    Returns
    -------
    float
        The worst-case loss increase.

    Raises
    ------
    ValueError
        If ``beta0`` and ``beta_star`` differ in shape or ``rho`` is not positive.
    """
    b0, bs, rho = _prepare(beta0, beta_star, rho)
    r = float(np.linalg.norm(b0 - bs))
    return scale * (2.0 * SQRT2 * rho * r + 2.0 * rho**2)


def mix_closed_form_valid(beta0: ArrayLike, beta_star: ArrayLike, rho: float) -> bool:
    r"""Whether the maximiser :math:`\delta = \sqrt2\rho\,r/|r|` keeps every
    :math:`1 + \delta_i / \beta_{0,i} > 0`, i.e. the geodesic stays on the quotient.

    Parameters
    ----------
    beta0 : array-like, shape (d,)
        The network's coefficients :math:`\beta_0 = u \odot v`.
    beta_star : array-like, shape (d,)
        The least-squares solution :math:`\beta^*`.
    rho : float
        Radius :math:`\rho > 0` of the mix ball.

    Returns
    -------
    bool
        ``True`` when :func:`mix_worst_case` is the value of a geodesic of the quotient
        (with :math:`r = 0`: when no :math:`\beta_{0,i}` is 0).
    """
    b0, bs, rho = _prepare(beta0, beta_star, rho)
    r = b0 - bs
    norm = np.linalg.norm(r)
    if norm == 0:  # any direction is optimal, e.g. one that increases the largest |beta0_i|
        return bool(np.all(b0 != 0))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (SQRT2 * rho * r / norm) / b0
    return bool(np.all(np.where(b0 == 0, False, 1.0 + ratio > 0)))


def mix_worst_case_dense(
    beta0: ArrayLike, beta_star: ArrayLike, rho: float, *, scale: float = 1.0, grid: int = 4000
) -> WorstCase:
    """The mix worst case (no domain constraint) by the dense solver: checks the closed form."""
    return separable_worst_case(beta0, beta_star, rho, mix_interval, scale=scale, grid=grid)


def mix_worst_case_clamped(
    beta0: ArrayLike, beta_star: ArrayLike, rho: float, *, scale: float = 1.0, grid: int = 4000
) -> WorstCase:
    r"""The worst case over the mix metric ball of the quotient: the Euclidean ball of
    radius :math:`\sqrt2\rho` in :math:`\beta` within the closed orthant of :math:`\beta_0`.

    Parameters
    ----------
    beta0 : array-like, shape (d,)
        The network's coefficients :math:`\beta_0 = u \odot v`.
    beta_star : array-like, shape (d,)
        The least-squares solution :math:`\beta^* = X^\top y` of the training data.
    rho : float
        Radius :math:`\rho > 0` of the ball, in the metric named above.
    scale : float
        The loss is :math:`c\,|X\beta - y|^2` with :math:`c =` ``scale`` (default 1).
    grid : int
        Number of grid intervals of each coordinate's radius :math:`t \in [0, \rho]`
        (default 4000; at least 2).

    Returns
    -------
    WorstCase
        The value (a lower bound, up to the grid), a dual upper bound, the maximising
        :math:`\beta'` and the per-coordinate budgets.

    Raises
    ------
    ValueError
        If ``beta0`` and ``beta_star`` differ in shape, ``rho`` is not positive or
        ``grid < 2``.
    """
    return separable_worst_case(beta0, beta_star, rho, mix_clamped_interval, scale=scale, grid=grid)


def inv_worst_case(
    beta0: ArrayLike, beta_star: ArrayLike, rho: float, *, scale: float = 1.0, grid: int = 4000
) -> WorstCase:
    r"""The inv geodesic worst case
    :math:`c\max_{|B| \le \rho/\sqrt2} \sum_i (\beta_{0,i}e^{2B_i} - \beta^*_i)^2 - r_i^2`,
    with :math:`r = \beta_0 - \beta^*`.

    Parameters
    ----------
    beta0 : array-like, shape (d,)
        The network's coefficients :math:`\beta_0 = u \odot v`.
    beta_star : array-like, shape (d,)
        The least-squares solution :math:`\beta^* = X^\top y` of the training data.
    rho : float
        Radius :math:`\rho > 0` of the ball, in the metric named above.
    scale : float
        The loss is :math:`c\,|X\beta - y|^2` with :math:`c =` ``scale`` (default 1).
    grid : int
        Number of grid intervals of each coordinate's radius :math:`t \in [0, \rho]`
        (default 4000; at least 2).

    Returns
    -------
    WorstCase
        The value (a lower bound, up to the grid), a dual upper bound, the maximising
        :math:`\beta'` and the per-coordinate budgets.

    Raises
    ------
    ValueError
        If ``beta0`` and ``beta_star`` differ in shape, ``rho`` is not positive or
        ``grid < 2``.
    """
    return separable_worst_case(beta0, beta_star, rho, inv_interval, scale=scale, grid=grid)


def adaptive_worst_case(
    beta0: ArrayLike, beta_star: ArrayLike, rho: float, *, scale: float = 1.0, grid: int = 4000
) -> WorstCase:
    r"""The adaptive (:math:`\varepsilon = 0`, straight line) worst case
    :math:`c\max_{|a|^2 + |b|^2 \le \rho^2} |\beta_0(1+a)(1+b) - \beta^*|^2 - |r|^2`,
    with :math:`a = \delta_u / u`, :math:`b = \delta_v / v` and :math:`r = \beta_0 - \beta^*`.

    Parameters
    ----------
    beta0 : array-like, shape (d,)
        The network's coefficients :math:`\beta_0 = u \odot v`.
    beta_star : array-like, shape (d,)
        The least-squares solution :math:`\beta^* = X^\top y` of the training data.
    rho : float
        Radius :math:`\rho > 0` of the ball, in the metric named above.
    scale : float
        The loss is :math:`c\,|X\beta - y|^2` with :math:`c =` ``scale`` (default 1).
    grid : int
        Number of grid intervals of each coordinate's radius :math:`t \in [0, \rho]`
        (default 4000; at least 2).

    Returns
    -------
    WorstCase
        The value (a lower bound, up to the grid), a dual upper bound, the maximising
        :math:`\beta'` and the per-coordinate budgets.

    Raises
    ------
    ValueError
        If ``beta0`` and ``beta_star`` differ in shape, ``rho`` is not positive or
        ``grid < 2``.
    """
    return separable_worst_case(beta0, beta_star, rho, adaptive_interval, scale=scale, grid=grid)


def first_order_worst_case(
    beta0: ArrayLike, beta_star: ArrayLike, rho: float, *, scale: float = 1.0
) -> float:
    r"""First-order value :math:`c\,2\sqrt2\,\rho\,|\beta_0 \odot r|` shared by inv and adaptive.

    The leading term in :math:`\rho` of :func:`inv_worst_case` and
    :func:`adaptive_worst_case`, with :math:`r = \beta_0 - \beta^*`.

    Parameters
    ----------
    beta0 : array-like, shape (d,)
        The network's coefficients :math:`\beta_0 = u \odot v`.
    beta_star : array-like, shape (d,)
        The least-squares solution :math:`\beta^* = X^\top y` of the training data.
    rho : float
        Radius :math:`\rho > 0` of the ball, in the metric named above.
    scale : float
        The loss is :math:`c\,|X\beta - y|^2` with :math:`c =` ``scale`` (default 1).

    Returns
    -------
    float
        The worst-case loss increase.

    Raises
    ------
    ValueError
        If ``beta0`` and ``beta_star`` differ in shape or ``rho`` is not positive.
    """
    b0, bs, rho = _prepare(beta0, beta_star, rho)
    return scale * 2.0 * SQRT2 * rho * float(np.linalg.norm(b0 * (b0 - bs)))


# ----------------------------------------------------------------------------- any data
def _quadratic(
    beta0: ArrayLike, x: ArrayLike, y: ArrayLike, scale: float
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(beta0, g, Q)`` of the loss increase :math:`g^\\top\\delta + \\delta^\\top Q\\delta`."""
    b0, targets = _as_array(beta0, "beta0"), _as_array(y, "y")
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().to(torch.float64).numpy()
    design = np.asarray(x, dtype=np.float64)
    if design.shape != (targets.shape[0], b0.shape[0]):
        raise ValueError(
            f"`x` must have shape (n, d) = ({targets.shape[0]}, {b0.shape[0]}), got {design.shape}"
        )
    residual = design @ b0 - targets
    return b0, 2.0 * scale * design.T @ residual, scale * design.T @ design


def mix_ball_worst_case(
    beta0: ArrayLike, x: ArrayLike, y: ArrayLike, rho: float, *, scale: float = 1.0
) -> WorstCase:
    r"""Exact worst case of :math:`c\,|X\beta - y|^2` over the mix geodesic ball continued
    through :math:`\beta_i = 0`, for any data :math:`X`: the Euclidean ball
    :math:`|\beta' - \beta_0| \le \sqrt2\rho`.

    A horizontal :math:`\eta = (Bu, Bv)` has :math:`|\eta|^2_{\text{mix}} =
    2\sum_i B_i^2\beta_{0,i}^2` and its geodesic ends at :math:`\beta_0 + \delta`,
    :math:`\delta = 2B\odot\beta_0`, so :math:`|\delta| = \sqrt2|\eta|`: the map
    :math:`\eta \mapsto \delta` is a linear isometry up to the factor :math:`\sqrt2`,
    and the ball is *exactly* Euclidean in :math:`\beta` (the quotient's own ball is its
    intersection with the closed orthant of :math:`\beta_0`,
    :func:`mix_worst_case_clamped`). With :math:`g = 2cX^\top(X\beta_0 - y)` and
    :math:`Q = cX^\top X`, the increase :math:`g^\top\delta + \delta^\top Q\delta` is a
    convex quadratic; its maximum over :math:`|\delta| \le R = \sqrt2\rho` is on the
    sphere, at :math:`\delta = \tfrac12(\mu I - Q)^{-1}g` with the multiplier
    :math:`\mu \ge \lambda_{\max}(Q)` solving :math:`|\delta(\mu)| = R` (bisection;
    :math:`\mu = \lambda_{\max}` plus a top-eigenvector component in the "hard case").
    Hence

    .. math::

        2\rho^2\lambda_{\max}(Q) \;\le\; S(\rho) \;\le\; 2\rho^2\lambda_{\max}(Q)
            + \sqrt2\rho\,|g|,

    the same for every model up to :math:`\sqrt2\rho|g|`, which vanishes at an
    interpolant. With :math:`X^\top X = I` it is :func:`mix_worst_case`.

    Parameters
    ----------
    beta0 : array-like, shape (d,)
        The network's coefficients :math:`\beta_0 = u \odot v`.
    x : array-like, shape (n, d)
        The inputs :math:`X` of the loss.
    y : array-like, shape (n,)
        The targets.
    rho : float
        Radius :math:`\rho > 0` of the mix ball.
    scale : float
        The loss is :math:`c\,|X\beta - y|^2` with :math:`c =` ``scale`` (default 1).

    Returns
    -------
    WorstCase
        ``value`` (exact up to the bisection, float64), ``upper_bound`` the bound
        :math:`2\rho^2\lambda_{\max} + \sqrt2\rho|g|`, ``beta`` the maximiser
        :math:`\beta_0 + \delta`, ``budgets`` the per-coordinate radii
        :math:`|\delta_i| / \sqrt2` and ``multiplier`` :math:`\mu`.

    Raises
    ------
    ValueError
        If the shapes disagree, an entry is not finite or ``rho`` is not positive.
    """
    b0, g, q = _quadratic(beta0, x, y, check_positive_float(scale, "scale"))
    radius = SQRT2 * check_positive_float(rho, "rho")
    eigenvalues, vectors = np.linalg.eigh(q)
    top = float(eigenvalues[-1])
    g_eig = vectors.T @ g
    g_norm = float(np.linalg.norm(g))

    def step(mu: float) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(mu > eigenvalues, g_eig / (2.0 * (mu - eigenvalues)), 0.0)

    low, high = top, top + g_norm / (2.0 * radius)
    for _ in range(200):  # |delta(mu)| decreases in mu on (top, inf); |delta(high)| <= R
        mid = 0.5 * (low + high)
        if np.linalg.norm(step(mid)) > radius:
            low = mid
        else:
            high = mid
    mu, coef = high, step(high)
    # hard case (g has no component on the top eigenvector): fill the sphere along it
    candidates = [coef]
    shortfall = radius**2 - float(coef @ coef)
    if shortfall > 1e-12 * radius**2:
        root = math.sqrt(coef[-1] ** 2 + shortfall)
        for extra in (-coef[-1] + root, -coef[-1] - root):
            filled = coef.copy()
            filled[-1] += extra
            candidates.append(filled)
    deltas = [vectors @ c for c in candidates]
    delta = max(deltas, key=lambda d: float(g @ d + d @ q @ d))
    value = float(g @ delta + delta @ q @ delta)
    return WorstCase(
        value=value,
        upper_bound=radius**2 * top + radius * g_norm,
        beta=b0 + delta,
        budgets=np.abs(delta) / SQRT2,
        multiplier=float(mu),
    )


def mix_retraction_product(beta0: ArrayLike, rates: ArrayLike) -> np.ndarray:
    r"""The product :math:`\beta_0(1 + B - B^2/2)^2` at the end of the second-order
    retraction of the mix metric along a horizontal :math:`\eta = (Bu, Bv)`.

    For horizontal :math:`\eta` the mix Christoffel term is
    :math:`\Gamma(\eta, \eta) = B^2(u, v)`, so the retraction
    :math:`X + \eta - \tfrac12\Gamma(\eta,\eta)` is :math:`(u, v)(1 + B - B^2/2)`; the exact
    geodesic ends at :math:`\beta_0(1 + 2B)`. The two agree to
    :math:`O(B^3)`: :math:`(1 + B - B^2/2)^2 = 1 + 2B - B^3 + B^4/4`. Spending the whole
    budget :math:`\rho` on one coordinate allows :math:`|B_i| = \rho/(\sqrt2|\beta_{0,i}|)`,
    where the retraction reaches :math:`\beta'_i \approx \rho^4/(16\beta_{0,i}^3)` against
    the geodesic's :math:`\beta_{0,i} \pm \sqrt2\rho`: on coordinates with
    :math:`|\beta_{0,i}| \ll \rho` the retraction leaves every bounded set.

    Parameters
    ----------
    beta0 : array-like, shape (d,)
        The network's coefficients :math:`\beta_0 = u \odot v`.
    rates : array-like, shape (d,)
        The horizontal rates :math:`B = \eta_u / u = \eta_v / v`.

    Returns
    -------
    numpy.ndarray
        :math:`\beta_0(1 + B - B^2/2)^2`, shape (d,).

    Raises
    ------
    ValueError
        If the shapes disagree or an entry is not finite.
    """
    b0, b = _as_array(beta0, "beta0"), _as_array(rates, "rates")
    if b0.shape != b.shape:
        raise ValueError(f"`beta0` {b0.shape} and `rates` {b.shape} differ in shape")
    return b0 * (1.0 + b - 0.5 * b**2) ** 2


def mix_retraction_one_coordinate(
    beta0: ArrayLike, x: ArrayLike, y: ArrayLike, rho: float, *, scale: float = 1.0
) -> WorstCase:
    r"""The best loss increase along the mix second-order retraction that spends the whole
    budget on one coordinate: a feasible lower bound of that worst case, and its value
    where one coordinate with :math:`|\beta_{0,i}| \ll \rho` dominates.

    For each :math:`i` and sign, :math:`B_i = \pm\rho/(\sqrt2|\beta_{0,i}|)` (so
    :math:`|\eta|_{\text{mix}} = \rho`), :math:`\delta_i = \beta_{0,i}((1 + B_i -
    B_i^2/2)^2 - 1)` (:func:`mix_retraction_product`) and the increase is
    :math:`g_i\delta_i + Q_{ii}\delta_i^2`, with :math:`g` and :math:`Q` as in
    :func:`mix_ball_worst_case`. For :math:`|\beta_{0,i}| \ll \rho` this is about
    :math:`Q_{ii}\rho^8/(256\,\beta_{0,i}^6)`: a function of the smallest coefficients,
    not of the curvature of the loss.

    Parameters
    ----------
    beta0 : array-like, shape (d,)
        The network's coefficients :math:`\beta_0 = u \odot v`, no entry 0.
    x : array-like, shape (n, d)
        The inputs :math:`X` of the loss.
    y : array-like, shape (n,)
        The targets.
    rho : float
        Radius :math:`\rho > 0` of the mix ball.
    scale : float
        The loss is :math:`c\,|X\beta - y|^2` with :math:`c =` ``scale`` (default 1).

    Returns
    -------
    WorstCase
        ``value`` = ``upper_bound`` the best single-coordinate increase, ``beta`` its
        point, ``budgets`` :math:`\rho` on that coordinate and 0 elsewhere,
        ``multiplier`` 0.

    Raises
    ------
    ValueError
        If the shapes disagree, an entry is not finite or zero, or ``rho`` is not positive.
    """
    b0, g, q = _quadratic(beta0, x, y, check_positive_float(scale, "scale"))
    rho = check_positive_float(rho, "rho")
    if np.any(b0 == 0):
        raise ValueError("`beta0` has zero entries: the quotient excludes beta_i = 0")
    rate = rho / (SQRT2 * np.abs(b0))
    diag = np.diag(q)
    best, best_i, best_delta = -np.inf, 0, 0.0
    for sign in (1.0, -1.0):
        delta = mix_retraction_product(b0, sign * rate) - b0
        gains = g * delta + diag * delta**2
        i = int(np.argmax(gains))
        if gains[i] > best:
            best, best_i, best_delta = float(gains[i]), i, float(delta[i])
    beta = b0.copy()
    beta[best_i] += best_delta
    budgets = np.zeros_like(b0)
    budgets[best_i] = rho
    return WorstCase(value=best, upper_bound=best, beta=beta, budgets=budgets, multiplier=0.0)
