"""One base exception and one base warning: every public one of the package derives from them."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings
from typing import Iterator, List, Type

import pytest

import geoopt_quotient as gq
from geoopt_quotient.errors import GeooptQuotientError, GeooptQuotientWarning


def package_modules() -> Iterator[str]:
    """Every module of the package, by its file (not the old names kept for moved paths)."""
    yield gq.__name__
    for info in pkgutil.walk_packages(gq.__path__, prefix=f"{gq.__name__}."):
        yield info.name


def public_exceptions(module_names) -> List[Type[BaseException]]:
    """The public exception and warning classes that the named modules define."""
    found = []
    for name in module_names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not attribute.startswith("_")
            ):
                found.append(value)
    return found


def unrooted(classes) -> List[str]:
    """The classes of ``classes`` that derive from neither base of the package."""
    bases = (GeooptQuotientError, GeooptQuotientWarning)
    return [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, bases)]


def test_every_public_exception_and_warning_derives_from_the_package_bases():
    classes = public_exceptions(package_modules())
    assert len(classes) >= 17, classes  # the walk found the package's classes
    assert unrooted(classes) == []


def test_the_check_flags_a_class_outside_the_hierarchy():
    class Stray(ValueError):
        pass

    assert unrooted([Stray, gq.PlanError]) == [f"{__name__}.{Stray.__qualname__}"]


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("PlanError", ValueError),
        ("SymmetryVerificationError", ValueError),
        ("GeodesicDomainError", ValueError),
        ("NonFiniteError", FloatingPointError),
        ("LossFnError", RuntimeError),
        ("StaleParameterError", RuntimeError),
        ("ZeroSharpnessWarning", UserWarning),
        ("PathGapWarning", UserWarning),
        ("GeodesicEqualsAdaptiveWarning", UserWarning),
    ],
)
def test_the_classes_keep_their_builtin_bases(name, builtin):
    """``except ValueError`` and the like still catch what they caught."""
    cls = getattr(gq, name)
    assert issubclass(cls, builtin)
    assert issubclass(cls, (GeooptQuotientError, GeooptQuotientWarning))


def test_the_bases_separate_errors_from_warnings():
    assert not issubclass(GeooptQuotientWarning, GeooptQuotientError)
    assert not issubclass(GeooptQuotientError, Warning)
    assert gq.GeooptQuotientError is GeooptQuotientError
    assert gq.errors.GeooptQuotientWarning is GeooptQuotientWarning
    with pytest.raises(GeooptQuotientError):
        raise gq.PlanError("caught by the base")
