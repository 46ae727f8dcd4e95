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


def test_import_loads_nothing_heavy():
    code = (
        "import sys, geoopt_quotient\n"
        "heavy = ['torch', 'geoopt', 'numpy', 'scipy', 'transformers', 'matplotlib']\n"
        "assert not [m for m in heavy if m in sys.modules], sorted(sys.modules)\n"
        "assert not [m for m in sys.modules if m.startswith('geoopt_quotient.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_export_is_reachable_and_listed():
    for name in gq.__all__:
        assert getattr(gq, name) is not None
        assert name in dir(gq)


def test_engine_uses_the_installed_discovery(monkeypatch):
    find_symmetries = gq.find_symmetries  # importing models installs it
    assert plan_module._discovery is find_symmetries
    monkeypatch.setattr(plan_module, "_discovery", None)
    monkeypatch.setattr(plan_module, "DISCOVERY_ENTRY_POINTS", "no.such.group")
    with pytest.raises(gq.PlanError, match="symmetries=None"):
        plan_module.discover_symmetries(object(), metric="mix", eps=0.0)


def test_engine_alone_loads_the_discovery_from_its_entry_point():
    code = (
        "import sys, torch\n"
        "from geoopt_quotient.sharpness import geodesic_sharpness, plan\n"
        "assert 'geoopt_quotient.models' not in sys.modules\n"
        "found = plan.discover_symmetries(torch.nn.MultiheadAttention(8, 2), metric='mix', "
        "eps=0.0)\n"
        "assert len(found.groups) == 2, found\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
