r"""Run a user's ``loss_fn(model, batch)`` on perturbed parameters, never on stale ones.

Sharpness evaluates :math:`L_b(w')` at perturbed parameters :math:`w'` by calling the
user's ``loss_fn(model, batch)``. For every use of the parameters inside that call to
see :math:`w'` (calls of the model or of any submodule, ``.forward``, attribute reads
such as ``m.classifier.weight``, iteration over ``m.parameters()``, tied weights, and the
model object a loss closes over), :class:`PerturbedLoss` swaps the perturbed tensors
into the real module for the duration of the call and puts the original parameters back
on every exit, exceptions and ``KeyboardInterrupt`` included. Nothing is written into
the parameters, so the model is bitwise unchanged afterwards.

Two ways of writing a loss cannot be measured, and are refused rather than measured
wrongly: a loss whose value has no autograd path to any perturbed parameter
(:class:`IndependentLossError`), and a loss that uses a parameter tensor it got before
the call, which the swap cannot reach (:class:`StaleParameterError`, checked on the
first evaluation).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Tuple

import torch
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..errors import GeooptQuotientError

__all__ = [
    "IndependentLossError",
    "LossFnError",
    "PerturbedLoss",
    "StaleParameterError",
    "add_note",
    "check_batches",
    "check_loss_fn",
    "check_loss_value",
    "noting_batch",
    "trainable_parameters",
]

LossFn = Callable[[Any, Any], torch.Tensor]

#: How to write a loss that every perturbation reaches (quoted by the errors).
LOSS_FN_RULE = (
    "compute the loss from the model passed to loss_fn(model, batch), inside the call: "
    "call it or its submodules, or read its parameters there (m.classifier.weight, "
    "m.parameters()), without torch.no_grad(), .detach() or .item() on the way"
)


class LossFnError(GeooptQuotientError, RuntimeError):
    """``loss_fn`` is written so that the perturbation would not reach its value."""


class IndependentLossError(LossFnError):
    """The loss has no autograd path to any perturbed parameter."""


class StaleParameterError(LossFnError):
    """The loss used a parameter tensor taken from the model before the call."""


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where Python has it (3.11+); otherwise nothing."""
    if hasattr(error, "add_note"):
        error.add_note(note)


@contextlib.contextmanager
def noting_batch(index: int) -> Iterator[None]:
    """Exceptions raised inside say which batch (of ``batches``) they came from."""
    try:
        yield
    except Exception as error:
        add_note(error, f"(while measuring batch {index} of `batches`, counted from 0)")
        raise


class _Carrier(torch.nn.Module):
    """Holds the model as its submodule ``model``, so that :func:`functional_call`
    swaps tensors into the real model around the whole ``loss_fn`` call."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Any:
        return self.loss_fn(self.model, batch)


class PerturbedLoss:
    """``loss_fn(model, batch)`` with the model's trainable parameters replaced by tensors.

    ``PerturbedLoss(model, loss_fn)(params, batch)`` swaps ``params`` (name to tensor, as
    in ``model.named_parameters()``) into ``model`` with :func:`torch.func.functional_call`
    (tied weights follow their tie: a tensor goes under every name of its parameter,
    found once), calls ``loss_fn(model, batch)`` and restores the
    original parameters on every exit. The first call also refuses a loss that uses one
    of the original parameters (:class:`StaleParameterError`), and warns when the loss is
    a bfloat16/float16 tensor.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn):
        check_loss_fn(loss_fn)
        self.model = model
        self._carrier = _Carrier(model, loss_fn)
        self._aliases = _tied_aliases(model)
        self._first_call = True

    def __call__(self, params: Mapping[str, torch.Tensor], batch: Any) -> Any:
        swapped = self._under_every_name(params)
        if not self._first_call:
            return self._call(swapped, batch)
        with _StaleParameterGuard(self.model, params), _noting_dtype_mismatch(params, batch):
            value = self._call(swapped, batch)
        self._first_call = False
        warn_if_low_precision_loss(value)
        return value

    def _under_every_name(self, params: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Each tensor under every name of its parameter (tied weights), as the carrier's
        names: functional_call then need not search the model for ties at every call."""
        swapped: Dict[str, torch.Tensor] = {}
        for name, tensor in params.items():
            for alias in self._aliases.get(name, (name,)):
                if swapped.setdefault(f"model.{alias}", tensor) is not tensor:
                    raise ValueError(
                        f"{name!r} and {alias!r} are one parameter in the model (tied), "
                        "but got different tensors"
                    )
        return swapped

    def _call(self, swapped: Dict[str, torch.Tensor], batch: Any) -> Any:
        return functional_call(self._carrier, swapped, (batch,), strict=False, tie_weights=False)


def check_loss_fn(loss_fn: Any) -> None:
    """Refuse a ``loss_fn`` that cannot be called as ``loss_fn(model, batch)``."""
    if not callable(loss_fn):
        raise TypeError("`loss_fn` must be callable as loss_fn(model, batch) -> scalar tensor")


def check_batches(batches: Any) -> None:
    """Refuse a single batch given where an iterable of batches is expected."""
    if isinstance(batches, Mapping):
        raise TypeError(
            "`batches` is a single batch (a dict; iterating it gives its keys): pass an "
            "iterable of batches, e.g. [batch] or a DataLoader"
        )


def check_loss_value(value: Any) -> None:
    """Refuse what ``loss_fn`` returned unless it is a scalar tensor, saying what to return."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return
        got, hint = f"a tensor of shape {tuple(value.shape)}", ": reduce it (e.g. .mean())"
    elif value is None:
        got, hint = "None", ": it returned nothing (a missing `return`?)"
    elif _model_output_loss(value) is not None:
        got, hint = type(value).__name__, ": return the model output's loss (m(**b).loss)"
    elif hasattr(value, "loss"):  # a Hugging Face ModelOutput without a loss
        got = type(value).__name__
        hint = (
            " with no loss: pass the labels in the batch (labels=...) and return .loss, or "
            "compute the loss from the logits"
        )
    else:
        got, hint = type(value).__name__, ""
    raise TypeError(f"the objective (loss_fn) must return a scalar tensor, got {got}{hint}")


def _model_output_loss(value: Any) -> Any:
    """The ``loss`` of a model output (a Hugging Face ``ModelOutput`` or a dict), or None."""
    if isinstance(value, Mapping):
        return value.get("loss")
    return None if isinstance(value, torch.nn.Module) else getattr(value, "loss", None)


@contextlib.contextmanager
def _noting_dtype_mismatch(params: Mapping[str, torch.Tensor], batch: Any) -> Iterator[None]:
    """An error in the loss names a batch whose floating tensors have another dtype than
    the model's parameters (e.g. float32 inputs to a float64 model)."""
    try:
        yield
    except Exception as error:
        wanted = {p.dtype for p in params.values() if p.is_floating_point()}
        leaves, _ = tree_flatten(batch)
        given = {t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if wanted and given and not given <= wanted:
            add_note(
                error,
                f"(the batch holds {_dtype_names(given)} tensors but the model's parameters are "
                f"{_dtype_names(wanted)}: convert the batch's floating tensors to the model's "
                "dtype, or the model to the batch's)",
            )
        raise


def _dtype_names(dtypes: Any) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def _tied_aliases(model: torch.nn.Module) -> Dict[str, Tuple[str, ...]]:
    """For each parameter registered under several names (tied weights), all its names."""
    names_of: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return {name: tuple(names) for names in names_of.values() if len(names) > 1 for name in names}


class _StaleParameterGuard(TorchFunctionMode):
    """Raises :class:`StaleParameterError` when an operation reads the storage of a
    parameter that is swapped out (a reference the loss took before the call)."""

    #: Operations that read a tensor's metadata, not its values.
    METADATA = frozenset(
        "__get__ __hash__ __repr__ __format__ size dim ndimension numel nelement stride "
        "element_size is_floating_point is_complex is_contiguous storage_offset "
        "untyped_storage data_ptr".split()
    )

    def __init__(self, model: torch.nn.Module, params: Mapping[str, torch.Tensor]):
        super().__init__()
        # by storage, the swapped-out parameters in it (several where they share one)
        self.swapped_out: Dict[int, List[Tuple[int, str]]] = {}
        for name, original in model.named_parameters():
            new = params.get(name)
            if new is not None and _storage(new) != _storage(original):
                entry = (original.data_ptr(), name)
                self.swapped_out.setdefault(_storage(original), []).append(entry)  # type: ignore[arg-type]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in self.METADATA:
            for item in tree_flatten((args, kwargs))[0]:
                if isinstance(item, torch.Tensor) and _storage(item) in self.swapped_out:
                    raise StaleParameterError(self._message(self._name(item)))
        return func(*args, **kwargs)

    def _name(self, item: torch.Tensor) -> str:
        """The swapped-out parameter whose entries ``item`` reads (the last that starts
        at or before it, in the storage it shares with others)."""
        entries = sorted(self.swapped_out[_storage(item)])  # type: ignore[index]
        before = [name for start, name in entries if start <= item.data_ptr()]
        return before[-1] if before else entries[0][1]

    @staticmethod
    def _message(name: str) -> str:
        return (
            f"loss_fn used the unperturbed parameter {name!r} (a tensor taken from the model "
            "before the call: a reference kept outside loss_fn, or an attribute that caches "
            "it), which the perturbation cannot reach; the sharpness would be wrong. "
            f"Instead, {LOSS_FN_RULE}"
        )


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of a tensor's storage (``None`` for tensors without one)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def check_depends_on_perturbation(value: torch.Tensor, grads_found: bool) -> None:
    """Raise :class:`IndependentLossError` unless the value was differentiable in at
    least one perturbed parameter (``grads_found``: some gradient was not ``None``)."""
    if value.requires_grad and grads_found:
        return
    raise IndependentLossError(
        "loss_fn's value has no autograd path to any perturbed parameter, so no "
        "perturbation can change it and its sharpness would be 0 whatever the model. "
        "Parameters the loss does not use are fine, but it must depend on some: "
        f"{LOSS_FN_RULE}"
    )


#: Relative resolution of the low-precision floating-point dtypes.
RESOLUTION = {torch.bfloat16: "2⁻⁸", torch.float16: "2⁻¹¹"}


def warn_if_low_precision_loss(value: Any) -> None:
    """Warn that a bfloat16/float16 loss rounds the sharpness, a difference of losses."""
    dtype = getattr(value, "dtype", None)
    if dtype in RESOLUTION:
        warnings.warn(
            f"loss_fn returns a {dtype} loss (relative resolution {RESOLUTION[dtype]}): "
            "sharpness is a small difference of two losses, which that rounding can quantise "
            "or make exactly 0; compute the loss in float32, e.g. "
            "cross_entropy(logits.float(), labels)",
            stacklevel=5,
        )


def trainable_parameters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Detached views (no copies) of the model's trainable parameters."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
