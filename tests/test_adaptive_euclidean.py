"""Property-based tests of :class:`AdaptiveEuclidean` (metric sum eta nu / c^2, c = |w| + eps).

Points have random signs, magnitudes log-uniform in [1e-2, 10] and, for about a third
of the entries, exact zeros (frozen when ``eps = 0``). Everything is element-wise, so
float64 results are exact to a few units of roundoff (tolerance 1e-12); see
:func:`test_expmap_is_a_constant_speed_geodesic` for the finite-difference tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from geoopt_quotient import AdaptiveEuclidean
from geoopt_quotient.manifolds import adaptive

F64 = torch.float64
SEEDS = st.integers(0, 2**32 - 1)
RTOL = 1e-12
EPS_VALUES = (0.0, 0.1, 1.0)


pytestmark = [pytest.mark.on_device, pytest.mark.usefixtures("single_thread")]


@st.composite
def weights(draw, shape=None, zero_fraction=0.3):
    """Weights with random signs and magnitudes, and about ``zero_fraction`` exact zeros."""
    if shape is None:
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    gen = torch.Generator().manual_seed(draw(SEEDS))
    mag = torch.exp(
        torch.empty(shape, dtype=F64).uniform_(math.log(1e-2), math.log(10.0), generator=gen)
    )
    sign = torch.randint(0, 2, shape, generator=gen).to(F64) * 2 - 1
    keep = torch.rand(shape, generator=gen, dtype=F64) >= zero_fraction
    return torch.where(keep, sign * mag, torch.zeros_like(mag))


@st.composite
def setups(draw, eps=EPS_VALUES):
    x = draw(weights())
    ndim = draw(st.integers(0, x.dim()))
    return AdaptiveEuclidean(eps=draw(st.sampled_from(eps)), ndim=ndim), x


def noise(data, x, scale=1.0):
    gen = torch.Generator().manual_seed(data.draw(SEEDS))
    return torch.randn(x.shape, generator=gen, dtype=F64) * scale


def reduce(manifold, value, keepdim=False):
    if manifold.ndim == 0:
        return value
    return value.sum(dim=tuple(range(-manifold.ndim, 0)), keepdim=keepdim)


def frozen(manifold, x):
    return (x.abs() + manifold.eps) == 0


# ----------------------------------------------------------------------------- metric
@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_inner_matches_definition_and_ignores_frozen_entries(setup, data):
    manifold, x = setup
    u, v = noise(data, x), noise(data, x)  # not projected: non-zero on frozen entries
    c2 = (x.abs() + manifold.eps) ** 2
    per_entry = torch.where(c2 > 0, u * v / torch.where(c2 > 0, c2, 1.0), 0.0)
    value = manifold.inner(x, u, v)
    expected = reduce(manifold, per_entry)
    assert value.shape == expected.shape
    scale = reduce(manifold, per_entry.abs()).max().item() if per_entry.numel() else 0.0
    assert_close(value, expected, RTOL, scale, "inner")
    assert_close(manifold.inner(x, v, u), value, RTOL, scale, "symmetry")
    keep = manifold.inner(x, u, v, keepdim=True)
    assert keep.shape == x.shape[: x.dim() - manifold.ndim] + (1,) * manifold.ndim
    assert_close(manifold.component_inner(x, u, v), keep, RTOL, scale, "component_inner")
    assert torch.isfinite(manifold.norm(x, u)).all()
    # positive definite on the tangent space (which is zero on frozen entries)
    p = manifold.proju(x, u)
    nonzero = reduce(manifold, (p != 0).to(F64)) > 0
    assert (manifold.inner(x, p)[nonzero] > 0).all()
    if manifold.eps == 0:
        assert (p[frozen(manifold, x)] == 0).all()


@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_egrad2rgrad_represents_the_directional_derivative(setup, data):
    manifold, x = setup
    mixing = noise(data, x)
    xr = x.clone().requires_grad_(True)
    (egrad,) = torch.autograd.grad((torch.sin(xr) * mixing + xr**2).sum(), xr)
    rgrad = manifold.egrad2rgrad(x, egrad)
    assert torch.isfinite(rgrad).all()
    assert_close(rgrad, egrad * (x.abs() + manifold.eps) ** 2, RTOL, what="c^2 grad")
    assert (rgrad[frozen(manifold, x)] == 0).all()
    xi = manifold.proju(x, noise(data, x))
    dot = reduce(manifold, egrad * xi)
    scale = reduce(manifold, (egrad * xi).abs()).max().item()
    assert_close(manifold.inner(x, rgrad, xi), dot, RTOL, scale, "<rgrad, xi> = df(xi)")


@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_projection_freezes_exactly_the_zero_scale_entries(setup, data):
    manifold, x = setup
    u = noise(data, x)
    p = manifold.proju(x, u)
    mask = frozen(manifold, x)
    assert torch.equal(p, torch.where(mask, torch.zeros_like(u), u))
    assert torch.equal(manifold.proju(x, p), p)
    assert manifold.check_vector_on_tangent(x, p)
    if bool(mask.any()):
        ok, reason = manifold.check_vector_on_tangent(x, u, explain=True)
        assert not ok and "frozen" in reason
    # random tangent vectors and transported vectors are tangent too
    assert manifold.check_vector_on_tangent(
        x, manifold.random_tangent(x, generator=torch.Generator().manual_seed(0))
    )
    y = manifold.retr(x, p)
    assert torch.equal(y, x + p)
    assert torch.equal(y[mask], x[mask])  # frozen entries do not move
    y2, w = manifold.retr_transp(x, p, u)
    assert torch.equal(y2, y)
    assert torch.equal(w, manifold.proju(y, u))


# ----------------------------------------------------------------------------- expmap
@settings(max_examples=40, deadline=None)
@given(x=weights(), data=st.data())
def test_expmap_without_offset_is_w_exp_xi_over_w(x, data):
    manifold = AdaptiveEuclidean(eps=0.0)
    xi = noise(data, x) * x.abs()  # rates xi / w of order one
    safe = torch.where(x == 0, torch.ones_like(x), x)
    expected = torch.where(x == 0, torch.zeros_like(x), x * torch.exp(xi / safe))
    assert_close(manifold.expmap(x, xi), expected, RTOL, what="w exp(xi / w)")
    # arbitrary values on frozen entries give no NaN and move nothing
    wild = xi + torch.where(x == 0, torch.full_like(x, 5.0), torch.zeros_like(x))
    y = manifold.expmap(x, wild)
    assert torch.isfinite(y).all()
    assert (y[x == 0] == 0).all()
    assert (torch.sign(y) == torch.sign(x)).all()  # a zero-free geodesic keeps its sign


@settings(max_examples=40, deadline=None)
@given(setup=setups(), data=st.data())
def test_expmap_is_a_constant_speed_geodesic(setup, data):
    r"""In one dimension a curve is a geodesic iff it has constant metric speed; the
    metric is a product, so :math:`|\dot w_i(t)| / c(w_i(t))` must equal
    :math:`|\xi_i| / c(w_i)` for every entry and every t. Derivatives by central finite
    differences with step h; rates :math:`|\xi| / c` up to 3 make ``eps > 0`` geodesics
    cross zero, where :math:`c = |w| + \varepsilon` has a kink and the geodesic is only
    :math:`C^1`, so the difference quotient is first-order accurate there: relative error
    about h * rate <= 3e-5, hence the tolerance 1e-4 (a wrong geodesic is off by O(1))."""
    manifold, x = setup
    c = x.abs() + manifold.eps
    xi = manifold.proju(x, noise(data, x) * c)
    speed0 = (xi.abs() / torch.where(c > 0, c, 1.0)).clamp_max(3.0)
    xi = torch.sign(xi) * speed0 * c
    # exactly x for eps = 0; through log1p / expm1 (a few ulps) for eps > 0
    assert_close(manifold.expmap(x, torch.zeros_like(x)), x, RTOL, what="expmap(x, 0)")
    h = 1e-5
    fd_tol = 1e-4
    for t in (0.0, 0.5, 1.0):
        pos = manifold.expmap(x, t * xi)
        vel = (manifold.expmap(x, (t + h) * xi) - manifold.expmap(x, (t - h) * xi)) / (2 * h)
        if t == 0:
            assert_close(vel, xi, fd_tol, scale=1e-12, what="initial velocity")
        c_t = pos.abs() + manifold.eps
        speed = torch.where(c_t > 0, vel.abs() / torch.where(c_t > 0, c_t, 1.0), 0.0)
        assert_close(speed, speed0, fd_tol, scale=1.0, what=f"speed at t={t}")
        # the metric speed of the whole curve: |gamma'|^2_gamma = |xi|^2_x
        assert_close(manifold.inner(pos, vel), manifold.inner(x, xi), 2 * fd_tol, what="speed^2")


@settings(max_examples=25, deadline=None)
@given(x=weights(shape=(6,), zero_fraction=0.0), data=st.data())
def test_expmap_is_a_geodesic_by_autograd(x, data):
    r"""The geodesic equation :math:`\ddot w = \operatorname{sign}(w)\,\dot w^2 / c(w)` of
    the metric :math:`dw^2 / c(w)^2` (no zero weights: the equation is singular there)."""
    manifold = AdaptiveEuclidean(eps=data.draw(st.sampled_from((0.0, 0.3))))
    c = x.abs() + manifold.eps
    xi = noise(data, x) * c * 0.5

    def velocity(t):
        return torch.func.jvp(lambda s: manifold.expmap(x, s * xi), (t,), (torch.ones_like(t),))

    t = torch.tensor(0.7, dtype=F64)
    (pos, vel), (_, acc) = torch.func.jvp(velocity, (t,), (torch.ones_like(t),))
    expected = torch.sign(pos) * vel**2 / (pos.abs() + manifold.eps)
    assert_close(acc, expected, 1e-10, scale=expected.abs().max().item(), what="geodesic ODE")


# ----------------------------------------------------------------------------- sampling
@settings(max_examples=20, deadline=None)
@given(x=weights(shape=(7,)), eps=st.sampled_from(EPS_VALUES))
def test_random_tangent_is_a_standard_gaussian_on_the_free_entries(x, eps):
    """E|xi|^2 = number of free entries; 6 standard errors of the mean, fixed seed."""
    manifold = AdaptiveEuclidean(eps=eps, ndim=1)
    samples = 4000
    xs = x.expand(samples, *x.shape)
    xi = manifold.random_tangent(xs, generator=torch.Generator().manual_seed(11))
    assert torch.isfinite(xi).all()
    mask = frozen(manifold, xs)
    assert (xi[mask] == 0).all()
    free = int((~frozen(manifold, x)).sum())
    sq = manifold.inner(xs, xi)
    tol = 6 * math.sqrt(2 * max(free, 1) / samples)
    assert abs(sq.mean().item() - free) < tol, (sq.mean(), free)


# ----------------------------------------------------------------------------- dtypes, errors
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_is_finite_and_keeps_the_dtype(dtype):
    manifold = AdaptiveEuclidean(eps=0.0, ndim=1)
    x = torch.tensor([[0.5, 0.0, -2.0], [0.1, 3.0, 0.0]], dtype=dtype)
    u = torch.tensor([[1.0, 1.0, -1.0], [0.5, 2.0, 4.0]], dtype=dtype)
    for value in (
        manifold.inner(x, u),
        manifold.egrad2rgrad(x, u),
        manifold.expmap(x, manifold.proju(x, u) * 0.1),
        manifold.random_tangent(x),
    ):
        assert value.dtype == dtype and torch.isfinite(value).all()
    expected = manifold.inner(x.double(), u.double())
    unit = torch.finfo(dtype).eps
    assert_close(manifold.inner(x, u).double(), expected, 8 * unit, what="inner")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_tangent_space_keeps_nothing_of_the_points_size_and_is_exact(dtype, eps, monkeypatch):
    """The cached tangent space recomputes c^2 and 1/c^2 block by block (several blocks
    here, the last one ragged): bitwise as the whole-tensor formulas, except its inner
    product of tangent vectors, summed block by block as (u / c) . (v / c)."""
    monkeypatch.setattr(adaptive, "BLOCK", 100)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 53, generator=gen, dtype=F64)
    x[:, ::3] = 0.0
    x = x.to(dtype)
    u, v = (torch.randn(x.shape, generator=gen, dtype=F64).to(dtype) for _ in range(2))
    manifold = AdaptiveEuclidean(eps=eps)
    space = manifold.tangent_space(x)
    work = torch.float32 if dtype == torch.bfloat16 else dtype
    c2 = (x.to(work).abs() + eps).pow(2)
    weight = torch.where(c2 > 0, c2.reciprocal(), torch.zeros_like(c2))
    tu, tv = space.proju(u), space.proju(v)
    for a, b in ((tu, tv), (tu, tu)):
        terms = weight.double() * a.double() * b.double()
        assert_close(
            space.inner(a, b).double(),
            terms.sum(),
            8 * torch.finfo(dtype).eps,
            scale=terms.abs().sum().item(),
            what="tangent-space inner",
        )
    assert torch.equal(space.egrad2rgrad(u), (u.to(work) * c2).to(dtype))
    assert torch.equal(space.egrad2rgrad(u), manifold.egrad2rgrad(x, u))
    assert not [t for t in vars(space.state).values() if isinstance(t, torch.Tensor) and t is not x]
    wide = torch.randn(3, *x.shape, generator=gen, dtype=F64).to(dtype)  # broadcasts: whole
    expected = (weight * wide.to(work) * wide.to(work)).to(dtype)
    assert torch.equal(manifold.inner(x, wide), expected)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="eps"):
        AdaptiveEuclidean(eps=-1e-3)
    with pytest.raises(ValueError, match="eps"):
        AdaptiveEuclidean(eps=float("inf"))
    with pytest.raises(TypeError, match="eps"):
        AdaptiveEuclidean(eps="0.1")
    for ndim in (-1, 1.5, True):
        with pytest.raises(ValueError, match="ndim"):
            AdaptiveEuclidean(ndim=ndim)
    manifold = AdaptiveEuclidean()
    ok, reason = manifold.check_point_on_manifold(torch.tensor([1.0, float("nan")]), explain=True)
    assert not ok and "non-finite" in reason
    assert manifold.check_point_on_manifold(torch.tensor([1.0, 0.0]))
