r"""Sharpness measured during training, without changing the training.

:class:`SharpnessMonitor` measures named sharpness measures
(:func:`~geoopt_quotient.integrations.measures.measure_sharpness`) on held-out batches
every few optimizer steps of a hand-written loop; the Hugging Face callback
(:class:`~geoopt_quotient.integrations.SharpnessCallback`) wraps it. A measurement leaves
the training exactly as it was: the weights and their ``.grad`` tensors, the train/eval
flags of every module, ``requires_grad``, and the CPU and CUDA random number generators
(so that dropout masks and data order after the measurement are the same as without
it).

**Mode.** Sharpness is measured in eval mode (dropout off), as the sharpness functions
do: the maximiser needs a deterministic loss (with dropout on, each Auto-PGD iterate
would see a different network and the "worst case" would partly be the luckiest
mask), and the network whose sharpness predicts generalization is the one that is
evaluated. The modes are restored afterwards.
"""

from __future__ import annotations

import contextlib
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch

from .._checks import check_positive_int
from .._model_state import preserved_model_state
from ..measures import NAMED_MEASURES
from ..sharpness import SharpnessResult
from ..symmetry import BoundPlan
from .measures import Radii, measure_radii, measure_sharpness

__all__ = ["SharpnessMonitor", "default_loss", "measure_during_training"]


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` for a dict batch (a Hugging Face model given ``labels``).

    Parameters
    ----------
    model : torch.nn.Module
        A model that returns an output with a ``loss`` when called with the batch's
        keys.
    batch : mapping
        The model's keyword inputs, labels included.

    Returns
    -------
    torch.Tensor
        The loss.

    Raises
    ------
    TypeError
        If ``batch`` is not a mapping (give a ``loss_fn`` then).
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"the default loss calls model(**batch).loss and needs dict batches; got a "
            f"{type(batch).__name__}: pass loss_fn(model, batch) -> scalar tensor"
        )
    return model(**batch).loss


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested in mappings, lists, tuples) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


@contextlib.contextmanager
def training_untouched(model: torch.nn.Module) -> Iterator[None]:
    """Restore the ``.grad`` tensors (the objects themselves), the modules' train/eval
    flags, ``requires_grad`` and the CPU and CUDA RNG states on exit; eval mode inside."""
    grads = [(p, p.grad) for p in model.parameters()]
    with preserved_model_state(model, eval_mode=True):
        try:
            yield
        finally:
            for param, grad in grads:
                param.grad = grad


class SharpnessMonitor:
    r"""Named sharpness measures on held-out batches every ``every_n_steps`` steps.

    For a hand-written training loop::

        monitor = SharpnessMonitor(held_out, every_n_steps=100, rho=0.05)
        for step, batch in enumerate(loader, start=1):
            ...  # forward, backward, optimizer.step()
            values = monitor.step(model, step)  # a dict at steps 100, 200, ...; else None

    Each measurement computes, per measure, the sharpness

    .. math::

        S(w_t) = \frac1B \sum_{b=1}^B \Big[\max_{|\xi|_{w_t} \le \rho}
            L_b(\gamma_\xi(1)) - L_b(w_t)\Big]

    of the current weights :math:`w_t` on the held-out batches (the mean over the
    ball with ``kind="average"``), in eval mode, and leaves the training untouched:
    weights, ``.grad``, modes, ``requires_grad``, CPU and CUDA RNG states (module
    docstring). The batches are moved to the model's device.

    Parameters
    ----------
    batches : iterable
        The held-out batches, the same at every measurement (read once, at the first
        measurement, with the RNG state restored afterwards, so a shuffling
        ``DataLoader`` is fine and its order is fixed from then on).
    every_n_steps : int
        Measure at steps ``every_n_steps``, ``2 * every_n_steps``, ... (steps as given
        to :meth:`step`: count optimizer steps, not micro-batches).
    measures : sequence of str
        Names from :data:`~geoopt_quotient.integrations.NAMED_MEASURES` (default: all
        three) and :data:`~geoopt_quotient.integrations.ABLATIONS`.
    rho : float, mapping of str to float, or None
        One radius for every measure, or one per measure (radii of different balls are
        on different scales; :func:`~geoopt_quotient.calibrate_rho`). ``None``
        (default): each measure's default radius
        (:func:`~geoopt_quotient.integrations.measure_radii`: 0.01 adaptive, 0.003
        ``inv``, 0.003 ``mix``), as for the sharpness functions and the command line.
    loss_fn : callable or None
        ``loss_fn(model, batch) -> scalar tensor``; ``None``: :func:`default_loss`
        (``model(**batch).loss``).
    iters, kind, path, seed, eps
        As for :func:`~geoopt_quotient.geodesic_sharpness` (default 10 Auto-PGD
        iterations per batch: cheaper than the paper's 20).
    share_storage : bool
        As for :func:`~geoopt_quotient.geodesic_sharpness`: the worst case's base point in
        the model's own storage, one parameter-sized vector less at each measurement
        (default ``False``). The trainable parameters move, once, into one buffer per
        dtype and device (the same objects and values, which the optimizer keeps
        updating); the weights' values stay untouched.
    state_dtype : torch.dtype, str or None
        As for :func:`~geoopt_quotient.geodesic_sharpness`: ``torch.bfloat16`` keeps a
        bfloat16 model's Auto-PGD iterates and gradients in bfloat16, half their memory
        (default ``None``: float32 or better).
    prefix : str
        Prefix of the keys of the values (default ``"sharpness/"``; e.g.
        ``"sharpness/geodesic_mix"``).

    Attributes
    ----------
    history : list of dict
        One entry per measurement: ``step`` and the values.
    results : dict of str to SharpnessResult
        The full results of the last measurement.
    plans : dict of str to BoundPlan
        The symmetry plan of each metric, discovered and proven at the first geodesic
        measurement and reused by the later ones while the model's trainable parameters
        keep their names, shapes and dtypes (else discovered again): a measurement then
        pays for its Auto-PGD iterations only, and every measurement of a run uses one
        geometry. Clear it to discover again (e.g. once a LoRA adapter's second factor,
        zero at initialisation, has left zero).

    Raises
    ------
    ValueError
        For unknown measures, missing radii or a non-positive ``every_n_steps``.

    Examples
    --------
    >>> import torch
    >>> from geoopt_quotient.integrations import SharpnessMonitor
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> held_out = [(torch.randn(16, 3), torch.randn(16, 1))]
    >>> def loss_fn(model, batch):
    ...     x, y = batch
    ...     return torch.nn.functional.mse_loss(model(x), y)
    >>> monitor = SharpnessMonitor(
    ...     held_out, every_n_steps=2, measures=["adaptive"], rho=0.05, loss_fn=loss_fn, iters=3
    ... )
    >>> [monitor.step(model, step) is None for step in (1, 2, 3)]
    [True, False, True]
    >>> sorted(monitor.history[0])
    ['sharpness/adaptive', 'step']
    """

    def __init__(
        self,
        batches: Iterable[Any],
        every_n_steps: int,
        measures: Sequence[str] = NAMED_MEASURES,
        rho: Radii = None,
        *,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        iters: int = 10,
        kind: str = "worst",
        path: str = "second_order",
        seed: int = 0,
        eps: float = 0.0,
        prefix: str = "sharpness/",
        share_storage: bool = False,
        state_dtype: Union[torch.dtype, str, None] = None,
    ):
        self.every_n_steps = check_positive_int(every_n_steps, "every_n_steps")
        self.measures = tuple(measures)
        self.rho = measure_radii(self.measures, rho)
        if any(isinstance(radius, list) for radius in self.rho.values()):
            raise ValueError("`rho`: the monitor takes one radius per measure, not a grid")
        self.loss_fn = default_loss if loss_fn is None else loss_fn
        self.options = dict(
            iters=iters,
            kind=kind,
            path=path,
            seed=seed,
            eps=eps,
            share_storage=share_storage,
            state_dtype=state_dtype,
        )
        self.prefix = prefix
        self._source = batches
        self._batches: Optional[List[Any]] = None
        self.history: List[Dict[str, Any]] = []
        self.results: Dict[str, SharpnessResult] = {}
        self.plans: Dict[str, BoundPlan] = {}
        self._plans_for: Optional[Tuple] = None
        self._last_step: Optional[int] = None

    def due(self, step: int) -> bool:
        """Whether :meth:`step` measures at ``step`` (a multiple of ``every_n_steps`` not
        measured yet)."""
        return step > 0 and step % self.every_n_steps == 0 and step != self._last_step

    def step(self, model: torch.nn.Module, step: int) -> Optional[Dict[str, float]]:
        """Measure if ``step`` is due (:meth:`due`); the values by key, else ``None``."""
        if not self.due(step):
            return None
        values = self.measure(model)
        self._last_step = step
        self.history.append({"step": step, **values})
        return values

    def measure(self, model: torch.nn.Module) -> Dict[str, float]:
        """Measure now: ``{prefix + measure: value}``, training left untouched."""
        device = model_device(model)
        trainable = _trainable_signature(model)
        if trainable != self._plans_for:  # another model, or parameters (un)frozen
            self.plans.clear()
            self._plans_for = trainable
        with training_untouched(model):
            batches = [to_device(b, device) for b in self._held_out()]
            self.results = measure_sharpness(
                model,
                self.loss_fn,
                batches,
                self.measures,
                self.rho,
                plans=self.plans,
                **self.options,
            )
        return {f"{self.prefix}{m}": r.value for m, r in self.results.items()}

    def _held_out(self) -> List[Any]:
        if self._batches is None:
            self._batches = list(self._source)
            if not self._batches:
                raise ValueError("SharpnessMonitor: `batches` is empty")
        return self._batches


def _trainable_signature(model: torch.nn.Module) -> Tuple:
    """Name, shape and dtype of each trainable parameter: what a bound plan depends on."""
    return tuple(
        (name, tuple(p.shape), p.dtype) for name, p in model.named_parameters() if p.requires_grad
    )


def measure_during_training(
    model: torch.nn.Module,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]],
    batches: Iterable[Any],
    measures: Sequence[str] = NAMED_MEASURES,
    rho: Radii = None,
    **options: Any,
) -> Dict[str, float]:
    r"""Measure once, in the middle of training, and leave the training untouched.

    :meth:`SharpnessMonitor.measure` without the schedule: per measure the sharpness
    :math:`S(w)` of the current weights on ``batches``, in eval mode, with the weights,
    ``.grad``, modes, ``requires_grad`` and CPU/CUDA RNG states as they were.

    Parameters
    ----------
    model : torch.nn.Module
        The model being trained.
    loss_fn : callable or None
        ``loss_fn(model, batch) -> scalar tensor``; ``None``: ``model(**batch).loss``.
    batches : iterable
        Held-out batches (moved to the model's device).
    measures : sequence of str
        As for :class:`SharpnessMonitor`.
    rho : float, mapping of str to float, or None
        One radius, one per measure, or ``None`` (default): each measure's default, as
        for :class:`SharpnessMonitor`.
    **options
        ``iters``, ``kind``, ``path``, ``seed``, ``eps``, ``prefix``, as for
        :class:`SharpnessMonitor`.

    Returns
    -------
    dict of str to float
        ``{prefix + measure: value}`` (``prefix`` default ``"sharpness/"``).

    Examples
    --------
    >>> import torch
    >>> from geoopt_quotient.integrations import measure_during_training
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    >>> x = torch.randn(4, 5, 8)
    >>> def loss_fn(model, x):
    ...     return model(x, x, x)[0].pow(2).mean()
    >>> values = measure_during_training(model, loss_fn, [x], ["geodesic_mix"], rho=0.1, iters=3)
    >>> list(values), values["sharpness/geodesic_mix"] > 0
    (['sharpness/geodesic_mix'], True)
    """
    monitor = SharpnessMonitor(batches, 1, measures, rho, loss_fn=loss_fn, **options)
    return monitor.measure(model)
