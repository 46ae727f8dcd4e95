r"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, Kimi, LongCat, GLM-4-MoE-Lite...).

The queries come from a low-rank path, ``q_b_proj(norm(q_a_proj(x)))`` (or one ``q_proj``),
the keys and values from a shared latent, ``kv_b_proj(norm(c))`` with
``c = kv_a_proj_with_mqa(x)[:kv_lora_rank]``. Per head :math:`i` the query splits into
``qk_nope_head_dim`` dimensions without position and ``qk_rope_head_dim`` rotary ones,
the rows of ``kv_b_proj`` into the head's non-rotary key ``k_nope`` and its value
(``v_head_dim``); the rotary key is one shared head (``kv_a_proj_with_mqa``'s last
``qk_rope_head_dim`` outputs). The scores are

.. math::

    s_i = q_{\mathrm{nope},i}^\top k_{\mathrm{nope},i} + q_{\mathrm{rope},i}^\top
    R\, k_{\mathrm{rope}},

so, with :math:`W^{q}_i` the head's non-rotary rows of the query projection and
:math:`W^{k}_i` its key rows of ``kv_b_proj`` (both after the norms, which they do not
touch), :math:`A \in \mathrm{GL}(\texttt{qk\_nope\_head\_dim})` acting as
:math:`W^q_i \mapsto A^\top W^q_i`, :math:`W^k_i \mapsto A^{-1} W^k_i` leaves every score
unchanged: a query-key :class:`~geoopt_quotient.GLQuotient` pair per head
(:math:`G = {W^q_i}^\top`, :math:`H = {W^k_i}^\top`, biases as extra rows). Likewise the
head's value rows of ``kv_b_proj`` against its columns of ``o_proj``, with
:math:`B \in \mathrm{GL}(\texttt{v\_head\_dim})`: a value-output pair. The rotary part is
left to the adaptive geometry: the rotary key is shared by all heads (multi-query), so
its group would be one rotary-commuting element for every head at once, acting on
``kv_a_proj_with_mqa``; that is not claimed here.

Each pair is replayed on its module before it is kept
(:func:`~geoopt_quotient.symmetry.huggingface.check_locally`) and proven on the model
with the rest of the plan.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from .huggingface import Findings, check_locally, module_attribute
from .layouts import PairSpec, child_path, head_columns, linear_child

__all__ = ["latent_attention_pairs"]

#: Head sizes an MLA module declares.
LATENT_ATTRS = ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
#: The query projection: after a low-rank path, direct, or fused with an output gate
#: (AXK2: per head the query then a gate of ``v_head_dim`` that multiplies the head's
#: output elementwise, which leaves V/O only diagonal scalings: V/O is not quotiented).
QUERY_CHILDREN = ("q_b_proj", "q_proj", "q_gate_proj")
#: The note on every MLA module with both pairs.
LATENT_NOTE = (
    "multi-head latent attention: the non-rotary query/key dimensions and the values are "
    "quotiented per head; the rotary dimensions (rows of the query projection against one "
    "rotary key shared by all heads) are left to the adaptive geometry"
)
#: The note on MLA whose query projection also gates the output.
GATED_LATENT_NOTE = (
    "multi-head latent attention whose query projection also gates each head's output "
    "elementwise (q_gate_proj): the non-rotary query/key dimensions are quotiented per "
    "head; V/O keeps only diagonal scalings (not quotiented) and the rotary dimensions "
    "(against one rotary key shared by all heads) are left to the adaptive geometry"
)
#: What a failed replay of an MLA pair means.
LATENT_BREAKS = (
    "the module does not split its heads as multi-head latent attention does (non-rotary "
    "dimensions first in each query head, k_nope then the value in each kv_b_proj head), "
    "or it acts on them between the projections and the scores"
)


def _entries(path: str, linear: torch.nn.Linear) -> Dict[str, torch.Size]:
    out = {child_path(path, "weight"): linear.weight.shape}
    if linear.bias is not None:
        out[child_path(path, "bias")] = linear.bias.shape
    return out


def _head_slice(weight, bias, heads: int, per_head: int, start: int, size: int) -> torch.Tensor:
    """Rows ``start:start+size`` of each head of an ``(heads*per_head, in)`` projection,
    as ``(heads, in [+1], size)``."""
    rows = weight.reshape(heads, per_head, -1)[:, start : start + size].mT
    if bias is None:
        return rows
    b = bias.reshape(heads, per_head)[:, start : start + size].reshape(heads, 1, size)
    return torch.cat((rows, b), dim=-2)


def _latent_specs(path: str, module: torch.nn.Module) -> Optional[list]:
    """The Q/K and V/O pairs of one MLA module, or ``None`` if it is not one."""
    sizes = [module_attribute(module, a) for a in LATENT_ATTRS]
    if not all(isinstance(s, int) and s > 0 for s in sizes):
        return None
    heads, nope, rope, v_dim = sizes
    q_name = next((n for n in QUERY_CHILDREN if linear_child(module, n) is not None), "q_proj")
    gated = q_name == "q_gate_proj"  # per head: the query, then a gate of the output
    q, kv, o = (linear_child(module, n) for n in (q_name, "kv_b_proj", "o_proj"))
    if q is None or kv is None or o is None or linear_child(module, "kv_a_proj_with_mqa") is None:
        return None
    per_head = nope + rope + (v_dim if gated else 0)
    if (
        q.out_features != heads * per_head
        or kv.out_features != heads * (nope + v_dim)
        or o.in_features != heads * v_dim
    ):
        return None
    q_bias, kv_bias = q.bias is not None, kv.bias is not None
    q_path, kv_path = child_path(path, q_name), child_path(path, "kv_b_proj")

    def qk_layout(*t):
        kv_t = t[1 + q_bias :]
        g = _head_slice(t[0], t[1] if q_bias else None, heads, per_head, 0, nope)
        h = _head_slice(kv_t[0], kv_t[1] if kv_bias else None, heads, nope + v_dim, 0, nope)
        return torch.cat((g, h), dim=-2)

    def vo_layout(*t):
        g = _head_slice(t[0], t[1] if kv_bias else None, heads, nope + v_dim, nope, v_dim)
        return torch.cat((g, head_columns(t[-1], heads, v_dim)), dim=-2)

    qk = PairSpec(
        "query-key", path, {**_entries(q_path, q), **_entries(kv_path, kv)}, qk_layout,
        q.in_features + q_bias, kv.in_features + kv_bias, nope, heads,
    )  # fmt: skip
    vo_params = {**_entries(kv_path, kv), child_path(path, "o_proj.weight"): o.weight.shape}
    vo = PairSpec(
        "value-output", path, vo_params, vo_layout, kv.in_features + kv_bias,
        o.out_features, v_dim, heads,
    )  # fmt: skip
    return [qk] if gated else [qk, vo]


def latent_attention_pairs(model: torch.nn.Module) -> Findings:
    """The query-key and value-output pairs of every multi-head latent attention module.

    Recognised by structure: a module with ``num_heads``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim`` and ``v_head_dim``, ``nn.Linear`` children ``q_b_proj`` (or
    ``q_proj``, or ``q_gate_proj`` whose heads also hold an output gate: Q/K only),
    ``kv_a_proj_with_mqa``, ``kv_b_proj`` and ``o_proj`` whose shapes fit those sizes.

    Parameters
    ----------
    model : torch.nn.Module
        The model; only its module structure is read (and the modules are replayed on the
        recorded probe forward).

    Returns
    -------
    Findings
        Per module a query-key pair (``GL(qk_nope_head_dim)`` per head) and a
        value-output pair (``GL(v_head_dim)`` per head), each replayed on its module
        (:func:`~geoopt_quotient.symmetry.huggingface.check_locally`), and a note that
        the shared rotary key is left to the adaptive geometry.
    """
    found = Findings()
    for path, module in model.named_modules():
        specs = _latent_specs(path, module)
        if specs is None:
            continue
        found.add_replayed(specs, LATENT_BREAKS, claim=path)
        found.note(LATENT_NOTE if len(specs) == 2 else GATED_LATENT_NOTE, path)
    return check_locally(model, found)
