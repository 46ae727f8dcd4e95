r"""Mixture of attention heads (JetMoE's MoA): the query and output projections are experts.

Each token is routed to ``top_k`` of ``E`` experts; expert :math:`e` projects the queries
of ``kv_heads`` heads with ``experts.input_linear.weight[e]`` (``(kv_heads * h, in)``) and
maps the attention output of those heads back with ``experts.output_linear.weight[e]``
(``(out, kv_heads * h)``), while one ``kv_proj`` gives the keys and values
(``chunk(2)``: all key rows, then all value rows). The forward repeats the key/value
heads ``top_k`` times (``repeat``, not interleaved), so head :math:`j` of whichever expert a
token is routed to attends with key/value head :math:`j`. Per key/value head :math:`j`:

* query-key: :math:`A_j` on head :math:`j`'s query rows of *every* expert and
  :math:`A_j^{-\top}` on its key rows (the experts' rows stacked in :math:`G`, like the
  query heads of grouped-query attention), under the rotary embedding's subgroup;
* value-output: :math:`B_j` on its value rows and :math:`B_j^{-1}` on head :math:`j`'s
  columns of every expert's output projection (stacked in :math:`H`).

The routing, its gates and the output bias see neither. The pairs are replayed on their
module before they are kept and proven with the plan.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .huggingface import Findings, check_locally, module_attribute, rotary_geometry
from .layouts import PairSpec, child_path

__all__ = ["mixture_of_attention_pairs"]

#: What a failed replay of a mixture-of-attention pair means.
MOA_BREAKS = (
    "the module does not pair head j of each expert with key/value head j, or acts on the "
    "queries, keys or values between the projections and the attention"
)


def _expert_weight(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    weight = getattr(getattr(module, name, None), "weight", None)
    return weight if isinstance(weight, torch.nn.Parameter) and weight.dim() == 3 else None


def _moa_specs(path: str, module: torch.nn.Module) -> Optional[List[PairSpec]]:
    """The Q/K and V/O pairs of one mixture-of-attention module, or ``None``."""
    experts, kv = module_attribute(module, "experts"), module_attribute(module, "kv_proj")
    if not isinstance(experts, torch.nn.Module) or not isinstance(kv, torch.nn.Linear):
        return None
    w_in, w_out = _expert_weight(experts, "input_linear"), _expert_weight(experts, "output_linear")
    kv_heads, hd = getattr(module, "num_key_value_heads", None), getattr(module, "head_dim", None)
    if w_in is None or w_out is None or not all(isinstance(v, int) for v in (kv_heads, hd)):
        return None
    n_exp, rows, width = w_in.shape
    if rows != kv_heads * hd or kv.out_features != 2 * rows or w_out.shape[2] != rows:
        return None
    if kv.bias is not None or min(width, w_out.shape[1]) < hd:
        return None  # (heads wider than the model: the factors cannot have full rank)
    rotary = rotary_geometry(module, getattr(module, "config", None), hd)[0] or (0, "half")
    q_name = child_path(path, "experts.input_linear.weight")
    o_name = child_path(path, "experts.output_linear.weight")
    kv_name = child_path(path, "kv_proj.weight")

    def qk_layout(q, k):
        # (kv_heads, experts * in, hd): head j of every expert, stacked
        g = q.reshape(n_exp, kv_heads, hd, width).permute(1, 0, 3, 2).reshape(kv_heads, -1, hd)
        h = k[:rows].reshape(kv_heads, hd, width).mT
        return torch.cat((g, h), dim=-2)

    def vo_layout(k, o):
        g = k[rows:].reshape(kv_heads, hd, width).mT
        out = o.shape[1]
        h = o.reshape(n_exp, out, kv_heads, hd).permute(2, 0, 1, 3).reshape(kv_heads, -1, hd)
        return torch.cat((g, h), dim=-2)

    qk = PairSpec(
        "query-key", path, {q_name: w_in.shape, kv_name: kv.weight.shape}, qk_layout,
        n_exp * width, width, hd, kv_heads, rotary[0], rotary[1],
    )  # fmt: skip
    vo = PairSpec(
        "value-output", path, {kv_name: kv.weight.shape, o_name: w_out.shape}, vo_layout,
        width, n_exp * w_out.shape[1], hd, kv_heads,
    )  # fmt: skip
    return [qk, vo]


def mixture_of_attention_pairs(model: torch.nn.Module) -> Findings:
    """The query-key and value-output pairs of every mixture-of-attention-heads module.

    Recognised by structure: a module with ``num_key_value_heads`` and ``head_dim``, an
    ``experts`` child whose ``input_linear`` and ``output_linear`` hold 3-D weights
    ``(experts, kv_heads * head_dim, in)`` and ``(experts, out, kv_heads * head_dim)``, and
    a ``kv_proj`` ``nn.Linear`` with the key rows then the value rows. The rotary
    geometry of Q/K is read from the module's config and modelling module
    (:func:`~geoopt_quotient.symmetry.rotary_geometry`) and checked by replaying the module.

    Parameters
    ----------
    model : torch.nn.Module
        The model; only its module structure is read (and the modules are replayed on
        the recorded probe forward).

    Returns
    -------
    Findings
        Per module one query-key and one value-output pair per key/value head.
    """
    found = Findings()
    for path, module in model.named_modules():
        specs = _moa_specs(path, module)
        if specs is None:
            continue
        found.add_replayed(specs, MOA_BREAKS, claim=path)
    return check_locally(model, found)
