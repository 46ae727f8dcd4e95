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
@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(
        st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
    ),
    eps=st.sampled_from([0.0, 0.1]),
)
def test_fused_ball_has_the_joint_metric_and_splits_back(shapes, eps):
    generator = torch.Generator().manual_seed(len(shapes))
    points = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    manifold = gq.AdaptiveEuclidean(eps=eps)
    groups = [BallGroup(p, manifold) for p in points]
    ball = fusion.fuse_elementwise(groups)
    assert len(ball.groups) == (1 if len(groups) > 1 else len(groups))
    back = ball.unfuse([g.point for g in ball.groups])
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(back, points))
    xi = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in points]
    fused_xi = [torch.cat([v.reshape(-1) for v in xi])] if len(groups) > 1 else xi
    joint = sum(float(manifold.inner(p, v).sum()) for p, v in zip(points, xi))
    fused = sum(float(g.manifold.inner(g.point, v).sum()) for g, v in zip(ball.groups, fused_xi))
    assert math.isclose(fused, joint, rel_tol=64 * torch.finfo(torch.float64).eps)


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
    assert ball.groups[-1].point.shape == (24,)


@pytest.mark.parametrize("name", ["adaptive", "inv", "mix"])
def test_fusing_changes_the_value_only_by_rounding(name, monkeypatch):
    model, batches = tiny_bert()
    fused = measure(model, batches, name)
    monkeypatch.setattr(fusion, "MAX_ENTRIES_PER_TENSOR", 0)  # nothing fused
    separate = measure(model, batches, name)
    assert fused.value > 0
    # float64 sums in another order; the iterates' branch decisions are the same
    for a, b in zip(fused.per_batch, separate.per_batch):
        assert math.isclose(a, b, rel_tol=1e-9)
    for a, b in zip(fused.histories, separate.histories):
        assert a == pytest.approx(b, rel=1e-9)


def test_the_average_case_is_not_fused(monkeypatch):
    model, batches = tiny_bert()
    calls = []
    monkeypatch.setattr(
        fusion, "fuse_elementwise", lambda groups: calls.append(groups) or pytest.fail()
    )
    gq.adaptive_sharpness(model, loss_fn, batches, rho=0.1, iters=3, kind="average")
    assert not calls


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
