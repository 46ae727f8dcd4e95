r"""A Hugging Face ``Trainer`` whose step is sharpness-aware: GeodesicSAM, SAM or ASAM."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch
from transformers import Trainer

from .._checks import GEODESIC_PATHS, METRICS, check_choice, check_positive_float
from ..optim.sam import BALLS, SAMAscent
from ..sharpness import NonFiniteError
from ..sharpness.measure import Symmetries
from .callback import SharpnessCallback

__all__ = ["GeodesicSAMTrainer"]


class GeodesicSAMTrainer(Trainer):
    r"""A ``transformers.Trainer`` whose training step takes GeodesicSAM's two passes.

    Per optimizer step, over its micro-batches :math:`b_1, \dots, b_k`
    (``gradient_accumulation_steps = k``):

    1. the Trainer's forward and backward passes at :math:`w` accumulate
       :math:`g = \nabla L(w)` (the loss it logs is :math:`L(w)`);
    2. the ascent moves the weights to :math:`w' = R_w(\xi)`,
       :math:`\xi = \rho \operatorname{grad} L(w) / |\operatorname{grad} L(w)|_w`, in the
       ball's metric (:class:`~geoopt_quotient.optim.SAMAscent`, shared with
       :class:`~geoopt_quotient.optim.GeodesicSAM`);
    3. forward and backward passes at :math:`w'` over the same micro-batches give
       :math:`\nabla L(w')`, and the weights go back to :math:`w` bitwise;
    4. the Trainer clips :math:`\nabla L(w')` (``max_grad_norm``), and its own
       optimizer and learning-rate scheduler take the step from :math:`w`.

    Mixed precision (``bf16``, ``fp16``) runs the passes as the Trainer does; the ascent
    is computed in float32 or better outside autocast, and its direction does not depend
    on the loss scale. Checkpoints hold nothing beyond the Trainer's own state, so
    saving and resuming work as for the Trainer and continue identically.

    Parameters
    ----------
    *args
        Passed to ``transformers.Trainer`` (``model``, ``args``, ...).
    rho : float
        Radius of the ascent, in the ball's metric (default 0.05).
    metric : {"mix", "inv"}
        Metric of the discovered quotients (``ball="geodesic"``).
    ball : {"geodesic", "adaptive", "euclidean"}
        ``"geodesic"``: the quotient metric and its retraction (GeodesicSAM);
        ``"adaptive"``: ASAM; ``"euclidean"``: SAM.
    eps : float
        :math:`\varepsilon` of the adaptive metric :math:`\sum \xi^2 / (|w| + \varepsilon)^2`
        (ASAM's :math:`\eta`; default 0).
    path : {"second_order", "exact"}
        Retraction of the geodesic ball.
    symmetries : SymmetryPlan, list of SymmetryGroup or None
        As for :class:`~geoopt_quotient.optim.GeodesicSAM`; ``None`` discovers them in
        the model the Trainer trains, when training starts.
    **kwargs
        Passed to ``transformers.Trainer`` (``train_dataset``, ``callbacks``, ...).

    Raises
    ------
    ValueError
        For an unknown ``ball``, ``metric`` or ``path``, or a non-positive ``rho``.
    NotImplementedError
        Under DeepSpeed or FSDP (sharded parameters have no whole ascent).
    NonFiniteError
        During training, when the ascent would write a NaN/Inf into a weight (NaN/Inf
        gradients without a loss scaler); no weight is changed. Under ``fp16`` loss
        scaling an overflowing step skips its ascent and is skipped by the scaler, as in
        the Trainer.

    Warns
    -----
    ZeroAscentWarning
        When the gradient is 0 in the ball's metric (e.g. fresh LoRA adapters,
        :math:`B = 0`, with ``eps=0``): that step's ascent is skipped, it is the
        optimizer's step at :math:`w` alone.

    Notes
    -----
    A step costs two forward and backward passes per micro-batch, as SAM. The loss in
    the logs is the loss at :math:`w`. The symmetries are discovered at the first step;
    adapters that are rank-deficient then (fresh LoRA, :math:`B = 0`, on which the exact
    quotient is singular) are left to the adaptive geometry, and discovery runs again at
    the next steps until they are not, so that they get their :math:`\GL(r)` quotient
    once training has moved :math:`B`. Callbacks given here that are
    :class:`~geoopt_quotient.integrations.SharpnessCallback` are put first
    (:meth:`SharpnessCallback.attach`).

    Examples
    --------
    ::

        trainer = GeodesicSAMTrainer(
            model, TrainingArguments("out", max_steps=100), train_dataset=train,
            rho=0.05, ball="geodesic", metric="mix",
        )
        trainer.train()
    """

    def __init__(
        self,
        *args: Any,
        rho: float = 0.05,
        metric: str = "mix",
        ball: str = "geodesic",
        eps: float = 0.0,
        path: str = "second_order",
        symmetries: Symmetries = None,
        **kwargs: Any,
    ):
        self.sam_rho = check_positive_float(rho, "rho")
        self.sam_options: Dict[str, Any] = dict(
            metric=metric, ball=ball, eps=eps, path=path, symmetries=symmetries
        )
        check_choice(ball, BALLS, "ball")
        check_choice(metric, METRICS, "metric")
        check_choice(path, GEODESIC_PATHS, "path")
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise NotImplementedError("GeodesicSAMTrainer does not support DeepSpeed or FSDP")
        for callback in list(self.callback_handler.callbacks)[::-1]:
            if isinstance(callback, SharpnessCallback):
                callback.attach(self)
        self._sam_ascent: Optional[SAMAscent] = None
        self._sam_model: Optional[torch.nn.Module] = None
        self._sam_micro_batches: List[Tuple[Any, Any]] = []

    @property
    def sam_ascent(self) -> SAMAscent:
        """The ascent on the model being trained (made, with its symmetry plan, on first
        use, and again if the Trainer's model changes, e.g. with ``model_init``, or while
        discovery leaves rank-deficient adapters to the adaptive geometry)."""
        if (
            self._sam_ascent is None
            or self._sam_model is not self.model
            or _has_rank_deficient_notes(self._sam_ascent, self.sam_options)
        ):
            self._sam_ascent = SAMAscent(self.model, **self.sam_options)
            self._sam_model = self.model
        return self._sam_ascent

    def training_step(
        self, model: torch.nn.Module, inputs: Dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The Trainer's pass at :math:`w`; at the last micro-batch of an optimizer step,
        also the ascent and the passes at :math:`w'` (class docstring)."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._sam_micro_batches.append((inputs, num_items_in_batch))
        if self.accelerator.sync_gradients:
            micro_batches, self._sam_micro_batches = self._sam_micro_batches, []
            self._sam_second_pass(model, micro_batches)
        return loss

    def _sam_second_pass(self, model: torch.nn.Module, micro_batches: List[Tuple[Any, Any]]):
        ascent = self.sam_ascent
        try:
            ascent.perturb(self.sam_rho)
        except NonFiniteError:
            if self.accelerator.scaler is not None and not _finite_gradients(model):
                return  # an overflow: the scaler skips this step and lowers its scale
            raise
        try:
            model.zero_grad(set_to_none=True)
            for index, (inputs, items) in enumerate(micro_batches):
                last = index == len(micro_batches) - 1
                sync = contextlib.nullcontext() if last else self.accelerator.no_sync(model)
                with sync:
                    super().training_step(model, inputs, items)
        finally:
            ascent.restore()


def _has_rank_deficient_notes(ascent: SAMAscent, options: Dict[str, Any]) -> bool:
    """Whether discovery found adapters it left to the adaptive geometry because they were
    rank-deficient (fresh LoRA, B = 0): after a step they are not, so discover again."""
    if options["ball"] != "geodesic" or options["symmetries"] is not None:
        return False
    return any("rank-deficient" in note for note in ascent.plan.notes)


def _finite_gradients(model: torch.nn.Module) -> bool:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return all(bool(torch.isfinite(g).all()) for g in grads)
