"""Layouts of today's zoo: fused 3-D experts, multi-head latent attention, fused and
multi-query attention, each checked with an action written here from the family's
modelling code (not the library's layouts), on tiny float64 models of the zoo.

Each test (1) checks what :func:`find_symmetries` claims on the family, (2) applies a
random element of that group with its own row maps and checks the logits do not move,
and (3) checks the negative: the same maps on one factor only do move them.
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
from geoopt_quotient.testing import zoo

pytestmark = [pytest.mark.usefixtures("single_thread")]
F64 = torch.float64
Params = Dict[str, torch.Tensor]


@functools.cache
def _built(family: str) -> zoo.ZooModel:
    built = zoo.build_family(family)
    assert built.model is not None, built.reason
    return built


def _plan(family: str):
    model = _built(family).model
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no group of these families may be demoted
        return find_symmetries(model, kinds="all")


def _invariance(family: str, act: Callable[[Params, bool], Params]) -> None:
    """``act(params, both)`` moves the parameters by a random group element (``both``) or
    its first factor only; the logits stay within the threshold only in the first case."""
    built = _built(family)
    params = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    reference = zoo.logits_of(built.model, params, built.inputs)
    threshold, _ = zoo.tolerance_for_ops(
        zoo.reduced_precision_ops(built.model, params, built.inputs)
    )
    moved = zoo.logits_of(built.model, act(dict(params), True), built.inputs)
    broken = zoo.logits_of(built.model, act(dict(params), False), built.inputs)
    assert zoo.relative_change(reference, moved) <= threshold
    assert zoo.relative_change(reference, broken) > 100 * threshold


# ----------------------------------------------------------------- fused 3-D experts
def _expert_modules(model: torch.nn.Module):
    return [(p, m) for p, m in model.named_modules() if type(m).__name__.endswith("Experts")
            and isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)]  # fmt: skip


def _scale_experts(model, params: Params, both: bool, seed: int = 0) -> Params:
    """Unit ``i`` of expert ``e``: row ``units + i`` of ``gate_up_proj[e]`` (the up half of
    ``chunk(2)``) times ``a``, column ``i`` of ``down_proj[e]`` divided by ``a``."""
    generator = torch.Generator().manual_seed(seed)
    for path, _ in _expert_modules(model):
        up, down = f"{path}.gate_up_proj", f"{path}.down_proj"
        experts, _, units = params[down].shape
        a = random_factors((experts, units), generator)
        w = params[up].clone()
        w[:, units:, :] = w[:, units:, :] * a[:, :, None]
        params[up] = w
        if both:
            params[down] = params[down] / a[:, None, :]
    return params


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "olmoe", "qwen3_moe"])
def test_every_expert_unit_of_fused_experts_is_quotiented(family):
    model = _built(family).model
    experts = _expert_modules(model)
    assert experts, f"{family}: no fused experts in the tiny model"
    bound = _plan(family).bind(model)
    for path, module in experts:
        covered = [g for g in bound.symmetric_groups if f"{path}.gate_up_proj" in g.param_names]
        assert len(covered) == 1 and covered[0].kind == "mlp", path
        e, _, units = module.down_proj.shape
        assert covered[0].shape[-3] == e * units and covered[0].shape[-1] == 1
    _invariance(family, functools.partial(_scale_experts, model))


def test_gpt_oss_experts_keep_no_unit_scaling_and_say_why():
    """GPT-OSS gates with ``(clamp(up) + 1) * glu(clamp(gate))``: no per-unit scaling of
    its interleaved up columns survives (the negative: scaling them moves the logits)."""
    built = _built("gpt_oss")
    plan = _plan("gpt_oss")
    bound = plan.bind(built.model)
    assert not any(".experts." in n for g in bound.symmetric_groups for n in g.param_names)
    assert any("GptOssExperts._apply_gate" in note for note in plan.notes)
    params = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    reference = zoo.logits_of(built.model, params, built.inputs)
    generator = torch.Generator().manual_seed(0)
    for path, _ in _expert_modules(built.model):
        up, down = f"{path}.gate_up_proj", f"{path}.down_proj"
        e, units, _ = params[down].shape  # transposed: (experts, units, hidden)
        a = random_factors((e, units), generator)
        w, b = params[up].clone(), params[f"{up}_bias"].clone()
        w[:, :, 1::2] *= a[:, None, :]
        b[:, 1::2] *= a
        params[up], params[f"{up}_bias"], params[down] = w, b, params[down] / a[:, :, None]
    moved = zoo.logits_of(built.model, params, built.inputs)
    assert zoo.relative_change(reference, moved) > 1e-3


# ----------------------------------------------------------- multi-head latent attention
def _latent_action(model, params: Params, both: bool, seed: int = 0) -> Params:
    """Per head: ``A`` on the non-rotary query rows of ``q_b_proj`` and ``A^{-T}`` on the
    key rows of ``kv_b_proj``; ``B`` on its value rows and ``B^{-1}`` on the head's
    columns of ``o_proj`` (DeepSeek-V3's ``split([nope, rope])`` and
    ``split([nope, v])``)."""
    generator = torch.Generator().manual_seed(seed)
    for path, m in model.named_modules():
        if not hasattr(m, "kv_b_proj"):
            continue
        heads, nope, rope, v = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        a, b = random_matrices(heads, nope, generator), random_matrices(heads, v, generator)
        q = params[f"{path}.q_b_proj.weight"].reshape(heads, nope + rope, -1).clone()
        kv = params[f"{path}.kv_b_proj.weight"].reshape(heads, nope + v, -1).clone()
        o = params[f"{path}.o_proj.weight"].reshape(-1, heads, v).clone()
        q[:, :nope] = a @ q[:, :nope]
        kv[:, nope:] = b @ kv[:, nope:]
        if both:
            kv[:, :nope] = torch.linalg.inv(a).mT @ kv[:, :nope]
            o = torch.einsum("ohj,hjk->ohk", o, torch.linalg.inv(b))
        params[f"{path}.q_b_proj.weight"] = q.reshape(heads * (nope + rope), -1)
        params[f"{path}.kv_b_proj.weight"] = kv.reshape(heads * (nope + v), -1)
        params[f"{path}.o_proj.weight"] = o.reshape(o.shape[0], -1)
    return params


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "minicpm3"])
def test_latent_attention_has_query_key_and_value_output_groups(family):
    model = _built(family).model
    bound = _plan(family).bind(model)
    kinds = {g.kind: g for g in bound.symmetric_groups if g.kind in zoo.ATTENTION_KINDS}
    assert set(kinds) == {"query-key", "value-output"}
    config = model.config
    assert kinds["query-key"].shape[-1] == config.qk_nope_head_dim
    assert kinds["value-output"].shape[-1] == config.v_head_dim
    assert kinds["query-key"].shape[-3] == config.num_attention_heads
    _invariance(family, functools.partial(_latent_action, model))


# ------------------------------------------------- fused, multi-query and sink attention
def _rows(params: Params, name: str, rows: torch.Tensor, mats: torch.Tensor) -> None:
    """``weight[rows[i]] <- mats[i] @ weight[rows[i]]`` (and the bias entries alike)."""
    for suffix in ("weight", "bias"):
        key = f"{name}.{suffix}"
        if key in params:
            t = params[key].clone()
            block = t[rows.reshape(-1)].reshape(*rows.shape, *t.shape[1:])
            moved = torch.einsum("hij,hj...->hi...", mats, block)
            t[rows.reshape(-1)] = moved.reshape(-1, *t.shape[1:])
            params[key] = t


def _columns(params: Params, name: str, heads: int, mats: torch.Tensor) -> None:
    """Head ``i``'s columns of ``name.weight`` (an output projection) times ``mats[i]``."""
    w = params[f"{name}.weight"]
    head_dim = mats.shape[-1]
    blocks = w.reshape(w.shape[0], heads, head_dim)
    params[f"{name}.weight"] = torch.einsum("ohj,hjk->ohk", blocks, mats).reshape(w.shape)


def _fused_action(family: str, fused: str, out: str, kv_heads: int):
    """Q/K: ``A_g`` on the query rows of every head of key/value head ``g``, ``A_g^{-T}``
    on its key rows; V/O: ``B_g`` on its value rows, ``B_g^{-1}`` on the output columns
    of its query heads. Rows of the fused projection: all queries, all keys, all values
    (MPT's ``chunk(3)``, GPT-BigCode's multi-query ``split``)."""
    model = _built(family).model

    def act(params: Params, both: bool, seed: int = 0) -> Params:
        generator = torch.Generator().manual_seed(seed)
        for path, m in model.named_modules():
            if not isinstance(getattr(m, fused, None), torch.nn.Linear):
                continue
            heads, hd = m.num_heads if hasattr(m, "num_heads") else m.n_heads, m.head_dim
            group = heads // kv_heads
            a, b = (
                random_matrices(kv_heads, hd, generator),
                random_matrices(kv_heads, hd, generator),
            )
            q = torch.arange(heads * hd).reshape(heads, hd)
            k = heads * hd + torch.arange(kv_heads * hd).reshape(kv_heads, hd)
            v = (heads + kv_heads) * hd + torch.arange(kv_heads * hd).reshape(kv_heads, hd)
            per_query = torch.arange(heads) // group
            _rows(params, f"{path}.{fused}", q, a[per_query])
            _rows(params, f"{path}.{fused}", v, b)
            if both:
                _rows(params, f"{path}.{fused}", k, torch.linalg.inv(a).mT)
                _columns(params, f"{path}.{out}", heads, torch.linalg.inv(b)[per_query])
        return params

    return act


@pytest.mark.parametrize(
    "family, fused, out, kv_heads",
    [("gpt_bigcode", "c_attn", "c_proj", 1), ("mpt", "Wqkv", "out_proj", 4)],
)
def test_fused_and_multi_query_attention_has_both_groups(family, fused, out, kv_heads):
    bound = _plan(family).bind(_built(family).model)
    groups = {g.kind: g for g in bound.symmetric_groups}
    assert {"query-key", "value-output"} <= set(groups)
    assert groups["query-key"].shape[-3] == kv_heads  # one element per key/value head
    _invariance(family, _fused_action(family, fused, out, kv_heads))


def test_attention_sinks_leave_both_groups_of_gpt_oss():
    """A learned logit per head in the softmax's denominator does not see Q, K or V."""
    model = _built("gpt_oss").model
    bound = _plan("gpt_oss").bind(model)
    assert {"query-key", "value-output"} <= {g.kind for g in bound.symmetric_groups}
    config = model.config
    heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def act(params: Params, both: bool, seed: int = 0) -> Params:
        generator = torch.Generator().manual_seed(seed)
        for path, m in model.named_modules():
            if not hasattr(m, "sinks"):
                continue
            b = random_matrices(kv_heads, hd, generator)
            _rows(params, f"{path}.v_proj", torch.arange(kv_heads * hd).reshape(kv_heads, hd), b)
            if both:
                per_query = torch.arange(heads) // (heads // kv_heads)
                _columns(params, f"{path}.o_proj", heads, torch.linalg.inv(b)[per_query])
        return params

    _invariance("gpt_oss", act)


def test_jetmoe_mixture_of_attention_heads_has_both_groups():
    """JetMoE repeats its key/value heads over the ``top_k`` routed experts: head ``j`` of
    every expert pairs with key/value head ``j``. Own action on V/O: ``B_j`` on value head
    ``j``'s rows of ``kv_proj``, ``B_j^{-1}`` on head ``j``'s columns of every expert's
    output projection."""
    model = _built("jetmoe").model
    bound = _plan("jetmoe").bind(model)
    kinds = {g.kind: g for g in bound.symmetric_groups}
    assert {"query-key", "value-output"} <= set(kinds)
    config = model.config
    kv_heads, hd, experts = config.num_key_value_heads, config.kv_channels, config.num_local_experts
    assert kinds["value-output"].shape[-3:] == (kv_heads, 32 + experts * 32, hd)

    def act(params: Params, both: bool, seed: int = 0) -> Params:
        generator = torch.Generator().manual_seed(seed)
        for path, m in model.named_modules():
            if not hasattr(m, "kv_proj"):
                continue
            b = random_matrices(kv_heads, hd, generator)
            rows = kv_heads * hd + torch.arange(kv_heads * hd).reshape(kv_heads, hd)
            _rows(params, f"{path}.kv_proj", rows, b)
            if both:
                name = f"{path}.experts.output_linear.weight"
                w = params[name].reshape(experts, -1, kv_heads, hd)
                moved = torch.einsum("eojh,jhk->eojk", w, torch.linalg.inv(b))
                params[name] = moved.reshape(params[name].shape)
        return params

    _invariance("jetmoe", act)


def test_dbrx_clamped_qkv_keeps_no_attention_group_and_says_why():
    """DBRX clamps the fused q, k, v to [-clip_qkv, clip_qkv]: only signed permutations of
    a head's dimensions commute with that (a finite group)."""
    plan = _plan("dbrx")
    assert not [g for g in plan.groups if g.kind in zoo.ATTENTION_KINDS]
    assert any("clip_qkv" in note for note in plan.notes)


def test_llama4_quotients_query_key_of_its_nope_layers_only():
    """Llama 4 L2-normalises the rotated queries and keys of its rotary layers (no group
    the library quotients survives, a note says why); its NoPE layers keep GL(h) on Q/K
    (per key/value head: ``A`` on its query heads' rows of ``q_proj``, ``A^{-T}`` on its
    rows of ``k_proj``)."""
    model = _built("llama4_text").model
    plan = _plan("llama4_text")
    (qk,) = [g for g in plan.bind(model).symmetric_groups if g.kind == "query-key"]
    nope = [i for i, rope in enumerate(model.config.no_rope_layers) if not rope]
    assert nope and {n.split(".")[2] for n in qk.param_names} == {str(i) for i in nope}
    assert any("without gains" in n and "qk_norm" in n for n in plan.notes)
    config = model.config
    heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_query = torch.arange(heads) // (heads // kv_heads)

    def act(params: Params, both: bool, seed: int = 0) -> Params:
        generator = torch.Generator().manual_seed(seed)
        for i in nope:
            path = f"model.layers.{i}.self_attn"
            a = random_matrices(kv_heads, hd, generator)
            _rows(
                params, f"{path}.q_proj", torch.arange(heads * hd).reshape(heads, hd), a[per_query]
            )
            if both:
                k_rows = torch.arange(kv_heads * hd).reshape(kv_heads, hd)
                _rows(params, f"{path}.k_proj", k_rows, torch.linalg.inv(a).mT)
        return params

    _invariance("llama4_text", act)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::geoopt_quotient.GeodesicEqualsAdaptiveWarning")
def test_geodesic_sharpness_of_deepseek_v3_is_invariant_adaptive_is_not():
    """Latent attention and fused experts acted on together (this file's own actions):
    geodesic sharpness (kinds="all") does not move, adaptive sharpness does."""
    built = _built("deepseek_v3")
    model, batch = built.model, {"input_ids": built.inputs["input_ids"]}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = _latent_action(model, _scale_experts(model, dict(params), True, seed=1), True)
    geodesic, (c, d) = sharpness_before_and_after(model, moved, batch, kinds="all")
    for metric, (a, b) in geodesic.items():
        assert a > 0 and abs(a - b) <= 1e-5 * abs(a), (metric, a, b)
    assert abs(c - d) > 1e-2 * abs(c), (c, d)


def test_the_docs_table_of_families_is_derived_from_the_sweep_file():
    """``benchmarks/derive_results.py`` gives every family of the committed sweep a row of
    the docs' table, with the plan's own note where attention is not quotiented, and the
    committed derived file is what the sweep gives."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = root / "benchmarks/derive_results.py"
    spec = importlib.util.spec_from_file_location("derive_results", path)
    derive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(derive)
    sweep = root / "benchmarks/results/zoo/causal_lm_sweep.json"
    document = json.loads(sweep.read_text())
    rows = derive.zoo_sweep(document)["families"]
    assert [r["family"] for r in rows] == [r["family"] for r in document["families"]]
    by_family = {r["family"]: r for r in document["families"]}
    assert derive.why_not(by_family["llama"]) == ""
    assert derive.why_not(by_family["mamba"]).startswith("no attention")
    assert "clip_qkv" in derive.why_not(by_family["dbrx"])
    table = {r["family"]: r for r in rows}
    assert table["llama"]["why_not"] == derive.DASH and table["llama"]["exact"] == "yes"
    committed = json.loads(sweep.with_suffix(".derived.json").read_text())
    assert committed["derived"]["families"] == rows


def test_dbrx_clamp_breaks_the_scaling_every_attention_group_contains():
    """Why DBRX has no attention group: ``s`` on the queries and ``1/s`` on the keys lies in
    every Q/K group (rotary or not) and keeps the logits while no entry reaches the clamp,
    so a probe cannot refute it; once queries reach ``clip_qkv`` it changes them. (In
    transformers' DBRX the clamp cannot be turned off: ``clip_qkv=None`` fails there.)"""
    built = _built("dbrx")
    config = built.model.config
    q_rows = config.d_model  # Wqkv's rows: all queries, then the keys, then the values
    k_rows = slice(
        q_rows, q_rows + config.attn_config.kv_n_heads * (config.d_model // config.n_heads)
    )
    params = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    reference = zoo.logits_of(built.model, params, built.inputs)
    threshold, _ = zoo.tolerance_for_ops(
        zoo.reduced_precision_ops(built.model, params, built.inputs)
    )

    def scaled(s: float) -> float:
        moved = dict(params)
        for name in [n for n in params if n.endswith("Wqkv.weight")]:
            w = params[name].clone()
            w[:q_rows] *= s
            w[k_rows] /= s
            moved[name] = w
        return zoo.relative_change(reference, zoo.logits_of(built.model, moved, built.inputs))

    assert scaled(1.5) <= threshold  # below the clamp: invisible to a probe
    assert scaled(1e4) > 100 * threshold  # queries clamped: the function changes
