"""Population results as tables, and the population study of models in memory."""

from __future__ import annotations

import math

import pytest
import torch

from geoopt_quotient.experiments.population import (
    StudySettings,
    measure_model,
    measure_population,
    population_frames,
    population_rows,
    read_rows_csv,
    tau_rows,
    write_rows_csv,
)
from geoopt_quotient.experiments.population import in_memory as in_memory_module

SETTINGS = StudySettings(iters=2, verify=False, rho_mix=0.01)
WIDTHS = (2, 3, 4)


def mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(width)
    return torch.nn.Sequential(
        torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    ).double()


def factories():
    return {f"w{w}": (lambda w=w: mlp(w)) for w in WIDTHS}


def loss_fn(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def batches():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=generator, dtype=torch.float64)
    return [(x[:8], x[:8, :1].sin()), (x[8:], x[8:, :1].sin())]


GAPS = [0.3, 0.1, 0.4]


def test_in_memory_population_measures_each_model_as_measure_model():
    document = measure_population(factories(), loss_fn, batches(), GAPS, SETTINGS, resamples=20)
    assert [m["checkpoint"] for m in document["models"]] == list(factories())
    assert [m["gap"] for m in document["models"]] == GAPS
    expected = measure_model(mlp(WIDTHS[2]), loss_fn, batches(), SETTINGS)
    for name in SETTINGS.measures:
        assert document["models"][2]["measures"][name]["value"] == expected[name]["value"]
    assert list(document["tau"]) == list(SETTINGS.measures)
    assert document["warning"] and "only 3 models" in document["warning"]
    # models given as modules (a list, named by position) give the same values
    listed = measure_population([mlp(w) for w in WIDTHS], loss_fn, batches(), GAPS, SETTINGS)
    assert [m["checkpoint"] for m in listed["models"]] == [f"model_{i}" for i in range(3)]
    assert [values(m) for m in listed["models"]] == [values(m) for m in document["models"]]


def values(model):
    return {name: entry["value"] for name, entry in model["measures"].items()}


def test_in_memory_population_writes_the_cli_files_and_resumes(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    gaps = dict(zip(factories(), GAPS))
    first = measure_population(factories(), loss_fn, batches(), gaps, SETTINGS, out=tmp_path)
    for name in ("population.png", "population.json", "population.csv", "population-tau.csv"):
        assert (tmp_path / name).is_file(), name
    assert read_rows_csv(tmp_path / "population.csv") == population_rows(first)
    calls = []
    original = in_memory_module.measure_model

    def counting(model, *args, **kwargs):
        calls.append(model)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(in_memory_module, "measure_model", counting)
    again = measure_population(
        factories(), loss_fn, batches(), gaps, SETTINGS, out=tmp_path, resume=True
    )
    assert calls == []  # every model reused
    assert again["tau"] == first["tau"]
    changed = factories()
    changed["w3"] = lambda: mlp(5)  # other weights under the same name: measured again
    measure_population(changed, loss_fn, batches(), gaps, SETTINGS, out=tmp_path, resume=True)
    assert len(calls) == 1
    other = StudySettings(iters=3, verify=False, rho_mix=0.01)  # other settings: all again
    measure_population(factories(), loss_fn, batches(), gaps, other, out=tmp_path, resume=True)
    assert len(calls) == 1 + len(WIDTHS)


def test_population_errors():
    with pytest.raises(ValueError, match="at least 3"):
        measure_population([mlp(2), mlp(3)], loss_fn, batches(), [0.1, 0.2], SETTINGS)
    with pytest.raises(ValueError, match="2 gaps for 3"):
        measure_population(factories(), loss_fn, batches(), GAPS[:2], SETTINGS)
    with pytest.raises(ValueError, match="no gap for w4"):
        measure_population(factories(), loss_fn, batches(), {"w2": 0, "w3": 0}, SETTINGS)
    with pytest.raises(ValueError, match="not finite"):
        measure_population(factories(), loss_fn, batches(), [0, 0, math.nan], SETTINGS)


def small_document():
    return measure_population(factories(), loss_fn, batches(), GAPS, SETTINGS, resamples=20)


def test_rows_csv_round_trip_without_pandas(tmp_path):
    document = small_document()
    rows = population_rows(document)
    assert len(rows) == len(WIDTHS) * len(SETTINGS.measures)
    assert rows[0].keys() >= {"model", "measure", "value", "clean_loss", "gap"}
    assert read_rows_csv(write_rows_csv(rows, tmp_path / "models.csv")) == rows
    taus = tau_rows(document)
    assert [r["measure"] for r in taus] == list(SETTINGS.measures)
    back = read_rows_csv(write_rows_csv(taus, tmp_path / "tau.csv"))
    assert [r["tau"] for r in back] == [r["tau"] for r in taus]
    assert all(r["warning"] == taus[0]["warning"] for r in back)


def test_population_frames_round_trip_through_csv(tmp_path):
    pandas = pytest.importorskip("pandas")
    document = small_document()
    models, tau = population_frames(document)
    assert list(models.columns[:3]) == ["model", "measure", "value"]
    assert len(models) == len(WIDTHS) * len(SETTINGS.measures)
    models.to_csv(tmp_path / "models.csv", index=False)
    pandas.testing.assert_frame_equal(pandas.read_csv(tmp_path / "models.csv"), models)
    pivot = models.pivot(index="model", columns="measure", values="value")
    assert pivot.loc["w4", "adaptive"] == document["models"][2]["measures"]["adaptive"]["value"]
    assert (
        tau.set_index("measure").loc["geodesic_mix", "tau"]
        == document["tau"]["geodesic_mix"]["tau"]
    )
