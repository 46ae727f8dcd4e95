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
from typing import Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_radius_grid import bert_case, llama_case

from geoopt_quotient import find_symmetries, geodesic_sharpness
from geoopt_quotient.manifolds import AdaptiveEuclidean, GeodesicDomainError, GLQuotient, _linalg
from geoopt_quotient.manifolds._linalg import block_length, compute_dtype
from geoopt_quotient.sharpness import PathGapWarning
from geoopt_quotient.sharpness.apgd import BallGroup
from geoopt_quotient.sharpness.functional import trainable_parameters
from geoopt_quotient.sharpness.path_gap import (
    ESTIMATE_BLOCK,
    ESTIMATE_CPU_BLOCK,
    GEODESIC_TOLERANCE,
    PATH_GAP_TOLERANCE,
    _adaptive_estimate,
    elementwise_gap,
    estimated_path_gap,
    expm1_minus_identity,
    path_gap,
    warn_if_estimated_path_gap,
)

CASES = {"bert": bert_case, "llama": llama_case}

#: The radii these tests are measured around on the tiny random-weight models (the default
#: radii before they were set on pretrained models), as in the path-gap table of the docs.
RADII = {"inv": 0.05, "mix": 0.01}


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
    t = RADII[metric] / 16  # well inside the asymptotic range
    for groups, order in ((quotient, 2), (adaptive, 1)):
        direction = unit_direction(groups)
        gaps = [gap_along(groups, direction, t / 2**k) for k in range(3)]
        ratios = [a / b for a, b in itertools.pairwise(gaps)]
        assert all(g > 0 for g in gaps)
        # 2**order (1 + O(t)): within 10% of it, and nowhere near the other order's ratio
        assert all(abs(r / 2**order - 1) < 0.1 for r in ratios), (order, ratios)
    assert gap_along(quotient, unit_direction(quotient), 0.0) == 0.0  # xi = 0: same point


def measure(case, rho, metric="mix", report=True):
    model, loss_fn, batches = CASES[case]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = geodesic_sharpness(
            model, loss_fn, batches, rho=rho, metric=metric, iters=5, path_report=report
        )
    return result, [w for w in caught if issubclass(w.category, PathGapWarning)]


def loss_gap_ratio(result):
    pairs = zip(result.exact_losses, result.perturbed_losses)
    return sum(abs(e - r) for e, r in pairs) / len(result.per_batch) / result.value


@pytest.mark.parametrize("case", sorted(CASES))
def test_warning_fires_at_a_large_radius_and_not_at_a_small_one(case):
    reference = RADII["mix"]
    small, small_warnings = measure(case, reference / 8)
    large, large_warnings = measure(case, 4 * reference)
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_estimate_warns_where_the_exact_report_does_without_integrating(case):
    """Without ``path_report`` no geodesic is integrated and no pass made for it, and the
    warning from the estimated gaps agrees with the exact report's: it fires at the large
    radius (loss differences of the order of the sharpness) and not at the small one."""
    reference = RADII["mix"]
    for rho, fires in ((reference / 8, False), (4 * reference, True)):
        estimated, estimated_warnings = measure(case, rho, report=False)
        reported, reported_warnings = measure(case, rho, report=True)
        assert estimated.path_gaps is None and estimated.exact_losses is None
        assert estimated.forward_passes == [5 + 1] * len(estimated.per_batch)
        assert estimated.per_batch == reported.per_batch  # the report changes no value
        assert estimated.estimated_path_gaps == reported.estimated_path_gaps
        assert bool(estimated_warnings) == bool(reported_warnings) == fires
    assert "path_report=True" in str(estimated_warnings[0].message)
    assert all(g > PATH_GAP_TOLERANCE for g in estimated.estimated_path_gaps)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_estimated_gap_near_the_closed_form_and_the_integrated_magnitude(case, metric):
    r"""On the adaptive parameters the estimate is the closed form's leading term
    (relative error below :math:`\max_i |a_i|`); on the quotients it is of third order
    (halving the step divides the relative estimate by 4, as the integrated gap) and of
    the integrated gap's magnitude (within a factor 4 either way, well inside the
    asymptotic range)."""
    model = CASES[case]()[0]
    plan = find_symmetries(model, metric=metric).bind(model)
    points = plan.gather(trainable_parameters(model))
    groups = [BallGroup(x, g.manifold) for g, x in zip(plan.groups, points)]
    adaptive = [g for g, p in zip(groups, plan.groups) if p.kind == "adaptive"]
    quotient = [g for g, p in zip(groups, plan.groups) if p.kind != "adaptive"]
    t = RADII[metric] / 16
    direction = unit_direction(adaptive)
    xi = [t * v for v in direction]
    ratios = [torch.where(g.point != 0, v / g.point, 0.0) for g, v in zip(adaptive, xi)]
    largest = max(float(a.abs().max()) for a in ratios)
    assert 0 < largest < 1
    assert estimated_path_gap(adaptive, adaptive, xi) == pytest.approx(
        path_gap(adaptive, adaptive, lambda points: torch.zeros(()), xi)[0], rel=largest
    )
    direction = unit_direction(quotient)
    estimates = [
        estimated_path_gap(quotient, quotient, [t / 2**k * v for v in direction]) for k in range(2)
    ]
    assert estimates[0] / estimates[1] == pytest.approx(4, rel=1e-3)
    assert 0.25 < estimates[0] / gap_along(quotient, direction, t) < 4
    assert estimated_path_gap(quotient, quotient, [0 * v for v in direction]) == 0.0


def test_estimated_warning_reads_the_weighted_mean_of_the_estimates():
    """The estimate's test: the sharpness-weighted mean of the gaps against the
    tolerance, NaN warns, negative batches weigh nothing."""
    tolerance = PATH_GAP_TOLERANCE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_estimated_path_gap([1.0, 1.0], [tolerance, tolerance], 0.1)
        warn_if_estimated_path_gap([2.0, -1.0], [tolerance / 2, 100.0], 0.1)
    for estimates in ([2.1 * tolerance, 0.0], [math.nan, 0.0]):
        with pytest.warns(PathGapWarning, match="estimated"):
            warn_if_estimated_path_gap([1.0, 1.0], estimates, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adaptive_estimate_sums_every_block_in_the_working_dtype(dtype):
    r"""The adaptive estimate's sums :math:`\tfrac14 \sum a^4, \sum a^2` of :math:`a =
    \xi / w` (0 where :math:`w = 0`), block by block with each block's sums in the
    working dtype: the float64 reference's within a rounding that scales with the
    dtype's epsilon and a block's length, over blocks that do not divide the vector, a
    non-finite ratio where :math:`w \ne 0` kept."""
    generator = torch.Generator().manual_seed(0)
    size = 3 * ESTIMATE_CPU_BLOCK + 123
    w = torch.randn(size, generator=generator, dtype=torch.float64)
    xi = 0.1 * torch.randn(size, generator=generator, dtype=torch.float64) * w
    w[::97] = 0.0
    xi[::194] = 0.0  # 0 / 0 and nonzero / 0 both count as 0
    a = torch.where(w != 0, xi / w, 0.0)
    expected = ((a**4).sum().item() / 4, (a**2).sum().item())
    estimate = _adaptive_estimate(w.to(dtype), xi.to(dtype))
    tolerance = 16 * math.sqrt(ESTIMATE_CPU_BLOCK) * torch.finfo(dtype).eps
    if dtype == torch.float32:  # the inputs' own rounding, 4 eps in a^4
        tolerance += 8 * torch.finfo(dtype).eps
    assert estimate == pytest.approx(expected, rel=tolerance)
    w[5] = 1e-300  # a ratio that overflows: an estimate of its own size
    assert math.isinf(_adaptive_estimate(w, xi)[0])


def masked_block_sums(w: torch.Tensor, xi: torch.Tensor, step: int) -> Tuple[float, float]:
    """The adaptive estimate's sums the textbook way: each block masked where w = 0."""
    sums = []
    for start in range(0, w.numel(), step):
        part = w[start : start + step]
        squares = (xi[start : start + step] / part).masked_fill_(part == 0, 0.0).square_()
        sums.append(torch.stack((torch.dot(squares, squares), squares.sum())))
    fourth, second = torch.stack(sums).double().sum(0).tolist()
    return fourth / 4, second


@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adaptive_estimate_unmasked_first_is_the_masked_sums_bit_for_bit(
    dtype, capped, monkeypatch
):
    """Summed first without the mask (a quantised model's zero weights fall in every
    block), the estimate is the masked one exactly: 0/0 read as 0, and each block with
    a nonzero step on a zero weight, a NaN or an infinity summed again with the mask.
    Where blocks are capped (an accelerator's few large blocks), masked at once."""
    monkeypatch.setattr(_linalg, "CAP_ON_CPU", capped)
    generator = torch.Generator().manual_seed(1)
    size = 4 * ESTIMATE_CPU_BLOCK + 77
    block = block_length(size, ESTIMATE_BLOCK, torch.device("cpu")) if capped else None
    block = block or ESTIMATE_CPU_BLOCK
    w = torch.randn(size, generator=generator, dtype=dtype)
    xi = 0.1 * torch.randn(size, generator=generator, dtype=dtype) * w
    w[::300] = 0.0  # zeros in every block, with a zero step there
    xi[::300] = 0.0
    cases = {"zeros": (w, xi)}
    cases["step on a zero weight"] = (w, xi.clone().index_fill_(0, torch.tensor([600]), 1.0))
    cases["NaN step"] = (w, xi.clone().index_fill_(0, torch.tensor([70000]), math.nan))
    cases["infinite weight"] = (w.clone().index_fill_(0, torch.tensor([140000]), math.inf), xi)
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    cases["overflow"] = (w.clone().index_fill_(0, torch.tensor([5]), tiny), xi)
    for name, (weights, step) in cases.items():
        expected = masked_block_sums(weights, step, block)
        estimate = _adaptive_estimate(weights, step)
        assert all(
            a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(estimate, expected)
        ), name
    assert math.isfinite(_adaptive_estimate(*cases["step on a zero weight"])[0])


def test_exact_loss_on_the_default_inv_radius_and_other_paths():
    """At the reference inv radius the path is faithful on the tiny Llama: the exact point's
    loss is close to the retraction's and above the clean loss. Other paths report
    nothing."""
    model, loss_fn, batches = llama_case()
    rho = RADII["inv"]
    second = geodesic_sharpness(
        model, loss_fn, batches, rho=rho, metric="inv", iters=5, path_report=True
    )
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
        assert other.estimated_path_gaps is None
        assert "path_gap" not in other.rows()[0]
    average = geodesic_sharpness(model, loss_fn, batches, rho=rho, iters=3, kind="average")
    assert average.path_gaps is None and average.estimated_path_gaps is None
    with pytest.raises(ValueError, match="path_report"):
        geodesic_sharpness(model, loss_fn, batches, kind="average", path_report=True)
    default = geodesic_sharpness(model, loss_fn, batches, rho=rho, metric="inv", iters=5)
    assert default.path_gaps is None and default.exact_losses is None
    assert default.estimated_path_gaps == second.estimated_path_gaps
    assert "path_gap" not in default.rows()[0]


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_large_groups_taken_a_slice_at_a_time_give_the_same_report(metric, monkeypatch):
    """The float64 copies of a large group are made a slice at a time (flat pieces of the
    adaptive buffers, batches of quotient points): the same gap and exact loss."""
    from geoopt_quotient.sharpness import path_gap as module

    model, loss_fn, batches = llama_case()
    options = dict(rho=0.005, metric=metric, iters=2, path_report=True)
    whole = geodesic_sharpness(model, loss_fn, batches, **options)
    monkeypatch.setattr(module, "SLICE_ENTRIES", 7)
    sliced = geodesic_sharpness(model, loss_fn, batches, **options)
    assert sliced.perturbed_losses == whole.perturbed_losses
    for a, b in zip(sliced.path_gaps, whole.path_gaps):
        assert a == pytest.approx(b, rel=1e-9)
    assert sliced.exact_losses == pytest.approx(whole.exact_losses, rel=1e-12, abs=0)
    assert sliced.estimated_path_gaps == pytest.approx(whole.estimated_path_gaps, rel=1e-9)


def gl_ball(metric, radius, seed=0, steps=16):
    """A float64 batch of GL points and a horizontal vector of metric norm ``radius``."""
    manifold = GLQuotient(12, 12, metric, expmap_steps=steps)
    torch.manual_seed(seed)
    x = manifold.random(3, 24, 3, dtype=torch.float64)
    (u,) = unit_direction([BallGroup(x, manifold)], seed)
    return [BallGroup(x, manifold)], [radius * u]


def spy_steps(monkeypatch):
    """The step counts of every span integration made from now on."""
    from geoopt_quotient.manifolds import _gl_geodesic

    steps, original = [], _gl_geodesic.SpanGeodesic.integrate

    def recorded(self, t, count):
        steps.append(count)
        return original(self, t, count)

    monkeypatch.setattr(_gl_geodesic.SpanGeodesic, "integrate", recorded)
    return steps


def reference_gap(groups, xi):
    """The gap on the manifold's ``expmap_steps`` (the reference's integration)."""
    ((x, manifold, _),), (v,) = [(g.point, g.manifold, g.path) for g in groups], xi
    difference = manifold.retr(x, v) - manifold.expmap(x, v)
    return math.sqrt(
        float(manifold.inner(x, difference, difference).sum() / manifold.inner(x, v, v).sum())
    )


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_error_controlled_geodesic_agrees_with_the_sixteen_step_reference(metric, monkeypatch):
    """At a moderate radius a few RK4 steps pass the Richardson check: the accepted end
    point's error is at most GEODESIC_TOLERANCE of the gap, the reference's is smaller by
    (steps / 16)^4, so the two gaps differ by at most twice that fraction."""
    groups, xi = gl_ball(metric, 0.05)
    steps = spy_steps(monkeypatch)
    gap, _ = path_gap(groups, groups, lambda points: torch.zeros(()), xi)
    assert max(steps) < 16 and steps[:2] == [1, 2]
    reference = reference_gap(groups, xi)
    assert reference > 0
    assert abs(gap - reference) <= 2 * GEODESIC_TOLERANCE * reference


def test_error_control_falls_back_to_expmap_steps_at_a_large_radius(monkeypatch):
    """Far out the coarse integrations disagree (or break down): the gap is the one of
    the manifold's own ``expmap_steps``, bit for bit."""
    groups, xi = gl_ball("inv", 20.0)
    steps = spy_steps(monkeypatch)
    gap, _ = path_gap(groups, groups, lambda points: torch.zeros(()), xi)
    assert steps[0] == 1 and steps[-1] == 16
    reference = reference_gap(groups, xi)
    assert gap == pytest.approx(reference, rel=1e-12)
    assert gap > 1  # far outside the asymptotic range indeed


def test_error_control_is_off_where_expmap_steps_leaves_no_coarser_pair(monkeypatch):
    groups, xi = gl_ball("inv", 0.05, steps=2)
    steps = spy_steps(monkeypatch)
    gap, _ = path_gap(groups, groups, lambda points: torch.zeros(()), xi)
    assert steps == [2]
    assert gap == pytest.approx(reference_gap(groups, xi), rel=1e-12)


def d_reference(a: torch.Tensor) -> torch.Tensor:
    r""":math:`e^a - 1 - a` in float64 to a few units of its rounding: the series to
    :math:`a^{20} / 20!` below :math:`|a| = 1` (tail :math:`< 10^{-19}` relative),
    ``expm1(a) - a`` above (cancellation at most a factor 2.5)."""
    a = a.double()
    series = torch.full_like(a, 1 / math.factorial(20))
    for k in range(19, 1, -1):
        series = series * a + 1 / math.factorial(k)
    return torch.where(a.abs() < 1, series * a * a, torch.expm1(a) - a)


@settings(max_examples=40, deadline=None)
@given(
    exponent=st.floats(-12, 1.2),
    weight_exponent=st.floats(-6, 2),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_closed_form_of_the_adaptive_gap_matches_float64(exponent, weight_exponent, seed, dtype):
    """Entries of both signs with |a| = |xi / w| up to 10**exponent (tiny a included,
    where e^a - 1 - a cancels), a frozen entry: the squared gap and step to a few units
    of the working dtype's rounding, the end point w e^a to its rounding, no NaN."""
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(999, generator=generator, dtype=torch.float64) * 10**weight_exponent).to(dtype)
    w[0] = 0.0
    a = torch.randn(999, generator=generator, dtype=torch.float64) * 10**exponent / 3
    v = (a * w.double()).to(dtype)
    v[0] = 0.0
    gap_sq, step_sq, end = elementwise_gap(w, v)
    a = torch.where(w == 0, 0.0, v.double() / w.double())
    eps = torch.finfo(compute_dtype(dtype)).eps
    assert gap_sq == pytest.approx(float((d_reference(a) ** 2).sum()), rel=16 * eps, abs=0)
    assert step_sq == pytest.approx(float((a**2).sum()), rel=16 * eps, abs=0)
    expected = (w.double() * torch.exp(a)).to(dtype)
    ulp = torch.finfo(dtype).eps * expected.double().abs()  # and a's rounding, |a| ulp
    assert ((end.double() - expected.double()).abs() <= (2 + a.abs()) * ulp).all()
    assert end.dtype == dtype and end[0] == 0


def test_naive_closed_form_loses_its_digits_where_the_series_does_not():
    a = torch.tensor([1e-4, -3e-5, 2e-2, 0.3, -0.45, 0.6, -2.0], dtype=torch.float32)
    expected = d_reference(a)
    ours = expm1_minus_identity(a).double()
    naive = (torch.expm1(a) - a).double()
    eps = torch.finfo(torch.float32).eps
    assert ((ours - expected).abs() <= 8 * eps * expected.abs()).all()
    assert ((naive - expected).abs() > 100 * eps * expected.abs())[:2].all()


def test_closed_form_redone_in_float64_where_float32_overflows():
    """a = 100: e^a - 1 - a overflows float32; the sums are then float64's."""
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float32)
    v = torch.tensor([100.0, 1.0, -0.1], dtype=torch.float32) * w.abs()
    gap_sq, step_sq, end = elementwise_gap(w, v)
    a = v.double() / w.double()
    assert math.isfinite(gap_sq) and step_sq == pytest.approx(float((a**2).sum()), rel=1e-6)
    assert end[0] == math.inf and end[1:].isfinite().all()
    assert gap_sq == pytest.approx(float((d_reference(a) ** 2).sum()), rel=1e-12)


def test_closed_form_agrees_with_the_generic_float64_path(monkeypatch):
    """The adaptive groups of a model: the same report with the closed form switched off
    (today's float64 geodesic and difference)."""
    from geoopt_quotient.sharpness import path_gap as module

    model = bert_case()[0]
    plan = find_symmetries(model, metric="inv").bind(model)
    points = plan.gather(trainable_parameters(model))
    groups = [BallGroup(x, g.manifold) for g, x in zip(plan.groups, points) if g.kind == "adaptive"]
    direction = unit_direction(groups)
    closed = gap_along(groups, direction, 0.3)
    monkeypatch.setattr(module, "_closed_form_applies", lambda group, exact: False)
    generic = gap_along(groups, direction, 0.3)
    assert closed == pytest.approx(generic, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_path_gap_leaves_the_points_and_the_vector_as_they_were(dtype):
    """The report reads the maximiser and the base points only (the result's values and
    the caller's weights depend on them)."""
    manifold = GLQuotient(12, 12, "inv")
    torch.manual_seed(0)
    quotient = manifold.random(2, 24, 3, dtype=torch.float64).to(dtype)
    adaptive = torch.randn(50, dtype=dtype)
    groups = [BallGroup(quotient, manifold), BallGroup(adaptive, AdaptiveEuclidean())]
    xi = [0.1 * v for v in unit_direction(groups)]
    before = [t.clone() for t in (quotient, adaptive, *xi)]
    points = []
    path_gap(groups, groups, lambda p: points.extend(p) or torch.zeros(()), xi)
    assert all(torch.equal(a, b) for a, b in zip(before, (quotient, adaptive, *xi)))
    assert [p.dtype for p in points] == [dtype, dtype]


def test_a_geodesic_that_leaves_the_manifold_still_reports_nan_without_a_forward():
    """Where the 16 steps break down (the reference raises), the coarse integrations do
    not hide it: NaN, and the objective is not evaluated."""
    from test_gl_geodesic import case

    manifold = GLQuotient(6, 6, "inv")
    x, u, _, reference = case(manifold, (3,), 2, 0, 20.0)
    with pytest.raises(GeodesicDomainError):
        reference.expmap(u)
    groups, calls = [BallGroup(x, manifold)], []
    gap, loss = path_gap(groups, groups, lambda p: calls.append(p) or torch.zeros(()), [u])
    assert math.isnan(gap) and math.isnan(loss) and not calls
