"""Every causal-LM family of ``transformers``, built tiny, and a check of its symmetry plan.

:func:`causal_lm_families` lists the model types of
``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``;
:func:`build_family` builds one of them from its config class with tiny sizes
(:data:`TINY`, per family :data:`FAMILY_OVERRIDES`), in float64, with eager attention
and eager experts, seeded, in eval mode, without network or files. A family that cannot
be built this way is returned with the reason (exception type and first line).

:func:`check_family` discovers the family's symmetries
(:func:`~geoopt_quotient.find_symmetries` with ``kinds="all"``), draws a random element of
each symmetric group (condition number at most 10), acts on the parameters with the
plan's own action and measures the relative change of the logits,

.. math::

    \\delta = \\frac{\\max |\\ell(g \\cdot \\theta) - \\ell(\\theta)|}{\\max |\\ell(\\theta)|},

group by group and for all groups at once. A group is exact if :math:`\\delta` stays below
a threshold: :data:`EXACT_RTOL` (``1e-6``) for a model that computes in float64
throughout, and :data:`FLOAT32_RTOL` (64 float32 epsilons) for a model that computes
from its weights in float32 somewhere (RMSNorm upcast to float32, a softmax in float32).
Which applies is observed, not assumed: :func:`reduced_precision_ops` traces the forward
pass and lists the operators whose outputs depend on the parameters and are below
float64 (tables computed from constants alone, such as rotary ``cos``/``sin``, do not
count: they are the same before and after the action).

The rows of :func:`check_family` are JSON-able; ``benchmarks/sweep_zoo.py`` writes them
for every family.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch.func import functional_call

from ..manifolds.base import random_group_element
from ..symmetry.verify import FLOAT32_IN_FLOAT64_RTOL, WeightPrecision

__all__ = [
    "ZooModel",
    "build_family",
    "causal_lm_families",
    "check_family",
    "check_model",
    "draw_group_element",
    "logits_of",
    "probe_inputs",
    "reduced_precision_ops",
    "relative_change",
    "tiny_config",
]

#: Generic tiny sizes, applied to every config field (and sub-config field) of that name.
TINY: Dict[str, Any] = {
    # sizes
    "vocab_size": 96,
    "hidden_size": 32,
    "n_embd": 32,
    "n_embed": 32,
    "d_model": 32,
    "embedding_size": 32,
    "word_embed_proj_dim": 32,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "n_inner": 48,
    "ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "encoder_ffn_dim": 48,
    "d_ff": 48,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_ctx": 64,
    "rotary_dim": 4,
    "dff": 48,
    "dim_ff": 48,
    "dim_head": 8,
    "emb_dim": 32,
    "ffn_hidden_size": 48,
    "hidden_size_global": 32,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 96,
    "laurel_rank": 4,
    "pronunciation_embed_dim": 32,
    "pronunciation_vocab_size": 16,
    "shape_embed_dim": 32,
    "shape_vocab_size": 16,
    "encoder_hash_byte_group_vocab": 64,
    "is_decoder": True,
    # mixture of experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "top_k_experts": 2,
    "moe_topk": 2,
    "expert_ffn_hidden_size": 16,
    "zero_expert_num": 2,
    "n_group": 1,
    "topk_group": 1,
    # state-space and linear-attention mixers
    "mamba_d_ssm": 64,
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_d_state": 8,
    "mamba_chunk_size": 8,
    "ssm_state_size": 8,
    "linear_head_dim": 8,
    "linear_num_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    # multi-head latent attention
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    # initialisation far from uniform attention; token ids inside the vocabulary
    "initializer_range": 0.2,
    "init_std": 0.2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
}

_MLA = {"num_key_value_heads": 4}  # multi-head latent attention: as many K/V heads as Q
#: one dense layer, then mixture-of-experts layers (the default puts 3 dense layers first)
_ONE_DENSE = {"first_k_dense_replace": 1}
#: linear-attention hybrids: one full-attention layer among the two
_HYBRID = {"layer_types": ["linear_attention", "full_attention"]}

#: Per family: config fields set on top of :data:`TINY` (``None`` removes a generic one; a
#: dict for a sub-config such as ``text_config``), ``"_probe"``: changes of the probe
#: inputs (``None`` drops one), or ``"_skip"``: why it cannot be built without files or
#: network.
FAMILY_OVERRIDES: Dict[str, Dict[str, Any]] = {
    **dict.fromkeys(
        (
            "axk1",
            "axk2",
            "deepseek_v2",
            "deepseek_v3",
            "deepseek_v32",
            "glm4_moe_lite",
            "glm_moe_dsa",
            "longcat_flash",
            "minicpm3",
            "sarvam_mla",
            "youtu",
        ),
        _MLA,
    ),
    "deepseek_v3": {**_MLA, **_ONE_DENSE},
    "deepseek_v32": {**_MLA, **_ONE_DENSE},
    "glm_moe_dsa": {**_MLA, **_ONE_DENSE},
    "flint": {"mlp_only_layers": [0]},
    # hybrids: one attention layer among the two (the defaults put the first one deeper)
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    # JetMoE's attention heads default to 128 wide, wider than the tiny model
    "jetmoe": {"kv_channels": 8},
    # Llama 4: a rotary layer (queries and keys L2-normalised) and a NoPE layer
    "llama4": {"text_config": {"no_rope_layers": [1, 0]}},
    "llama4_text": {"no_rope_layers": [1, 0]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), _HYBRID),
    # their full-attention layers are multi-head latent attention
    "kimi_linear": {**_HYBRID, **_MLA},
    # NVFP4 rounding of keys and values (multiples of 16), an index over 1 query head
    "kolibri1_1": {"head_dim": 16, "index_num_heads": 1, "index_topk": 8, "index_pool_size": 16},
    "bailing_hybrid": {**_HYBRID, **_MLA, **_ONE_DENSE},
    "bamba": {"attn_layer_indices": [1]},
    "lfm3": {"layer_types": ["conv", "full_attention"]},
    **{key: {"text_config": _HYBRID} for key in ("qwen3_5", "qwen3_5_moe")},
    # a padded position attends to nothing in the n-gram stream: NaN logits
    "prophetnet": {"_probe": {"attention_mask": None}},
    # validators: the Mamba-2 heads must tile expand * hidden_size
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "nemotron_h": {"chunk_size": 8, "n_groups": 1},
    "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1, "state_size": 8, "chunk_size": 8},
    # layer-type lists whose defaults are longer than two layers
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 4},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # Zamba ties its shared transformer across the hybrid layers: it needs two of them
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
    },
    # constraints of the family
    # (the vision tower's per-layer defaults name its default depth; only the text part is built)
    "dots3_note": {
        "text_config": {"num_key_value_heads": 4},
        "vision_config": {"num_hidden_layers": None, "adapter_in_dim": 32, "adapter_out_dim": 32},
        "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 32},
    },
    "dots3_note_text": {"num_key_value_heads": 4},
    "dots1": {"n_shared_experts": 1},
    # Gemma 4's full-attention layers have their own head size (default 512)
    "gemma4": {"text_config": {"global_head_dim": 16}},
    "gemma4_text": {"global_head_dim": 16},
    "gemma4_unified": {"text_config": {"global_head_dim": 16}},
    "gemma4_unified_text": {"global_head_dim": 16},
    "gemma4_unified_assistant": {"text_config": {"global_head_dim": 16}},
    "gemma4_assistant": {
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "global_head_dim": 16,
        }
    },
    "cohere_compass_text": {
        "layer_types": ["full_attention"] * 2,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 1, 1],
            }
        },
    },
    "reformer": {
        "axial_pos_embds_dim": [16, 16],
        "axial_pos_shape": [8, 8],
        "attention_head_size": 8,
        "feed_forward_size": 48,
        "attn_layers": ["local", "lsh"],
    },
    "zaya": {"num_experts_per_tok": 1},
    "xmod": {"default_language": "en_XX"},
    # one codebook: the decoder reads input_ids of shape (batch * codebooks, length)
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
    # sub-configs the config class does not declare as such
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2},
    },
}

#: Relative change of the logits below which a group is exact, for a model that computes
#: in float64 throughout.
EXACT_RTOL = 1e-6


@dataclasses.dataclass
class ZooModel:
    """One causal-LM family, built tiny (or the reason it could not be).

    Attributes
    ----------
    family : str
        The model type (key of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``).
    class_name : str
        The causal-LM class transformers maps it to.
    model : torch.nn.Module or None
        The float64 model in eval mode; ``None`` if it could not be built or gives no
        finite logits on :func:`probe_inputs`.
    reason : str
        Why not (exception type and first line; ``"forward: ..."`` for a model that
        was built but cannot run); empty if built.
    seconds : float
        Time to build the model.
    inputs : dict
        The probe inputs the model ran on (:func:`probe_inputs`, with the family's
        ``"_probe"`` changes).
    """

    family: str
    class_name: str
    model: Optional[torch.nn.Module]
    reason: str = ""
    seconds: float = 0.0
    inputs: Dict[str, Any] = dataclasses.field(default_factory=dict)


def causal_lm_families() -> List[str]:
    """The model types transformers maps to a causal-LM class, sorted.

    Returns
    -------
    list of str
        Keys of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (``"gpt2"``, ``"llama"``, ...).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _field_names(config_class: type) -> set:
    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class)}
    import inspect

    return set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}


def _sub_config_class(spec: Any) -> Optional[type]:
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = spec.config_class
    if isinstance(cls, type) and issubclass(cls, PreTrainedConfig):
        return cls
    return CONFIG_MAPPING[spec.model_type] if spec.model_type in CONFIG_MAPPING else None


def _tiny_kwargs(config_class: type, overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """Keyword arguments of ``config_class``: the fields of :data:`TINY` and ``overrides``
    it has, and tiny sub-configs (as dicts) for its non-optional sub-configs."""
    fields = _field_names(config_class)
    merged = {**TINY, **overrides}
    kwargs = {k: v for k, v in merged.items() if k in fields and v is not None}
    kwargs.update({k: v for k, v in overrides.items() if k not in TINY and v is not None})
    for key, spec in (getattr(config_class, "sub_configs_defaults", None) or {}).items():
        sub_class = _sub_config_class(spec)
        if sub_class is None or getattr(spec, "optional", False):
            continue
        nested = overrides.get(key, {}) if isinstance(overrides.get(key), dict) else {}
        sub = {**getattr(spec, "init_kwargs", {}), **_tiny_kwargs(sub_class, nested)}
        if getattr(sub_class, "model_type", None):
            sub.setdefault("model_type", sub_class.model_type)
        kwargs[key] = sub
    return kwargs


def tiny_config(family: str) -> Any:
    """The tiny config of ``family``: :data:`TINY` and :data:`FAMILY_OVERRIDES` applied.

    Parameters
    ----------
    family : str
        A model type of :func:`causal_lm_families`.

    Returns
    -------
    transformers.PreTrainedConfig
        The config, with the fields of its class (and of its sub-configs) that
        :data:`TINY` names set to tiny values.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    overrides = FAMILY_OVERRIDES.get(family, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_class(**_tiny_kwargs(config_class, overrides))


def _model_class(family: str) -> type:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])


def _config_for(model_class: type, config: Any) -> Any:
    """``config``, or the sub-config of the class ``model_class`` expects (the text part of a
    composite config, e.g. ``Llama4TextConfig`` for ``Llama4ForCausalLM``)."""
    expected = getattr(model_class, "config_class", None)
    if expected is None or isinstance(config, expected):
        return config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, expected):
            return sub
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _first_line(error: BaseException) -> str:
    """``"Type: first line"`` of ``error``; a first line that ends with a colon (a
    validator's) is followed by the next one."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else "".join(lines[:1])
    return f"{type(error).__name__}: {text}".strip()


def build_family(family: str, *, seed: int = 0) -> ZooModel:
    """Build ``family`` tiny, in float64, with eager attention and experts, in eval mode.

    Parameters
    ----------
    family : str
        A model type of :func:`causal_lm_families`.
    seed : int
        Seed of the random initialisation (``torch.manual_seed``).

    Returns
    -------
    ZooModel
        The model, or ``model=None`` and the reason it could not be built.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]
    skip = FAMILY_OVERRIDES.get(family, {}).get("_skip")
    if skip:
        return ZooModel(family, class_name, None, skip)
    start = time.perf_counter()
    try:
        model_class = _model_class(family)
        config = _config_for(model_class, tiny_config(family))
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = model_class._from_config(
                config,
                dtype=torch.float64,
                attn_implementation="eager",
                experts_implementation="eager",
            )
        model.eval()
    except Exception as error:
        return ZooModel(family, class_name, None, _first_line(error), time.perf_counter() - start)
    inputs = probe_inputs(model)
    for key, value in FAMILY_OVERRIDES.get(family, {}).get("_probe", {}).items():
        inputs.pop(key) if value is None else inputs.__setitem__(key, value)
    reason = _forward_failure(model, inputs)
    return ZooModel(
        family,
        class_name,
        None if reason else model,
        reason,
        time.perf_counter() - start,
        inputs,
    )


def _forward_failure(model: torch.nn.Module, inputs: Mapping[str, Any]) -> str:
    """Why ``model`` gives no finite logits on ``inputs`` (empty if it does)."""
    try:
        params = {n: p.detach() for n, p in model.named_parameters()}
        logits = logits_of(model, params, inputs)
    except Exception as error:
        return "forward: " + _first_line(error)
    if not bool(torch.isfinite(logits).all()):
        return "forward: the logits of the tiny model are not finite"
    return ""


# ---------------------------------------------------------------------------- checks


def draw_group_element(
    group: Any, generator: torch.Generator, dtype: torch.dtype, max_condition: float
) -> Optional[torch.Tensor]:
    """A random element of the group that acts on ``group``'s points.

    The one place the sweep draws group elements: the manifold's own group (the rotary
    subgroup of :class:`~geoopt_quotient.RotaryGLQuotient`, positive scalings of
    :class:`~geoopt_quotient.PositiveScalingQuotient`, GL(h), diagonal scalings), with
    spectral condition number at most ``max_condition``.

    Parameters
    ----------
    group : SymmetryGroup
        A symmetric group of a bound plan; its leading shape gets one element per entry.
    generator : torch.Generator
        Source of randomness.
    dtype : torch.dtype
        Dtype of the element.
    max_condition : float
        Bound on the condition number of each element.

    Returns
    -------
    torch.Tensor or None
        Shape ``(*lead, h, h)`` (``(*lead, k)`` for diagonal groups); ``None`` if the
        group's manifold has no known group action.
    """
    shape = tuple(group.shape)
    return random_group_element(
        group.manifold,
        shape[:-2],
        h=shape[-1],
        max_condition=max_condition,
        generator=generator,
        dtype=dtype,
    )


def probe_inputs(model: torch.nn.Module, batch_size: int = 2, seq_len: int = 7) -> Dict[str, Any]:
    """Text probe inputs of a zoo model, as its ``forward`` accepts them.

    Random ``input_ids`` of shape ``(batch_size, seq_len)`` (token ids from 3 on: not the
    pad, bos or eos ids of :data:`TINY`), an ``attention_mask`` that pads the last two
    positions of the last sequence (masks must not matter either) and ``use_cache=False``.
    No images or audio: multimodal families are probed through their text path.

    Parameters
    ----------
    model : torch.nn.Module
        A model of :func:`build_family`.
    batch_size, seq_len : int
        Shape of ``input_ids`` (default 2 x 7).

    Returns
    -------
    dict
        Keyword arguments of ``model``.
    """
    import inspect

    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", None) or TINY["vocab_size"])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch_size, seq_len), generator=generator)
    accepted = inspect.signature(model.forward).parameters
    inputs: Dict[str, Any] = {"input_ids": ids}
    if "attention_mask" in accepted:
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        mask[-1, seq_len - 2 :] = 0
        inputs["attention_mask"] = mask
    if "use_cache" in accepted:
        inputs["use_cache"] = False
    return inputs


def logits_of(
    model: torch.nn.Module, params: Mapping[str, torch.Tensor], inputs: Mapping[str, Any]
) -> torch.Tensor:
    """The logits of ``model`` with ``params`` substituted, in float64.

    Parameters
    ----------
    model : torch.nn.Module
        A causal LM; not mutated (:func:`torch.func.functional_call`).
    params : mapping
        Parameter name -> tensor (all of the model's parameters or some of them).
    inputs : mapping
        Keyword inputs.

    Returns
    -------
    torch.Tensor
        ``output.logits`` (or the first output), detached, in float64.
    """
    with torch.no_grad():
        out = functional_call(model, dict(params), (), dict(inputs), strict=False)
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out
    return logits.detach().to(torch.float64)


def relative_change(reference: torch.Tensor, moved: torch.Tensor) -> float:
    r"""``max |moved - reference| / max |reference|`` (``inf`` for non-finite values).

    Parameters
    ----------
    reference, moved : torch.Tensor
        Logits before and after a group action.

    Returns
    -------
    float
        The relative change :math:`\delta`.
    """
    if not bool(torch.isfinite(moved).all()):
        return float("inf")
    scale = float(reference.abs().max())
    return float((moved - reference).abs().max()) / max(scale, torch.finfo(torch.float64).tiny)


def reduced_precision_ops(
    model: torch.nn.Module, params: Mapping[str, torch.Tensor], inputs: Mapping[str, Any]
) -> Dict[str, int]:
    """Operators of a float64 model's forward pass that compute from its parameters in
    float32 or less (RMSNorm upcasts, attention softmax in float32...).

    Parameters
    ----------
    model : torch.nn.Module
        A float64 model.
    params : mapping
        Its parameters (name -> tensor), as passed to :func:`logits_of`.
    inputs : mapping
        Keyword inputs.

    Returns
    -------
    dict
        Operator name (``aten._to_copy`` ...) -> how often it produced a tainted tensor
        below float64; empty if the forward pass is float64 throughout.
    """
    with WeightPrecision(list(params.values())) as precision:
        logits_of(model, params, inputs)
    return dict(precision.below)


#: Relative change of the logits below which a group is exact for a float64 model that
#: computes parts of its forward pass in float32 (:func:`reduced_precision_ops`): the
#: tolerance of symmetry verification for such models.
FLOAT32_RTOL = FLOAT32_IN_FLOAT64_RTOL

ATTENTION_KINDS = ("query-key", "value-output")


def _json_float(value: Optional[float]) -> Any:
    if value is None or (value == value and abs(value) != float("inf")):
        return value
    return str(value)


def tolerance_for_ops(ops: Mapping[str, int]) -> tuple:
    """``(rtol, why)``: the relative change of the logits below which a group counts as
    exact, for a float64 model whose forward pass computes from its weights in float32 in
    the operators ``ops`` (:func:`reduced_precision_ops`): :data:`EXACT_RTOL` when there
    are none, :data:`FLOAT32_RTOL` otherwise, and the reason, for the zoo's report."""
    if not ops:
        return EXACT_RTOL, "float64 throughout"
    names = ", ".join(sorted(ops, key=lambda k: -ops[k])[:4])
    return FLOAT32_RTOL, f"computes from the weights in float32 ({names})"


def _group_rows(model, bound, params, inputs, reference, elements) -> List[Dict[str, Any]]:
    from ..symmetry.plan import symmetry_label

    rows = []
    for group, element in zip(bound.symmetric_groups, elements):
        deviation = control = None
        if element is not None:
            acting = [element if g is group else None for g in bound.symmetric_groups]
            moved = logits_of(model, bound.act(params, acting), inputs)
            deviation = relative_change(reference, moved)
            broken = logits_of(model, bound.act(params, acting, first_factor_only=True), inputs)
            control = relative_change(reference, broken)
        rows.append(
            {
                "name": group.name,
                "kind": group.kind,
                "label": symmetry_label(group.manifold, group.shape[-1]),
                "shape": list(group.shape),
                "deviation": _json_float(deviation),
                "control": _json_float(control),
            }
        )
    return rows


def _exactness(rows: List[Dict[str, Any]], all_at_once: Any, threshold: float) -> bool:
    def ok(value: Any) -> bool:
        return isinstance(value, float) and value <= threshold

    return all(ok(r["deviation"]) for r in rows) and (not rows or ok(all_at_once))


def check_model(
    model: torch.nn.Module,
    *,
    verify: bool = False,
    seed: int = 0,
    max_condition: float = 10.0,
    inputs: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    r"""Check every symmetric group that discovery claims for ``model``.

    ``find_symmetries(model, kinds="all", verify=verify)``, bound to the model; a random
    element of each symmetric group (:func:`draw_group_element`, condition number at most
    ``max_condition``) acts on the parameters (``BoundPlan.act``), one group at a time and
    all at once, and the relative change of the logits (:func:`relative_change`) is
    compared with the threshold of the model's precision (:data:`EXACT_RTOL` or
    :data:`FLOAT32_RTOL`, chosen by :func:`reduced_precision_ops`).

    Parameters
    ----------
    model : torch.nn.Module
        A float64 causal LM in eval mode (e.g. from :func:`build_family`).
    verify : bool
        Passed to :func:`~geoopt_quotient.find_symmetries` (default ``False``: the check
        sees what discovery claims).
    seed : int
        Seed of the group elements.
    max_condition : float
        Bound on the condition number of the group elements (default 10).
    inputs : mapping, optional
        Keyword inputs (default :func:`probe_inputs`: ``input_ids`` of shape 2 x 7).

    Returns
    -------
    dict
        JSON-able: ``groups`` (name, kind, label, shape, deviation per group, and
        ``control``: the change when the element acts on the first factor only, which
        is not a symmetry and must change the logits clearly, and ``reached``: whether
        it does, by more than 10 thresholds; a group the text probe does not reach,
        such as a vision tower's, is not tested by its deviation),
        ``all_at_once``, ``threshold``, ``threshold_reason``, ``reduced_precision_ops``,
        ``exact``, ``attention_quotiented``, ``notes``. A deviation that is not finite is
        written as a string (``"inf"``, ``"nan"``); ``None`` for a group without a known
        action (such a family is not exact).
    """
    from ..symmetry import SymmetryNotProvenWarning, find_symmetries

    inputs = probe_inputs(model) if inputs is None else inputs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SymmetryNotProvenWarning)
        plan = find_symmetries(model, kinds="all", verify=verify, probe_inputs=inputs)
    demoted = [str(w.message) for w in caught if w.category is SymmetryNotProvenWarning]
    bound = plan.bind(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    reference = logits_of(model, params, inputs)
    ops = reduced_precision_ops(model, params, inputs)
    threshold, why = tolerance_for_ops(ops)
    generator = torch.Generator().manual_seed(seed)
    elements = [
        draw_group_element(g, generator, torch.float64, max_condition)
        for g in bound.symmetric_groups
    ]
    rows = _group_rows(model, bound, params, inputs, reference, elements)
    all_at_once = None
    if rows and all(e is not None for e in elements):
        moved = logits_of(model, bound.act(params, elements), inputs)
        all_at_once = _json_float(relative_change(reference, moved))
    for row in rows:  # a control within the threshold: the probe does not reach the group
        control = row["control"]
        row["reached"] = not (
            control is None or (isinstance(control, float) and control <= 10 * threshold)
        )
    kinds = sorted({r["kind"] for r in rows})
    return {
        "groups": rows,
        "all_at_once": all_at_once,
        "threshold": threshold,
        "threshold_reason": why,
        "reduced_precision_ops": ops,
        "exact": _exactness(rows, all_at_once, threshold),
        "attention_quotiented": any(k in ATTENTION_KINDS for k in kinds),
        "kinds": kinds,
        "notes": list(plan.notes),
        "demoted": demoted,
    }


def check_family(
    family: str,
    *,
    verify: bool = False,
    seed: int = 0,
    max_condition: float = 10.0,
) -> Dict[str, Any]:
    """Build ``family`` tiny (:func:`build_family`) and check its plan (:func:`check_model`).

    Parameters
    ----------
    family : str
        A model type of :func:`causal_lm_families`.
    verify : bool
        Passed to :func:`~geoopt_quotient.find_symmetries` (default ``False``).
    seed : int
        Seed of the model's initialisation and of the group elements.
    max_condition : float
        Bound on the condition number of the group elements (default 10).

    Returns
    -------
    dict
        JSON-able row: ``family``, ``built``, ``reason`` (why it was not built),
        ``model_class``, ``n_params``, ``seconds`` (build and check), ``error`` (an
        exception of discovery or of the forward pass, else empty) and the fields of
        :func:`check_model`; a family that is not built or whose check fails has
        ``exact=False``.
    """
    start = time.perf_counter()
    zoo_model = build_family(family, seed=seed)
    row: Dict[str, Any] = {
        "family": family,
        "built": zoo_model.model is not None,
        "reason": zoo_model.reason,
        "model_class": zoo_model.class_name,
        "n_params": 0,
        "error": "",
        "exact": False,
    }
    if zoo_model.model is not None:
        row["n_params"] = sum(p.numel() for p in zoo_model.model.parameters())
        try:
            checked = check_model(
                zoo_model.model,
                verify=verify,
                seed=seed,
                max_condition=max_condition,
                inputs=zoo_model.inputs,
            )
            row.update(checked)
        except Exception as error:
            row["error"] = _first_line(error)
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row
