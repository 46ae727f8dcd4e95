"""What makes an Auto-PGD iteration cheap changes no value: fused element-wise groups and
the kept best gradient."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import geoopt_quotient as gq
from geoopt_quotient.sharpness import apgd, fusion
from geoopt_quotient.sharpness import measure as measure_module
from geoopt_quotient.sharpness.apgd import BallGroup, maximize_in_ball

pytestmark = [
    pytest.mark.filterwarnings("ignore::geoopt_quotient.ZeroSharpnessWarning"),
    pytest.mark.usefixtures("single_thread"),
]


def tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).double().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [
        (
            torch.randint(0, 50, (6, 8), generator=generator),
            torch.randint(0, 3, (6,), generator=generator),
        )
        for _ in range(2)
    ]
    return model, batches


def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(input_ids=batch[0]).logits, batch[1])


def measure(model, batches, name: str, **options):
    common = dict(rho=0.3, iters=12, progress=False, **options)
    if name == "adaptive":
        return gq.adaptive_sharpness(model, loss_fn, batches, **common)
    return gq.geodesic_sharpness(model, loss_fn, batches, metric=name, **common)


# ---------------------------------------------------------------- fusion
def fused_vector(ball, vectors):
    """The fused ball's vector holding ``vectors`` (one per original group), zero in the
    gaps: written through the views :meth:`FusedBall.unfuse` returns."""
    fused = [torch.zeros_like(g.point) for g in ball.groups]
    for piece, v in zip(ball.unfuse(fused), vectors):
        piece.copy_(v)
    return fused


def gaps(ball, fused):
    """The entries of the fused points that belong to no original group."""
    marks = [torch.ones_like(f) for f in fused]
    for piece in ball.unfuse(marks):
        piece.zero_()
    return torch.cat([f[m.bool()] for f, m in zip(fused, marks)])


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(
        st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
    ),
    eps=st.sampled_from([0.0, 0.1]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_fused_ball_has_the_joint_metric_and_splits_back(shapes, eps, dtype):
    generator = torch.Generator().manual_seed(len(shapes))
    points = [torch.randn(s, generator=generator, dtype=dtype) for s in shapes]
    manifold = gq.AdaptiveEuclidean(eps=eps)
    groups = [BallGroup(p, manifold) for p in points]
    ball = fusion.fuse_elementwise(groups)
    assert len(ball.groups) == (1 if len(groups) > 1 else len(groups))
    back = ball.unfuse([g.point for g in ball.groups])
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(back, points))
    if len(groups) > 1:  # each tensor starts on a cache line, as a tensor of its own
        base = ball.groups[0].point.data_ptr()
        assert all((b.data_ptr() - base) % apgd.ALIGNMENT == 0 for b in back)
        assert not gaps(ball, [g.point for g in ball.groups]).any()
    xi = [torch.randn(p.shape, generator=generator, dtype=dtype) for p in points]
    fused_xi = fused_vector(ball, xi)
    joint = sum(float(manifold.inner(p, v).sum()) for p, v in zip(points, xi))
    fused = sum(float(g.manifold.inner(g.point, v).sum()) for g, v in zip(ball.groups, fused_xi))
    assert math.isclose(fused, joint, rel_tol=64 * torch.finfo(dtype).eps)


def test_only_small_elementwise_groups_on_the_balls_own_path_are_fused():
    small = torch.randn(3, 4)
    large = torch.randn(fusion.MAX_ENTRIES_PER_TENSOR + 1)
    gl = gq.GLQuotient(3, 3)
    groups = [
        BallGroup(small, gq.AdaptiveEuclidean()),
        BallGroup(gl.random(2, 6, 2), gl),
        BallGroup(small.clone(), gq.AdaptiveEuclidean()),
        BallGroup(large, gq.AdaptiveEuclidean()),
        BallGroup(small.double(), gq.AdaptiveEuclidean()),  # another dtype: alone
        BallGroup(small.clone(), gq.AdaptiveEuclidean(), path=lambda x, u: x + u),
        BallGroup(small.clone(), gq.AdaptiveEuclidean(eps=0.5)),  # another eps: alone
    ]
    ball = fusion.fuse_elementwise(groups)
    assert ball._kept == [1, 3, 4, 5, 6]
    assert [f.members for f in ball._fused] == [[0, 2]]
    assert ball.groups[-1].point.shape == (28,)  # 12 entries, 4 of gap, 12


def test_only_quotient_groups_of_one_geometry_are_stacked():
    def group(n, m, rank=2, batch=(3,), **options):
        manifold = gq.GLQuotient(n, m, **options)
        return BallGroup(manifold.random(*batch, n + m, rank, dtype=torch.float64), manifold)

    groups = [
        group(5, 5),
        group(5, 4, batch=(2, 2)),  # fewer H rows: stacked, padded
        group(4, 5),  # another n: not
        group(5, 5, rank=3),  # another rank: not
        group(5, 5, metric="inv"),
        group(5, 5, eps=0.1),
        group(5, 3, batch=()),  # a single point
        BallGroup(torch.randn(4, 4), gq.AdaptiveEuclidean()),
        BallGroup(torch.randn(2), gq.AdaptiveEuclidean()),
    ]
    ball = fusion.fuse_groups(groups)
    assert ball._kept == [2, 3, 4, 5]
    assert [f.members for f in ball._fused] == [[0, 1, 6], [7, 8]]
    stacked = ball.groups[4]
    assert stacked.point.shape == (3 + 4 + 1, 10, 2)
    assert (stacked.manifold.n, stacked.manifold.m) == (5, 5)
    back = ball.unfuse([g.point for g in ball.groups])
    assert all(torch.equal(a, g.point) for a, g in zip(back, groups))
    assert not gaps(ball, [g.point for g in ball.groups]).any()
    large = group(5, 5, batch=(fusion.MAX_ENTRIES_PER_TENSOR // 20 + 1,))
    assert len(fusion.fuse_quotients([large, group(5, 5)]).groups) == 2


@settings(max_examples=25, deadline=None)
@given(
    metric=st.sampled_from(["inv", "mix"]),
    eps=st.sampled_from([0.0, 0.05]),
    rows=st.lists(st.integers(3, 6), min_size=2, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_stacked_quotients_have_the_joint_geometry_and_keep_the_padding_zero(
    metric, eps, rows, seed
):
    """Metric, horizontal projection, Riemannian gradient, retraction and its pullback of
    the stacked group are those of the groups, and the padding rows stay exactly 0."""
    torch.manual_seed(seed)
    n, rank = 4, 3
    manifolds = [gq.GLQuotient(n, m, metric=metric, eps=eps) for m in rows]
    points = [mf.random(2, n + mf.m, rank, dtype=torch.float64) for mf in manifolds]
    ball = fusion.fuse_quotients([BallGroup(x, mf) for x, mf in zip(points, manifolds)])
    ((x, stacked),) = [(g.point, g.manifold) for g in ball.groups]
    spaces = [mf.tangent_space(p) for mf, p in zip(manifolds, points)]
    space = stacked.tangent_space(x)

    def horizontal():
        return [0.1 * s.proju(torch.randn_like(p)) for s, p in zip(spaces, points)]

    def close(fused, separate):
        pieces = ball.unfuse([fused])
        assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(pieces, separate))
        assert torch.equal(gaps(ball, [fused]), torch.zeros_like(gaps(ball, [fused])))

    xs = [horizontal() for _ in range(3)]
    fused = [fused_vector(ball, v)[0] for v in xs]
    joint = sum(s.gram([v[i] for v in xs]) for i, s in enumerate(spaces))
    assert torch.allclose(space.gram(fused), joint, rtol=1e-10, atol=1e-14)
    close(space.proju(fused[0]), [s.proju(v) for s, v in zip(spaces, xs[0])])
    egrads = [torch.randn_like(p) for p in points]
    close(
        space.egrad2rgrad_(fused_vector(ball, egrads)[0]),
        [s.egrad2rgrad(g) for s, g in zip(spaces, egrads)],
    )
    out = torch.empty_like(x)
    retracted, pullback = space.retr_vjp(fused[0], out)
    close(retracted, [s.retr(v) for s, v in zip(spaces, xs[0])])
    cotangents = [torch.randn_like(p) for p in points]
    separate = []
    for s, v, c in zip(spaces, xs[0], cotangents):
        _, member_pullback = s.retr_vjp(v, torch.empty_like(v))
        separate.append(member_pullback(c.clone()))
    close(pullback(fused_vector(ball, cotangents)[0]), separate)


@pytest.mark.parametrize("name", ["adaptive", "inv", "mix"])
def test_flat_layout_changes_the_value_only_by_rounding(name, monkeypatch):
    """The flat buffers against the reference: one ball group per plan group, written
    back into the parameters by the plan."""
    model, batches = tiny_bert()
    flat = measure(model, batches, name)
    monkeypatch.setattr(measure_module, "BallLayout", lambda *args: None)  # no layout
    separate = measure(model, batches, name)
    assert flat.value > 0
    # float64 sums in another order; the iterates' branch decisions are the same
    for a, b in zip(flat.per_batch, separate.per_batch):
        assert math.isclose(a, b, rel_tol=1e-9)
    for a, b in zip(flat.histories, separate.histories):
        assert a == pytest.approx(b, rel=1e-9)


def test_the_average_case_has_no_flat_layout(monkeypatch):
    model, batches = tiny_bert()
    calls = []
    make = measure_module.BallLayout
    monkeypatch.setattr(
        measure_module, "BallLayout", lambda *args: calls.append(args) or make(*args)
    )
    gq.adaptive_sharpness(model, loss_fn, batches, rho=0.1, iters=3, kind="average")
    assert not calls
    gq.adaptive_sharpness(model, loss_fn, batches, rho=0.1, iters=3)  # the worst case has
    assert calls


# ---------------------------------------------------------------- the best gradient
def restarting_objective():
    """A concave quadratic with a ridge: Auto-PGD overshoots, halves and restarts."""
    a = torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64)
    target = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)
    calls = {"grad": 0}

    def objective(points):
        (x,) = points
        if x.requires_grad:
            calls["grad"] += 1
        return -(a * (x - target) ** 2).sum() + torch.cos(7 * x).sum()

    return objective, calls


@pytest.mark.parametrize("iters", [5, 20, 40])
def test_kept_best_gradient_gives_the_same_iterates_with_fewer_passes(iters):
    point = torch.ones(3, dtype=torch.float64)
    runs = {}
    for keep in (False, True):
        objective, calls = restarting_objective()
        result = maximize_in_ball(
            [(point, gq.AdaptiveEuclidean())],
            objective,
            rho=1.0,
            iters=iters,
            path="straight",
            keep_best_gradient=keep,
        )
        assert result.gradients == calls["grad"]
        runs[keep] = result
    recomputed, kept = runs[False], runs[True]
    assert kept.history == recomputed.history  # bitwise: the same gradient, kept
    assert torch.equal(kept.xi[0], recomputed.xi[0])
    restarts = recomputed.gradients - iters
    assert kept.gradients == iters and kept.evaluations == iters + 1
    assert recomputed.evaluations == iters + 1 + restarts
    if iters >= 20:
        assert restarts > 0  # the case this test is about happened


def test_best_gradient_kept_by_default_only_for_small_balls(monkeypatch):
    objective, _ = restarting_objective()
    point = torch.ones(3, dtype=torch.float64)
    args = dict(rho=1.0, iters=20, path="straight")
    small = maximize_in_ball([(point, gq.AdaptiveEuclidean())], objective, **args)
    assert small.gradients == 20
    monkeypatch.setattr(apgd, "KEEP_GRADIENT_MAX_BYTES", 8 * 3 - 1)
    large = maximize_in_ball([(point, gq.AdaptiveEuclidean())], objective, **args)
    assert large.gradients > 20 and large.history == small.history


@pytest.mark.parametrize("name", ["adaptive", "mix"])
def test_sharpness_reports_one_backward_pass_per_iteration(name):
    model, batches = tiny_bert()
    result = measure(model, batches, name)
    assert result.backward_passes == [12, 12] and result.forward_passes == [13, 13]
    recomputed = measure(model, batches, name, keep_best_gradient=False)
    assert recomputed.per_batch == result.per_batch
    assert all(b >= 12 for b in recomputed.backward_passes)


# ---------------------------------------------------------------- the update in one combination
def random_ball_vector(ball, generator, radius):
    return ball.clip([v * radius for v in ball.random(generator, 1.0)])


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float64, torch.float32]),
    metric=st.sampled_from(["inv", "mix"]),
    alpha=st.sampled_from([1.0, 0.75, 0.3]),
    step_over_rho=st.floats(0.01, 3.0),
    radii=st.tuples(st.floats(0.0, 1.5), st.floats(0.0, 1.5)),
    seed=st.integers(0, 2**16),
)
def test_update_as_one_combination_is_the_formulas_up_to_rounding(
    dtype, metric, alpha, step_over_rho, radii, seed
):
    """ξ_next = w₁ξ + w₂g + w₃ξ_prev with weights from the Gram matrix equals the step by
    step update (ascent step, clip, momentum, clip) to the dtype's rounding, on a joint
    ball of an element-wise group, with frozen entries, and a GL(h) quotient group."""
    from test_sharpness import formula_update

    generator = torch.Generator().manual_seed(seed)
    gl = gq.GLQuotient(5, 4, metric)
    weights = torch.randn(7, 3, generator=generator, dtype=dtype)
    weights[0, 0] = 0.0  # a frozen entry
    groups = [
        BallGroup(weights, gq.AdaptiveEuclidean()),
        BallGroup(gl.random(2, 9, 2, dtype=dtype), gl),
    ]
    rho = 0.7
    ball, _ = apgd._prepare(groups, rho, "second_order")
    xi = random_ball_vector(ball, generator, radii[0] * rho)
    xi_prev = random_ball_vector(ball, generator, radii[1] * rho)
    rgrads = ball.random(generator, 3.0)  # horizontal, zero where frozen
    step = step_over_rho * rho
    expected = formula_update(ball, xi, xi_prev, rgrads, step, alpha)
    out = [torch.empty_like(v) for v in xi]
    got, grad_norm = apgd._apgd_update(ball, xi, xi_prev, rgrads, step, alpha, out)
    assert got is out
    tol = 64 * torch.finfo(dtype).eps * rho
    for a, b in zip(got, expected):
        assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()) / rho)
    assert float(ball.norm(got)) <= rho * (1 + 64 * torch.finfo(dtype).eps)
    assert math.isclose(float(grad_norm), float(ball.norm(rgrads)), rel_tol=64 * 1e-7)
    # in place into the previous iterate, as the loop does when nothing else holds it
    in_place = [v.clone() for v in xi_prev]
    apgd._apgd_update(ball, xi, in_place, rgrads, step, alpha, in_place)
    assert all(torch.equal(a, b) for a, b in zip(in_place, got))


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(1, 700),
    block=st.sampled_from([7, 64, 1 << 16]),
    eps=st.sampled_from([0.0, 0.1]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_adaptive_gram_is_the_matrix_of_inner_products(size, block, eps, dtype, seed):
    from geoopt_quotient.manifolds import adaptive

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=generator, dtype=dtype)
    x[::5] = 0.0  # frozen where eps = 0
    manifold = gq.AdaptiveEuclidean(eps=eps)
    space = manifold.tangent_space(x)
    vectors = [space.random(generator) for _ in range(3)]
    old_block, adaptive.GRAM_BLOCK = adaptive.GRAM_BLOCK, block
    try:
        gram = space.gram(vectors)
    finally:
        adaptive.GRAM_BLOCK = old_block
    assert gram.dtype == torch.float64 and gram.shape == (3, 3)
    expected = torch.tensor(
        [[float(manifold.inner(x, u, v).sum()) for v in vectors] for u in vectors],
        dtype=torch.float64,
    )
    scale = float(expected.diagonal().max())
    tol = 8 * (size + 8) * torch.finfo(dtype).eps * scale  # sums of size terms
    assert torch.allclose(gram, expected, rtol=0, atol=tol)


def test_riemannian_gradient_in_place_has_the_same_values_and_copies_what_it_cannot_own():
    x = torch.randn(40, 30, dtype=torch.float64)
    space = gq.AdaptiveEuclidean().tangent_space(x)
    egrad = torch.randn(40, 30, dtype=torch.float64)
    expected = space.egrad2rgrad(egrad)
    buffer = egrad.clone()
    assert space.egrad2rgrad_(buffer) is buffer and torch.equal(buffer, expected)
    transposed = egrad.t().contiguous().t()  # not contiguous: a new tensor, input unchanged
    before = transposed.clone()
    result = space.egrad2rgrad_(transposed)
    assert result is not transposed and torch.equal(transposed, before)
    assert torch.equal(result, expected)


def shared_gradient_objective(points):
    """Autograd hands the same gradient tensor to both points (the backward of a sum)."""
    return torch.sin(points[0] + points[1]).pow(2).sum()


def test_gradients_autograd_shares_between_points_are_not_overwritten():
    """The Riemannian gradient is written into the gradient's buffer: where autograd
    gives two leaves one tensor, the second gets a copy, and the iterates are those of
    the out-of-place loop."""
    from test_sharpness import gram_update, textbook_apgd

    torch.manual_seed(0)
    groups = [
        (torch.randn(6, 5, dtype=torch.float64), gq.AdaptiveEuclidean()),
        (torch.randn(6, 5, dtype=torch.float64), gq.AdaptiveEuclidean()),
    ]
    kwargs = dict(rho=0.5, iters=15)
    value, xi, history = textbook_apgd(
        groups, shared_gradient_objective, update=gram_update, **kwargs
    )
    result = maximize_in_ball(groups, shared_gradient_objective, **kwargs)
    assert (result.value, result.history) == (value, history)
    assert all(torch.equal(a, b) for a, b in zip(result.xi, xi))


def test_straight_path_gradient_and_value_are_those_of_x_plus_xi():
    """The perturbed point written into the ball's buffer and differentiated there gives
    the value and gradient of x + ξ differentiated in ξ, bit for bit, at every call."""
    torch.manual_seed(0)
    point = torch.randn(8, 5, dtype=torch.float64)
    a = torch.randn(5, dtype=torch.float64)

    def objective(points):
        return torch.tanh(points[0] @ a).pow(3).sum()

    ball, paths = apgd._prepare([(point, gq.AdaptiveEuclidean())], 1.0, "second_order")
    assert paths[0] is apgd._straight
    autocast = apgd.AutocastState.capture()
    for seed in range(3):
        xi = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        value, (grad,) = apgd._evaluate(ball, paths, objective, [xi], True, autocast)
        leaf = xi.clone().requires_grad_()
        expected_value = objective([point + leaf])
        (expected_grad,) = torch.autograd.grad(expected_value, leaf)
        assert torch.equal(value, expected_value.detach()) and torch.equal(grad, expected_grad)


@pytest.mark.parametrize("keep, most", [(False, 2), (True, 3)])
def test_iterates_reuse_their_buffers(keep, most):
    """Over 40 iterations with restarts Auto-PGD allocates the zero start, the perturbed
    point and, with the kept gradient, the first update's output, and nothing more: the
    next iterate is written over the previous one or over the gradient, and where the
    best iterate holds both (after a restart) over the iterate the restart left."""
    objective, _ = restarting_objective()
    allocations = []
    original = apgd._joint_buffer

    def counted(*args, **kwargs):
        allocations.append(1)
        return original(*args, **kwargs)

    point = torch.ones(3, dtype=torch.float64)
    try:
        apgd._joint_buffer = counted
        result = maximize_in_ball(
            [(point, gq.AdaptiveEuclidean())],
            objective,
            rho=1.0,
            iters=40,
            keep_best_gradient=keep,
        )
    finally:
        apgd._joint_buffer = original
    assert result.gradients >= 40
    assert len(allocations) <= most
