"""Finding the symmetries of a model by its module structure: :func:`find_symmetries`."""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .._checks import METRICS, check_choice, check_nonnegative_float
from .experts import expert_pairs
from .huggingface import (
    Findings,
    check_locally,
    collapse_paths,
    deferred_replays,
    find_attention,
)
from .latent import latent_attention_pairs
from .layouts import PairSpec, stack_pairs
from .lora import lora_pairs
from .mixture_attention import mixture_of_attention_pairs
from .mlp import gated_mlp_pairs
from .norm_gains import norm_gain_pairs
from .output_gate import gated_output_pairs
from .plan import NO_SYMMETRY, SymmetryGroup, SymmetryPlan
from .probe import recorded_forward, shared_records, why_not_runnable
from .torch_nn import manifold_parameter_groups, multihead_attention_pairs
from .verify import (
    REPORT,
    PlanProof,
    ReferencePass,
    SymmetryNotProvenWarning,
    failure_message,
    prove_at_once,
    prove_plan,
    without_autocast,
)

__all__ = ["find_symmetries"]

#: The kinds of symmetry :func:`find_symmetries` quotients by default (the paper's).
DEFAULT_KINDS = ("query-key", "value-output", "lora", "manifold-parameter")
#: Every kind it knows (``kinds="all"``).
KINDS = (*DEFAULT_KINDS, "mlp")


def find_symmetries(
    model: torch.nn.Module,
    metric: str = "mix",
    eps: float = 0.0,
    verify: bool = True,
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
      same projection layouts (BART, OPT, Whisper...), fused and multi-query layouts
      (GPT-BigCode ``c_attn``, MPT and DBRX ``Wqkv``, CTRL, OpenAI GPT), attention
      sinks;
    * attention with an elementwise output gate (AFMoE, Qwen3-Next, Qwen3.5): V/O by its
      diagonal subgroup, one GL(1) pair per head dimension of each key/value head
      (:func:`~geoopt_quotient.symmetry.gated_output_pairs`);
    * q/k-normalised attention whose V/O is not quotiented by GL(h) (Gemma 3n, Gemma 4,
      Doge, and the gated ones): the gains of the q and k norms scaled by :math:`s` and
      :math:`1/s` per rotary plane, one GL(1) pair each, kind ``"query-key"``
      (:func:`~geoopt_quotient.symmetry.norm_gain_pairs`);
    * mixture-of-attention heads (JetMoE:
      :func:`~geoopt_quotient.symmetry.mixture_of_attention_pairs`);
    * multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, LongCat...): per head
      GL(qk_nope_head_dim) on Q/K and GL(v_head_dim) on V/O
      (:func:`~geoopt_quotient.symmetry.latent_attention_pairs`);
    * with ``kinds="all"``, gated MLPs and the fused 3-D experts of mixture-of-experts
      layers: one GL(1) pair per hidden unit (per expert;
      :func:`~geoopt_quotient.symmetry.expert_pairs`);
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
        Prove every group on the model before it is used (default): a random element
        of each group's own group (condition number at most 4), all at once, must leave
        every floating-point output unchanged within the precision the model computes
        in (:func:`~geoopt_quotient.symmetry.verify.prove_plan`; two forward passes when
        every group holds, the first of them the rotary probe's recorded pass where the
        probe inputs are built from the config, and a third where rounding alone moves
        the outputs beyond the default tolerance, which that pass measures). A group the
        outputs refute, or the modules of a stacked group that break it, are left to the
        adaptive geometry with a :class:`SymmetryNotProvenWarning`, and the plan's notes
        say so; pairs that their own module breaks (a norm of the values between V and
        O...) are replayed on it then and dropped with a note. ``False`` skips the proof
        (the plan then rests on module structure alone and on those replays, run on every
        such pair). A model on the meta device or sharded with FSDP2 cannot be run here:
        its plan is returned unproven, with a note; prove it with :func:`verify_plan` on
        the loaded (or an unsharded) model.
    probe_inputs : dict, tuple, torch.Tensor, callable or None
        Inputs of the proof: keyword arguments, positional arguments, one tensor, or a
        function ``model -> outputs`` (e.g. the loss on the first batch). ``None``
        builds them from a Hugging Face config (``input_ids``, ``pixel_values``,
        ``decoder_input_ids``; see :func:`probe_inputs_for`) or, for a
        ``torch.nn.MultiheadAttention``, from its sizes.
    trainable_only : bool
        Skip pairs on frozen parameters (they are never perturbed; e.g. the base
        weights of a PEFT model). Must match ``SymmetryPlan.bind(trainable_only=...)``.
    kinds : {"default", "all"} or iterable of str
        Which kinds of symmetry to quotient: ``"default"`` is the paper's (attention
        ``"query-key"`` and ``"value-output"`` pairs, rotary Q/K included, ``"lora"``
        adapters and ``"manifold-parameter"``); ``"all"`` adds every kind the library
        knows: ``"mlp"``, one GL(1) pair per hidden unit of a gated MLP
        (:func:`~geoopt_quotient.symmetry.mlp.gated_mlp_pairs`) and of each expert of a
        fused mixture-of-experts layer
        (:func:`~geoopt_quotient.symmetry.expert_pairs`). Or a list of kinds.

    Returns
    -------
    SymmetryPlan
        ``plan.bind(model).summary()`` prints it as a table.

    Warns
    -----
    SymmetryNotProvenWarning
        With ``verify=True``, for each group (or part of one) that is not a symmetry of
        the model: it is left to the adaptive geometry.

    Raises
    ------
    PlanError
        With ``verify=True``, if no probe inputs can be built (pass ``probe_inputs=``).

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
    with without_autocast():  # the model's own function, in its weights' precision
        return _discovered(model, metric, eps, verify, probe_inputs, trainable_only, wanted)


def _discovered(model, metric, eps, verify, probe_inputs, trainable_only, wanted) -> SymmetryPlan:
    """The body of :func:`find_symmetries`, its arguments checked."""
    unproven = _unprovable(model) if verify else None
    proving = verify and unproven is None
    # one recorded probe forward for the detectors, the replays and (on the default probe
    # inputs) the proof, whose reference pass it is
    sharing = proving and probe_inputs is None
    with shared_records(reference=sharing):
        with deferred_replays() if proving else contextlib.nullcontext():
            found = _found(model, wanted, eps)
        specs = _wanted_specs(model, found, trainable_only, wanted)
        extra = (
            manifold_parameter_groups(model, metric, eps) if "manifold-parameter" in wanted else []
        )
        pair_groups = stack_pairs(specs, metric, eps)
        proof_notes = [unproven] if unproven else []
        if proving:
            usable = functools.partial(
                _wanted_specs, model, found, trainable_only, wanted, notes=False
            )
            pair_groups, extra, proof_notes = _proven_plan(
                model, found, (specs, usable), pair_groups, extra, probe_inputs, metric, eps
            )
    notes = found.rendered_notes() + proof_notes
    groups = pair_groups + extra
    if not any(g.kind in (*ATTENTION_KINDS, "lora") for g in groups):
        notes.append(attention_reason(model, notes))  # (adapters: the base is not trained)
    if not groups:
        notes.insert(0, NO_SYMMETRY)
    return SymmetryPlan(groups, notes=notes)


def _wanted_specs(
    model, found: Findings, trainable_only: bool, wanted, notes: bool = True
) -> List[PairSpec]:
    """The pairs of ``found`` the plan can use, of the kinds asked for (``notes``: say in
    ``found`` which are frozen; once per discovery)."""
    usable = _usable_specs(model, found, trainable_only, notes)
    return [s for s in usable if s.kind in wanted]


def _proven_plan(model, found, pairs, pair_groups, extra, probe_inputs, metric, eps) -> Tuple:
    """``(pair groups, extra groups, notes)`` of the plan proven on the model.

    The pairs discovery flagged for a replay on their modules (``found.to_check``: V/O
    pairs, whose values may pass through a norm, and the like) are replayed only where
    the plan does not hold as a whole (:func:`prove_at_once`): the replays then drop, with
    a note that says why, the pairs their modules break, the q/k-norm gain scalings of
    the modules whose V/O they dropped are found (:func:`norm_gain_pairs`), and what is
    left is proven and bisected as usual. ``pairs``: the pairs of ``found`` the plan can
    use, and a function that lists them again. Without ``probe_inputs`` the recorded probe
    forward is the first proof's reference pass (a later proof runs its own, on the same
    inputs).
    """
    specs, usable = pairs
    reference = _shared_reference(model) if probe_inputs is None else None
    first = dict(probe_inputs=probe_inputs) if reference is None else dict(reference=reference)
    if reference is not None:
        probe_inputs = reference.inputs
    if found.to_check:
        proof = _proof_at_once(model, pair_groups + extra, first)
        if proof is not None:
            found.to_check = []
            return pair_groups, extra, proof.notes()
        check_locally(model, found)  # drops (with a note) the pairs their modules break
        norm_gain_pairs(model, found)  # where a dropped V/O leaves the gains' scaling
        specs = usable()
        pair_groups = stack_pairs(specs, metric, eps)
        first = dict(probe_inputs=probe_inputs)
    kept_specs, extra, notes = _proven(model, specs, pair_groups, extra, first)
    if len(kept_specs) < len(specs):  # stacked again without the members that broke
        pair_groups = stack_pairs(kept_specs, metric, eps)
    return pair_groups, extra, notes


def _proof_at_once(model, groups: List[SymmetryGroup], probe: Dict) -> Optional[PlanProof]:
    """The proof of ``groups`` if they hold together (two or three forward passes), else ``None``;
    ``probe``: ``probe_inputs=`` or ``reference=`` of :func:`prove_at_once`."""
    return prove_at_once(model, SymmetryPlan(groups), **probe) if groups else None


def _shared_reference(model: torch.nn.Module) -> Optional[ReferencePass]:
    """The reference pass the recorded probe forward made (:func:`shared_records`), if any."""
    record, _ = recorded_forward(model)
    return getattr(record, "reference", None)


def _found(model: torch.nn.Module, wanted: Tuple[str, ...], eps: float) -> Findings:
    """What the detectors recognise in ``model`` (attention, LoRA, and MLPs if wanted)."""
    found = Findings()
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.MultiheadAttention):
            found.specs.extend(multihead_attention_pairs(path, module))
            found.claimed.add(path)
    found.extend(lora_pairs(model, eps))
    found.extend(latent_attention_pairs(model))
    found.extend(mixture_of_attention_pairs(model))
    found.extend(find_attention(model, skip=set(found.claimed)))
    gated_output_pairs(model, found)  # V/O's diagonal subgroup under an output gate
    norm_gain_pairs(model, found)  # the gains of q/k norms, where V/O's GL(h) is not had
    if "mlp" in wanted:
        found.extend(gated_mlp_pairs(model))
        found.extend(expert_pairs(model))
    return found


#: The kinds of the attention groups.
ATTENTION_KINDS = ("query-key", "value-output")
#: Class names of token mixers that are attention.
ATTENTION_NAMES = re.compile(r"Attention|Attn|MLA(?![a-z])")


def attention_reason(model: torch.nn.Module, notes: List[str]) -> str:
    """One line that says why no attention group is in a plan: the model has no attention,
    or its attention modules are left adaptive for the reasons in ``notes``, or they are
    not recognised (with how to describe them by hand).

    Parameters
    ----------
    model : torch.nn.Module
        The model (its module class names are read).
    notes : list of str
        The plan's notes so far.

    Returns
    -------
    str
        The note, starting with ``"attention not quotiented: "``.
    """
    head = "attention not quotiented: "
    if any("attention" in n or "Q/K" in n or "V/O" in n for n in notes):
        return head + (
            "its attention modules are left to the adaptive geometry for the reasons noted "
            "(a normalisation, clamp or gate that removes the continuous symmetry, or a "
            "layout discovery does not recognise: describe one by hand with "
            "SymmetryGroup.from_layout)"
        )
    names = sorted(
        {type(m).__name__ for m in model.modules() if ATTENTION_NAMES.search(type(m).__name__)}
    )  # fmt: skip
    if names:
        return head + (
            f"modules named like attention ({', '.join(names[:3])}) match no known layout; "
            "describe their heads by hand with SymmetryGroup.from_layout"
        )
    return head + (
        "the model has no attention (its token mixers are state-space, recurrent or "
        "convolutional layers), so there is no Q/K or V/O symmetry"
    )


def _unprovable(model: torch.nn.Module) -> Optional[str]:
    """Why the model cannot be run to prove its plan here, or ``None``."""
    why_not = why_not_runnable(model)
    if not why_not:
        return None
    return (
        f"unverified: {why_not}, so the plan rests on module structure alone; prove it with "
        "verify_plan(model, plan) on the loaded model, or on an unsharded model of the same "
        "architecture (e.g. a small config)"
    )


def _proven(
    model: torch.nn.Module,
    specs: List[PairSpec],
    pair_groups: List[SymmetryGroup],
    extra: List[SymmetryGroup],
    probe: Dict[str, Any],
) -> Tuple[List[PairSpec], List[SymmetryGroup], List[str]]:
    """The specs and extra groups that hold on the model, and the notes of the proof
    (``probe``: ``probe_inputs=`` or ``reference=`` of :func:`prove_plan`); each group
    (or stacked member) the outputs refute is dropped with a warning."""
    plan = SymmetryPlan(pair_groups + extra)
    if not plan.groups:
        return specs, extra, []
    proof = prove_plan(model, plan, **probe)
    members = _members(specs, pair_groups)
    dropped_specs, dropped_groups, notes = set(), set(), []
    for check in proof.failed:
        message = failure_message(model, check, proof, members)
        warnings.warn(
            f"{message}; it is left to the adaptive geometry ({REPORT})",
            SymmetryNotProvenWarning,
            stacklevel=3,
        )
        names = members.get(check.name)
        if names is None:
            dropped_groups.add(check.name)
            notes.append(f"not a symmetry, left adaptive: {check.name} ({check.deviation:.2g})")
            continue
        failing = [names[i] for i in check.failing_members]
        dropped_specs.update((check.name, m) for m in failing)
        notes.append(
            f"not a symmetry, left adaptive: {check.name} in {collapse_paths(failing)} "
            f"(output change {check.deviation:.2g}, tolerance {proof.tolerance:.2g})"
        )
    kept = [s for s in specs if (_group_of(s, pair_groups, specs), s.module) not in dropped_specs]
    return kept, [g for g in extra if g.name not in dropped_groups], proof.notes() + notes


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


def _usable_specs(
    model: torch.nn.Module, found: Findings, trainable_only: bool, notes: bool = True
) -> List[PairSpec]:
    if not trainable_only:
        return list(found.specs)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    out, frozen = [], 0
    for spec in found.specs:
        flags = [n in trainable for n in spec.params]
        if all(flags):
            out.append(spec)
        elif any(flags) and notes:
            found.note(
                f"{spec.kind} pair partly frozen: left to the adaptive geometry", spec.module
            )
        else:
            frozen += 1
    if frozen and notes:
        found.note(f"{frozen} pairs on frozen parameters skipped (never perturbed)")
    return out


def _group_of(spec: PairSpec, groups: List[SymmetryGroup], specs: List[PairSpec]) -> str:
    """The name of the stacked group ``spec`` belongs to (as bucketed by :func:`stack_pairs`)."""
    signatures = list(dict.fromkeys(s.signature for s in specs))
    return groups[signatures.index(spec.signature)].name


def _members(specs: List[PairSpec], groups: List[SymmetryGroup]) -> Dict[str, List[str]]:
    """Group name -> module of each stacked entry (same bucketing as :func:`stack_pairs`)."""
    buckets: Dict[tuple, List[PairSpec]] = {}
    for spec in specs:
        buckets.setdefault(spec.signature, []).append(spec)
    return {g.name: [s.module for s in m] for g, m in zip(groups, buckets.values())}
