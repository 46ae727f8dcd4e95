"""The ball's memory beside the model: the fused base point is the model's own parameters.

:meth:`~geoopt_quotient.sharpness.layout.BallLayout.share_base` makes the parameters of
the fused adaptive groups views of the base point for the duration of the ball, and
gives them storages of their own back afterwards; ties between parameters are kept, and
no value changes.
"""

from __future__ import annotations

import gc

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
def test_fused_parameters_are_views_of_the_base_point_while_the_ball_is_open(measure):
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ball = open_ball(model, measure)
    layout = ball.layout
    points = {g.point.untyped_storage().data_ptr() for g in layout.groups}
    shared = [n for n, p in model.named_parameters() if p.untyped_storage().data_ptr() in points]
    assert shared and len(shared) == len(layout._shared)
    fused = {n for flat in layout._fused for n in flat.names}
    assert set(shared) == fused  # every fused parameter, nothing else
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    parts = layout.bytes_per_parameter(keep_best_gradient=False)
    if measure == "adaptive":
        assert parts["base"] == 0.0
    value = gq.maximize_in_ball(ball.groups, ball.objective(BATCH), rho=0.1, iters=3).value
    ball.close()
    assert all(owns_storage(p) for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    ball.close()  # a second close changes nothing
    assert all(owns_storage(p) for p in model.parameters())
    # the same run on a model that keeps its own storages: the same value, bit for bit
    again = open_ball(tiny_bert(), measure)
    again.layout.release()
    assert (
        gq.maximize_in_ball(again.groups, again.objective(BATCH), rho=0.1, iters=3).value == value
    )


def test_parameters_own_their_storage_after_a_sharpness_call():
    model = tiny_bert()
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    first = gq.adaptive_sharpness(model, loss_fn, [BATCH], rho=0.1, iters=3, progress=False)
    gc.collect()
    assert all(owns_storage(p) for p in model.parameters())
    assert any(p.data_ptr() != pointers[n] for n, p in model.named_parameters())
    second = gq.adaptive_sharpness(model, loss_fn, [BATCH], rho=0.1, iters=3, progress=False)
    assert first.value == second.value


def test_parameters_that_share_a_storage_keep_it():
    """Two parameters on one storage (a tie the model made by hand) are left as they are,
    and so is a parameter that is a view of a larger buffer."""
    model = tiny_bert()
    classifier = model.classifier
    flat = torch.zeros(classifier.weight.numel() + 8)
    flat[: classifier.weight.numel()] = classifier.weight.detach().reshape(-1)
    classifier.weight = torch.nn.Parameter(
        flat[: classifier.weight.numel()].view_as(classifier.weight)
    )
    dense = model.bert.pooler.dense
    dense.bias = torch.nn.Parameter(dense.weight.detach()[0].clone())
    dense.register_buffer("bias_alias", dense.bias.detach())
    ball = open_ball(model, "adaptive")
    shared = {id(p) for p in ball.layout._shared}
    assert id(classifier.weight) not in shared and id(dense.bias) not in shared
    assert id(dense.weight) in shared
    assert dense.bias_alias.data_ptr() == dense.bias.data_ptr()
    ball.close()


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
    ball.close()


def test_parameters_own_their_storage_after_a_call_that_raises():
    """The ball gives the storages back on exit from the engine, also when the loss raises
    (not only when the layout is collected)."""
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []

    def failing(model, batch):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("boom")
        return loss_fn(model, batch)

    gc.disable()
    try:
        gq.adaptive_sharpness(model, failing, [BATCH], rho=0.1, iters=3, progress=False)
    except RuntimeError as error:  # its traceback holds the engine's frames, the ball's too
        assert "boom" in str(error)
        assert all(owns_storage(p) for p in model.parameters())
    else:
        pytest.fail("the loss's error was not raised")
    finally:
        gc.enable()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
