"""Hypothesis strategies and assertions for testing code that should respect symmetries.

Requires ``hypothesis``, which the ``testing`` extra installs
(``pip install -e '.[testing]'`` in the clone).
"""

from . import _needs  # noqa: F401  (first: names the extra if hypothesis is missing)
from .cuda import count_host_syncs, host_syncs_per_iteration
from .geometry import (
    batch_shapes,
    diagonal_points,
    full_rank_matrices,
    gl_elements,
    gl_points,
    horizontal_vectors,
    tangent_vectors,
)
from .invariance import assert_invariant, transformed_copy
from .models import (
    act_on_module,
    attention_blocks,
    group_elements_for,
    quotient_parameters,
    random_group_elements,
)

__all__ = [
    "act_on_module",
    "assert_invariant",
    "attention_blocks",
    "batch_shapes",
    "count_host_syncs",
    "diagonal_points",
    "full_rank_matrices",
    "gl_elements",
    "gl_points",
    "group_elements_for",
    "horizontal_vectors",
    "host_syncs_per_iteration",
    "quotient_parameters",
    "random_group_elements",
    "tangent_vectors",
    "transformed_copy",
]
