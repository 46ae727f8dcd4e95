r"""Q/K-normalised attention: the gains of ``q_norm`` and ``k_norm`` scaled against each other.

A per-head norm of the queries and keys (Gemma 3n/4, Doge, AFMoE, Qwen3-Next...),

.. math::

    \tilde q = R_t\,(\gamma \odot \hat q), \qquad \tilde k = R_{t'}\,(\delta \odot \hat k),
    \qquad \hat q = W_q^{(i)} x / \mathrm{rms}(W_q^{(i)} x),

leaves no continuous subgroup of Q/K's :math:`\mathrm{GL}(h)`: an action must keep each
head's RMS up to a factor and commute with the gains and the rotary rotations
:math:`R_t`, which leaves sign flips per rotary plane (a finite group). The symmetry that
remains acts on the gains: for a rotary plane :math:`p = \{a, b\}` and any
:math:`s \ne 0`, scaling :math:`\gamma_a, \gamma_b` by :math:`s` and :math:`\delta_a,
\delta_b` by :math:`1/s` multiplies the plane's part of :math:`\tilde q` by :math:`s` and
of :math:`\tilde k` by :math:`1/s`; the rotation acts on the plane as a complex number
and commutes with the scalar, so every score :math:`\tilde q^\top \tilde k` keeps its
value. Both entries of a plane take the same scale (a different scale per entry does
not commute with the rotation); dimensions no rotation touches scale one by one. The
gains are shared by the heads, so one scale per plane acts on every head at once.

Per unit (a rotary plane, or a dimension outside the rotary part) this is a rank-one
:class:`~geoopt_quotient.GLQuotient` pair: :math:`G` = the unit's entries of
``q_norm``'s gain as a column (with those of the layers that reuse this layer's keys,
Gemma 3n's shared key/value layers, stacked below) and :math:`H` = the same entries of
``k_norm``'s gain. Kind ``"query-key"``, label ``"q/k-norm gain scaling"``: it is the
continuous symmetry of Q/K that survives the norms.

Only norms that multiply by their gain, :math:`\mathrm{norm}(x; \gamma) = \gamma \odot
f(x)`, or :math:`\gamma \odot f(x) + \beta` with the bias scaled alike, are claimed
(checked numerically on the norm module): a norm with :math:`(1 + \gamma)` (Qwen3-Next's
zero-centred gains) makes the scaling an affine map of the parameters, which is not a
linear group action on them, and is noted instead.
Where V/O's full :math:`\mathrm{GL}(h)` is quotiented the gains are left as they are.
The rotary planes are read by probing the model's rotary function
(:func:`~geoopt_quotient.symmetry.probe.rotary_planes`); every pair is replayed on its
module and proven on the model with the rest of the plan.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.func import functional_call

from .huggingface import Findings, check_locally, module_attribute
from .layouts import PairSpec, child_path
from .output_gate import AttentionProjections, attention_projections
from .probe import ForwardRecord, local_tolerance, recorded_forward, rotary_planes

__all__ = ["gain_names", "gain_pairs", "key_sharers", "multiplies_by_gain", "norm_gain_pairs"]

#: (query norm, key norm) children of q/k-normalised attention.
NORM_PAIRS = (
    ("q_norm", "k_norm"),
    ("query_layernorm", "key_layernorm"),
    ("q_layernorm", "k_layernorm"),
    ("query_norm", "key_norm"),
)
#: The label of the gain scaling (in the group's name).
GAIN_SCALING = "q/k-norm gain scaling"
#: Part of the note of :mod:`~geoopt_quotient.symmetry.huggingface` a gain group replaces.
REPLACED_NOTE = "Q/K normalised or acted on ("
#: The note on each module whose gains are quotiented.
GAIN_NOTE = (
    "Q/K normalised ({q}, {k}): Q/K's GL(h) does not survive the norms (an action must "
    "keep each head's RMS and commute with the gains{rotations}, which leaves sign flips, "
    "a finite group); the continuous symmetry that remains, {q}'s gain scaled by s and "
    "{k}'s by 1/s per {unit} (shared by the heads{sharers}), is quotiented as "
    "query-key: q/k-norm gain scaling (GL(1) per {unit})"
)
#: The note where the norms do not multiply by their gains.
AFFINE_NOTE = (
    "Q/K normalised ({q}, {k}) with gains that do not simply multiply (a (1 + weight) "
    "gain): scaling the gains by s and 1/s is an affine map of the parameters, "
    "not a linear group action on them, and is not claimed; Q/K's GL(h) does not survive "
    "the norms: Q/K left to the adaptive geometry"
)
#: What it means when a gain scaling moves the module's output.
GAINS_BREAK = (
    "the normalised queries or keys meet something besides the rotary rotation and the "
    "scores (a per-dimension position bias, a rotation read wrongly), so scaling the "
    "gains of a unit against each other is not a symmetry"
)


def _gain(norm: object, size: int) -> Optional[torch.nn.Parameter]:
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.nn.Parameter) and weight.dim() == 1 and weight.numel() == size:
        return weight
    return None


def gain_names(norm: torch.nn.Module, size: int) -> Tuple[str, ...]:
    r"""The norm's per-dimension parameters the scaling acts on: ``weight``, and ``bias``
    where the norm has one of the same size (the output :math:`\gamma \odot f(x) + \beta`
    is linear in the pair)."""
    bias = getattr(norm, "bias", None)
    with_bias = isinstance(bias, torch.nn.Parameter) and bias.shape == torch.Size((size,))
    return ("weight", "bias") if with_bias else ("weight",)


def multiplies_by_gain(norm: torch.nn.Module, size: int) -> bool:
    r"""Whether ``norm`` computes :math:`\gamma \odot f(x)` of its gain ``weight``.

    Checked on random inputs: with gains :math:`r` and :math:`r \odot d` (random, of
    either sign; a bias of the same size, if any, drawn and scaled alike: see
    :func:`gain_names`) the outputs must differ by the factor :math:`d` entry by entry,
    within the local tolerance of the norm's precision. A :math:`(1 + \gamma)` gain fails.

    Parameters
    ----------
    norm : torch.nn.Module
        The norm (its ``weight`` of ``size`` entries is replaced, not changed).
    size : int
        The normalised size (the head size).

    Returns
    -------
    bool
        ``True`` if the output is the gain times a function of the input.
    """
    weight = _gain(norm, size)
    if weight is None:
        return False
    generator = torch.Generator().manual_seed(0)

    def draw(*shape, signed=False):
        values = 4.0 ** (2 * torch.rand(shape, generator=generator, dtype=torch.float64) - 1)
        if signed:
            values = values * torch.where(torch.rand(shape, generator=generator) < 0.5, -1, 1)
        return values.to(weight.device, weight.dtype)

    x = torch.randn(3, 2, size, generator=generator, dtype=torch.float64)
    x = x.to(weight.device, weight.dtype)
    names, d = gain_names(norm, size), draw(size, signed=True)
    values = {n: draw(size, signed=True) for n in names}
    try:
        with torch.no_grad():
            a = functional_call(norm, values, (x,), strict=False)
            b = functional_call(norm, {n: v * d for n, v in values.items()}, (x,), strict=False)
    except Exception:
        return False
    scale = (a * d).abs().max().clamp_min(torch.finfo(a.dtype).tiny)
    return bool((b - a * d).abs().max() <= local_tolerance(a.dtype) * scale)


def _norms(module: torch.nn.Module, size: int) -> Optional[Tuple[str, str]]:
    """The (query norm, key norm) child names of ``module`` with gains of ``size``."""
    for q_name, k_name in NORM_PAIRS:
        if _gain(module_attribute(module, q_name), size) is not None:
            if _gain(module_attribute(module, k_name), size) is not None:
                return q_name, k_name
    return None


def _is_module(value: object) -> bool:
    return isinstance(value, torch.nn.Module)


def _query_norm_only(module: torch.nn.Module) -> Optional[str]:
    """The query norm of a module with queries but no keys of its own (it reuses the
    keys of an earlier layer: Gemma 3n's shared key/value layers), or ``None``."""
    for q_name, k_name in NORM_PAIRS:
        if _is_module(module_attribute(module, q_name)):
            keyless = not hasattr(module, k_name) and not hasattr(module, "k_proj")
            return (
                q_name
                if keyless and isinstance(getattr(module, "q_proj", None), torch.nn.Linear)
                else None
            )
    return None


def key_sharers(model: torch.nn.Module) -> Dict[str, List[str]]:
    """For each attention module with a key norm, the query-norm gains (full parameter
    names) of the later modules that reuse its keys: a module with a query norm but no
    keys reuses those of the last earlier module with keys and the same ``layer_type``
    (the proof on the model decides whether that reading holds)."""
    last: Dict[object, str] = {}
    sharers: Dict[str, List[str]] = {}
    for path, module in model.named_modules():
        if any(_is_module(module_attribute(module, k)) for _, k in NORM_PAIRS):
            if any(_is_module(module_attribute(module, q)) for q, _ in NORM_PAIRS):
                last[getattr(module, "layer_type", None)] = path
            continue
        q_name = _query_norm_only(module)
        source = last.get(getattr(module, "layer_type", None))
        if q_name is not None and source is not None:
            norm, size = getattr(module, q_name), getattr(module, q_name).weight.numel()
            gains = [child_path(child_path(path, q_name), n) for n in gain_names(norm, size)]
            sharers.setdefault(source, []).extend(gains)
    return sharers


def _normed_heads(projections: AttentionProjections, which: int, norm: torch.nn.Module):
    """A reader of the module's normalised queries (``which=0``) or keys (1) per head, from
    the recorded output of its projection (each head's first ``head_dim`` rows: a query
    projection that packs a gate after each head's queries is read alike)."""
    path = child_path(projections.path, projections.names[which])
    heads = projections.heads if which == 0 else projections.kv_heads
    hd = projections.head_dim

    def read(record: ForwardRecord) -> Optional[torch.Tensor]:
        out = record.linear_outputs.get(path)
        if out is None or out.shape[-1] % heads:
            return None
        with torch.no_grad():
            return norm(out.reshape(*out.shape[:-1], heads, -1)[..., :hd])

    return read


def gain_pairs(
    projections: AttentionProjections,
    norms: Tuple[str, str],
    units: Sequence[Sequence[int]],
    sharers: Sequence[str] = (),
) -> PairSpec:
    """The rank-one pairs of the gains of ``norms`` over ``units`` (each a rotary plane's
    two dimensions, or one dimension): :math:`G` = the unit's entries of the query norm's
    gain and bias, if any (then of each of ``sharers``' gains), :math:`H` = those of the
    key norm's.

    Parameters
    ----------
    projections : AttentionProjections
        The module.
    norms : tuple of str
        Its (query norm, key norm) child names.
    units : sequence of sequence of int
        The dimensions of each unit, all units of one size.
    sharers : sequence of str
        Query-norm gains (full names) of modules that reuse this module's keys.

    Returns
    -------
    PairSpec
        Kind ``"query-key"``, label :data:`GAIN_SCALING`, ``head_dim = 1``.
    """
    hd, width, count = projections.head_dim, len(units[0]), len(units)
    index = torch.tensor([list(u) for u in units], dtype=torch.long)
    q_gains, k_gains = (
        [
            child_path(child_path(projections.path, n), g)
            for g in gain_names(getattr(projections.module, n), hd)
        ]
        for n in norms
    )
    params = {name: torch.Size((hd,)) for name in (*q_gains, *sharers, *k_gains)}

    def layout(*gains):
        return torch.cat([g[index].reshape(count, width, 1) for g in gains], dim=-2)

    n, m = width * (len(q_gains) + len(sharers)), width * len(k_gains)
    return PairSpec(
        "query-key", projections.path, params, layout, n, m, 1, count, label=GAIN_SCALING
    )


def _gain_units(
    projections: AttentionProjections, norms: Tuple[str, str], record: ForwardRecord
) -> Tuple[Optional[List[List[List[int]]]], str]:
    """The units of the gains (rotary planes, then the other dimensions one by one, as
    lists of equal-sized units), or ``(None, reason)``."""
    module = projections.module
    readers = (
        _normed_heads(projections, 0, getattr(module, norms[0])),
        _normed_heads(projections, 1, getattr(module, norms[1])),
    )
    reading = rotary_planes(record, projections.path, *readers)
    if reading.reason:
        return None, reading.reason
    planes = [list(p) for p in reading.planes] if reading.found else []
    in_planes = {d for p in planes for d in p}
    fixed = [[d] for d in range(projections.head_dim) if d not in in_planes]
    return [u for u in (planes, fixed) if u], ""


def norm_gain_pairs(model: torch.nn.Module, found: Findings) -> None:
    """Add the q/k-norm gain scalings of every q/k-normalised attention module whose V/O
    is not quotiented by all of GL(h) to ``found`` (see the module docstring).

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    found : Findings
        What the other detectors found; extended in place, its notes on Q/K of the
        modules handled here replaced.
    """
    skip = {
        s.module
        for s in found.specs
        if s.kind == "query-key" or (s.kind == "value-output" and not s.label)
    }
    record, _ = recorded_forward(model)
    sharers: Optional[Dict[str, List[str]]] = None  # read once a module has q/k norms
    mine, notes = Findings(), {}
    for path, module in model.named_modules():
        projections = None if path in skip else attention_projections(path, module)
        norms = None if projections is None else _norms(module, projections.head_dim)
        if norms is None or record is None:
            continue
        q_norm, k_norm = (getattr(module, n) for n in norms)
        if not all(multiplies_by_gain(n, projections.head_dim) for n in (q_norm, k_norm)):
            found.retract(path, REPLACED_NOTE)
            mine.note(AFFINE_NOTE.format(q=norms[0], k=norms[1]), path)
            continue
        units, _ = _gain_units(projections, norms, record)
        sharers = key_sharers(model) if sharers is None else sharers
        for unit_set in units or []:
            spec = gain_pairs(projections, norms, unit_set, sharers.get(path, ()))
            mine.add_replayed([spec], GAINS_BREAK)
        if units:
            notes[path] = _gain_note(norms, units, sharers.get(path, ()))
    check_locally(model, mine)
    for path in dict.fromkeys(s.module for s in mine.specs):  # in the model's order
        found.retract(path, REPLACED_NOTE)
        mine.note(notes[path], path)
    found.extend(mine)


def _gain_note(norms: Tuple[str, str], units: List[List[List[int]]], sharers: Sequence[str]) -> str:
    rotary = any(len(u[0]) == 2 for u in units)
    plain = any(len(u[0]) == 1 for u in units)
    unit = " and ".join(
        w
        for w, keep in (
            ("rotary plane", rotary),
            ("dimension outside them" if rotary else "dimension", plain),
        )
        if keep
    )
    shared = f", and by the layers reusing its keys: {', '.join(sharers)}" if sharers else ""
    return GAIN_NOTE.format(
        q=norms[0],
        k=norms[1],
        rotations=" and the rotary rotations" if rotary else "",
        unit=unit,
        sharers=shared,
    )
