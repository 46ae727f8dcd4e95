"""Property-based tests of :class:`RotaryGLQuotient`: the quotient by the subgroup
:math:`(\\mathbb{C}^*)^{r/2} \\times \\mathrm{GL}(h - r)` of :math:`\\mathrm{GL}(h)` that
commutes with rotary rotations.

Every check is against an independent reference written here (the subgroup's vertical
vectors built from the Lie algebra's elementary matrices, the Levi-Civita connection by
autograd, explicit rotation matrices), never against the code under test. Tolerances
follow tests/test_gl_quotient.py: ``1000 * unit * cond ** p``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gl_quotient import (
    assert_close_metric,
    euclidean_dot,
    reference_christoffel,
    tolerance,
    vertical,
    with_relative_size,
)

from geoopt_quotient import GLQuotient, RotaryGLQuotient
from geoopt_quotient.testing import batch_shapes, gl_points, tangent_vectors

F64 = torch.float64
pytestmark = [pytest.mark.usefixtures("single_thread")]


@st.composite
def setups(draw, eps=(0.0,), batch=None, max_condition=1e2, max_size=6):
    """A random ``RotaryGLQuotient`` (full or partial rotary, both pairings) and a point."""
    h = draw(st.integers(2, 4))
    r = 2 * draw(st.integers(1, h // 2))
    n = draw(st.integers(h, max_size))
    m = draw(st.integers(h, max_size))
    manifold = RotaryGLQuotient(
        n,
        m,
        r,
        draw(st.sampled_from(("half", "interleaved"))),
        draw(st.sampled_from(("inv", "mix"))),
        draw(st.sampled_from(eps)),
    )
    batch = batch_shapes(max_dims=1) if batch is None else batch
    return manifold, draw(gl_points(manifold, batch, h, max_condition))


def element_for(manifold, x, data, max_condition=10.0):
    seed = data.draw(st.integers(0, 2**31))
    generator = torch.Generator().manual_seed(seed)
    return manifold.random_element(
        x.shape[:-2], h=x.shape[-1], max_condition=max_condition, generator=generator
    )


def rotations(manifold, h, angles):
    """Block rotations of a rotary embedding: one plane per pair of dims, identity elsewhere."""
    first, second = manifold.planes()
    out = torch.eye(h, dtype=F64).repeat(len(angles), 1, 1)
    cos, sin = torch.cos(angles)[:, None], torch.sin(angles)[:, None]
    freqs = 10.0 ** -torch.arange(len(first), dtype=F64)  # distinct frequencies
    cos, sin = torch.cos(angles[:, None] * freqs), torch.sin(angles[:, None] * freqs)
    out[:, first, first], out[:, second, second] = cos, cos
    out[:, second, first], out[:, first, second] = sin, -sin
    return out


def algebra_basis(manifold, h):
    """A basis of the subgroup's Lie algebra, written from its definition."""
    first, second = manifold.planes()
    basis = []
    for j, k in zip(first.tolist(), second.tolist()):
        a = torch.zeros(h, h, dtype=F64)
        a[j, j] = a[k, k] = 1
        b = torch.zeros(h, h, dtype=F64)
        b[k, j], b[j, k] = 1, -1
        basis += [a, b]
    r = manifold.rotary_dim
    for i in range(r, h):
        for j in range(r, h):
            e = torch.zeros(h, h, dtype=F64)
            e[i, j] = 1
            basis.append(e)
    return torch.stack(basis)


def max_subgroup_vertical_cosine(manifold, x, u, ref_norm=None):
    """Largest |<u, v(E)>| / (|ref| |v(E)|) over the algebra basis; 0 iff u is horizontal."""
    basis = algebra_basis(manifold, x.shape[-1])
    xe, ue = x.unsqueeze(-3), u.unsqueeze(-3)
    v = vertical(manifold, xe, basis)
    ref = manifold.norm(xe, ue) if ref_norm is None else ref_norm.unsqueeze(-1)
    return (manifold.inner(xe, ue, v) / (ref * manifold.norm(xe, v))).abs().max().item()


def subgroup_vertical_residual(manifold, x, r):
    """Distance of ``r`` from v(s): least squares in the algebra's coordinates."""
    basis = algebra_basis(manifold, x.shape[-1])
    columns = vertical(manifold, x.unsqueeze(-3), basis)  # (..., d, n+m, h)
    design = columns.flatten(-2).mT
    coef = torch.linalg.lstsq(design, r.flatten(-2).unsqueeze(-1)).solution
    fit = (design @ coef).squeeze(-1).reshape(r.shape)
    return (fit - r).abs().max().item()


# ----------------------------------------------------------------------------- the group
@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_random_elements_commute_with_every_rotary_rotation(setup, data):
    manifold, x = setup
    h = x.shape[-1]
    a = element_for(manifold, x, data)
    rot = rotations(manifold, h, torch.linspace(-3, 7, 5, dtype=F64))
    a = a.reshape(-1, 1, h, h)
    assert_close(a @ rot, rot @ a, 1e-13, what="commutation")
    assert (GLQuotient.condition_number(a) <= 10.0 * (1 + 1e-9)).all()
    assert_close(manifold.project_algebra(a), a, 1e-15, what="a in the algebra's pattern")


def test_a_general_matrix_does_not_commute_with_the_rotations():
    """The negative: GL(h) is not a symmetry of rotary attention."""
    manifold = RotaryGLQuotient(4, 4, 2, "half")
    a = torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    rot = rotations(manifold, 3, torch.tensor([0.7], dtype=F64))[0]
    assert (a @ rot - rot @ a).abs().max() > 0.1


# ----------------------------------------------------------------------------- projection
@settings(max_examples=40, deadline=None)
@given(setup=setups(eps=(0.0, 0.25)), data=st.data())
def test_proju_is_the_metric_orthogonal_projection_for_the_subgroup(setup, data):
    manifold, x = setup
    u = data.draw(tangent_vectors(x))
    tol = tolerance(manifold, x)
    p = manifold.proju(x, u)
    assert max_subgroup_vertical_cosine(manifold, x, p, ref_norm=manifold.norm(x, u)) < tol
    assert subgroup_vertical_residual(manifold, x, u - p) <= tol * u.abs().max().item()
    assert_close_metric(manifold, x, manifold.proju(x, p), p, tol, ref=u, what="idempotence")
    assert manifold.check_vector_on_tangent(x, p, atol=tol * u.abs().max().item(), rtol=tol)
    basis = algebra_basis(manifold, x.shape[-1])
    omega = (torch.randn(basis.shape[0], dtype=F64)[:, None, None] * basis).sum(0)
    v = vertical(manifold, x, omega)
    zero = torch.zeros_like(v)
    assert_close_metric(manifold, x, manifold.proju(x, v), zero, tol, ref=v, what="vertical")


@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_subgroup_horizontal_vectors_are_not_gl_horizontal(setup, data):
    """The projection is not GL(h)'s: its output has components along gl(h)'s other
    vertical directions (so applying GLQuotient's projection would remove too much)."""
    manifold, x = setup
    h = x.shape[-1]
    if manifold.dim(h) == GLQuotient.dim(manifold, h):
        return
    p = manifold.proju(x, data.draw(tangent_vectors(x)))
    full = GLQuotient(manifold.n, manifold.m, manifold.metric, manifold.eps)
    removed = p - full.proju(x, p)
    assert (manifold.norm(x, removed) > 1e-6 * manifold.norm(x, p)).all()
    assert not full.check_vector_on_tangent(x, p)


@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_proju_is_equivariant_and_the_metric_invariant(setup, data):
    manifold, x = setup
    a = element_for(manifold, x, data)
    u, w = data.draw(tangent_vectors(x)), data.draw(tangent_vectors(x))
    xa, ua, wa = manifold.act(x, a), manifold.act(u, a), manifold.act(w, a)
    tol = tolerance(manifold, x, xa)
    assert_close(manifold.inner(xa, ua, wa), manifold.inner(x, u, w), tol, what="metric")
    expected = manifold.act(manifold.proju(x, u), a)
    assert_close_metric(manifold, xa, manifold.proju(xa, ua), expected, tol, ref=ua, what="proju")


@settings(max_examples=20, deadline=None)
@given(setup=setups(), data=st.data())
def test_equivariance_fails_for_a_general_gl_element(setup, data):
    """The negative: a generic GL(h) element does not map horizontal spaces to each other."""
    manifold, x = setup
    h = x.shape[-1]
    if manifold.rotary_dim == 2 and h == 2:
        return  # C* is GL(1, C) acting on the only plane; need two dims outside it
    a = torch.eye(h, dtype=F64) + 0.5 * torch.randn(h, h, dtype=F64)
    a[0, -1] += 1.0  # couples a rotary dimension with another one
    p = manifold.proju(x, data.draw(tangent_vectors(x)))
    xa, pa = manifold.act(x, a), manifold.act(p, a)
    assert (manifold.norm(xa, pa - manifold.proju(xa, pa)) > 1e-6 * manifold.norm(xa, pa)).any()


@settings(max_examples=20, deadline=None)
@given(setup=setups(batch=st.just(())), data=st.data())
def test_dimension_is_the_rank_of_the_projection(setup, data):
    manifold, x = setup
    size = x.numel()
    eye = torch.eye(size, dtype=F64).reshape(size, *x.shape)
    images = manifold.proju(x.expand_as(eye), eye).reshape(size, size)
    assert torch.linalg.matrix_rank(images).item() == manifold.dim(x.shape[-1])


# ----------------------------------------------------------------------------- gradient
@settings(max_examples=30, deadline=None)
@given(setup=setups(), data=st.data())
def test_egrad2rgrad_represents_the_directional_derivative(setup, data):
    """For a loss invariant under the subgroup only (attention scores under a rotary
    rotation), <rgrad, xi> = D f[xi] for horizontal xi, and rgrad is horizontal."""
    manifold, x = setup
    h = x.shape[-1]
    rot = rotations(manifold, h, torch.tensor([0.9], dtype=F64))[0]

    def loss(p):
        g, hh = manifold.factors(p)
        return torch.sin(g @ rot @ hh.mT).sum()

    xr = x.clone().requires_grad_(True)
    (egrad,) = torch.autograd.grad(loss(xr), xr)
    rgrad = manifold.egrad2rgrad(x, egrad)
    xi = manifold.proju(x, data.draw(tangent_vectors(x)))
    tol = tolerance(manifold, x)
    scale = (manifold.norm(x, rgrad) * manifold.norm(x, xi)).max().item()
    assert_close(manifold.inner(x, rgrad, xi), euclidean_dot(egrad, xi), tol, scale=scale)
    assert max_subgroup_vertical_cosine(manifold, x, rgrad) < tol
    # the loss is invariant under the subgroup, not under GL(h): egrad has no s-vertical part
    a = element_for(manifold, x, data)
    assert_close(loss(manifold.act(x, a)), loss(x), tol * 10, what="loss invariance")


# ----------------------------------------------------------------------------- geodesics
@settings(max_examples=25, deadline=None)
@given(setup=setups(eps=(0.0, 0.25)), data=st.data())
def test_christoffel_is_the_total_space_connection_on_subgroup_horizontal_vectors(setup, data):
    """GLQuotient's Gamma is the Levi-Civita connection of the total space for every
    vector, so it holds for vectors horizontal for the subgroup but not for GL(h)."""
    manifold, x = setup
    xi = manifold.proju(x, data.draw(tangent_vectors(x)))
    tol = tolerance(manifold, x)
    expected = reference_christoffel(manifold, x, xi)
    assert_close(manifold.christoffel(x, xi), expected, tol, what="christoffel")


@settings(max_examples=20, deadline=None)
@given(setup=setups(max_condition=30.0), data=st.data())
def test_geodesic_stays_horizontal_with_constant_speed(setup, data):
    manifold, x = setup
    xi = with_relative_size(manifold, x, manifold.proju(x, data.draw(tangent_vectors(x))), 0.2)
    speed0 = manifold.inner(x, xi)
    for t in (0.5, 1.0):
        pos, vel = manifold.geodesic(x, xi, t, steps=32)
        assert max_subgroup_vertical_cosine(manifold, pos, vel) < 1e-6
        assert_close(manifold.inner(pos, vel), speed0, 1e-6, what=f"speed at t={t}")


@settings(max_examples=20, deadline=None)
@given(setup=setups(), data=st.data())
def test_geodesic_and_retraction_are_equivariant(setup, data):
    manifold, x = setup
    a = element_for(manifold, x, data)
    xi = with_relative_size(manifold, x, manifold.proju(x, data.draw(tangent_vectors(x))), 0.2)
    xa, xia = manifold.act(x, a), manifold.act(xi, a)
    tol = tolerance(manifold, x, xa)
    pos, vel = manifold.geodesic(x, xi, 1.0, steps=8)
    pos_a, vel_a = manifold.geodesic(xa, xia, 1.0, steps=8)
    assert_close(manifold.product(pos_a), manifold.product(pos), tol, what="G(t)H(t)^T")
    assert_close_metric(manifold, pos_a, vel_a, manifold.act(vel, a), tol, what="velocity")
    ret, ret_a = manifold.retr(x, xi), manifold.retr(xa, xia)
    assert_close(manifold.product(ret_a), manifold.product(ret), tol, what="retraction")


@settings(max_examples=20, deadline=None)
@given(setup=setups(batch=batch_shapes(max_dims=1).filter(bool)), data=st.data())
def test_cached_tangent_space_and_slices_agree_with_the_methods(setup, data):
    """The sharpness engine's path (a cached tangent space, fused in-place conversions)
    gives what the public methods give."""
    manifold, x = setup
    u = data.draw(tangent_vectors(x))
    space = manifold.tangent_space(x)
    tol = tolerance(manifold, x)
    assert_close(space.proju(u), manifold.proju(x, u), tol, what="proju")
    expected = manifold.egrad2rgrad(x, u)
    assert_close(space.egrad2rgrad_(u.clone()), expected, tol, what="egrad2rgrad_")
    z = space.random(torch.Generator().manual_seed(0))
    assert max_subgroup_vertical_cosine(manifold, x, z) < tol


def test_constructor_and_shape_errors():
    with pytest.raises(ValueError, match="even"):
        RotaryGLQuotient(4, 4, 3)
    with pytest.raises(ValueError, match="pairing"):
        RotaryGLQuotient(4, 4, 2, "zigzag")
    manifold = RotaryGLQuotient(4, 4, 4)
    ok, reason = manifold._check_shape((8, 2), "x")
    assert not ok and "rotary_dim" in reason
    assert manifold.dim(4) == 8 * 4 - 4
    assert RotaryGLQuotient(5, 5, 2).dim(3) == 10 * 3 - 2 - 1


@settings(max_examples=20, deadline=None)
@given(setup=setups(max_condition=10.0), data=st.data())
def test_float32_projection_matches_float64(setup, data):
    """float32 points get their small systems solved in float64 (as GLQuotient does)."""
    manifold, x = setup
    u = data.draw(tangent_vectors(x))
    p32 = manifold.proju(x.float(), u.float())
    assert p32.dtype == torch.float32
    tol = tolerance(manifold, x, unit=torch.finfo(torch.float32).eps)
    p64 = manifold.proju(x, u)
    assert_close_metric(manifold, x, p32.double(), p64, tol, ref=u, what="float32 proju")


def test_schur_system_built_a_few_heads_at_a_time_is_the_same(monkeypatch):
    from geoopt_quotient.manifolds import rotary_quotient

    manifold = RotaryGLQuotient(7, 6, 2, "interleaved", "inv")
    x = manifold.random(3, 2, 7 + 6, 4, dtype=F64)
    u = torch.randn_like(x)
    whole = manifold.proju(x, u)
    monkeypatch.setattr(rotary_quotient, "SCHUR_CHUNK_ENTRIES", 1)  # one head per chunk
    assert_close(manifold.proju(x, u), whole, 1e-13, what="chunked")
