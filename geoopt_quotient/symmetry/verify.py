"""Check a symmetry plan on a model: group elements must leave the outputs unchanged.

:func:`verify_plan` applies a random, well-conditioned element to one symmetric group at
a time (identity on the others), runs the model on probe inputs and compares every
floating-point output with the unperturbed run. A group that changes the outputs raises
:class:`SymmetryVerificationError`, naming the group and, for stacked groups, the first
member module that breaks. As a control, the same element applied to the group's first
factor only (``G A^{-1}`` with ``H`` untouched, which is not a symmetry) must change the
outputs clearly; when it does not, the check is reported as weak in the plan's notes.

The group elements and their action (solves, products) are computed in float64 for a
float64 model and in float32 otherwise; the transformed weights are cast back to the
model's dtype. A bfloat16 or float16 model is thus checked on the CPU too (which has no
half-precision solver), within a tolerance of a few of its dtype's machine epsilons.

Probe inputs: ``probe_inputs`` (a dict of keyword arguments, a tuple of positional
arguments or one tensor), or, for Hugging Face models, inputs built from the config
(:func:`probe_inputs_for`): ``input_ids`` from ``vocab_size``, ``pixel_values`` from
``num_channels``/``image_size``, ``decoder_input_ids`` for encoder-decoders, and
``use_cache=False``.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch.func import functional_call

from .._model_state import preserved_model_state
from ..manifolds import DiagonalQuotient, GLQuotient
from .plan import BoundPlan, PlanError, SymmetryGroup, SymmetryPlan

__all__ = ["SymmetryVerificationError", "probe_inputs_for", "verify_plan"]

#: Relative tolerance (of the largest output magnitude) per dtype. float64 allows for
#: models that compute softmax or norms in float32 internally (ViT, CLIP, T5, LLaMA).
RTOL = {torch.float64: 1e-5, torch.float32: 1e-4}
#: Tolerance of a half-precision model in units of its dtype's machine epsilon: every
#: transformed weight is rounded to the dtype (relative error up to eps/2), and so is
#: every activation of the forward pass, layer after layer.
HALF_RTOL_EPS = 8
#: Output keys that are not functions of the symmetry class (cached keys/values).
SKIPPED_OUTPUT_KEYS = ("past_key_values", "cache")


class SymmetryVerificationError(PlanError):
    """A group of a symmetry plan changes the model's outputs: it is not a symmetry."""


def _config_value(config: Any, names: Sequence[str]) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _sub_config(config: Any, name: str) -> Any:
    sub = getattr(config, name, None)
    return sub if sub is not None else config


def probe_inputs_for(
    model: torch.nn.Module,
    *,
    batch_size: int = 2,
    seq_len: int = 7,
    generator: Optional[torch.Generator] = None,
) -> Dict[str, Any]:
    """Keyword inputs for a Hugging Face model, built from its config.

    Random ``input_ids`` (with an ``attention_mask`` that pads the last sequence),
    ``decoder_input_ids`` for encoder-decoders and ``pixel_values`` for vision models,
    as the model's ``forward`` accepts them, on the model's device.

    Parameters
    ----------
    model : torch.nn.Module
        A Hugging Face model (or a PEFT model around one) with a ``config``.
    batch_size : int
        Number of probe sequences or images (default 2).
    seq_len : int
        Length of the token sequences, at most the model's maximum (default 7).
    generator : torch.Generator or None
        Generator of the random inputs; default a CPU generator seeded with 0.

    Returns
    -------
    dict
        Keyword arguments for ``model(**inputs)``.

    Raises
    ------
    PlanError
        If the model has no ``config`` or its ``forward`` needs inputs this function
        cannot build; pass ``probe_inputs=`` instead.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None:
        raise PlanError(
            f"cannot build probe inputs for {type(model).__name__}: it has no Hugging Face "
            "config; pass probe_inputs= (a dict of keyword arguments, a tuple or a tensor)"
        )
    try:
        signature = inspect.signature(base.forward).parameters
    except (TypeError, ValueError) as error:
        raise PlanError(f"cannot inspect {type(base).__name__}.forward: {error}") from error
    device = next((p.device for p in base.parameters()), torch.device("cpu"))
    dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
    gen = generator or torch.Generator().manual_seed(0)
    inputs: Dict[str, Any] = {}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = _config_value(text, ("vocab_size",))
    max_len = _config_value(text, ("max_position_embeddings", "n_positions", "max_length"))
    length = min(seq_len, int(max_len)) if isinstance(max_len, int) and max_len > 0 else seq_len
    if "input_ids" in signature and isinstance(vocab, int):
        inputs["input_ids"] = torch.randint(0, vocab, (batch_size, length), generator=gen)
        if "attention_mask" in signature:
            mask = torch.ones(batch_size, length, dtype=torch.long)
            mask[-1, length - 2 :] = 0  # one padded sequence: masks must not matter either
            inputs["attention_mask"] = mask
    if "decoder_input_ids" in signature and getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(
            0, vocab, (batch_size, max(2, length - 2)), generator=gen
        )
    if "pixel_values" in signature:
        vision = _sub_config(config, "vision_config")
        channels = _config_value(vision, ("num_channels",)) or 3
        size = _config_value(vision, ("image_size",))
        if size is not None:
            hw = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
            inputs["pixel_values"] = torch.randn(batch_size, channels, *hw, generator=gen)
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    if "use_cache" in signature:
        inputs["use_cache"] = False
    missing = [
        name
        for name, p in signature.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and name not in inputs
    ]
    data_keys = {"input_ids", "pixel_values", "decoder_input_ids"}
    if missing or not data_keys & set(inputs):
        needs = ", ".join(missing) if missing else "inputs this function does not know"
        raise PlanError(
            f"cannot build probe inputs for {type(base).__name__} (forward needs {needs}); "
            "pass probe_inputs= (a dict of keyword arguments, a tuple or a tensor)"
        )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _float_leaves(output: Any, key: str = "") -> List[torch.Tensor]:
    if any(s in key for s in SKIPPED_OUTPUT_KEYS):
        return []
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() or output.is_complex() else []
    if isinstance(output, Mapping):
        return [t for k, v in output.items() for t in _float_leaves(v, str(k))]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in _float_leaves(v, key)]
    return []


def _run(model: torch.nn.Module, params: Mapping[str, torch.Tensor], probe: Any) -> List[Any]:
    if isinstance(probe, Mapping):
        out = functional_call(model, dict(params), (), dict(probe), strict=False)
    elif isinstance(probe, tuple):
        out = functional_call(model, dict(params), probe, strict=False)
    else:
        out = functional_call(model, dict(params), (probe,), strict=False)
    leaves = _float_leaves(out)
    if not leaves:
        raise PlanError("the model's outputs on the probe inputs contain no floating tensor")
    return [t.detach().to(torch.float64) for t in leaves]


def _deviation(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))


def random_element(
    group: SymmetryGroup, generator: torch.Generator, dtype: torch.dtype, max_condition: float
) -> Optional[torch.Tensor]:
    """A random group element for ``group`` (``None`` if its manifold has no known action)."""
    lead = tuple(group.shape[:-2])
    own = getattr(group.manifold, "random_element", None)
    if own is not None:  # a subgroup of GL(h) (RotaryGLQuotient) draws its own elements
        h = group.shape[-1]
        return own(lead, h=h, max_condition=max_condition, generator=generator, dtype=dtype)
    if isinstance(group.manifold, GLQuotient):
        h = group.shape[-1]
        u, _ = torch.linalg.qr(torch.randn(*lead, h, h, generator=generator, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(*lead, h, h, generator=generator, dtype=torch.float64))
        s = max_condition ** (torch.rand(*lead, h, generator=generator, dtype=torch.float64) - 0.5)
        return (u @ torch.diag_embed(s) @ v.mT).to(dtype)
    if isinstance(group.manifold, DiagonalQuotient):
        k = group.shape[-1]
        log = torch.rand(*lead, k, generator=generator, dtype=torch.float64) - 0.5
        return (max_condition**log).to(dtype)
    return None


def _identity_like(element: torch.Tensor, manifold: Any) -> torch.Tensor:
    if isinstance(manifold, GLQuotient):
        eye = torch.eye(element.shape[-1], dtype=element.dtype, device=element.device)
        return eye.expand_as(element).clone()
    return torch.ones_like(element)


def _default_rtol(dtype: torch.dtype) -> float:
    """The default tolerance of :func:`verify_plan`, relative to the largest output.

    :data:`RTOL` for float64 and float32; for a half-precision dtype (bfloat16, float16)
    :data:`HALF_RTOL_EPS` times its machine epsilon; ``1e-3`` otherwise.

    Parameters
    ----------
    dtype : torch.dtype
        The model's floating-point dtype.

    Returns
    -------
    float
        The relative tolerance.
    """
    if dtype in RTOL:
        return RTOL[dtype]
    if dtype.is_floating_point and torch.finfo(dtype).bits <= 16:
        return HALF_RTOL_EPS * torch.finfo(dtype).eps
    return 1e-3


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the group actions for a model in ``dtype``: float64 for float64, else
    float32 (half precision has no CPU solver, and rounds the elements' inverses)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _lifted(
    groups: Sequence[SymmetryGroup], params: Dict[str, torch.Tensor], compute: torch.dtype
) -> Dict[str, torch.Tensor]:
    """``params`` with the parameters of ``groups`` in the ``compute`` dtype."""
    names = {n for g in groups for n in g.param_names}
    return {n: p.to(compute) if n in names else p for n, p in params.items()}


def _lowered(moved: Mapping[str, torch.Tensor], params: Dict[str, torch.Tensor]):
    """``moved``, each tensor cast back to the dtype of the parameter it replaces."""
    return {n: moved[n].to(p.dtype) for n, p in params.items()}


def _acted(
    bound: BoundPlan,
    params: Dict[str, torch.Tensor],
    elements: Sequence[Optional[torch.Tensor]],
    compute: torch.dtype,
) -> Dict[str, torch.Tensor]:
    """``bound.act`` computed in ``compute``, the moved parameters cast back to their dtype.

    For a float32 or float64 model ``compute`` is its dtype and nothing is cast.
    """
    acting = [g for g, a in zip(bound.symmetric_groups, elements) if a is not None]
    lifted = _lifted(acting, params, compute)
    elements = [None if a is None else a.to(compute) for a in elements]
    return _lowered(bound.act(lifted, elements), params)


def _broken(
    group: SymmetryGroup,
    params: Dict[str, torch.Tensor],
    element: torch.Tensor,
    compute: torch.dtype,
):
    """The element applied to the first factor only: a control that is not a symmetry."""
    manifold = group.manifold
    lifted = _lifted([group], params, compute)
    point = group.gather(lifted)
    moved = manifold.act(point, element.to(compute))
    if isinstance(manifold, GLQuotient):
        broken = torch.cat((moved[..., : manifold.n, :], point[..., manifold.n :, :]), dim=-2)
    else:
        broken = torch.stack((moved[..., 0, :], point[..., 1, :]), dim=-2)
    out = dict(lifted)
    out.update(group.scatter(broken, lifted))
    return _lowered(out, params)


def verify_plan(
    model: torch.nn.Module,
    plan: SymmetryPlan | BoundPlan,
    probe_inputs: Any = None,
    *,
    members: Optional[Mapping[str, Sequence[str]]] = None,
    seed: int = 0,
    max_condition: float = 4.0,
    rtol: Optional[float] = None,
) -> List[str]:
    """Check that every symmetric group of ``plan`` leaves the model's outputs unchanged.

    Parameters
    ----------
    model : torch.nn.Module
        Not mutated (parameters reach it through :func:`torch.func.functional_call`); it
        runs in eval mode without gradients.
    plan : SymmetryPlan or BoundPlan
        The plan to check; a :class:`SymmetryPlan` is bound to ``model`` first.
    probe_inputs : dict, tuple, torch.Tensor or None
        Keyword arguments, positional arguments or the single input of ``model``;
        ``None`` builds them from a Hugging Face config (:func:`probe_inputs_for`).
    members : mapping, optional
        Group name -> module path of each entry of the group's leading dimension, used
        to name the module that breaks.
    seed : int
        Seed of the random group elements.
    max_condition : float
        Condition number of the random elements (singular values in
        ``[max_condition^-1/2, max_condition^1/2]``).
    rtol : float, optional
        Tolerance relative to the largest output magnitude (default by the model's
        dtype: 1e-5 for float64, 1e-4 for float32, ``HALF_RTOL_EPS`` = 8 machine
        epsilons for bfloat16 and float16).

    Returns
    -------
    list of str
        Notes: the largest deviation seen, and any group whose check is weak (breaking
        its symmetry barely changes the outputs on these inputs).

    Raises
    ------
    SymmetryVerificationError
        Naming the first group (and member module) whose element changes the outputs.
    """
    bound = plan if isinstance(plan, BoundPlan) else plan.bind(model)
    groups = bound.symmetric_groups
    if not groups:
        return ["verify: no symmetric group to check"]
    params = {n: p.detach() for n, p in model.named_parameters()}
    dtype = next((p.dtype for p in params.values() if p.is_floating_point()), torch.float32)
    tol_rel = _default_rtol(dtype) if rtol is None else rtol
    compute = _compute_dtype(dtype)
    generator = torch.Generator().manual_seed(seed)
    notes: List[str] = []
    worst = 0.0
    with preserved_model_state(model), torch.no_grad():
        probe = probe_inputs_for(model) if probe_inputs is None else probe_inputs
        reference = _run(model, params, probe)
        scale = max(float(t.abs().max()) if t.numel() else 0.0 for t in reference)
        tol = tol_rel * max(scale, 1e-30)
        weak = []
        for group in groups:
            element = random_element(group, generator, compute, max_condition)
            if element is None:
                notes.append(f"verify: group {group.name!r} has no known group action: unchecked")
                continue
            element = element.to(next(iter(params.values())).device)
            elements = [element if g is group else None for g in groups]
            err = _deviation(
                reference, _run(model, _acted(bound, params, elements, compute), probe)
            )
            if err > tol:
                raise SymmetryVerificationError(
                    _failure_message(
                        model, bound, group, element, params, probe, reference, tol, err, members
                    )
                )
            worst = max(worst, err)
            control = _deviation(
                reference, _run(model, _broken(group, params, element, compute), probe)
            )
            if control <= 10 * tol:
                weak.append(f"{group.name} ({control:.2g})")
    notes.insert(
        0,
        f"verified {len(groups)} symmetric groups on probe inputs: largest output change "
        f"{worst:.2g} (tolerance {tol:.2g} = {tol_rel:g} x max |output|)",
    )
    if weak:
        notes.append(
            "verify: weak check for " + "; ".join(weak) + ": breaking these symmetries barely "
            "changes the outputs on the probe inputs (small weights or inactive adapters?)"
        )
    return notes


def _failure_message(
    model, bound, group, element, params, probe, reference, tol, err, members
) -> str:
    where = ""
    lead = group.shape[:-2]
    names = (members or {}).get(group.name)
    if len(lead) >= 1 and lead[0] > 1:
        groups = bound.symmetric_groups
        for index in range(lead[0]):
            single = _identity_like(element, group.manifold)
            single[index] = element[index]
            elements = [single if g is group else None for g in groups]
            moved = _acted(bound, params, elements, _compute_dtype(element.dtype))
            if _deviation(reference, _run(model, moved, probe)) > tol:
                module = names[index] if names and index < len(names) else f"entry {index}"
                where = f" (first failing member: {module})"
                break
    return (
        f"group {group.name!r} is not a symmetry of {type(model).__name__}{where}: a random "
        f"group element changes the outputs by {err:.3g} (tolerance {tol:.3g}). The detector "
        "recognised this module by its structure, but the model computes something else; "
        "drop the group or write the plan by hand"
    )
