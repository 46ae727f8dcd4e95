"""The diagonal-network experiment of "Hide & Seek": data, training, sharpness, closed forms."""

from .analytic import (
    WorstCase,
    adaptive_worst_case,
    first_order_worst_case,
    inv_worst_case,
    mix_ball_worst_case,
    mix_closed_form_valid,
    mix_retraction_one_coordinate,
    mix_retraction_product,
    mix_worst_case,
    mix_worst_case_clamped,
)
from .data import SparseRegression, make_sparse_regression, recovery_threshold
from .experiment import (
    MEASURES,
    PAPER_TAU,
    SETUPS,
    format_table,
    measure_names,
    run_diagonal,
    summarize_runs,
)
from .train import (
    TrainedPopulation,
    sample_hyperparameters,
    sample_step_size_hyperparameters,
    train_population,
    train_schedule_population,
)

__all__ = [
    "MEASURES",
    "PAPER_TAU",
    "SETUPS",
    "SparseRegression",
    "TrainedPopulation",
    "WorstCase",
    "adaptive_worst_case",
    "first_order_worst_case",
    "format_table",
    "inv_worst_case",
    "make_sparse_regression",
    "measure_names",
    "mix_ball_worst_case",
    "mix_closed_form_valid",
    "mix_retraction_one_coordinate",
    "mix_retraction_product",
    "mix_worst_case",
    "mix_worst_case_clamped",
    "recovery_threshold",
    "run_diagonal",
    "sample_hyperparameters",
    "sample_step_size_hyperparameters",
    "summarize_runs",
    "train_population",
    "train_schedule_population",
]
