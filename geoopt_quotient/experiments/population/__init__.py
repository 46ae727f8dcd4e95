"""Population studies: does a sharpness measure track generalization across many models?

:mod:`~geoopt_quotient.experiments.population.study` measures any directory of Hugging Face
classifier checkpoints; :mod:`~geoopt_quotient.experiments.population.digits` trains a population of
small vision transformers on CPU to run it on.
"""

from .study import (
    ABLATIONS,
    MEASURES,
    MIN_MODELS,
    PAPER_TAU,
    StudySettings,
    few_models_warning,
    find_checkpoints,
    format_tau_table,
    measure_model,
    read_gaps,
    run_population,
    scatter_figure,
    tau_table,
)

__all__ = [
    "ABLATIONS",
    "MEASURES",
    "MIN_MODELS",
    "PAPER_TAU",
    "StudySettings",
    "few_models_warning",
    "find_checkpoints",
    "format_tau_table",
    "measure_model",
    "read_gaps",
    "run_population",
    "scatter_figure",
    "tau_table",
]
