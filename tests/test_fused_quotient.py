"""The sharpness loop's fused quotient operations are the plain ones: the GL(h)
retraction with its hand-written pullback, the in-place Riemannian gradient, the Gram
matrix a slice of the batch at a time, and parameters written back by strided copies."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _linalg, gl_quotient
from geoopt_quotient.manifolds.tangent import CachedTangentSpace, TangentSpace
from geoopt_quotient.sharpness.apgd import maximize_in_ball
from geoopt_quotient.symmetry import plan as plan_module
from geoopt_quotient.symmetry import strided
from geoopt_quotient.symmetry.layouts import head_columns, head_rows
from geoopt_quotient.symmetry.plan import SymmetryGroup, SymmetryPlan

pytestmark = pytest.mark.usefixtures("single_thread")

EPS64 = torch.finfo(torch.float64).eps


def gl_case(metric, eps, batch, n, m, rank, seed, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    manifold = gq.GLQuotient(n, m, metric, eps)
    x = torch.randn(*batch, n + m, rank, generator=generator, dtype=dtype)
    space = manifold.tangent_space(x)
    u = 0.3 * space.proju(torch.randn(x.shape, generator=generator, dtype=dtype))
    c = torch.randn(x.shape, generator=generator, dtype=dtype)
    return manifold, space, x, u, c


@contextmanager
def chunk_bytes(size: int):
    """The fused operations' slice size set to ``size`` bytes (hypothesis runs many
    examples per test, so no function-scoped ``monkeypatch``)."""
    saved, gl_quotient.CHUNK_BYTES = gl_quotient.CHUNK_BYTES, size
    try:
        yield
    finally:
        gl_quotient.CHUNK_BYTES = saved


gl_cases = dict(
    metric=st.sampled_from(["inv", "mix"]),
    eps=st.sampled_from([0.0, 0.1]),
    batch=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    rank=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    chunk=st.sampled_from([1, 700, 1 << 21]),
)


@settings(max_examples=40, deadline=None)
@given(**gl_cases)
def test_retraction_and_its_pullback_are_autograd_through_retr(
    metric, eps, batch, rank, seed, chunk
):
    manifold, space, x, u, c = gl_case(metric, eps, batch, 4, 5, rank, seed)
    out = torch.full_like(x, float("nan"))
    cotangent = c.clone()
    with chunk_bytes(chunk):
        point, pullback = space.retr_vjp(u, out)
        grad = pullback(cotangent)
    leaf = u.clone().requires_grad_()
    expected = manifold.retr(x, leaf)
    (expected_grad,) = torch.autograd.grad(expected, leaf, c)
    scale = 1 + float(x.abs().max())
    assert point is out and grad is cotangent
    assert torch.allclose(point, expected.detach(), rtol=0, atol=64 * EPS64 * scale**3)
    grad_scale = float(c.abs().max()) * scale**2
    assert torch.allclose(grad, expected_grad, rtol=0, atol=256 * EPS64 * grad_scale)


def test_the_pullback_is_not_the_identity():
    """The negative: the retraction bends, its pullback differs from c by O(|ξ|)."""
    _, space, _, u, c = gl_case("inv", 0.0, (3,), 4, 5, 2, seed=1)
    _, pullback = space.retr_vjp(u, torch.empty_like(u))
    assert (pullback(c.clone()) - c).abs().max() > 1e-3


def test_first_order_retraction_is_the_straight_line_with_the_identity_pullback():
    manifold = gq.GLQuotient(4, 5, "mix", retraction="first_order")
    x = manifold.random(2, 9, 2, dtype=torch.float64)
    u = torch.randn_like(x)
    point, pullback = manifold.tangent_space(x).retr_vjp(u, torch.empty_like(x))
    c = torch.randn_like(x)
    assert torch.equal(point, x + u) and pullback(c) is c


def test_no_explicit_retraction_where_it_would_not_be_exact():
    """Another dtype, a non-contiguous vector, autograd on the inputs, or a geoopt
    manifold: ``None``, and the loop differentiates ``retr`` instead."""
    manifold, space, x, u, _ = gl_case("inv", 0.0, (2,), 4, 5, 2, seed=0)
    out = torch.empty_like(x)
    assert space.retr_vjp(u.float(), out.float()) is None
    assert space.retr_vjp(u.mT.contiguous().mT, out) is None
    assert space.retr_vjp(u.clone().requires_grad_(), out) is None
    generic = TangentSpace(manifold, x)  # the manifold's public methods only
    assert generic.retr_vjp(u, out) is None
    assert isinstance(space, CachedTangentSpace)


@pytest.mark.parametrize("small", [True, False])
@pytest.mark.parametrize("alpha", [1.0, -0.5])
@pytest.mark.parametrize("in_place", [True, False])
def test_add_product_is_baddbmm_on_strided_views(small, alpha, in_place, monkeypatch):
    monkeypatch.setattr(_linalg, "SMALL_PRODUCT_FLOPS", 1 << 30 if small else 0)
    generator = torch.Generator().manual_seed(int(small) + 2 * int(in_place))
    rows, cols, inner = 7, 3, 4
    whole = torch.randn(5, 2 * rows, cols, dtype=torch.float64, generator=generator)
    a = torch.randn(5, 2 * rows, inner, dtype=torch.float64, generator=generator)[:, :rows]
    b = torch.randn(5, inner, cols, dtype=torch.float64, generator=generator)
    base = whole[:, rows:]  # strided views, as the factors of a point are
    before = base.clone()
    out = base if in_place else torch.zeros_like(whole)[:, :rows]
    expected = torch.baddbmm(base, a, b, alpha=alpha)
    assert _linalg.add_product(out, base, a, b, alpha=alpha) is out
    assert torch.allclose(out, expected, rtol=0, atol=16 * EPS64 * float(expected.abs().max()))
    if not in_place:
        assert torch.equal(base, before)


@settings(max_examples=30, deadline=None)
@given(**gl_cases)
def test_riemannian_gradient_in_place_is_egrad2rgrad(metric, eps, batch, rank, seed, chunk):
    manifold, space, x, _, c = gl_case(metric, eps, batch, 4, 5, rank, seed)
    expected = manifold.egrad2rgrad(x, c)
    buffer = c.clone()
    with chunk_bytes(chunk):
        result = space.egrad2rgrad_(buffer)
    assert result is buffer
    scale = float(c.abs().max()) * (1 + float(x.abs().max())) ** 4
    assert torch.allclose(result, expected, rtol=0, atol=256 * EPS64 * scale)


def test_a_batch_slice_of_the_state_is_kept_and_sliced_from_the_whole_batch():
    manifold, space, x, u, _ = gl_case("inv", 0.0, (2, 3), 4, 5, 2, 0)
    state = space.state
    manifold._prepare(state)
    part = state.batch_slice(1, 4)
    assert state.batch_slice(1, 4) is part
    assert state.batch_slice(0, 4) is not part
    flat = x.flatten(0, 1)
    assert torch.equal(part.x, flat[1:4])
    for whole, sliced in zip(state.inverses, part.inverses):
        assert torch.equal(sliced, whole.flatten(0, 1)[1:4])
    assert "_batch_slices" not in part.__dict__
    vectors = u.flatten(0, 1)[1:4]
    expected = manifold.inner(flat[1:4], vectors)
    scale = float(expected.abs().max())
    sliced = manifold._inner(part, vectors, None, False)
    assert torch.allclose(sliced, expected, rtol=0, atol=64 * EPS64 * scale)


@settings(max_examples=40, deadline=None)
@given(**gl_cases, dtype=st.sampled_from([torch.float64, torch.float32]))
def test_gram_a_slice_at_a_time_is_the_matrix_of_inner_products(
    metric, eps, batch, rank, seed, chunk, dtype
):
    _, space, _, u, c = gl_case(metric, eps, batch, 4, 5, rank, seed, dtype)
    vectors = [u, space.proju(c), 2 * u - space.proju(c)]
    with chunk_bytes(chunk):
        gram = space.gram(vectors)
    pairwise = TangentSpace.gram(space, vectors)
    scale = float(pairwise.diagonal().max())
    assert gram.dtype == torch.float64
    assert torch.allclose(gram, pairwise, rtol=0, atol=256 * torch.finfo(dtype).eps * scale)
    assert torch.equal(gram, gram.mT)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_auto_pgd_with_the_explicit_retraction_follows_the_autograd_one(metric, monkeypatch):
    """The same iterates, to rounding, with the explicit retraction and pullback as with
    autograd through ``retr`` (forced by hiding ``retr_vjp``)."""
    generator = torch.Generator().manual_seed(3)
    manifold = gq.GLQuotient(5, 4, metric, eps=0.01)
    x = manifold.random(3, 9, 2, dtype=torch.float64)
    target = torch.randn(3, 5, 4, dtype=torch.float64, generator=generator)

    def objective(points):
        return (manifold.product(points[0]) - target).pow(2).sum()

    groups = [(x, manifold)]
    explicit = maximize_in_ball(groups, objective, rho=0.4, iters=15)
    monkeypatch.setattr(CachedTangentSpace, "retr_vjp", lambda self, u, out: None)
    plain = maximize_in_ball(groups, objective, rho=0.4, iters=15)
    assert explicit.history == pytest.approx(plain.history, rel=1e-11)
    assert explicit.value > explicit.initial_value
    for a, b in zip(explicit.xi, plain.xi):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "source, expected",
    [
        (torch.tensor([2, 0, 1]), True),
        (torch.tensor([], dtype=torch.long), True),
        (torch.tensor([0, 0, 2]), False),
        (torch.tensor([0, 1, 3]), False),
        (torch.tensor([-1, 0, 1]), False),  # would wrap around as an index
    ],
)
def test_a_permutation_is_recognised_without_sorting(source, expected):
    assert plan_module.is_permutation(source) is expected


# ---------------------------------------------------------------- strided write-back
@pytest.mark.parametrize(
    "positions, split",
    [
        (torch.arange(12), ((12,), (1,))),
        (torch.arange(12) * 3 + 5, ((12,), (3,))),
        (torch.arange(12).reshape(3, 4).mT.reshape(-1), ((4, 3), (1, 4))),
        (torch.tensor([7]), ((1,), (1,))),
        (
            torch.arange(24).reshape(2, 3, 4).permute(2, 0, 1).reshape(-1),
            ((4, 6), (1, 4)),
        ),  # (2, 3) merge
    ],
)
def test_affine_split_finds_the_strides(positions, split):
    assert strided.affine_split(positions) == split
    dims, steps = split
    view = torch.arange(100).as_strided(dims, steps, int(positions[0]))
    assert torch.equal(view.reshape(-1), positions)


@pytest.mark.parametrize(
    "positions", [torch.tensor([0, 1, 3]), torch.tensor([3, 2, 1]), torch.tensor([0, 2, 1, 4])]
)
def test_affine_split_refuses_irregular_positions(positions):
    assert strided.affine_split(positions) is None


def attention_model(dim: int, heads: int, layers: int, seed: int):
    torch.manual_seed(seed)
    return torch.nn.ModuleDict(
        {
            f"l{i}": torch.nn.ModuleDict(
                {k: torch.nn.Linear(dim, dim, bias=k != "o") for k in "qkvo"}
            )
            for i in range(layers)
        }
    ).double()


def attention_plan(model, dim: int, heads: int, layers: int, shuffle: bool):
    head_dim = dim // heads
    groups = []
    names = [f"l{i}" for i in range(layers)]

    def qk(*tensors):
        points = []
        for i in range(layers):
            wq, bq, wk, bk = tensors[4 * i : 4 * i + 4]
            g, h = head_rows(wq, heads, head_dim, bq), head_rows(wk, heads, head_dim, bk)
            points.append(torch.cat([g, h], dim=-2))
        return torch.stack(points)

    def vo(*tensors):
        points = []
        for i in range(layers):
            wv, bv, wo = tensors[3 * i : 3 * i + 3]
            g = head_rows(wv, heads, head_dim, bv)
            points.append(torch.cat([g, head_columns(wo, heads, head_dim)], dim=-2))
        return torch.stack(points)

    shapes = {n: p.shape for n, p in model.named_parameters()}
    qk_params = {
        f"{n}.{k}.{w}": shapes[f"{n}.{k}.{w}"]
        for n in names
        for k in "qk"
        for w in ("weight", "bias")
    }
    vo_params = {}
    for n in names:
        vo_params.update(
            {f"{n}.v.weight": shapes[f"{n}.v.weight"], f"{n}.v.bias": shapes[f"{n}.v.bias"]}
        )
        vo_params[f"{n}.o.weight"] = shapes[f"{n}.o.weight"]
    qk_params = dict(sorted(qk_params.items(), key=lambda kv: names.index(kv[0].split(".")[0])))
    manifold_qk = gq.GLQuotient(dim + 1, dim + 1, "inv")
    manifold_vo = gq.GLQuotient(dim + 1, dim, "mix")
    groups.append(SymmetryGroup.from_layout("qk", manifold_qk, qk_params, qk, kind="query-key"))
    groups.append(SymmetryGroup.from_layout("vo", manifold_vo, vo_params, vo, kind="value-output"))
    if shuffle:  # an irregular layout: the write-back falls back to the index map
        perm = torch.randperm(groups[1].index.numel(), generator=torch.Generator().manual_seed(0))
        index = groups[1].index.reshape(-1)[perm].reshape(groups[1].index.shape)
        groups[1] = SymmetryGroup(
            "vo", manifold_vo, groups[1].param_names, groups[1].param_shapes, index, "custom"
        )
    return SymmetryPlan(groups).bind(model)


@contextmanager
def min_entries_per_piece(size: int):
    saved, strided.MIN_ENTRIES_PER_PIECE = strided.MIN_ENTRIES_PER_PIECE, size
    try:
        yield
    finally:
        strided.MIN_ENTRIES_PER_PIECE = saved


def test_strided_copies_are_used_where_the_pieces_are_large_enough(monkeypatch):
    model = attention_model(8, 4, 2, seed=0)
    plan = attention_plan(model, 8, 4, 2, shuffle=False)
    base = dict(model.named_parameters())
    points = [p.detach() for p in plan.gather(base)]
    sources = [points[i] for i in plan._permutation[0]]
    calls = []
    monkeypatch.setattr(plan_module, "write_back", lambda *a: calls.append(a) or {})
    assert plan._strided.entries_per_piece < strided.MIN_ENTRIES_PER_PIECE
    assert not plan_module.fits_strided(plan._strided, sources)
    plan.scatter(points, base)
    assert calls == []
    with min_entries_per_piece(0):
        assert plan_module.fits_strided(plan._strided, sources)
        plan.scatter(points, base)
    assert len(calls) == 1


@settings(max_examples=15, deadline=None)
@given(
    dim_heads=st.sampled_from([(4, 2), (6, 3), (6, 1), (8, 4)]),
    layers=st.integers(1, 3),
    seed=st.integers(0, 100),
)
def test_strided_write_back_is_the_index_map_forward_backward_and_twice(dim_heads, layers, seed):
    dim, heads = dim_heads
    model = attention_model(dim, heads, layers, seed)
    plan = attention_plan(model, dim, heads, layers, shuffle=False)
    assert plan._strided is not None
    base = dict(model.named_parameters())
    points = [p.detach().clone() for p in plan.gather(base)]
    weights = {n: torch.randn(p.shape, dtype=p.dtype) for n, p in base.items()}

    def second_order(use_strided: bool):
        leaves = [p.clone().requires_grad_() for p in points]
        saved = plan.__dict__["_strided"]
        plan.__dict__["_strided"] = saved if use_strided else None
        try:
            with min_entries_per_piece(0):
                out = plan.scatter(leaves, base)
            loss = sum((torch.sin(out[n]) * weights[n]).sum() for n in out)
            grads = torch.autograd.grad(loss, leaves, create_graph=True)
            hvp = torch.autograd.grad(sum(g.pow(2).sum() for g in grads), leaves)
        finally:
            plan.__dict__["_strided"] = saved
        return out, grads, hvp

    strided_out, strided_grads, strided_hvp = second_order(True)
    index_out, index_grads, index_hvp = second_order(False)
    assert all(torch.equal(strided_out[n], index_out[n]) for n in base)
    assert all(torch.equal(a, b) for a, b in zip(strided_grads, index_grads))
    assert all(torch.allclose(a, b, rtol=1e-13, atol=0) for a, b in zip(strided_hvp, index_hvp))


def test_an_irregular_layout_is_written_back_with_the_index_map():
    model = attention_model(4, 2, 2, seed=0)
    plan = attention_plan(model, 4, 2, 2, shuffle=True)
    assert plan._permutation is not None and plan._strided is None
    base = dict(model.named_parameters())
    out = plan.scatter([p.detach() for p in plan.gather(base)], base)
    assert all(torch.equal(out[n], base[n]) for n in base)
