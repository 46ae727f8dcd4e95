"""find_symmetries on tiny random models of real architectures (float64).

Every model gets weights of std 1/sqrt(fan_in) (BERT-style 0.02 init makes outputs so
insensitive that a wrong transformation changes them by ~1e-7 and nothing could fail).
Per architecture: the plan has the expected groups and heads; random group elements
(condition number 20) leave the outputs unchanged; the same element applied to one
factor only (Q but not K, V but not O) changes them a lot; geodesic sharpness is
invariant and adaptive sharpness is not.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict

import pytest
import torch
from conftest import TinyTransformer, random_gl
from torch.func import functional_call

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from geoopt_quotient import (  # noqa: E402
    GLQuotient,
    PlanError,
    RotaryGLQuotient,
    adaptive_sharpness,
    find_symmetries,
    geodesic_sharpness,
)
from geoopt_quotient.symmetry import (  # noqa: E402
    SymmetryNotProvenWarning,
    SymmetryVerificationError,
    linear_attention_pairs,
    verify_plan,
)

pytestmark = pytest.mark.on_device


# ---------------------------------------------------------------- tiny models
def reinit(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """float64, weights ~ N(0, 1/fan_in), biases and norm parameters O(0.3)."""
    g = torch.Generator().manual_seed(seed)
    model = model.double().eval()
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if isinstance(module, (torch.nn.Linear, Conv1D)) and name == "weight":
                    fan_in = p.shape[0] if isinstance(module, Conv1D) else p.shape[1]
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(fan_in))
                elif isinstance(module, torch.nn.Embedding):
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
                elif p.dim() == 1 and name == "weight":  # norm gains
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
                elif p.dim() == 1:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def text_inputs(vocab: int = 50, length: int = 7, **extra) -> Callable[[int], Dict[str, Any]]:
    def make(seed: int) -> Dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (3, length), generator=g)
        mask = torch.ones(3, length, dtype=torch.long)
        mask[-1, -2:] = 0
        out = {"input_ids": ids, "attention_mask": mask}
        for key, shape in extra.items():
            if not isinstance(shape, tuple):
                out[key] = shape
            elif key == "decoder_input_ids":
                out[key] = torch.randint(0, vocab, shape, generator=g)
            else:
                out[key] = torch.randn(shape, generator=g, dtype=torch.float64)
        return out

    return make


def image_inputs(size: int = 8) -> Callable[[int], Dict[str, Any]]:
    def make(seed: int) -> Dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(3, 3, size, size, generator=g, dtype=torch.float64)}

    return make


def clip_inputs(seed: int) -> Dict[str, Any]:
    return {**text_inputs()(seed), **image_inputs()(seed + 1)}


@dataclass
class Case:
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int], Dict[str, Any]]
    groups: Dict[str, int]  # kind -> total heads (count) over all groups of that kind
    n_groups: int
    tol: float = 1e-10  # relative invariance tolerance
    note: str | None = None


T = transformers
SMALL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24)
CASES: Dict[str, Case] = {
    "bert": Case(
        lambda: T.BertModel(T.BertConfig(vocab_size=50, **SMALL)),
        text_inputs(),
        {"query-key": 4, "value-output": 4},
        2,
    ),
    "roberta": Case(
        lambda: T.RobertaModel(T.RobertaConfig(vocab_size=50, **SMALL)),
        text_inputs(),
        {"query-key": 4, "value-output": 4},
        2,
    ),
    "bert-decoder": Case(  # causal self-attention + cross-attention to encoder states
        lambda: T.BertModel(
            T.BertConfig(vocab_size=50, is_decoder=True, add_cross_attention=True, **SMALL)
        ),
        text_inputs(encoder_hidden_states=(3, 5, 16)),
        {"query-key": 8, "value-output": 8},
        2,
    ),
    "distilbert": Case(
        lambda: T.DistilBertModel(
            T.DistilBertConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, hidden_dim=24)
        ),
        text_inputs(),
        {"query-key": 4, "value-output": 4},
        2,
    ),
    "vit": Case(
        lambda: T.ViTModel(T.ViTConfig(image_size=8, patch_size=4, **SMALL)),
        image_inputs(),
        {"query-key": 4, "value-output": 4},
        2,
    ),
    "swin": Case(  # windowed attention + relative position bias; 2 stages of widths 8, 16
        lambda: T.SwinModel(
            T.SwinConfig(
                image_size=8,
                patch_size=2,
                embed_dim=8,
                depths=[1, 1],
                num_heads=[2, 2],
                window_size=2,
            )
        ),
        image_inputs(),
        {"query-key": 4, "value-output": 4},
        4,
    ),
    "clip": Case(  # text: 2 heads of 8; vision: 3 heads of 4 -> separate stacks
        lambda: T.CLIPModel(
            T.CLIPConfig(
                text_config=dict(vocab_size=50, max_position_embeddings=16, **SMALL),
                vision_config=dict(
                    hidden_size=12,
                    num_hidden_layers=2,
                    num_attention_heads=3,
                    intermediate_size=24,
                    image_size=8,
                    patch_size=4,
                ),
                projection_dim=8,
            )
        ),
        clip_inputs,
        {"query-key": 4 + 6, "value-output": 4 + 6},
        4,
    ),
    "gpt2": Case(
        lambda: T.GPT2Model(T.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2)),
        text_inputs(),
        {"query-key": 4, "value-output": 4},
        2,
    ),
    "gpt2-cross": Case(  # self- and cross-attention (q_attn + c_attn K/V) in each block
        lambda: T.GPT2Model(
            T.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, add_cross_attention=True)
        ),
        text_inputs(encoder_hidden_states=(3, 5, 16)),
        {"query-key": 8, "value-output": 8},
        2,
    ),
    "t5": Case(  # inner size 2 x 6 = 12 != d_model 16; encoder self, decoder self + cross
        lambda: T.T5Model(
            T.T5Config(vocab_size=50, d_model=16, d_kv=6, num_heads=2, d_ff=24, num_layers=2)
        ),
        text_inputs(decoder_input_ids=(3, 5)),
        {"query-key": 12, "value-output": 12},
        2,
    ),
    "llama": Case(  # GQA: 4 query heads, 2 kv heads; RoPE: Q/K by the rotary subgroup
        lambda: T.LlamaModel(
            T.LlamaConfig(
                vocab_size=50,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=24,
                max_position_embeddings=32,
            )
        ),
        text_inputs(output_hidden_states=True),
        {"query-key": 4, "value-output": 4},
        2,
        # LlamaRMSNorm casts its float64 input to float32: where the two representatives'
        # hidden states (equal to ~1e-15) round to neighbouring float32 numbers, the outputs
        # differ by a float32 ulp times the later layers' gain (measured: 1.2 eps for one
        # such entry, 4.4 eps if every entry does). Such entries are rare (none in 1000
        # trials); a wrong transformation changes the outputs by > 1e-2.
        tol=64 * torch.finfo(torch.float32).eps,
    ),
    "mha": Case(
        lambda: TinyTransformer(),
        lambda seed: {
            "tokens": torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(seed))
        },
        {"query-key": 6, "value-output": 6},
        2,
    ),
}


_MODELS: Dict[str, torch.nn.Module] = {}


def model_for(name: str) -> torch.nn.Module:
    if name not in _MODELS:
        torch.manual_seed(0)
        _MODELS[name] = reinit(CASES[name].build())
    return _MODELS[name]


def outputs(model: torch.nn.Module, params: Dict[str, torch.Tensor], inputs) -> torch.Tensor:
    """All floating outputs (but caches), flattened into one vector."""
    with torch.no_grad():
        out = functional_call(model, params, (), dict(inputs), strict=False)
    leaves = []

    def collect(value, key=""):
        if "past_key_values" in key:
            return
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            leaves.append(value.reshape(-1))
        elif isinstance(value, dict):
            for k, v in value.items():
                collect(v, str(k))
        elif isinstance(value, (tuple, list)):
            for v in value:
                collect(v, key)

    collect(out if not isinstance(out, torch.Tensor) else [out])
    return torch.cat(leaves)


def relative_change(model, params, new_params, inputs) -> float:
    y0, y1 = outputs(model, params, inputs), outputs(model, new_params, inputs)
    return float((y1 - y0).abs().max() / y0.abs().max())


def one_factor(group, params, element):
    """The element applied to G only (Q but not K; V but not O): not a symmetry."""
    m: GLQuotient = group.manifold
    point = group.gather(params)
    moved = m.act(point, element)
    broken = torch.cat((moved[..., : m.n, :], point[..., m.n :, :]), dim=-2)
    return {**params, **group.scatter(broken, params)}


def elements_for(bound, seed: int, max_condition: float = 20.0):
    g = torch.Generator().manual_seed(seed)
    return [element_for(gr, max_condition, g) for gr in bound.symmetric_groups]


def element_for(group, max_condition, generator):
    """A random element of the group's own group: GL(h), or a subgroup of it."""
    lead, h = group.shape[:-2], group.shape[-1]
    own = getattr(group.manifold, "random_element", None)
    if own is not None:  # the library draws on the generator's device; the test's tensors
        on_test_device = torch.empty(()).device  # are on --torch-device (device_mode)
        return own(lead, h=h, max_condition=max_condition, generator=generator).to(on_test_device)
    return random_gl(lead, h, max_condition, generator)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_plan_has_the_expected_groups(name):
    case, model = CASES[name], model_for(name)
    plan = find_symmetries(model)
    bound = plan.bind(model)
    groups = bound.symmetric_groups
    assert len(groups) == case.n_groups
    counts: Dict[str, int] = {}
    for g in groups:
        counts[g.kind] = counts.get(g.kind, 0) + g.count
        assert isinstance(g.manifold, GLQuotient) and g.manifold.metric == "mix"
        rotary = name == "llama" and g.kind == "query-key"  # the others keep all of GL(h)
        assert (type(g.manifold) is RotaryGLQuotient) == rotary
    assert counts == case.groups
    if case.note:
        assert any(case.note in note for note in plan.notes), plan.notes
    else:
        assert [n for n in plan.notes if not n.startswith("verified")] == []


@pytest.mark.parametrize("name", list(CASES))
def test_group_elements_leave_outputs_unchanged_and_one_factor_does_not(name):
    case, model = CASES[name], model_for(name)
    bound = find_symmetries(model).bind(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    inputs = case.inputs(0)
    elements = elements_for(bound, seed=1)
    err = relative_change(model, params, bound.act(params, elements), inputs)
    assert err <= case.tol, f"{name}: invariance error {err:.3g}"
    for group, a in zip(bound.symmetric_groups, elements):
        wrong = relative_change(model, params, one_factor(group, params, a), inputs)
        assert wrong > 1e-2, f"{name}: {group.name}: one-factor change only {wrong:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_geodesic_sharpness_is_invariant_adaptive_is_not(name):
    case, model = CASES[name], model_for(name)
    bound = find_symmetries(model).bind(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    other = copy.deepcopy(model)
    other.load_state_dict(bound.act(params, elements_for(bound, seed=2)), strict=False)
    batches = [case.inputs(10), case.inputs(11)]
    target = [0.9 * outputs(model, params, b) for b in batches]

    def loss_fn(m, batch):
        out = m(**batch)
        y = out if isinstance(out, torch.Tensor) else out[0]
        index = next(i for i, b in enumerate(batches) if b is batch)
        return (y.reshape(-1) - target[index][: y.numel()]).pow(2).mean()

    kw = dict(rho=0.05, iters=3)
    a = geodesic_sharpness(model, loss_fn, batches, **kw).value
    b = geodesic_sharpness(other, loss_fn, batches, **kw).value
    assert a > 0
    assert abs(a - b) <= max(1e-8, 100 * case.tol) * abs(a), (a, b)
    c = adaptive_sharpness(model, loss_fn, batches, **kw).value
    d = adaptive_sharpness(other, loss_fn, batches, **kw).value
    assert abs(c - d) > 0.1 * abs(c), (c, d)


# ---------------------------------------------------------------- verify
@pytest.mark.parametrize("name", ["bert", "vit", "clip", "gpt2", "t5", "llama"])
def test_verify_builds_a_probe_from_the_config(name):
    plan = find_symmetries(model_for(name), verify=True)
    assert any(note.startswith("verified") for note in plan.notes)
    assert not any("weak" in note for note in plan.notes)


def test_verify_needs_probe_inputs_without_a_config():
    model = model_for("mha")  # tokens in: its first layer is an Embedding
    plan = find_symmetries(model)
    assert any(note.startswith("verified 2") for note in plan.notes)
    unknown = torch.nn.Sequential(torch.nn.LayerNorm(11), model)
    with pytest.raises(PlanError, match="probe_inputs"):
        find_symmetries(unknown, verify=True)
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    plan = find_symmetries(model, verify=True, probe_inputs=tokens)
    assert any(note.startswith("verified 2") for note in plan.notes)
    plan = find_symmetries(model, verify=True, probe_inputs={"tokens": tokens})
    assert any(note.startswith("verified 2") for note in plan.notes)


class LyingAttention(torch.nn.Module):
    """Looks like attention (q/k/v/o_proj, num_heads, head_dim) but squashes the queries."""

    def __init__(self, dim: int = 8, heads: int = 2):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.v_proj, self.o_proj = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape

        def split(y):
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = split(torch.tanh(self.q_proj(x))), split(self.k_proj(x)), split(self.v_proj(x))
        att = (q @ k.mT / math.sqrt(self.head_dim)).softmax(-1) @ v
        return self.o_proj(att.transpose(1, 2).reshape(b, t, -1))


def test_verify_names_the_group_that_is_not_a_symmetry():
    torch.manual_seed(0)
    model = torch.nn.Sequential(LyingAttention(), LyingAttention()).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    plan = find_symmetries(model, verify=False)  # the structure fools the detector...
    assert {g.kind for g in plan.groups} == {"query-key", "value-output"}
    with pytest.raises(SymmetryVerificationError, match=r"query-key.*first failing member: 0"):
        verify_plan(model, plan, x)  # ...but not the check
    with pytest.warns(SymmetryNotProvenWarning, match=r"query-key.*first failing member: 0"):
        proven = find_symmetries(model, probe_inputs=x)  # default discovery drops it
    assert {g.kind for g in proven.groups} == {"value-output"}
    with pytest.raises(PlanError, match="do not run it"):  # 2-D features for a 3-D forward
        find_symmetries(model)


# ---------------------------------------------------------------- notes
class Attention(torch.nn.Module):
    """Configurable attention-like module for the half-recognised cases."""

    def __init__(self, dim=8, heads=2, head_dim=4, extra=None, q_out=None):
        super().__init__()
        self.num_heads, self.head_dim = heads, head_dim
        self.q_proj = torch.nn.Linear(dim, q_out or heads * head_dim)
        self.k_proj = torch.nn.Linear(dim, heads * head_dim)
        self.v_proj = torch.nn.Linear(dim, heads * head_dim)
        self.o_proj = torch.nn.Linear(heads * head_dim, dim)
        for name, module in (extra or {}).items():
            setattr(self, name, module)


def test_half_recognised_modules_are_notes_not_guesses():
    model = torch.nn.ModuleDict(
        {
            "shapes": Attention(q_out=6),
            "param": Attention(extra={"gate": torch.nn.Linear(8, 2)}),
            "qknorm": Attention(
                extra={"q_norm": torch.nn.LayerNorm(4), "k_norm": torch.nn.LayerNorm(4)}
            ),
        }
    )
    model.fused = torch.nn.Module()
    model.fused.num_heads, model.fused.head_dim = 2, 4
    model.fused.qkv_proj, model.fused.o_proj = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)
    plan = find_symmetries(model, verify=False)  # a ModuleDict: no forward to prove on
    text = "\n".join(plan.notes)
    assert "shapes: " in text and "Q/K shapes do not fit" in text
    assert "param: " in text and "(gate)" in text
    assert "qknorm: " in text and "q_norm, k_norm" in text
    assert "fused: " in text and "known layout" in text
    (group,) = plan.groups  # V/O of "qknorm" only
    assert group.kind == "value-output" and group.name == "qknorm [value-output]"
    assert tuple(group.shape) == (1, 2, 9 + 8, 4)


def test_model_without_symmetry_gets_a_plan_that_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    plan = find_symmetries(model, verify=True, probe_inputs=torch.randn(2, 3))
    assert plan.groups == [] and "no symmetry found" in plan.notes[0]
    text = plan.bind(model).summary()
    assert text.count("no symmetry found") == 1 and "adaptive parameters" in text


def test_rotary_qk_is_not_general_gl_but_the_commuting_subgroup_is():
    """Why LLaMA's Q/K has a smaller group: a general A breaks it, a + bJ per rotary plane
    does not."""
    model = model_for("llama")
    attn = model.layers[0].self_attn
    path = "layers.0.self_attn"
    projections = tuple(
        (f"{path}.{n}", getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    )
    (qk,) = linear_attention_pairs(path, projections, 4, 4, num_kv_heads=2, value_output=False)
    from geoopt_quotient.symmetry import stack_pairs

    (group,) = stack_pairs([qk], "mix", 0.0)
    params = {n: p.detach() for n, p in model.named_parameters()}
    inputs = CASES["llama"].inputs(0)
    g = torch.Generator().manual_seed(0)
    general = random_gl(group.shape[:-2], 4, 20.0, g)
    act = lambda a: {**params, **group.scatter(group.manifold.act(group.gather(params), a), params)}  # noqa: E731
    assert relative_change(model, params, act(general), inputs) > 1e-2
    # rotate_half pairs coordinate j with j + h/2: A = a I + b J on each plane
    ab = torch.randn(*group.shape[:-2], 2, 2, generator=g, dtype=torch.float64)
    commuting = torch.zeros(*group.shape[:-2], 4, 4, dtype=torch.float64)
    for j in range(2):
        a, b = ab[..., j, 0] + 2, ab[..., j, 1]
        commuting[..., j, j] = commuting[..., j + 2, j + 2] = a
        commuting[..., j, j + 2], commuting[..., j + 2, j] = -b, b
    assert relative_change(model, params, act(commuting), inputs) < CASES["llama"].tol


# ---------------------------------------------------------------- PEFT LoRA
def lora_model(seed: int = 0, randomise: bool = True):
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    base = reinit(T.BertModel(T.BertConfig(vocab_size=50, **SMALL)))
    config = peft.LoraConfig(r=2, target_modules=["query", "value", "word_embeddings"])
    model = peft.get_peft_model(base, config).double().eval()
    if randomise:  # PEFT starts from B = 0 (embeddings: A = 0), a rank-deficient point
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(
                        torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[-1])
                    )
    return model


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_peft_lora_pairs_are_symmetries():
    model = lora_model()
    plan = find_symmetries(model)
    bound = plan.bind(model)
    kinds = [(g.kind, tuple(g.shape), g.count) for g in bound.symmetric_groups]
    # the embedding adapter: (1, 1, 16 + 50, 2); q and v adapters of 2 layers: (4, 1, 16 + 16, 2)
    assert kinds == [("lora", (1, 1, 66, 2), 1), ("lora", (4, 1, 32, 2), 4)]
    assert [n for n in plan.notes if not n.startswith("verified")] == []  # frozen base
    params = {n: p.detach() for n, p in model.named_parameters()}
    inputs = CASES["bert"].inputs(0)
    elements = elements_for(bound, seed=3)
    assert relative_change(model, params, bound.act(params, elements), inputs) < 1e-10
    for group, a in zip(bound.symmetric_groups, elements):
        assert relative_change(model, params, one_factor(group, params, a), inputs) > 1e-2
    plan = find_symmetries(model, verify=True)
    assert any(note.startswith("verified 2") for note in plan.notes)
    model.requires_grad_(True)  # trainable base weights under wrapped projections: say so
    plan = find_symmetries(model)
    assert len(plan.groups) == 2 and "wrapped by adapters" in plan.notes[0]


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_fresh_peft_adapters_are_rank_deficient_notes_unless_relaxed():
    model = lora_model(randomise=False)
    plan = find_symmetries(model)
    assert plan.groups == [] and any("rank-deficient" in n for n in plan.notes)
    relaxed = find_symmetries(model, eps=1e-3)
    assert [g.count for g in relaxed.groups] == [1, 4]
    assert all(g.manifold.eps == 1e-3 for g in relaxed.groups)


def test_frozen_pairs_are_skipped_with_a_note():
    model = copy.deepcopy(model_for("bert"))
    model.encoder.layer[0].attention.self.query.weight.requires_grad_(False)
    model.encoder.layer[1].attention.requires_grad_(False)
    plan = find_symmetries(model)
    assert [(g.kind, g.count) for g in plan.groups] == [("value-output", 2)]
    assert "encoder.layer.0.attention: query-key pair partly frozen" in plan.notes[0]
    assert "2 pairs on frozen parameters skipped" in plan.notes[1]
    plan.bind(model)  # binds: no group names a frozen parameter


# ---------------------------------------------------------------- summary
def test_summary_is_a_readable_table():
    model = model_for("t5")
    text = find_symmetries(model).bind(model).summary()
    lines = text.splitlines()
    assert lines[0].split() == ["kind", "symmetry", "group", "manifold", "point", "shape", "count"]
    assert "GL(6) [36]" in lines[2]
    assert "GLQuotient(16+16, mix)" in text and "(6, 2, 32, 6)" in text
    assert "[query-key]" not in text
    assert "adaptive parameters" in text and "encoder.block.*.layer.*.layer_norm.weight" in text
    inv = find_symmetries(model, metric="inv", eps=1e-4).bind(model).summary()
    assert "GLQuotient(16+16, inv, eps=0.0001)" in inv
