"""calibrate_rho: the radius at which worst-case sharpness is a multiple of the clean loss."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import cross_entropy_loss, tiny_llama_causal_lm
from hypothesis import given, settings
from hypothesis import strategies as st

import geoopt_quotient as gq
import geoopt_quotient.sharpness.measure as measure_module
from geoopt_quotient.sharpness import CalibrationError, RhoEvaluation, calibrate_rho

#: Agreement asked of a calibration with the default ``rtol`` (0.01).
TOLERANCE = 0.02


class Ones(torch.nn.Module):
    """One float64 parameter vector of ``n`` ones."""

    def __init__(self, n: int = 1) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n, dtype=torch.float64))


def quadratic_loss(model: Ones, curvature: float) -> torch.Tensor:
    """:math:`a |w|^2 / 2`, the batch being the curvature :math:`a`."""
    return curvature * model.w.square().sum() / 2


def quadratic_answer(target: float, n: int) -> float:
    r"""Radius solving adaptive worst case = target x clean loss for :func:`quadratic_loss`.

    At :math:`w = \mathbf 1 \in \mathbb R^n` the adaptive ball is the Euclidean ball of
    radius :math:`\rho`; the worst increase :math:`a(\mathbf 1\cdot\delta + |\delta|^2/2)`
    is reached at :math:`\delta = \rho \mathbf 1/\sqrt n`: :math:`a(\rho\sqrt n + \rho^2/2)`.
    With the clean loss :math:`a n / 2` (any mix of curvatures over batches),
    :math:`2\rho/\sqrt n + \rho^2/n = t`, so :math:`\rho^\star = \sqrt n(\sqrt{1+t} - 1)`.
    """
    return math.sqrt(n) * (math.sqrt(1 + target) - 1)


def sharpness_ratio(model, loss_fn, batches, measure: str, rho: float, **options) -> float:
    """Worst-case sharpness / mean clean loss, measured independently of the calibration."""
    if measure == "adaptive":
        result = gq.adaptive_sharpness(model, loss_fn, batches, rho=rho, **options)
    else:
        result = gq.geodesic_sharpness(model, loss_fn, batches, rho=rho, metric=measure, **options)
    return result.value / (sum(result.clean_losses) / len(result.clean_losses))


# ---------------------------------------------------------------- a known answer
@settings(max_examples=15, deadline=None)
@given(
    target=st.floats(0.01, 100.0),
    n=st.integers(1, 4),
    curvatures=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=3),
)
def test_quadratic_radius_matches_the_closed_form(single_thread, target, n, curvatures):
    model = Ones(n)
    rho = calibrate_rho(
        model, quadratic_loss, curvatures, target=target, measure="adaptive", iters=5
    )
    expected = quadratic_answer(target, n)
    assert abs(rho / expected - 1) <= TOLERANCE, (rho, expected)
    ratio = sharpness_ratio(model, quadratic_loss, curvatures, "adaptive", rho, iters=5)
    assert abs(ratio / target - 1) <= TOLERANCE, (ratio, target)


def test_history_records_every_evaluation_and_ends_at_the_answer(single_thread):
    rho, history = calibrate_rho(
        Ones(),
        quadratic_loss,
        [2.0],
        target=1.0,
        measure="adaptive",
        rho_start=0.05,
        return_history=True,
    )
    assert all(isinstance(h, RhoEvaluation) for h in history)
    assert [row["rho"] for row in history.rows()] == [h.rho for h in history]  # a ResultList
    assert history[-1].rho == rho
    assert abs(history[-1].ratio - 1.0) <= 0.01
    # bracketing doubles from rho_start=0.05 once, then follows the log-log secant of the
    # ratio 2 rho + rho^2 through the last two radii past the target (rho* = 0.414)
    ratios = [2 * r + r**2 for r in (0.05, 0.1)]
    slope = math.log(ratios[1] / ratios[0]) / math.log(2)
    secant = 0.1 * (1.0 / ratios[1]) ** (1 / slope)
    assert [h.rho for h in history[:2]] == [0.05, 0.1]
    assert history[2].rho == pytest.approx(secant, rel=1e-12)
    assert secant > quadratic_answer(1.0, 1)  # bracketed in three evaluations
    assert len(history) <= 8
    for h in history:  # the closed form at every evaluated radius
        assert math.isclose(h.value, 2.0 * (h.rho + h.rho**2 / 2), rel_tol=1e-12)
        assert h.clean_loss == 1.0


def test_bracketing_shrinks_from_a_large_start(single_thread):
    rho = calibrate_rho(Ones(), quadratic_loss, [1.0], target=0.1, measure="adaptive", rho_start=50)
    assert abs(rho / quadratic_answer(0.1, 1) - 1) <= TOLERANCE


def test_a_one_shot_iterator_gives_the_same_radius_as_a_list(single_thread):
    batches = [1.0, 3.0]
    from_list = calibrate_rho(Ones(2), quadratic_loss, batches, target=2.0, measure="adaptive")
    from_iterator = calibrate_rho(
        Ones(2), quadratic_loss, iter(batches), target=2.0, measure="adaptive"
    )
    assert from_list == from_iterator


def test_unconverged_search_warns_and_returns_the_closest_evaluation(single_thread):
    with pytest.warns(RuntimeWarning, match="did not reach"):
        rho, history = calibrate_rho(
            Ones(),
            quadratic_loss,
            [1.0],
            target=1.0,
            measure="adaptive",
            rtol=1e-9,
            max_evals=7,
            return_history=True,
        )
    assert len(history) == 7
    closest = min(history, key=lambda h: abs(h.ratio - 1.0))
    assert rho == closest.rho


# ---------------------------------------------------------------- a tiny transformer
@pytest.mark.parametrize("measure", ["adaptive", "inv", "mix"])
def test_tiny_transformer_hits_its_target(single_thread, tiny_transformer, token_batches, measure):
    target = 0.5
    rho, history = calibrate_rho(
        tiny_transformer,
        cross_entropy_loss,
        token_batches,
        target=target,
        measure=measure,
        iters=5,
        rho_start=0.2,
        return_history=True,
    )
    assert len(history) >= 2  # not hit by the first guess: the search did work
    ratio = sharpness_ratio(
        tiny_transformer, cross_entropy_loss, token_batches, measure, rho, iters=5
    )
    assert abs(ratio / target - 1) <= TOLERANCE, (measure, rho, ratio)


def test_symmetries_are_discovered_once(
    single_thread, tiny_transformer, token_batches, monkeypatch
):
    calls = []
    discovery = measure_module.find_symmetries

    def counting(model, **kwargs):
        calls.append(kwargs)
        return discovery(model, **kwargs)

    monkeypatch.setattr(measure_module, "find_symmetries", counting)
    _, history = calibrate_rho(
        tiny_transformer,
        cross_entropy_loss,
        token_batches,
        target=0.5,
        measure="mix",
        iters=3,
        rho_start=0.2,
        return_history=True,
    )
    assert len(history) > 1
    assert [(c["metric"], c["eps"]) for c in calls] == [("mix", 0.0)]


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(target=0.0), ValueError, "`target` must be finite and > 0"),
        (dict(target=-1.0), ValueError, "`target` must be finite and > 0"),
        (dict(target=math.nan), ValueError, "`target` must be finite and > 0"),
        (dict(target=True), TypeError, "`target` must be a real number"),
        (dict(measure="geodesic"), ValueError, "unknown `measure`"),
        (dict(kind="average"), ValueError, "`kind` must be 'worst'"),
        (dict(rho=0.1), TypeError, "`rho` is set by calibrate_rho"),
        (dict(symmetries=None), TypeError, "unknown option 'symmetries' for measure 'adaptive'"),
        (dict(rtol=1.0), ValueError, "`rtol` must be in"),
        (dict(rho_bounds=(1.0, 0.1)), ValueError, "low < high"),
        (dict(rho_start=1e4), ValueError, "outside `rho_bounds`"),
        (dict(max_evals=0), ValueError, "`max_evals` must be >= 1"),
    ],
)
def test_invalid_arguments_are_refused_before_any_evaluation(kwargs, error, match):
    evaluated = []

    def loss(model, batch):
        evaluated.append(batch)
        return quadratic_loss(model, batch)

    arguments = {"target": 1.0, "measure": "adaptive", **kwargs}
    with pytest.raises(error, match=match):
        calibrate_rho(Ones(), loss, [1.0], **arguments)
    assert evaluated == []


def test_saturating_sharpness_cannot_be_bracketed(single_thread):
    def bounded_loss(model, batch):  # increase at most 1 - tanh(1) = 0.24 over clean 2.76
        return 2 + torch.tanh(model.w).sum()

    with pytest.raises(CalibrationError, match="saturates below"):
        calibrate_rho(
            Ones(), bounded_loss, [None], target=1.0, measure="adaptive", rho_bounds=(1e-3, 10.0)
        )


def test_target_above_at_the_smallest_radius(single_thread):
    with pytest.raises(CalibrationError, match="already above the target"):
        calibrate_rho(
            Ones(),
            quadratic_loss,
            [1.0],
            target=0.1,  # rho* = 0.049, below the bounds
            measure="adaptive",
            rho_start=1.0,
            rho_bounds=(0.5, 10.0),
        )


def test_bracketing_budget_is_enforced(single_thread):
    # the target needs three evaluations to be bracketed (see the history test above)
    with pytest.raises(CalibrationError, match="not bracketed in `max_evals`=2"):
        calibrate_rho(Ones(), quadratic_loss, [1.0], target=1.0, measure="adaptive", max_evals=2)


def test_zero_clean_loss_makes_the_rule_undefined(single_thread):
    def zero_at_w(model, batch):
        return (model.w - 1).square().sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gq.ZeroSharpnessWarning)
        with pytest.raises(CalibrationError, match="positive clean loss"):
            calibrate_rho(Ones(), zero_at_w, [None], target=1.0, measure="adaptive")


# ---------------------------------------------------------------- the benchmark script
def test_transformers_benchmark_runs_in_quick_mode(single_thread, tmp_path, monkeypatch):
    import json
    import pathlib

    benchmarks = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    import calibrate_transformers

    out = tmp_path / "calibrate.json"
    report = calibrate_transformers.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for measure in ("adaptive", "inv", "mix"):
        row = report["models"][0]["measures"][measure]
        calibrated = row["calibrated"]["0.1"]
        assert calibrated["rho"] > 0 and isinstance(calibrated["within_rtol"], bool)
        assert (calibrated["rho"], calibrated["ratio"]) in map(tuple, calibrated["evaluations"])
        assert row["default_rho"] == report["settings"]["default_radii"][measure]


# ---------------------------------------------------------- an estimate that loses the maximum
def _fake_estimate(monkeypatch, estimate):
    """Replace the sharpness by ``estimate(rho)`` (clean loss 1); a 0 warns as Auto-PGD does."""
    import geoopt_quotient.sharpness.calibrate as calibrate_module

    calls = []

    def make(model, loss_fn, batches, measure, options):
        def evaluate(rho):
            calls.append(rho)
            value = estimate(rho)
            if value == 0:
                warnings.warn("no increase", gq.ZeroSharpnessWarning, stacklevel=2)
            return RhoEvaluation(rho=rho, value=value, clean_loss=1.0)

        return evaluate

    monkeypatch.setattr(calibrate_module, "_sharpness_of_rho", make)
    return calls


def test_an_estimate_that_collapses_at_larger_radii_stops_early_with_one_error(monkeypatch):
    # the estimate of the tiny Llama (mix, iters=3): 0.009 x the clean loss at
    # rho = 0.05 and 0.1, then 0 at every larger radius
    calls = _fake_estimate(monkeypatch, lambda rho: 0.00924 if rho <= 0.1 else 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning escapes before the error
        with pytest.raises(CalibrationError, match="stopped growing with the radius") as info:
            calibrate_rho(Ones(), quadratic_loss, [1.0], target=0.2, measure="mix", rho_start=0.05)
    assert "2 of these evaluations found no loss increase" in str(info.value)
    assert calls == [0.05, 0.1, 0.2, 0.4]  # the running maximum is flat from 0.05 to 0.4


def test_zero_estimates_warn_once_and_the_search_goes_on(monkeypatch):
    # the truth is rho^2; the estimate loses the maximum (returns 0) on radii in (0.3, 0.6)
    def estimate(rho):
        return 0.0 if 0.3 < rho < 0.6 else rho**2

    calls = _fake_estimate(monkeypatch, estimate)
    with pytest.warns(RuntimeWarning) as record:
        rho = calibrate_rho(
            Ones(), quadratic_loss, [1.0], target=0.5, measure="adaptive", rho_start=0.4
        )
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "no loss increase at all at 2" in messages[0]
    assert not any(issubclass(w.category, gq.ZeroSharpnessWarning) for w in record)
    assert rho == pytest.approx(math.sqrt(0.5), rel=0.01)
    assert len(calls) <= 8


# ---------------------------------------------------------------- every measure at once
def test_calibrate_radii_puts_every_measure_at_the_target(single_thread, monkeypatch):
    import geoopt_quotient.sharpness.calibrate as calibrate_module

    seen = []
    real = calibrate_module.calibrate_rho

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "calibrate_rho", spy)
    radii, histories = gq.calibrate_radii(
        Ones(2),
        quadratic_loss,
        iter([1.0, 3.0]),  # a one-shot iterator serves every measure
        target=0.5,
        measures=("adaptive", "mix"),
        iters=5,
        path="exact",
        return_history=True,
    )
    assert list(radii) == ["adaptive", "mix"]
    assert radii["adaptive"] == pytest.approx(quadratic_answer(0.5, 2), rel=TOLERANCE)
    for measure, history in histories.items():
        assert history[0].rho == gq.sharpness.DEFAULT_RADII[measure]  # started at the default
        best = max(h.value for h in history if h.rho <= radii[measure])
        assert abs(best / history[0].clean_loss / 0.5 - 1) <= 0.01
    # the geodesic-only option is not passed to adaptive sharpness
    assert "path" not in seen[0] and seen[1]["path"] == "exact"


@pytest.mark.parametrize(
    "measures, match", [((), "empty"), (("mix", "mix"), "repeated"), (("geodesic",), "unknown")]
)
def test_calibrate_radii_refuses_bad_measures(measures, match):
    with pytest.raises(ValueError, match=match):
        gq.calibrate_radii(Ones(), quadratic_loss, [1.0], target=1.0, measures=measures)


def test_tiny_llama_with_three_iterations_ends_quickly_and_warns_at_most_once(single_thread):
    """The issue's case: a tiny float64 Llama, mix, 3 Auto-PGD iterations (27 evaluations and
    19 warnings before the running maximum). Whatever Auto-PGD finds at each radius, the
    search ends within a few evaluations: a radius whose running maximum meets the target,
    or a CalibrationError; never one ZeroSharpnessWarning per evaluation."""
    pytest.importorskip("transformers")
    model = tiny_llama_causal_lm()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss_fn(model, batch):
        return model(input_ids=batch, labels=batch).loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rho, history = calibrate_rho(
                model,
                loss_fn,
                [ids],
                target=0.2,
                measure="mix",
                iters=3,
                rho_start=0.05,
                max_evals=40,
                return_history=True,
            )
        except CalibrationError as error:  # not the budget: a diagnosis saying what to do
            assert "stopped growing with the radius" in str(error) or "saturates" in str(error)
            history = None
    ours = [w for w in caught if issubclass(w.category, (RuntimeWarning, gq.ZeroSharpnessWarning))]
    assert not any(issubclass(w.category, gq.ZeroSharpnessWarning) for w in ours)
    assert len(ours) <= 2  # not reaching rtol, and the summary of lost estimates
    if history is not None:
        assert len(history) <= 20
        running = max(h.value for h in history if h.rho <= rho)
        assert running / history[0].clean_loss > 0


def test_path_gap_warnings_of_the_evaluations_come_as_one(monkeypatch):
    """The second-order path's PathGapWarning at some evaluated radii: one warning per
    call naming them, not one per evaluation."""
    import geoopt_quotient.sharpness.calibrate as calibrate_module

    def make(model, loss_fn, batches, measure, options):
        def evaluate(rho):
            if rho > 0.1:
                warnings.warn("unfaithful", gq.PathGapWarning, stacklevel=2)
            return RhoEvaluation(rho=rho, value=rho, clean_loss=1.0)

        return evaluate

    monkeypatch.setattr(calibrate_module, "_sharpness_of_rho", make)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rho = calibrate_rho(
            Ones(), quadratic_loss, [1.0], target=0.4, measure="mix", rho_start=0.05
        )
    assert rho == pytest.approx(0.4, rel=0.06)
    gaps = [w for w in caught if issubclass(w.category, gq.PathGapWarning)]
    assert len(gaps) == 1 and "calibrate_rho" in str(gaps[0].message)
    assert "unfaithful" not in str(gaps[0].message)
