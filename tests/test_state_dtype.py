"""Auto-PGD's state in bfloat16 (``state_dtype=torch.bfloat16``): which vectors it stores
so, that they are computed in float32 and rounded once, and what it saves."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TinyTransformer
from test_ball_norm import tiny_bert

import geoopt_quotient as gq
from geoopt_quotient.manifolds.tangent import tangent_space
from geoopt_quotient.sharpness.apgd import (
    NormError,
    check_state_dtype,
    combine_,
    prepare_ball,
    state_dtype_for,
)
from geoopt_quotient.sharpness.ball import LocalBall
from geoopt_quotient.sharpness.engine import Search
from geoopt_quotient.sharpness.measure import resolve_plan

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


def test_state_dtype_names_and_refusals():
    assert check_state_dtype(None) is None
    assert check_state_dtype("bfloat16") is BF16 and check_state_dtype(F32) is F32
    with pytest.raises(ValueError, match="subnormals: use bfloat16"):
        check_state_dtype(torch.float16)
    with pytest.raises(ValueError, match="must be None or one of bfloat16, float32, float64"):
        check_state_dtype("int8")


@pytest.mark.parametrize(
    ("point", "requested", "stored"),
    [
        (BF16, None, F32),
        (BF16, BF16, BF16),
        (BF16, F32, F32),
        (torch.float16, BF16, F32),  # only bfloat16 points keep a bfloat16 state
        (F32, BF16, F32),
        (F32, None, F32),
        (F64, None, F64),
        (F64, BF16, F64),
        (F64, F32, F64),
    ],
)
def test_which_points_store_their_state_in_which_dtype(point, requested, stored):
    assert state_dtype_for(point, requested) is stored


def test_a_state_more_precise_than_the_arithmetic_is_refused():
    with pytest.raises(ValueError, match=r"more precise than the torch\.float32 arithmetic"):
        state_dtype_for(F32, F64)
    with pytest.raises(ValueError, match="more precise"):
        prepare_ball([(torch.ones(4), gq.AdaptiveEuclidean(ndim=1))], 0.1, "straight", None, F64)


def test_state_dtype_is_for_the_worst_case_only():
    with pytest.raises(ValueError, match="kind='worst'"):
        Search(kind="average", iters=2, path="straight", seed=0, norm=True, state_dtype=BF16)
    assert Search("worst", 2, "straight", 0, True, state_dtype="bfloat16").state_dtype is BF16


def test_a_bfloat16_ball_stores_half_the_bytes_and_computes_in_float32():
    w = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(BF16)
    groups = [(w, gq.AdaptiveEuclidean(ndim=1))]
    full, _ = prepare_ball(groups, 0.1, "straight")
    half, _ = prepare_ball(groups, 0.1, "straight", None, BF16)
    assert (full.dtypes, half.dtypes, half.compute_dtypes) == ([F32], [BF16], [F32])
    assert half.vector_bytes() * 2 == full.vector_bytes()
    assert half.zeros()[0].dtype is BF16
    # the rounding of the state widens the margin of the radial scaling by 2^-8
    assert half.norm_error.combination - full.norm_error.combination == pytest.approx(
        2.0**-8, rel=1e-3
    )
    assert half.norm_error.gram == full.norm_error.gram


def test_combine_computes_in_the_weights_dtype_and_rounds_once():
    g = torch.Generator().manual_seed(1)
    vectors = [torch.randn(700_000, generator=g).to(BF16) for _ in range(3)]
    weights = tuple(torch.tensor(w) for w in (0.3, -1.7, 0.55))
    out = torch.empty(700_000, dtype=BF16)
    combine_(out, tuple(vectors), weights)
    a, b, c = (v.float() for v in vectors)
    expected = c.mul(weights[2]).addcmul_(a, weights[0]).addcmul_(b, weights[1]).to(BF16)
    assert torch.equal(out, expected)
    # computed in bfloat16 instead, the sums would round three times: not the same
    in_bf16 = (vectors[2] * 0.55 + vectors[0] * 0.3 + vectors[1] * -1.7).to(BF16)
    assert not torch.equal(out, in_bf16)


def test_a_written_perturbed_point_adds_the_rounded_iterate():
    g = torch.Generator().manual_seed(2)
    x, a, b, c = (torch.randn(300_000, generator=g).to(BF16) for _ in range(4))
    out, buffer = torch.empty_like(x), torch.empty_like(x)
    weights = tuple(torch.tensor(w) for w in (1.1, 0.2, -0.4))
    combine_(out, (a, b, c), weights, (x, buffer))
    assert torch.equal(buffer, x + out)


def test_adaptive_gram_sweep_of_bfloat16_vectors_is_that_of_the_stored_entries():
    r"""The gradient rescaled in place (rounded to bfloat16 once), the Gram matrix of the
    vectors as stored, summed in float32: within the rounding that the ball's margin
    allows for (:class:`NormError`: :math:`\delta_G \sqrt{G_{ii} G_{jj}}`), which sums
    in bfloat16 exceed tenfold. An entry's own relative error is no measure: the
    vectors' cross products cancel to a small part of their diagonals' scale, and how
    much depends on the CPU's order of summation."""
    manifold = gq.AdaptiveEuclidean(ndim=1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(600_000, generator=g).to(BF16)
    xi, grad, prev = (torch.randn(600_000, generator=g).to(BF16) * 1e-3 for _ in range(3))
    before = grad.clone()
    space = tangent_space(manifold, x)
    rgrad, gram = space.egrad2rgrad_gram_((xi, grad, prev), 1)
    assert rgrad is grad and rgrad.dtype is BF16
    c2 = x.float().abs() ** 2
    assert torch.equal(rgrad, (before.float() * c2).to(BF16))
    stored = torch.stack([xi, rgrad, prev]).double() / x.double().abs()
    exact = stored @ stored.T
    scale = exact.diagonal().sqrt().outer(exact.diagonal().sqrt())
    allowed = NormError.of([torch.float32], x.numel()).gram * scale
    assert ((gram.double() - exact).abs() <= allowed).all()


def tiny_bert_bf16():
    torch.manual_seed(0)
    return tiny_bert(BF16)[0]


@pytest.mark.parametrize("measure", ["adaptive", "inv", "mix"])
def test_layout_counts_two_bytes_per_entry_of_a_bfloat16_state(measure):
    model = tiny_bert_bf16()
    plan = gq.SymmetryPlan().bind(model) if measure == "adaptive" else None
    plan = plan or resolve_plan(model, None, measure)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the bfloat16 model's resolution
        ball = LocalBall(
            model,
            plan,
            lambda m, b: m(**b).loss,
            kind="worst",
            path="second_order",
            norm=True,
            keep_best_gradient=False,
        )
    full = ball.layout.bytes_per_parameter(keep_best_gradient=True)
    half = ball.layout.bytes_per_parameter(keep_best_gradient=True, state_dtype=BF16)
    assert full["iterates"] == pytest.approx(12.0, rel=1e-2)
    assert half["iterates"] == pytest.approx(6.0, rel=1e-2)
    assert half["gradients"] == pytest.approx(4.0, rel=1e-2)
    halved = (full["iterates"] + full["gradients"]) / 2
    assert half["total"] == pytest.approx(full["total"] - halved, rel=1e-12)
    # not kept: the gradient in the layout's own vector, in the parameters' dtype
    lent = ball.layout.bytes_per_parameter(keep_best_gradient=False, state_dtype=BF16)
    assert lent["gradients"] < (0.01 if measure == "adaptive" else 2.0)
    assert lent["total"] == pytest.approx(half["total"] - half["gradients"] + lent["gradients"])


def float_loss(model, batch):
    tokens, labels = batch
    return torch.nn.functional.cross_entropy(model(tokens).float(), labels)


def test_a_bfloat16_state_is_recorded_and_differs_from_the_float32_state():
    """The same bfloat16 model and batch: the state's rounding changes the search (not
    the clean loss), within a few bfloat16 units of the sharpness."""
    torch.manual_seed(0)
    model = TinyTransformer().to(BF16)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 11, (16, 6), generator=g), torch.randint(0, 2, (16,))
    batches = [(tokens, labels)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        full = gq.adaptive_sharpness(model, float_loss, batches, rho=0.2, iters=6)
        half = gq.adaptive_sharpness(
            model, float_loss, batches, rho=0.2, iters=6, state_dtype="bfloat16"
        )
    assert half.settings["state_dtype"] == "bfloat16" and "state_dtype" not in full.settings
    assert half.clean_losses == full.clean_losses
    assert half.value != full.value
    assert abs(half.value - full.value) <= 16 * 2.0**-8 * full.value


def test_a_monitor_passes_the_state_dtype_on():
    from geoopt_quotient.integrations import SharpnessMonitor

    torch.manual_seed(0)
    model = TinyTransformer().to(BF16)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 11, (8, 6), generator=g), torch.randint(0, 2, (8,), generator=g))
    monitor = SharpnessMonitor(
        [batch], 1, ["adaptive", "geodesic_mix"], loss_fn=float_loss, iters=2, state_dtype=BF16
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        monitor.step(model, 1)
    assert {r.settings["state_dtype"] for r in monitor.results.values()} == {"bfloat16"}
