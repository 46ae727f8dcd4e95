"""Property-based tests of :class:`DiagonalQuotient`.

The diagonal quotient is :class:`GLQuotient` with ``n = m = h = 1`` for every
coordinate, so most of its geometry is checked against ``GLQuotient(1, 1, metric)``
applied to ``x.mT.unsqueeze(-1)`` (itself tested against reference formulas in
``test_gl_quotient.py``); the closed-form exponential map is checked against the RK4
integration of the geodesic equation and directly against the geodesic ODE.

Points have entries of magnitude in [0.1, 10] (so the metric weights span 1e4) and there
is no linear solve: float64 results are accurate to a few units of roundoff relative to
the size of the terms, hence the tolerances of 1e-12.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from geoopt_quotient import DiagonalQuotient, GeodesicDomainError, GLQuotient
from geoopt_quotient.testing import batch_shapes, diagonal_points, tangent_vectors

F64 = torch.float64
METRICS = ("inv", "mix")
SEEDS = st.integers(0, 2**32 - 1)
RTOL = 1e-12


pytestmark = [pytest.mark.on_device, pytest.mark.usefixtures("single_thread")]


# ----------------------------------------------------------------------------- helpers


def maxabs(t):
    return t.detach().double().abs().max().item()


def as_gl(x):
    """``(..., 2, d)`` -> ``(..., d, 2, 1)``: one GLQuotient(1, 1) point per coordinate."""
    return x.mT.unsqueeze(-1)


def from_gl(y):
    return y.squeeze(-1).mT


def vertical(x, alpha):
    r"""The vertical vector :math:`(\alpha u, -\alpha v)` (derivative of the action)."""
    return x * torch.stack((alpha, -alpha), dim=-2)


def horizontal_residual(x, u):
    r"""Relative violation of :math:`\eta_u v = \eta_v u` (:math:`\eta_u / u = \eta_v / v`)."""
    left, right = u[..., 0, :] * x[..., 1, :], u[..., 1, :] * x[..., 0, :]
    return maxabs(left - right) / max(maxabs(left) + maxabs(right), 1e-300)


@st.composite
def setups(draw, metrics=METRICS, batch=None, max_d=4):
    metric = draw(st.sampled_from(metrics))
    batch = batch_shapes() if batch is None else batch
    x = draw(diagonal_points(st.integers(1, max_d), batch))
    return DiagonalQuotient(metric), x


@st.composite
def rates(draw, x, max_rate):
    """A tangent vector ``x * r`` with per-entry rates ``|r| <= max_rate`` (not horizontal)."""
    gen = torch.Generator().manual_seed(draw(SEEDS))
    r = (2 * torch.rand(x.shape, generator=gen, dtype=F64) - 1) * max_rate
    return x * r


# ----------------------------------------------------------------------------- vs GLQuotient
@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_agrees_with_gl_quotient_of_rank_one(setup, data):
    manifold, x = setup
    gl = GLQuotient(1, 1, manifold.metric)
    u = data.draw(tangent_vectors(x))
    v = data.draw(tangent_vectors(x))
    xg, ug, vg = as_gl(x), as_gl(u), as_gl(v)
    scale = manifold.norm(x, u).max().item() * manifold.norm(x, v).max().item()
    assert_close(manifold.inner(x, u, v), gl.inner(xg, ug, vg).sum(-1), RTOL, scale, "inner")
    assert_close(
        manifold.component_inner(x, u, v)[..., 0, 0],
        gl.inner(xg, ug, vg).sum(-1),
        RTOL,
        scale,
        "component_inner",
    )
    for name in ("proju", "egrad2rgrad", "christoffel"):
        expected = from_gl(getattr(gl, name)(xg, ug))
        assert_close(getattr(manifold, name)(x, u), expected, RTOL, what=name)
    for retraction in ("second_order", "first_order"):
        diag = DiagonalQuotient(manifold.metric, retraction=retraction)
        gl_r = GLQuotient(1, 1, manifold.metric, retraction=retraction)
        xi = 0.1 * u
        assert_close(diag.retr(x, xi), from_gl(gl_r.retr(xg, as_gl(xi))), RTOL, what=retraction)
    y = manifold.retr(x, 0.1 * manifold.proju(x, u))
    expected = from_gl(gl.transp(xg, as_gl(y), vg))
    assert_close(manifold.transp(x, y, v), expected, RTOL, what="transp")


@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_closed_form_expmap_matches_the_integrated_geodesic(setup, data):
    """Any tangent vector, horizontal or not; relative rates |xi/x| <= 0.3 keep the
    geodesic well inside the manifold, and 64 RK4 steps are then accurate to ~1e-10."""
    manifold, x = setup
    gl = GLQuotient(1, 1, manifold.metric)
    xi = data.draw(rates(x, 0.3))
    if data.draw(st.booleans()):
        xi = manifold.proju(x, xi)
    expected = from_gl(gl.expmap(as_gl(x), as_gl(xi), steps=64))
    assert_close(manifold.expmap(x, xi), expected, 1e-8, what="expmap")


@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_horizontal_geodesics_have_the_documented_closed_forms(setup, data):
    manifold, x = setup
    gen = torch.Generator().manual_seed(data.draw(SEEDS))
    b = (2 * torch.rand(x[..., 0, :].shape, generator=gen, dtype=F64) - 1) * 0.45
    xi = b.unsqueeze(-2) * x
    assert horizontal_residual(x, xi) < 1e-15
    if manifold.metric == "inv":
        expected = x * torch.exp(b).unsqueeze(-2)
    else:
        expected = x * torch.sqrt(1 + 2 * b).unsqueeze(-2)
    assert_close(manifold.expmap(x, xi), expected, RTOL, what="closed form")
    # the invariant: inv u v e^{2B}, mix u v (1 + 2B) (a straight line in beta)
    beta = manifold.product(manifold.expmap(x, xi))
    factor = torch.exp(2 * b) if manifold.metric == "inv" else 1 + 2 * b
    assert_close(beta, manifold.product(x) * factor, RTOL, what="beta")


@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_expmap_solves_the_geodesic_equation(setup, data):
    r""":math:`\gamma(t) = \exp_x(t\xi)` has :math:`\gamma(0) = x`, :math:`\dot\gamma(0) = \xi`,
    :math:`\ddot\gamma + \Gamma(\dot\gamma, \dot\gamma) = 0` and constant metric speed
    (derivatives in t by forward-mode autograd)."""
    manifold, x = setup
    xi = data.draw(rates(x, 0.4))
    if data.draw(st.booleans()):
        xi = manifold.proju(x, xi)

    def curve(t):
        return manifold.expmap(x, t * xi)

    def velocity(t):
        return torch.func.jvp(curve, (t,), (torch.ones_like(t),))[1]

    speed0 = manifold.inner(x, xi)
    for t in (0.0, 0.4, 1.0):
        t = torch.tensor(t, dtype=F64)
        pos = curve(t)
        vel, acc = torch.func.jvp(velocity, (t,), (torch.ones_like(t),))
        if t == 0:
            assert_close(pos, x, RTOL, what="gamma(0)")
            assert_close(vel, xi, RTOL, what="gamma'(0)")
        gamma = manifold.christoffel(pos, vel)
        assert_close(acc + gamma, torch.zeros_like(acc), 1e-10, scale=maxabs(gamma), what="ODE")
        assert_close(manifold.inner(pos, vel), speed0, 1e-10, what="speed")


def test_mix_expmap_raises_when_the_geodesic_reaches_zero():
    """Exactly representable data, so the rates are exactly horizontal."""
    mix, inv = DiagonalQuotient("mix"), DiagonalQuotient("inv")
    x = torch.tensor([[2.0, -4.0, 0.5], [-1.0, 8.0, 0.25]], dtype=F64)
    for b in (-0.5, -0.75, -2.0):
        xi = b * x
        with pytest.raises(GeodesicDomainError, match=r"1 \+ 2 B <= 0"):
            mix.expmap(x, xi)
        with pytest.raises(ValueError):
            mix.expmap(x, xi)
        assert torch.isfinite(inv.expmap(x, xi)).all()
        assert_close(inv.expmap(x, xi), x * math.exp(b), RTOL)
    # a single offending coordinate is enough
    xi = torch.zeros_like(x)
    xi[:, 1] = -0.5 * x[:, 1]
    with pytest.raises(GeodesicDomainError):
        mix.expmap(x, xi)
    # -0.25 is fine: sqrt(1 + 2 B) = sqrt(1/2)
    assert_close(mix.expmap(x, -0.25 * x), x * math.sqrt(0.5), RTOL)
    # a non-horizontal vector with the same mean rate passes by zero at a positive
    # distance (a straight line in the flat coordinate w), so the result is a point
    xi = -0.75 * x
    xi[0] = xi[0] * 1.5
    y = mix.expmap(x, xi)
    assert torch.isfinite(y).all() and (y != 0).all()
    assert issubclass(GeodesicDomainError, ValueError)


@settings(max_examples=40, deadline=None)
@given(setup=setups(metrics=("mix",)), data=st.data())
def test_mix_expmap_raises_for_every_numerically_horizontal_vector_past_the_domain(setup, data):
    """Horizontal vectors made by ``proju`` (so horizontal only up to rounding) with
    1 + 2 B <= 0 in some coordinate must raise, not return a point whose u / v ratio
    depends on the sign of a rounding error. Before the fix (exact ``b_u == b_v``) about
    5% of such vectors returned a point."""
    manifold, x = setup
    xi = manifold.proju(x, data.draw(tangent_vectors(x)))
    gen = torch.Generator().manual_seed(data.draw(SEEDS))
    target = -0.5 - 2.5 * torch.rand(x[..., 0, :].shape, generator=gen, dtype=F64)
    xi = xi * (target / manifold.horizontal_rate(x, xi)).unsqueeze(-2)
    assert manifold.check_vector_on_tangent(x, xi, atol=1e-10, rtol=1e-10)
    with pytest.raises(GeodesicDomainError):
        manifold.expmap(x, xi)
    # clearly non-horizontal vectors with the same rates pass by zero: a point
    bumped = xi + x * torch.stack((1e-3 * torch.ones_like(target), torch.zeros_like(target)), -2)
    y = manifold.expmap(x, bumped)
    assert torch.isfinite(y).all() and (y != 0).all()


# ----------------------------------------------------------------------------- projection
@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_proju_is_the_metric_orthogonal_projection(setup, data):
    manifold, x = setup
    u = data.draw(tangent_vectors(x))
    p = manifold.proju(x, u)
    r = u - p
    assert horizontal_residual(x, p) < 1e-14
    assert manifold.check_vector_on_tangent(x, p, atol=1e-10, rtol=1e-10)
    # the removed part is vertical: r = (alpha u, -alpha v)
    alpha = r[..., 0, :] / x[..., 0, :]
    assert_close(r, vertical(x, alpha), RTOL, scale=maxabs(u), what="removed part")
    # metric-orthogonal to the vertical direction, and idempotent
    ones = torch.ones_like(x[..., 0, :])
    cross = manifold.inner(x, p, vertical(x, ones))
    bound = manifold.norm(x, p) * manifold.norm(x, vertical(x, ones))
    assert (cross.abs() <= 1e-13 * bound).all()
    assert_close(manifold.proju(x, p), p, RTOL, scale=maxabs(u), what="idempotence")
    assert maxabs(manifold.proju(x, vertical(x, alpha))) <= 1e-14 * maxabs(r) + 1e-300


def test_non_horizontal_vectors_are_rejected():
    manifold = DiagonalQuotient("inv")
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=F64)
    assert not manifold.check_vector_on_tangent(x, vertical(x, torch.ones(2, dtype=F64)))
    ok, reason = manifold.check_vector_on_tangent(x, torch.ones_like(x), explain=True)
    assert not ok and "not horizontal" in reason


# ----------------------------------------------------------------------------- metric
@st.composite
def scalings(draw, shape, max_ratio=1e3):
    """Element-wise group elements alpha: random signs, |alpha| in [1/sqrt(r), sqrt(r)]."""
    gen = torch.Generator().manual_seed(draw(SEEDS))
    half = 0.5 * math.log(max_ratio)
    mag = torch.exp((2 * torch.rand(shape, generator=gen, dtype=F64) - 1) * half)
    sign = torch.randint(0, 2, shape, generator=gen).to(F64) * 2 - 1
    return sign * mag


@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_metric_is_symmetric_positive_and_invariant(setup, data):
    manifold, x = setup
    u = data.draw(tangent_vectors(x))
    v = data.draw(tangent_vectors(x))
    alpha = data.draw(scalings(x[..., 0, :].shape))
    value = manifold.inner(x, u, v)
    scale = manifold.norm(x, u).max().item() * manifold.norm(x, v).max().item()
    assert_close(manifold.inner(x, v, u), value, RTOL, scale, "symmetry")
    assert (manifold.inner(x, u) > 0).all()
    assert (manifold.inner(x, manifold.proju(x, u)) > 0).all()
    weights = x.flip(-2) ** 2 if manifold.metric == "mix" else x**-2
    assert_close(value, (weights * u * v).sum((-2, -1)), RTOL, scale, "definition")
    xa, ua, va = (manifold.act(t, alpha) for t in (x, u, v))
    assert_close(manifold.inner(xa, ua, va), value, RTOL, scale, "invariance")
    assert_close(manifold.product(xa), manifold.product(x), RTOL, what="beta")
    # projection, Christoffel symbols and the exponential map are equivariant
    assert_close(manifold.proju(xa, ua), manifold.act(manifold.proju(x, u), alpha), RTOL)
    gamma = manifold.christoffel(x, u)
    assert_close(manifold.christoffel(xa, ua), manifold.act(gamma, alpha), RTOL)
    xi = data.draw(rates(x, 0.3))
    expected = manifold.product(manifold.expmap(x, xi))
    xia = manifold.act(xi, alpha)
    assert_close(manifold.product(manifold.expmap(xa, xia)), expected, RTOL, what="expmap")


@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_egrad2rgrad_represents_the_directional_derivative(setup, data):
    manifold, x = setup
    gen = torch.Generator().manual_seed(data.draw(SEEDS))
    target = torch.randn(x[..., 0, :].shape, generator=gen, dtype=F64)
    xr = x.clone().requires_grad_(True)
    loss = ((manifold.product(xr) - target) ** 2 + torch.sin(manifold.product(xr))).sum()
    (egrad,) = torch.autograd.grad(loss, xr)
    rgrad = manifold.egrad2rgrad(x, egrad)
    assert horizontal_residual(x, rgrad) < 1e-14
    xi = data.draw(tangent_vectors(x))  # any direction: the loss is invariant
    dot = (egrad * xi).sum((-2, -1))
    scale = maxabs((egrad * xi).abs().sum((-2, -1)))
    assert_close(manifold.inner(x, rgrad, xi), dot, RTOL, scale, "invariant loss")
    # a loss that is not invariant: along horizontal directions
    xr = x.clone().requires_grad_(True)
    (egrad,) = torch.autograd.grad(torch.cos(xr).sum(), xr)
    rgrad = manifold.egrad2rgrad(x, egrad)
    xi = manifold.proju(x, xi)
    dot = (egrad * xi).sum((-2, -1))
    scale = maxabs((egrad * xi).abs().sum((-2, -1)))
    assert_close(manifold.inner(x, rgrad, xi), dot, RTOL, scale, "horizontal directions")


# ----------------------------------------------------------------------------- retraction
def loglog_slope(ts, errors):
    lt, le = torch.tensor(ts).log(), torch.tensor(errors).log()
    lt, le = lt - lt.mean(), le - le.mean()
    return ((lt * le).sum() / (lt * lt).sum()).item()


@settings(max_examples=30, deadline=None)
@given(setup=setups(batch=st.just(())), data=st.data())
def test_retr_agrees_with_expmap_to_the_expected_order(setup, data):
    manifold, x = setup
    xi = manifold.proju(x, data.draw(rates(x, 1.0)))
    xi = xi / maxabs(xi / x)  # largest relative rate 1
    assert torch.equal(manifold.retr(x, torch.zeros_like(x)), x)
    ts = [0.05 * 2.0**-k for k in range(5)]
    slopes = {}
    for retraction in ("second_order", "first_order"):
        retr = DiagonalQuotient(manifold.metric, retraction=retraction)
        errors = [
            maxabs(retr.product(retr.retr(x, t * xi)) - retr.product(retr.expmap(x, t * xi)))
            for t in ts
        ]
        slopes[retraction] = loglog_slope(ts, errors)
    assert slopes["second_order"] > 2.7, slopes
    assert 1.8 < slopes["first_order"] < 2.2, slopes


# ----------------------------------------------------------------------------- batching, sampling
@settings(max_examples=25, deadline=None)
@given(setup=setups(batch=batch_shapes().filter(bool)), data=st.data())
def test_batched_results_equal_per_item_results(setup, data):
    manifold, x = setup
    u = data.draw(tangent_vectors(x))
    xi = data.draw(rates(x, 0.3))
    names = ("inner", "component_inner", "proju", "egrad2rgrad", "christoffel", "retr")
    batched = {name: getattr(manifold, name)(x, u) for name in names}
    batched["expmap"] = manifold.expmap(x, xi)
    for index in itertools.product(*(range(s) for s in x.shape[:-2])):
        for name in names:
            single = getattr(manifold, name)(x[index], u[index])
            assert_close(batched[name][index], single, RTOL, what=f"{name} at {index}")
        single = manifold.expmap(x[index], xi[index])
        assert_close(batched["expmap"][index], single, RTOL, what=f"expmap at {index}")


@settings(max_examples=15, deadline=None)
@given(setup=setups(batch=st.just(()), max_d=6))
def test_random_tangent_is_a_standard_horizontal_gaussian(setup):
    """E|xi|^2 = d, the dimension of the quotient; 6 standard errors, fixed seed."""
    manifold, x = setup
    samples, d = 4000, x.shape[-1]
    xs = x.expand(samples, *x.shape)
    xi = manifold.random_tangent(xs, generator=torch.Generator().manual_seed(7))
    assert horizontal_residual(xs, xi) < 1e-14
    sq = manifold.inner(xs, xi)
    assert abs(sq.mean().item() - d) < 6 * math.sqrt(2 * d / samples), (sq.mean(), d)


def test_random_and_origin_are_points():
    manifold = DiagonalQuotient("mix")
    x = manifold.random(3, 2, 5, dtype=F64)
    assert x.manifold is manifold and x.shape == (3, 2, 5)
    manifold.assert_check_point_on_manifold(x)
    assert torch.equal(manifold.origin(2, 4), torch.ones(2, 4))


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="metric"):
        DiagonalQuotient("riemannian")
    with pytest.raises(TypeError, match="metric"):
        DiagonalQuotient(None)
    with pytest.raises(ValueError, match="retraction"):
        DiagonalQuotient(retraction="exact")
    manifold = DiagonalQuotient()
    x = torch.tensor([[1.0, 0.0, 2.0], [3.0, 1.0, 0.0]])
    ok, reason = manifold.check_point_on_manifold(x, explain=True)
    assert not ok and "2 zero entries" in reason and "u_i != 0" in reason
    with pytest.raises(ValueError, match="zero entries"):
        manifold.assert_check_point_on_manifold(x)
    ok, reason = manifold.check_point_on_manifold(torch.full((2, 2), float("nan")), explain=True)
    assert not ok and "non-finite" in reason
    ok, reason = manifold.check_point(torch.ones(3, 4), explain=True)
    assert not ok and "(..., 2, d)" in reason
    with pytest.raises(ValueError, match=r"\(\.\.\., 2, d\)"):
        manifold.random(4, 3)
    assert manifold.check_point_on_manifold(torch.ones(5, 2, 3))
