"""Symmetry plans, and their discovery in real architectures.

A :class:`SymmetryPlan` says which parameter entries form which quotient-manifold point
(:mod:`~geoopt_quotient.symmetry.plan`); :func:`find_symmetries` builds one from a model's
module structure (:mod:`~geoopt_quotient.symmetry.huggingface`, ``torch.nn``, PEFT LoRA,
``ManifoldParameter``) and :func:`verify_plan` checks it on probe inputs. Nothing here
measures sharpness: the engine (:mod:`geoopt_quotient.sharpness`) consumes the plans.
"""

from .discovery import find_symmetries
from .huggingface import (
    bert_style_pairs,
    fused_attention_pairs,
    fused_rows,
    linear_attention_pairs,
    rotary_geometry,
)
from .layouts import PairSpec, head_columns, head_rows, stack_pairs
from .lora import lora_pairs
from .plan import BoundPlan, GeodesicEqualsAdaptiveWarning, PlanError, SymmetryGroup, SymmetryPlan
from .torch_nn import multihead_attention_pairs
from .verify import SymmetryVerificationError, probe_inputs_for, verify_plan

__all__ = [
    "BoundPlan",
    "GeodesicEqualsAdaptiveWarning",
    "PairSpec",
    "PlanError",
    "SymmetryGroup",
    "SymmetryPlan",
    "SymmetryVerificationError",
    "bert_style_pairs",
    "find_symmetries",
    "fused_attention_pairs",
    "fused_rows",
    "head_columns",
    "head_rows",
    "linear_attention_pairs",
    "lora_pairs",
    "multihead_attention_pairs",
    "probe_inputs_for",
    "rotary_geometry",
    "stack_pairs",
    "verify_plan",
]
