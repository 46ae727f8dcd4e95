"""The documentation: every public name has an API entry, and the site builds without a
warning (its code examples run too)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"

#: Every module whose ``__all__`` is public API, documented in ``docs/api/``.
PUBLIC_MODULES = (
    "geoopt_quotient.errors",
    "geoopt_quotient.measures",
    "geoopt_quotient.manifolds",
    "geoopt_quotient.symmetry",
    "geoopt_quotient.sharpness",
    "geoopt_quotient.sharpness.ranks",
    "geoopt_quotient.nn",
    "geoopt_quotient.optim",
    "geoopt_quotient.testing",
    "geoopt_quotient.testing.zoo",
    "geoopt_quotient.integrations",
    "geoopt_quotient.cli",
    "geoopt_quotient.experiments.diagonal",
    "geoopt_quotient.experiments.population",
    "geoopt_quotient.experiments.population.rho_grid",
    "geoopt_quotient.experiments.population.modular",
    "geoopt_quotient.experiments.population.rotary",
    "geoopt_quotient.experiments.figures",
    "geoopt_quotient.experiments.records",
    "geoopt_quotient.experiments.classifiers",
    "geoopt_quotient.experiments.causal_lm",
    "geoopt_quotient.experiments.io",
    "geoopt_quotient.experiments.images",
    "geoopt_quotient.experiments.model_soups",
)

SPHINX_PACKAGES = (
    "sphinx",
    "numpydoc",
    "sphinx_gallery",
    "myst_parser",
    "sphinxcontrib.bibtex",
    "pydata_sphinx_theme",
    "sphinx_copybutton",
    "matplotlib",
)


def documented_names() -> tuple[set[str], set[str]]:
    """The fully qualified names listed in the API pages' autosummary tables, and the
    modules the pages document (``automodule``)."""
    names, modules = set(), set()
    for page in API.rglob("*.rst"):
        if "generated" in page.parts:
            continue
        module = None
        in_summary = False
        for line in page.read_text().splitlines():
            directive = re.match(r"\.\. (automodule|currentmodule|autosummary)::\s*(\S*)", line)
            if directive:
                kind, argument = directive.groups()
                if kind == "automodule":
                    modules.add(argument)
                if kind in ("automodule", "currentmodule"):
                    module = argument
                in_summary = kind == "autosummary"
                continue
            if not in_summary:
                continue
            entry = re.match(r"   (?!:)([A-Za-z_][\w.]*)\s*$", line)
            if entry:
                names.add(f"{module}.{entry.group(1)}")
            elif line.strip() and not line.startswith("   "):
                in_summary = False
    return names, modules


def public_names(module: str) -> list[str]:
    return [f"{module}.{name}" for name in importlib.import_module(module).__all__]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_has_an_api_entry(module):
    names, modules = documented_names()
    assert module in modules, f"no page of docs/api documents {module} (automodule)"
    missing = [name for name in public_names(module) if name not in names]
    assert not missing, f"public names without an entry in docs/api: {missing}"


def test_every_documented_name_is_public():
    names, _ = documented_names()
    public = {name for module in PUBLIC_MODULES for name in public_names(module)}
    assert not sorted(names - public), "docs/api lists names that are not in any __all__"


def test_every_subpackage_has_a_page():
    import geoopt_quotient
    import geoopt_quotient.experiments

    _, modules = documented_names()
    subpackages = [f"geoopt_quotient.{name}" for name in geoopt_quotient.SUBMODULES]
    subpackages += [
        f"geoopt_quotient.experiments.{name}" for name in geoopt_quotient.experiments.SUBMODULES
    ]
    assert not [m for m in subpackages if m not in modules]


def test_every_top_level_name_points_to_its_entry():
    import geoopt_quotient

    names, _ = documented_names()
    index = (API / "index.rst").read_text()
    for name in geoopt_quotient.__all__:
        target = f"geoopt_quotient.{geoopt_quotient.EXPORTS[name]}.{name}"
        assert f":obj:`{target}`" in index, f"docs/api/index.rst does not list {name}"
        assert target in names, f"{target} has no autosummary entry"


def sphinx(builder: str, out: Path, *options: str) -> subprocess.CompletedProcess:
    for package in SPHINX_PACKAGES:
        pytest.importorskip(package)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("GEOOPT_QUOTIENT_DOCS_INTERSPHINX", None)  # the build must not need the network
    command = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-b",
        builder,
        "-d",
        str(out / "doctrees"),
        *options,
        str(DOCS),
        str(out / builder),
    ]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path):
    """``python -m sphinx -W --keep-going -b html docs OUT``: no warning, and every public
    name is an object of the built inventory."""
    result = sphinx("html", tmp_path)
    assert result.returncode == 0 and "WARNING" not in result.stderr, result.stderr[-6000:]

    from sphinx.util.inventory import InventoryFile

    with open(tmp_path / "html" / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", os.path.join)
    objects = {
        name for kind, entries in inventory.items() if kind.startswith("py:") for name in entries
    }
    public = [name for module in PUBLIC_MODULES for name in public_names(module)]
    assert not [name for name in public if name not in objects]
    html = (tmp_path / "html" / "performance.html").read_text()
    assert "benchmarks/results/gpu/bench_cuda.json" in html  # the generated tables


@pytest.mark.slow
def test_docs_code_examples_run(tmp_path):
    """The pages' ``testcode`` blocks run and print what their ``testoutput`` says."""
    result = sphinx("doctest", tmp_path, "-D", "plot_gallery=0")
    report = (tmp_path / "doctest" / "output.txt").read_text() if result.returncode else ""
    assert result.returncode == 0, (result.stderr[-3000:], report[-6000:])
