"""The one vocabulary of sharpness measures: every name the package uses parses to a
:class:`~geoopt_quotient.Measure`, and names round-trip."""

from __future__ import annotations

import pytest

import geoopt_quotient as gq
from geoopt_quotient import measures
from geoopt_quotient.measures import ABLATIONS, MEASURES, NAMED_MEASURES, Measure

#: Every name in use before the vocabulary was one class, and its measure.
KNOWN = {
    "adaptive": Measure(),
    "geodesic_inv": Measure("inv"),
    "geodesic_mix": Measure("mix"),
    "inv": Measure("inv"),
    "mix": Measure("mix"),
    "geodesic_inv_no_norm": Measure("inv", norm=False),
    "geodesic_mix_no_norm": Measure("mix", norm=False),
    "geodesic_inv_no_curvature": Measure("inv", curvature=False),
    "geodesic_mix_no_curvature": Measure("mix", curvature=False),
    "inv_second_order": Measure("inv", "second_order"),
    "mix_second_order": Measure("mix", "second_order"),
    "mix_unclamped": Measure("mix", clamped=False),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_every_name_in_use_parses_and_round_trips(name):
    measure = Measure.parse(name)
    assert measure == KNOWN[name]
    assert Measure.parse(measure.name) == measure
    assert name in (measure.name, None if measure.is_ablation else measure.short_name)


def test_every_name_round_trips():
    for name in measures.names():
        measure = Measure.parse(name)
        assert Measure.parse(measure.name) == measure
        assert Measure.parse(measure) is measure


def test_the_name_tuples_are_the_vocabulary():
    assert MEASURES == ("adaptive", "inv", "mix")
    assert NAMED_MEASURES == ("adaptive", "geodesic_inv", "geodesic_mix")
    assert ABLATIONS == (
        "geodesic_inv_no_norm",
        "geodesic_inv_no_curvature",
        "geodesic_mix_no_norm",
        "geodesic_mix_no_curvature",
    )
    assert gq.Measure is Measure


def test_ball_and_path_of_each_measure():
    assert [Measure.parse(m).ball for m in NAMED_MEASURES + ABLATIONS] == [
        "adaptive",
        "inv",
        "mix",
        "adaptive",
        "inv",
        "adaptive",
        "mix",
    ]
    straight = [m for m in NAMED_MEASURES + ABLATIONS if Measure.parse(m).straight]
    assert straight == ["adaptive", "geodesic_inv_no_curvature", "geodesic_mix_no_curvature"]


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown measure 'geodesic'.*'geodesic_mix_no_norm'"):
        Measure.parse("geodesic")
    with pytest.raises(TypeError, match="must be a string"):
        Measure.parse(3)
    with pytest.raises(ValueError, match="no short name"):
        _ = Measure("inv", norm=False).short_name


@pytest.mark.parametrize(
    "fields",
    [
        dict(metric="bad"),
        dict(metric=None, path="exact"),
        dict(metric=None, norm=False),
        dict(metric="inv", path="straight"),
        dict(metric="inv", path="exact", norm=False),
        dict(metric="inv", norm=False, curvature=False),
        dict(metric="inv", clamped=False),
    ],
)
def test_measures_that_do_not_exist_are_refused(fields):
    with pytest.raises(ValueError):
        Measure(**fields)
