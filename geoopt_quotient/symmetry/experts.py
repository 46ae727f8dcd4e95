r"""Mixture-of-experts MLPs stored as fused 3-D tensors: one :math:`\mathrm{GL}(1)` pair per
unit of each expert (kind ``"mlp"``, like the dense gated MLPs of
:mod:`~geoopt_quotient.symmetry.mlp`).

Hugging Face stores the routed experts of Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE,
GLM-4-MoE... as two parameters of one module: ``gate_up_proj`` of shape
``(experts, 2 * units, hidden)`` and ``down_proj`` of shape ``(experts, hidden, units)``
(``nn.Linear`` layout per expert), or their transposes ``(experts, hidden, 2 * units)`` and
``(experts, units, hidden)`` (GPT-OSS, Aria, Llama 4: ``x @ W``); the shapes tell which
(both fit only for ``units = 0``). Expert :math:`e` computes

.. math::

    y = \mathrm{down}_e\, \mathrm{gate}\bigl(\mathrm{gate\_up}_e\, x\bigr),

where :math:`\mathrm{gate}` maps the ``2 * units`` outputs to ``units``. If
:math:`\mathrm{gate}` is homogeneous of degree one in one output per unit (the "up" half:
:math:`\mathrm{act}(g_i)\, u_i`), scaling that row of ``gate_up`` (and its bias) by
:math:`a^{-1}` and column :math:`i` of :math:`\mathrm{down}_e` by :math:`a` leaves the expert
unchanged: per expert and unit, :math:`G` = the up row and :math:`H` = the down column are
a :class:`~geoopt_quotient.GLQuotient` pair of rank one, and all ``experts * units`` pairs
of a module are one stacked point (no new geometry: the layout slices the 3-D weights).

Which outputs are the up half (the second half, ``chunk(2)``, or the odd columns of an
interleaved layout) is read numerically from the module's own gating function
(``_apply_gate``, or ``act_fn(gate) * up`` of the ``chunk(2)`` forward for modules without
one), on values spanning six orders of magnitude: a clamp of the up half (DeepSeek-V4,
Hunyuan-V4) or a gated output :math:`(u + 1)\,\mathrm{glu}(g)` (GPT-OSS, MiniMax-M3)
is homogeneous in no output, so no per-unit scaling survives and the experts are left to
the adaptive geometry with a note. Experts with a separate 3-D ``gate_proj`` and
``up_proj`` (Inkling's shared experts) are read the same way, the up rows being all of
``up_proj``'s. Experts without a gate (``up_proj``, ``down_proj``) get
positive scalings where the activation is positively homogeneous of degree one (ReLU; not
ReLU², whose square needs :math:`a^2` on the down column).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from .huggingface import Findings, check_locally
from .layouts import PairSpec, child_path

__all__ = ["expert_pairs", "up_columns"]

#: Float64 epsilons (of the largest output) within which a gating function counts as
#: homogeneous in a column: rounding of a product of two factors, with headroom.
HOMOGENEITY_EPS = 64
#: What it means when an expert's unit scaling moves the module's output on the replay.
EXPERT_BREAKS = (
    "the experts' forward does something to the up half or between the gated product and "
    "the down projection that the gating function alone does not show, so scaling a unit's "
    "up row against its down column is not a symmetry"
)


def _gating(module: torch.nn.Module, gated: bool) -> Optional[Callable]:
    """The function from the up projection's outputs to the units: ``_apply_gate``, else
    ``act_fn(gate) * up`` of ``chunk(2)`` (gated) or ``act_fn`` (not gated)."""
    act = getattr(module, "act_fn", None)
    if not gated:
        return act if callable(act) else None
    apply_gate = getattr(module, "_apply_gate", None)
    if callable(apply_gate):
        return apply_gate
    if not callable(act):
        return None

    def chunked(z: torch.Tensor) -> torch.Tensor:
        gate, up = z.chunk(2, dim=-1)
        return act(gate) * up

    return chunked


def _homogeneous_in(
    gating: Callable, columns: slice, width: int, positive: bool, generator
) -> bool:
    """Whether ``gating(z)[:, i]`` scales by ``a_i`` when column ``columns[i]`` of ``z``
    does, for values of ``z`` over six orders of magnitude."""
    units = len(range(width)[columns])
    magnitude = 10.0 ** (6 * torch.rand(64, width, generator=generator, dtype=torch.float64) - 3)
    z = torch.randn(64, width, generator=generator, dtype=torch.float64) * magnitude
    a = 0.25 + 3.75 * torch.rand(units, generator=generator, dtype=torch.float64)
    if not positive:
        a = a * torch.where(torch.rand(units, generator=generator) < 0.5, -1.0, 1.0).double()
    scaled = z.clone()
    scaled[:, columns] = z[:, columns] * a
    try:
        with torch.no_grad():
            before, after = gating(z), gating(scaled)
    except Exception:
        return False
    if not isinstance(before, torch.Tensor) or before.shape != (64, units):
        return False
    scale = float(before.abs().max()) * float(a.abs().max())
    error = float((after - before * a).abs().max())
    # a homogeneous gate differs only by rounding (a few float64 epsilons of the largest
    # value); a clamp or an offset differs by order one
    tolerance = HOMOGENEITY_EPS * torch.finfo(torch.float64).eps * scale
    return bool(torch.isfinite(after).all()) and error <= max(tolerance, torch.finfo().tiny)


def up_columns(
    module: torch.nn.Module, units: int, gated: bool = True
) -> Tuple[Optional[slice], bool, str]:
    """Which output of an experts module's up projection each unit is linear in.

    The candidates (the second half, the first half, the odd, the even columns of a gated
    layout; all columns of an ungated one) are tried on the module's gating function
    (:func:`_gating`) with random per-unit factors: nonzero for a gated layout, positive for
    an ungated one.

    Parameters
    ----------
    module : torch.nn.Module
        The experts module (its ``_apply_gate`` or ``act_fn`` is called on float64 values).
    units : int
        Units per expert.
    gated : bool
        Whether the up projection has ``2 * units`` outputs (gate and up).

    Returns
    -------
    tuple
        ``(columns, positive, reason)``: the columns of the units, as a slice (``None`` if
        no candidate holds), whether only positive factors act, and why not (empty when found).
    """
    gating = _gating(module, gated)
    if gating is None:
        return None, False, "no gating function or activation (act_fn) to read"
    generator = torch.Generator().manual_seed(0)
    if not gated:
        columns = slice(0, units)
        if _homogeneous_in(gating, columns, units, True, generator):
            return columns, True, ""
        return (
            None,
            True,
            (
                f"its activation ({type(gating).__name__}) is not positively homogeneous of "
                "degree one, so no scaling of a unit passes through it"
            ),
        )
    candidates = (slice(units, 2 * units), slice(0, units), slice(1, None, 2), slice(0, None, 2))
    for columns in candidates:
        if _homogeneous_in(gating, columns, 2 * units, False, generator):
            return columns, False, ""
    where = getattr(getattr(module, "_apply_gate", None), "__qualname__", "act_fn(gate) * up")
    return (
        None,
        False,
        (
            f"its gating ({where}) is homogeneous in neither half of gate_up (a clamp of the up "
            "half, an offset such as (up + 1) * glu(gate)), so no per-unit scaling survives it"
        ),
    )


def _separate_gate(module: torch.nn.Module, up: torch.Tensor) -> bool:
    """Whether ``module`` holds its gate as a separate 3-D ``gate_proj`` shaped like ``up``."""
    gate = getattr(module, "gate_proj", None)
    return isinstance(gate, torch.nn.Parameter) and gate.shape == up.shape


def _shapes(module: torch.nn.Module) -> Optional[Tuple[str, torch.Tensor, bool, int]]:
    """``(up name, up weight, transposed, units)`` of a 3-D experts module, or ``None``."""
    down = getattr(module, "down_proj", None)
    if not isinstance(down, torch.nn.Parameter) or down.dim() != 3:
        return None
    for name, factor in (("gate_up_proj", 2), ("up_proj", 1)):
        up = getattr(module, name, None)
        if not isinstance(up, torch.nn.Parameter) or up.dim() != 3:
            continue
        (_, a, b), (_, c, d) = up.shape, down.shape
        if a == factor * d and b == c:
            return name, up, False, d
        if b == factor * c and a == d:
            return name, up, True, c
    return None


def _settings(module: torch.nn.Module) -> Tuple:
    """What the gating of ``module`` can depend on besides its class: its scalar
    attributes (limits, ``alpha``...) and the class of its activation."""
    scalars = sorted(
        (k, v) for k, v in vars(module).items() if isinstance(v, (bool, int, float, str))
    )
    return (type(module), type(getattr(module, "act_fn", None)), tuple(scalars))


def _expert_spec(
    path: str, module: torch.nn.Module, read: Dict[Tuple, Tuple]
) -> Tuple[Optional[PairSpec], str]:
    """The pair of one 3-D experts module, or ``(None, why not)`` (empty: not experts);
    ``read`` caches :func:`up_columns` over modules of one class and settings."""
    found = _shapes(module)
    if found is None:
        return None, ""
    up_name, up, transposed, units = found
    down = module.down_proj
    separate = up_name == "up_proj" and _separate_gate(module, up)
    gated = up_name == "gate_up_proj" or separate
    key = (_settings(module), units, gated)
    if key not in read:
        read[key] = up_columns(module, units, gated)
    columns, positive, why = read[key]
    if columns is None:
        return None, why
    if separate:  # act_fn(gate) * up with up its own tensor: its rows are the units
        if columns != slice(units, 2 * units):
            return None, "its gating is not act_fn(gate_proj x) * (up_proj x)"
        columns = slice(0, units)
    experts = down.shape[0]  # routed experts (a gate_up may hold more: identity experts)
    hidden = up.shape[1] if transposed else up.shape[2]
    bias = getattr(module, f"{up_name}_bias", None)
    outputs = up.shape[2] if transposed else up.shape[1]
    has_bias = isinstance(bias, torch.nn.Parameter) and bias.shape == (up.shape[0], outputs)
    params = {child_path(path, up_name): up.shape}
    if has_bias:
        params[child_path(path, f"{up_name}_bias")] = bias.shape
    params[child_path(path, "down_proj")] = down.shape

    def layout(weight, *rest):
        # (experts, units, hidden): the up row of each unit
        rows = weight[:experts, :, columns].mT if transposed else weight[:experts, columns, :]
        g = rows.reshape(experts * units, -1, 1)
        if len(rest) == 2:
            g = torch.cat((g, rest[0][:experts, columns].reshape(experts * units, 1, 1)), -2)
        d = rest[-1] if transposed else rest[-1].mT  # (experts, units, out)
        return torch.cat((g, d.reshape(experts * units, -1, 1)), dim=-2)

    out = down.shape[2] if transposed else down.shape[1]
    n = hidden + int(has_bias)
    return PairSpec("mlp", path, params, layout, n, out, 1, experts * units, positive=positive), ""


def expert_pairs(model: torch.nn.Module) -> Findings:
    """The per-unit pairs of every mixture-of-experts module with fused 3-D weights.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its module structure is read, and each experts module's gating
        function is called on synthetic values (:func:`up_columns`).

    Returns
    -------
    Findings
        One :class:`~geoopt_quotient.symmetry.PairSpec` of kind ``"mlp"`` per experts
        module, with ``head_dim = 1`` and ``experts * units`` pairs; each is replayed on
        its module (:func:`~geoopt_quotient.symmetry.huggingface.check_locally`). Experts
        whose gating leaves no scaling get a note.
    """
    found, read = Findings(), {}
    for path, module in model.named_modules():
        spec, why = _expert_spec(path, module, read)
        if spec is not None:
            found.add_replayed([spec], EXPERT_BREAKS, claim=path)
        elif why:
            found.note(
                f"experts ({type(module).__name__}) left to the adaptive geometry: {why}", path
            )
    return check_locally(model, found)
