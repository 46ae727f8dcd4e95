r"""MLPs: one :math:`\mathrm{GL}(1)` pair per hidden unit (an opt-in kind, ``"mlp"``).

A gated MLP computes :math:`\mathrm{down}(\mathrm{act}(\mathrm{gate}(x)) \odot
\mathrm{up}(x))` (SwiGLU, GeGLU: Llama, Mistral, Qwen, Gemma, OLMo, Phi-3's fused
``gate_up_proj``). Scaling row :math:`i` of ``up`` (and its bias) by :math:`a^{-1}` and
column :math:`i` of ``down`` by :math:`a`, for any :math:`a \ne 0`, leaves it unchanged:
per unit, :math:`G` = that row as a column (with the bias appended) and :math:`H` = that
column of ``down`` are an ordinary :class:`~geoopt_quotient.GLQuotient` pair of rank 1.
The gate is untouched (the activation is not homogeneous). A ReLU MLP
:math:`\mathrm{out}(\mathrm{relu}(\mathrm{in}(x)))` has the same pairs for positive
:math:`a` only (:class:`~geoopt_quotient.PositiveScalingQuotient`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .huggingface import Findings, check_locally
from .layouts import PairSpec, child_path, linear_child

__all__ = ["gated_mlp_pairs"]

#: (gate, up, down) children of gated MLPs with separate projections (Llama-style, T5's
#: gated variant).
GATED = (("gate_proj", "up_proj", "down_proj"), ("wi_0", "wi_1", "wo"))
#: (fused gate and up, down): the first half of the fused rows is the gate, the second up.
FUSED = ("gate_up_proj", "down_proj")
#: (in, out) children of plain MLPs ``out(act(in(x)))`` (OPT, T5, GPT-NeoX, Falcon, Phi...)
PLAIN = (("fc1", "fc2"), ("wi", "wo"), ("dense_h_to_4h", "dense_4h_to_h"))
ACTIVATION_ATTRS = ("act_fn", "activation_fn", "act", "activation")
#: What it means when a unit's scaling of ``up`` against ``down`` moves the MLP's output.
BETWEEN_FACTORS = (
    "something sits between the product act(gate) * up and down (a norm of the hidden "
    "units) or adds to up (an adapter), so scaling a unit's up row against its down column "
    "is not a symmetry"
)


def _activation(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    return next(
        (a for n in ACTIVATION_ATTRS if isinstance(a := getattr(module, n, None), torch.nn.Module)),
        None,
    )


def _up_and_down(module: torch.nn.Module):
    """``(up name, up, row offset, down name, down, positive)`` of an MLP, or ``None``: a
    gated MLP (any nonzero scaling) or a ReLU MLP (positive scalings only)."""
    for gate_name, up_name, down_name in GATED:
        gate, up, down = (linear_child(module, n) for n in (gate_name, up_name, down_name))
        if gate is not None and up is not None and down is not None:
            units = down.in_features
            if gate.out_features == units == up.out_features:
                return up_name, up, 0, down_name, down, False
            return None
    fused, down = linear_child(module, FUSED[0]), linear_child(module, FUSED[1])
    if fused is not None and down is not None:
        units = down.in_features
        return (
            (FUSED[0], fused, units, FUSED[1], down, False)
            if fused.out_features == 2 * units
            else None
        )
    for up_name, down_name in PLAIN:
        up, down = linear_child(module, up_name), linear_child(module, down_name)
        if up is not None and down is not None and up.out_features == down.in_features:
            if isinstance(_activation(module), torch.nn.ReLU):
                return up_name, up, 0, down_name, down, True
            return None
    return None


def _mlp(path: str, module: torch.nn.Module) -> Optional[PairSpec]:
    """The pair of one module, if it is a Hugging Face gated or ReLU MLP."""
    if not type(module).__module__.startswith("transformers."):
        return None  # the forward conventions below are Hugging Face's
    if _activation(module) is None:
        return None
    found = _up_and_down(module)
    if found is None:
        return None
    up_name, up, start, down_name, down, positive = found
    units = down.in_features
    up_path = child_path(path, up_name)
    params = {child_path(up_path, "weight"): up.weight.shape}
    if up.bias is not None:
        params[child_path(up_path, "bias")] = up.bias.shape
    params[child_path(path, f"{down_name}.weight")] = down.weight.shape

    def layout(weight, *rest):
        g = weight[start : start + units].reshape(units, -1, 1)
        if len(rest) == 2:
            g = torch.cat((g, rest[0][start : start + units].reshape(units, 1, 1)), dim=-2)
        h = rest[-1].mT.reshape(units, -1, 1)
        return torch.cat((g, h), dim=-2)

    n = up.in_features + int(up.bias is not None)
    return PairSpec("mlp", path, params, layout, n, down.out_features, 1, units, positive=positive)


def gated_mlp_pairs(model: torch.nn.Module) -> Findings:
    """The per-unit pairs of every gated or ReLU MLP of ``model``.

    Hugging Face modules with an activation and ``gate_proj``/``up_proj``/``down_proj``,
    ``wi_0``/``wi_1``/``wo`` or ``gate_up_proj``/``down_proj`` (gated: any nonzero
    scaling), or ``fc1``/``fc2``, ``wi``/``wo``, ``dense_h_to_4h``/``dense_4h_to_h``
    with a ReLU (positive scalings: :class:`~geoopt_quotient.PositiveScalingQuotient`).

    Parameters
    ----------
    model : torch.nn.Module
        The model; only its module structure is read.

    Returns
    -------
    Findings
        One :class:`~geoopt_quotient.symmetry.PairSpec` of kind ``"mlp"`` per MLP, with
        ``head_dim = 1`` and one pair per hidden unit (``positive=True`` for ReLU). Each
        MLP is replayed with a random scaling of its units
        (:func:`~geoopt_quotient.symmetry.huggingface.check_locally`): one whose output
        moves (a norm between the product and ``down``, an adapter added to ``up``) is
        dropped with a note.
    """
    found = Findings()
    for path, module in model.named_modules():
        spec = _mlp(path, module)
        if spec is not None:
            found.add_replayed([spec], BETWEEN_FACTORS, claim=path)
    return check_locally(model, found)
