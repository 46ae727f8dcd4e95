"""The package's base exception and base warning.

Every exception the package raises on purpose derives from :class:`GeooptQuotientError`
(and, where one fits, from the built-in it refines, e.g. ``ValueError``), and every
warning it issues from :class:`GeooptQuotientWarning`; so one ``except`` clause or one
warnings filter covers them all:

>>> import warnings
>>> import geoopt_quotient as gq
>>> issubclass(gq.PlanError, gq.GeooptQuotientError) and issubclass(gq.PlanError, ValueError)
True
>>> warnings.simplefilter("error", gq.GeooptQuotientWarning)  # every warning of the package
>>> warnings.resetwarnings()

This module imports nothing: the lowest layer of the package, below
:mod:`~geoopt_quotient.manifolds`.
"""

__all__ = ["GeooptQuotientError", "GeooptQuotientWarning"]


class GeooptQuotientError(Exception):
    """Base class of the exceptions of ``geoopt_quotient``."""


class GeooptQuotientWarning(Warning):
    """Base class of the warnings of ``geoopt_quotient``."""
