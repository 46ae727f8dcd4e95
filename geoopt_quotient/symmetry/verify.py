"""Prove a symmetry plan on a model: group elements must leave the outputs unchanged.

:func:`prove_plan` draws a random, well-conditioned element of every symmetric group's own
group (``manifold.random_element``: GL(h), its rotary-commuting subgroup, scalings), applies
all of them at once to the weights and runs the model on probe inputs. When the outputs do
not move beyond the model's precision, every group holds: two forward passes in all (three
where the tolerance is raised to the model's rounding, below). When they do, the groups
are bisected (half of them acted on, then half of those...) down to the groups, and
within a stacked group down to its members (modules), that change the outputs.

**Tolerance.** Relative to the largest output magnitude: :data:`RTOL` of the precision in
which the model actually computes what depends on its weights, read during the reference
pass (a float64 model whose norms or softmax compute in float32 is checked at float32's
tolerance, one that computes in float64 throughout at 1e-6), or :data:`HALF_RTOL_EPS` machine
epsilons of a bfloat16 or float16 model. Where the acted outputs move beyond it, the
model's own rounding on the probe is measured by a third pass, on the weights acted on by
every element and then by its inverse (the weights themselves in exact arithmetic): the
tolerance is raised to :data:`ROUND_TRIP_FACTOR` times that change, up to
:data:`MAX_RAISE` default tolerances (a deep float32 model at positions far apart moves
its outputs by rounding alone beyond the default, SmolLM2-135M by ten times it).

**Control.** The reference pass also takes the gradient of a random (Gaussian) projection
of the outputs, and each group's element applied to its first factor alone (not a
symmetry) must move it, to first order, by more than ten tolerances: otherwise the probe
cannot see the group (e.g. an adapter whose second factor is zero), and the proof says its
check is weak.

The group elements and their action are computed in float64 for a float64 model and in
float32 otherwise; the transformed weights are cast back to the model's dtype (a
half-precision model is checked on the CPU too, which has no half-precision solver).

Probe inputs: ``probe_inputs`` (a dict of keyword arguments, a tuple of positional
arguments, one tensor, or a function ``model -> outputs``, e.g. the loss on a batch), or,
for Hugging Face models, inputs built from the config (:func:`probe_inputs_for`):
``input_ids`` from ``vocab_size``, ``pixel_values`` from ``num_channels``/``image_size``,
``decoder_input_ids`` for encoder-decoders, and ``use_cache=False``; for a
``torch.nn.MultiheadAttention``, random query, key and value.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from .._model_state import preserved_model_state
from ..errors import GeooptQuotientWarning
from ..manifolds.base import random_group_element
from .plan import BoundPlan, PlanError, SymmetryGroup, SymmetryPlan

__all__ = [
    "GroupCheck",
    "PlanProof",
    "ProbeError",
    "ReferencePass",
    "SymmetryNotProvenWarning",
    "SymmetryVerificationError",
    "WeightPrecision",
    "probe_inputs_for",
    "prove_at_once",
    "prove_plan",
    "reference_pass",
    "verify_plan",
]

#: Relative tolerance (of the largest output magnitude) by the precision the model
#: computes in.
RTOL = {torch.float64: 1e-6, torch.float32: 1e-4}
#: Relative tolerance of a float64 model that computes parts of its forward pass from the
#: weights in float32 (norms, softmax): float32 rounding (machine epsilon 2^-23) of
#: invariant activations computed from different weights, amplified by up to 64 through
#: the layers.
FLOAT32_IN_FLOAT64_RTOL = 64 * torch.finfo(torch.float32).eps
#: Tolerance of a half-precision model in units of its dtype's machine epsilon: every
#: transformed weight is rounded to the dtype (relative error up to eps/2), and so is
#: every activation of the forward pass, layer after layer.
HALF_RTOL_EPS = 8
#: Where the outputs move beyond the default tolerance, it is raised to this many times
#: the change of a round trip (every element, then its inverse: the weights themselves in
#: exact arithmetic, whatever the model), the model's own rounding on the probe inputs.
ROUND_TRIP_FACTOR = 10
#: ... but to at most this many default tolerances: outputs that rounding moves more are
#: too sensitive to prove anything on (pass other ``probe_inputs=``).
MAX_RAISE = 100
#: A group whose first factor alone moves the outputs (to first order) by less than this
#: many tolerances is reported as weakly checked.
CONTROL_FACTOR = 10
#: Output keys that are not functions of the symmetry class (cached keys/values).
SKIPPED_OUTPUT_KEYS = ("past_key_values", "cache")
#: Where to report a group that discovery claimed but the model does not have.
REPORT = (
    "if the model is a released architecture, please report it to geoopt-quotient's issue "
    "tracker with the model class and `plan.bind(model).summary()`"
)

Probe = Callable[[torch.nn.Module], Any]


class SymmetryVerificationError(PlanError):
    """A group of a symmetry plan changes the model's outputs: it is not a symmetry."""


class ProbeError(PlanError):
    """No probe inputs could be built for a model, or those built do not run it: pass
    ``probe_inputs=``."""


class SymmetryNotProvenWarning(GeooptQuotientWarning, UserWarning):
    """Discovery claimed a group that the model's outputs refute; it is left to the adaptive
    geometry."""


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
        raise ProbeError(
            f"cannot build probe inputs for {type(model).__name__}: it has no Hugging Face "
            "config; pass probe_inputs= (a dict of keyword arguments, a tuple or a tensor)"
        )
    try:
        signature = inspect.signature(base.forward).parameters
    except (TypeError, ValueError) as error:
        raise ProbeError(f"cannot inspect {type(base).__name__}.forward: {error}") from error
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
        raise ProbeError(
            f"cannot build probe inputs for {type(base).__name__} (forward needs {needs}); "
            "pass probe_inputs= (a dict of keyword arguments, a tuple or a tensor)"
        )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def default_probe(model: torch.nn.Module, guess: bool = True) -> Any:
    """Probe inputs for ``model``: random query, key and value for a
    ``torch.nn.MultiheadAttention`` (or a module like it), inputs built from a Hugging Face
    config, or (with ``guess``) one input read off a first ``Embedding``, ``Linear`` or
    multi-head attention layer.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    guess : bool
        Read one input off the first layer when nothing else applies (default ``True``).

    Returns
    -------
    dict, tuple or torch.Tensor
        Keyword arguments, positional arguments or the one input of ``model``.

    Raises
    ------
    PlanError
        If none applies: pass ``probe_inputs=`` (or ``verify=False``).
    """
    if _attention_like(model):
        p = next(model.parameters())
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 2, model.embed_dim, generator=gen, dtype=p.dtype)
        shape = (2, 5) if getattr(model, "batch_first", False) else (5, 2)
        x = x.reshape(*shape, model.embed_dim).to(p.device)
        kdim = getattr(model, "kdim", model.embed_dim)
        vdim = getattr(model, "vdim", model.embed_dim)
        k = x if kdim == model.embed_dim else x.new_ones(*shape, kdim)
        v = x if vdim == model.embed_dim else x.new_ones(*shape, vdim)
        return (x, k, v)
    if getattr(_base_model(model), "config", None) is not None:
        return probe_inputs_for(model)
    single = _single_input(model) if guess else None
    if single is None:
        raise ProbeError(
            f"cannot build probe inputs for {type(model).__name__}: it has no Hugging Face "
            "config and its first layer does not say what it takes; pass probe_inputs= (a dict "
            "of keyword arguments, a tuple, a tensor or a function of the model), or verify=False"
        )
    return single


def _attention_like(model: torch.nn.Module) -> bool:
    """A ``torch.nn.MultiheadAttention``, or a module with its ``embed_dim`` whose forward
    takes ``query`` first (e.g. :class:`~geoopt_quotient.nn.QuotientMultiheadAttention`)."""
    if isinstance(model, torch.nn.MultiheadAttention):
        return True
    try:
        first = next(iter(inspect.signature(model.forward).parameters), None)
    except (TypeError, ValueError):
        return False
    return isinstance(getattr(model, "embed_dim", None), int) and first == "query"


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _single_input(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """Random input for a module whose ``forward`` takes one required argument, read off
    its first parameterised layer: tokens for an ``Embedding``, features for a
    ``Linear``, a ``(2, 5, embed_dim)`` sequence for a ``MultiheadAttention``; ``None``
    otherwise."""
    try:
        signature = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    required = [
        p
        for p in signature
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    first = next((m for m in model.modules() if next(m.parameters(False), None) is not None), None)
    if len(required) != 1 or first is None:
        return None
    gen = torch.Generator().manual_seed(0)
    p = next(first.parameters())
    if isinstance(first, torch.nn.Embedding):
        return torch.randint(0, first.num_embeddings, (2, 7), generator=gen).to(p.device)
    if isinstance(first, torch.nn.Linear):
        return torch.randn(2, first.in_features, generator=gen, dtype=torch.float64).to(p)
    if isinstance(first, torch.nn.MultiheadAttention):  # e.g. a TransformerEncoderLayer
        return torch.randn(2, 5, first.embed_dim, generator=gen, dtype=torch.float64).to(p)
    return None


@contextlib.contextmanager
def without_autocast() -> Iterator[None]:
    """Autocast off on every device type where the caller turned it on: a symmetry is a
    property of the model's function, checked in its weights' precision."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda", "xpu", "mps"):
            try:
                enabled = torch.is_autocast_enabled(device)
            except (RuntimeError, TypeError):  # a device type this build does not know
                continue
            if enabled:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def as_probe(probe_inputs: Any) -> Probe:
    """A function ``model -> outputs`` from probe inputs: keyword arguments (a mapping),
    positional arguments (a tuple), one input (a tensor), or such a function itself."""
    if callable(probe_inputs) and not isinstance(probe_inputs, torch.Tensor):
        return probe_inputs
    if isinstance(probe_inputs, Mapping):
        return lambda model: model(**probe_inputs)
    if isinstance(probe_inputs, tuple):
        return lambda model: model(*probe_inputs)
    return lambda model: model(probe_inputs)


class _Probed(torch.nn.Module):
    """``probe(model)`` as a module, so :func:`torch.func.functional_call` swaps weights in."""

    def __init__(self, model: torch.nn.Module, probe: Probe):
        super().__init__()
        self.model = model
        self.probe = probe

    def forward(self) -> Any:
        return self.probe(self.model)


class WeightPrecision(TorchDispatchMode):
    """A dispatch mode that records the lowest floating-point precision among the results
    of the operations that depend, through any chain of operations, on the given tensors
    (the weights), and which operators computed below the weights' own precision.

    Tables computed from constants alone (rotary ``cos``/``sin`` from ``inv_freq``) do
    not count: they are the same before and after a group acts, so their rounding cancels.

    Parameters
    ----------
    roots : sequence of torch.Tensor
        The weights, as the forward pass receives them.

    Attributes
    ----------
    lowest : torch.dtype or None
        The lowest precision seen (``None``: no floating result depended on the roots).
    below : dict of str to int
        Operator name -> how often it produced a weight-dependent result of lower precision
        than the roots.

    :meth:`lowest_from` reads the lowest precision of the results that depend on some of
    the roots only (one pass at every weight serves the proof of any plan).
    """

    def __init__(self, roots: Sequence[torch.Tensor]):
        super().__init__()
        self.tainted = WeakIdKeyDictionary()  # tensor -> bit mask of the roots it depends on
        self.bits = WeakIdKeyDictionary()
        for k, root in enumerate(roots):
            self.tainted[root] = self.tainted.get(root, 0) | 1 << k
            self.bits[root] = self.tainted[root]
        floating = [r.dtype for r in roots if r.is_floating_point()]
        self.own = max(floating, key=_eps) if floating else None
        self.lowest: Optional[torch.dtype] = None
        self.below: Dict[str, int] = {}
        self.depends: Dict[torch.dtype, int] = {}  # dtype -> roots some result depends on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        mask = 0
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                mask |= self.tainted.get(t, 0)
        if mask:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.tainted[t] = self.tainted.get(t, 0) | mask
                    self._record(t.dtype, str(func.overloadpacket), mask)
        return out

    def _record(self, dtype: torch.dtype, name: str, mask: int) -> None:
        if dtype.is_complex:
            dtype = dtype.to_real()
        if not dtype.is_floating_point:
            return
        self.depends[dtype] = self.depends.get(dtype, 0) | mask
        if self.lowest is None or _eps(dtype) > _eps(self.lowest):
            self.lowest = dtype
        if self.own is not None and _eps(dtype) > _eps(self.own):
            self.below[name] = self.below.get(name, 0) + 1

    def lowest_from(self, roots: Sequence[torch.Tensor]) -> Optional[torch.dtype]:
        """The lowest precision among the results that depend on some of ``roots`` (a
        subset of the roots the mode was made with), ``None`` if none does.

        Parameters
        ----------
        roots : sequence of torch.Tensor
            Some of the roots.

        Returns
        -------
        torch.dtype or None
            As :attr:`lowest`, for these roots alone.
        """
        wanted = 0
        for root in roots:
            wanted |= self.bits.get(root, 0)
        seen = [dtype for dtype, mask in self.depends.items() if mask & wanted]
        return max(seen, key=_eps) if seen else None


def _eps(dtype: torch.dtype) -> float:
    """Machine epsilon: the larger, the lower the precision (bfloat16 below float16)."""
    return torch.finfo(dtype).eps


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


def _deviation(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    """The largest entry-wise change; equal entries (infinities and NaNs included) change
    by 0, an entry that became non-finite by ``inf``."""
    worst = 0.0
    for x, y in zip(a, b):
        if x.numel():
            same = (x == y) | (x.isnan() & y.isnan())
            diff = torch.where(same, 0.0, (x - y).abs()).nan_to_num(nan=float("inf"))
            worst = max(worst, float(diff.max()))
    return worst


def _scale(reference: List[torch.Tensor]) -> float:
    """The largest finite output magnitude."""
    finite = [t[t.isfinite()].abs() for t in reference]
    return max((float(t.max()) for t in finite if t.numel()), default=0.0)


def default_rtol(dtype: torch.dtype, weights: Optional[torch.dtype] = None) -> float:
    """The default tolerance of :func:`prove_plan`, relative to the largest output.

    :data:`RTOL` for float64 and float32 (:data:`FLOAT32_IN_FLOAT64_RTOL` for float64
    weights used in float32); for a half-precision dtype (bfloat16, float16)
    :data:`HALF_RTOL_EPS` times its machine epsilon; ``1e-3`` otherwise.

    Parameters
    ----------
    dtype : torch.dtype
        The lowest precision the model computes in from its weights.
    weights : torch.dtype, optional
        The weights' dtype.

    Returns
    -------
    float
        The relative tolerance.
    """
    if weights == torch.float64 and dtype == torch.float32:
        return FLOAT32_IN_FLOAT64_RTOL
    if dtype in RTOL:
        return RTOL[dtype]
    if dtype.is_floating_point and torch.finfo(dtype).bits <= 16:
        return HALF_RTOL_EPS * torch.finfo(dtype).eps
    return 1e-3


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the group actions for a model in ``dtype``: float64 for float64, else
    float32 (half precision has no CPU solver, and rounds the elements' inverses)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class GroupCheck:
    """What the proof found for one symmetric group.

    Attributes
    ----------
    name : str
        The group's name.
    holds : bool
        Whether its random element left the outputs unchanged within the tolerance.
    deviation : float or None
        The largest output change under its element alone (``None`` when it was only
        checked together with other groups that hold).
    control : float
        First-order output change (along a random projection of the outputs) when its
        element moves the first factor alone; below ``CONTROL_FACTOR`` tolerances the check is weak.
    failing_members : tuple of int
        Entries of the group's leading dimension (modules) whose elements change the outputs.
    """

    name: str
    holds: bool
    deviation: Optional[float]
    control: float
    failing_members: Tuple[int, ...] = ()


@dataclass
class PlanProof:
    """The outcome of :func:`prove_plan`.

    Attributes
    ----------
    checks : list of GroupCheck
        One per symmetric group of the plan, in its order.
    tolerance : float
        Absolute tolerance on the outputs (``rtol`` times the largest output).
    rtol : float
        The relative tolerance.
    precision : torch.dtype
        The lowest precision of the weight-dependent operations of the reference pass.
    largest_change : float
        The output change with every group that holds acted on at once.
    forward_calls : int
        Number of forward passes of the model the proof made.
    rounding : float or None
        The output change of the round trip (every element, then its inverse) that raised
        the tolerance, where the default was exceeded; else ``None``.
    """

    checks: List[GroupCheck] = field(default_factory=list)
    tolerance: float = 0.0
    rtol: float = 0.0
    precision: torch.dtype = torch.float32
    largest_change: float = 0.0
    forward_calls: int = 0
    rounding: Optional[float] = None

    @property
    def failed(self) -> List[GroupCheck]:
        """The groups the outputs refute."""
        return [c for c in self.checks if not c.holds]

    @property
    def weak(self) -> List[GroupCheck]:
        """The groups that hold but whose control barely moved the outputs."""
        return [c for c in self.checks if c.holds and c.control <= CONTROL_FACTOR * self.tolerance]

    def _raised(self) -> str:
        if self.rounding is None:
            return ""
        return (
            f", raised to {ROUND_TRIP_FACTOR} x the change {self.rounding:.2g} of a round trip "
            f"(the elements, then their inverses: rounding alone), at most {MAX_RAISE} x the "
            "default"
        )

    def notes(self) -> List[str]:
        """Plan notes: what was verified, to which tolerance, and any weak check."""
        held = sum(c.holds for c in self.checks)
        notes = [
            f"verified {held} symmetric groups on probe inputs: largest output change "
            f"{self.largest_change:.2g} (tolerance {self.tolerance:.2g} = {self.rtol:g} x max "
            f"|output|{self._raised()}, the model computing in "
            f"{str(self.precision).replace('torch.', '')}; {self.forward_calls} forward passes)"
        ]
        if self.weak:
            weak = "; ".join(f"{c.name} ({c.control:.2g})" for c in self.weak)
            notes.append(
                f"verify: weak check for {weak}: breaking these symmetries barely changes the "
                "outputs on the probe inputs (small weights or inactive adapters?)"
            )
        return notes


@dataclass
class ReferencePass:
    """A forward pass of the model at its weights, kept to serve as a proof's reference
    pass (:func:`reference_pass`): discovery records its rotary probe on this pass, so
    that the two are one forward pass.

    Attributes
    ----------
    inputs : dict
        The keyword inputs the model ran on (the proof's probe inputs).
    params : dict of str to torch.Tensor
        The weights the pass used, by name, every floating one a leaf that requires
        gradients, so that the proof can differentiate with respect to any group's: the
        model's own parameters where they all require gradients, else detached copies.
    outputs : Any
        The model's outputs, with their autograd graph.
    precision : WeightPrecision or None
        The precision of each weight-dependent operation (read for a float64 model only,
        where it sets the tolerance).
    """

    inputs: Dict[str, Any]
    params: Dict[str, torch.Tensor]
    outputs: Any
    precision: Optional[WeightPrecision] = None


def reference_pass(model: torch.nn.Module, inputs: Mapping[str, Any]) -> ReferencePass:
    """Run ``model(**inputs)`` at its weights as a proof's reference pass: every floating
    weight a leaf that requires gradients, and, for a float64 model, the precision of each
    operation read (:class:`WeightPrecision`, rooted at every weight).

    Parameters
    ----------
    model : torch.nn.Module
        The model (not mutated; run as it is: the caller sets eval mode).
    inputs : mapping
        Keyword inputs, e.g. :func:`probe_inputs_for`'s.

    Returns
    -------
    ReferencePass
        The pass, for ``prove_plan(..., reference=)``.
    """
    own = dict(model.named_parameters())
    # where every floating weight already requires gradients, the model runs on its own
    # weights (differentiating does not write their .grad); else on detached leaves
    direct = all(p.requires_grad for p in own.values() if p.is_floating_point())
    params = (
        own
        if direct
        else {n: p.detach().requires_grad_(p.is_floating_point()) for n, p in own.items()}
    )
    floating = [p.dtype for p in params.values() if p.is_floating_point()]
    dtype = floating[0] if floating else torch.float32
    precision = WeightPrecision(list(params.values())) if dtype == torch.float64 else None
    with torch.enable_grad(), precision or contextlib.nullcontext():
        if direct:
            outputs = model(**inputs)
        else:
            outputs = functional_call(model, params, (), dict(inputs), strict=False)
    return ReferencePass(dict(inputs), params, outputs, precision)


class _Prover:
    """The state of one proof: the model's weights, the probe, the drawn elements and the
    reference outputs; every forward pass goes through :meth:`outputs` and is counted."""

    def __init__(
        self,
        model: torch.nn.Module,
        bound: BoundPlan,
        probe: Probe,
        seed: int,
        shared: Optional[ReferencePass] = None,
    ):
        self.module = _Probed(model, probe)
        self.shared = shared
        self.bound = bound
        self.groups = bound.symmetric_groups
        self.params = {n: p.detach() for n, p in model.named_parameters()}
        floating = [p.dtype for p in self.params.values() if p.is_floating_point()]
        self.dtype = floating[0] if floating else torch.float32
        self.compute = _compute_dtype(self.dtype)
        self.generator = torch.Generator().manual_seed(seed)
        self.projections = torch.Generator().manual_seed(seed + 1)
        self.forward_calls = 0 if shared is None else 1  # the shared pass is the reference

    def outputs(self, params: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        self.forward_calls += 1
        named = {f"model.{n}": p for n, p in params.items()}
        leaves = _float_leaves(functional_call(self.module, named, (), strict=False))
        if not leaves:
            raise ProbeError("the model's outputs on the probe inputs contain no floating tensor")
        return leaves

    def draw(self, max_condition: float) -> List[Optional[torch.Tensor]]:
        device = next(iter(self.params.values())).device
        elements = []
        for group in self.groups:
            shape = tuple(group.shape)
            a = random_group_element(
                group.manifold,
                shape[:-2],
                h=shape[-1],
                max_condition=max_condition,
                generator=self.generator,
                dtype=self.compute,
            )
            elements.append(None if a is None else a.to(device))
        return elements

    def acted(
        self, elements: Sequence[Optional[torch.Tensor]], *, first_factor_only: bool = False
    ) -> Dict[str, torch.Tensor]:
        """The weights ``elements`` move, by name (computed in :attr:`compute`, cast back);
        the model's own weights stand for the others (:meth:`outputs` swaps in these)."""
        names = {n for g, a in zip(self.groups, elements) if a is not None for n in g.param_names}
        lifted = {n: p.to(self.compute) if n in names else p for n, p in self.params.items()}
        moved = self.bound.act(lifted, elements, first_factor_only=first_factor_only)
        return {n: moved[n].to(p.dtype) for n, p in self.params.items() if n in names}

    def acted_pair(
        self, elements: Sequence[Optional[torch.Tensor]]
    ) -> Optional[Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]]:
        """``(acted(elements), acted(elements, first_factor_only=True))`` from one gather
        per group, where the acting groups have no parameter in common (else ``None``):
        the same weights, bit for bit, as the two calls."""
        names = [n for g, a in zip(self.groups, elements) if a is not None for n in g.param_names]
        if len(set(names)) != len(names):
            return None
        lifted = {n: self.params[n].to(self.compute) for n in names}
        full, first = dict(lifted), dict(lifted)
        for group, a in zip(self.groups, elements):
            if a is None:
                continue
            point = group.gather(lifted)
            full.update(group.scatter(group.manifold.act(point, a), full))
            first.update(group.scatter(group.manifold.act_on_first_factor(point, a), first))
        return tuple(
            {n: moved[n].to(self.params[n].dtype) for n in names} for moved in (full, first)
        )

    def round_trip(
        self, elements: Sequence[Optional[torch.Tensor]], acted: Mapping[str, torch.Tensor]
    ) -> Optional[Dict[str, torch.Tensor]]:
        """The weights ``acted`` (moved by ``elements``) moved back by the inverse elements,
        group by group in reverse order: the weights themselves in exact arithmetic, for
        any model, so the outputs they give differ from the reference by rounding alone;
        ``None`` where a group's manifold has no inverse (``inverse_element``)."""
        try:
            inverses = [
                None if a is None else g.manifold.inverse_element(a)
                for g, a in zip(self.groups, elements)
            ]
        except NotImplementedError:
            return None
        back = {n: p.to(self.compute) for n, p in acted.items()}
        lifted = {**self.params, **back}
        for i in reversed(range(len(self.groups))):
            inverse = inverses[i]
            if inverse is None:
                continue
            alone = [inverse if j == i else None for j in range(len(self.groups))]
            lifted = self.bound.act(lifted, alone)
        return {n: lifted[n].to(self.params[n].dtype) for n in acted}

    def reference(self) -> Tuple[List[torch.Tensor], torch.dtype, List[Dict[str, torch.Tensor]]]:
        """The outputs at the weights, the lowest precision they were computed in, and the
        gradient of a random projection of them with respect to the groups' weights."""
        names = {n for g in self.groups for n in g.param_names}
        if self.shared is not None:
            return self._shared_reference(sorted(names))
        params = {
            n: p.detach().requires_grad_(p.is_floating_point()) if n in names else p
            for n, p in self.params.items()
        }
        roots = [params[n] for n in sorted(names)]
        # only a float64 model may compute in a lower precision than its weights' (norms
        # in float32) in a way that matters for the tolerance; the dispatch mode that reads
        # it costs Python time per operator, so it runs only there
        precision = WeightPrecision(roots)
        reading = precision if self.dtype == torch.float64 else contextlib.nullcontext()
        with torch.enable_grad(), reading:
            leaves = self.outputs(params)
        lowest = precision.lowest or self.dtype
        reference = [t.detach().to(torch.float64) for t in leaves]
        return reference, lowest, self._projected_gradients(leaves, roots, sorted(names))

    def _shared_reference(self, names: List[str]):
        """:meth:`reference` read from the shared pass (every weight a leaf there)."""
        roots = [self.shared.params[n] for n in names]
        leaves = _float_leaves(self.shared.outputs)
        if not leaves:
            raise ProbeError("the model's outputs on the probe inputs contain no floating tensor")
        read = self.shared.precision
        lowest = (read.lowest_from(roots) if read is not None else None) or self.dtype
        reference = [t.detach().to(torch.float64) for t in leaves]
        return reference, lowest, self._projected_gradients(leaves, roots, names)

    def _projected_gradients(self, leaves, roots, names) -> List[Dict[str, torch.Tensor]]:
        r"""The gradient, with respect to the groups' weights, of one random projection
        :math:`c^\top y` of the outputs :math:`y` (:math:`c` standard Gaussian), in one
        backward pass: its product with a weight step :math:`\delta` is
        :math:`c^\top J\delta`, whose mean square is :math:`\lVert J\delta\rVert^2`, and
        which is below :math:`\epsilon\lVert J\delta\rVert` with probability about
        :math:`0.8\,\epsilon` only."""
        leaves = [t for t in leaves if t.requires_grad]
        if not leaves or not any(r.requires_grad for r in roots):
            return []
        cotangents = [
            torch.randn(t.shape, generator=self.projections).to(t.device, t.dtype) for t in leaves
        ]
        parts = torch.autograd.grad(leaves, roots, cotangents, retain_graph=True, allow_unused=True)
        return [{n: g for n, g in zip(names, parts) if g is not None}]

    def controls(
        self,
        elements: Sequence[Optional[torch.Tensor]],
        grads,
        together: Optional[Dict[str, torch.Tensor]],
    ) -> List[float]:
        """Per group, the first-order output change (projected) when its element
        moves its first factor alone: 0 for a group without an element, ``inf`` when no
        gradient could be taken.

        ``together``: the weights every element moves on its first factor alone, where
        the groups have no parameter in common (:meth:`acted_pair`: each moves its own
        parameters only, exactly as alone); ``None``: each group is moved alone."""
        acting = [i for i, a in enumerate(elements) if a is not None]
        out = [0.0 if a is None else float("inf") for a in elements]
        if not grads or not acting:
            return out
        for i in acting:
            alone = [a if j == i else None for j, a in enumerate(elements)]
            moved = together or self.acted(alone, first_factor_only=True)
            out[i] = self._control(self.groups[i].param_names, moved, grads)
        return out

    def _control(self, own: Sequence[str], moved: Mapping[str, torch.Tensor], grads) -> float:
        """Largest projected first-order change of the weights ``own`` moved to ``moved``."""
        steps = {n: moved[n].double() - self.params[n].double() for n in own}
        change = 0.0
        for grad in grads:
            dot = sum(float((g.double() * steps[n]).sum()) for n, g in grad.items() if n in steps)
            change = max(change, abs(dot))
        return change


def _bisect(indices: List[int], breaks: Callable[[List[int]], bool]) -> List[int]:
    """The indices ``i`` with ``breaks([i])``, given that ``breaks(indices)``: halves are
    tested in turn, so ``k`` culprits among ``n`` cost about ``2 k log2(n)`` tests."""
    if len(indices) == 1:
        return indices
    half = len(indices) // 2
    culprits = []
    for part in (indices[:half], indices[half:]):
        if breaks(part):
            culprits += _bisect(part, breaks)
    return culprits


def _member_elements(group: SymmetryGroup, element: torch.Tensor, members: List[int]):
    """``element`` on the leading entries ``members`` of the group, the identity elsewhere."""
    lead, h = tuple(group.shape[:-2]), group.shape[-1]
    out = group.manifold.identity_element(lead, h=h, dtype=element.dtype, device=element.device)
    out[members] = element[members]
    return out


def _failing_members(prover, index, element, changes) -> Tuple[int, ...]:
    group = prover.groups[index]
    if len(group.shape) <= 2 or group.shape[0] == 1:
        return (0,)

    def breaks(members: List[int]) -> bool:
        partial = _member_elements(group, element, members)
        return changes([partial if i == index else None for i in range(len(prover.groups))])

    return tuple(_bisect(list(range(group.shape[0])), breaks))


def prove_plan(
    model: torch.nn.Module,
    plan: SymmetryPlan | BoundPlan,
    probe_inputs: Any = None,
    *,
    seed: int = 0,
    max_condition: float = 4.0,
    rtol: Optional[float] = None,
    reference: Optional[ReferencePass] = None,
) -> PlanProof:
    """Check every symmetric group of ``plan`` on the model's outputs, without raising.

    Parameters
    ----------
    model : torch.nn.Module
        Not mutated (weights reach it through :func:`torch.func.functional_call`); it
        runs in eval mode.
    plan : SymmetryPlan or BoundPlan
        The plan to check; a :class:`SymmetryPlan` is bound to ``model`` first.
    probe_inputs : dict, tuple, torch.Tensor, callable or None
        Keyword arguments, positional arguments or the single input of ``model``, or a
        function ``model -> outputs`` (e.g. ``lambda m: loss_fn(m, batch)``); ``None``
        builds them (:func:`default_probe`).
    seed : int
        Seed of the random group elements and projections.
    max_condition : float
        Bound on the condition number of the random elements.
    rtol : float, optional
        Tolerance relative to the largest output magnitude (default
        :func:`default_rtol` of the precision the model computes in).
    reference : ReferencePass, optional
        A pass of the model at its weights (:func:`reference_pass`) to use as the
        reference pass instead of running one; the probe inputs are then its inputs
        (``probe_inputs`` must be ``None``). Its graph is differentiated once.

    Returns
    -------
    PlanProof
        Per group: holds or not (and which members break it), and its control.
    """
    proof = _proof(model, plan, probe_inputs, seed, max_condition, rtol, reference, True)
    assert proof is not None  # localised proofs always report
    return proof


def prove_at_once(
    model: torch.nn.Module,
    plan: SymmetryPlan | BoundPlan,
    probe_inputs: Any = None,
    *,
    seed: int = 0,
    max_condition: float = 4.0,
    rtol: Optional[float] = None,
    reference: Optional[ReferencePass] = None,
) -> Optional[PlanProof]:
    """:func:`prove_plan` when every group holds, in two forward passes (three where the
    tolerance is raised to the model's rounding); ``None`` when the outputs refute the
    plan, with nothing localised (no bisection).

    The reference pass and the pass with every group acted on are those of
    :func:`prove_plan` (same seed, same elements): where every group holds, the two
    return the same proof. A caller that can explain a failure more cheaply than by
    bisection (discovery replays the pairs it flagged on their modules) tries this first.

    Parameters
    ----------
    model, plan, probe_inputs, seed, max_condition, rtol, reference
        As for :func:`prove_plan`.

    Returns
    -------
    PlanProof or None
        The proof, every group holding; ``None`` if some group does not.
    """
    return _proof(model, plan, probe_inputs, seed, max_condition, rtol, reference, False)


def _proof(
    model, plan, probe_inputs, seed, max_condition, rtol, reference, localise
) -> Optional[PlanProof]:
    """The body of :func:`prove_plan` (``localise=False``: :func:`prove_at_once`)."""
    if reference is not None and probe_inputs is not None:
        raise ValueError("pass probe_inputs or reference, not both (the reference has inputs)")
    bound = plan if isinstance(plan, BoundPlan) else plan.bind(model)
    if reference is not None:
        probe_inputs = reference.inputs
    probe = as_probe(default_probe(model) if probe_inputs is None else probe_inputs)
    prover = _Prover(model, bound, probe, seed, reference)
    if not prover.groups:
        return PlanProof(rtol=rtol or 0.0, precision=prover.dtype)
    with preserved_model_state(model), without_autocast():
        try:
            reference, precision, grads = prover.reference()
        except Exception as error:
            if probe_inputs is not None or isinstance(error, PlanError):
                raise
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise ProbeError(
                f"the probe inputs built for {type(model).__name__} do not run it "
                f"({type(error).__name__}: {first}); pass probe_inputs= (a dict of keyword "
                "arguments, a tuple, a tensor or a function of the model), or verify=False"
            ) from error
        with torch.no_grad():
            return _prove(prover, reference, precision, grads, max_condition, rtol, localise)


def _prove(
    prover, reference, precision, grads, max_condition, rtol, localise
) -> Optional[PlanProof]:
    scale = _scale(reference)
    calibrate = rtol is None
    rtol = default_rtol(precision, prover.dtype) if rtol is None else rtol
    tol = rtol * max(scale, 1e-30)
    elements = prover.draw(max_condition)

    def change(acting: Sequence[Optional[torch.Tensor]], weights=None) -> float:
        weights = prover.acted(acting) if weights is None else weights
        moved = [t.detach().to(torch.float64) for t in prover.outputs(weights)]
        return _deviation(reference, moved)

    def changes(acting) -> bool:
        return change(acting) > tol

    def only(indices: List[int]) -> List[Optional[torch.Tensor]]:
        return [a if i in indices else None for i, a in enumerate(elements)]

    checked = [i for i, a in enumerate(elements) if a is not None]
    pair = prover.acted_pair(elements) if checked else None  # every group, and the controls
    acted = (pair and pair[0]) or (prover.acted(elements) if checked else {})
    largest = change(elements, acted) if checked else 0.0
    rounding = None
    trip = prover.round_trip(elements, acted) if largest > tol and calibrate else None
    if trip is not None:
        rounding = change(elements, trip)
        tol = max(tol, min(ROUND_TRIP_FACTOR * rounding, MAX_RAISE * tol))
        rtol = tol / max(scale, 1e-30)
    if largest > tol and not localise:
        return None
    failing = _bisect(checked, lambda part: changes(only(part))) if largest > tol else []
    checks = []
    controls = prover.controls(elements, grads, pair and pair[1])
    for i, (group, a) in enumerate(zip(prover.groups, elements)):
        control = controls[i]
        members = _failing_members(prover, i, a, changes) if i in failing else ()
        deviation = change(only([i])) if i in failing else None
        checks.append(GroupCheck(group.name, i not in failing, deviation, control, members))
    if failing:
        largest = change(only([i for i in checked if i not in failing])) if checked else 0.0
    return PlanProof(checks, tol, rtol, precision, largest, prover.forward_calls, rounding)


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
    """Check that every symmetric group of ``plan`` leaves the model's outputs unchanged,
    and raise if one does not (:func:`prove_plan` reports instead of raising).

    Parameters
    ----------
    model : torch.nn.Module
        Not mutated; it runs in eval mode.
    plan : SymmetryPlan or BoundPlan
        The plan to check; a :class:`SymmetryPlan` is bound to ``model`` first.
    probe_inputs : dict, tuple, torch.Tensor, callable or None
        As for :func:`prove_plan`.
    members : mapping, optional
        Group name -> module path of each entry of the group's leading dimension, used
        to name the modules that break.
    seed : int
        Seed of the random group elements.
    max_condition : float
        Bound on the condition number of the random elements.
    rtol : float, optional
        Tolerance relative to the largest output magnitude (default by the precision the
        model computes in: 1e-6 for float64, 1e-4 for float32, ``HALF_RTOL_EPS`` = 8
        machine epsilons for bfloat16 and float16).

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
    if not bound.symmetric_groups:
        return ["verify: no symmetric group to check"]
    proof = prove_plan(
        model, bound, probe_inputs, seed=seed, max_condition=max_condition, rtol=rtol
    )
    if proof.failed:
        raise SymmetryVerificationError(failure_message(model, proof.failed[0], proof, members))
    return proof.notes()


def failure_message(
    model: torch.nn.Module,
    check: GroupCheck,
    proof: PlanProof,
    members: Optional[Mapping[str, Sequence[str]]] = None,
) -> str:
    """Why ``check``'s group is not a symmetry of ``model``: its deviation and modules."""
    names = (members or {}).get(check.name)
    where = ""
    if check.failing_members and (names is None or len(names) > 1):
        first = check.failing_members[0]
        module = names[first] if names and first < len(names) else str(first)
        where = f" (first failing member: {module})"
    deviation = check.deviation if check.deviation is not None else float("nan")
    return (
        f"group {check.name!r} is not a symmetry of {type(model).__name__}{where}: a random "
        f"group element changes the outputs by {deviation:.3g} (tolerance "
        f"{proof.tolerance:.3g}). The detector recognised this module by its structure, but "
        "the model computes something else; drop the group or write the plan by hand"
    )
