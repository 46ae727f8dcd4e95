"""The package's namespace: lazy subpackages, discovery installed for the engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

import geoopt_quotient as gq
from geoopt_quotient.sharpness import plan as plan_module

LAZY = ("nn", "optim", "testing", "population")


def test_subpackages_load_on_first_attribute_access():
    code = (
        "import sys, geoopt_quotient as gq\n"
        f"lazy = {LAZY!r}\n"
        "assert not [n for n in lazy if 'geoopt_quotient.' + n in sys.modules], sys.modules\n"
        "gq.nn.FactorizedLinear, gq.optim.GeodesicSAM, gq.testing.assert_invariant\n"
        "gq.population.run_population\n"
        "assert all('geoopt_quotient.' + n in sys.modules for n in lazy)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", LAZY)
def test_lazy_subpackages_are_listed_and_reachable(name):
    assert name in dir(gq)
    assert getattr(gq, name).__name__ == f"geoopt_quotient.{name}"


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        gq.nonexistent  # noqa: B018


def test_engine_uses_the_installed_discovery(monkeypatch):
    assert plan_module._discovery is gq.find_symmetries
    monkeypatch.setattr(plan_module, "_discovery", None)
    with pytest.raises(gq.PlanError, match="symmetries=None"):
        plan_module.discover_symmetries(object(), metric="mix", eps=0.0)
