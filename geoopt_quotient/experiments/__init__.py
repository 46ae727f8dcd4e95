"""The paper's experiments, on top of the library: not needed to measure sharpness.

* :mod:`~geoopt_quotient.experiments.diagonal`: diagonal linear networks (data,
  training, sharpness, closed forms);
* :mod:`~geoopt_quotient.experiments.population`: does sharpness track generalization
  across a population of transformers;
* :mod:`~geoopt_quotient.experiments.classifiers`, :mod:`~geoopt_quotient.experiments.causal_lm`,
  :mod:`~geoopt_quotient.experiments.images`, :mod:`~geoopt_quotient.experiments.model_soups`,
  :mod:`~geoopt_quotient.experiments.io`: checkpoints and data to measure them on;
* :mod:`~geoopt_quotient.experiments.records`: resumable JSON-lines results;
* :mod:`~geoopt_quotient.experiments.figures`: figures, drawn without pyplot.

Figures, the digits data set and image folders need the ``experiments`` extra
(``pip install -e '.[experiments]'`` in the clone); without it they raise
:class:`~geoopt_quotient._extras.MissingExtraError`, which names the extra. Subpackages
are imported on first attribute access.
"""

import importlib
from typing import Any, List

SUBMODULES = (
    "causal_lm",
    "classifiers",
    "diagonal",
    "figures",
    "images",
    "io",
    "model_soups",
    "population",
    "records",
)


def __getattr__(name: str) -> Any:
    if name not in SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(SUBMODULES))
