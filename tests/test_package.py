"""The package's namespace: lazy subpackages, the engine's discovery, moved paths, extras."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import geoopt_quotient as gq
from geoopt_quotient.sharpness import measure as measure_module

LAZY = ("nn", "optim", "testing", "experiments", "integrations")


def test_subpackages_load_on_first_attribute_access():
    code = (
        "import sys, geoopt_quotient as gq\n"
        f"lazy = {LAZY!r}\n"
        "assert not [n for n in lazy if 'geoopt_quotient.' + n in sys.modules], sys.modules\n"
        "gq.nn.FactorizedLinear, gq.optim.GeodesicSAM, gq.testing.assert_invariant\n"
        "gq.experiments.population.run_population, gq.integrations.SharpnessMonitor\n"
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
        "loaded = [m for m in sys.modules if m.startswith('geoopt_quotient.')]\n"
        "assert loaded == ['geoopt_quotient._moved'], loaded  # the finder of moved paths\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_export_is_reachable_and_listed():
    for name in gq.__all__:
        assert getattr(gq, name) is not None
        assert name in dir(gq)


def test_engine_discovers_with_find_symmetries(monkeypatch):
    """``symmetries=None`` asks :func:`find_symmetries`, with the measure's metric and eps."""
    calls = []

    def spy(model, **kwargs):
        calls.append(kwargs)
        return gq.SymmetryPlan([])

    monkeypatch.setattr(measure_module, "find_symmetries", spy)
    measure_module.resolve_plan(torch.nn.Linear(2, 2), None, "inv", 0.25)
    assert [(c["metric"], c["eps"]) for c in calls] == [("inv", 0.25)]


def test_engine_alone_discovers_the_symmetries():
    code = (
        "import sys, torch\n"
        "from geoopt_quotient.sharpness import measure\n"
        "bound = measure.resolve_plan(torch.nn.MultiheadAttention(8, 2), None, 'mix')\n"
        "assert len(bound.symmetric_groups) == 2, bound\n"
        "above = ('geoopt_quotient.experiments', 'geoopt_quotient.cli')\n"
        "assert not [m for m in sys.modules if m.startswith(above)]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("geoopt_quotient.models", "geoopt_quotient.symmetry"),
        ("geoopt_quotient.models.huggingface", "geoopt_quotient.symmetry.huggingface"),
        ("geoopt_quotient.models.images", "geoopt_quotient.experiments.images"),
        ("geoopt_quotient.sharpness.plan", "geoopt_quotient.symmetry.plan"),
        ("geoopt_quotient.diagonal.train", "geoopt_quotient.experiments.diagonal.train"),
        ("geoopt_quotient.population", "geoopt_quotient.experiments.population"),
        ("geoopt_quotient.classifiers", "geoopt_quotient.experiments.classifiers"),
    ],
)
def test_moved_module_paths_import_the_new_module_with_a_warning(old, new):
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({new!r})\n"
        "assert old is new and new.__spec__.name == new.__name__, (old, new.__spec__)\n"
        f"assert any({old!r} in str(w.message) and w.category is FutureWarning for w in caught)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_moved_names_are_found_with_a_warning():
    from geoopt_quotient.experiments.figures import sharpness_scatter
    from geoopt_quotient.symmetry import SymmetryPlan

    with pytest.warns(FutureWarning, match="moved to geoopt_quotient.symmetry.plan"):
        assert gq.sharpness.__getattr__("SymmetryPlan") is SymmetryPlan
    with pytest.warns(FutureWarning, match="experiments.figures"):
        assert gq.sharpness.stats.__getattr__("sharpness_scatter") is sharpness_scatter
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        gq.sharpness.__getattr__("nonexistent")


def test_the_library_imports_without_the_experiment_extras():
    """Without matplotlib, scikit-learn and Pillow (blocked here), the library works and an
    experiment command fails with one line that names the extra."""
    code = (
        "import sys\n"
        "for name in ('matplotlib', 'sklearn', 'PIL'):\n"
        "    sys.modules[name] = None  # import fails as if not installed\n"
        "import torch, geoopt_quotient as gq\n"
        "gq.geodesic_sharpness, gq.find_symmetries, gq.nn, gq.optim, gq.testing\n"
        "from geoopt_quotient.cli import main\n"
        "main(['reproduce', 'diagonal', '--models', '2', '--out', 'unused'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "pip install -e '.[experiments]' in the clone of geoopt-quotient" in lines[0]
    assert "geoopt-quotient[" not in lines[0]  # no index has the package
    assert "matplotlib" in lines[0]


def test_the_trainer_integration_has_its_dependency_in_an_extra():
    """``transformers.Trainer`` needs accelerate: the ``integrations`` extra installs it,
    and the test suite's extras include it (its Trainer tests need it)."""
    import configparser
    from pathlib import Path

    from geoopt_quotient._extras import EXTRAS, MissingExtraError, require

    parser = configparser.ConfigParser()
    parser.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    extras = {k: v.split() for k, v in parser["options.extras_require"].items()}
    for extra in ("integrations", "test", "dev"):
        assert any(r.startswith("accelerate") for r in extras[extra]), extra
    assert EXTRAS["accelerate"][0] == "integrations"
    with pytest.raises(MissingExtraError, match=r"pip install -e '\.\[testing\]' in the clone"):
        require("hypothesis.nonexistent_module", "the testing kit")


def test_the_command_lines_help_imports_nothing_heavy():
    """``geoopt-quotient --help`` reads the commands' help lines from their sources: no
    torch, no command module imported (4 s before; 0.06 s after, on the CI machine)."""
    code = (
        "import sys\n"
        "from geoopt_quotient.cli import main\n"
        "for argv in (['--help'], ['--version'], ['nonexistent'], []):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'geoopt_quotient.cli.sharpness')\n"
        "         if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "population" in result.stdout and "invalid choice: 'nonexistent'" in result.stderr


def test_the_help_lines_read_from_the_sources_are_the_commands_own():
    import argparse

    from geoopt_quotient import cli

    full = cli.build_parser()
    action = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    registered = {choice.dest: choice.help for choice in action._choices_actions}
    assert cli.command_summaries(cli) == registered
    assert sorted(registered) == ["population", "reproduce", "sharpness"]


def test_the_version_is_the_same_everywhere():
    """The package, the citation file and the changelog's latest release agree."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    citation = re.search(r"^version: (\S+)$", (root / "CITATION.cff").read_text(), re.M)
    changelog = (root / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\d+\.\d+\.\d+)$", changelog, re.M)
    assert citation.group(1) == gq.__version__ == releases[0]
    assert changelog.index("## Unreleased") < changelog.index(f"## {gq.__version__}")
    assert len(changelog.splitlines()) <= 300  # a changelog, not a lab notebook
