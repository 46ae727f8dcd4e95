r"""Gated MLPs: one :math:`\mathrm{GL}(1)` pair per hidden unit (an opt-in kind, ``"mlp"``).

A gated MLP computes :math:`\mathrm{down}(\mathrm{act}(\mathrm{gate}(x)) \odot
\mathrm{up}(x))` (SwiGLU, GeGLU: Llama, Mistral, Qwen, Gemma, OLMo, Phi-3's fused
``gate_up_proj``). Scaling row :math:`i` of ``up`` (and its bias) by :math:`a^{-1}` and
column :math:`i` of ``down`` by :math:`a`, for any :math:`a \ne 0`, leaves it unchanged:
per unit, :math:`G` = that row as a column (with the bias appended) and :math:`H` = that
column of ``down`` are an ordinary :class:`~geoopt_quotient.GLQuotient` pair of rank 1.
The gate is untouched (the activation is not homogeneous).
"""

from __future__ import annotations

from typing import Optional

import torch

from .huggingface import Findings, _linear, _prefixed
from .layouts import PairSpec

__all__ = ["gated_mlp_pairs"]

#: (gate, up, down) children of a gated MLP with separate projections.
SEPARATE = ("gate_proj", "up_proj", "down_proj")
#: (fused gate and up, down): the first half of the fused rows is the gate, the second up.
FUSED = ("gate_up_proj", "down_proj")
ACTIVATION_ATTRS = ("act_fn", "activation_fn")


def _gated_mlp(path: str, module: torch.nn.Module) -> Optional[PairSpec]:
    """The pair of one module, if it is a Hugging Face gated MLP."""
    if not type(module).__module__.startswith("transformers."):
        return None  # the forward convention below is Hugging Face's
    if not any(isinstance(getattr(module, n, None), torch.nn.Module) for n in ACTIVATION_ATTRS):
        return None
    down = _linear(module, "down_proj")
    if down is None:
        return None
    gate, up = _linear(module, "gate_proj"), _linear(module, "up_proj")
    units = down.in_features
    if gate is not None and up is not None:
        up_path, start = _prefixed(path, "up_proj"), 0
        if gate.out_features != units or up.out_features != units:
            return None
    else:
        up = _linear(module, "gate_up_proj")
        if up is None or up.out_features != 2 * units:
            return None
        up_path, start = _prefixed(path, "gate_up_proj"), units
    params = {_prefixed(up_path, "weight"): up.weight.shape}
    if up.bias is not None:
        params[_prefixed(up_path, "bias")] = up.bias.shape
    params[_prefixed(path, "down_proj.weight")] = down.weight.shape

    def layout(weight, *rest):
        g = weight[start : start + units].reshape(units, -1, 1)
        if len(rest) == 2:
            g = torch.cat((g, rest[0][start : start + units].reshape(units, 1, 1)), dim=-2)
        h = rest[-1].mT.reshape(units, -1, 1)
        return torch.cat((g, h), dim=-2)

    n = up.in_features + int(up.bias is not None)
    return PairSpec("mlp", path, params, layout, n, down.out_features, 1, units)


def gated_mlp_pairs(model: torch.nn.Module) -> Findings:
    """The per-unit pairs of every gated MLP of ``model`` (Hugging Face modules with
    ``gate_proj``/``up_proj``/``down_proj`` or ``gate_up_proj``/``down_proj`` and an
    activation).

    Parameters
    ----------
    model : torch.nn.Module
        The model; only its module structure is read.

    Returns
    -------
    Findings
        One :class:`~geoopt_quotient.symmetry.PairSpec` of kind ``"mlp"`` per MLP, with
        ``head_dim = 1`` and one pair per hidden unit.
    """
    found = Findings()
    for path, module in model.named_modules():
        spec = _gated_mlp(path, module)
        if spec is not None:
            found.specs.append(spec)
            found.claimed.add(path)
    return found
