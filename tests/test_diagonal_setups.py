"""The two diagonal-network populations, the two paths, and tau as a function of the radius."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from geoopt_quotient.cli import main
from geoopt_quotient.experiments.diagonal import experiment
from geoopt_quotient.experiments.diagonal.data import make_sparse_regression
from geoopt_quotient.experiments.diagonal.experiment import (
    measure_groups,
    measure_names,
    run_diagonal,
)
from geoopt_quotient.experiments.diagonal.train import (
    sample_hyperparameters,
    sample_step_size_hyperparameters,
    step_sizes_for,
    train_population,
    train_schedule_population,
)
from geoopt_quotient.experiments.records import RecordFile
from geoopt_quotient.sharpness.apgd import maximize_in_ball

TINY = dict(models=6, dim=16, iters=3, progress=False)


@pytest.fixture
def few_resamples(monkeypatch):
    """Bootstrap intervals from 50 resamples: the records' shape is under test, not their width."""
    monkeypatch.setattr(experiment, "TAU_BY_RHO_RESAMPLES", 50)


@pytest.mark.parametrize("setup", ["phase-transition", "step-size"])
def test_each_setup_trains_every_model_to_the_stopping_rule(setup):
    run = run_diagonal(**TINY, setup=setup)
    per_model, training = run["per_model"], run["training"]
    assert training["converged"] == 6 and all(per_model["converged"])
    assert max(per_model["train_loss"]) <= 1e-5
    assert run["settings"]["setup"] == setup
    if setup == "step-size":
        assert per_model["algorithm"] == ["gd", "sgd"] * 3
        assert per_model["init_scale"] == [0.1] * 6
        assert run["data"]["n_train"] == round(0.4 * 16) and run["data"]["noise_std"] == 0.0
    else:
        assert "step_factor" in per_model and "algorithm" not in per_model


def test_step_size_hyperparameters_follow_their_ranges():
    stochastic, steps = sample_step_size_hyperparameters(200, seed=3)
    assert stochastic.tolist() == [False, True] * 100
    assert np.all((steps[~stochastic] >= 0.01) & (steps[~stochastic] <= 2.72))
    assert np.all((steps[stochastic] >= 0.01) & (steps[stochastic] <= 0.25))
    again = sample_step_size_hyperparameters(200, seed=3)[1]
    assert np.array_equal(steps, again)


def test_full_batch_schedule_is_gradient_descent():
    """Without SGD models and with the decay after the budget, the schedule trainer takes
    exactly the steps of :func:`train_population` from u0 = 0.1, v0 = 0."""
    data = make_sparse_regression(16, n_train=8, noise_std=0.0, seed=1)
    steps = torch.tensor([0.05, 0.2, 0.5], dtype=torch.float64)
    schedule = train_schedule_population(
        data, torch.zeros(3, dtype=torch.bool), steps, large_steps=10**9, max_steps=50_000
    )
    plain = train_population(
        data, torch.full((3,), 0.1, dtype=torch.float64), steps, max_steps=50_000
    )
    assert bool(schedule.converged.all())
    assert torch.equal(schedule.points, plain.points)
    assert torch.equal(schedule.steps, plain.steps)


def test_sgd_samples_are_seeded_and_a_diverging_model_restarts():
    data = make_sparse_regression(16, n_train=8, noise_std=0.0, nonnegative=True, seed=2)
    stochastic = torch.tensor([True, True, False])
    steps = torch.tensor([0.05, 0.05, 40.0], dtype=torch.float64)
    first = train_schedule_population(data, stochastic, steps, seed=5, large_steps=500)
    again = train_schedule_population(data, stochastic, steps, seed=5, large_steps=500)
    other = train_schedule_population(data, stochastic, steps, seed=6, large_steps=500)
    assert bool(first.converged.all()) and float(first.train_loss.max()) <= 1e-5
    assert torch.equal(first.points, again.points)
    assert not torch.equal(first.points[:2], other.points[:2])  # other samples
    assert torch.equal(first.points[2], other.points[2])  # full batch: no samples
    assert int(first.restarts[2]) >= 1 and float(first.step_sizes[2]) < 40.0


def test_nonnegative_ground_truth_only_changes_signs():
    signed = make_sparse_regression(30, seed=4)
    positive = make_sparse_regression(30, seed=4, nonnegative=True)
    assert torch.equal(positive.beta_star, signed.beta_star.abs())
    assert torch.equal(positive.x_train, signed.x_train)


def test_default_values_are_those_of_the_library_calls(few_resamples):
    """The phase-transition setup's values at the default radius are the plain library
    calls' (data, gradient descent, one Auto-PGD maximisation per measure): measuring
    several scales and paths changes no arithmetic of the default."""
    run = run_diagonal(**TINY, rho_scales=(0.5, 2.0))
    data = make_sparse_regression(16, seed=0)
    scales, factors = sample_hyperparameters(6, seed=0)
    scales_t, factors_t = torch.as_tensor(scales), torch.as_tensor(factors)
    population = train_population(data, scales_t, step_sizes_for(data, scales_t, factors_t))
    assert run["per_model"]["test_loss"] == data.test_loss(population.beta).tolist()
    table = measure_groups(0.1, 0.1)

    def objective(perturbed):
        return data.train_loss(perturbed[0][0] * perturbed[0][1])

    for name in ("adaptive", "inv", "mix", "mix_unclamped", "mix_second_order"):
        make_group, radius = table[name]
        expected = []
        for point in population.points:
            result = maximize_in_ball([make_group(point)], objective, rho=radius, iters=3)
            expected.append(result.value - result.initial_value)
        assert run["per_model"][f"sharpness_{name}"] == expected, name


@pytest.mark.parametrize("paths", [("exact", "second_order"), ("second_order",)])
def test_one_tau_per_scale_measure_and_path(tmp_path, capsys, few_resamples, paths):
    argv = ["reproduce", "diagonal", "--models", "6", "--dim", "16", "--iters", "2"]
    argv += ["--rho-scales", "0.5,2", "--rho-mix", "0.2", "--paths", ",".join(paths)]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "tau against the radius, seed 0" in printed and "scale 0.5" in printed
    document = json.loads((tmp_path / "diagonal.json").read_text())
    records = document["tau_by_rho"]
    keys = [(r["scale"], r["measure"], r["path"]) for r in records]
    expected_pairs = [("adaptive", "straight")]
    expected_pairs += [(m, p) for m in ("inv", "mix") for p in paths]
    assert sorted(keys) == sorted((s, m, p) for s in (0.5, 1.0, 2.0) for m, p in expected_pairs)
    for record in records:
        assert set(record) == {"scale", "rho", "measure", "path", "tau", "ci"}
        base = 0.2 if record["measure"] == "mix" else 0.1
        assert record["rho"] == pytest.approx(base * record["scale"], rel=1e-15)
        assert -1 <= record["tau"] <= 1 and len(record["ci"]) == 2
    run = document["runs"][0]
    assert [b["scale"] for b in run["by_scale"]] == [0.5, 1.0, 2.0]
    assert set(run["by_scale"][0]["sharpness"]) == set(measure_names(paths))
    assert (tmp_path / "diagonal-tau-by-rho.png").read_bytes()[:4] == b"\x89PNG"
    # larger balls, larger worst cases: the mean of every measure grows with the radius
    for name in measure_names(paths):
        means = [np.mean(b["sharpness"][name]) for b in run["by_scale"]]
        assert means[0] <= means[1] <= means[2], name


class _Killed(BaseException):
    """Stands for a SIGKILL arriving right after a record was written."""


def test_rho_scales_resume_after_a_kill_per_model_and_radius(tmp_path, monkeypatch, few_resamples):
    argv = ["reproduce", "diagonal", "--models", "4", "--dim", "12", "--iters", "2", "--quiet"]
    argv += ["--rho-scales", "0.5,2", "--paths", "exact"]
    assert main([*argv, "--out", str(tmp_path / "reference")]) == 0
    reference = json.loads((tmp_path / "reference" / "diagonal.json").read_text())

    append, written, kill_after = RecordFile.append, [], [5]

    def append_then_die(self, record):
        append(self, record)
        written.append((record["model"], record["scale"]))
        if len(written) == kill_after[0]:  # the 5th record: model 1 at its second scale
            raise _Killed

    monkeypatch.setattr(RecordFile, "append", append_then_die)
    out = tmp_path / "killed"
    with pytest.raises(_Killed):
        main([*argv, "--out", str(out)])
    assert not (out / "diagonal.json").exists()
    assert written == [(0, 0.5), (0, 1.0), (0, 2.0), (1, 0.5), (1, 1.0)]

    written.clear()
    kill_after[0] = None
    assert main([*argv, "--out", str(out), "--resume"]) == 0
    assert written == [(1, 2.0)] + [(m, s) for m in (2, 3) for s in (0.5, 1.0, 2.0)]
    resumed = json.loads((out / "diagonal.json").read_text())
    settings = resumed["runs"][0]["settings"]
    assert settings["resumed_models"] == 5  # (model, scale) records reused
    for key in ("tau_by_rho", "summary"):
        assert resumed[key] == reference[key]
    for ours, theirs in zip(resumed["runs"][0]["by_scale"], reference["runs"][0]["by_scale"]):
        assert ours == theirs


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rho-scales", "0,1"], "finite number > 0"),
        (["--rho-scales", "1;2"], "is not a number"),
        (["--paths", "geodesic"], "expected comma-separated paths among exact, second_order"),
        (["--paths", "exact,exact"], "repeated"),
        (["--setup", "random"], "invalid choice"),
    ],
)
def test_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["reproduce", "diagonal", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
