"""Symmetries of today's decoder LLMs, family by family, on tiny random float64 models.

For each family the test applies a random element of the group that discovery found,
with its *own* implementation of the action on the weights (row maps written here from
each family's modelling code, not the library's layouts), and checks that

* the logits do not change (to the float32 resolution of the norms these families run
  in float32 even in a float64 model),
* a general GL(h) on rotary Q/K *does* change them (attention is made far from uniform
  with a large ``initializer_range``, so the check is sensitive),
* geodesic sharpness (inv and mix) is the same before and after, adaptive sharpness is not.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torch.func import functional_call

from geoopt_quotient import (
    GeodesicEqualsAdaptiveWarning,
    GLQuotient,
    PlanError,
    PositiveScalingQuotient,
    RotaryGLQuotient,
    SymmetryGroup,
    SymmetryPlan,
    adaptive_sharpness,
    find_symmetries,
    geodesic_sharpness,
)

transformers = pytest.importorskip("transformers")
F64 = torch.float64
pytestmark = [pytest.mark.usefixtures("single_thread")]

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 4, 2, 8, 32, 50
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    intermediate_size=24,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
    initializer_range=0.3,
)
#: the float32 resolution the families' norms compute in, times the layers' gain
TOL = 64 * torch.finfo(torch.float32).eps


@dataclass
class Family:
    """A tiny model of one family and where its heads sit in its weights."""

    prefix: str  # the classes are <prefix>Config and <prefix>ForCausalLM, or "Config:Model"
    options: Dict
    layout: str = "separate"  # or "blocks", "per-head", "kv-groups"
    names: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # or (fused, o)
    kv_heads: int = KV_HEADS
    rotary: Tuple[int, str] | None = (HEAD_DIM, "half")  # None: Q/K left adaptive


GQA = dict(num_key_value_heads=KV_HEADS)
HALF_ROTARY = dict(
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
)
FUSED = ("query_key_value", "dense")
FAMILIES: Dict[str, Family] = {
    "llama": Family("Llama", GQA),
    "mistral": Family("Mistral", GQA),
    "qwen2": Family("Qwen2", GQA),  # q, k, v biases
    "qwen3": Family("Qwen3", dict(GQA, head_dim=HEAD_DIM), rotary=None),  # per-head q/k norm
    "olmo2": Family("Olmo2", GQA, rotary=None),  # q/k norm over all heads
    "gemma3": Family(
        "Gemma3TextConfig:Gemma3ForCausalLM", dict(GQA, head_dim=HEAD_DIM), rotary=None
    ),
    "gemma": Family("Gemma", dict(GQA, head_dim=HEAD_DIM)),
    "gemma2": Family("Gemma2", dict(GQA, head_dim=HEAD_DIM)),
    "olmo": Family("Olmo", GQA),
    "phi3": Family("Phi3", GQA, "blocks", ("qkv_proj", "o_proj")),
    "phi": Family(
        "Phi",
        HALF_ROTARY,
        names=("q_proj", "k_proj", "v_proj", "dense"),
        kv_heads=HEADS,
        rotary=(4, "half"),
    ),
    "gpt_neox": Family("GPTNeoX", HALF_ROTARY, "per-head", FUSED, HEADS, (4, "half")),
    "falcon": Family(
        "Falcon", dict(new_decoder_architecture=True, num_kv_heads=2, bias=True), "kv-groups", FUSED
    ),
    "falcon_mqa": Family("Falcon", dict(multi_query=True), "blocks", FUSED, kv_heads=1),
    "gptj": Family(
        "GPTJ",
        dict(n_embd=HIDDEN, n_head=HEADS, n_layer=2, rotary_dim=4, n_positions=64),
        names=("q_proj", "k_proj", "v_proj", "out_proj"),
        kv_heads=HEADS,
        rotary=(4, "interleaved"),
    ),
}


_MODELS: Dict[str, torch.nn.Module] = {}


def model_for(name: str) -> torch.nn.Module:
    family = FAMILIES[name]
    config_name, _, model_name = family.prefix.partition(":")
    if not model_name:
        config_name, model_name = f"{family.prefix}Config", f"{family.prefix}ForCausalLM"
    config_class = getattr(transformers, config_name, None)
    model_class = getattr(transformers, model_name, None)
    if config_class is None or model_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    if name not in _MODELS:
        torch.manual_seed(0)
        config = config_class(**{**COMMON, **family.options})
        config._attn_implementation = "eager"
        _MODELS[name] = model_class(config).double().eval()
    return _MODELS[name]


def inputs(seed: int) -> Dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids}


def logits(model, params, batch) -> torch.Tensor:
    with torch.no_grad():
        return functional_call(model, params, (), dict(batch)).logits


def relative_change(model, params, new_params, batch) -> float:
    y0, y1 = logits(model, params, batch), logits(model, new_params, batch)
    return float((y1 - y0).abs().max() / y0.abs().max())


# ---------------------------------------------------------------- the action, written here
def planes(rotary: Tuple[int, str]) -> List[Tuple[int, int]]:
    r, pairing = rotary
    if pairing == "half":
        return [(j, j + r // 2) for j in range(r // 2)]
    return [(2 * j, 2 * j + 1) for j in range(r // 2)]


def well_conditioned(k: int, g: torch.Generator, max_condition: float = 10.0) -> torch.Tensor:
    u, _ = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=F64))
    s = max_condition ** (torch.rand(k, generator=g, dtype=F64) - 0.5)
    return u @ torch.diag(s) @ v.T


def commuting_element(rotary, g: torch.Generator) -> torch.Tensor:
    """a I + b J on each rotary plane (|a + ib| in [10^-1/2, 10^1/2]), a general
    well-conditioned block on the other dims: condition number <= 10."""
    a = torch.zeros(HEAD_DIM, HEAD_DIM, dtype=F64)
    for j, k in planes(rotary):
        modulus = 10 ** (torch.rand((), generator=g, dtype=F64).item() - 0.5)
        angle = 2 * math.pi * torch.rand((), generator=g, dtype=F64).item()
        re, im = modulus * math.cos(angle), modulus * math.sin(angle)
        a[j, j] = a[k, k] = re
        a[k, j], a[j, k] = im, -im
    r = rotary[0]
    if r < HEAD_DIM:
        a[r:, r:] = well_conditioned(HEAD_DIM - r, g)
    assert torch.linalg.cond(a) <= 10 * (1 + 1e-9)
    return a


def head_rows(family: Family, heads: int) -> Dict[str, List[torch.Tensor]]:
    """Output rows of each head's q, k, v (per kv head for k, v) in the family's weights."""
    hd, kv = HEAD_DIM, family.kv_heads
    span = lambda start: torch.arange(start, start + hd)  # noqa: E731
    group = heads // kv
    if family.layout in ("separate", "blocks"):
        q_end, k_end = (0, 0) if family.layout == "separate" else (heads * hd, (heads + kv) * hd)
        return {
            "q": [span(i * hd) for i in range(heads)],
            "k": [span(q_end + j * hd) for j in range(kv)],
            "v": [span(k_end + j * hd) for j in range(kv)],
        }
    if family.layout == "per-head":  # [q; k; v] per head
        return {
            "q": [span(3 * i * hd) for i in range(heads)],
            "k": [span((3 * i + 1) * hd) for i in range(heads)],
            "v": [span((3 * i + 2) * hd) for i in range(heads)],
        }
    per = group + 2  # kv-groups: [q_1..q_g; k; v] per kv head
    return {
        "q": [span((i // group * per + i % group) * hd) for i in range(heads)],
        "k": [span((j * per + group) * hd) for j in range(kv)],
        "v": [span((j * per + group + 1) * hd) for j in range(kv)],
    }


def attention_modules(model, family: Family) -> List[str]:
    last = family.names[-1]
    return [
        path
        for path, module in model.named_modules()
        if all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in family.names)
        and isinstance(getattr(module, last), torch.nn.Linear)
    ]


def act(
    model, family: Family, params, qk: Callable, vo: Callable, output: bool = True
) -> Dict[str, torch.Tensor]:
    """Weights after A = qk(layer, kv head) on Q/K and B = vo(layer, kv head) on V/O:
    W_q <- A^-T W_q, W_k <- A W_k, W_v <- B^-T W_v, W_o[:, head] <- W_o[:, head] B^T
    (the last one skipped with ``output=False``: not a symmetry)."""
    out = {n: p.clone() for n, p in params.items()}
    rows = head_rows(family, HEADS)
    group = HEADS // family.kv_heads
    for layer, path in enumerate(attention_modules(model, family)):
        if family.layout == "separate":
            q, k, v = (f"{path}.{n}" for n in family.names[:3])
        else:
            q = k = v = f"{path}.{family.names[0]}"
        o = f"{path}.{family.names[-1]}.weight"

        def apply(name, row, matrix):
            for suffix in ("weight", "bias"):
                key = f"{name}.{suffix}"
                if key in out:
                    out[key][row] = matrix @ out[key][row]

        for j in range(family.kv_heads):
            a, b = qk(layer, j), vo(layer, j)
            apply(k, rows["k"][j], a)
            apply(v, rows["v"][j], torch.linalg.inv(b).T)
            for i in range(j * group, (j + 1) * group):
                apply(q, rows["q"][i], torch.linalg.inv(a).T)
                cols = torch.arange(i * HEAD_DIM, (i + 1) * HEAD_DIM)
                if output:
                    out[o][:, cols] = out[o][:, cols] @ b.T
    return out


def params_of(model) -> Dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def symmetric_weights(name: str, seed: int) -> Dict[str, torch.Tensor]:
    family, model = FAMILIES[name], model_for(name)
    g = torch.Generator().manual_seed(seed)
    eye = torch.eye(HEAD_DIM, dtype=F64)
    cache: Dict = {}

    def qk(layer, j):
        if family.rotary is None:
            return eye
        return cache.setdefault(("qk", layer, j), commuting_element(family.rotary, g))

    def vo(layer, j):
        return cache.setdefault(("vo", layer, j), well_conditioned(HEAD_DIM, g))

    return act(model, family, params_of(model), qk, vo)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(FAMILIES))
def test_discovery_finds_the_rotary_subgroup(name):
    family, model = FAMILIES[name], model_for(name)
    plan = find_symmetries(model)
    kinds = {g.kind: g for g in plan.groups}
    vo = kinds["value-output"]
    assert type(vo.manifold) is GLQuotient
    assert vo.count == 2 * family.kv_heads  # one element per kv head and layer
    if family.rotary is None:
        assert "query-key" not in kinds
        assert any("q_norm, k_norm" in note for note in plan.notes), plan.notes
        return
    qk = kinds["query-key"].manifold
    assert isinstance(qk, RotaryGLQuotient)
    assert (qk.rotary_dim, qk.pairing) == family.rotary
    assert kinds["query-key"].count == 2 * family.kv_heads
    text = plan.bind(model).summary()
    assert "rotary C*^" in text and "GL(8) [64]" in text


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_found_group_leaves_logits_unchanged_and_general_gl_does_not(name):
    family, model = FAMILIES[name], model_for(name)
    params = params_of(model)
    batch = inputs(0)
    err = relative_change(model, params, symmetric_weights(name, seed=1), batch)
    assert err <= TOL, f"{name}: invariance error {err:.3g}"
    g = torch.Generator().manual_seed(2)
    eye = torch.eye(HEAD_DIM, dtype=F64)
    general = act(model, family, params, lambda *_: well_conditioned(HEAD_DIM, g), lambda *_: eye)
    assert relative_change(model, params, general, batch) > 1e-3
    # the test's action is not vacuous on V/O either: B on V alone changes the logits
    v_only = act(model, family, params, lambda *_: eye, lambda *_: well_conditioned(8, g), False)
    assert relative_change(model, params, v_only, batch) > 1e-3


def next_token_loss(model, batch):
    out = model(**batch)
    return torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, VOCAB), batch["input_ids"][:, 1:].reshape(-1)
    )


@pytest.mark.parametrize("name", list(FAMILIES))
def test_geodesic_sharpness_is_invariant_adaptive_is_not(name):
    model = model_for(name)
    other = copy.deepcopy(model)
    other.load_state_dict(symmetric_weights(name, seed=3), strict=False)
    batches = [inputs(10)]
    kw = dict(rho=0.05, iters=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GeodesicEqualsAdaptiveWarning)  # Qwen3's Q/K
        for metric in ("mix", "inv"):
            a = geodesic_sharpness(model, next_token_loss, batches, metric=metric, **kw).value
            b = geodesic_sharpness(other, next_token_loss, batches, metric=metric, **kw).value
            assert a > 0
            assert abs(a - b) <= 1e-5 * abs(a), (metric, a, b)
    c = adaptive_sharpness(model, next_token_loss, batches, **kw).value
    d = adaptive_sharpness(other, next_token_loss, batches, **kw).value
    assert abs(c - d) > 1e-2 * abs(c), (c, d)


def test_geodesic_sharpness_warns_where_attention_is_left_adaptive():
    model = model_for("qwen3")
    with pytest.warns(GeodesicEqualsAdaptiveWarning, match=r"q_norm, k_norm"):
        geodesic_sharpness(model, next_token_loss, [inputs(0)], rho=0.05, iters=1)
    bare = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with pytest.warns(GeodesicEqualsAdaptiveWarning, match="equals adaptive sharpness"):
        geodesic_sharpness(
            bare, lambda m, x: m(x).square().mean(), [torch.randn(2, 3)], rho=0.1, iters=1
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", GeodesicEqualsAdaptiveWarning)
        geodesic_sharpness(model_for("llama"), next_token_loss, [inputs(0)], rho=0.05, iters=1)


# ---------------------------------------------------------------- gated MLPs (kinds="all")
def mlp_weights(name: str, seed: int, part: str = "both") -> Dict[str, torch.Tensor]:
    """Row i of up (and of gate with ``part="gate"``: not a symmetry) divided by a_i,
    column i of down multiplied by a_i; written here from the MLPs' forward."""
    model = model_for(name)
    out = {n: p.clone() for n, p in params_of(model).items()}
    g = torch.Generator().manual_seed(seed)
    for path, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        if not isinstance(down, torch.nn.Linear):
            continue
        units = down.in_features
        a = 10 ** (torch.rand(units, generator=g, dtype=F64) - 0.5)
        a = a * torch.where(torch.rand(units, generator=g) < 0.5, -1.0, 1.0).double()
        if hasattr(module, "gate_up_proj"):  # Phi-3: rows [gate; up]
            rows = torch.arange(units) if part == "gate" else torch.arange(units, 2 * units)
            key = f"{path}.gate_up_proj.weight"
        else:
            rows = torch.arange(units)
            key = f"{path}.{'gate' if part == 'gate' else 'up'}_proj.weight"
        out[key][rows] = out[key][rows] / a[:, None]
        out[f"{path}.down_proj.weight"] = out[f"{path}.down_proj.weight"] * a
    return out


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_gated_mlp_pairs_with_kinds_all(name):
    model = model_for(name)
    default = find_symmetries(model)
    plan = find_symmetries(model, kinds="all")
    assert "mlp" not in {g.kind for g in default.groups}
    (mlp,) = [g for g in plan.groups if g.kind == "mlp"]
    assert mlp.count == 2 * 24 and tuple(mlp.shape) == (2, 24, HIDDEN + HIDDEN, 1)
    assert "GL(1) [1]" in plan.bind(model).summary()
    params, batch = params_of(model), inputs(0)
    assert relative_change(model, params, mlp_weights(name, 1), batch) <= TOL
    assert relative_change(model, params, mlp_weights(name, 1, part="gate"), batch) > 1e-3
    other = copy.deepcopy(model)
    moved = mlp_weights(name, 2)
    moved.update(
        {k: v for k, v in symmetric_weights(name, 3).items() if "mlp" not in k}
    )  # attention and MLP actions together
    assert relative_change(model, params, moved, batch) <= TOL
    other.load_state_dict(moved, strict=False)
    kw = dict(rho=0.05, iters=3)
    for metric in ("mix", "inv"):
        sym = find_symmetries(model, metric=metric, kinds="all")
        a = geodesic_sharpness(model, next_token_loss, [batch], symmetries=sym, **kw).value
        sym_other = find_symmetries(other, metric=metric, kinds="all")
        b = geodesic_sharpness(other, next_token_loss, [batch], symmetries=sym_other, **kw)
        assert abs(a - b.value) <= 1e-5 * abs(a), (metric, a, b.value)
    c = adaptive_sharpness(model, next_token_loss, [batch], **kw).value
    d = adaptive_sharpness(other, next_token_loss, [batch], **kw).value
    assert abs(c - d) > 1e-2 * abs(c), (c, d)


def test_kinds_are_checked_and_overlapping_groups_refused():
    model = model_for("llama")
    with pytest.raises(ValueError, match="unknown symmetry kinds"):
        find_symmetries(model, kinds=["mlp", "norm"])
    only = find_symmetries(model, kinds=["mlp"])
    assert {g.kind for g in only.groups} == {"mlp"}
    plan = find_symmetries(model, kinds="all")
    q = "model.layers.0.self_attn.q_proj.weight"
    gain = "model.layers.0.input_layernorm.weight"
    columns = SymmetryGroup.from_layout(
        "gain x q columns",  # a norm gain against Q's input columns: touches Q/K's entries
        GLQuotient(1, HEADS * HEAD_DIM),
        {gain: (HIDDEN,), q: (HEADS * HEAD_DIM, HIDDEN)},
        lambda g, w: torch.cat((g[:1, None], w[:, :1]), dim=0),
        kind="norm-gain",
    )
    with pytest.raises(PlanError, match=r"covered by two groups.*query-key.*norm-gain"):
        SymmetryPlan([*plan.groups, columns]).bind(model)


def test_relu_mlps_quotient_positive_scalings_only():
    """T5's DenseReluDense: wi rows / a, wo columns * a is a symmetry for a > 0 only."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=6, num_heads=2, d_ff=24, num_layers=1
    )
    model = transformers.T5Model(config).double().eval()
    plan = find_symmetries(model, kinds="all", verify=True)
    (mlp,) = [g for g in plan.groups if g.kind == "mlp"]
    assert isinstance(mlp.manifold, PositiveScalingQuotient) and mlp.count == 2 * 24
    assert any(note.startswith("verified 3") for note in plan.notes)
    params = params_of(model)
    batch = {"input_ids": inputs(0)["input_ids"], "decoder_input_ids": inputs(1)["input_ids"]}

    def outputs(weights):
        with torch.no_grad():
            return functional_call(model, weights, (), batch).last_hidden_state

    def scaled(a):
        out = dict(params)
        for path in ("encoder.block.0.layer.1", "decoder.block.0.layer.2"):
            wi, wo = f"{path}.DenseReluDense.wi.weight", f"{path}.DenseReluDense.wo.weight"
            out[wi], out[wo] = params[wi] / a[:, None], params[wo] * a
        return out

    g = torch.Generator().manual_seed(0)
    a = 10 ** (torch.rand(24, generator=g, dtype=F64) - 0.5)
    y0 = outputs(params)
    assert (outputs(scaled(a)) - y0).abs().max() <= 1e-12 * y0.abs().max()
    a[:12] *= -1
    assert (outputs(scaled(a)) - y0).abs().max() > 1e-3 * y0.abs().max()
