"""The batched tangent space of GLQuotient (equal factors) is the reference formulas."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _gl_tangent
from geoopt_quotient.manifolds.gl_quotient import PointState
from geoopt_quotient.manifolds.tangent import CachedTangentSpace

pytestmark = pytest.mark.usefixtures("single_thread")


def case(manifold, batch, rank, seed, dtype=torch.float64, zero_rows=False):
    """A point (optionally with zero rows at the end of both factors, as a stack's
    padding), the batched and the reference tangent space there, a horizontal vector and
    a cotangent."""
    generator = torch.Generator().manual_seed(seed)
    n, m = manifold.n, manifold.m
    x, noise, c = (
        torch.randn(*batch, n + m, rank, generator=generator, dtype=dtype) for _ in range(3)
    )
    if zero_rows:
        for t in (x, noise, c):
            t[..., n - 1, :] = 0
            t[..., n + m - 1, :] = 0
    fast = manifold.tangent_space(x)
    reference = CachedTangentSpace(manifold, x, PointState(manifold, x))
    u = 0.3 * reference.proju(noise)
    return x, fast, reference, u, c


def chunk_bytes(size: int):
    """The slice size set to ``size`` bytes (hypothesis runs many examples per test, so
    no function-scoped ``monkeypatch``)."""
    return mock.patch.object(_gl_tangent, "CHUNK_BYTES", size)


cases = dict(
    metric=st.sampled_from(["inv", "mix"]),
    eps=st.sampled_from([0.0, 0.1]),
    batch=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    rank=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    chunk=st.sampled_from([1, 500, 1 << 21]),
    zero_rows=st.booleans(),
    rows=st.sampled_from([(4, 4), (4, 5), (6, 4), (4, 8)]),
)


def close(a, b, dtype, magnitude):
    tolerance = 512 * torch.finfo(dtype).eps * magnitude
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.allclose(a, b, rtol=0, atol=tolerance), float((a - b).abs().max())


@settings(max_examples=40, deadline=None)
@given(**cases, dtype=st.sampled_from([torch.float64, torch.float32]))
def test_batched_operations_are_the_reference_formulas(
    metric, eps, batch, rank, seed, chunk, zero_rows, rows, dtype
):
    manifold = gq.GLQuotient(*rows, metric, eps)
    x, fast, reference, u, c = case(manifold, batch, rank, seed, dtype, zero_rows)
    assert isinstance(fast, _gl_tangent.GLTangentSpace)
    scale = (1 + float(x.abs().max())) ** 4
    vectors = [u, reference.proju(c), 2 * u - c]
    with chunk_bytes(chunk):
        gram = fast.gram(vectors)
        rgrad = fast.egrad2rgrad_(c.clone())
        point, pullback = fast.retr_vjp(u, torch.full_like(x, float("nan")))
        pulled = pullback(c.clone())
    expected_gram = reference.gram(vectors)
    close(gram, expected_gram, dtype, float(expected_gram.abs().max()) * scale)
    assert torch.equal(gram, gram.mT)
    close(rgrad, reference.egrad2rgrad(c), dtype, float(c.abs().max()) * scale)
    expected_point, expected_pullback = reference.retr_vjp(u, torch.empty_like(x))
    close(point, expected_point, dtype, scale)
    close(pulled, expected_pullback(c.clone()), dtype, float(c.abs().max()) * scale)
    if zero_rows:  # a stack's padding stays exactly zero
        n, m = rows
        for t in (rgrad, point, pulled):
            assert not t[..., n - 1, :].any() and not t[..., n + m - 1, :].any()


@settings(max_examples=20, deadline=None)
@given(**cases)
def test_the_riemannian_gradient_is_horizontal_and_not_the_euclidean_one(
    metric, eps, batch, rank, seed, chunk, zero_rows, rows
):
    manifold = gq.GLQuotient(*rows, metric, eps)
    x, fast, _, _, c = case(manifold, batch, rank, seed, zero_rows=zero_rows)
    with chunk_bytes(chunk):
        rgrad = fast.egrad2rgrad_(c.clone())
    left, right = manifold._horizontality_terms(x, rgrad)
    magnitude = float(c.abs().max()) * (1 + float(x.abs().max())) ** 6
    assert torch.allclose(left, right, rtol=0, atol=1e-10 * magnitude)
    left, right = manifold._horizontality_terms(x, c)  # the negative: c is not horizontal
    assert not torch.allclose(left, right, rtol=0, atol=1e-6 * magnitude)
    # the metric's Riesz representative: <rgrad, v> = <c, v>_F for horizontal v
    v = fast.proju(torch.randn_like(x))
    assert torch.allclose(fast.inner(rgrad, v), (c * v).sum(), rtol=1e-9, atol=1e-12 * magnitude)


def test_other_tensors_use_the_reference_and_rotary_batches_its_own_projection(monkeypatch):
    calls = []
    for name in ("_riemannian_gradient", "_retract"):
        original = getattr(_gl_tangent, name)
        monkeypatch.setattr(
            _gl_tangent, name, lambda *a, o=original, n=name: calls.append(n) or o(*a)
        )
    manifold = gq.GLQuotient(4, 5, "inv")
    x = manifold.random(2, 9, 2, dtype=torch.float64)
    space = manifold.tangent_space(x)
    u = 0.1 * space.proju(torch.randn_like(x))
    assert space.retr_vjp(u.float(), torch.empty_like(x).float()) is None  # another dtype
    assert space.retr_vjp(u.mT.contiguous().mT, torch.empty_like(x)) is None  # strided
    assert calls == []
    space.retr_vjp(u, torch.empty_like(x))
    space.egrad2rgrad_(torch.randn_like(x))
    assert calls == ["_retract", "_riemannian_gradient"]
    rotary = gq.RotaryGLQuotient(4, 5, rotary_dim=2, metric="inv")
    x = rotary.random(2, 9, 2, dtype=torch.float64)
    space = rotary.tangent_space(x)
    c = torch.randn_like(x)
    expected = rotary.egrad2rgrad(x, c)
    assert torch.allclose(space.egrad2rgrad_(c.clone()), expected, rtol=0, atol=1e-12)
    # the rotary projection is batched too (its own matrices, _rotary_tangent)
    assert calls == ["_retract", "_riemannian_gradient", "_riemannian_gradient"]
    assert space._whole().rotary is not None and space._whole().left is None
    generic = gq.GLQuotient(4, 5, "inv").egrad2rgrad(x, c)  # the negative: GL(h)'s differs
    assert not torch.allclose(expected, generic, rtol=0, atol=1e-6)
