r"""Attention with an elementwise output gate: V/O quotiented by its diagonal subgroup.

Gated attention (Qwen3-Next, Qwen3.5, AFMoE...) multiplies the concatenated heads'
output elementwise by a gate computed from the layer's input before the output
projection:

.. math::

    y = W_o \bigl(\sigma(W_g x) \odot [\,a_1; \dots; a_H\,]\bigr), \qquad
    a_i = \mathrm{softmax}(s_i)\, V_{\kappa(i)} ,

with :math:`V_\kappa = X W_{v,\kappa}^\top` the values of key/value head :math:`\kappa`
(query head :math:`i` reads key/value head :math:`\kappa(i)`). V/O's
:math:`\mathrm{GL}(h)` acts by :math:`V_\kappa \mapsto V_\kappa B` and the inverse on the
output columns of the query heads of :math:`\kappa`; the gate sits between the two and
:math:`\mathrm{diag}(g)\, B^\top \ne B^\top \mathrm{diag}(g)` unless :math:`B` commutes
with every diagonal the gate takes, i.e. (for gates that differ from one dimension to the
next) :math:`B` is diagonal. The diagonal subgroup survives: scaling the value row
:math:`j` of key/value head :math:`\kappa` (and its bias) by :math:`d \ne 0` and output
column :math:`j` of every query head reading :math:`\kappa` by :math:`1/d` leaves
:math:`y` unchanged. Per unit :math:`(\kappa, j)` this is a rank-one
:class:`~geoopt_quotient.GLQuotient` pair, :math:`G` = the value row (bias appended) as a
column and :math:`H` = the output columns stacked, the same geometry as a gated MLP's
units (:mod:`~geoopt_quotient.symmetry.mlp`): no new manifold.

The gate is recognised by shape (a projection of the input with one output per entry of
the attention output, or a query projection with twice the rows the output projection
reads: each head's queries packed with its gate); names are not read, and the pair is
replayed on its module (:func:`~geoopt_quotient.symmetry.huggingface.check_locally`)
and proven on the model with the rest of the plan, so a module whose values pass through
anything else (a norm of the values, a mask computed from them) keeps nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from .huggingface import (
    HEAD_DIM_ATTRS,
    HEADS_ATTRS,
    KV_HEADS_ATTRS,
    SEPARATE_CONVENTIONS,
    Findings,
    check_locally,
)
from .layouts import PairSpec, child_path

__all__ = ["AttentionProjections", "attention_projections", "gated_output_pairs"]

#: The label of V/O's diagonal subgroup (in the group's name).
DIAGONAL = "diagonal"
#: Parts of the notes of :mod:`~geoopt_quotient.symmetry.huggingface` that a diagonal
#: group replaces: V/O refused under an output gate, or a gate packed into q_proj.
REPLACED_NOTES = ("V/O's GL(h) does not survive", "twice the rows o_proj reads")
#: The note on each module whose V/O is quotiented by its diagonal subgroup.
DIAGONAL_NOTE = (
    "{gate} multiplies the attention output elementwise before the output projection: "
    "V/O is quotiented by its diagonal subgroup (GL(1) per dimension of each key/value "
    "head: the value row scaled by d, the output columns of every query head reading it "
    "by 1/d), not by GL(h), because a non-diagonal B acting on a head's values does not "
    "commute with the gate's elementwise product"
)
#: What it means when the diagonal scalings move the module's output.
NOT_EVEN_DIAGONAL = (
    "the values pass through more than an elementwise gate (a norm of the values or of "
    "the heads, a mask computed from them): not even V/O's diagonal scalings survive"
)


def _positive_int(module: torch.nn.Module, names: Sequence[str]) -> Optional[int]:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class AttentionProjections:
    """An attention module with four ``nn.Linear`` projections and its head counts.

    Attributes
    ----------
    path : str
        The module's path in the model.
    module : torch.nn.Module
        The module.
    names : tuple of str
        Child names of the query, key, value and output projections.
    heads, kv_heads, head_dim : int
        Query heads, key/value heads and the head size (from the module's attributes).
    """

    path: str
    module: torch.nn.Module
    names: Tuple[str, str, str, str]
    heads: int
    kv_heads: int
    head_dim: int

    def linear(self, which: int) -> torch.nn.Linear:
        """Projection ``which`` (0: query, 1: key, 2: value, 3: output)."""
        return getattr(self.module, self.names[which])

    def entries(self, which: int, bias: bool = True) -> Dict[str, torch.Size]:
        """Full names and shapes of projection ``which``'s weight (and bias)."""
        linear, prefix = self.linear(which), child_path(self.path, self.names[which])
        out = {child_path(prefix, "weight"): linear.weight.shape}
        if bias and linear.bias is not None:
            out[child_path(prefix, "bias")] = linear.bias.shape
        return out


def attention_projections(path: str, module: torch.nn.Module) -> Optional[AttentionProjections]:
    """The projections and head counts of ``module``, if it has separate q, k, v and o
    ``nn.Linear`` children (:data:`~geoopt_quotient.symmetry.huggingface.SEPARATE_CONVENTIONS`)
    and a head-size attribute whose multiples fit the key, value and output projections.

    Parameters
    ----------
    path : str
        The module's path in the model.
    module : torch.nn.Module
        The module.

    Returns
    -------
    AttentionProjections or None
        ``None`` where the module is not such attention.
    """
    head_dim = _positive_int(module, HEAD_DIM_ATTRS)
    if head_dim is None:
        return None
    for q_name, k_name, v_name, o_names in SEPARATE_CONVENTIONS:
        q, k, v = (getattr(module, n, None) for n in (q_name, k_name, v_name))
        o_name = next(
            (n for n in o_names if isinstance(getattr(module, n, None), torch.nn.Linear)), None
        )
        if o_name is None or not all(isinstance(p, torch.nn.Linear) for p in (q, k, v)):
            continue
        o = getattr(module, o_name)
        heads = _positive_int(module, HEADS_ATTRS) or o.in_features // head_dim
        kv_heads = _positive_int(module, KV_HEADS_ATTRS) or k.out_features // head_dim
        fits = (
            kv_heads > 0
            and heads % kv_heads == 0
            and o.in_features == heads * head_dim
            and v.out_features == kv_heads * head_dim
        )
        if fits:
            names = (q_name, k_name, v_name, o_name)
            return AttentionProjections(path, module, names, heads, kv_heads, head_dim)
    return None


def output_gate(projections: AttentionProjections) -> Optional[str]:
    """What gates the attention output of ``projections``' module elementwise, by shape,
    or ``None``: another child projection of the input with one output per entry of the
    attention output, or a query projection with twice the rows the output reads."""
    q, o = projections.linear(0), projections.linear(3)
    width = o.in_features
    for name, child in projections.module.named_children():
        if name in projections.names or not isinstance(child, torch.nn.Linear):
            continue
        if child.in_features == q.in_features and child.out_features == width:
            return f"{name} (a projection of the input)"
    if q.out_features == 2 * width:
        return (
            f"the gate half of {projections.names[0]}'s rows (each head's queries packed "
            "with a gate of the head's size: twice the rows the output projection reads)"
        )
    return None


def diagonal_value_output(projections: AttentionProjections) -> PairSpec:
    """The rank-one V/O pairs of every head dimension of every key/value head.

    Unit :math:`u = \\kappa h + j` pairs value row :math:`u` (bias appended) with output
    column :math:`j` of each query head reading key/value head :math:`\\kappa`.

    Parameters
    ----------
    projections : AttentionProjections
        The module.

    Returns
    -------
    PairSpec
        Kind ``"value-output"``, label ``"diagonal"``, ``head_dim = 1`` and one pair per
        unit (``kv_heads * head_dim`` of them).
    """
    v, o = projections.linear(2), projections.linear(3)
    kv, hd = projections.kv_heads, projections.head_dim
    group, units = projections.heads // kv, kv * hd
    params = {**projections.entries(2), **projections.entries(3, bias=False)}

    def layout(weight, *rest):
        g = weight.reshape(units, -1, 1)
        if len(rest) == 2:
            g = torch.cat((g, rest[0].reshape(units, 1, 1)), dim=-2)
        out = rest[-1]
        h = out.reshape(out.shape[0], kv, group, hd).permute(1, 3, 2, 0)
        return torch.cat((g, h.reshape(units, group * out.shape[0], 1)), dim=-2)

    n = v.in_features + int(v.bias is not None)
    return PairSpec(
        "value-output", projections.path, params, layout, n, group * o.out_features, 1, units,
        label=DIAGONAL,
    )  # fmt: skip


def gated_output_pairs(model: torch.nn.Module, found: Findings) -> None:
    """Add V/O's diagonal subgroup of every gated attention module to ``found``.

    Modules that already have a V/O pair in ``found`` are skipped; for the others with
    four projections and an output gate (:func:`output_gate`), the diagonal pairs
    (:func:`diagonal_value_output`) are replayed on the module and kept where they hold,
    their notes replacing those that said V/O was refused.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    found : Findings
        What the other detectors found; extended in place.
    """
    has_value_output = {s.module for s in found.specs if s.kind == "value-output"}
    mine, gates = Findings(), {}
    for path, module in model.named_modules():
        projections = None if path in has_value_output else attention_projections(path, module)
        gate = None if projections is None else output_gate(projections)
        if gate is None:
            continue
        mine.add_replayed([diagonal_value_output(projections)], NOT_EVEN_DIAGONAL)
        gates[path] = gate
    check_locally(model, mine)
    for spec in mine.specs:
        for marker in REPLACED_NOTES:
            found.retract(spec.module, marker)
        mine.note(DIAGONAL_NOTE.format(gate=gates[spec.module]), spec.module)
    found.extend(mine)
