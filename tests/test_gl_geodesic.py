"""The exponential map of GLQuotient's tangent space, integrated in the span of its start,
is the reference's RK4."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import geoopt_quotient as gq
from geoopt_quotient.manifolds import GeodesicDomainError, _gl_geodesic, _linalg
from geoopt_quotient.manifolds.tangent import TangentSpace

pytestmark = [pytest.mark.on_device, pytest.mark.usefixtures("single_thread")]


def case(manifold, batch, rank, seed, scale, zero_rows=False):
    """A float64 point (optionally with zero rows at the end of both factors, as a
    stack's padding), a horizontal vector of metric norm ``scale`` per point, and the
    batched and the reference tangent spaces."""
    generator = torch.Generator().manual_seed(seed)
    n, m = manifold.n, manifold.m
    x, noise = (
        torch.randn(*batch, n + m, rank, generator=generator, dtype=torch.float64) for _ in range(2)
    )
    if zero_rows:
        for t in (x, noise):
            t[..., n - 1, :] = 0
            t[..., n + m - 1, :] = 0
    u = manifold.proju(x, noise)
    u = scale * u / manifold.norm(x, u, keepdim=True).clamp_min(1e-300)
    return x, u, manifold.tangent_space(x), TangentSpace(manifold, x)


@settings(max_examples=30, deadline=None)
@given(
    metric=st.sampled_from(["inv", "mix"]),
    eps=st.sampled_from([0.0, 0.1]),
    batch=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    rank=st.integers(1, 2),
    seed=st.integers(0, 2**16),
    zero_rows=st.booleans(),
    rows=st.sampled_from([(6, 6), (6, 7), (8, 6), (4, 8)]),
    steps=st.sampled_from([1, 3, 16]),
)
def test_the_batched_exponential_map_is_the_reference_one(
    metric, eps, batch, rank, seed, zero_rows, rows, steps
):
    manifold = gq.GLQuotient(*rows, metric, eps, expmap_steps=steps)
    x, u, fast, reference = case(manifold, batch, rank, seed, 0.2, zero_rows)
    assert _gl_geodesic.applies(manifold, x, u)
    end = fast.expmap(u)
    expected = reference.expmap(u)
    # the two points differ by the order of float rounding, relative to the step's size
    tolerance = 1e3 * torch.finfo(torch.float64).eps * (1 + float(x.abs().max()))
    assert torch.allclose(end, expected, rtol=0, atol=tolerance), float(
        (end - expected).abs().max()
    )
    moved = float((expected - x).abs().max())
    assert moved > 1e3 * tolerance or not u.any()  # the negative: the point moved
    pos, vel, failures = _gl_geodesic.geodesic(manifold, x, u, 0.5, steps)
    pos_ref, vel_ref = manifold.geodesic(x, u, 0.5, steps=steps)
    assert torch.allclose(pos, pos_ref, rtol=0, atol=tolerance)
    assert torch.allclose(vel, vel_ref, rtol=0, atol=tolerance * (1 + float(u.abs().max())))
    assert len(failures) == 4 * steps and all(not info.any() for info in failures)
    if zero_rows:  # a stack's padding stays exactly zero
        n, m = rows
        assert not end[..., n - 1, :].any() and not end[..., n + m - 1, :].any()


def test_the_reference_where_the_batched_map_does_not_apply(monkeypatch):
    calls = []
    original = _gl_geodesic.SpanGeodesic
    monkeypatch.setattr(
        _gl_geodesic, "SpanGeodesic", lambda *a: calls.append(a[1].dtype) or original(*a)
    )
    manifold = gq.GLQuotient(6, 7, "mix")
    x = manifold.random(2, 13, 2, dtype=torch.float64)
    space = manifold.tangent_space(x)
    u = 0.1 * space.proju(torch.randn_like(x))
    space.expmap(u.mT.contiguous().mT)  # strided
    x32 = x.float()
    manifold.tangent_space(x32).expmap(u.float())  # float32: its Gram matrices in float64
    leaf = u.clone().requires_grad_()
    space.expmap(leaf).sum().backward()  # autograd through the reference
    few = gq.GLQuotient(4, 5, "mix")  # fewer than 2h rows in G: no orthonormal basis
    y = few.random(2, 9, 3, dtype=torch.float64)
    few.tangent_space(y).expmap(0.1 * few.proju(y, torch.randn_like(y)))
    assert calls == [] and leaf.grad is not None
    space.expmap(u)
    assert calls == [torch.float64]


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_a_geodesic_that_leaves_the_manifold_raises_as_the_reference(metric):
    manifold = gq.GLQuotient(6, 6, metric, expmap_steps=2)
    _, u, fast, reference = case(manifold, (3,), 2, 0, 50.0)
    assert _gl_geodesic.applies(manifold, fast.x, u)
    with pytest.raises(GeodesicDomainError):
        reference.expmap(u)
    with pytest.raises(GeodesicDomainError):
        fast.expmap(u)


def test_the_zero_vector_stays_at_the_point():
    manifold = gq.GLQuotient(6, 6, "inv")
    x, u, fast, _ = case(manifold, (2,), 2, 1, 0.0)
    assert not u.any() and _gl_geodesic.applies(manifold, x, u)
    assert torch.equal(fast.expmap(u), x)


@pytest.mark.parametrize("capped", [False, True], ids=["cpu", "capped"])
@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("kind", ["full", "relaxed", "low_rank", "zero_at_a_point"])
def test_the_span_coordinates_come_from_a_cholesky_factor_whatever_the_span_rank(
    metric, kind, capped, monkeypatch
):
    """Both forms of the Christoffel coefficients: the inverse (CPU) and the triangular
    solves (where blocks are capped, as on an accelerator)."""
    monkeypatch.setattr(_linalg, "CAP_ON_CPU", capped)
    manifold = gq.GLQuotient(8, 8, metric, 0.1 if kind == "relaxed" else 0.0)
    x, u, fast, reference = case(manifold, (4,), 3, 7, 0.2)
    generator = torch.Generator().manual_seed(3)
    if kind == "low_rank":  # as the gradient of a one-token batch: each span of rank h + 1
        column, row = (
            torch.randn(4, *s, generator=generator, dtype=x.dtype) for s in [(16, 1), (1, 3)]
        )
        u = manifold.proju(x, column @ row)
        u = 0.2 * u / manifold.norm(x, u, keepdim=True)
    elif kind == "zero_at_a_point":
        u[1] = 0
    spans = _gl_geodesic.factor_spans(manifold, x.reshape(-1, 16, 3), u.reshape(-1, 16, 3))
    grams = _gl_geodesic.stacked_factors([_gl_geodesic.span_gram(*s) for s in spans], 4)
    singular = bool(torch.linalg.cholesky_ex(grams)[1].any())
    assert singular == (kind not in ("full", "relaxed"))  # the negative: the plain one fails
    monkeypatch.setattr(torch.linalg, "qr", None)  # no Householder factorisation
    assert _gl_geodesic.SpanGeodesic(manifold, x, u).lower is not None
    end, expected = fast.expmap(u), reference.expmap(u)
    tolerance = 1e3 * torch.finfo(torch.float64).eps * (1 + float(x.abs().max()))
    assert torch.allclose(end, expected, rtol=0, atol=tolerance)
    assert float((expected - x).abs().max()) > 1e3 * tolerance
    if kind == "zero_at_a_point":
        assert torch.equal(end[1], x[1])


def test_a_span_whose_gram_matrix_cannot_be_factorised_takes_householder():
    manifold = gq.GLQuotient(8, 8, "inv")
    x, u, _, _ = case(manifold, (2,), 3, 1, 0.2)
    u[0, 0, 0] = float("nan")
    span = _gl_geodesic.SpanGeodesic(manifold, x, u)
    assert span.lower is None and span.frames[0].shape == (4, 8, 6)  # the orthonormal frames
    assert _gl_geodesic.SpanGeodesic(manifold, x, u.nan_to_num()).lower is not None


def test_a_factor_with_nan_entries_reported_as_success_takes_householder(monkeypatch):
    """The GPU's Cholesky solvers can return ``info == 0`` for a matrix with NaN entries:
    the factor's own entries decide too."""
    manifold = gq.GLQuotient(8, 8, "inv")
    x, u, _, _ = case(manifold, (2,), 3, 1, 0.2)
    u[0, 0, 0] = float("nan")
    factorise = torch.linalg.cholesky_ex

    def reporting_success(matrix):
        lower, info = factorise(matrix.nan_to_num())
        return lower.masked_fill(matrix.isnan(), float("nan")), torch.zeros_like(info)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", reporting_success)
    assert _gl_geodesic.SpanGeodesic(manifold, x, u).lower is None
    assert _gl_geodesic.SpanGeodesic(manifold, x, u.nan_to_num()).lower is not None


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_checks_norms_from_the_span_coordinates_are_the_rows_ones(metric, eps):
    """The speeds the span's check compares and the change between two end points, from
    the 2h x 2h coordinates, are the metric's on the rows (to float rounding); the
    negative: a speed change beyond 2% raises."""
    manifold = gq.GLQuotient(8, 7, metric, eps)
    x, u, _, _ = case(manifold, (3,), 2, 5, 1.0)
    span = _gl_geodesic.SpanGeodesic(manifold, x, u)
    coarse, _ = span.integrate(1.0, 1)
    fine, failures = span.integrate(1.0, 2)
    (pos, vel), (pos_1,) = span.ends(fine, with_velocity=True), span.ends(coarse)
    tolerance = 1e3 * torch.finfo(torch.float64).eps
    speeds = span.squared_speeds(fine, failures)
    assert torch.allclose(speeds, manifold.inner(pos, vel, vel), rtol=tolerance, atol=0)
    start, _ = span.start_speeds()
    assert torch.allclose(start, manifold.inner(x, u, u), rtol=tolerance, atol=0)
    change = float(manifold.inner(x, pos - pos_1, pos - pos_1).sum())
    assert float(span.squared_change(fine, coarse)) == pytest.approx(change, rel=1e-6)
    assert change > 1e-12  # the negative: the end points differ
    assert float(span.squared_change(span.start, None)) == pytest.approx(
        float(manifold.inner(x, x, x).sum()), rel=tolerance
    )
    span.check(fine, failures, 2, pos)  # a good integration passes
    with pytest.raises(GeodesicDomainError):
        span.check(fine, failures, 2, pos * float("nan"))
    slow = fine.clone()
    slow[:, 2:] *= 0.985  # each squared speed 3% lower
    with pytest.raises(GeodesicDomainError):
        span.check(slow, failures, 2, pos)


@pytest.mark.parametrize("rows", [(8, 8), (8, 9)])
def test_the_householder_frames_move_the_point_as_the_reference(rows, monkeypatch):
    """Where the span's Cholesky coordinates are not taken, its orthonormal frames give
    the reference's end point (both factors in one batch and one span per factor)."""
    manifold = gq.GLQuotient(*rows, "mix")
    x, u, fast, reference = case(manifold, (3,), 2, 4, 0.3)
    monkeypatch.setattr(_gl_geodesic, "_cholesky_coordinates", lambda *a: None)
    assert _gl_geodesic.SpanGeodesic(manifold, x, u).frames is not None
    end, expected = fast.expmap(u), reference.expmap(u)
    tolerance = 1e3 * torch.finfo(torch.float64).eps * (1 + float(x.abs().max()))
    assert torch.allclose(end, expected, rtol=0, atol=tolerance)
    assert float((expected - x).abs().max()) > 1e3 * tolerance
