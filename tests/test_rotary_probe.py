"""Discovery that reads the model, not names: rotary planes probed, pairs replayed.

For families whose modelling files name a function ``rotate_half`` that pairs adjacent
dimensions, whose rotary embedding arrives under another name, whose rotary factor sits
per layer type, whose fused QKV has its own shard layout, or whose values / MLP halves
pass through a norm or an adapter, discovery must find the true groups: each one is
checked exact on the model (``verify_plan``), and the groups that do not exist are absent.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Dict, Optional, Tuple

import pytest
import torch

from geoopt_quotient import RotaryGLQuotient, find_symmetries
from geoopt_quotient.symmetry import probe
from geoopt_quotient.symmetry.probe import canonical_rotary, recorded_forward
from geoopt_quotient.symmetry.verify import SymmetryVerificationError, verify_plan

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("single_thread")]

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=24,
    max_position_embeddings=64,
    initializer_range=0.2,
    moe_intermediate_size=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
#: family -> (config class, extra options, Q/K (rotary_dim, pairing) or None, V/O, MLP)
FAMILIES: Dict[str, Tuple[str, Dict, Optional[Tuple[int, str]], bool, bool]] = {
    "cohere": ("CohereConfig", {}, (8, "interleaved"), True, True),
    "cohere2": ("Cohere2Config", {}, (8, "interleaved"), True, True),
    # its routed experts are fused 3-D weights (the per-unit groups of symmetry.experts)
    "cohere2_moe": ("Cohere2MoeConfig", {}, (8, "interleaved"), True, True),
    "glm": ("GlmConfig", {}, (4, "interleaved"), True, True),
    "glm4": ("Glm4Config", {}, (4, "interleaved"), True, True),
    "ernie4_5": ("Ernie4_5Config", {}, (8, "interleaved"), True, True),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {}, (8, "interleaved"), True, True),
    "helium": ("HeliumConfig", {}, (8, "interleaved"), True, True),
    "roformer": (
        "RoFormerConfig",
        dict(embedding_size=32, is_decoder=True),
        (8, "interleaved"),
        True,
        False,
    ),
    "mimo_v2_flash": (  # partial_rotary_factor 0.334 per layer type: 2 of 8 dims rotate
        "MiMoV2FlashConfig",
        dict(v_head_dim=8, layer_types=["full_attention"] * 2, mlp_layer_types=["dense"] * 2),
        (2, "half"),
        True,
        True,
    ),
    "codegen": (
        "CodeGenConfig",
        dict(
            n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, num_key_value_heads=None
        ),
        (4, "interleaved"),
        True,
        False,
    ),
    "gemma3n": (  # v_norm: no V/O; q_norm/k_norm: Q/K by the gains only
        "Gemma3nTextConfig",
        dict(
            layer_types=["sliding_attention", "full_attention"],
            num_kv_shared_layers=0,
            activation_sparsity_pattern=[0.0, 0.0],
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            altup_num_inputs=2,
            vocab_size_per_layer_input=64,
        ),
        None,
        False,
        True,
    ),
    "gemma4": ("Gemma4TextConfig", {}, None, False, True),
    # attn_sub_norm (between the heads and o_proj) removes V/O, not Q/K; ffn_sub_norm the MLP
    "bitnet": ("BitNetConfig", {}, (8, "half"), False, False),
    "zamba2": (  # per-layer adapters add to the shared MLP's gate_up_proj: no MLP group
        "Zamba2Config",
        dict(
            layers_block_type=["mamba", "hybrid"],
            mamba_d_state=8,
            n_mamba_heads=4,
            adapter_rank=4,
            attention_head_dim=8,
            use_mem_rope=True,
        ),
        (8, "half"),
        True,
        False,
    ),
    "llama": ("LlamaConfig", {}, (8, "half"), True, True),
}


def build(name: str, **options) -> torch.nn.Module:
    config_name, extra, *_ = FAMILIES[name]
    config = getattr(transformers, config_name)(**{**SMALL, **extra, **options})
    config._experts_implementation = "eager"
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    causal = next(n for n in dir(module) if n.endswith("ForCausalLM"))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(module, causal)._from_config(config, attn_implementation="eager")
    return model.to(torch.float64).eval()


def kinds(plan) -> Dict[str, object]:
    return {g.kind: g.manifold for g in plan.groups}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_gets_its_true_groups(name):
    _, _, rotary, value_output, mlp = FAMILIES[name]
    model = build(name)
    plan = find_symmetries(model, kinds="all", verify=False)
    verify_plan(model, plan)  # raises if any group is not exact
    found = kinds(plan)
    assert ("value-output" in found) == value_output, plan.notes
    assert ("mlp" in found) == mlp, plan.notes
    if rotary is None:  # no Q/K GL(h) pair; q/k-normalised ones keep their gain scaling
        query_key = [g for g in plan.groups if g.kind == "query-key"]
        assert all(g.name.endswith("[query-key: q/k-norm gain scaling]") for g in query_key)
        assert bool(query_key) == (name in ("gemma3n", "gemma4")), plan.notes
        return
    qk = found["query-key"]
    assert isinstance(qk, RotaryGLQuotient)
    assert (qk.rotary_dim, qk.pairing) == rotary


def test_dropped_pairs_say_why():
    plan = find_symmetries(build("gemma3n"), kinds="all")
    assert any("value-output pair dropped" in n and "v_norm" in n for n in plan.notes)
    plan = find_symmetries(build("bitnet"), kinds="all")
    assert any("mlp pair dropped" in n and "ffn_sub_norm" in n for n in plan.notes)


def test_wrong_pairing_changes_the_logits():
    """The pairing the name ``rotate_half`` suggests is not a symmetry of Cohere."""
    model = build("cohere")
    plan = find_symmetries(model)
    group = next(g for g in plan.groups if g.kind == "query-key")
    m = group.manifold
    wrong = group.with_manifold(RotaryGLQuotient(m.n, m.m, m.rotary_dim, "half"))
    plan.groups[plan.groups.index(group)] = wrong
    with pytest.raises(SymmetryVerificationError):
        verify_plan(model, plan)


def test_llama_reads_half_pairing():
    model = build("llama")
    record, why = recorded_forward(model)
    assert record is not None, why
    qk = kinds(find_symmetries(model))["query-key"]
    assert (qk.rotary_dim, qk.pairing) == (8, "half")


def test_canonical_rotary_orders_other_planes():
    assert canonical_rotary([(0, 2), (1, 3)], 6) == (4, "half", None)
    assert canonical_rotary([(0, 1), (2, 3)], 4) == (4, "interleaved", None)
    # planes on the last dims: permuted to the front
    assert canonical_rotary([(2, 4), (3, 5)], 6) == (4, "half", [2, 3, 4, 5, 0, 1])


def test_meta_device_notes_the_unverified_reading():
    with torch.device("meta"):
        model = build("llama")
    plan = find_symmetries(model)
    assert any("not verified" in n for n in plan.notes), plan.notes
    assert isinstance(kinds(plan)["query-key"], RotaryGLQuotient)


@pytest.mark.parametrize("name", [n for n, spec in FAMILIES.items() if spec[2] is not None])
def test_the_mapped_replay_reads_the_maps_of_one_call_per_vector(name):
    """The basis vectors go through the rotary call in one vmapped call: the same maps,
    bit for bit, as one call per vector."""
    record, why = recorded_forward(build(name))
    assert record is not None, why
    calls = [c for cs in record.rotary_calls.values() for c in cs]
    assert calls
    for call in calls[:2]:
        slots = [
            i
            for i, a in enumerate(call.args)
            if isinstance(a, torch.Tensor) and any(a.shape == o.shape for o in call.outputs)
        ]
        try:  # every slot's basis vectors in one mapped call, as discovery reads them
            joint = probe._mapped_maps_of_slots(call, slots)
        except Exception:  # not mappable: the loop reads it
            continue
        for slot, mapped in zip(slots, joint):
            looped = probe._looped_maps(call, slot, slots)
            assert (mapped is None) == (looped is None)
            assert mapped is None or torch.equal(mapped, looped)


def test_a_rotary_function_vmap_cannot_follow_is_replayed_call_by_call():
    angle = torch.tensor([0.3, 1.1, 2.0], dtype=torch.float64)  # per position

    def rotate(x):  # reads a number out of its input: vmap refuses it
        if float(x.abs().sum().item()) < 0:
            raise AssertionError
        c, s = angle.cos(), angle.sin()
        return torch.stack([c * x[..., 0] - s * x[..., 1], s * x[..., 0] + c * x[..., 1]], -1)

    x = torch.randn(3, 2, dtype=torch.float64)
    call = probe.RotaryCall(rotate, (x,), {}, [rotate(x)])
    with pytest.raises(RuntimeError):
        probe._mapped_maps_of_slots(call, [0])
    (maps,) = probe._replay_maps_of_slots(call, [0])
    assert maps is not None and torch.equal(maps, probe._looped_maps(call, 0, [0]))
    assert probe._planes(maps, 1e-12) == ([(0, 1)], [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_model_reads_every_plane_of_its_rotary_embedding(dtype):
    """In bfloat16 (float16), the planes are those of the float32 model: the maps are read
    in float32 and to float32's tolerance. At the data's own precision (0.5 in
    bfloat16) the slow planes, whose angles stay small at the probed positions, passed
    for fixed dimensions: a wrong subgroup, or none (a plane near a half turn read as a
    scaling)."""
    wide = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    config = transformers.LlamaConfig(**{**SMALL, **wide}, rope_theta=1e6)
    config.max_position_embeddings = 8192
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    expected = kinds(find_symmetries(model, verify=False))["query-key"]
    assert (expected.rotary_dim, expected.pairing) == (64, "half")
    low = model.to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # proven, not left adaptive
        plan = find_symmetries(low)
    qk = kinds(plan)["query-key"]
    assert (type(qk), qk.rotary_dim, qk.pairing) == (RotaryGLQuotient, 64, "half")
    # the negative: the maps of the bfloat16 call, read at the data's precision
    record, why = recorded_forward(low)
    assert record is not None, why
    call = next(c for cs in record.rotary_calls.values() for c in cs)
    slots = [i for i, a in enumerate(call.args) if any(a.shape == o.shape for o in call.outputs)]
    maps = probe._looped_maps(call, slots[0], slots)
    coarse = probe._planes(maps, probe._tolerance(dtype))
    assert coarse is None or len(coarse[0]) < 32
    planes, fixed = probe._planes(maps, probe.MAP_TOLERANCE)
    assert (len(planes), fixed) == (32, [])
