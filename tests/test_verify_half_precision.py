"""Symmetry verification of bfloat16 and float16 models on the CPU: the group action is
computed in float32 (the CPU has no half-precision solver) and cast back, within a
tolerance of a few machine epsilons of the model's dtype."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from geoopt_quotient.symmetry import (  # noqa: E402
    SymmetryNotProvenWarning,
    SymmetryVerificationError,
    find_symmetries,
    verify_plan,
)

HALF = [torch.bfloat16, torch.float16]


def tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    """Weights large enough that breaking a symmetry clearly changes the logits."""
    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_model_verifies_on_cpu(dtype):
    model = tiny_llama(dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():  # rounding alone must not refute a true group
        warnings.simplefilter("error", SymmetryNotProvenWarning)
        plan = find_symmetries(model, verify=True)
    bound = plan.bind(model)
    assert {g.kind for g in bound.symmetric_groups} == {"query-key", "value-output"}
    note = next(n for n in bound.notes if n.startswith("verified"))
    eps = torch.finfo(dtype).eps
    if "round trip" in note:  # raised to the rounding measured, within its bound
        assert "at most 100 x the default" in note
    else:
        assert f"{8 * eps:g} x max |output|" in note
    assert not any("weak check" in n for n in bound.notes), bound.notes
    for name, param in model.named_parameters():  # verification leaves the weights alone
        assert param.dtype == dtype and torch.equal(param, before[name])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_check_still_catches_a_broken_symmetry(dtype):
    """A nonlinearity after v_proj breaks the V/O symmetry: the check must fail."""
    model = tiny_llama(dtype)
    plan = find_symmetries(model, verify=False)
    attention = model.model.layers[1].self_attn
    attention.v_proj.register_forward_hook(lambda module, args, out: torch.tanh(2 * out))
    with pytest.raises(SymmetryVerificationError, match="is not a symmetry"):
        verify_plan(model, plan)


def test_float32_and_float64_checks_are_unchanged():
    """No cast for full precision: the element acts in the model's own dtype. A float64
    Llama normalises in float32: its tolerance is float32's."""
    for dtype, rtol in (
        (torch.float32, 1e-4),
        (torch.float64, 64 * torch.finfo(torch.float32).eps),
    ):
        model = tiny_llama(dtype)
        notes = verify_plan(model, find_symmetries(model, verify=False))
        assert f"{rtol:g} x max |output|" in notes[0]
