"""Every way of writing ``loss_fn`` sees the perturbation, or is refused.

Each pattern below computes the same loss as a canonical ``m(**b)`` formulation; the
sharpness (adaptive, geodesic worst and average case) and the Hessian trace must then
agree with it in float64, and the model must be bitwise unchanged afterwards.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.optimize
import torch
import transformers
from conftest import assert_close
from conftest import tiny_bert_classifier as tiny_bert

import geoopt_quotient as gq
from geoopt_quotient.sharpness.functional import (
    IndependentLossError,
    LossFnError,
    PerturbedLoss,
    StaleParameterError,
)

pytestmark = pytest.mark.on_device

EPS64 = torch.finfo(torch.float64).eps


def tiny_gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=30, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double().eval()


def dict_batches(labels: int = 3, count: int = 2):
    g = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": torch.randint(0, 30, (4, 7), generator=g),
            "attention_mask": torch.ones(4, 7, dtype=torch.long),
            "labels": torch.randint(0, labels, (4,), generator=g),
        }
        for _ in range(count)
    ]


def canonical(m, b):
    return m(**b).loss


def through_submodules(m, b):
    pooled = m.bert(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).pooler_output
    logits = m.classifier(m.dropout(pooled))
    return torch.nn.functional.cross_entropy(logits, b["labels"])


def through_forward(m, b):
    return m.forward(**b).loss


class WithPenalty(torch.nn.Module):
    """The canonical formulation of a loss with a weight penalty: inside ``forward``."""

    def __init__(self, inner: torch.nn.Module, penalty):
        super().__init__()
        self.inner, self.penalty = inner, penalty

    def forward(self, **batch):
        return self.inner(**batch).loss + self.penalty(self.inner)


def classifier_penalty(m):
    return m.classifier.weight.pow(2).sum()


def all_parameters_penalty(m):
    return 1e-2 * sum(p.pow(2).sum() for p in m.parameters())


def structure(model):
    return gq.find_symmetries(model, verify=False)


MEASURES = {
    "adaptive": lambda model, loss, batches: (
        gq.adaptive_sharpness(model, loss, batches, rho=0.05, iters=4).per_batch
    ),
    # the plan by structure on both sides: a wrapper whose output adds a penalty of all
    # weights is not symmetric, and default discovery (proving the groups on its outputs)
    # would rightly leave it without groups
    "geodesic": lambda model, loss, batches: (
        gq.geodesic_sharpness(
            model, loss, batches, rho=0.05, iters=4, symmetries=structure(model)
        ).per_batch
    ),
    "geodesic-average": lambda model, loss, batches: (
        gq.geodesic_sharpness(
            model, loss, batches, rho=0.05, iters=3, kind="average", symmetries=structure(model)
        ).per_batch
    ),
    "hessian-trace": lambda model, loss, batches: (
        gq.hessian_trace(model, loss, batches[:1], probes=2, symmetries=structure(model)).per_batch
    ),
}


def snapshot(model: torch.nn.Module):
    """Every parameter and buffer: the object itself and a copy of its values."""
    state = model.state_dict(keep_vars=True)
    return {name: (tensor, tensor.detach().clone()) for name, tensor in state.items()}


def assert_bitwise_unchanged(model: torch.nn.Module, before) -> None:
    """The same objects (parameters back in place, ties intact), with the same bits."""
    after = model.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    for name, (tensor, values) in before.items():
        assert after[name] is tensor, f"{name} was not put back"
        assert torch.equal(tensor.detach(), values), f"{name} changed"


def assert_same_values(actual, expected, what):
    actual, expected = torch.tensor(actual), torch.tensor(expected)
    assert (expected.abs() > 0).all(), f"{what}: the canonical value is 0, the test is void"
    assert_close(actual, expected, rtol=1e4 * EPS64, what=what)


@pytest.mark.parametrize("measure", sorted(MEASURES))
@pytest.mark.parametrize("pattern", ["submodules", "forward", "closure"])
def test_bert_patterns_equal_the_canonical_loss(measure, pattern, single_thread):
    model, batches = tiny_bert(), dict_batches()
    before = snapshot(model)
    loss_fn = {
        "submodules": through_submodules,
        "forward": through_forward,
        "closure": lambda m, b: model(**b).loss,  # ignores its argument
    }[pattern]
    expected = MEASURES[measure](model, canonical, batches)
    actual = MEASURES[measure](model, loss_fn, batches)
    assert_same_values(actual, expected, f"{pattern}, {measure}")
    assert_bitwise_unchanged(model, before)


@pytest.mark.parametrize("measure", sorted(MEASURES))
@pytest.mark.parametrize("penalty", [classifier_penalty, all_parameters_penalty])
def test_parameter_penalties_are_perturbed(measure, penalty, single_thread):
    batches = dict_batches()
    model = tiny_bert()
    before = snapshot(model)
    expected = MEASURES[measure](WithPenalty(model, penalty), lambda m, b: m(**b), batches)
    actual = MEASURES[measure](model, lambda m, b: m(**b).loss + penalty(m), batches)
    without = MEASURES[measure](model, canonical, batches)
    assert_same_values(actual, expected, f"{penalty.__name__}, {measure}")
    assert not np.allclose(actual, without, rtol=1e-6), "the penalty changed nothing"
    assert_bitwise_unchanged(model, before)


def next_token_loss(logits, ids):
    """In the logits' dtype (transformers' own loss rounds them to float32)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def canonical_lm_loss(m, b):
    return next_token_loss(m(**b).logits, b["input_ids"])


def manual_lm_loss(m, b):
    """GPT-2's language-model loss from its parts: the head's weight is the tied embedding."""
    hidden = m.transformer(input_ids=b["input_ids"]).last_hidden_state
    return next_token_loss(hidden @ m.transformer.wte.weight.T, b["input_ids"])


@pytest.mark.parametrize("measure", sorted(MEASURES))
def test_tied_gpt2_embeddings(measure, single_thread):
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    batches = [{"input_ids": b["input_ids"]} for b in dict_batches()]
    before = snapshot(model)
    expected = MEASURES[measure](model, canonical_lm_loss, batches)
    actual = MEASURES[measure](model, manual_lm_loss, batches)
    assert_same_values(actual, expected, f"tied GPT-2, {measure}")
    assert_bitwise_unchanged(model, before)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_tied_weights_get_one_tensor_under_every_name():
    """The perturbed tensor of a tied parameter replaces it under all its names; two
    different tensors for one tied parameter are refused, not silently untied."""
    model = tiny_gpt2()
    seen = {}

    def loss_fn(m, batch):
        seen["head"], seen["embedding"] = m.lm_head.weight, m.transformer.wte.weight
        return m.lm_head.weight.sum()

    loss = PerturbedLoss(model, loss_fn)
    perturbed = model.transformer.wte.weight.detach() + 1.0
    loss({"transformer.wte.weight": perturbed}, None)
    assert seen["head"] is perturbed and seen["embedding"] is perturbed
    assert model.lm_head.weight is model.transformer.wte.weight
    other = perturbed.clone()
    with pytest.raises(ValueError, match="tied"):
        loss({"transformer.wte.weight": perturbed, "lm_head.weight": other}, None)


class Quadratic(torch.nn.Module):
    """:math:`\\tfrac12 (w - a)^\\top Q (w - a)`, read from the parameter directly."""

    def __init__(self, n: int, generator: torch.Generator):
        super().__init__()
        m = torch.randn(n, n, generator=generator, dtype=torch.float64)
        self.register_buffer("q", m @ m.T / n + 0.1 * torch.eye(n, dtype=torch.float64))
        self.register_buffer("a", torch.randn(n, generator=generator, dtype=torch.float64))
        self.w = torch.nn.Parameter(torch.randn(n, generator=generator, dtype=torch.float64))

    def value(self) -> torch.Tensor:
        d = self.w - self.a
        return 0.5 * d @ self.q @ d


def exact_adaptive_maximum(model: Quadratic, rho: float) -> float:
    r"""max over :math:`|u| \le \rho` of :math:`L(w + Du) - L(w)`, :math:`D = \mathrm{diag}|w|`:
    :math:`g^\top u + \tfrac12 u^\top H u` with :math:`g = DQ(w - a)`, :math:`H = DQD`, whose
    maximiser is :math:`u = (\lambda I - H)^{-1} g` with :math:`\lambda > \lambda_{max}(H)`
    and :math:`|u| = \rho` (the trust-region subproblem, convex case)."""
    w, a, q = (t.detach().cpu().numpy() for t in (model.w, model.a, model.q))
    d = np.abs(w)
    g, h = d * (q @ (w - a)), d[:, None] * q * d[None, :]
    evals, evecs = np.linalg.eigh(h)
    coef = evecs.T @ g

    def excess(lam):
        return np.sqrt(np.sum((coef / (lam - evals)) ** 2)) - rho

    top = evals[-1]
    lam = scipy.optimize.brentq(excess, top + 1e-12, top + 1e6 * (1 + np.abs(coef).sum()))
    u = evecs @ (coef / (lam - evals))
    return float(g @ u + 0.5 * u @ h @ u)


def test_direct_parameter_read_reaches_the_exact_maximum():
    model = Quadratic(6, torch.Generator().manual_seed(3))
    rho = 0.5
    result = gq.adaptive_sharpness(model, lambda m, b: m.value(), [None], rho=rho, iters=50)
    exact = exact_adaptive_maximum(model, rho)
    assert exact > 0.1
    assert 0.99 * exact <= result.value <= exact * (1 + 1e3 * EPS64)


def test_quadratic_direct_read_equals_the_canonical_call():
    class Canonical(Quadratic):
        def forward(self):
            return self.value()

    model = Canonical(5, torch.Generator().manual_seed(4))
    direct = gq.adaptive_sharpness(model, lambda m, b: m.value(), [None], rho=0.3, iters=6)
    called = gq.adaptive_sharpness(model, lambda m, b: m(), [None], rho=0.3, iters=6)
    assert direct.value > 0
    assert direct.per_batch == called.per_batch


# --- refused: losses the perturbation cannot reach ------------------------------------


def constant_loss(m, b):
    return torch.tensor(1.5, dtype=torch.float64)


def detached_loss(m, b):
    return m(**b).loss.detach()


def no_grad_loss(m, b):
    with torch.no_grad():
        return m(**b).loss


CALLS = {
    "adaptive": lambda model, loss, batches: gq.adaptive_sharpness(
        model, loss, batches, rho=0.05, iters=2
    ),
    "geodesic": lambda model, loss, batches: gq.geodesic_sharpness(
        model, loss, batches, rho=0.05, iters=2
    ),
    "average": lambda model, loss, batches: gq.geodesic_sharpness(
        model, loss, batches, rho=0.05, iters=2, kind="average"
    ),
    "hessian-trace": lambda model, loss, batches: gq.hessian_trace(model, loss, batches, probes=2),
    "hessian-top": lambda model, loss, batches: gq.hessian_top_eigenvalue(
        model, loss, batches, iters=2
    ),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("loss_fn", [constant_loss, detached_loss, no_grad_loss])
def test_parameter_independent_loss_raises(call, loss_fn):
    model, batches = tiny_bert(), dict_batches(count=1)
    before = snapshot(model)
    with pytest.raises(IndependentLossError, match="no autograd path"):
        CALLS[call](model, loss_fn, batches)
    assert_bitwise_unchanged(model, before)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_stale_parameter_reference_is_refused(call):
    model, batches = tiny_bert(), dict_batches(count=1)
    weight = model.classifier.weight  # taken before the call: the swap cannot reach it

    def loss_fn(m, b):
        return m(**b).loss + weight.pow(2).sum()

    before = snapshot(model)
    with pytest.raises(StaleParameterError, match=r"'classifier\.weight'"):
        CALLS[call](model, loss_fn, batches)
    assert_bitwise_unchanged(model, before)


def test_stale_reference_of_a_detached_copy_is_refused():
    model, batches = tiny_bert(), dict_batches(count=1)
    weight = model.classifier.weight.detach()  # shares the parameter's storage

    with pytest.raises(StaleParameterError, match=r"classifier\.weight"):
        gq.adaptive_sharpness(
            model, lambda m, b: m(**b).loss + weight.sum(), batches, rho=0.05, iters=2
        )


def test_unused_parameters_are_fine():
    """A loss that calls only part of the model (a text tower an image loss never uses)."""
    model, batches = tiny_bert(), dict_batches()

    def embeddings_only(m, b):
        return m.bert.embeddings(input_ids=b["input_ids"]).pow(2).mean()

    result = gq.adaptive_sharpness(model, embeddings_only, batches, rho=0.05, iters=3)
    assert result.value > 0
    trace = gq.hessian_trace(model, embeddings_only, batches[:1], probes=1)
    assert np.isfinite(trace.value)


class Interrupt(BaseException):
    pass


@pytest.mark.parametrize("error", [ValueError("boom"), KeyboardInterrupt(), Interrupt()])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_model_unchanged_when_loss_fn_raises_midway(call, error):
    model, batches = tiny_gpt2(), [{"input_ids": dict_batches()[0]["input_ids"]}] * 2
    before = snapshot(model)
    calls = []

    def loss_fn(m, b):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return canonical_lm_loss(m, b)

    with pytest.raises(type(error)):
        CALLS[call](model, loss_fn, batches)
    assert len(calls) == 3
    assert_bitwise_unchanged(model, before)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("call", sorted(CALLS))
def test_errors_inside_loss_fn_name_the_batch(call):
    model, batches = tiny_bert(), dict_batches(count=3)

    def loss_fn(m, b):
        if b is batches[2]:
            raise ValueError("a bad batch")
        return m(**b).loss

    with pytest.raises(ValueError, match="a bad batch") as raised:
        CALLS[call](model, loss_fn, batches)
    notes = getattr(raised.value, "__notes__", [])
    if hasattr(raised.value, "add_note"):
        assert any("batch 2 " in note for note in notes), notes


def test_loss_fn_errors_share_a_base_class():
    assert issubclass(IndependentLossError, LossFnError)
    assert issubclass(StaleParameterError, LossFnError)
    assert gq.IndependentLossError is IndependentLossError
    assert gq.StaleParameterError is StaleParameterError


# --- warnings --------------------------------------------------------------------------


def test_zero_worst_case_sharpness_warns():
    model = Quadratic(4, torch.Generator().manual_seed(5))
    with torch.no_grad():
        model.w.copy_(model.a)  # the minimum: the gradient is exactly 0

    with pytest.warns(gq.ZeroSharpnessWarning, match="exactly 0 on every batch"):
        result = gq.adaptive_sharpness(model, lambda m, b: m.value(), [0, 1], rho=0.1, iters=3)
    assert result.value == 0.0


def test_piecewise_constant_loss_warns_and_names_the_batches():
    model = Quadratic(4, torch.Generator().manual_seed(6))

    def loss_fn(m, b):
        if b == 0:
            return (m.w > 100).double().mean() + 0 * m.w.sum()  # constant, yet connected
        return m.value()

    with pytest.warns(gq.ZeroSharpnessWarning, match=r"batches \[0\] of 2"):
        gq.adaptive_sharpness(model, loss_fn, [0, 1], rho=0.1, iters=3)


def test_positive_sharpness_does_not_warn():
    model = Quadratic(4, torch.Generator().manual_seed(7))
    with warnings.catch_warnings():
        warnings.simplefilter("error", gq.ZeroSharpnessWarning)
        assert gq.adaptive_sharpness(model, lambda m, b: m.value(), [0], rho=0.1, iters=3).value > 0


# --- what a measurement costs --------------------------------------------------------


@pytest.mark.parametrize("kind", ["worst", "average"])
@pytest.mark.parametrize("measure", ["adaptive", "geodesic"])
def test_reported_passes_are_the_passes_made(kind, measure):
    """``forward_passes`` counts the calls of loss_fn, ``backward_passes`` the backward
    passes through it (restarts included), per batch."""
    model, batches = tiny_bert(), dict_batches()
    forward, backward = [0] * len(batches), [0] * len(batches)

    def counting_loss(m, b):
        index = next(i for i, c in enumerate(batches) if c is b)
        forward[index] += 1
        loss = m(**b).loss
        if loss.requires_grad:
            loss.register_hook(lambda g: backward.__setitem__(index, backward[index] + 1) or g)
        return loss

    call = gq.adaptive_sharpness if measure == "adaptive" else gq.geodesic_sharpness
    result = call(model, counting_loss, batches, rho=0.5, iters=12, kind=kind)
    assert result.forward_passes == forward
    if kind == "worst":
        assert result.backward_passes == backward
        # the second-order path's gap report: one forward where the geodesic reaches the
        # maximiser (NaN and none where it leaves the manifold)
        gaps = result.path_gaps or [math.nan] * len(batches)
        extra = [int(not math.isnan(g)) for g in gaps]
        assert all(b >= 12 and f == b + 1 + e for f, b, e in zip(forward, backward, extra))
    else:
        assert result.backward_passes == [0, 0] and forward == [13, 13]
