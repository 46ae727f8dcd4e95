"""Every perturbation Auto-PGD evaluates lies in the ball, its norm recomputed from its entries.

The updates scale each iterate by a norm computed from a Gram matrix, and write it with
rounding; :class:`~geoopt_quotient.sharpness.apgd.NormError` leaves room for both. Here
every evaluated perturbation (the first iterate, the updates, the restarts) and the one
reported are recorded, and their norms recomputed directly, in the vectors' dtype and in
float64 from the same entries: none may exceed the radius, and the margin must stay
small (the ball is reached). A bfloat16 state (``state_dtype=torch.bfloat16`` at bfloat16
points) rounds every written entry once more, which the margin covers too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import geoopt_quotient as gq
from geoopt_quotient.manifolds._linalg import compute_dtype
from geoopt_quotient.sharpness.apgd import BallGroup, NormError
from geoopt_quotient.sharpness.ball import LocalBall
from geoopt_quotient.sharpness.measure import resolve_plan

DTYPES = [torch.float32, torch.float64]
#: (points' dtype, state_dtype): the default state of float32 and float64 points, and
#: bfloat16 points with a bfloat16 state
STATES = [(torch.float32, None), (torch.float64, None), (torch.bfloat16, torch.bfloat16)]
STATE_IDS = ["float32", "float64", "bfloat16-state"]


class Recording:
    """An objective with the layout's evaluation, recording each evaluated perturbation."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def perturbed_buffer(self, index):
        return self.inner.perturbed_buffer(index)

    def evaluate_ball(self, ball, paths, xi, grad, autocast, recycled=None, own_vector=False):
        self.seen.append([v.detach().clone() for v in xi])
        return self.inner.evaluate_ball(ball, paths, xi, grad, autocast, recycled, own_vector)

    def owns(self, vector):
        return self.inner.owns(vector)


def norms(groups, xi):
    """``|xi|_x`` recomputed from the entries: in their dtype's arithmetic (float32 for
    bfloat16 entries: a result rounded to bfloat16 would round a norm on the sphere up to
    ``bfloat16(rho) > rho`` half the time), and in float64."""

    def own_inner(g, v):
        dtype = compute_dtype(v.dtype)
        return g.manifold.inner(g.point.to(dtype), v.to(dtype), v.to(dtype)).sum()

    own = sum(own_inner(g, v) for g, v in zip(groups, xi))
    wide = sum(
        g.manifold.inner(g.point.double(), v.double(), v.double()).sum() for g, v in zip(groups, xi)
    )
    return float(own.clamp_min(0).sqrt()), float(wide.clamp_min(0).sqrt())


def assert_in_ball(groups, evaluated, reported, rho, dtype, state_dtype=None):
    """No evaluated or reported perturbation outside the ball; the largest one on its
    sphere but for the margin (below 1e-3 of the radius; 1e-2 with a bfloat16 state)."""
    largest = 0.0
    stored = state_dtype or compute_dtype(dtype)
    for xi in [*evaluated, reported]:
        assert all(v.dtype == stored for v in xi)
        own, wide = norms(groups, xi)
        assert own <= rho and wide <= rho, (own / rho - 1, wide / rho - 1)
        largest = max(largest, wide)
    entries = max(g.point.numel() for g in groups)
    error = NormError.of([compute_dtype(dtype)], entries, [stored])
    assert largest >= rho * (1 - 2 * (error.gram + error.combination)), largest / rho


@pytest.mark.parametrize(("dtype", "state_dtype"), STATES, ids=STATE_IDS)
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16), rho=st.floats(1e-3, 10.0), init=st.sampled_from(["zero", "random"])
)
def test_linear_model_iterates_stay_in_the_ball(dtype, state_dtype, seed, rho, init):
    """A linear objective over the adaptive ball: the iterates sit on its sphere."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(3000, generator=generator).to(dtype)
    g = torch.randn(3000, generator=generator).to(dtype)
    seen = []

    def path(x, u):
        seen.append([u.detach().clone()])
        return x + u

    groups = [BallGroup(w, gq.AdaptiveEuclidean(), path)]
    result = gq.maximize_in_ball(
        groups,
        lambda points: (points[0].to(compute_dtype(dtype)) * g).sum(),
        rho=rho,
        iters=6,
        init=init,
        seed=seed,
        state_dtype=state_dtype,
    )
    assert len(seen) == result.evaluations
    assert_in_ball(groups, seen, result.xi, rho, dtype, state_dtype)


def tiny_bert(dtype):
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=48,
        num_labels=3,
        initializer_range=0.2,
    )
    model = transformers.BertForSequenceClassification(config).to(dtype).eval()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": torch.tensor([0, 2])}


def tiny_llama(dtype):
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        initializer_range=0.2,
    )
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


RADII = {"adaptive": 0.2, "inv": 0.05, "mix": 0.01}


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "state_dtype"), STATES, ids=STATE_IDS)
@pytest.mark.parametrize("measure", list(RADII))
@pytest.mark.parametrize("build", [tiny_bert, tiny_llama])
def test_model_iterates_stay_in_the_ball(build, measure, dtype, state_dtype):
    """The engine's layout (fused adaptive buffers, stacked quotient groups): every
    evaluated perturbation, over seeds and both starts, in the ball."""
    for seed, init in ((0, "zero"), (1, "random"), (2, "random")):
        torch.manual_seed(seed)
        model, batch = build(dtype)
        if measure == "adaptive":
            plan = gq.SymmetryPlan().bind(model)
        else:
            plan = resolve_plan(model, None, measure)
        with warnings.catch_warnings():  # a bfloat16 model's resolution, warned of
            warnings.simplefilter("ignore", UserWarning)
            ball = LocalBall(
                model,
                plan,
                lambda m, b: m(**b).loss.float(),
                kind="worst",
                path="second_order",
                norm=True,
                keep_best_gradient=seed == 1,
            )
        objective = Recording(ball.objective(batch))
        result = gq.maximize_in_ball(
            ball.groups,
            objective,
            rho=RADII[measure],
            iters=6,
            seed=seed,
            init=init,
            state_dtype=state_dtype,
        )
        assert len(objective.seen) == result.evaluations
        rho = RADII[measure]
        assert_in_ball(ball.groups, objective.seen, result.xi, rho, dtype, state_dtype)
