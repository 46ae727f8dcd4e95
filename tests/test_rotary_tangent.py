"""The batched rotary projection in the GL tangent space is the reference formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _gl_tangent, _rotary_tangent
from geoopt_quotient.manifolds.gl_quotient import PointState
from geoopt_quotient.manifolds.tangent import CachedTangentSpace

pytestmark = pytest.mark.usefixtures("single_thread")

cases = dict(
    metric=st.sampled_from(["inv", "mix"]),
    eps=st.sampled_from([0.0, 0.1]),
    batch=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    # (n, m, h, rotary_dim): k = h - r = 0 (Llama), k > 0 (partial rotary), m = 2n (GQA)
    shape=st.sampled_from([(6, 6, 4, 4), (4, 8, 4, 2), (7, 5, 5, 2), (8, 16, 6, 4)]),
    pairing=st.sampled_from(["half", "interleaved"]),
    seed=st.integers(0, 2**16),
    chunk=st.sampled_from([1, 1 << 21]),
)


def case(metric, eps, batch, shape, pairing, seed, dtype):
    n, m, rank, rotary_dim = shape
    manifold = gq.RotaryGLQuotient(n, m, rotary_dim, pairing, metric, eps)
    generator = torch.Generator().manual_seed(seed)
    x, c = (torch.randn(*batch, n + m, rank, generator=generator, dtype=dtype) for _ in "xc")
    return manifold, x, c


def scale_of(x: torch.Tensor) -> float:
    return (1 + float(x.abs().max())) ** 6


@settings(max_examples=40, deadline=None)
@given(**cases, dtype=st.sampled_from([torch.float64, torch.float32]))
def test_the_batched_riemannian_gradient_is_the_reference_one(
    metric, eps, batch, shape, pairing, seed, chunk, dtype
):
    manifold, x, c = case(metric, eps, batch, shape, pairing, seed, dtype)
    fast = manifold.tangent_space(x)
    assert isinstance(fast, _gl_tangent.GLTangentSpace)
    reference = CachedTangentSpace(manifold, x, PointState(manifold, x))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_gl_tangent, "CHUNK_BYTES", chunk)
        rgrad = fast.egrad2rgrad_(c.clone())
    assert isinstance(fast._whole().projection, _rotary_tangent.RotaryProjection)
    expected = reference.egrad2rgrad(c)
    tolerance = 512 * torch.finfo(dtype).eps * float(c.abs().max()) * scale_of(x)
    assert rgrad.dtype == dtype
    assert torch.allclose(rgrad, expected, rtol=0, atol=tolerance)


@settings(max_examples=25, deadline=None)
@given(**cases)
def test_the_batched_projection_is_horizontal_idempotent_and_not_gl_horizontal(
    metric, eps, batch, shape, pairing, seed, chunk
):
    manifold, x, c = case(metric, eps, batch, shape, pairing, seed, torch.float64)
    space = manifold.tangent_space(x)
    rgrad = space.egrad2rgrad_(c.clone())
    magnitude = float(c.abs().max()) * scale_of(x)
    left, right = manifold._horizontality_terms(x, rgrad)
    assert torch.allclose(left, right, rtol=0, atol=1e-10 * magnitude)
    left, right = manifold._horizontality_terms(x, c)  # the negative: c is not horizontal
    assert not torch.allclose(left, right, rtol=0, atol=1e-6 * magnitude)
    # idempotent: the projection of a horizontal vector is itself (the gradient of the
    # Riesz representative's Euclidean form, converted back, is the same vector)
    again = space.egrad2rgrad_(_euclidean_form(manifold, x, rgrad))
    assert torch.allclose(again, rgrad, rtol=0, atol=1e-9 * magnitude)
    # rotary-horizontal is weaker than GL(h)-horizontal (a smaller group)
    gl = gq.GLQuotient(manifold.n, manifold.m, metric, eps)
    left, right = gl._horizontality_terms(x, rgrad)
    assert not torch.allclose(left, right, rtol=0, atol=1e-6 * magnitude)


def _euclidean_form(manifold, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r"""The Euclidean gradient :math:`\nabla` whose metric conversion (before the
    projection) is ``u``: :math:`\nabla_F = u_F K_F^{-1}`."""
    state = PointState(manifold, x)
    g, h = manifold.factors(u)
    s_g, s_h = state.grams_exact
    s_g_inv, s_h_inv = state.inverses
    if manifold.metric == "inv":  # K_F = S_F
        return manifold.from_factors(g @ s_g_inv, h @ s_h_inv)
    return manifold.from_factors(g @ s_h, h @ s_g)  # mix: K_G = S_H^{-1}, K_H = S_G^{-1}


def test_the_projection_matrices_of_a_slice_are_those_of_its_heads():
    manifold = gq.RotaryGLQuotient(6, 8, rotary_dim=4, metric="inv")
    x = manifold.random(5, 14, 6, dtype=torch.float64)
    build = manifold.batched_kernels().projection  # the manifold's kernel of its projection
    whole, part = build(PointState(manifold, x)), build(PointState(manifold, x[1:3]))
    assert isinstance(whole, _rotary_tangent.RotaryProjection)
    sliced = whole.part(1, 3)
    assert sliced.basis is whole.basis
    for mine, theirs in zip(sliced, part):
        if isinstance(mine, torch.Tensor):
            assert torch.allclose(mine, theirs, rtol=0, atol=1e-12)
