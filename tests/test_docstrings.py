"""Every public callable has a numpydoc docstring, and the main entry points' examples run.

Public callables are the classes and functions named in the ``__all__`` of the modules
below (each object once, however often it is exported) that take arguments: a
function's parameters, a class's constructor arguments, a dataclass's fields. Each
needs a numpydoc ``Parameters`` section (a dataclass may describe its fields under
``Attributes`` instead); the docstrings must be valid reStructuredText once numpydoc
has turned them into Sphinx markup.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import io
import time
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch

numpydoc_docscrape = pytest.importorskip("numpydoc.docscrape")
NumpyDocString = numpydoc_docscrape.NumpyDocString

MODULES = (
    "geoopt_quotient",
    "geoopt_quotient.manifolds",
    "geoopt_quotient.symmetry",
    "geoopt_quotient.sharpness",
    "geoopt_quotient.sharpness.ranks",
    "geoopt_quotient.nn",
    "geoopt_quotient.optim",
    "geoopt_quotient.testing",
    "geoopt_quotient.testing.zoo",
    "geoopt_quotient.integrations",
    "geoopt_quotient.experiments.diagonal",
    "geoopt_quotient.experiments.population",
    "geoopt_quotient.experiments.figures",
    "geoopt_quotient.experiments.population.rho_grid",
    "geoopt_quotient.experiments.population.modular",
    "geoopt_quotient.experiments.population.rotary",
    "geoopt_quotient.sharpness.shares",
    "geoopt_quotient.sharpness.stats",
    "geoopt_quotient.experiments.records",
    "geoopt_quotient.experiments.classifiers",
    "geoopt_quotient.experiments.causal_lm",
    "geoopt_quotient.experiments.io",
    "geoopt_quotient.experiments.images",
    "geoopt_quotient.experiments.model_soups",
    "geoopt_quotient.cli",
)

#: The library proper (below the experiments and the command line): every public
#: callable defined there is documented.
LIBRARY = tuple(
    f"geoopt_quotient.{name}"
    for name in ("manifolds", "symmetry", "sharpness", "nn", "optim", "testing", "integrations")
)

#: The share of all public callables that must have the sections.
MIN_COVERAGE = 0.9

#: The main entry points: each has an ``Examples`` section whose doctests run here.
ENTRY_POINTS = (
    "geoopt_quotient.geodesic_sharpness",
    "geoopt_quotient.adaptive_sharpness",
    "geoopt_quotient.find_symmetries",
    "geoopt_quotient.GLQuotient",
    "geoopt_quotient.DiagonalQuotient",
    "geoopt_quotient.AdaptiveEuclidean",
    "geoopt_quotient.maximize_in_ball",
    "geoopt_quotient.calibrate_rho",
    "geoopt_quotient.hessian_trace",
    "geoopt_quotient.optim.GeodesicSAM",
    "geoopt_quotient.optim.SAMAscent",
    "geoopt_quotient.integrations.SharpnessMonitor",
    "geoopt_quotient.integrations.measure_during_training",
    "geoopt_quotient.kendall_tau",
)


def _exported_names(module: Any) -> List[str]:
    """``__all__``, and for the top level also its lazily imported ``EXPORTS``."""
    names = list(getattr(module, "__all__", ()))
    names += [n for n in getattr(module, "EXPORTS", {}) if n not in names]
    return names


def _takes_arguments(obj: Any) -> bool:
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        return bool(dataclasses.fields(obj))
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):  # e.g. exceptions with the builtin constructor
        return False
    if inspect.isclass(obj):  # a constructor that only passes ``**kwargs`` on takes none
        named = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        return any(p.kind not in named for p in parameters)
    return bool(parameters)


def public_callables() -> Dict[str, Any]:
    """``{exporting module.name: object}``, each object once (first export wins)."""
    found: Dict[str, Any] = {}
    seen = set()
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in _exported_names(module):
            obj = getattr(module, name)  # resolves lazily exported names
            if not (inspect.isclass(obj) or inspect.isroutine(obj)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            if _takes_arguments(obj):
                found[f"{module_name}.{name}"] = obj
    return found


def _docstrings(obj: Any) -> List[str]:
    """The docstring, and for a class also that of its own ``__init__``."""
    texts = [inspect.getdoc(obj) or ""]
    init = vars(obj).get("__init__") if inspect.isclass(obj) else None
    if init is not None and init.__doc__:
        texts.append(inspect.getdoc(init))
    return texts


def has_parameters(obj: Any) -> bool:
    docs = [NumpyDocString(text) for text in _docstrings(obj)]
    if any(doc["Parameters"] or doc["Other Parameters"] for doc in docs):
        return True
    dataclass = inspect.isclass(obj) and dataclasses.is_dataclass(obj)
    return dataclass and bool(docs[0]["Attributes"])


def _defining_module(obj: Any) -> str:
    return getattr(inspect.unwrap(obj), "__module__", "") or ""


PUBLIC = public_callables()


def test_public_callables_are_collected():
    """The walk finds the package's main names (lazy top-level exports included)."""
    assert len(PUBLIC) > 100
    objects = list(PUBLIC.values())
    for name in ("geodesic_sharpness", "GLQuotient", "GeodesicSAM", "run_population"):
        assert any(getattr(obj, "__name__", "") == name for obj in objects), name
    assert len({id(obj) for obj in objects}) == len(objects)


def test_most_public_callables_document_their_parameters():
    missing = sorted(name for name, obj in PUBLIC.items() if not has_parameters(obj))
    coverage = 1 - len(missing) / len(PUBLIC)
    assert coverage >= MIN_COVERAGE, (
        f"{coverage:.0%} of {len(PUBLIC)} public callables have a numpydoc Parameters "
        f"section (Attributes for dataclasses); missing: {missing}"
    )


def test_every_library_callable_documents_its_parameters():
    library = {
        name: obj
        for name, obj in PUBLIC.items()
        if _defining_module(obj).startswith(LIBRARY) or name.rpartition(".")[0] in LIBRARY
    }
    assert library
    missing = sorted(name for name, obj in library.items() if not has_parameters(obj))
    assert not missing, f"no numpydoc Parameters (or Attributes) section: {missing}"


def _documented_names(obj: Any) -> set:
    names = set()
    for text in _docstrings(obj):
        doc = NumpyDocString(text)
        for section in ("Parameters", "Other Parameters", "Attributes"):
            for entry in doc[section]:
                names.update(n.strip().lstrip("*") for n in entry.name.split(","))
    return names


def _argument_names(obj: Any) -> List[str]:
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return [n for n in inspect.signature(obj).parameters if n != "self"]


def test_documented_parameters_match_the_signatures():
    """Every argument (dataclass field) is documented; a function documents no other."""
    problems = []
    for name, obj in PUBLIC.items():
        if not has_parameters(obj):
            continue
        documented, arguments = _documented_names(obj), _argument_names(obj)
        missing = [a for a in arguments if a not in documented]
        stale = [] if inspect.isclass(obj) else sorted(documented - set(arguments))
        if missing or stale:
            problems.append(f"{name}: undocumented {missing}, not arguments {stale}")
    assert not problems, "\n".join(problems)


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_entry_points_have_examples(path):
    doc = NumpyDocString(inspect.getdoc(_resolve(path)) or "")
    assert doc["Examples"], f"{path} has no Examples section"


def test_geodesic_sharpness_documents_what_it_returns():
    doc = NumpyDocString(inspect.getdoc(_resolve("geoopt_quotient.geodesic_sharpness")))
    assert doc["Returns"]


def _run_doctests(path: str) -> Tuple[doctest.TestResults, str, float]:
    obj = _resolve(path)
    tests = doctest.DocTestFinder(recurse=False).find(obj, path.rpartition(".")[2], globs={})
    assert tests and any(t.examples for t in tests), f"{path}: no doctest found"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: List[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the examples' values must not depend on the thread count
    start = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[]):  # they seed torch: leave others' RNG alone
            for test in tests:
                runner.run(test, out=report.append, clear_globs=True)
    finally:
        torch.set_num_threads(threads)
    return runner.summarize(verbose=False), "".join(report), time.perf_counter() - start


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_entry_point_examples_run(path):
    results, report, _ = _run_doctests(path)
    assert results.attempted > 0
    assert results.failed == 0, report


# ------------------------------------------------------------------ reStructuredText


def _sphinx_markup() -> None:
    """Register Sphinx's roles, and the ``only`` directive numpydoc writes, with plain
    docutils: cross-reference targets are not checked here, only that the markup around
    them parses."""
    from docutils import nodes
    from docutils.parsers.rst import Directive, directives, roles

    def role(name, rawtext, text, lineno, inliner, options=None, content=None):
        return [nodes.literal(rawtext, text)], []

    for name in ("attr", "class", "data", "exc", "func", "meth", "mod", "obj", "cite", "ref"):
        roles.register_local_role(name, role)
        roles.register_local_role(f"py:{name}", role)

    class Only(Directive):
        required_arguments = 1
        final_argument_whitespace = True
        has_content = True

        def run(self):
            node = nodes.container()
            self.state.nested_parse(self.content, self.content_offset, node)
            return [node]

    directives.register_directive("only", Only)


def rst_problems(obj: Any) -> List[str]:
    """docutils' warnings and errors for the Sphinx markup numpydoc makes of ``obj``'s
    docstring (and of its class's ``__init__``)."""
    import docutils.core
    import docutils.utils
    from numpydoc.docscrape_sphinx import SphinxDocString

    _sphinx_markup()
    problems = []
    for raw in _docstrings(obj):
        with warnings.catch_warnings(record=True) as caught:  # numpydoc's own complaints
            warnings.simplefilter("always")
            text = str(SphinxDocString(raw))
        problems.extend(f"numpydoc: {w.message}" for w in caught)
        stream = io.StringIO()
        docutils.core.publish_doctree(
            text,
            settings_overrides={
                "report_level": docutils.utils.Reporter.WARNING_LEVEL,
                "halt_level": docutils.utils.Reporter.SEVERE_LEVEL + 1,
                "warning_stream": stream,
            },
        )
        problems.extend(line for line in stream.getvalue().splitlines() if line.strip())
    return problems


def test_docstrings_are_valid_restructuredtext():
    pytest.importorskip("docutils")
    bad = {name: rst_problems(obj) for name, obj in PUBLIC.items()}
    bad = {name: problems for name, problems in bad.items() if problems}
    assert not bad, "\n".join(f"{name}: {problems}" for name, problems in bad.items())
