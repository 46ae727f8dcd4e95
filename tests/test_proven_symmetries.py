"""Symmetries proven, not guessed: every group of a discovered plan is checked on the
model's outputs before use, the manifolds own their groups, and a plan carries its metric."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import geoopt_quotient as gq  # noqa: E402
from geoopt_quotient.manifolds.base import group_label, random_group_element  # noqa: E402
from geoopt_quotient.symmetry import PlanError, SymmetryPlan, verify  # noqa: E402
from geoopt_quotient.symmetry.verify import (  # noqa: E402
    SymmetryNotProvenWarning,
    WeightPrecision,
    probe_inputs_for,
    prove_at_once,
    prove_plan,
    reference_pass,
)
from geoopt_quotient.testing import assert_invariant, transformed_copy  # noqa: E402

F64 = torch.float64

MANIFOLDS = {
    "gl-mix": (gq.GLQuotient(5, 4, "mix"), 3),
    "gl-inv": (gq.GLQuotient(5, 4, "inv"), 3),
    "rotary-half": (gq.RotaryGLQuotient(5, 4, rotary_dim=2), 3),
    "rotary-interleaved": (gq.RotaryGLQuotient(6, 5, rotary_dim=4, pairing="interleaved"), 4),
    "positive": (gq.PositiveScalingQuotient(3, 2), 1),
    "diagonal": (gq.DiagonalQuotient("inv"), 3),
}


def _point(manifold, rank, generator):
    if isinstance(manifold, gq.DiagonalQuotient):
        return torch.randn(2, 2, rank, generator=generator, dtype=F64)
    return torch.randn(2, manifold.n + manifold.m, rank, generator=generator, dtype=F64)


@pytest.mark.parametrize("name", list(MANIFOLDS))
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), condition=st.floats(1.0, 50.0))
def test_the_manifolds_own_group_keeps_the_product_and_one_factor_alone_does_not(
    name, seed, condition
):
    manifold, rank = MANIFOLDS[name]
    gen = torch.Generator().manual_seed(seed)
    x = _point(manifold, rank, gen)
    a = manifold.random_element((2,), h=rank, max_condition=condition, generator=gen)
    scale = manifold.product(x).abs().max()
    tol = 1e3 * condition * torch.finfo(F64).eps * scale
    torch.testing.assert_close(
        manifold.product(manifold.act(x, a)), manifold.product(x), rtol=0, atol=float(tol)
    )
    one = manifold.identity_element((2,), h=rank, dtype=F64)
    torch.testing.assert_close(manifold.act(x, one), x, rtol=0, atol=0)
    back = manifold.act(manifold.act(x, a), manifold.inverse_element(a))
    atol = 1e3 * condition * torch.finfo(F64).eps * float(x.abs().max())
    torch.testing.assert_close(back, x, rtol=0, atol=atol)
    if condition > 2:  # the control: moving one factor changes the product
        broken = manifold.product(manifold.act_on_first_factor(x, a))
        assert (broken - manifold.product(x)).abs().max() > 1e-3 * scale


def test_group_labels_and_metrics_come_from_the_manifold():
    labels = {name: group_label(m, r) for name, (m, r) in MANIFOLDS.items()}
    assert labels == {
        "gl-mix": "GL(3) [9]",
        "gl-inv": "GL(3) [9]",
        "rotary-half": "rotary C*^1 x GL(1) [3]",
        "rotary-interleaved": "rotary C*^2 [4]",
        "positive": "GL(1)+ [1]",
        "diagonal": "GL(1)^3 [3]",
    }
    assert group_label(gq.AdaptiveEuclidean(), 4) == "-"
    assert random_group_element(gq.AdaptiveEuclidean(), (2,), h=3) is None
    rotary = gq.RotaryGLQuotient(5, 4, rotary_dim=2, pairing="interleaved").with_metric("inv", 0.1)
    assert type(rotary) is gq.RotaryGLQuotient and rotary.pairing == "interleaved"
    assert (rotary.metric, rotary.eps, rotary.rotary_dim) == ("inv", 0.1, 2)


def test_random_elements_respect_the_condition_bound():
    gen = torch.Generator().manual_seed(0)
    for manifold, rank in MANIFOLDS.values():
        a = manifold.random_element((64,), h=rank, max_condition=7.0, generator=gen)
        if a.dim() == 2:  # scalars per coordinate
            ratio = a.abs().max() / a.abs().min()
        else:
            s = torch.linalg.svdvals(a)
            ratio = (s[..., 0] / s[..., -1]).max()
        assert ratio <= 7.0 * (1 + 1e-9)


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(F64).eval()


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


def test_default_discovery_proves_every_group_in_two_forward_passes():
    """The rotary probe's recorded pass is the proof's reference pass, the second acts on
    every group; no pair is replayed on its module when the plan holds as a whole."""
    model = tiny_llama()
    counter = ForwardCounter(model)
    attention = ForwardCounter(model.model.layers[0].self_attn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SymmetryNotProvenWarning)
        plan = gq.find_symmetries(model, kinds="all")
    assert counter.calls == 2, counter.calls
    assert attention.calls == 2, attention.calls  # (a replay would run it again)
    kinds = {g.kind for g in plan.groups}
    assert kinds == {"query-key", "value-output", "mlp"}
    assert any(n.startswith("verified 3 symmetric groups") for n in plan.notes), plan.notes
    assert any("2 forward passes" in n for n in plan.notes), plan.notes


def test_the_shared_reference_pass_proves_as_a_pass_of_its_own():
    model = tiny_llama()
    plan = gq.find_symmetries(model, kinds="all", verify=False)
    inputs = probe_inputs_for(model)
    shared = prove_plan(model, plan, reference=reference_pass(model, inputs))
    own = prove_plan(model, plan, inputs)
    assert [(c.name, c.holds, c.control) for c in shared.checks] == [
        (c.name, c.holds, c.control) for c in own.checks
    ]
    assert (shared.tolerance, shared.precision, shared.largest_change) == (
        own.tolerance,
        own.precision,
        own.largest_change,
    )
    assert shared.forward_calls == own.forward_calls == 2
    at_once = prove_at_once(model, plan, inputs)
    assert at_once is not None and at_once.checks == own.checks
    with pytest.raises(ValueError, match="not both"):
        prove_plan(model, plan, inputs, reference=reference_pass(model, inputs))


def test_prove_at_once_says_nothing_of_a_plan_that_fails():
    model = tiny_llama()
    plan = gq.find_symmetries(model, verify=False)
    qk = next(g for g in plan.groups if g.kind == "query-key")
    general = qk.with_manifold(gq.GLQuotient(qk.manifold.n, qk.manifold.m))
    broken = SymmetryPlan([general if g is qk else g for g in plan.groups])
    assert prove_at_once(model, broken) is None
    assert [c.holds for c in prove_plan(model, broken).checks] == [
        g is not general for g in broken.groups
    ]


def _float32_plan():
    model = tiny_llama().float()
    return model, gq.find_symmetries(model, verify=False)


def test_outputs_that_rounding_moves_beyond_the_default_raise_the_tolerance(monkeypatch):
    """A model whose outputs move by rounding beyond the default tolerance (here: a default
    far below float32's rounding): a third pass measures that rounding on a round trip
    (the elements, then their inverses), the true groups hold at ten times it, and a
    general GL(h) on the rotary pairs is still refuted far beyond it."""
    model, plan = _float32_plan()
    usual = prove_plan(model, plan)
    assert usual.rounding is None and usual.forward_calls == 2  # the default suffices
    scale = usual.tolerance / usual.rtol
    below = usual.largest_change / scale / 2  # a default that rounding alone exceeds
    monkeypatch.setitem(verify.RTOL, torch.float32, below)
    proof = prove_plan(model, plan)
    assert proof.rounding is not None and proof.rounding > 0
    assert not proof.failed and proof.forward_calls == 3
    raised = min(verify.ROUND_TRIP_FACTOR * proof.rounding, verify.MAX_RAISE * below * scale)
    assert proof.tolerance == pytest.approx(raised, rel=1e-12)
    assert "round trip" in proof.notes()[0]
    qk = next(g for g in plan.groups if g.kind == "query-key")
    general = qk.with_manifold(gq.GLQuotient(qk.manifold.n, qk.manifold.m))
    refuted = prove_plan(model, SymmetryPlan([general]))
    assert refuted.checks[0].deviation > 1e3 * refuted.tolerance


def test_a_tolerance_given_is_not_raised():
    model, plan = _float32_plan()
    proof = prove_plan(model, plan, rtol=1e-12)
    assert proof.rounding is None and proof.failed and proof.tolerance < 1e-9


def test_outputs_too_sensitive_to_rounding_prove_nothing():
    """The raised tolerance stops at MAX_RAISE default tolerances: where the outputs move
    more than that without any group acting (here: noise added to every pass), the
    groups are refuted."""
    model, plan = _float32_plan()
    inputs = probe_inputs_for(model)
    noise = torch.Generator().manual_seed(0)

    def noisy(m):
        logits = m(**inputs).logits
        return logits + 0.1 * logits.detach().abs().max() * torch.randn(
            logits.shape, generator=noise
        )

    proof = prove_plan(model, plan, noisy)
    default = verify.default_rtol(torch.float32) * proof.tolerance / proof.rtol
    assert proof.rounding > verify.MAX_RAISE * default
    assert proof.tolerance == pytest.approx(verify.MAX_RAISE * default, rel=1e-12)
    assert len(proof.failed) == len(proof.checks)


def test_weight_precision_reads_each_roots_own_precision():
    a, b = torch.ones(3, dtype=F64), torch.ones(3, dtype=F64)
    with WeightPrecision([a, b]) as precision:
        (a * 2).float().sum()  # a's results drop to float32
        (b * 3).sum()
    assert precision.lowest == torch.float32
    assert precision.lowest_from([a]) == torch.float32
    assert precision.lowest_from([b]) == F64
    assert precision.lowest_from([torch.ones(1)]) is None


def _normalise_heads(module, args, output):
    b, s, _ = output.shape
    heads = output.view(b, s, -1, 8)
    return (heads / heads.norm(dim=-1, keepdim=True)).view(b, s, -1)


def test_a_hook_that_normalises_values_removes_that_layers_value_output_group():
    model = tiny_llama()
    model.model.layers[1].self_attn.v_proj.register_forward_hook(_normalise_heads)
    with pytest.warns(SymmetryNotProvenWarning, match=r"layers\.1\.self_attn.*value-output"):
        plan = gq.find_symmetries(model)
    vo = [g for g in plan.groups if g.kind == "value-output"]
    assert len(vo) == 1 and vo[0].shape[0] == 1  # layer 0 keeps its group
    assert all("layers.1." not in n for n in vo[0].param_names)
    assert any("value-output pair dropped" in n for n in plan.notes)
    gq.verify_plan(model, plan)  # what is left holds


def test_a_hook_that_rescales_the_queries_removes_the_query_key_group():
    model = tiny_llama()
    scale = torch.linspace(0.5, 2.0, 32, dtype=F64)  # per query dimension, not per plane
    for layer in model.model.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda m, a, out: out * scale)
    with pytest.warns(SymmetryNotProvenWarning, match="query-key"):
        plan = gq.find_symmetries(model)
    assert {g.kind for g in plan.groups} == {"value-output"}


def test_a_general_gl_element_on_rotary_query_key_changes_the_function():
    """The negative: the rotary Q/K pair is not GL(h)-symmetric, only its subgroup is."""
    model = tiny_llama()
    plan = gq.find_symmetries(model)
    qk = next(g for g in plan.groups if g.kind == "query-key")
    general = qk.with_manifold(gq.GLQuotient(qk.manifold.n, qk.manifold.m))
    proof = prove_plan(model, SymmetryPlan([general]))
    assert not proof.checks[0].holds and proof.checks[0].deviation > 1e3 * proof.tolerance
    assert prove_plan(model, SymmetryPlan([qk])).checks[0].holds


FAMILIES = {
    "llama": lambda: tiny_llama(),
    "gpt-neox": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            rotary_pct=0.5,
            max_position_embeddings=64,
            initializer_range=0.2,
        )
    ),
    "phi3": lambda: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.2,
            pad_token_id=0,
        )
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_testing_kit_keeps_the_function_and_breaks_it_on_one_factor(family):
    torch.manual_seed(0)
    model = FAMILIES[family]().to(F64).eval()
    x = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    plan = gq.find_symmetries(model, kinds="all")
    assert {"query-key", "value-output"} <= {g.kind for g in plan.groups}

    def logits(m):
        return m(x).logits

    # float32 norms inside the float64 models: float32's precision
    assert_invariant(logits, model, plan, rtol=1e-4, atol=1e-4)
    with pytest.raises(AssertionError):
        assert_invariant(logits, model, plan, rtol=1e-4, atol=1e-4, first_factor_only=True)
    moved = transformed_copy(model, plan)
    changed = [not torch.equal(p, q) for p, q in zip(moved.parameters(), model.parameters())]
    assert sum(changed) >= 4  # the weights moved, the function did not


def test_a_meta_device_model_gets_an_unverified_plan_without_running():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plan = gq.find_symmetries(model)
    assert {g.kind for g in plan.groups} == {"query-key", "value-output"}
    assert any(n.startswith("unverified: the model is on the meta device") for n in plan.notes), (
        plan.notes
    )


def test_a_model_without_probe_inputs_gets_a_one_line_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.register_module("attn", torch.nn.MultiheadAttention(4, 2))
    with pytest.raises(PlanError, match="pass probe_inputs=") as error:
        gq.find_symmetries(model)
    assert "\n" not in str(error.value)
    plan = gq.find_symmetries(model, verify=False)
    assert plan.groups


def test_the_probe_can_be_a_function_of_the_model():
    model = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
    x = torch.randn(3, 5, 8, dtype=F64)
    plan = gq.find_symmetries(model, probe_inputs=lambda m: m(x, x, x)[0].pow(2).mean())
    assert len(plan.groups) == 2 and plan.notes[0].startswith("verified 2")


def _loss(model, batch):
    return model(batch, labels=batch).loss


def test_a_plan_carries_its_metric_and_a_mismatch_is_refused():
    model = tiny_llama()
    batches = [torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))]
    plan = gq.find_symmetries(model, metric="mix")
    assert plan.metric == "mix" and plan.bind(model).metric == "mix"
    with pytest.raises(PlanError, match=r"'mix' metric, but metric='inv'"):
        gq.geodesic_sharpness(model, _loss, batches, metric="inv", symmetries=plan, iters=1)
    result = gq.geodesic_sharpness(model, _loss, batches, symmetries=plan, iters=1, progress=False)
    assert result.settings["metric"] == "mix"
    assert result.settings["rho"] == gq.sharpness.DEFAULT_RADII["mix"]
    inv = gq.find_symmetries(model, metric="inv")
    result = gq.geodesic_sharpness(model, _loss, batches, symmetries=inv, iters=1, progress=False)
    assert result.settings["metric"] == "inv"
    assert SymmetryPlan().metric is None


def test_outputs_that_become_non_finite_refute_a_group():
    model = tiny_llama()
    v_proj = model.model.layers[0].self_attn.v_proj
    original = v_proj.weight.detach().clone()

    def poison(module, args, out):  # any other value weights: NaN outputs
        return out if torch.equal(module.weight, original) else out * float("nan")

    v_proj.register_forward_hook(poison)
    plan = gq.find_symmetries(model, verify=False)
    proof = prove_plan(model, plan)
    vo = next(c for c in proof.checks if "value-output" in c.name)
    assert not vo.holds and vo.deviation == float("inf")


def test_the_proof_and_its_controls_run_under_no_grad():
    model = tiny_llama()
    with torch.no_grad():
        plan = gq.find_symmetries(model)
    assert plan.notes[-1].startswith("verified 2") or any(
        n.startswith("verified 2") for n in plan.notes
    )
    assert not any("weak check" in n for n in plan.notes), plan.notes


def test_discovery_under_autocast_proves_in_the_weights_precision():
    model = tiny_llama().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = gq.find_symmetries(model)
    assert {g.kind for g in plan.groups} == {"query-key", "value-output"}
    assert any("computing in float32" in n for n in plan.notes), plan.notes
