"""Module paths and names that moved, kept importable with a :class:`FutureWarning`.

Release 0.2.0 separated the library from the paper's experiments: symmetry discovery
moved from ``geoopt_quotient.models`` to :mod:`geoopt_quotient.symmetry`, the plan data
model from ``geoopt_quotient.sharpness.plan`` to :mod:`geoopt_quotient.symmetry.plan`, and
the experiments (diagonal networks, population studies, checkpoints, records, figures)
to :mod:`geoopt_quotient.experiments`. An old module path imports the new module itself
(the same object, so patching either patches both) and warns once per path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Dict

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "install", "moved_attribute"]

_PACKAGE = __name__.rpartition(".")[0]


def _modules() -> Dict[str, str]:
    moves = {"models": "symmetry", "sharpness.plan": "symmetry.plan"}
    moves["sharpness.strided"] = "symmetry.strided"
    for name in ("huggingface", "layouts", "lora", "torch_nn", "verify"):
        moves[f"models.{name}"] = f"symmetry.{name}"
    for name in ("images", "model_soups"):
        moves[f"models.{name}"] = f"experiments.{name}"
    for name in ("classifiers", "io", "records", "diagonal", "population"):
        moves[name] = f"experiments.{name}"
    for name in ("analytic", "data", "experiment", "train"):
        moves[f"diagonal.{name}"] = f"experiments.diagonal.{name}"
    for name in ("digits", "rho_grid", "study"):
        moves[f"population.{name}"] = f"experiments.population.{name}"
    return {f"{_PACKAGE}.{old}": f"{_PACKAGE}.{new}" for old, new in moves.items()}


#: Old module path -> the module that replaced it.
MOVED_MODULES: Dict[str, str] = _modules()

_FIGURES = f"{_PACKAGE}.experiments.figures"
_PLAN = f"{_PACKAGE}.symmetry.plan"

#: Module -> {name that left it: the module that defines it now}.
MOVED_NAMES: Dict[str, Dict[str, str]] = {
    f"{_PACKAGE}.sharpness": {
        **dict.fromkeys(("BoundPlan", "PlanError", "SymmetryGroup", "SymmetryPlan"), _PLAN),
        "sharpness_scatter": _FIGURES,
    },
    f"{_PACKAGE}.sharpness.stats": {"sharpness_scatter": _FIGURES},
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old path will be removed in a future release",
        FutureWarning,
        stacklevel=stacklevel + 1,
    )


def moved_attribute(module: str, name: str) -> object:
    """``name`` of ``module`` where it moved to (with a warning), for a module ``__getattr__``."""
    target = MOVED_NAMES.get(module, {}).get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{target}.{name}", stacklevel=3)
    value = getattr(importlib.import_module(target), name)
    setattr(sys.modules[module], name, value)  # warn once
    return value


class _Alias(importlib.abc.Loader):
    """Loads an old module path as the module that replaced it."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new, stacklevel=2)
        self.module = importlib.import_module(self.new)
        self.spec = self.module.__spec__
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set it to the old path's spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        is_package = any(other.startswith(fullname + ".") for other in MOVED_MODULES)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), is_package=is_package)


def install() -> None:
    """Put the finder of moved modules on :data:`sys.meta_path` (once)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
