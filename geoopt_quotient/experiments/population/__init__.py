"""Population studies: does a sharpness measure track generalization across many models?

:mod:`~geoopt_quotient.experiments.population.study` measures any directory of Hugging Face
classifier checkpoints; :mod:`~geoopt_quotient.experiments.population.digits` trains a population of
small vision transformers on CPU to run it on;
:func:`~geoopt_quotient.experiments.population.measure_population` runs the same study on
models in memory, and :mod:`~geoopt_quotient.experiments.population.report` turns a
study's document into figures and tables (CSV, pandas).
"""

from .in_memory import measure_population
from .report import (
    figure_title,
    population_frames,
    population_rows,
    read_rows_csv,
    tau_rows,
    write_population_files,
    write_rows_csv,
)
from .study import (
    ABLATIONS,
    MEASURES,
    MIN_MODELS,
    PAPER_TAU,
    JointModels,
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
    "JointModels",
    "StudySettings",
    "few_models_warning",
    "figure_title",
    "find_checkpoints",
    "format_tau_table",
    "measure_model",
    "measure_population",
    "population_frames",
    "population_rows",
    "read_gaps",
    "read_rows_csv",
    "run_population",
    "scatter_figure",
    "tau_rows",
    "tau_table",
    "write_population_files",
    "write_rows_csv",
]
