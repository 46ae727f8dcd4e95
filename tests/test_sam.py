"""GeodesicSAM: its ascent is horizontal, of metric norm rho, and invariant; SAM's and ASAM's
are not."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close
from conftest import tiny_bert_classifier as tiny_bert
from hypothesis import given, settings
from hypothesis import strategies as st

import geoopt_quotient as gq
from geoopt_quotient.nn import QuotientMultiheadAttention
from geoopt_quotient.optim import GeodesicSAM, RiemannianSGD
from geoopt_quotient.testing import act_on_module, random_group_elements, transformed_copy

pytestmark = pytest.mark.on_device

DT = torch.float64
EPS64 = torch.finfo(DT).eps
BALLS = ("geodesic", "adaptive", "euclidean")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def attention_block() -> QuotientMultiheadAttention:
    return QuotientMultiheadAttention(8, 2, dtype=DT, generator=gen(12))


def attention_data():
    x = torch.randn(4, 5, 8, generator=gen(11), dtype=DT)
    return x, torch.tanh(x.flip(1)) + 0.3 * x


def attention_output(model, x):
    out = model(x, x, x)
    return out[0] if isinstance(out, tuple) else out


def attention_loss(model, data):
    x, target = data
    return (attention_output(model, x) - target).pow(2).mean()


def moved_block(block, condition, seed):
    elements = {
        "qk": random_group_elements((2,), 4, condition=condition, generator=gen(seed)),
        "vo": random_group_elements((2,), 4, condition=condition, generator=gen(seed + 1)),
    }
    return act_on_module(block, elements)


def bert_batch():
    g = gen(1)
    return {
        "input_ids": torch.randint(0, 30, (6, 7), generator=g),
        "labels": torch.randint(0, 3, (6,), generator=g),
    }


def bert_loss(model, batch):
    return model(**batch).loss


def bert_logits(model, batch):
    return model(input_ids=batch["input_ids"]).logits


def perturbed(model, loss_fn, data, ball, rho=0.05, base=torch.optim.SGD, **kwargs):
    """The model at the ascent point of one first step (and its optimizer)."""
    optimizer = GeodesicSAM(model, base, rho=rho, ball=ball, lr=0.1, **kwargs)
    loss_fn(model, data).backward()
    optimizer.first_step(zero_grad=True)
    return optimizer


# --- the ascent step ---------------------------------------------------------------------


@pytest.mark.parametrize("model_kind", ["attention", "bert"])
def test_geodesic_ascent_is_horizontal_with_metric_norm_rho(model_kind):
    if model_kind == "attention":
        model, loss_fn, data = attention_block(), attention_loss, attention_data()
    else:
        model, loss_fn, data = tiny_bert(), bert_loss, bert_batch()
    points = {n: p.detach().clone() for n, p in model.named_parameters()}
    rho = 0.07
    optimizer = perturbed(model, loss_fn, data, "geodesic", rho=rho)
    plan = optimizer.plan
    assert plan.symmetric_groups, "no symmetry found: the test is void"
    norm2 = 0.0
    for group, point, xi in zip(plan.groups, plan.gather(points), optimizer.last_ascent):
        ok, reason = group.manifold.check_vector_on_tangent(
            point, xi, explain=True, atol=1e3 * EPS64, rtol=1e3 * EPS64
        )
        assert ok, f"{group.name}: {reason}"
        norm2 += group.manifold.inner(point, xi).sum().item()
    assert abs(norm2**0.5 - rho) <= 1e3 * EPS64 * rho


def test_geodesic_ascent_lands_on_the_second_order_retraction():
    model, data = attention_block(), attention_data()
    points = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = perturbed(model, attention_loss, data, "geodesic")
    now = {n: p.detach() for n, p in model.named_parameters()}
    for group, x, x_now, xi in zip(
        optimizer.plan.groups,
        optimizer.plan.gather(points),
        optimizer.plan.gather(now),
        optimizer.last_ascent,
    ):
        assert_close(x_now, group.manifold.retr(x, xi), rtol=64 * EPS64, what=group.name)


@pytest.mark.parametrize("ball", ["adaptive", "euclidean"])
def test_sam_and_asam_ascents_follow_their_formulas(ball):
    """SAM: rho g / |g|. ASAM: rho T^2 g / |T g| with T = |w| + eta."""
    model, data = tiny_bert(), bert_batch()
    eta, rho = 0.01, 0.05
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bert_loss(model, data).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    perturbed(model, bert_loss, data, ball, rho=rho, eps=eta)
    scales = {
        n: (w.abs() + eta if ball == "adaptive" else torch.ones_like(w)) for n, w in before.items()
    }
    norm = sum((scales[n] * g).pow(2).sum() for n, g in grads.items()).sqrt()
    for name, param in model.named_parameters():
        expected = before[name] + rho * scales[name].pow(2) * grads[name] / norm
        assert_close(param.detach(), expected, rtol=64 * EPS64, what=name)


# --- invariance --------------------------------------------------------------------------


@pytest.mark.parametrize("ball", BALLS)
def test_perturbed_function_of_two_representatives(ball):
    """The ascent of two GL-related representatives of a BERT: the same function for
    GeodesicSAM (with any base optimizer: the descent is not part of this), different
    functions for SAM and ASAM, by a fair fraction of what the ascent changes."""
    model, data = tiny_bert(initializer_range=0.3), bert_batch()  # attention not uniform
    for name, param in model.named_parameters():  # only attention moves: its effect is seen
        param.requires_grad_("attention.self" in name or "attention.output.dense" in name)
    plan = gq.find_symmetries(model)
    other = transformed_copy(model, plan, condition=30.0, seed=3)
    clean = bert_logits(model, data)
    assert (clean - bert_logits(other, data)).abs().max().item() < 1e-12
    for m in (model, other):
        perturbed(m, bert_loss, data, ball, rho=0.5, eps=0.01)
    change = (bert_logits(model, data) - clean).abs().max().item()
    gap = (bert_logits(model, data) - bert_logits(other, data)).abs().max().item()
    assert change > 1e-4, "the ascent changed nothing: the test is void"
    if ball == "geodesic":
        assert gap < 1e-9 * change, (gap, change)
    else:
        assert gap > 0.05 * change, f"{ball}: the ascent looks invariant ({gap:.3g} / {change:.3g})"


def train_pair(ball, condition, steps=15, seed=13):
    """Two representatives trained with the ball's SAM and the equivariant RiemannianSGD;
    returns the gap of their outputs after each step."""
    block, data = attention_block(), attention_data()
    models = [block, moved_block(block, condition, seed)]
    optimizers = [
        GeodesicSAM(m, RiemannianSGD, rho=0.05, ball=ball, eps=0.01, lr=0.05, momentum=0.9)
        for m in models
    ]
    gaps = []
    for _ in range(steps):
        for m, optimizer in zip(models, optimizers):

            def closure(m=m):
                loss = attention_loss(m, data)
                loss.backward()
                return loss

            optimizer.step(closure)
            optimizer.zero_grad()
        x = data[0]
        gaps.append((attention_output(models[0], x) - attention_output(models[1], x)).abs().max())
    return [g.item() for g in gaps], attention_loss(models[0], data).item()


@pytest.mark.parametrize("condition", [10.0, 100.0])
def test_training_keeps_representatives_in_correspondence(condition):
    gaps, _ = train_pair("geodesic", condition)
    assert max(gaps) < 1e-9, gaps


@pytest.mark.parametrize("ball", ["adaptive", "euclidean"])
def test_sam_and_asam_training_separates_representatives(ball):
    gaps, _ = train_pair(ball, 30.0)
    assert gaps[-1] > 1e-3, gaps


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), log_condition=st.floats(1.0, 2.0))
def test_ascent_equivariance_property(seed, log_condition):
    """For random group elements (condition 10 to 100), the ascent point of the moved
    representative is the moved ascent point: the perturbed outputs agree."""
    block, data = attention_block(), attention_data()
    other = moved_block(block, 10.0**log_condition, seed)
    for m in (block, other):
        perturbed(m, attention_loss, data, "geodesic", base=RiemannianSGD)
    x = data[0]
    gap = (attention_output(block, x) - attention_output(other, x)).abs().max().item()
    assert gap < 1e-9, gap


# --- mechanics ---------------------------------------------------------------------------


def test_second_step_restores_the_parameters_bitwise():
    model, data = tiny_bert(), bert_batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = GeodesicSAM(model, torch.optim.SGD, rho=0.05, lr=0.0)
    bert_loss(model, data).backward()
    optimizer.first_step(zero_grad=True)
    moved = any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert moved
    bert_loss(model, data).backward()
    optimizer.second_step(zero_grad=True)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
        assert param.grad is None or not param.grad.any()


@pytest.mark.parametrize("ball", BALLS)
def test_first_step_leaves_the_gradients_alone(ball):
    """Without ``zero_grad`` the gradients at w are still there after the ascent."""
    model, data = tiny_bert(), bert_batch()
    bert_loss(model, data).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer = GeodesicSAM(model, torch.optim.SGD, rho=0.05, ball=ball, eps=0.01, lr=0.1)
    optimizer.first_step(zero_grad=False)
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, grads[name]), name


def test_step_with_closure_equals_the_two_steps():
    data = attention_data()
    models = [attention_block(), attention_block()]
    optimizers = [GeodesicSAM(m, RiemannianSGD, rho=0.05, lr=0.05, momentum=0.9) for m in models]
    for _ in range(3):
        attention_loss(models[0], data).backward()
        optimizers[0].first_step(zero_grad=True)
        attention_loss(models[0], data).backward()
        optimizers[0].second_step(zero_grad=True)

        def closure():
            loss = attention_loss(models[1], data)
            loss.backward()
            return loss

        optimizers[1].step(closure)
        optimizers[1].zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def test_state_dict_round_trip_resumes_exactly():
    data = attention_data()

    def run(model, optimizer, steps):
        for _ in range(steps):
            attention_loss(model, data).backward()
            optimizer.first_step(zero_grad=True)
            attention_loss(model, data).backward()
            optimizer.second_step(zero_grad=True)

    def make(model):
        return GeodesicSAM(model, RiemannianSGD, rho=0.05, lr=0.05, momentum=0.9)

    straight = attention_block()
    run(straight, make(straight), 4)
    resumed = attention_block()
    first = make(resumed)
    run(resumed, first, 2)
    state = copy.deepcopy(first.state_dict())
    assert state["state"], "the base optimizer's momentum is missing from the state dict"
    assert state["param_groups"][0]["rho"] == 0.05
    second = make(resumed)
    second.load_state_dict(state)
    run(resumed, second, 2)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_misuse_is_reported():
    model, data = attention_block(), attention_data()
    optimizer = GeodesicSAM(model, torch.optim.SGD, rho=0.05, lr=0.1)
    with pytest.raises(RuntimeError, match="without first_step"):
        optimizer.second_step()
    attention_loss(model, data).backward()
    optimizer.first_step()
    with pytest.raises(RuntimeError, match="twice"):
        optimizer.first_step()
    with pytest.raises(ValueError, match="closure"):
        optimizer.step()
    with pytest.raises(ValueError, match="ball"):
        GeodesicSAM(model, torch.optim.SGD, rho=0.05, ball="sphere", lr=0.1)
    with pytest.raises(ValueError, match="rho"):
        GeodesicSAM(model, torch.optim.SGD, rho=0.0, lr=0.1)


def test_training_with_geodesic_sam_lowers_the_loss():
    _, final = train_pair("geodesic", 10.0, steps=30)
    block, data = attention_block(), attention_data()
    assert final < 0.8 * attention_loss(block, data).item()


# ------------------------------------------------------------------ zero weights, NaN/Inf
def fresh_lora_bert(dtype=torch.float32):
    """A tiny BERT classifier with fresh PEFT LoRA adapters (B = 0) on Q and V: only the
    adapters are trainable, and the loss's gradient lives on B alone."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["query", "value"])
    return peft.get_peft_model(tiny_bert().to(dtype), config).train()


def all_finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize("ball", BALLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fresh_lora_adapters_never_get_nan(ball, dtype):
    """With eps = 0 the adaptive part of the ball cannot move B = 0 and A has no gradient:
    the ascent is skipped with a warning naming lora_B (never 0 * inf = NaN), training goes
    on, and from the second step (B no longer 0) the ascent is taken."""
    model, batch = fresh_lora_bert(dtype), bert_batch()
    optimizer = GeodesicSAM(model, torch.optim.SGD, rho=0.05, ball=ball, lr=0.5)

    def closure():
        loss = bert_loss(model, batch)
        loss.backward()
        return loss

    def eval_loss() -> float:  # without dropout: the training losses are noisy
        model.eval()
        with torch.no_grad():
            value = bert_loss(model, batch).item()
        model.train()
        return value

    before, losses = eval_loss(), []
    for step in range(4):
        optimizer.zero_grad()
        if ball != "euclidean" and step == 0:
            with pytest.warns(gq.optim.ZeroAscentWarning, match=r"lora_B.*eps > 0"):
                losses.append(optimizer.step(closure).item())
            assert all(float(a.abs().max()) == 0 for a in optimizer.last_ascent)
        else:
            losses.append(optimizer.step(closure).item())
            assert any(float(a.abs().max()) > 0 for a in optimizer.last_ascent)
        assert all_finite(model), (ball, step)
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    assert eval_loss() < before


@pytest.mark.parametrize("ball", BALLS)
def test_a_non_finite_ascent_raises_and_leaves_the_weights(ball):
    block, data = attention_block(), attention_data()
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    optimizer = GeodesicSAM(block, torch.optim.SGD, rho=0.05, ball=ball, lr=0.1)
    attention_loss(block, data).backward()
    name, param = next(iter(block.named_parameters()))
    param.grad[(0,) * param.grad.dim()] = float("nan")
    with pytest.raises(gq.NonFiniteError, match=r"no parameter was changed.*NaN/Inf") as info:
        optimizer.first_step()
    assert name in str(info.value)
    for n, p in block.named_parameters():
        assert torch.equal(p, before[n]), n
    attention_loss(block, data).backward()  # the optimizer is usable afterwards
    optimizer.zero_grad()
    attention_loss(block, data).backward()
    optimizer.first_step()
    optimizer.second_step()
    assert all_finite(block)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_zero_sharpness_of_fresh_lora_names_the_zero_weights():
    model, batch = fresh_lora_bert(torch.float64), bert_batch()
    with pytest.warns(gq.ZeroSharpnessWarning, match=r"exactly 0 .*lora_B.*eps > 0"):
        result = gq.geodesic_sharpness(model, bert_loss, [batch], rho=0.05, iters=3)
    assert result.value == 0
    with pytest.warns(gq.ZeroSharpnessWarning) as caught:  # a zero that is not the weights'
        gq.adaptive_sharpness(model, lambda m, b: bert_loss(m, b).round(), [batch], rho=1e-6)
    assert "lora_B" in str(caught[0].message)  # B = 0 is still named, as one cause
