"""The batched tangent space of GLQuotient (equal factors) is the reference formulas."""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import pytest
import torch
from conftest import FreshTensors
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _gl_tangent, _rotary_tangent
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


#: The largest condition number of the factors' Gram matrices at which float32 results
#: are compared: the metric's inverses and the projection's solve lose about that factor
#: of float32's precision (float64 is compared at every point).
FLOAT32_CONDITIONING = 100.0


def conditioning(x: torch.Tensor, n: int) -> float:
    """The largest condition number of :math:`G^\top G` and :math:`H^\top H` over the
    batch (in float64)."""
    x = x.double()
    grams = [f.mT @ f for f in (x[..., :n, :], x[..., n:, :])]
    return max(float(torch.linalg.cond(g).max()) for g in grams)


def ill_conditioning(x: torch.Tensor, n: int) -> float:
    """How far the point's conditioning exceeds :data:`FLOAT32_CONDITIONING`, at least
    1: the factor by which the metric's solves lose more precision there (hypothesis
    draws float64 points whose Gram matrices reach condition numbers of 1e7)."""
    return max(1.0, conditioning(x, n) / FLOAT32_CONDITIONING)


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
    if dtype == torch.float32:  # float32 where its rounding allows it; float64 everywhere
        assume(conditioning(x, manifold.n) < FLOAT32_CONDITIONING)
    scale = (1 + float(x.abs().max())) ** 4 * ill_conditioning(x, manifold.n)
    vectors = [u, reference.proju(c), 2 * u - c]
    with chunk_bytes(chunk):
        gram = fast.gram(vectors)
        rgrad = fast.egrad2rgrad_(c.clone())
        point, pullback = fast.retr_vjp(u, torch.full_like(x, float("nan")))
        pulled = pullback(c.clone())
        retracted = fast.retr(u)  # the path gap's: the same point, a new tensor
    assert torch.equal(retracted, point) and retracted.data_ptr() != point.data_ptr()
    # the reference formulas in float64 on the same inputs: in float32 at an
    # ill-conditioned point the reference's own rounding can exceed the tolerance
    exact = CachedTangentSpace(manifold, x.double(), PointState(manifold, x.double()))
    u, c, vectors = u.double(), c.double(), [v.double() for v in vectors]
    expected_gram = exact.gram(vectors)
    magnitude = float(expected_gram.abs().max()) * scale
    close(gram.to(dtype), expected_gram.to(dtype), dtype, magnitude)  # float64 sums
    assert torch.equal(gram, gram.mT)
    close(rgrad, exact.egrad2rgrad(c).to(dtype), dtype, float(c.abs().max()) * scale)
    expected_point, expected_pullback = exact.retr_vjp(u, torch.empty_like(u))
    close(point, expected_point.to(dtype), dtype, scale)
    close(retracted, exact.retr(u).to(dtype), dtype, scale)
    pulled_exact = expected_pullback(c.clone()).to(dtype)
    close(pulled, pulled_exact, dtype, float(c.abs().max()) * scale)
    if zero_rows:  # a stack's padding stays exactly zero
        n, m = rows
        for t in (rgrad, point, pulled):
            assert not t[..., n - 1, :].any() and not t[..., n + m - 1, :].any()


@settings(max_examples=40, deadline=None)
@given(**cases, dtype=st.sampled_from([torch.float64, torch.float32]))
def test_the_retraction_corrections_are_those_of_the_retracted_point(
    metric, eps, batch, rank, seed, chunk, zero_rows, rows, dtype
):
    r"""The path gap estimate's :math:`|c|^2` per point, from the retraction's
    coefficients without a retracted point, is that of :math:`c = x + u - R_x(u)` with
    the reference's retraction in float64, and :math:`|u|^2` per point the metric's;
    a first-order retraction has no closed form here (``None``)."""
    manifold = gq.GLQuotient(*rows, metric, eps)
    x, fast, _, u, _ = case(manifold, batch, rank, seed, dtype, zero_rows)
    if dtype == torch.float32:
        assume(conditioning(x, manifold.n) < FLOAT32_CONDITIONING)
    with chunk_bytes(chunk):
        corrections, squares = fast.retraction_corrections(u)
    exact = CachedTangentSpace(manifold, x.double(), PointState(manifold, x.double()))
    u64 = u.double()
    c = x.double() + u64 - exact.retr(u64)
    expected = [manifold.inner(x.double(), v, v).reshape(-1) for v in (c, u64)]
    scale = (1 + float(x.abs().max())) ** 4 * ill_conditioning(x, manifold.n)
    for value, reference in zip((corrections, squares), expected):
        close(value, reference.to(dtype), dtype, float(reference.abs().max()) * scale)
    assert float(corrections.max()) > 0 or not u.any()
    first_order = gq.GLQuotient(*rows, metric, eps, retraction="first_order")
    assert first_order.tangent_space(x).retraction_corrections(u) is None


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
    rounding = 1e-10 * ill_conditioning(x, manifold.n) * max(1.0, float(rgrad.abs().max()))
    assert torch.allclose(left, right, rtol=0, atol=rounding * magnitude)
    left, right = manifold._horizontality_terms(x, c)  # the negative: c is not horizontal
    terms = max(float(left.abs().max()), float(right.abs().max()))
    assert float((left - right).abs().max()) > 1e-6 * terms
    # the metric's Riesz representative: <rgrad, v> = <c, v>_F for horizontal v
    v = fast.proju(torch.randn_like(x))
    assert torch.allclose(
        fast.inner(rgrad, v), (c * v).sum(), rtol=1e-9, atol=1e-2 * rounding * magnitude
    )


def test_other_tensors_use_the_reference_and_rotary_batches_its_own_projection(monkeypatch):
    calls = []
    for name in ("riemannian_gradient_batch", "retract_batch"):
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
    assert calls == ["retract_batch", "riemannian_gradient_batch"]
    rotary = gq.RotaryGLQuotient(4, 5, rotary_dim=2, metric="inv")
    x = rotary.random(2, 9, 2, dtype=torch.float64)
    space = rotary.tangent_space(x)
    c = torch.randn_like(x)
    expected = rotary.egrad2rgrad(x, c)
    assert torch.allclose(space.egrad2rgrad_(c.clone()), expected, rtol=0, atol=1e-12)
    # the rotary projection is batched too (its own matrices, _rotary_tangent)
    assert calls == ["retract_batch", "riemannian_gradient_batch", "riemannian_gradient_batch"]
    assert isinstance(space._whole().projection, _rotary_tangent.RotaryProjection)
    generic = gq.GLQuotient(4, 5, "inv").egrad2rgrad(x, c)  # the negative: GL(h)'s differs
    assert not torch.allclose(expected, generic, rtol=0, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(**cases)
def test_the_pullback_knows_the_point_products_of_its_result(
    metric, eps, batch, rank, seed, chunk, zero_rows, rows
):
    r""":math:`F^\top` of the pulled-back gradient, from :math:`h \times h` products
    only, is the direct product; the Riemannian gradient that reads it is the reference's.
    The negative: a changed coefficient (:math:`E` in place of :math:`E^\top`) breaks the
    identity, and a gradient changed in place is not taken for the one pulled back."""
    manifold = gq.GLQuotient(*rows, metric, eps)
    n = manifold.n
    x, fast, reference, u, c = case(manifold, batch, rank, seed, zero_rows=zero_rows)
    split = fast._split
    with chunk_bytes(chunk):
        _, pullback = fast.retr_vjp(u, torch.empty_like(x))
        pulled = pullback(c.clone())
        known = fast._crosses.get(pulled)
        direct = split.inner(x.reshape(-1, *x.shape[-2:]), pulled.view(-1, *x.shape[-2:]))
        # the pulled-back gradient grows with the point's conditioning, and so does
        # the rounding of the metric's solves: the tolerance scales with both
        magnitude = float(pulled.abs().max()) * (1 + float(x.abs().max())) ** 4
        tolerance = 512 * torch.finfo(x.dtype).eps * ill_conditioning(x, n) * magnitude
        assert known is not None
        assert torch.allclose(known, direct, rtol=0, atol=tolerance)
        expected = reference.egrad2rgrad(pulled)
        assert torch.allclose(fast.egrad2rgrad_(pulled), expected, rtol=0, atol=tolerance)
        # written anew by the gradient: now the products of the Riemannian gradient
        rgrad_direct = split.inner(x.reshape(-1, *x.shape[-2:]), pulled.view(-1, *x.shape[-2:]))
        assert not torch.allclose(rgrad_direct, direct, rtol=0, atol=1e-6 * magnitude)
        assert torch.allclose(fast._crosses.get(pulled), rgrad_direct, rtol=0, atol=tolerance)
        other = pullback(c.clone())
        other.mul_(2)  # changed in place: its products are no longer the pullback's
        assert fast._crosses.get(other) is None

    # the negative: E instead of E^T in the first term
    kernel = fast._whole()
    flat_u = u.reshape(kernel.x.shape)
    e, k = _gl_tangent.retract_batch(
        kernel, split, flat_u, torch.empty_like(kernel.x), metric == "mix"
    )
    wrong = _gl_tangent.pull_back_(
        kernel,
        split,
        flat_u,
        c.clone().reshape(kernel.x.shape),
        e.mT,
        k,
        fast._point_grams(),
        metric == "mix",
    )
    right = _gl_tangent.pull_back_(
        kernel,
        split,
        flat_u,
        c.clone().reshape(kernel.x.shape),
        e,
        k,
        fast._point_grams(),
        metric == "mix",
    )
    assert torch.allclose(right, direct.reshape(right.shape), rtol=0, atol=tolerance)
    asymmetric = float((e - e.mT).abs().max()) > 1e-6
    if asymmetric:
        assert not torch.allclose(wrong, right, rtol=0, atol=1e-6 * magnitude)


@settings(max_examples=30, deadline=None)
@given(**cases, dtype=st.sampled_from([torch.float64, torch.float32]))
def test_the_riemannian_gradient_and_gram_of_auto_pgd_are_the_reference(
    metric, eps, batch, rank, seed, chunk, zero_rows, rows, dtype
):
    r"""The Gram matrix of ``(xi, rgrad, xi_prev)`` with the gradient's row from Euclidean
    products, and the previous iterate's norm kept, is the reference's (the metric's
    products of all three), for horizontal iterates; the negative: with an iterate that
    is not horizontal, the Euclidean row is not the metric's."""
    manifold = gq.GLQuotient(*rows, metric, eps)
    x, fast, reference, u, c = case(manifold, batch, rank, seed, dtype, zero_rows)
    if dtype == torch.float32:  # as in test_batched_operations_are_the_reference_formulas
        assume(conditioning(x, manifold.n) < FLOAT32_CONDITIONING)
    v = 0.5 * reference.proju(torch.randn_like(x))
    scale = (1 + float(x.abs().max())) ** 6 * (1 + float(c.abs().max())) ** 2
    scale *= ill_conditioning(x, manifold.n)
    with chunk_bytes(chunk):
        first = fast.egrad2rgrad_gram_((u, c.clone(), u), 1)
        for vectors in ((v, c.clone(), u), (v, c.clone(), u)):  # u's norm kept, then v's
            rgrad, gram = fast.egrad2rgrad_gram_(vectors, 1)
            expected_rgrad = reference.egrad2rgrad(c)
            close(rgrad, expected_rgrad, dtype, float(c.abs().max()) * scale)
            expected = reference.gram([vectors[0], expected_rgrad, vectors[2]])
            close(gram, expected, dtype, float(expected.abs().max()) * scale)
            assert torch.equal(gram, gram.mT)
    expected = reference.gram([u, reference.egrad2rgrad(c), u])
    close(first[1], expected, dtype, float(expected.abs().max()) * scale)
    with chunk_bytes(chunk):  # an iterate changed in place: its norm is not the kept one
        v.mul_(3)
        _, gram = fast.egrad2rgrad_gram_((u, c.clone(), v), 1)
    expected = reference.gram([u, reference.egrad2rgrad(c), v])
    close(gram, expected, dtype, float(expected.abs().max()) * scale)
    if dtype == torch.float64:  # the negative: an iterate that is not horizontal
        vertical = c - reference.proju(c)
        if float(vertical.abs().max()) > 1e-3:
            _, gram = fast.egrad2rgrad_gram_((vertical, c.clone(), u), 1)
            metric_row = reference.gram([vertical, reference.egrad2rgrad(c)])
            assert not torch.allclose(gram[0, 1], metric_row[0, 1], rtol=1e-6, atol=1e-9)


@settings(max_examples=20, deadline=None)
@given(**cases, dtype=st.sampled_from([torch.float64, torch.float32]))
def test_the_gradients_column_of_auto_pgd_is_that_of_the_gram_matrix(
    metric, eps, batch, rank, seed, chunk, zero_rows, rows, dtype
):
    """The column of the Riemannian gradient (Euclidean dots, no metric product) is the
    column of the Gram matrix and the gradient the same, bit for bit, with the vectors in
    any order and one of them twice; the negative: with an iterate that is not
    horizontal, it is not the metric's inner product."""
    manifold = gq.GLQuotient(*rows, metric, eps)
    x, fast, reference, u, c = case(manifold, batch, rank, seed, dtype, zero_rows)
    v = 0.5 * reference.proju(torch.randn_like(x))
    with chunk_bytes(chunk):
        for vectors, index in (((u, c, v), 1), ((c, v, u), 0), ((u, v, c), 2), ((u, c, u), 1)):
            vectors = [w.clone() if w is c else w for w in vectors]
            expected_rgrad, gram = fast.egrad2rgrad_gram_(
                [w.clone() if i == index else w for i, w in enumerate(vectors)], index
            )
            rgrad, column = fast.egrad2rgrad_column_(vectors, index)
            assert rgrad is vectors[index] and torch.equal(rgrad, expected_rgrad)
            assert column.dtype == torch.float64 and torch.equal(column, gram[:, index])
    if dtype == torch.float64:
        vertical = c - reference.proju(c)
        if float(vertical.abs().max()) > 1e-3:
            _, column = fast.egrad2rgrad_column_((vertical, c.clone(), u), 1)
            metric_row = reference.gram([vertical, reference.egrad2rgrad(c)])
            assert not torch.allclose(column[0], metric_row[0, 1], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_the_rotary_quotients_gram_of_auto_pgd_is_the_reference(metric):
    """The rotary quotient's projection is metric-orthogonal too: the Euclidean row of
    its Riemannian gradient is the metric's."""
    torch.manual_seed(0)
    manifold = gq.RotaryGLQuotient(4, 8, rotary_dim=2, metric=metric)
    x = manifold.random(3, 12, 4, dtype=torch.float64)
    fast = manifold.tangent_space(x)
    reference = CachedTangentSpace(manifold, x, PointState(manifold, x))
    u, v = (0.3 * reference.proju(torch.randn_like(x)) for _ in range(2))
    c = torch.randn_like(x)
    fast.egrad2rgrad_gram_((u, c.clone(), u), 1)
    rgrad, gram = fast.egrad2rgrad_gram_((v, c.clone(), u), 1)
    expected_rgrad = reference.egrad2rgrad(c)
    close(rgrad, expected_rgrad, torch.float64, float(expected_rgrad.abs().max()))
    expected = reference.gram([v, expected_rgrad, u])
    close(gram, expected, torch.float64, float(expected.abs().max()))
    rgrad, column = fast.egrad2rgrad_column_((v, c.clone(), u), 1)  # the column alone
    assert torch.equal(rgrad, fast.egrad2rgrad_gram_((v, c.clone(), u), 1)[0])
    close(column, expected[:, 1], torch.float64, float(expected.abs().max()))
    # the negative: the plain GL(h) quotient's gradient is not horizontal here
    _, generic = gq.GLQuotient(4, 8, metric).tangent_space(x).egrad2rgrad_gram_((v, c, u), 1)
    assert not torch.allclose(generic, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_the_rotary_quotients_retraction_corrections_are_the_reference(metric):
    """The rotary quotient retracts as GL(h)'s: its corrections are those of its
    reference retraction, and of a much smaller size than the step."""
    torch.manual_seed(0)
    manifold = gq.RotaryGLQuotient(4, 8, rotary_dim=2, metric=metric)
    x = manifold.random(3, 12, 4, dtype=torch.float64)
    reference = CachedTangentSpace(manifold, x, PointState(manifold, x))
    u = 0.1 * reference.proju(torch.randn_like(x))
    corrections, squares = manifold.tangent_space(x).retraction_corrections(u)
    c = x + u - reference.retr(u)
    expected = manifold.inner(x, c, c).reshape(-1)
    close(corrections, expected, torch.float64, float(expected.abs().max()))
    close(squares, manifold.inner(x, u, u).reshape(-1), torch.float64, float(squares.max()))
    assert 0 < float((corrections / squares).max()) < 0.1


class _FactorProducts(TorchDispatchMode):
    """The work of the batched products with an operand of ``rows`` rows or more, in
    multiply-adds over ``unit`` (those of one product of every factor with an ``h x h``
    matrix)."""

    def __init__(self, rows: int, unit: int):
        super().__init__()
        self.rows, self.unit, self.work = rows, unit, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packets = (torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.baddbmm_)
        if func.overloadpacket in packets:
            left, right = args[-2:] if func.overloadpacket is torch.ops.aten.bmm else args[1:3]
            if max(*left.shape[-2:], *right.shape[-2:]) >= self.rows:
                self.work += left.numel() * right.shape[-1] / self.unit
        return func(*args, **(kwargs or {}))


def _iterate(fast, x, previous, c, weights=(0.75, 0.5, 0.25), known=True):
    """As Auto-PGD: ``previous`` retracted, its gradient pulled back from ``c`` and made
    Riemannian (``previous``'s norm kept), then the next iterate, a combination of
    them, written into a new tensor with :meth:`combination` (its products with the
    point derived) if ``known``, else as a plain sum."""
    _, pullback = fast.retr_vjp(previous, torch.empty_like(x))
    grad, _ = fast.egrad2rgrad_gram_((previous, pullback(c.clone()), previous), 1)
    vectors = (previous, grad, previous)
    scalars = [torch.tensor(w, dtype=x.dtype) for w in weights]
    written = fast.combination(vectors, scalars) if known else None
    out = sum(w * v for w, v in zip(scalars, vectors))
    if written is not None:
        written(out)
    return out


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_an_auto_pgd_iteration_makes_eleven_products_with_the_factors(metric):
    """The retraction 3 (its iterate's products with the point derived from those of
    the vectors it combines), its pullback 5, the Riemannian gradient 2 (its product
    with the point read from the pullback's), the Gram matrix 1 (the gradient's row
    Euclidean, the previous iterate's norm kept): the work of 11 products of the ``n x
    h`` factors with ``h x h`` matrices. The negatives: an iterate not made by a known
    combination costs the retraction's fourth; the generic path (a conversion and a
    Gram matrix of their own) does 15 and the Gram matrix's pairs."""
    n, rank, batch = 32, 8, 3
    manifold = gq.GLQuotient(n, n, metric)
    x, fast, _, previous, c = case(manifold, (batch,), rank, 0)
    unit = 2 * batch * n * rank * rank
    for known, expected in ((True, 11), (False, 12)):
        u = _iterate(fast, x, previous, c, known=known)
        with _FactorProducts(n, unit) as counter:
            _, pullback = fast.retr_vjp(u, torch.empty_like(x))
            fast.egrad2rgrad_gram_((u, pullback(c.clone()), previous), 1)
        assert counter.work == expected
    u = _iterate(fast, x, previous, c, known=False)
    with _FactorProducts(n, unit) as counter:  # the negative: no products known
        _, pullback = fast.retr_vjp(u, torch.empty_like(x))
        grad = pullback(c.clone()).clone()
        fast.egrad2rgrad_(grad)
        fast.gram([u, grad, previous])
    assert counter.work == 15 + 9 / rank


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_an_auto_pgd_iteration_with_derived_gram_entries_makes_ten_products(metric):
    """With the iterates' entries derived from the last update (Auto-PGD's
    ``egrad2rgrad_column_``), the Gram matrix takes no product with the factors: 3 + 5 + 2;
    the negative: the whole matrix's column costs the eleventh."""
    n, rank, batch = 32, 8, 3
    manifold = gq.GLQuotient(n, n, metric)
    x, fast, _, previous, c = case(manifold, (batch,), rank, 0)
    unit = 2 * batch * n * rank * rank
    for column, expected in ((True, 10), (False, 11)):
        u = _iterate(fast, x, previous, c)
        with _FactorProducts(n, unit) as counter:
            _, pullback = fast.retr_vjp(u, torch.empty_like(x))
            vectors = (u, pullback(c.clone()), previous)
            if column:
                fast.egrad2rgrad_column_(vectors, 1)
            else:
                super(type(fast), fast).egrad2rgrad_column_(vectors, 1)
        assert counter.work == expected


class _Operators(TorchDispatchMode):
    """The operators dispatched (views not counted: they move no data), by name, and
    the bytes of the operands and results of those with an operand of ``rows`` rows or
    more (the factors' size)."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows, self.calls, self.large = rows, Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            name = func.overloadpacket.__name__
            self.calls[name] += 1
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if any(t.dim() >= 2 and t.shape[-2] >= self.rows for t in tensors):
                self.large[name] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _iteration_operators(metric: str, rows, dtype) -> _Operators:
    """The operators of one Auto-PGD iteration of the batched tangent space (the
    retraction, its pullback, the Riemannian gradient and the Gram matrix), after one
    that made what the space keeps."""
    manifold = gq.GLQuotient(*rows, metric)
    x, fast, _, u, c = case(manifold, (3,), 8, 0, dtype)
    previous = 0.5 * u
    for counted in (False, True):
        fast.egrad2rgrad_gram_((previous, c.clone(), previous), 1)  # keeps the norm
        with _Operators(min(rows)) if counted else contextlib.nullcontext() as counter:
            _, pullback = fast.retr_vjp(u, torch.empty_like(x))
            fast.egrad2rgrad_gram_((u, pullback(c.clone()), previous), 1)
    return counter


@pytest.mark.parametrize("rows", [(32, 32), (16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_mix_iteration_makes_no_operation_beyond_an_inv_iteration(rows, dtype):
    """The mix metric's weights (:math:`W_G = S_H`) couple each factor to the other's
    Gram matrix, so its iteration exchanges the factors' ``h x h`` matrices (``flip``);
    beyond that it makes no operator call that the inv metric's does not (each at most as
    often), and the operations on the ``n x h`` factors move the same bytes. The
    negative: the generic path (a conversion and a Gram matrix of its own) moves more."""
    inv, mix = (_iteration_operators(metric, rows, dtype) for metric in ("inv", "mix"))
    beyond = {name: n for name, n in (mix.calls - inv.calls).items() if name != "flip"}
    assert beyond == {}
    assert 0 < mix.calls["flip"] <= 4
    assert mix.large == inv.large
    manifold = gq.GLQuotient(*rows, "mix")
    x, fast, _, u, c = case(manifold, (3,), 8, 0, dtype)
    with _Operators(min(rows)) as generic:
        _, pullback = fast.retr_vjp(u, torch.empty_like(x))
        grad = pullback(c.clone()).clone()
        fast.egrad2rgrad_(grad)
        fast.gram([u, grad, 0.5 * u])
    assert sum(generic.large.values()) > sum(mix.large.values())


@settings(max_examples=60, deadline=None)
@given(**cases, dtype=st.sampled_from([torch.float64, torch.float32]))
def test_a_combination_knows_its_products_with_the_point(
    metric, eps, batch, rank, seed, chunk, zero_rows, rows, dtype
):
    r""":math:`F^\top v_F` of Auto-PGD's next iterate, derived from those of the vectors
    it combines (a retracted one, a Riemannian gradient), is the direct product up to
    rounding, and the retraction that reads it is the reference's. The negatives: a
    vector whose products are unknown gives nothing to derive, and an iterate changed in
    place is not taken for the combination."""
    manifold = gq.GLQuotient(*rows, metric, eps)
    x, fast, reference, previous, c = case(manifold, batch, rank, seed, dtype, zero_rows)
    if dtype == torch.float32:  # as in test_batched_operations_are_the_reference_formulas
        assume(conditioning(x, manifold.n) < FLOAT32_CONDITIONING)
    scale = (1 + float(x.abs().max())) ** 4 * (1 + float(c.abs().max()))
    scale *= ill_conditioning(x, manifold.n)
    with chunk_bytes(chunk):
        u = _iterate(fast, x, previous, c)
        known = fast._crosses.get(u)
        assert known is not None
        direct = fast._split.inner(x.reshape(-1, *x.shape[-2:]), u.reshape(-1, *x.shape[-2:]))
        close(known, direct, dtype, scale * (1 + float(direct.abs().max())))
        point, _ = fast.retr_vjp(u, torch.empty_like(x))
        expected = reference.retr(u)
        close(point, expected, dtype, scale * (1 + float(expected.abs().max())))
        assert fast.combination((u, torch.randn_like(x), u), [torch.tensor(1.0)] * 3) is None
        u.mul_(2)
        assert fast._crosses.get(u) is None


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize("rows", [(32, 32), (16, 32)])
def test_an_auto_pgd_iteration_allocates_nothing_of_the_vectors_size(
    metric, capped, rows, monkeypatch
):
    """After the first iteration at a point, the retraction, its pullback, the Riemannian
    gradient with either of Auto-PGD's Gram entries and the combination write their
    results into the vectors, a workspace of the space and ``h x h`` matrices: no new
    tensor as large as a slice of the vectors (the whole batch where slices are capped,
    as on a GPU), so that no allocation of that size is faulted in anew at each
    iteration. The negatives: the reference's Riemannian gradient allocates such
    tensors, and so does the first iteration, which makes the workspace."""
    from geoopt_quotient.manifolds import _linalg

    monkeypatch.setattr(_linalg, "CAP_ON_CPU", capped)
    batch, rank = 8, 3
    manifold = gq.GLQuotient(*rows, metric)
    x, fast, reference, previous, c = case(manifold, (batch,), rank, 0)
    point_bytes = x[0].numel() * x.element_size()
    monkeypatch.setattr(_gl_tangent, "CHUNK_BYTES", 2 * point_bytes)  # slices of 2 points
    slice_bytes = (batch if capped else 2) * point_bytes
    assert 2 * batch * rank * rank * x.element_size() < slice_bytes  # the h x h products
    scalars = [torch.tensor(w, dtype=x.dtype) for w in (0.75, 0.5, 0.25)]

    def iteration(u, column, perturbed, grad, out):
        fast.retr_vjp(u, perturbed)[1](grad.copy_(c))
        vectors = (u, grad, previous)
        (fast.egrad2rgrad_column_ if column else fast.egrad2rgrad_gram_)(vectors, 1)
        written = fast.combination(vectors, scalars)
        torch.mul(previous, scalars[2], out=out).add_(u, alpha=0.75).add_(grad, alpha=0.5)
        written(out)

    allocations, u = [], previous
    for column in (False, True, False, True):
        buffers = [torch.empty_like(x) for _ in range(3)]  # Auto-PGD's, made once
        with FreshTensors() as fresh:
            iteration(u, column, *buffers)
        allocations.append(sum(size >= slice_bytes for _, _, size in fresh.records))
        u = buffers[-1]
    assert allocations[0] > 0  # the workspace
    assert allocations[1:] == [0, 0, 0]
    with FreshTensors() as fresh:
        reference.egrad2rgrad(c)
    assert any(size >= slice_bytes for _, _, size in fresh.records)


def test_a_subclass_with_formulas_of_its_own_names_the_kernels_that_still_apply():
    """A subclass that redefines the projection without saying which batched kernels
    still apply is refused where it is defined; one that names none gets its own
    projection on the batched metric conversion, and the reference's geodesic."""
    with pytest.raises(TypeError, match="define `batched_kernels`"):

        class Silent(gq.GLQuotient):
            def _proju(self, st, u):
                return super()._proju(st, u)

    class Doubled(gq.GLQuotient):  # a projection of its own: twice GL(h)'s
        def _proju(self, st, u):
            return 2 * super()._proju(st, u)

        def batched_kernels(self):
            return _gl_tangent.BatchedKernels(projection=None, span_geodesic=False)

    manifold, general = Doubled(8, 8, "inv"), gq.GLQuotient(8, 8, "inv")
    generator = torch.Generator().manual_seed(0)
    x, c = (torch.randn(3, 16, 2, generator=generator, dtype=torch.float64) for _ in "xc")
    space = manifold.tangent_space(x)
    rgrad = space.egrad2rgrad_(c.clone())
    magnitude = float(c.abs().max()) * (1 + float(x.abs().max())) ** 6
    assert torch.allclose(rgrad, manifold.egrad2rgrad(x, c), rtol=0, atol=1e-11 * magnitude)
    assert not torch.allclose(rgrad, general.egrad2rgrad(x, c), rtol=0, atol=1e-6 * magnitude)
    u = 0.01 * general.proju(x, c)
    assert space.span_geodesic(u) is None  # its geodesic is not said to be GL(h)'s
    assert general.tangent_space(x).span_geodesic(u) is not None
