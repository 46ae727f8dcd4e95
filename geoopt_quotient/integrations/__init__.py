"""Sharpness in the tools researchers train with.

* :class:`SharpnessMonitor` and :func:`measure_during_training`: sharpness measured in
  a hand-written PyTorch loop, leaving weights, gradients, modes and RNG streams as they
  were;
* :class:`SharpnessCallback`: the same as a Hugging Face ``TrainerCallback`` that logs
  into the Trainer's logs (``log_history``, TensorBoard, W&B...);
* :class:`GeodesicSAMTrainer`: a Hugging Face ``Trainer`` whose step is GeodesicSAM's
  (or SAM's, or ASAM's) two passes, with the Trainer's optimizer, scheduler, clipping,
  gradient accumulation and mixed precision;
* :func:`measure_sharpness`: several named measures of one model on the same batches.

The Hugging Face classes import ``transformers`` on first access, so that this package
(and its plain-PyTorch names) stays light.
"""

import importlib
from typing import Any, List

from .measures import (
    ABLATIONS,
    NAMED_MEASURES,
    default_measure_radius,
    measure_radii,
    measure_sharpness,
)
from .monitor import SharpnessMonitor, default_loss, measure_during_training

__all__ = [
    "ABLATIONS",
    "NAMED_MEASURES",
    "GeodesicSAMTrainer",
    "SharpnessCallback",
    "SharpnessMonitor",
    "default_loss",
    "default_measure_radius",
    "measure_during_training",
    "measure_radii",
    "measure_sharpness",
]

#: Names that need ``transformers``, and the module each is defined in.
_HUGGING_FACE = {"SharpnessCallback": "callback", "GeodesicSAMTrainer": "trainer"}


def __getattr__(name: str) -> Any:
    if name in _HUGGING_FACE:
        value = getattr(importlib.import_module(f"{__name__}.{_HUGGING_FACE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
