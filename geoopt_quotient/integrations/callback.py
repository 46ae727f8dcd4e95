"""A Hugging Face ``TrainerCallback`` that logs sharpness during training."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
from transformers import TrainerCallback

from ..measures import NAMED_MEASURES
from .measures import Radii
from .monitor import SharpnessMonitor

__all__ = ["SharpnessCallback"]


class SharpnessCallback(TrainerCallback):
    r"""Measure sharpness on held-out batches every N optimizer steps, into the Trainer's logs.

    At every optimizer step :math:`t` that is a multiple of ``every_n_steps``
    (``state.global_step``: under gradient accumulation, optimizer steps, not
    micro-batches) it measures each measure's sharpness :math:`S(w_t)` of the model on
    ``batches`` (:class:`~geoopt_quotient.integrations.SharpnessMonitor`) and makes that
    step log: the values appear as ``"sharpness/<measure>"`` in the log of step
    :math:`t`, in ``trainer.state.log_history`` and for every logging integration
    (TensorBoard, W&B, ...) that runs after this callback. Training is not changed: the
    weights, gradients, train/eval modes, ``requires_grad`` and the CPU and CUDA RNG
    streams are as they were, so a run ends with bitwise the same weights with or
    without the callback.

    Parameters
    ----------
    batches : iterable
        Held-out batches: what the model takes (dicts of tensors with ``labels`` for the
        default loss), e.g. a few batches of the eval set through the data collator.
        Moved to the model's device.
    every_n_steps : int
        Measure at optimizer steps ``N``, ``2N``, ...
    measures : sequence of str
        ``"adaptive"``, ``"geodesic_inv"``, ``"geodesic_mix"`` (default: all three) and
        the ablations (:data:`~geoopt_quotient.integrations.ABLATIONS`).
    rho : float, mapping of str to float, or None
        One radius, one per measure, or ``None`` (default): each measure's default
        radius (:func:`~geoopt_quotient.integrations.measure_radii`: 0.01 adaptive, 0.003
        ``inv``, 0.003 ``mix``).
    loss_fn : callable or None
        ``loss_fn(model, batch) -> scalar tensor``; ``None``: ``model(**batch).loss``.
    **options
        ``iters`` (default 10), ``kind``, ``path``, ``seed``, ``eps``, ``prefix``, as
        for :class:`~geoopt_quotient.integrations.SharpnessMonitor`.

    Attributes
    ----------
    monitor : SharpnessMonitor
        The measurements so far (:attr:`SharpnessMonitor.history`) and the last full
        results.

    Notes
    -----
    **Mode.** Measured in eval mode (dropout off): the maximiser needs a deterministic
    loss, and the evaluated network is the one whose sharpness is of interest. The
    modes are put back before training goes on.

    **Order of callbacks.** The Trainer calls its callbacks in order and puts the
    reporting integrations of ``report_to`` before the ones passed as
    ``callbacks=[...]``; TensorBoard or W&B would then write a step's log before this
    callback adds the sharpness to it (``log_history`` has it either way). Add it with
    :meth:`attach` (``SharpnessCallback(...).attach(trainer)``), which puts it first;
    :class:`~geoopt_quotient.integrations.GeodesicSAMTrainer` does so for the
    callbacks it is given. Without that and with a ``report_to``, it warns at the start
    of training.

    How it logs: measuring in ``on_step_end``, it sets ``control.should_log``, so the
    Trainer logs that step; in ``on_log`` it adds the values to that log (the dict the
    later callbacks see) and to the entry the Trainer has just appended to
    ``log_history``.

    Examples
    --------
    ::

        callback = SharpnessCallback(held_out, every_n_steps=50, rho={
            "adaptive": 0.1, "geodesic_inv": 0.05, "geodesic_mix": 0.01})
        trainer = Trainer(model, args, train_dataset=train)
        callback.attach(trainer)
        trainer.train()
        [log for log in trainer.state.log_history if "sharpness/geodesic_mix" in log]
    """

    def __init__(
        self,
        batches: Iterable[Any],
        every_n_steps: int,
        measures: Sequence[str] = NAMED_MEASURES,
        rho: Radii = None,
        *,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        **options: Any,
    ):
        self.monitor = SharpnessMonitor(
            batches, every_n_steps, measures, rho, loss_fn=loss_fn, **options
        )
        self._pending: Optional[Tuple[int, Dict[str, float]]] = None
        self._first = False

    def attach(self, trainer: Any) -> SharpnessCallback:
        """Put this callback first among ``trainer``'s callbacks (before the reporting
        integrations, so that they see the sharpness values); returns ``self``."""
        handler = trainer.callback_handler
        handler.callbacks = [self] + [c for c in handler.callbacks if c is not self]
        self._first = True
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        reporting = [r for r in (args.report_to or []) if r not in ("none", "all")]
        reporting += ["all"] if "all" in (args.report_to or []) else []
        if reporting and not self._first:
            warnings.warn(
                f"SharpnessCallback: the Trainer calls the report_to integrations "
                f"{reporting} before the callbacks given as callbacks=[...], so they log "
                "each step before the sharpness values are added (log_history has them); "
                "add the callback with callback.attach(trainer) instead",
                UserWarning,
                stacklevel=2,
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        values = self.monitor.step(model, state.global_step)
        if values is not None:
            self._pending = (state.global_step, values)
            control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending is None or self._pending[0] != state.global_step or logs is None:
            return control
        _, values = self._pending
        self._pending = None
        logs.update(values)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step:
            last.update(values)
        return control
