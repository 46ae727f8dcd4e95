"""Auto-PGD as written in :func:`maximize_in_ball` against a plain float64 Auto-PGD.

The reference below is Croce & Hein's Auto-PGD (Algorithm 1 of "Hide & Seek") written
out in the obvious way, vector by vector, on the Euclidean ball: the adaptive metric at
the point :math:`w = 1` is the Euclidean one and the straight path :math:`w + \\xi`, so
the Riemannian gradient is the Euclidean one. The library's loop (Gram-matrix weights,
recycled buffers, derived Gram entries) must give the same iterates.
"""

from __future__ import annotations

import math

import pytest
import torch

from geoopt_quotient import AdaptiveEuclidean, maximize_in_ball
from geoopt_quotient.sharpness.apgd import apgd_checkpoints

#: 2**22 float64 epsilons (9e-10): rounding, not a different algorithm; the library's ball
#: is smaller than the reference's by its margin for rounding (``NormError``, a few 1e-15
#: of rho here), which the objective's steepness grows along the run
TOLERANCE = 2**22 * torch.finfo(torch.float64).eps


def checkpoints(iters: int) -> list:
    """:math:`\\lceil p_j N \\rceil` for :math:`p_0 = 0, p_1 = 0.22,
    p_{j+1} = p_j + \\max(p_j - p_{j-1} - 0.03, 0.06)`, those in :math:`(0, N]`."""
    p = [0.0, 0.22]
    while p[-1] < 1:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    return sorted({math.ceil(q * iters - 1e-9) for q in p if q <= 1} - {0})


def reference_apgd(f, n: int, rho: float, iters: int, momentum: float = 0.75):
    """Plain Auto-PGD from :math:`\\xi = 0` on the Euclidean ball of radius ``rho``:
    ``(best value, best xi, history, step sizes, restarts)``."""

    def value_and_grad(xi):
        xi = xi.detach().requires_grad_()
        value = f(xi)
        (grad,) = torch.autograd.grad(value, xi)
        return float(value.detach()), grad

    def project(v):
        return v * min(1.0, rho / max(float(v.norm()), 1e-300))

    xi = torch.zeros(n, dtype=torch.float64)
    value, grad = value_and_grad(xi)
    best_value, best_xi, best_grad = value, xi, grad
    xi_prev, step = xi, 2 * rho
    history, steps, restarts = [value], [], 0
    marks, last_mark, increases = checkpoints(iters), 0, 0
    best_at_last_mark, halved_at_last_mark = value, True
    for k in range(iters):
        alpha = 1.0 if k == 0 else momentum
        norm = float(grad.norm())
        z = project(xi + (step / norm if norm > 0 else 0.0) * grad)
        xi_next = project(xi + alpha * (z - xi) + (1 - alpha) * (xi - xi_prev))
        xi_prev, xi = xi, xi_next
        new_value, grad = value_and_grad(xi)
        steps.append(step)
        history.append(new_value)
        increases += new_value > value
        value = new_value
        if new_value > best_value:
            best_value, best_xi, best_grad = new_value, xi, grad
        if k + 1 in marks and k + 1 < iters:
            too_few_increases = increases < 0.75 * (k + 1 - last_mark)
            stalled = not halved_at_last_mark and best_value <= best_at_last_mark
            halved_at_last_mark = too_few_increases or stalled
            if halved_at_last_mark:
                step /= 2
                if best_xi is not xi:  # back to the best iterate (xi_prev stays)
                    xi, value, grad, restarts = best_xi, best_value, best_grad, restarts + 1
            last_mark, increases, best_at_last_mark = k + 1, 0, best_value
    return best_value, best_xi, history, steps, restarts


def wiggly(n: int, seed: int):
    """A smooth objective with many local maxima in the ball, so that Auto-PGD both
    climbs and overshoots (halving its step and restarting)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(3 * n, n, generator=g, dtype=torch.float64) * 3
    b = torch.randn(3 * n, generator=g, dtype=torch.float64)
    q = torch.randn(n, n, generator=g, dtype=torch.float64)
    return lambda xi: torch.sin(a @ xi + b).sum() - 0.5 * xi @ (q @ q.T) @ xi


def test_the_reference_checkpoints_are_the_librarys():
    for iters in (1, 5, 20, 37, 100):
        assert checkpoints(iters) == apgd_checkpoints(iters)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("keep_best_gradient", [True, False])
def test_maximize_in_ball_makes_the_reference_iterates(seed, keep_best_gradient):
    n, rho, iters = 6, 0.8, 30
    f = wiggly(n, seed)
    point = torch.ones(n, dtype=torch.float64)  # the adaptive metric at 1: Euclidean
    best, best_xi, history, steps, restarts = reference_apgd(f, n, rho, iters)
    result = maximize_in_ball(
        [(point, AdaptiveEuclidean(ndim=1))],
        lambda points: f(points[0] - point),
        rho=rho,
        iters=iters,
        path="straight",
        keep_best_gradient=keep_best_gradient,
    )
    assert result.step_sizes == steps  # the same halvings, at the same checkpoints
    # the same iterates up to rounding: float64 eps, grown by the objective's steepness
    # (|a| ~ 3) over the iterations; a wrong step, momentum or projection is O(rho)
    tol = dict(rel=TOLERANCE, abs=TOLERANCE)
    assert result.history == pytest.approx(history, **tol)
    assert result.value == pytest.approx(best, **tol)
    assert torch.allclose(result.xi[0], best_xi, rtol=TOLERANCE, atol=TOLERANCE)
    assert len(result.history) == iters + 1
    # a restart from the best iterate costs a pass unless its gradient was kept
    assert result.evaluations == iters + 1 + (0 if keep_best_gradient else restarts)


def test_the_reference_problems_halve_and_restart():
    """The comparison above covers the step rule: its problems halve the step and go back
    to the best iterate, and some climb at every step between checkpoints."""
    runs = [reference_apgd(wiggly(6, seed), 6, 0.8, 30) for seed in range(4)]
    assert all(len(set(steps)) > 1 for _, _, _, steps, _ in runs)
    assert sum(restarts for *_, restarts in runs) > 0
