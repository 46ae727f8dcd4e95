r"""Several sharpness measures of one model, by name, on the same batches.

The names are those of the population studies: ``"adaptive"``, ``"geodesic_inv"``,
``"geodesic_mix"`` and the ablations of Appendix G of "Hide & Seek"
(``"geodesic_mix_no_norm"``: the adaptive ball walked along the quotient's geodesics;
``"geodesic_mix_no_curvature"``: the quotient ball walked along straight lines). Each is
:func:`~geoopt_quotient.geodesic_sharpness` or :func:`~geoopt_quotient.adaptive_sharpness`
with the matching switches; the symmetries are discovered once per metric and call.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch

from .._checks import check_choice, check_positive_float
from ..measures import ABLATIONS, NAMED_MEASURES, Measure
from ..sharpness import DEFAULT_RADII, SharpnessResult, adaptive_sharpness, geodesic_sharpness
from ..sharpness.measure import discover, loss_probe
from ..symmetry import BoundPlan, SymmetryPlan

__all__ = [
    "ABLATIONS",
    "NAMED_MEASURES",
    "default_measure_radius",
    "measure_radii",
    "measure_sharpness",
]

Radius = Union[float, Sequence[float]]
Radii = Union[None, Radius, Mapping[str, Radius]]


def default_measure_radius(measure: str) -> float:
    """The default radius of a named measure: that of its ball in
    :data:`~geoopt_quotient.sharpness.DEFAULT_RADII`.

    ``"adaptive"`` and the no-norm ablations (``"geodesic_M_no_norm"``, the adaptive
    ball) take the adaptive radius; ``"geodesic_M"`` and its no-curvature ablation (the
    ``M`` ball) take metric ``M``'s, as in the ``population`` command.

    Parameters
    ----------
    measure : str
        A name from :data:`NAMED_MEASURES` or :data:`ABLATIONS`.

    Returns
    -------
    float
        The radius.

    Examples
    --------
    >>> from geoopt_quotient.integrations import default_measure_radius
    >>> [default_measure_radius(m) for m in ("adaptive", "geodesic_inv", "geodesic_mix")]
    [0.01, 0.003, 0.003]
    >>> default_measure_radius("geodesic_mix_no_norm")
    0.01
    """
    return DEFAULT_RADII[named_measure(measure).ball]


def named_measure(measure: str) -> Measure:
    """The :class:`~geoopt_quotient.Measure` of a name from :data:`NAMED_MEASURES` or
    :data:`ABLATIONS` (the names this module measures).

    Raises
    ------
    ValueError
        For any other name (also the short names of :class:`~geoopt_quotient.Measure`:
        the path is :func:`measure_sharpness`'s argument here).
    """
    return Measure.parse(check_choice(measure, (*NAMED_MEASURES, *ABLATIONS), "measure"))


def measure_radii(measures: Sequence[str], rho: Radii = None) -> Dict[str, Radius]:
    """The radius of each measure: ``rho`` for all, ``rho[measure]`` from a mapping, or
    each measure's default.

    Parameters
    ----------
    measures : sequence of str
        Names from :data:`NAMED_MEASURES` and :data:`ABLATIONS`.
    rho : float, mapping of str to float, or None
        One radius for every measure, or one per measure (radii of different balls are
        on different scales: :func:`~geoopt_quotient.calibrate_rho`). ``None``
        (default): each measure's default radius (:func:`default_measure_radius`: 0.01
        adaptive, 0.003 ``inv``, 0.003 ``mix``), as the sharpness functions and the
        command line take them. A radius may be a sequence of radii, a grid, monotone
        by construction (:func:`~geoopt_quotient.geodesic_sharpness`).

    Returns
    -------
    dict of str to float or list of float
        The radius (or the list of radii of a grid) of each measure, in the order of
        ``measures``.

    Raises
    ------
    ValueError
        For an unknown or repeated measure, a mapping without some measure's radius, a
        radius for a measure not asked for, or a radius that is not finite and > 0.
    """
    if not measures:
        raise ValueError(f"no measures; give some of {[*NAMED_MEASURES, *ABLATIONS]}")
    if len(set(measures)) != len(measures):
        raise ValueError(f"`measures` lists a measure twice: {list(measures)}")
    for measure in measures:
        named_measure(measure)
    if rho is None:
        return {m: default_measure_radius(m) for m in measures}
    if not isinstance(rho, Mapping):
        return {m: _checked_radius(rho, "rho") for m in measures}
    missing = [m for m in measures if m not in rho]
    extra = [m for m in rho if m not in measures]
    if missing or extra:
        raise ValueError(
            f"`rho` must give the radius of each measure and no other: missing {missing}, "
            f"not measured {extra}"
        )
    return {m: _checked_radius(rho[m], f"rho[{m!r}]") for m in measures}


def _checked_radius(value: Radius, name: str) -> Radius:
    """A radius (finite, > 0), or a non-empty list of them for a sequence."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not value:
            raise ValueError(f"`{name}` is an empty sequence: give at least one radius")
        return [check_positive_float(r, name) for r in value]
    return check_positive_float(value, name)


def measure_sharpness(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Sequence[Any],
    measures: Sequence[str],
    rho: Radii = None,
    *,
    iters: int = 20,
    kind: str = "worst",
    path: str = "second_order",
    seed: int = 0,
    eps: float = 0.0,
    verify: bool = True,
    probe_inputs: Any = None,
    plans: Optional[Dict[str, BoundPlan]] = None,
    on_measure: Optional[Callable[[str], None]] = None,
    distributed: Optional[bool] = False,
    share_storage: bool = False,
    state_dtype: Union[torch.dtype, str, None] = None,
) -> Dict[str, Union[SharpnessResult, List[SharpnessResult]]]:
    r"""Every measure in ``measures`` of ``model`` on ``batches``, in that order.

    ``"adaptive"`` is :func:`~geoopt_quotient.adaptive_sharpness`; ``"geodesic_M"`` is
    :func:`~geoopt_quotient.geodesic_sharpness` in metric ``M``; ``"geodesic_M_no_norm"``
    the same with ``norm=False`` (adaptive ball, quotient paths) and
    ``"geodesic_M_no_curvature"`` with ``curvature=False`` (quotient ball, straight
    paths). Each measures

    .. math::

        S(w) = \frac1B \sum_{b=1}^B \Big[\max_{|\xi|_w \le \rho} L_b(\gamma_\xi(1))
            - L_b(w)\Big]

    in its ball and along its paths (the mean over the ball with ``kind="average"``).

    Parameters
    ----------
    model : torch.nn.Module
        Never written to; its mode, ``requires_grad`` flags and the RNG state are
        restored (as by the sharpness functions, which measure in eval mode).
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``.
    batches : sequence
        The batches, the same for every measure.
    measures : sequence of str
        Names from :data:`NAMED_MEASURES` and :data:`ABLATIONS`.
    rho : float, mapping of str to float, or None
        One radius, one per measure, or ``None`` (default): each measure's default
        radius (:func:`measure_radii`). A sequence of radii in place of a radius is a
        grid: that measure's result is then a list, one result per radius
        (:func:`~geoopt_quotient.geodesic_sharpness`).
    iters, kind, path, seed, eps
        As for :func:`~geoopt_quotient.geodesic_sharpness` (``path`` is that of the
        geodesic measures; adaptive sharpness and the no-curvature ablations walk
        straight lines).
    verify : bool
        Prove the discovered symmetries on the model (default; one discovery serves every
        metric, :meth:`~geoopt_quotient.SymmetryPlan.with_metric`); ``False``: by module
        structure alone.
    probe_inputs : object
        Inputs of the proof, as for :func:`~geoopt_quotient.find_symmetries`; default
        built from the model's config, else ``loss_fn`` on the first batch.
    plans : dict or None
        Filled with the bound plan of each metric discovered (metric name -> plan).
    on_measure : callable or None
        Called with each measure's name before it is measured.
    distributed : bool or None
        As for :func:`~geoopt_quotient.geodesic_sharpness` (default ``False``: this
        process measures every batch).
    share_storage : bool
        As for :func:`~geoopt_quotient.geodesic_sharpness`: the worst case's base point
        in the model's own storage, which the parameters move into (default ``False``).
    state_dtype : torch.dtype, str or None
        As for :func:`~geoopt_quotient.geodesic_sharpness`: the dtype of Auto-PGD's
        iterates and gradients (``torch.bfloat16`` for a bfloat16 model's in bfloat16;
        default ``None``, float32 or better).

    Returns
    -------
    dict of str to SharpnessResult or list of SharpnessResult
        The result of each measure (a list for a grid of radii).

    Raises
    ------
    ValueError
        For unknown measures or radii (:func:`measure_radii`), and as the sharpness
        functions.
    """
    radii = measure_radii(measures, rho)
    plans = {} if plans is None else plans
    found: List[SymmetryPlan] = []
    common = dict(
        iters=iters,
        kind=kind,
        seed=seed,
        progress=False,
        distributed=distributed,
        share_storage=share_storage,
        state_dtype=state_dtype,
    )
    results: Dict[str, Union[SharpnessResult, List[SharpnessResult]]] = {}
    for measure, radius in radii.items():
        if on_measure is not None:
            on_measure(measure)
        named = named_measure(measure)
        metric = named.metric
        if named.is_adaptive:
            results[measure] = adaptive_sharpness(
                model, loss_fn, batches, rho=radius, eps=eps, **common
            )
            continue
        if metric not in plans:
            if not found:  # one discovery (and proof); the other metric's plan follows it
                fallback = loss_probe(loss_fn, batches) if probe_inputs is None else None
                found.append(
                    discover(
                        model,
                        metric,
                        eps,
                        fallback=fallback,
                        verify=verify,
                        probe_inputs=probe_inputs,
                    )
                )
            plans[metric] = found[0].with_metric(metric, eps).bind(model)
        results[measure] = geodesic_sharpness(
            model,
            loss_fn,
            batches,
            rho=radius,
            symmetries=plans[metric],
            metric=metric,
            path=path,
            norm=named.norm,
            curvature=named.curvature,
            **common,
        )
    return results
