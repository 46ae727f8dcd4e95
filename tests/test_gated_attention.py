"""Gated and q/k-normalised attention of today's zoo: V/O's diagonal subgroup under an
elementwise output gate, and the q/k-norm gain scaling, each checked with an action
written here from the families' modelling code (not the library's layouts), on tiny
float64 models: the action leaves the logits unchanged, its negative (a general GL(h) on
gated V/O, a different scale per entry of a rotary plane, one gain scaled alone) moves
them, discovery finds the group and the proof keeps it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Dict

import pytest
import torch

pytest.importorskip("transformers")

from zoo_sharpness import random_factors, random_matrices, sharpness_before_and_after

from geoopt_quotient import find_symmetries
from geoopt_quotient.symmetry.norm_gains import multiplies_by_gain
from geoopt_quotient.testing import zoo

pytestmark = [pytest.mark.usefixtures("single_thread")]
F64 = torch.float64
Params = Dict[str, torch.Tensor]
GATED = ["afmoe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"]
NORMALISED = [
    "gemma3n_text",
    "gemma4",
    "gemma4_text",
    "gemma4_unified",
    "gemma4_unified_text",
    "doge",
    "afmoe",
]
DIAGONAL, GAINS = "[value-output: diagonal]", "[query-key: q/k-norm gain scaling]"


@functools.cache
def _built(family: str) -> zoo.ZooModel:
    built = zoo.build_family(family)
    assert built.model is not None, built.reason
    return built


@functools.cache
def _plan(family: str):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the proof demotes nothing
        return find_symmetries(_built(family).model)


def _attention(model, child: str):
    return [(p, m) for p, m in model.named_modules() if hasattr(m, child) and hasattr(m, "q_norm")]


def _value_output_action(model, params: Params, general: bool, seed: int = 0) -> Params:
    """Per key/value head ``B`` (diagonal, or a general invertible matrix): values
    ``v -> B^T v`` (rows of ``v_proj``) and ``O_h -> O_h B^{-T}`` on the output columns of
    every query head ``h`` reading that key/value head (``h // group``, as ``repeat_kv``)."""
    generator = torch.Generator().manual_seed(seed)
    for path, m in _attention(model, "v_proj"):
        config = m.config
        kv, hd = config.num_key_value_heads, m.head_dim
        group = config.num_attention_heads // kv
        b = (
            random_matrices(kv, hd, generator)
            if general
            else torch.diag_embed(random_factors((kv, hd), generator))
        )
        name = f"{path}.v_proj.weight"
        params[name] = (b.mT @ params[name].reshape(kv, hd, -1)).reshape(kv * hd, -1)
        if f"{path}.v_proj.bias" in params:
            bias = params[f"{path}.v_proj.bias"].reshape(kv, hd, 1)
            params[f"{path}.v_proj.bias"] = (b.mT @ bias).reshape(-1)
        name = f"{path}.o_proj.weight"
        o = params[name].reshape(-1, kv, group, hd)
        o = torch.einsum("okgj,kji->okgi", o, torch.linalg.inv(b).mT)
        params[name] = o.reshape(o.shape[0], -1)
    return params


def _gain_action(model, params: Params, per_entry: bool, both: bool = True, seed: int = 0):
    """Per rotary plane ``(j, j + h/2)`` (``rotate_half``) one scale ``s``: ``q_norm``'s
    gain times ``s``, ``k_norm``'s over ``s``, and the ``q_norm`` of each later layer that
    reuses this layer's keys (no ``k_norm``: the last earlier layer of its ``layer_type``)
    times ``s``. ``per_entry`` draws a scale per entry instead (not a symmetry)."""
    generator = torch.Generator().manual_seed(seed)
    last, scales = {}, {}
    for path, m in _attention(model, "q_proj"):
        kind = getattr(m, "layer_type", None)
        if not hasattr(m, "k_norm"):
            params[f"{path}.q_norm.weight"] = params[f"{path}.q_norm.weight"] * scales[last[kind]]
            continue
        hd = m.head_dim
        s = (
            random_factors((hd,), generator)
            if per_entry
            else random_factors((hd // 2,), generator).repeat(2)
        )
        last[kind], scales[path] = path, s
        params[f"{path}.q_norm.weight"] = params[f"{path}.q_norm.weight"] * s
        if both:
            params[f"{path}.k_norm.weight"] = params[f"{path}.k_norm.weight"] / s
    return params


def _change(family: str, act: Callable[[Params], Params]) -> float:
    """Relative change of the logits under ``act``, in units of the family's threshold."""
    built = _built(family)
    params = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    reference = zoo.logits_of(built.model, params, built.inputs)
    threshold, _ = zoo.tolerance_for_ops(
        zoo.reduced_precision_ops(built.model, params, built.inputs)
    )
    moved = zoo.logits_of(built.model, act(dict(params)), built.inputs)
    return zoo.relative_change(reference, moved) / threshold


@pytest.mark.slow
@pytest.mark.parametrize("family", GATED)
def test_gated_value_output_keeps_its_diagonal_subgroup_only(family):
    model = _built(family).model
    assert _change(family, lambda p: _value_output_action(model, p, general=False)) <= 1
    assert _change(family, lambda p: _value_output_action(model, p, general=True)) > 100
    plan = _plan(family)
    diagonal = [g for g in plan.groups if DIAGONAL in g.name]
    modules = _attention(model, "v_proj")
    assert len(diagonal) == 1 and diagonal[0].count == len(modules) * diagonal[0].shape[-3]
    kv_units = modules[0][1].config.num_key_value_heads * modules[0][1].head_dim
    assert diagonal[0].shape[-3:] == (kv_units, diagonal[0].shape[-2], 1)
    assert not any(g.kind == "value-output" and DIAGONAL not in g.name for g in plan.groups)
    note = next(n for n in plan.notes if "diagonal subgroup" in n)
    assert "not by GL(h)" in note and "commute" in note


@pytest.mark.slow
@pytest.mark.parametrize("family", NORMALISED)
def test_q_k_norm_gains_scale_against_each_other_per_rotary_plane(family):
    model = _built(family).model
    assert _change(family, lambda p: _gain_action(model, p, per_entry=False)) <= 1
    assert _change(family, lambda p: _gain_action(model, p, per_entry=True)) > 100
    assert _change(family, lambda p: _gain_action(model, p, False, both=False)) > 100
    plan = _plan(family)
    gains = [g for g in plan.groups if GAINS in g.name]
    assert gains and all(g.kind == "query-key" and g.shape[-1] == 1 for g in gains)
    keyed = [p for p, m in _attention(model, "k_norm")]
    covered = {n for g in gains for n in g.param_names}
    assert {f"{p}.k_norm.weight" for p in keyed} <= covered
    assert {f"{p}.q_norm.weight" for p, _ in _attention(model, "q_proj")} <= covered
    assert any("q/k-norm gain scaling" in n and "1/s per rotary plane" in n for n in plan.notes)
    assert not any(n.startswith("Q/K normalised or acted on") for n in plan.notes)


def test_qwen3_next_zero_centred_gains_are_noted_not_claimed():
    """Qwen3-Next's norms multiply by ``1 + weight``: the gain scaling is affine in the
    parameters, so no Q/K group, and the note says why."""
    plan = _plan("qwen3_next")
    assert not any(g.kind == "query-key" for g in plan.groups)
    assert any("(1 + weight)" in n and "not claimed" in n for n in plan.notes)


class _Norm(torch.nn.Module):
    def __init__(self, size: int, offset: float = 0.0, bias: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(size, dtype=F64))
        self.bias = torch.nn.Parameter(torch.rand(size, dtype=F64)) if bias else None
        self.offset = offset

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (self.offset + self.weight)
        return y if self.bias is None else y + self.bias


def test_only_norms_that_multiply_by_their_gain_are_claimed():
    assert multiplies_by_gain(_Norm(6), 6)
    assert not multiplies_by_gain(_Norm(6, offset=1.0), 6)  # (1 + weight)
    assert multiplies_by_gain(_Norm(6, bias=True), 6)  # the bias is scaled with the gain
    assert not multiplies_by_gain(_Norm(6), 4)  # not a gain per head dimension
    assert multiplies_by_gain(torch.nn.RMSNorm(6, dtype=F64), 6)
    assert multiplies_by_gain(torch.nn.LayerNorm(6, dtype=F64), 6)
    assert not multiplies_by_gain(_Norm(6, offset=1.0, bias=True), 6)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::geoopt_quotient.GeodesicEqualsAdaptiveWarning")
def test_geodesic_sharpness_of_afmoe_is_invariant_under_both_groups():
    """AFMoE's gated V/O (diagonal) and q/k-norm gains acted on together (this file's own
    actions): geodesic sharpness does not move; adaptive sharpness with ASAM's offset
    (eps = 0.01) does, by more than a hundred times geodesic's bound. (With eps = 0
    adaptive sharpness is itself invariant under these elementwise scalings: its ball
    scales with each entry.)"""
    built = _built("afmoe")
    model, batch = built.model, {"input_ids": built.inputs["input_ids"]}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = _gain_action(model, _value_output_action(model, dict(params), False, seed=1), False)
    geodesic, (c, d) = sharpness_before_and_after(model, moved, batch, adaptive_eps=0.01)
    for metric, (a, b) in geodesic.items():
        assert a > 0 and abs(a - b) <= 1e-5 * abs(a), (metric, a, b)
    assert abs(c - d) > 100 * 1e-5 * abs(c), (c, d)
