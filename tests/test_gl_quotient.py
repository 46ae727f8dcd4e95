"""Property-based tests of :class:`GLQuotient`.

Conventions
-----------
* Points come from :func:`gl_points`: factors with condition number up to 1e3, so the
  Gram matrices :math:`S_G, S_H` have condition number up to 1e6.
* Group elements have condition number up to 1e3 too, so ``act(x, A)`` can have Gram
  matrices of condition number up to ~1e12.
* Errors are measured relative to the size of the quantities compared: tangent vectors
  in the metric norm of their base point (:func:`assert_close_metric`), everything
  else entry-wise (:func:`assert_close`). Tolerances are
  ``1000 * unit roundoff * cond ** p`` (:func:`tolerance`), ``cond`` the largest
  condition number of the Gram matrices involved: rounding errors of the ``h x h``
  solves grow like that, while a wrong formula gives errors of order one at every
  point. Measured against a 40-digit mpmath projection and float32 against float64:
  p = 1 for the mix metric and p = 1.5 for the inv metric, whose projection (an
  eigendecomposition of S_G S_H with the non-orthogonal similarity chol(S_G) Q) loses a
  further factor sqrt(cond); error / (unit * cond ** p) was <= 1 for the projection
  itself and up to ~150 for derived checks (cosines with badly scaled vertical basis
  vectors) over ~10^4 examples. (For the most ill-conditioned ``act(x, A)`` the inv
  tolerance exceeds 1, and such an example checks nothing: the inv projection has no
  accurate digit left there. Wrong formulas are caught by the other examples.)
* The metric, its Christoffel symbols and the verticality of a vector are checked
  against independent reference implementations written here from the formulas
  (explicit inverses, autograd), never against the code under test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from geoopt_quotient import GLQuotient
from geoopt_quotient.testing import (
    batch_shapes,
    full_rank_matrices,
    gl_elements,
    gl_points,
    horizontal_vectors,
    tangent_vectors,
)

F64 = torch.float64
METRICS = ("inv", "mix")
SEEDS = st.integers(0, 2**32 - 1)
UNIT64 = torch.finfo(F64).eps
UNIT32 = torch.finfo(torch.float32).eps
CONDITION_POWER = {"mix": 1.0, "inv": 1.5}


pytestmark = [pytest.mark.on_device, pytest.mark.usefixtures("single_thread")]


# ----------------------------------------------------------------------------- helpers


def assert_close_metric(manifold, x, actual, expected, rtol, ref=None, what=""):
    """``|actual - expected|_x <= rtol * |ref|_x`` for every point of the batch (metric norm)."""
    ref = expected if ref is None else ref
    err = (manifold.norm(x, actual - expected) / manifold.norm(x, ref)).max().item()
    assert err <= rtol, f"{what}: relative metric error {err:.3g} > {rtol:.3g}"


def gram_condition(manifold, *points):
    """Largest condition number of the Gram matrices S_G, S_H of the given points."""
    conds = [torch.linalg.cond(s).max().item() for x in points for s in grams(manifold, x)]
    return max(conds)


def tolerance(manifold, *points, unit=UNIT64):
    """Relative tolerance ``1000 * unit * cond ** p`` for computations at ``points``."""
    cond = gram_condition(manifold, *(x.double() for x in points))
    return 1000 * unit * cond ** CONDITION_POWER[manifold.metric]


def maxabs(t):
    return t.detach().double().abs().max().item()


def grams(manifold, x):
    g, h = manifold.factors(x)
    eye = torch.eye(x.shape[-1], dtype=x.dtype)
    return g.mT @ g + manifold.eps * eye, h.mT @ h + manifold.eps * eye


def trace(a):
    return a.diagonal(dim1=-2, dim2=-1).sum(-1)


def reference_inner(manifold, x, u, v):
    """The metric written from its definition with explicit inverses."""
    s_g, s_h = grams(manifold, x)
    u_g, u_h = manifold.factors(u)
    v_g, v_h = manifold.factors(v)
    if manifold.metric == "inv":
        return trace(torch.linalg.inv(s_g) @ u_g.mT @ v_g) + trace(
            torch.linalg.inv(s_h) @ u_h.mT @ v_h
        )
    return trace(s_h @ u_g.mT @ v_g) + trace(s_g @ u_h.mT @ v_h)


def reference_raise(manifold, x, w):
    """The inverse of the metric applied to an ambient covector ``w``."""
    s_g, s_h = grams(manifold, x)
    w_g, w_h = manifold.factors(w)
    if manifold.metric == "inv":
        return manifold.from_factors(w_g @ s_g, w_h @ s_h)
    return manifold.from_factors(w_g @ torch.linalg.inv(s_h), w_h @ torch.linalg.inv(s_g))


def reference_christoffel(manifold, x, xi):
    r"""Levi-Civita :math:`\Gamma_x(\xi,\xi) = g^{-1}[(D_\xi g)\xi - \tfrac12 \nabla_x g(\xi,\xi)]`.

    From the Euler-Lagrange equation of the energy, :math:`\tfrac{d}{dt}(g\dot x)
    = \tfrac12 \nabla_x g(\dot x, \dot x)`, with derivatives of the reference metric by
    autograd.
    """

    def lowered(p):
        return torch.func.grad(lambda v: 0.5 * reference_inner(manifold, p, v, v).sum())(xi)

    _, d_lowered = torch.func.jvp(lowered, (x,), (xi,))
    grad_energy = torch.func.grad(lambda p: reference_inner(manifold, p, xi, xi).sum())(x)
    return reference_raise(manifold, x, d_lowered - 0.5 * grad_energy)


def vertical(manifold, x, omega):
    r"""The vertical vector :math:`(-G\Omega, H\Omega^\top)`."""
    g, h = manifold.factors(x)
    return manifold.from_factors(-g @ omega, h @ omega.mT)


def max_vertical_cosine(manifold, x, u, ref_norm=None):
    r"""Largest :math:`|\langle u, V\rangle| / (r \|V\|)` over the vertical vectors
    :math:`V` generated by the elementary matrices :math:`E_{ij}`; 0 iff ``u`` is
    horizontal. ``r`` (default :math:`\|u\|`) is the size of the vector that ``u`` was
    computed from: a projection's rounding error is relative to its input, and the
    output can be much shorter than the input."""
    k = x.shape[-1]
    basis_omega = torch.eye(k * k, dtype=x.dtype).reshape(k * k, k, k)
    xe, ue = x.unsqueeze(-3), u.unsqueeze(-3)
    basis = vertical(manifold, xe, basis_omega)
    if ref_norm is None:
        ref_norm = manifold.norm(xe, ue)
    elif torch.is_tensor(ref_norm):
        ref_norm = ref_norm.unsqueeze(-1)
    cos = manifold.inner(xe, ue, basis) / (ref_norm * manifold.norm(xe, basis))
    return cos.abs().max().item()


def vertical_residual(manifold, x, r):
    r"""Distance of ``r`` from the vertical space: fit :math:`\Omega` on the G block,
    :math:`\Omega = -G^+ r_G` (least squares by QR, accurate to ``cond(G)`` rather than
    ``cond(G^T G)``), and compare :math:`(-G\Omega, H\Omega^\top)` with ``r``."""
    g, _ = manifold.factors(x)
    r_g, _ = manifold.factors(r)
    omega = -torch.linalg.lstsq(g, r_g, driver="gels").solution
    fit = vertical(manifold, x, omega)
    return maxabs(fit - r)


def with_relative_size(manifold, x, xi, size):
    r"""Rescale ``xi`` (per point) so that
    :math:`\max(\|\xi_G\|_2 / \sigma_{\min}(G), \|\xi_H\|_2 / \sigma_{\min}(H)) = ` ``size``.

    This is the scale-free size of a step: the factors of :math:`X + t\xi` stay of full
    rank for :math:`t \cdot` ``size`` :math:`< 1`. A geodesic of the (incomplete) mix
    metric reaches a rank-deficient pair after a metric length of the order of the
    smallest singular values, so steps must be measured this way, not by metric norm.
    """
    sizes = []
    for f, d in zip(manifold.factors(x), manifold.factors(xi)):
        smin = torch.linalg.svdvals(f)[..., -1]
        sizes.append(torch.linalg.matrix_norm(d, ord=2) / smin)
    rel = torch.maximum(*sizes)
    return xi * (size / rel)[..., None, None]


def euclidean_dot(a, b):
    return (a * b).sum((-2, -1))


@st.composite
def setups(
    draw,
    metrics=METRICS,
    eps=(0.0,),
    batch=None,
    max_condition=1e3,
    dtype=F64,
    max_size=4,
):
    """A random ``GLQuotient(n, m, metric, eps)`` and a point of it."""
    n = draw(st.integers(1, max_size))
    m = draw(st.integers(1, max_size))
    h = draw(st.integers(1, min(n, m)))
    metric = draw(st.sampled_from(metrics))
    manifold = GLQuotient(n, m, metric, draw(st.sampled_from(eps)))
    batch = batch_shapes() if batch is None else batch
    x = draw(gl_points(manifold, batch, h, max_condition, dtype))
    return manifold, x


def gl_for(x, data, max_condition=1e3, **kwargs):
    """A group element broadcasting over the batch of ``x`` (one per point)."""
    return data.draw(
        gl_elements(x.shape[-1], max_condition, batch_shape=x.shape[:-2], dtype=x.dtype, **kwargs)
    )


# ----------------------------------------------------------------------------- strategies
@settings(max_examples=30, deadline=None)
@given(
    a=full_rank_matrices(
        st.integers(1, 5), st.integers(1, 5), 1e3, batch_shape=batch_shapes(), min_condition=2.0
    ),
    b=gl_elements(st.integers(1, 4), max_condition=50.0, dtype=torch.float32),
    setup=setups(),
    data=st.data(),
)
def test_strategies_deliver_what_they_promise(a, b, setup, data):
    cond = GLQuotient.condition_number(a)
    if min(a.shape[-2:]) > 1:
        assert (cond <= 1e3 * (1 + 1e-9)).all() and (cond >= 2.0 * (1 - 1e-9)).all()
    assert b.dtype == torch.float32 and b.shape[-1] == b.shape[-2]
    # rounding the float64 matrix to float32 (relative error <= sqrt(h) * UNIT32 / 2 <= UNIT32
    # in the spectral norm, h <= 4) raises its condition number by a factor of at most
    # 1 + (cond + 1) * UNIT32 (1 + 6e-6 for cond = 50): the bound below is twice that
    assert (GLQuotient.condition_number(b.double()) <= 50.0 * (1 + 100 * UNIT32)).all()
    manifold, x = setup
    assert x.dtype == F64 and x.shape[-2] == manifold.n + manifold.m
    manifold.assert_check_point_on_manifold(x)
    xi = data.draw(horizontal_vectors(manifold, x))
    manifold.assert_check_vector_on_tangent(x, xi, atol=1e-6, rtol=1e-6)
    assert max_vertical_cosine(manifold, x, xi) < 1e-6


# ----------------------------------------------------------------------------- projection
@settings(max_examples=40, deadline=None)
@given(setup=setups(eps=(0.0, 0.25)), data=st.data())
def test_proju_is_the_metric_orthogonal_projection(setup, data):
    manifold, x = setup
    u = data.draw(tangent_vectors(x))
    tol = tolerance(manifold, x)
    p = manifold.proju(x, u)
    r = u - p
    # horizontal: metric-orthogonal to every vertical vector, and the documented equation
    assert max_vertical_cosine(manifold, x, p, ref_norm=manifold.norm(x, u)) < tol
    left, right = manifold._horizontality_terms(x, p)
    scale = sum(maxabs(t) for t in manifold._horizontality_terms(x, u))  # size of the input
    assert_close(left, right, tol, scale=scale, what="horizontality")
    assert manifold.check_vector_on_tangent(x, p, atol=tol * scale, rtol=tol)
    # the removed part is vertical, (-G Omega, H Omega^T), and orthogonal to p
    assert vertical_residual(manifold, x, r) <= tol * maxabs(u)
    cross = manifold.inner(x, r, p).abs()
    assert (cross <= tol * manifold.inner(x, u)).all()
    assert_close(manifold.inner(x, p) + manifold.inner(x, r), manifold.inner(x, u), tol)
    # idempotent, and vertical vectors are annihilated
    assert_close_metric(manifold, x, manifold.proju(x, p), p, tol, ref=u, what="idempotence")
    omega = data.draw(tangent_vectors(x[..., : x.shape[-1], :], scale=1.0))
    v = vertical(manifold, x, omega)
    zero = torch.zeros_like(v)
    assert_close_metric(manifold, x, manifold.proju(x, v), zero, tol, ref=v, what="vertical")


@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_proju_is_equivariant(setup, data):
    manifold, x = setup
    a = gl_for(x, data)
    u = data.draw(tangent_vectors(x))
    xa, ua = manifold.act(x, a), manifold.act(u, a)
    tol = tolerance(manifold, x, xa)
    expected = manifold.act(manifold.proju(x, u), a)
    actual = manifold.proju(xa, ua)
    assert_close_metric(manifold, xa, actual, expected, tol, ref=ua, what="proju equivariance")


def test_vertical_vectors_are_not_horizontal():
    """Sanity check of the test helper: it must be able to reject a vector."""
    manifold = GLQuotient(3, 2, "mix")
    x = manifold.random(3 + 2, 2, dtype=F64)
    assert max_vertical_cosine(manifold, x, vertical(manifold, x, torch.eye(2, dtype=F64))) > 0.1


# ----------------------------------------------------------------------------- metric
@settings(max_examples=40, deadline=None)
@given(setup=setups(eps=(0.0, 0.25)), data=st.data())
def test_inner_matches_definition_symmetric_positive_definite(setup, data):
    manifold, x = setup
    u = data.draw(tangent_vectors(x))
    v = data.draw(tangent_vectors(x))
    tol = tolerance(manifold, x)
    value = manifold.inner(x, u, v)
    assert value.shape == x.shape[:-2]
    scale = manifold.norm(x, u).max().item() * manifold.norm(x, v).max().item()
    expected = reference_inner(manifold, x, u, v)
    assert_close(value, expected, tol, scale=scale, what="inner vs definition")
    assert_close(manifold.inner(x, v, u), value, 1e-12, scale=maxabs(value), what="symmetry")
    # positive definite on the total space and on the horizontal space
    assert (manifold.inner(x, u) > 0).all()
    p = manifold.proju(x, u)
    assert (manifold.inner(x, p) > 0).all()
    assert_close(manifold.norm(x, u) ** 2, manifold.inner(x, u), 1e-12, what="norm")
    # keepdim / component_inner: one value per point
    component = manifold.component_inner(x, u, v)
    assert component.shape == (*x.shape[:-2], 1, 1)
    assert_close(component[..., 0, 0], value, 1e-14, what="component_inner")


@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_inner_is_group_invariant(setup, data):
    manifold, x = setup
    a = gl_for(x, data)
    u = data.draw(tangent_vectors(x))
    v = data.draw(tangent_vectors(x))
    xa, ua, va = (manifold.act(t, a) for t in (x, u, v))
    tol = tolerance(manifold, x, xa)
    scale = manifold.norm(x, u).max().item() * manifold.norm(x, v).max().item()
    assert_close(manifold.inner(xa, ua, va), manifold.inner(x, u, v), tol, scale=scale)
    # the invariant G H^T is preserved by the action
    assert_close(manifold.product(xa), manifold.product(x), tol, what="product")


# ----------------------------------------------------------------------------- gradient
def invariant_loss(manifold, x, target, weight):
    """Per-point loss depending on x only through G H^T."""
    prod = manifold.product(x)
    return ((prod - target) ** 2).sum((-2, -1)) + (weight * prod).sum((-2, -1))


def dual_scale(manifold, x, egrad, xi):
    r"""Cauchy-Schwarz bound :math:`\|df\|_x^* \|\xi\|_x` of :math:`df(\xi)`, the natural
    size against which to measure rounding errors of the metric computations."""
    dual = reference_raise(manifold, x, egrad)
    return (manifold.norm(x, dual) * manifold.norm(x, xi)).max().item()


@settings(max_examples=40, deadline=None)
@given(setup=setups(eps=(0.0, 0.25)), data=st.data())
def test_egrad2rgrad_represents_the_directional_derivative(setup, data):
    manifold, x = setup
    tol = tolerance(manifold, x)
    n, m = manifold.n, manifold.m
    gen = torch.Generator().manual_seed(data.draw(SEEDS))
    target = torch.randn(*x.shape[:-2], n, m, generator=gen, dtype=F64)
    weight = torch.randn(n, m, generator=gen, dtype=F64)
    xr = x.clone().requires_grad_(True)
    (egrad,) = torch.autograd.grad(invariant_loss(manifold, xr, target, weight).sum(), xr)
    rgrad = manifold.egrad2rgrad(x, egrad)
    raised = manifold.norm(x, reference_raise(manifold, x, egrad))
    assert max_vertical_cosine(manifold, x, rgrad, ref_norm=raised) < tol
    # any direction, horizontal or not: the loss is invariant, so it ignores vertical parts
    xi = data.draw(tangent_vectors(x))
    scale = dual_scale(manifold, x, egrad, xi)
    assert_close(manifold.inner(x, rgrad, xi), euclidean_dot(egrad, xi), tol, scale=scale)

    # a loss that is not invariant: exact along horizontal directions
    mixing = torch.randn(x.shape[-2:], generator=gen, dtype=F64)
    xr = x.clone().requires_grad_(True)
    (egrad,) = torch.autograd.grad((torch.sin(xr) * mixing).sum(), xr)
    rgrad = manifold.egrad2rgrad(x, egrad)
    xi = data.draw(horizontal_vectors(manifold, x))
    scale = dual_scale(manifold, x, egrad, xi)
    assert_close(manifold.inner(x, rgrad, xi), euclidean_dot(egrad, xi), tol, scale=scale)


# ----------------------------------------------------------------------------- geodesics
@settings(max_examples=40, deadline=None)
@given(setup=setups(eps=(0.0, 0.25)), data=st.data())
def test_christoffel_is_the_levi_civita_connection_of_the_metric(setup, data):
    manifold, x = setup
    xi = data.draw(tangent_vectors(x))
    expected = reference_christoffel(manifold, x, xi)
    tol = tolerance(manifold, x)
    assert_close(manifold.christoffel(x, xi), expected, tol, what="christoffel")


@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_christoffel_is_equivariant(setup, data):
    manifold, x = setup
    a = gl_for(x, data)
    xi = data.draw(tangent_vectors(x))
    xa = manifold.act(x, a)
    expected = manifold.act(manifold.christoffel(x, xi), a)
    actual = manifold.christoffel(xa, manifold.act(xi, a))
    tol = tolerance(manifold, x, xa)
    assert_close_metric(manifold, xa, actual, expected, tol, what="christoffel equivariance")


@settings(max_examples=30, deadline=None)
@given(
    setup=setups(eps=(0.0, 0.25)),
    retraction=st.sampled_from(["second_order", "first_order"]),
    data=st.data(),
)
def test_retr_at_zero_and_its_velocity(setup, retraction, data):
    manifold, x = setup
    manifold = GLQuotient(
        manifold.n, manifold.m, manifold.metric, manifold.eps, retraction=retraction
    )
    assert torch.equal(manifold.retr(x, torch.zeros_like(x)), x)
    xi = data.draw(horizontal_vectors(manifold, x))
    t0 = torch.zeros((), dtype=F64)
    _, velocity = torch.func.jvp(lambda t: manifold.retr(x, t * xi), (t0,), (torch.ones_like(t0),))
    assert_close(velocity, xi, 1e-12, what="d/dt retr(x, t xi) at 0")


def loglog_slope(ts, errors):
    lt, le = torch.tensor(ts).log(), torch.tensor(errors).log()
    lt, le = lt - lt.mean(), le - le.mean()
    return ((lt * le).sum() / (lt * lt).sum()).item()


@settings(max_examples=20, deadline=None)
@given(setup=setups(batch=st.just(()), max_condition=10.0), data=st.data())
def test_retr_agrees_with_expmap_to_the_expected_order(setup, data):
    """The second-order retraction matches the geodesic up to O(t^3) in G H^T, the
    straight line only up to O(t^2). Points are well-conditioned here (<= 10) so that
    t <= 0.05 is already in the asymptotic regime; the property itself is exact."""
    manifold, x = setup
    xi = with_relative_size(manifold, x, data.draw(horizontal_vectors(manifold, x)), 1.0)
    ts = [0.05 * 2.0**-k for k in range(5)]
    slopes = {}
    for retraction in ("second_order", "first_order"):
        retr = GLQuotient(manifold.n, manifold.m, manifold.metric, retraction=retraction)
        errors = []
        for t in ts:
            exact = manifold.product(manifold.expmap(x, t * xi, steps=8))
            errors.append(maxabs(retr.product(retr.retr(x, t * xi)) - exact))
        slopes[retraction] = loglog_slope(ts, errors)
    assert slopes["second_order"] > 2.7, slopes
    assert 1.8 < slopes["first_order"] < 2.2, slopes


@settings(max_examples=10, deadline=None)
@given(setup=setups(batch=st.just(()), max_condition=10.0), data=st.data())
def test_expmap_rk4_converges_with_order_four(setup, data):
    manifold, x = setup
    xi = with_relative_size(manifold, x, data.draw(horizontal_vectors(manifold, x)), 0.2)
    reference = manifold.expmap(x, xi, steps=256)
    steps = [2, 4, 8]
    errors = [maxabs(manifold.expmap(x, xi, steps=s) - reference) for s in steps]
    assert -loglog_slope(steps, errors) > 3.5, errors


@settings(max_examples=30, deadline=None)
@given(setup=setups(max_condition=30.0), data=st.data())
def test_geodesic_stays_horizontal_with_constant_speed(setup, data):
    """Horizontal geodesics stay horizontal (the group acts by isometries) and have
    constant metric speed. Only the RK4 error (~1e-9 for 32 steps of a unit-speed
    geodesic on points of condition <= 30) separates the numbers from exact."""
    manifold, x = setup
    xi = with_relative_size(manifold, x, data.draw(horizontal_vectors(manifold, x)), 0.2)
    speed0 = manifold.inner(x, xi)
    for t in (0.5, 1.0):
        pos, vel = manifold.geodesic(x, xi, t, steps=32)
        assert max_vertical_cosine(manifold, pos, vel) < 1e-6
        assert_close(manifold.inner(pos, vel), speed0, 1e-6, what=f"speed at t={t}")
    # expmap is the end point of the geodesic
    assert_close(manifold.expmap(x, xi, steps=32), pos, 1e-14, what="expmap vs geodesic")


@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_geodesic_is_equivariant(setup, data):
    manifold, x = setup
    a = gl_for(x, data)
    xi = with_relative_size(manifold, x, data.draw(horizontal_vectors(manifold, x)), 0.2)
    xa = manifold.act(x, a)
    tol = tolerance(manifold, x, xa)
    pos, vel = manifold.geodesic(x, xi, 1.0, steps=8)
    pos_a, vel_a = manifold.geodesic(xa, manifold.act(xi, a), 1.0, steps=8)
    assert_close(manifold.product(pos_a), manifold.product(pos), tol, what="G(t)H(t)^T")
    assert_close_metric(manifold, pos_a, vel_a, manifold.act(vel, a), tol, what="velocity")


# ----------------------------------------------------------------------------- transport
@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_transp_is_horizontal_at_the_new_point_and_equivariant(setup, data):
    manifold, x = setup
    a = gl_for(x, data)
    xi = with_relative_size(manifold, x, data.draw(horizontal_vectors(manifold, x)), 0.1)
    v = data.draw(horizontal_vectors(manifold, x))
    y = manifold.retr(x, xi)
    xa = manifold.act(x, a)
    tol = tolerance(manifold, x, y, xa)
    w = manifold.transp(x, y, v)
    assert max_vertical_cosine(manifold, y, w, ref_norm=manifold.norm(y, v)) < tol
    assert_close_metric(manifold, y, manifold.proju(y, w), w, tol, what="transp is tangent")
    y2, w2 = manifold.retr_transp(x, xi, v)
    assert_close(y2, y, 1e-15, what="retr_transp point")
    assert_close(w2, w, 1e-15, what="retr_transp vector")
    ya, wa = manifold.retr_transp(xa, manifold.act(xi, a), manifold.act(v, a))
    tol = tolerance(manifold, x, y, xa, ya)
    assert_close(manifold.product(ya), manifold.product(y), tol, what="retr equivariance")
    assert_close_metric(manifold, ya, wa, manifold.act(w, a), tol, what="transp equivariance")


# ----------------------------------------------------------------------------- batching
@settings(max_examples=25, deadline=None)
@given(
    setup=setups(batch=batch_shapes().filter(bool), eps=(0.0, 0.25)),
    data=st.data(),
)
def test_batched_results_equal_per_item_results(setup, data):
    manifold, x = setup
    u = data.draw(tangent_vectors(x))
    v = data.draw(tangent_vectors(x))
    xi = with_relative_size(manifold, x, manifold.proju(x, u), 0.1)
    y = manifold.retr(x, xi)
    tol = tolerance(manifold, x, y)
    batched = {
        "inner": manifold.inner(x, u, v),
        "component_inner": manifold.component_inner(x, u, v),
        "proju": manifold.proju(x, u),
        "egrad2rgrad": manifold.egrad2rgrad(x, u),
        "christoffel": manifold.christoffel(x, u),
        "retr": y,
        "expmap": manifold.expmap(x, xi, steps=4),
        "transp": manifold.transp(x, y, v),
    }
    for index in itertools.product(*(range(s) for s in x.shape[:-2])):
        xi_, ui, vi, ti, yi = x[index], u[index], v[index], xi[index], y[index]
        single = {
            "inner": manifold.inner(xi_, ui, vi),
            "component_inner": manifold.component_inner(xi_, ui, vi),
            "proju": manifold.proju(xi_, ui),
            "egrad2rgrad": manifold.egrad2rgrad(xi_, ui),
            "christoffel": manifold.christoffel(xi_, ui),
            "retr": manifold.retr(xi_, ti),
            "expmap": manifold.expmap(xi_, ti, steps=4),
            "transp": manifold.transp(xi_, yi, vi),
        }
        for name, value in single.items():
            assert value.shape == batched[name][index].shape, name
            assert_close(batched[name][index], value, tol, what=f"{name} at {index}")


# ----------------------------------------------------------------------------- sampling
@settings(max_examples=20, deadline=None)
@given(setup=setups(batch=st.just(()), eps=(0.0, 0.25)), data=st.data())
def test_random_tangent_is_a_standard_horizontal_gaussian(setup, data):
    """E|xi|^2 = dim of the quotient and E<xi, e>^2 = 1 for a unit horizontal e.

    Fixed generator seed, so the test is deterministic; the tolerance is 6 standard
    errors of the sample mean (|xi|^2 is chi-square with ``dim`` degrees of freedom).
    """
    manifold, x = setup
    samples = 4000
    dim = manifold.dim(x.shape[-1])
    gen = torch.Generator().manual_seed(1234)
    xs = x.expand(samples, *x.shape)
    xi = manifold.random_tangent(xs, generator=gen)
    assert xi.shape == xs.shape
    # the whitened noise that is projected has metric norm ~ sqrt((n + m) h)
    noise_norm = (x.shape[-2] * x.shape[-1]) ** 0.5
    assert max_vertical_cosine(manifold, xs, xi, ref_norm=noise_norm) < tolerance(manifold, x)
    sq = manifold.inner(xs, xi)
    assert abs(sq.mean().item() - dim) < 6 * math.sqrt(2 * dim / samples), (sq.mean(), dim)
    e = data.draw(horizontal_vectors(manifold, x))
    e = e / manifold.norm(x, e)
    proj2 = manifold.inner(xs, xi, e) ** 2
    assert abs(proj2.mean().item() - 1) < 6 * math.sqrt(2 / samples), proj2.mean()


def test_random_and_origin_are_points():
    manifold = GLQuotient(4, 3, "inv")
    x = manifold.random(2, 7, 2, dtype=F64)
    assert x.manifold is manifold and x.shape == (2, 7, 2)
    manifold.assert_check_point_on_manifold(x)
    o = manifold.origin(7, 3, dtype=F64)
    manifold.assert_check_point_on_manifold(o)
    assert torch.equal(manifold.product(o)[:3, :3], torch.eye(3, dtype=F64))
    assert manifold.dim(2) == (4 + 3) * 2 - 4


# ----------------------------------------------------------------------------- float32
@settings(max_examples=30, deadline=None)
@given(setup=setups(dtype=torch.float32, max_condition=2.0), data=st.data())
def test_float32_projection_metric_and_gradient(setup, data):
    """float32 (unit roundoff 1.2e-7) with :func:`tolerance` for ``unit=UNIT32``; points
    and group elements of condition <= 2, so that ``act(x, A)`` has Gram matrices of
    condition <= 16 and the tolerances (mix 16 * 1000 * 1.2e-7 ~ 2e-3, inv
    16 ** 1.5 * 1000 * 1.2e-7 ~ 8e-3) still reject wrong formulas. The reference is the
    float64 computation on the same (float32-rounded) inputs."""
    manifold, x = setup
    a = gl_for(x, data, max_condition=2.0)
    u = data.draw(tangent_vectors(x))
    v = data.draw(tangent_vectors(x))
    xa, ua, va = (manifold.act(t, a) for t in (x, u, v))
    tol = tolerance(manifold, x, xa, unit=UNIT32)
    x64, u64 = x.double(), u.double()
    p = manifold.proju(x, u)
    assert p.dtype == torch.float32
    assert max_vertical_cosine(manifold, x64, p.double(), manifold.norm(x64, u64)) < tol
    assert_close_metric(manifold, x64, p.double(), manifold.proju(x64, u64), tol, ref=u64)
    assert_close_metric(manifold, x, manifold.proju(x, p), p, tol, ref=u, what="idempotence")
    value = manifold.inner(x, u, v)
    assert value.dtype == torch.float32
    scale = manifold.norm(x, u).max().item() * manifold.norm(x, v).max().item()
    assert_close(value, manifold.inner(x64, u64, v.double()).float(), tol, scale, "inner")
    assert_close(manifold.inner(xa, ua, va), value, tol, scale=scale, what="invariance")
    rgrad = manifold.egrad2rgrad(x, u)
    raised = reference_raise(manifold, x64, u64)
    expected = manifold.egrad2rgrad(x64, u64)
    assert_close_metric(manifold, x64, rgrad.double(), expected, tol, ref=raised, what="rgrad")
    gamma = manifold.christoffel(x, u).double()
    assert_close_metric(manifold, x64, gamma, manifold.christoffel(x64, u64), tol, what="Gamma")


# ----------------------------------------------------------------------------- half precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("metric", METRICS)
def test_half_precision_inputs_give_finite_results_of_the_input_dtype(dtype, metric):
    """The h x h algebra runs in float32, so the only error is the final rounding
    to the input dtype (unit roundoff eps / 2: 4.9e-4 for float16, 3.9e-3 for bfloat16)."""
    manifold = GLQuotient(6, 5, metric)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 11, 4, generator=gen).to(dtype)
    u = torch.randn(3, 11, 4, generator=gen).to(dtype)
    unit = torch.finfo(dtype).eps / 2
    for name in ("proju", "egrad2rgrad", "christoffel", "retr"):
        out = getattr(manifold, name)(x, u)
        assert out.dtype == dtype, name
        assert torch.isfinite(out).all(), name
        exact = getattr(manifold, name)(x.double(), u.double())
        assert_close(out.double(), exact, 8 * unit, what=name)
    value = manifold.inner(x, u)
    assert value.dtype == dtype and torch.isfinite(value).all()
    assert_close(value.double(), manifold.inner(x.double(), u.double()), 8 * unit)


# ----------------------------------------------------------------------------- bad input
def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="metric"):
        GLQuotient(3, 2, "euclidean")
    with pytest.raises(TypeError, match="metric"):
        GLQuotient(3, 2, metric=1)
    with pytest.raises(TypeError, match="`n`"):
        GLQuotient(3.0, 2)
    with pytest.raises(TypeError, match="`m`"):
        GLQuotient(3, "2")
    with pytest.raises(TypeError, match="`n`"):
        GLQuotient(True, 2)
    with pytest.raises(ValueError, match="`m`"):
        GLQuotient(3, 0)
    with pytest.raises(ValueError, match="eps"):
        GLQuotient(3, 2, eps=-0.1)
    with pytest.raises(ValueError, match="eps"):
        GLQuotient(3, 2, eps=float("nan"))
    with pytest.raises(ValueError, match="retraction"):
        GLQuotient(3, 2, retraction="third_order")
    with pytest.raises(ValueError, match="expmap_steps"):
        GLQuotient(3, 2, expmap_steps=0)
    with pytest.raises(TypeError, match="steps"):
        GLQuotient(3, 2).expmap(torch.ones(5, 1), torch.ones(5, 1), steps=2.5)


def test_shape_errors_name_the_problem():
    manifold = GLQuotient(3, 2)
    # rank larger than min(n, m)
    with pytest.raises(ValueError, match=r"rank h = 3.*min\(n, m\) = 2"):
        manifold.random(5, 3)
    ok, reason = manifold.check_point(torch.randn(5, 3), explain=True)
    assert not ok and "rank h = 3" in reason
    # wrong number of rows
    with pytest.raises(ValueError, match=r"n \+ m"):
        manifold.random(4, 2)
    ok, reason = manifold.check_point_on_manifold(torch.randn(2, 6, 2), explain=True)
    assert not ok and "(..., n + m, h)" in reason
    with pytest.raises(ValueError, match="`x`"):
        manifold.assert_check_point_on_manifold(torch.randn(6, 2))
    ok, reason = manifold.check_vector(torch.randn(4, 1), explain=True)
    assert not ok and "`u`" in reason
    assert manifold.check_point(torch.randn(4, 5, 2))


def test_rank_deficient_factors_are_rejected_unless_relaxed():
    manifold = GLQuotient(3, 3)
    x = torch.randn(6, 2, dtype=F64)
    assert manifold.check_point_on_manifold(x)
    x[:3, 1] = 2 * x[:3, 0]  # G has rank 1
    ok, reason = manifold.check_point_on_manifold(x, explain=True)
    assert not ok
    assert "G is rank-deficient" in reason and "eps > 0" in reason
    with pytest.raises(ValueError, match="rank-deficient"):
        manifold.assert_check_point_on_manifold(x)
    x[:3] = 0.0  # G = 0
    assert not manifold.check_point_on_manifold(x)
    y = torch.randn(6, 2, dtype=F64)
    y[3:, 0] = 0.0  # H has a zero column
    ok, reason = manifold.check_point_on_manifold(y, explain=True)
    assert not ok and "H is rank-deficient" in reason
    relaxed = GLQuotient(3, 3, eps=1e-3)
    assert relaxed.check_point_on_manifold(x)
    relaxed.assert_check_point_on_manifold(y)


@pytest.mark.parametrize("metric", METRICS)
def test_relaxed_geometry_is_finite_and_horizontal_at_rank_deficient_points(metric):
    """With eps > 0 a rank-deficient point is usable: every operation is finite and the
    projection is still the metric-orthogonal projection."""
    manifold = GLQuotient(4, 3, metric, eps=0.1)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 3, generator=gen, dtype=F64)
    x[0, :4, 2] = x[0, :4, 0] - x[0, :4, 1]  # G rank-deficient
    x[1, :4, 2] = x[1, :4, 0]  # both factors rank-deficient
    x[1, 4:, 1] = 0.0
    u = torch.randn(2, 7, 3, generator=gen, dtype=F64)
    p = manifold.proju(x, u)
    assert torch.isfinite(p).all()
    # orthogonal to every vertical vector (some of them vanish at the degenerate x[1])
    k = x.shape[-1]
    for i, j in itertools.product(range(k), range(k)):
        omega = torch.zeros(k, k, dtype=F64)
        omega[i, j] = 1.0
        vert = vertical(manifold, x, omega)
        scale = manifold.norm(x, p) * manifold.norm(x, vert) + 1e-12
        assert (manifold.inner(x, p, vert).abs() <= 1e-9 * scale).all()
    assert_close(manifold.proju(x, p), p, 1e-10, what="idempotence")
    for name in ("egrad2rgrad", "christoffel", "retr"):
        assert torch.isfinite(getattr(manifold, name)(x, u)).all(), name
    assert torch.isfinite(manifold.expmap(x, 0.1 * p, steps=4)).all()


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_geodesic_through_a_rank_loss_raises_the_domain_error(metric):
    """An RK4 stage at which a factor loses rank (here: one column of both factors exactly
    zero at the first midpoint) raises GeodesicDomainError, as a rank loss found at the
    end does, not the LinAlgError of inverting its failed Cholesky factor."""
    from geoopt_quotient import GeodesicDomainError

    manifold = GLQuotient(n=3, m=3, metric=metric)
    x = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    u = torch.zeros_like(x)
    u[:, 1] = -2 * x[:, 1]  # x + u / 2, the first midpoint with dt = 1, has a zero column
    with pytest.raises(GeodesicDomainError, match="lost rank"):
        manifold.expmap(x, u, steps=1)
    assert torch.isfinite(manifold.expmap(x, 0.1 * u, steps=8)).all()


@pytest.mark.parametrize("scale", [1e-300, 1.0, 1e300])
def test_point_check_is_scale_free_up_to_the_float64_range(scale):
    """A full-rank factor stays full rank, and a rank-deficient one rank-deficient, at any
    scale of its entries: the Gram matrix of entries near 1e300 must not overflow."""
    manifold = GLQuotient(3, 3, "mix")
    g = torch.tensor([[2.0, 0.3, 1.1], [0.7, 0.1, -0.2], [-0.2, 0.8, -0.2]], dtype=torch.float64)
    full = torch.cat([g * scale, g / scale])  # G H^T unchanged
    assert manifold.check_point_on_manifold(full)
    deficient = full.clone()
    deficient[:3, 2] = deficient[:3, 0]
    ok, reason = manifold.check_point_on_manifold(deficient, explain=True)
    assert not ok and "rank-deficient" in reason
