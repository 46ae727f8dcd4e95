"""Optional dependencies: import them, or say which extra of the package installs them."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict, Sequence

from .errors import GeooptQuotientError

__all__ = ["EXTRAS", "MissingExtraError", "require", "require_all"]

#: The extra that installs each optional top-level module, and the module's package name.
EXTRAS: Dict[str, tuple] = {
    "matplotlib": ("experiments", "matplotlib"),
    "sklearn": ("experiments", "scikit-learn"),
    "PIL": ("experiments", "Pillow"),
    "pandas": ("experiments", "pandas"),
    "hypothesis": ("testing", "hypothesis"),
    "accelerate": ("integrations", "accelerate"),
}


class MissingExtraError(GeooptQuotientError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (e.g. ``"matplotlib.figure"``) for ``purpose``, or raise
    :class:`MissingExtraError` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtraError(_message([module], purpose)) from error


def require_all(modules: Sequence[str], purpose: str) -> None:
    """Import every one of ``modules``, or raise one :class:`MissingExtraError` naming them all."""
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise MissingExtraError(_message(missing, purpose))


def _message(modules: Sequence[str], purpose: str) -> str:
    roots = [m.split(".")[0] for m in modules]
    extras = sorted({EXTRAS.get(r, ("experiments", r))[0] for r in roots})
    names = list(dict.fromkeys(EXTRAS.get(r, ("", r))[1] for r in roots))
    wanted = ",".join(extras)
    return (
        f"{purpose} needs {', '.join(names)}, which the '{wanted}' extra installs: "
        f"pip install -e '.[{wanted}]' in the clone of geoopt-quotient "
        f"(or pip install {' '.join(names)})"
    )
