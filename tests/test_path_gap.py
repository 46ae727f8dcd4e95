r"""The second-order path's report: relative path gap and the loss on the exact geodesic.

Expectations, derived (:mod:`geoopt_quotient.sharpness.path_gap`): the quotients'
retraction :math:`R_x(\xi) = x + \xi - \frac12 \Gamma_x(\xi, \xi)` agrees with the
geodesic to second order, so along a fixed direction the relative gap
:math:`|R_x(t u) - \operatorname{Exp}_x(t u)|_x / |t u|_x = c\, t^2 (1 + O(t))`: halving
:math:`t` divides it by 4. The adaptive parameters' straight line is only of first order
for their metric (geodesic :math:`w e^{\xi / w}`): halving divides it by 2. The loss gap
at the maximiser is :math:`O(\text{gap} \cdot \rho)`, the sharpness :math:`O(\rho)` or
:math:`O(\rho^2)`: their ratio grows with :math:`\rho`, so the warning (ratio above
:data:`PATH_GAP_TOLERANCE`) fires above some radius and not below it; where that radius
lies is the model's, measured here.
"""

import itertools
import math
import warnings

import pytest
import torch
from test_radius_grid import bert_case, llama_case

from geoopt_quotient import find_symmetries, geodesic_sharpness
from geoopt_quotient.sharpness import DEFAULT_RADII, PathGapWarning
from geoopt_quotient.sharpness.apgd import BallGroup
from geoopt_quotient.sharpness.functional import trainable_parameters
from geoopt_quotient.sharpness.path_gap import PATH_GAP_TOLERANCE, path_gap

CASES = {"bert": bert_case, "llama": llama_case}


def unit_direction(groups, seed=0):
    """A random horizontal direction of unit joint norm."""
    generator = torch.Generator().manual_seed(seed)
    u = [
        g.manifold.proju(
            g.point, torch.randn(g.point.shape, generator=generator, dtype=g.point.dtype)
        )
        for g in groups
    ]
    norm = math.sqrt(sum(float(g.manifold.inner(g.point, v, v).sum()) for g, v in zip(groups, u)))
    return [v / norm for v in u]


def gap_along(groups, direction, t):
    return path_gap(groups, groups, lambda points: torch.zeros(()), [t * v for v in direction])[0]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_relative_gap_is_second_order_on_quotients_first_order_on_adaptive(case, metric):
    model = CASES[case]()[0]
    plan = find_symmetries(model, metric=metric).bind(model)
    points = plan.gather(trainable_parameters(model))
    quotient = [
        BallGroup(x, g.manifold) for g, x in zip(plan.groups, points) if g.kind != "adaptive"
    ]
    adaptive = [
        BallGroup(x, g.manifold) for g, x in zip(plan.groups, points) if g.kind == "adaptive"
    ]
    assert quotient and adaptive
    t = DEFAULT_RADII[metric] / 16  # well inside the asymptotic range
    for groups, order in ((quotient, 2), (adaptive, 1)):
        direction = unit_direction(groups)
        gaps = [gap_along(groups, direction, t / 2**k) for k in range(3)]
        ratios = [a / b for a, b in itertools.pairwise(gaps)]
        assert all(g > 0 for g in gaps)
        # 2**order (1 + O(t)): within 10% of it, and nowhere near the other order's ratio
        assert all(abs(r / 2**order - 1) < 0.1 for r in ratios), (order, ratios)
    assert gap_along(quotient, unit_direction(quotient), 0.0) == 0.0  # xi = 0: same point


def measure(case, rho, metric="mix"):
    model, loss_fn, batches = CASES[case]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = geodesic_sharpness(model, loss_fn, batches, rho=rho, metric=metric, iters=5)
    return result, [w for w in caught if issubclass(w.category, PathGapWarning)]


def loss_gap_ratio(result):
    pairs = zip(result.exact_losses, result.perturbed_losses)
    return sum(abs(e - r) for e, r in pairs) / len(result.per_batch) / result.value


@pytest.mark.parametrize("case", sorted(CASES))
def test_warning_fires_at_a_large_radius_and_not_at_a_small_one(case):
    default = DEFAULT_RADII["mix"]
    small, small_warnings = measure(case, default / 8)
    large, large_warnings = measure(case, 4 * default)
    for result in (small, large):
        assert len(result.path_gaps) == len(result.exact_losses) == len(result.per_batch)
        # iters + 1 evaluations (the best gradient is kept) and one for the exact loss
        assert result.forward_passes == [5 + 1 + 1] * len(result.per_batch)
        assert result.backward_passes == [5] * len(result.per_batch)
    # the warning says what its definition says, read from the reported fields
    assert loss_gap_ratio(small) <= PATH_GAP_TOLERANCE and not small_warnings
    assert loss_gap_ratio(large) > PATH_GAP_TOLERANCE and large_warnings
    assert 'path="exact"' in str(large_warnings[0].message)
    # the maximiser's point moves further from the geodesic's at the larger radius
    assert min(large.path_gaps) > max(small.path_gaps) > 0


def test_exact_loss_on_the_default_inv_radius_and_other_paths():
    """At the default inv radius the path is faithful on the tiny Llama: the exact point's
    loss is close to the retraction's and above the clean loss. Other paths report
    nothing."""
    model, loss_fn, batches = llama_case()
    rho = DEFAULT_RADII["inv"]
    second = geodesic_sharpness(model, loss_fn, batches, rho=rho, metric="inv", iters=5)
    assert loss_gap_ratio(second) <= PATH_GAP_TOLERANCE
    assert all(e > c for e, c in zip(second.exact_losses, second.clean_losses))
    assert all(0 < g < 0.1 for g in second.path_gaps)
    rows = second.rows()
    assert [r["exact_loss"] for r in rows] == second.exact_losses
    assert [r["path_gap"] for r in rows] == second.path_gaps
    for path in ("exact", "straight"):
        other = geodesic_sharpness(
            model, loss_fn, batches, rho=rho, metric="inv", iters=5, path=path
        )
        assert other.path_gaps is None and other.exact_losses is None
        assert "path_gap" not in other.rows()[0]
    average = geodesic_sharpness(model, loss_fn, batches, rho=rho, iters=3, kind="average")
    assert average.path_gaps is None


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_large_groups_taken_a_slice_at_a_time_give_the_same_report(metric, monkeypatch):
    """The float64 copies of a large group are made a slice at a time (flat pieces of the
    adaptive buffers, batches of quotient points): the same gap and exact loss."""
    from geoopt_quotient.sharpness import path_gap as module

    model, loss_fn, batches = llama_case()
    whole = geodesic_sharpness(model, loss_fn, batches, rho=0.005, metric=metric, iters=2)
    monkeypatch.setattr(module, "SLICE_ENTRIES", 7)
    sliced = geodesic_sharpness(model, loss_fn, batches, rho=0.005, metric=metric, iters=2)
    assert sliced.perturbed_losses == whole.perturbed_losses
    for a, b in zip(sliced.path_gaps, whole.path_gaps):
        assert a == pytest.approx(b, rel=1e-9)
    assert sliced.exact_losses == pytest.approx(whole.exact_losses, rel=1e-12, abs=0)
