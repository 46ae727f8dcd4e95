"""Closed-form worst-case sharpness of diagonal networks against Auto-PGD and brute force.

Instances have orthonormal columns (``X^T X = I``), where the loss is
``|beta - beta*|^2 + const`` and the worst cases of
:mod:`geoopt_quotient.experiments.diagonal.analytic` are exact. Also: invariance of the
sharpness measures under ``(alpha u, v / alpha)``, and the data and training of the
experiment.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geoopt_quotient import AdaptiveEuclidean, BallGroup, DiagonalQuotient, maximize_in_ball
from geoopt_quotient.experiments.diagonal import analytic
from geoopt_quotient.experiments.diagonal.data import (
    l1_statistical_dimension,
    make_sparse_regression,
    recovery_threshold,
)
from geoopt_quotient.experiments.diagonal.experiment import mix_geodesic_path
from geoopt_quotient.experiments.diagonal.train import (
    initial_points,
    sample_hyperparameters,
    step_sizes_for,
    train_population,
)

pytestmark = pytest.mark.on_device

DT = torch.float64


class Whitened:
    """A regression with ``X^T X = I`` and a base point ``(u, v)``."""

    def __init__(self, d: int, seed: int, *, n: int | None = None, min_beta: float = 0.5):
        g = torch.Generator().manual_seed(seed)
        n = n or 3 * d
        x, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=DT))
        self.x = x
        self.y = torch.randn(n, generator=g, dtype=DT)
        self.beta_star = x.T @ self.y
        # |beta0_i| in [min_beta, 2], random signs, split unevenly between u and v
        signs = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0).to(DT)
        magnitude = min_beta + (2 - min_beta) * torch.rand(d, generator=g, dtype=DT)
        beta0 = signs * magnitude
        u = torch.exp(torch.randn(d, generator=g, dtype=DT))
        self.point = torch.stack((u, beta0 / u))
        self.beta0 = beta0

    def loss(self, beta: torch.Tensor) -> torch.Tensor:
        return (self.x @ beta - self.y).pow(2).sum()

    def objective(self, points):
        return self.loss(points[0][0] * points[0][1])

    def sharpness(self, manifold, rho: float, iters: int, path) -> float:
        """Auto-PGD worst case; ``path`` is a name ("exact", ...) or a function."""
        if isinstance(path, str):
            groups, kwargs = [(self.point, manifold)], {"path": path}
        else:
            groups, kwargs = [BallGroup(self.point, manifold, path)], {}
        result = maximize_in_ball(groups, self.objective, rho=rho, iters=iters, **kwargs)
        return result.value - result.initial_value


# --------------------------------------------------------------------------- Auto-PGD agrees
@pytest.mark.parametrize("iters", [20, 100])
def test_mix_exact_geodesic_matches_closed_form(iters):
    case = Whitened(d=12, seed=0)
    rho = 0.05  # sqrt(2) rho < min |beta0|: the whole ball stays on the quotient
    assert analytic.mix_closed_form_valid(case.beta0, case.beta_star, rho)
    expected = analytic.mix_worst_case(case.beta0, case.beta_star, rho)
    r = float((case.beta0 - case.beta_star).norm())
    assert expected == pytest.approx(2 * math.sqrt(2) * rho * r + 2 * rho**2)
    value = case.sharpness(DiagonalQuotient("mix"), rho, iters, "exact")
    assert value == pytest.approx(expected, rel=0.01)
    assert value <= expected * (1 + 1e-9)


@pytest.mark.parametrize("iters", [20, 100])
@pytest.mark.parametrize("rho", [0.05, 0.4])
def test_inv_exact_geodesic_matches_dense_optimum(iters, rho):
    case = Whitened(d=12, seed=1)
    oracle = analytic.inv_worst_case(case.beta0, case.beta_star, rho)
    assert oracle.relative_gap < 1e-3
    value = case.sharpness(DiagonalQuotient("inv"), rho, iters, "exact")
    assert value == pytest.approx(oracle.value, rel=0.01)
    assert value <= oracle.upper_bound * (1 + 1e-4)


@pytest.mark.parametrize("rho", [0.05, 0.4])
def test_adaptive_matches_dense_optimum(rho):
    case = Whitened(d=12, seed=2)
    oracle = analytic.adaptive_worst_case(case.beta0, case.beta_star, rho)
    value = case.sharpness(AdaptiveEuclidean(), rho, 100, "straight")
    assert value == pytest.approx(oracle.value, rel=0.01)
    assert value <= oracle.upper_bound * (1 + 1e-4)


def test_clamped_mix_matches_dense_optimum():
    # beta0 entries down to 1e-3: the mix geodesic would leave the quotient, the path stops it
    case = Whitened(d=12, seed=3, min_beta=1e-3)
    rho = 0.3
    assert not analytic.mix_closed_form_valid(case.beta0, case.beta_star, rho)
    oracle = analytic.mix_worst_case_clamped(case.beta0, case.beta_star, rho)
    value = case.sharpness(DiagonalQuotient("mix"), rho, 100, mix_geodesic_path(clamp=True))
    assert value == pytest.approx(oracle.value, rel=0.01)
    assert value <= oracle.upper_bound * (1 + 1e-4)
    # unclamped, the same path reaches the closed form of the continued geodesic
    unclamped = case.sharpness(DiagonalQuotient("mix"), rho, 100, mix_geodesic_path(clamp=False))
    closed = analytic.mix_worst_case(case.beta0, case.beta_star, rho)
    assert unclamped == pytest.approx(closed, rel=0.01)
    assert oracle.value < closed


# --------------------------------------------------------------------------- vs brute force
def _unit_circle(k: int) -> np.ndarray:
    angles = np.linspace(0, 2 * np.pi, k, endpoint=False)
    return np.stack((np.cos(angles), np.sin(angles)), axis=1)


def _brute_force_geodesic(case: Whitened, metric: str, rho: float, clamp: bool = False) -> float:
    """Max of the loss increase over the boundary of the ball, d = 2, through expmap."""
    manifold = DiagonalQuotient(metric)
    w = torch.as_tensor(_unit_circle(20000), dtype=DT)  # (k, 2) unit directions
    if metric == "inv":  # |eta|^2 = 2 |B|^2
        rates = rho * w / math.sqrt(2)
    else:  # |eta|^2 = 2 sum B^2 beta0^2
        rates = rho * w / (math.sqrt(2) * case.beta0.abs())
    xi = rates[:, None, :] * case.point  # horizontal (B u, B v), (k, 2, d)
    x = case.point.expand_as(xi)
    points = mix_geodesic_path(clamp=True)(x, xi) if clamp else manifold.expmap(x, xi)
    beta = points[:, 0] * points[:, 1]
    losses = (beta @ case.x.T - case.y).pow(2).sum(-1)
    return float(losses.max() - case.loss(case.beta0))


def test_closed_forms_against_brute_force():
    for seed in range(3):
        case = Whitened(d=2, seed=10 + seed, min_beta=0.5)
        for rho in (0.05, 0.3):
            mix = analytic.mix_worst_case(case.beta0, case.beta_star, rho)
            if analytic.mix_closed_form_valid(case.beta0, case.beta_star, rho):
                assert _brute_force_geodesic(case, "mix", rho) == pytest.approx(mix, rel=1e-4)
            inv = analytic.inv_worst_case(case.beta0, case.beta_star, rho)
            assert _brute_force_geodesic(case, "inv", rho) == pytest.approx(inv.value, rel=1e-4)


def test_clamped_mix_against_brute_force():
    case = Whitened(d=2, seed=20, min_beta=0.01)
    for rho in (0.05, 0.5):
        oracle = analytic.mix_worst_case_clamped(case.beta0, case.beta_star, rho)
        brute = _brute_force_geodesic(case, "mix", rho, clamp=True)
        # the clamped set is larger than the boundary's image: brute force is a lower bound
        assert brute <= oracle.upper_bound * (1 + 1e-6)
        assert brute == pytest.approx(oracle.value, rel=0.02)


def test_adaptive_against_brute_force():
    """d = 2: sample the boundary of the 4-dim ball |a|^2 + |b|^2 = rho^2 densely."""
    case = Whitened(d=2, seed=30)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((400_000, 4))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    b0, bs = case.beta0.cpu().numpy(), case.beta_star.cpu().numpy()
    for rho in (0.05, 0.5):
        a, b = rho * z[:, :2], rho * z[:, 2:]
        beta = b0 * (1 + a) * (1 + b)
        gains = ((beta - bs) ** 2).sum(1) - ((b0 - bs) ** 2).sum()
        oracle = analytic.adaptive_worst_case(b0, bs, rho)
        assert gains.max() <= oracle.upper_bound * (1 + 1e-6)
        assert gains.max() == pytest.approx(oracle.value, rel=2e-3)


def test_dense_solver_reproduces_mix_closed_form_and_first_order_limit():
    rng = np.random.default_rng(1)
    for _ in range(5):
        b0, bs = rng.standard_normal(30), rng.standard_normal(30)
        for rho in (0.01, 0.2, 1.0):
            dense = analytic.mix_worst_case_dense(b0, bs, rho)
            assert dense.value == pytest.approx(analytic.mix_worst_case(b0, bs, rho), rel=1e-5)
        rho = 1e-4
        first = analytic.first_order_worst_case(b0, bs, rho)
        assert analytic.inv_worst_case(b0, bs, rho).value == pytest.approx(first, rel=1e-3)
        assert analytic.adaptive_worst_case(b0, bs, rho).value == pytest.approx(first, rel=1e-3)
        # beyond first order, the geodesic reaches further than the straight line
        rho = 0.3
        inv, adaptive = (
            analytic.inv_worst_case(b0, bs, rho),
            analytic.adaptive_worst_case(b0, bs, rho),
        )
        assert inv.value >= adaptive.value


def test_worst_case_point_is_feasible_and_attains_value():
    case = Whitened(d=8, seed=4)
    b0, bs = case.beta0.cpu().numpy(), case.beta_star.cpu().numpy()
    rho = 0.3
    inv = analytic.inv_worst_case(b0, bs, rho)
    assert np.sum(inv.budgets**2) <= rho**2 * (1 + 1e-12)
    rates = np.log(inv.beta / b0) / 2  # beta0 exp(2B)
    assert 2 * np.sum(rates**2) <= rho**2 * (1 + 1e-9)
    assert analytic.loss_increase(inv.beta, b0, bs) == pytest.approx(inv.value)
    loss_value = float(case.loss(torch.as_tensor(inv.beta)) - case.loss(case.beta0))
    assert loss_value == pytest.approx(inv.value, rel=1e-9)


def test_analytic_argument_errors():
    with pytest.raises(ValueError, match="rho"):
        analytic.mix_worst_case([1.0, 2.0], [0.0, 0.0], 0.0)
    with pytest.raises(ValueError, match="differ in shape"):
        analytic.inv_worst_case([1.0, 2.0], [0.0], 0.1)


# --------------------------------------------------------------------------- invariance
def _regression(seed: int, n: int = 10, d: int = 6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=DT)
    y = torch.randn(n, generator=g, dtype=DT)
    point = torch.randn(2, d, generator=g, dtype=DT)
    point = torch.where(point.abs() < 0.1, torch.full_like(point, 0.1), point)

    def objective(points):
        beta = points[0][0] * points[0][1]
        return (x @ beta - y).pow(2).sum() / (2 * n)

    return point, objective


def _sharpness(point, objective, manifold, path, rho=0.1) -> float:
    result = maximize_in_ball([BallGroup(point, manifold, path)], objective, rho=rho, iters=20)
    return result.value - result.initial_value


def _measures():
    inv, mix, adaptive = DiagonalQuotient("inv"), DiagonalQuotient("mix"), AdaptiveEuclidean()
    return {
        "inv exact": (inv, inv.expmap),
        "inv second order": (inv, inv.retr),
        "mix clamped geodesic": (mix, mix_geodesic_path(clamp=True)),
        "mix second order": (mix, mix.retr),
        "adaptive eps=0": (adaptive, lambda x, xi: x + xi),
    }


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1), log_alpha=st.lists(st.floats(-2.3, 2.3), min_size=6, max_size=6)
)
def test_geodesic_sharpness_invariant_under_rescaling(seed, log_alpha):
    """Geodesic sharpness depends on beta = u * v only. So does adaptive sharpness with
    eps = 0 on a diagonal net: its ball in relative perturbations (a, b) = (du/u, dv/v)
    is the same set for every representative, and beta' = beta0 (1 + a)(1 + b)."""
    point, objective = _regression(seed)
    alpha = torch.exp(torch.tensor(log_alpha, dtype=DT))
    moved = DiagonalQuotient().act(point, alpha)
    for name, (manifold, path) in _measures().items():
        before = _sharpness(point, objective, manifold, path)
        after = _sharpness(moved, objective, manifold, path)
        assert after == pytest.approx(before, rel=1e-6, abs=1e-12), name


def test_adaptive_with_offset_and_euclidean_are_not_invariant():
    from geoopt.manifolds import Euclidean

    point, objective = _regression(5)
    alpha = torch.tensor([10.0, 0.1, 5.0, 0.2, 3.0, 0.3], dtype=DT)
    moved = DiagonalQuotient().act(point, alpha)
    for manifold in (AdaptiveEuclidean(eps=0.01), Euclidean(ndim=2)):
        before = _sharpness(point, objective, manifold, lambda x, xi: x + xi)
        after = _sharpness(moved, objective, manifold, lambda x, xi: x + xi)
        assert abs(after - before) > 0.01 * abs(before), manifold


def test_mix_path_is_the_geodesic_inside_the_quotient():
    point, _ = _regression(6)
    mix = DiagonalQuotient("mix")
    xi = mix.proju(
        point, 0.05 * torch.randn(point.shape, generator=torch.Generator().manual_seed(0), dtype=DT)
    )
    ours = mix_geodesic_path(clamp=True)(point, xi)
    exact = mix.expmap(point, xi)
    assert torch.allclose(mix.product(ours), mix.product(exact), rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- data and training
def test_data_setup():
    assert recovery_threshold(200) == math.ceil(l1_statistical_dimension(20, 200)) == 66
    data = make_sparse_regression(200, seed=3)
    assert data.n_train == 66 and data.n_test == 1000
    assert int((data.beta_star != 0).sum()) == 20
    assert float(data.beta_star.norm()) == pytest.approx(1.0)
    again = make_sparse_regression(200, seed=3)
    assert torch.equal(data.x_train, again.x_train) and torch.equal(data.y_test, again.y_test)
    risk = data.population_risk(data.beta_star[None])
    assert float(risk) == pytest.approx(0.5 * 0.1**2)
    assert float(data.test_loss(data.beta_star)) == pytest.approx(0.005, rel=0.2)


def test_training_reaches_target_and_init_scale_sets_the_bias():
    data = make_sparse_regression(40, seed=0)
    scales = torch.tensor([0.01, 1.0], dtype=DT)
    assert torch.equal(initial_points(scales, 40)[:, 1], torch.zeros(2, 40, dtype=DT))
    pop = train_population(data, scales, step_sizes_for(data, scales, torch.ones(2, dtype=DT)))
    assert bool(pop.converged.all())
    assert bool((pop.train_loss <= 1e-5).all())
    assert torch.allclose(data.train_loss(pop.beta), pop.train_loss)
    l1 = pop.beta.abs().sum(-1)
    assert l1[0] < l1[1]  # the small initialisation finds the sparser interpolant
    test = data.test_loss(pop.beta)
    assert test[0] < test[1]


def test_training_budget_and_divergence_guard():
    data = make_sparse_regression(20, seed=1)
    scales = torch.tensor([0.1, 0.1], dtype=DT)
    steps = step_sizes_for(data, scales, torch.tensor([1.0, 40.0], dtype=DT))
    pop = train_population(data, scales, steps, max_steps=50)
    assert int(pop.steps.max()) <= 50 and not bool(pop.converged.any())
    assert int(pop.restarts[1]) >= 1 and int(pop.restarts[0]) == 0
    alpha, factor = sample_hyperparameters(100, seed=0)
    assert alpha.min() >= 0.01 and alpha.max() <= 1.0
    assert factor.min() >= 0.2 and factor.max() <= 1.0
