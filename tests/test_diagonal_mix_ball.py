"""The mix ball of diagonal networks in beta = u * v, and the second-order retraction there.

The exact mix geodesic ball is the Euclidean ball of radius sqrt(2) rho in beta (intersected
with the orthant of beta0 on the quotient); the second-order retraction ends at
beta0 (1 + B - B^2/2)^2, far outside that ball where |beta0_i| << rho. Checked in float64
against the manifold's own expmap and retr, and the worst case over the ball for any data
against brute force and the closed form of whitened data.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geoopt_quotient import DiagonalQuotient
from geoopt_quotient.experiments.diagonal import analytic

DT = torch.float64
EPS = torch.finfo(DT).eps


def _point(seed: int, d: int, low: float = 0.05) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    signs = torch.where(torch.rand(2, d, generator=g) < 0.5, -1.0, 1.0).to(DT)
    return signs * (low + torch.rand(2, d, generator=g, dtype=DT) * 2)


def _horizontal(manifold: DiagonalQuotient, x: torch.Tensor, seed: int, rho: float):
    g = torch.Generator().manual_seed(seed + 1)
    eta = manifold.proju(x, torch.randn(x.shape, generator=g, dtype=DT))
    return eta * (rho / manifold.norm(x, eta))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), d=st.integers(1, 8), log_rho=st.floats(-4, 0))
def test_exact_mix_geodesic_moves_beta_by_sqrt2_times_the_norm(seed, d, log_rho):
    mix = DiagonalQuotient("mix")
    x = _point(seed, d)
    # a radius small enough that no coordinate reaches beta_i = 0: the geodesic exists
    rho = 10**log_rho * float((x[0] * x[1]).abs().min()) / 2
    eta = _horizontal(mix, x, seed, rho)
    beta0 = mix.product(x)
    shift = mix.product(mix.expmap(x, eta)) - beta0
    # the difference beta' - beta0 loses about eps |beta0| to cancellation
    atol = 64 * EPS * float(beta0.abs().max())
    assert float(shift.norm()) == pytest.approx(math.sqrt(2) * rho, abs=math.sqrt(d) * atol)
    # and the shift is delta = 2 B beta0 with B the horizontal rate
    rate = eta[0] / x[0]
    torch.testing.assert_close(shift, 2 * rate * beta0, rtol=0, atol=atol)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), d=st.integers(1, 8))
def test_every_point_of_the_euclidean_ball_in_the_orthant_is_reached(seed, d):
    mix = DiagonalQuotient("mix")
    x = _point(seed, d)
    beta0 = mix.product(x)
    g = torch.Generator().manual_seed(seed + 2)
    delta = torch.randn(d, generator=g, dtype=DT)
    # keep beta0 + delta in the open orthant of beta0
    delta = torch.where(1 + delta / beta0 > 0.01, delta, -0.5 * beta0)
    eta = (delta / (2 * beta0)) * x  # horizontal: eta_u / u = eta_v / v
    assert float(mix.norm(x, eta)) == pytest.approx(float(delta.norm()) / math.sqrt(2), rel=1e-13)
    torch.testing.assert_close(mix.product(mix.expmap(x, eta)), beta0 + delta, rtol=1e-12, atol=0)


def test_inv_ball_is_not_euclidean_in_beta():
    # the same inv norm moves a large coefficient further than a small one
    inv = DiagonalQuotient("inv")
    x = torch.tensor([[1.0, 0.1], [2.0, 0.1]], dtype=DT)
    shifts = []
    for i in range(2):
        eta = torch.zeros_like(x)
        eta[:, i] = 0.1 * x[:, i] / math.sqrt(2)  # B_i = 0.1 / sqrt(2): |eta| = 0.1
        assert float(inv.norm(x, eta)) == pytest.approx(0.1, rel=1e-14)
        shifts.append(float((inv.product(inv.expmap(x, eta)) - inv.product(x)).abs().sum()))
    assert shifts[0] > 100 * shifts[1]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), d=st.integers(1, 8), log_rho=st.floats(-3, 1))
def test_second_order_retraction_product(seed, d, log_rho):
    mix = DiagonalQuotient("mix")
    x = _point(seed, d, low=1e-3)
    eta = _horizontal(mix, x, seed, 10**log_rho)
    rate = (eta[0] / x[0]).numpy()
    expected = analytic.mix_retraction_product(mix.product(x).numpy(), rate)
    np.testing.assert_allclose(mix.product(mix.retr(x, eta)).numpy(), expected, rtol=1e-12)


def test_retraction_on_a_small_coordinate_grows_like_rho4_over_beta3():
    rho = 0.1
    for beta in (1e-3, 1e-4, 1e-5):
        rate = rho / (math.sqrt(2) * beta)  # the whole budget on this coordinate
        end = analytic.mix_retraction_product(np.array([beta]), np.array([rate]))[0]
        assert end == pytest.approx(rho**4 / (16 * beta**3), rel=4 * math.sqrt(2) * beta / rho)
        exact = beta * (1 + 2 * rate)  # the geodesic's end: beta + sqrt(2) rho
        assert exact == pytest.approx(beta + math.sqrt(2) * rho, rel=1e-14)
        assert end > 1e3 * exact
    # and for |B| << 1 the two agree to O(B^3)
    small = analytic.mix_retraction_product(np.array([1.0]), np.array([1e-3]))[0]
    assert abs(small - (1 + 2e-3)) == pytest.approx(1e-9, rel=1e-3)


def _data(seed: int, n: int, d: int):
    g = np.random.default_rng(seed)
    return g.normal(size=(n, d)), g.normal(size=n), g.normal(size=d)


@pytest.mark.parametrize("seed", range(4))
def test_mix_ball_worst_case_against_brute_force(seed):
    x, y, beta0 = _data(seed, 5, 3)
    rho, scale = 0.3, 0.1
    result = analytic.mix_ball_worst_case(beta0, x, y, rho, scale=scale)
    assert np.linalg.norm(result.beta - beta0) == pytest.approx(math.sqrt(2) * rho, rel=1e-12)

    def increase(beta):
        return scale * (np.sum((beta @ x.T - y) ** 2, -1) - np.sum((x @ beta0 - y) ** 2))

    assert result.value == pytest.approx(increase(result.beta), rel=1e-12)
    directions = np.random.default_rng(seed + 10).normal(size=(200000, 3))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    sampled = increase(beta0 + math.sqrt(2) * rho * directions).max()
    assert sampled <= result.value * (1 + 1e-12)
    assert sampled >= result.value * (1 - 1e-3)  # dense sampling comes close
    top = np.linalg.eigvalsh(scale * x.T @ x)[-1]
    assert 2 * rho**2 * top <= result.value <= result.upper_bound


def test_mix_ball_worst_case_is_the_whitened_closed_form_and_the_hard_case():
    g = np.random.default_rng(0)
    x, _ = np.linalg.qr(g.normal(size=(12, 4)))
    y, beta0 = g.normal(size=12), g.normal(size=4)
    rho = 0.2
    value = analytic.mix_ball_worst_case(beta0, x, y, rho).value
    assert value == pytest.approx(analytic.mix_worst_case(beta0, x.T @ y, rho), rel=1e-10)
    # at the least-squares solution g = 0: every model gets 2 rho^2 lambda_max
    fitted = np.linalg.lstsq(x, y, rcond=None)[0]
    hard = analytic.mix_ball_worst_case(fitted, x, y, rho)
    assert hard.value == pytest.approx(2 * rho**2, rel=1e-10)
    assert np.linalg.norm(hard.beta - fitted) == pytest.approx(math.sqrt(2) * rho, rel=1e-10)


def test_one_coordinate_retraction_value_is_attained_and_dominated_by_the_smallest_beta():
    x, y, beta0 = _data(3, 6, 4)
    beta0[2] = 1e-4
    rho = 0.1
    result = analytic.mix_retraction_one_coordinate(beta0, x, y, rho, scale=0.5)
    assert result.budgets.tolist() == [0.0, 0.0, rho, 0.0]
    # the same point through the manifold's retraction, at |eta| = rho
    mix = DiagonalQuotient("mix")
    point = torch.stack((torch.ones(4, dtype=DT), torch.as_tensor(beta0)))
    ends, losses = [], []
    for sign in (1.0, -1.0):
        rate = torch.zeros(4, dtype=DT)
        rate[2] = sign * rho / (math.sqrt(2) * 1e-4)
        eta = rate * point
        assert float(mix.norm(point, eta)) == pytest.approx(rho, rel=1e-14)
        end = mix.product(mix.retr(point, eta)).numpy()
        ends.append(end)
        losses.append(0.5 * (np.sum((x @ end - y) ** 2) - np.sum((x @ beta0 - y) ** 2)))
    best = int(np.argmax(losses))
    np.testing.assert_allclose(ends[best], result.beta, rtol=1e-12)
    assert result.value == pytest.approx(losses[best], rel=1e-10)
    q22 = 0.5 * float(x[:, 2] @ x[:, 2])
    # delta^2 = (rho^4 / (16 beta^3))^2 (1 - 2/B + ...)^4: relative error about 8/B
    rate = rho / (math.sqrt(2) * 1e-4)
    assert result.value == pytest.approx(q22 * rho**8 / (256 * 1e-4**6), rel=16 / rate)


def test_new_closed_forms_reject_bad_input():
    x, y, beta0 = _data(0, 5, 3)
    with pytest.raises(ValueError, match="shape"):
        analytic.mix_ball_worst_case(beta0, x[:, :2], y, 0.1)
    with pytest.raises(ValueError, match="rho"):
        analytic.mix_ball_worst_case(beta0, x, y, 0.0)
    with pytest.raises(ValueError, match="zero"):
        analytic.mix_retraction_one_coordinate(np.zeros(3), x, y, 0.1)
    with pytest.raises(ValueError, match="shape"):
        analytic.mix_retraction_product(beta0, beta0[:2])


def test_readings_benchmark_runs_in_quick_mode(tmp_path, monkeypatch):
    import json
    import pathlib

    benchmarks = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    import diagonal_readings

    out = tmp_path / "readings.json"
    doc = diagonal_readings.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert [r["setup"] for r in doc["runs"]] == ["phase-transition", "step-size"]
    for run in doc["runs"]:
        assert set(run["tau"]) == set(doc["readings"])
        checks = run["checks"]
        # Auto-PGD never beats the exact maximum over the same (Euclidean) ball
        assert checks["apgd_over_exact_euclidean_max"] <= 1 + 1e-9
        assert checks["euclidean_exact_min"] >= checks["euclidean_floor_2rho2_lambda_max"] * (
            1 - 1e-12
        )
