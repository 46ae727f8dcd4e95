"""Finding the symmetries of a model by its module structure: :func:`find_symmetries`."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple, Union

import torch

from .._checks import METRICS, check_choice, check_nonnegative_float
from .huggingface import Findings, find_attention
from .layouts import PairSpec, stack_pairs
from .lora import lora_pairs
from .mlp import gated_mlp_pairs
from .plan import NO_SYMMETRY, SymmetryGroup, SymmetryPlan
from .torch_nn import manifold_parameter_groups, multihead_attention_pairs
from .verify import verify_plan

__all__ = ["find_symmetries"]

#: The kinds of symmetry :func:`find_symmetries` quotients by default (the paper's).
DEFAULT_KINDS = ("query-key", "value-output", "lora", "manifold-parameter")
#: Every kind it knows (``kinds="all"``).
KINDS = (*DEFAULT_KINDS, "mlp")


def find_symmetries(
    model: torch.nn.Module,
    metric: str = "mix",
    eps: float = 0.0,
    verify: bool = False,
    *,
    probe_inputs: Any = None,
    trainable_only: bool = True,
    kinds: Union[str, Iterable[str]] = "default",
) -> SymmetryPlan:
    r"""Discover the GL(h) symmetries of ``model`` by module structure and attributes.

    Recognised (see :mod:`geoopt_quotient.symmetry.huggingface`):

    * ``torch.nn.MultiheadAttention`` (fused or separate projections,
      ``bias_k``/``bias_v``);
    * Hugging Face attention: BERT, RoBERTa, DistilBERT, ViT, CLIP (text and vision),
      GPT-2 (fused ``Conv1D``, self- and cross-attention), T5 (self- and
      cross-attention), decoder LLMs (Llama, Mistral, Qwen2, Gemma, OLMo, Phi, Phi-3,
      GPT-NeoX, Falcon, GPT-J: rotary Q/K as points of
      :class:`~geoopt_quotient.RotaryGLQuotient`, grouped-query sharing, fused QKV;
      per-head q/k norms leave Q/K adaptive with a note), and other modules with the
      same projection layouts (BART, OPT, Whisper...);
    * with ``kinds="all"``, gated MLPs: one GL(1) pair per hidden unit;
    * PEFT LoRA adapters (``lora_A``/``lora_B``): one GL(r) pair each;
    * parameters declared as ``geoopt.ManifoldParameter`` on the project's quotients.

    Per head, Q/K and V/O pairs carry the q, k, v biases as extra rows; pairs of the
    same shape are stacked into one group ``(modules, heads, n + m, h)``. Everything
    else is left to the adaptive geometry. A model with no detectable symmetry gets a
    plan that says so; modules recognised only in part (attention-like attributes but
    unexpected shapes or parameters, rotary Q/K, rank-deficient adapters) are reported
    in the plan's ``notes``, never guessed.

    Parameters
    ----------
    model : torch.nn.Module
        The model; only read (its module structure, attributes and parameter shapes).
    metric : {"mix", "inv"}
        Metric of the quotients (default ``"mix"``).
    eps : float
        Relaxation :math:`\varepsilon \ge 0` of the quotients' Gram matrices
        (default 0: the exact geometry).
    verify : bool
        Check every group on probe inputs (:func:`verify_plan`): a random element of
        each group (condition number 4) must leave every floating-point output
        unchanged, to ``1e-5`` (float64) or ``1e-4`` (float32) of the largest output.
        Raises :class:`SymmetryVerificationError` naming the group that fails; the
        result (and any weak check) is added to the notes.
    probe_inputs : dict, tuple, torch.Tensor or None
        Inputs for ``verify``: keyword arguments, positional arguments or one tensor.
        ``None`` builds them from a Hugging Face config (``input_ids``,
        ``pixel_values``, ``decoder_input_ids``; see :func:`probe_inputs_for`).
    trainable_only : bool
        Skip pairs on frozen parameters (they are never perturbed; e.g. the base
        weights of a PEFT model). Must match ``SymmetryPlan.bind(trainable_only=...)``.
    kinds : {"default", "all"} or iterable of str
        Which kinds of symmetry to quotient: ``"default"`` is the paper's (attention
        ``"query-key"`` and ``"value-output"`` pairs, rotary Q/K included, ``"lora"``
        adapters and ``"manifold-parameter"``); ``"all"`` adds every kind the library
        knows: ``"mlp"``, one GL(1) pair per hidden unit of a gated MLP
        (:func:`~geoopt_quotient.symmetry.mlp.gated_mlp_pairs`). Or a list of kinds.

    Returns
    -------
    SymmetryPlan
        ``plan.bind(model).summary()`` prints it as a table.

    Raises
    ------
    SymmetryVerificationError
        With ``verify=True``, if a group is not a symmetry of the model.
    PlanError
        With ``verify=True``, if no probe inputs can be built.

    References
    ----------
    da Silva, Dangel & Oore (2025), "Hide & Seek: Transformer Symmetries Obscure
    Sharpness & Riemannian Geometry Finds It", ICML :cite:`dasilva2025hide`.

    Examples
    --------
    The query/key and value/output pairs of both heads of an attention layer, each
    with its bias row (``n = m = 8 + 1``, ``h = 4``):

    >>> import torch
    >>> from geoopt_quotient import find_symmetries
    >>> model = torch.nn.MultiheadAttention(8, 2)
    >>> plan = find_symmetries(model)
    >>> [(group.kind, tuple(group.shape)) for group in plan.groups]
    [('query-key', (1, 2, 18, 4)), ('value-output', (1, 2, 17, 4))]

    Bound to the model, the plan leaves the rest to the adaptive geometry:

    >>> [group.name for group in plan.bind(model).adaptive_groups]
    ['out_proj.bias']
    """
    check_choice(metric, METRICS, "metric")
    eps = check_nonnegative_float(eps, "eps")
    wanted = _kinds(kinds)
    found = Findings()
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.MultiheadAttention):
            found.specs.extend(multihead_attention_pairs(path, module))
            found.claimed.add(path)
    found.extend(lora_pairs(model, eps))
    found.extend(find_attention(model, skip=set(found.claimed)))
    if "mlp" in wanted:
        found.extend(gated_mlp_pairs(model))
    specs = [s for s in _usable_specs(model, found, trainable_only) if s.kind in wanted]
    pair_groups = stack_pairs(specs, metric, eps)
    groups = list(pair_groups)
    if "manifold-parameter" in wanted:
        groups += manifold_parameter_groups(model, metric, eps)
    notes = found.rendered_notes()
    if not groups:
        notes.insert(0, NO_SYMMETRY)
    plan = SymmetryPlan(groups, notes=notes)
    if verify:
        plan.notes.extend(
            verify_plan(model, plan, probe_inputs, members=_members(specs, pair_groups))
        )
    return plan


def _kinds(kinds: Union[str, Iterable[str]]) -> Tuple[str, ...]:
    if isinstance(kinds, str) and kinds in ("default", "all"):
        return DEFAULT_KINDS if kinds == "default" else KINDS
    wanted = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    unknown = [k for k in wanted if k not in KINDS]
    if unknown:
        raise ValueError(
            f"unknown symmetry kinds {unknown}; expected 'default', 'all' or some of {list(KINDS)}"
        )
    return wanted


def _usable_specs(model: torch.nn.Module, found: Findings, trainable_only: bool) -> List[PairSpec]:
    if not trainable_only:
        return list(found.specs)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    out, frozen = [], 0
    for spec in found.specs:
        flags = [n in trainable for n in spec.params]
        if all(flags):
            out.append(spec)
        elif any(flags):
            found.note(
                f"{spec.kind} pair partly frozen: left to the adaptive geometry", spec.module
            )
        else:
            frozen += 1
    if frozen:
        found.note(f"{frozen} pairs on frozen parameters skipped (never perturbed)")
    return out


def _members(specs: List[PairSpec], groups: List[SymmetryGroup]) -> Dict[str, List[str]]:
    """Group name -> module of each stacked entry (same bucketing as :func:`stack_pairs`)."""
    buckets: Dict[tuple, List[PairSpec]] = {}
    for spec in specs:
        buckets.setdefault(spec.signature, []).append(spec)
    return {g.name: [s.module for s in m] for g, m in zip(groups, buckets.values())}
