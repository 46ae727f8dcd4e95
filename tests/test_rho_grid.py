"""Kendall's tau as a function of the radius: records, table, figure, argument type."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from geoopt_quotient._checks import STRAIGHT
from geoopt_quotient.experiments.population.rho_grid import (
    RhoSeries,
    format_tau_by_rho,
    parse_rho_scales,
    tau_by_rho,
    tau_by_rho_figure,
)
from geoopt_quotient.sharpness.stats import kendall_tau

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _series(models: int = 12):
    rng = np.random.default_rng(0)
    target = rng.random(models)
    series = []
    for measure, path, sign in (("adaptive", STRAIGHT, 1), ("inv", "exact", -1)):
        for scale in (0.5, 1.0, 2.0):
            values = sign * target + scale * rng.random(models)
            series.append(RhoSeries(scale, 0.1 * scale, measure, path, values.tolist()))
    return series, target.tolist()


def test_records_have_the_documented_fields_and_kendall_tau():
    series, target = _series()
    records = tau_by_rho(series, target, resamples=200)
    assert len(records) == len(series)
    for record, item in zip(records, series):
        assert set(record) == {"scale", "rho", "measure", "path", "tau", "ci"}
        assert (record["scale"], record["rho"]) == (item.scale, item.rho)
        assert (record["measure"], record["path"]) == (item.measure, item.path)
        assert record["tau"] == kendall_tau(item.values, target)[0]
        low, high = record["ci"]
        assert -1 <= low <= high <= 1
    # a perfectly anti-ordered series has tau = -1 and an interval collapsed there
    reversed_order = RhoSeries(1.0, 0.1, "m", "exact", [-t for t in target])
    (exact,) = tau_by_rho([reversed_order], target, resamples=100)
    assert exact["tau"] == pytest.approx(-1.0, abs=1e-12)
    assert exact["ci"] == pytest.approx([-1.0, -1.0], abs=1e-12)


def test_records_refuse_repeats_and_wrong_lengths():
    series, target = _series()
    with pytest.raises(ValueError, match="given twice"):
        tau_by_rho([series[0], series[0]], target, resamples=10)
    with pytest.raises(ValueError, match="11 values for 12 models"):
        short = RhoSeries(1.0, 0.1, "inv", "exact", series[0].values[:11])
        tau_by_rho([short], target, resamples=10)


def test_table_and_figure(tmp_path):
    series, target = _series()
    records = tau_by_rho(series, target, resamples=100)
    text = format_tau_by_rho(records, reference={"inv": -0.83})
    for token in ("scale 0.5", "scale 1", "scale 2", "adaptive (straight), ρ₁ = 0.1", "-0.83"):
        assert token in text
    inv_row = next(line for line in text.splitlines() if line.startswith("inv (exact)"))
    assert inv_row.count("[") == 3  # one interval per scale
    path = tau_by_rho_figure(records, str(tmp_path / "tau.png"), title="t", reference={"inv": -1})
    with open(path, "rb") as handle:
        assert handle.read(8) == PNG_MAGIC
    with pytest.raises(ValueError):
        format_tau_by_rho([])


@pytest.mark.parametrize(
    "text, expected",
    [("1", (1.0,)), ("2, 0.5,1", (0.5, 1.0, 2.0)), ("1e-1,4", (0.1, 4.0))],
)
def test_parse_rho_scales(text, expected):
    assert parse_rho_scales(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "comma-separated"),
        ("1,,2", "comma-separated"),
        ("a,1", "'a' is not a number"),
        ("0,1", "finite number > 0"),
        ("-1", "finite number > 0"),
        ("inf", "finite number > 0"),
        ("1,1.0", "repeated"),
    ],
)
def test_parse_rho_scales_refuses(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_rho_scales(text)
