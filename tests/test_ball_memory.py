"""The ball's memory beside the model: one staging buffer for the symmetry groups, and
the model's parameters left in their own storages (a reference the user holds to one of
them keeps aliasing it, which the stale-reference check relies on)."""

from __future__ import annotations

import pytest
import torch
from test_ball_norm import tiny_bert as bert_and_batch

import geoopt_quotient as gq
from geoopt_quotient.sharpness.ball import LocalBall
from geoopt_quotient.sharpness.measure import resolve_plan


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return bert_and_batch(torch.float32)[0]


def loss_fn(model, batch):
    return model(**batch).loss


BATCH = {"input_ids": torch.tensor([[1, 5, 7, 2], [3, 4, 9, 8]]), "labels": torch.tensor([0, 2])}


def owns_storage(p: torch.Tensor) -> bool:
    return p.untyped_storage().nbytes() == p.numel() * p.element_size()


def open_ball(model, measure):
    plan = (
        gq.SymmetryPlan().bind(model)
        if measure == "adaptive"
        else resolve_plan(model, None, measure)
    )
    return LocalBall(
        model, plan, loss_fn, kind="worst", path="second_order", norm=True, keep_best_gradient=None
    )


@pytest.mark.parametrize("measure", ["adaptive", "inv"])
def test_the_parameters_keep_their_storages_through_a_worst_case_call(measure):
    model = tiny_bert()
    storages = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    alias = model.classifier.weight.detach()
    call = gq.adaptive_sharpness if measure == "adaptive" else gq.geodesic_sharpness
    call(model, loss_fn, [BATCH], rho=0.01, iters=2, progress=False)
    assert {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()} == storages
    assert alias.data_ptr() == model.classifier.weight.data_ptr()


def test_joined_points_and_flat_gradient_share_one_buffer():
    """The unfused groups' staging: one buffer, as large as the larger of its two uses."""
    ball = open_ball(tiny_bert(), "inv")
    layout = ball.layout
    (rest,) = layout._rests
    points = rest.perturbed_points()
    gradient = layout.gradient_buffers(None)[-1]
    assert points[0].data_ptr() == gradient.data_ptr() == rest.scratch().data_ptr()
    joined = sum(p.numel() for p in points)
    assert rest.scratch().numel() == max(joined, rest.flat.size)
