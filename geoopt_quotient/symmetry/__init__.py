"""Symmetry plans, and their discovery in real architectures.

A :class:`SymmetryPlan` says which parameter entries form which quotient-manifold point
(:mod:`~geoopt_quotient.symmetry.plan`); :func:`find_symmetries` builds one from a model's
module structure (:mod:`~geoopt_quotient.symmetry.huggingface`, ``torch.nn``, PEFT LoRA,
``ManifoldParameter``) and proves every group on the model's outputs before use
(:func:`prove_plan`; :func:`verify_plan` raises where a group does not hold). Nothing here
measures sharpness: the engine (:mod:`geoopt_quotient.sharpness`) consumes the plans.
"""

from .discovery import find_symmetries
from .experts import expert_pairs
from .huggingface import (
    bert_style_pairs,
    fused_attention_pairs,
    fused_rows,
    linear_attention_pairs,
    rotary_geometry,
)
from .latent import latent_attention_pairs
from .layouts import PairSpec, head_columns, head_rows, stack_pairs
from .lora import lora_pairs
from .mixture_attention import mixture_of_attention_pairs
from .norm_gains import norm_gain_pairs
from .output_gate import gated_output_pairs
from .plan import BoundPlan, GeodesicEqualsAdaptiveWarning, PlanError, SymmetryGroup, SymmetryPlan
from .torch_nn import multihead_attention_pairs
from .verify import (
    GroupCheck,
    PlanProof,
    ProbeError,
    SymmetryNotProvenWarning,
    SymmetryVerificationError,
    probe_inputs_for,
    prove_plan,
    verify_plan,
)

__all__ = [
    "BoundPlan",
    "GeodesicEqualsAdaptiveWarning",
    "GroupCheck",
    "PairSpec",
    "PlanError",
    "PlanProof",
    "ProbeError",
    "SymmetryGroup",
    "SymmetryNotProvenWarning",
    "SymmetryPlan",
    "SymmetryVerificationError",
    "bert_style_pairs",
    "expert_pairs",
    "find_symmetries",
    "fused_attention_pairs",
    "fused_rows",
    "gated_output_pairs",
    "head_columns",
    "head_rows",
    "latent_attention_pairs",
    "linear_attention_pairs",
    "lora_pairs",
    "mixture_of_attention_pairs",
    "multihead_attention_pairs",
    "norm_gain_pairs",
    "probe_inputs_for",
    "prove_plan",
    "rotary_geometry",
    "stack_pairs",
    "verify_plan",
]
