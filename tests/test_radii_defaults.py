"""One table of default radii: the Python API and the CLI agree on every measure's default."""

from __future__ import annotations

import math

import pytest
import torch

import geoopt_quotient as gq
from geoopt_quotient.cli import build_parser
from geoopt_quotient.cli._runtime import radii_from_args
from geoopt_quotient.cli.population import settings_from_args
from geoopt_quotient.experiments.population import StudySettings
from geoopt_quotient.sharpness import DEFAULT_RADII, calibrate_rho, default_radius

RADIUS_KEYS = {"adaptive": "rho_adaptive", "inv": "rho_inv", "mix": "rho_mix"}


def expected_cli_radii() -> dict:
    return {RADIUS_KEYS[m]: r for m, r in DEFAULT_RADII.items()}


def test_table_has_one_radius_per_measure_and_is_read_only():
    assert set(DEFAULT_RADII) == {"adaptive", "inv", "mix"}
    assert all(r > 0 and math.isfinite(r) for r in DEFAULT_RADII.values())
    # the balls are on different scales, each default set on its own (inv and mix happen to
    # share a round value): the table is not one radius for all
    assert len(set(DEFAULT_RADII.values())) > 1
    with pytest.raises(TypeError):
        DEFAULT_RADII["mix"] = 1.0  # type: ignore[index]
    with pytest.raises(ValueError, match="unknown `measure`"):
        default_radius("geodesic")


def test_sharpness_command_defaults_are_the_table():
    args = build_parser().parse_args(["sharpness", "--model", "m", "--data", "d"])
    assert radii_from_args(args, StudySettings()) == expected_cli_radii()
    # and --help shows them
    help_text = build_parser()._subparsers._group_actions[0].choices["sharpness"].format_help()
    for measure, radius in DEFAULT_RADII.items():
        assert f"radius of the {'geodesic ' if measure != 'adaptive' else ''}{measure} ball" in (
            " ".join(help_text.split())
        )
        assert f"(default {radius})" in help_text


def test_population_command_defaults_are_the_table():
    args = build_parser().parse_args(["population", "--checkpoints", "c"])
    settings = settings_from_args(args, StudySettings())
    radii = {k: getattr(settings, k) for k in RADIUS_KEYS.values()}
    assert radii == expected_cli_radii()


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))


def quadratic(model, batch):
    return (model.w * batch).square().sum()


def test_api_defaults_are_the_table():
    model, batches = Linear(), [torch.tensor([1.0, 0.5], dtype=torch.float64)]
    result = gq.adaptive_sharpness(model, quadratic, batches, iters=2)
    assert result.settings["rho"] == DEFAULT_RADII["adaptive"]
    for metric in ("inv", "mix"):
        result = gq.geodesic_sharpness(model, quadratic, batches, metric=metric, iters=2)
        assert result.settings["rho"] == DEFAULT_RADII[metric]
    # calibrate_rho starts every measure's search at its default radius
    _, history = calibrate_rho(
        model, quadratic, batches, target=0.5, measure="adaptive", iters=3, return_history=True
    )
    assert history[0].rho == DEFAULT_RADII["adaptive"]


def test_api_and_cli_defaults_agree():
    args = build_parser().parse_args(["sharpness", "--model", "m", "--data", "d"])
    cli = radii_from_args(args, StudySettings())
    api = {RADIUS_KEYS[m]: default_radius(m) for m in RADIUS_KEYS}
    assert cli == api
