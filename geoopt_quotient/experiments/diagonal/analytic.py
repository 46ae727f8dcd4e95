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
    "mix_clamped_interval",
    "mix_closed_form_valid",
    "mix_interval",
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
