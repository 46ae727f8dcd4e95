"""Sphinx configuration of the geoopt-quotient documentation.

Build (from the repository root; warnings are errors)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The build needs no network. Intersphinx links to the documentation of Python, NumPy,
PyTorch, Geoopt and Transformers are made only where their inventories are at hand; see
``intersphinx_mapping`` below.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the package of this checkout, not another installed copy
sys.path.insert(0, str(DOCS / "_ext"))

import geoopt_quotient  # noqa: E402

# -- project -------------------------------------------------------------------------------

project = "geoopt-quotient"
author = "the geoopt-quotient authors"
copyright = "the geoopt-quotient authors"
version = release = geoopt_quotient.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.intersphinx",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
    "numpydoc",
    "myst_parser",
    "sphinx_copybutton",
    "sphinx_gallery.gen_gallery",
    "sphinxcontrib.bibtex",
    # local extensions (docs/_ext)
    "results_table",
    "project_directives",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = [
    "_build",
    "_templates",
    "**.ipynb_checkpoints",
    "auto_examples/*.ipynb",
    "auto_examples/*.py",
    "auto_examples/*.zip",
    "auto_examples/*.json",
    "auto_examples/*.md5",
]
default_role = "obj"
pygments_style = "sphinx"
# the changelog is written for a repository viewer: its links to files outside the
# documentation, and its heading levels, are not Sphinx's business
suppress_warnings = ["myst.xref_missing", "myst.header"]

# -- API reference -------------------------------------------------------------------------

autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "none"  # numpydoc's "Parameters" sections carry the types
autodoc_inherit_docstrings = False  # no docstrings of geoopt's or torch's base classes
numpydoc_show_class_members = False  # the class template lists the members
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# -- intersphinx, offline ------------------------------------------------------------------
#
# Intersphinx downloads each project's ``objects.inv`` when the build starts. The
# documentation must build, warnings as errors, where there is no network (CI, air-gapped
# machines), and Sphinx reports an unreachable inventory as a warning that no
# ``suppress_warnings`` entry can silence. So a project is put into ``intersphinx_mapping``
# only when its inventory can be had:
#
# * ``docs/_inventories/<name>.inv``, when such a file exists (a copy of the project's own
#   ``objects.inv``; none is shipped), is read locally;
# * with ``GEOOPT_QUOTIENT_DOCS_INTERSPHINX=1`` in the environment every inventory is
#   fetched from its site (a build for publishing, with network);
# * otherwise the project is left out, and references to it (``torch.Tensor``,
#   ``geoopt.ManifoldParameter``...) render as code without a link. Nothing is faked.
INTERSPHINX_SITES = {
    "python": "https://docs.python.org/3",
    "numpy": "https://numpy.org/doc/stable",
    "torch": "https://docs.pytorch.org/docs/stable",
    "geoopt": "https://geoopt.readthedocs.io/en/latest",
    "transformers": "https://huggingface.co/docs/transformers/main/en",
}
INVENTORIES = DOCS / "_inventories"
ONLINE = os.environ.get("GEOOPT_QUOTIENT_DOCS_INTERSPHINX") == "1"
intersphinx_mapping = {}
for _name, _site in INTERSPHINX_SITES.items():
    _local = INVENTORIES / f"{_name}.inv"
    if _local.is_file():
        intersphinx_mapping[_name] = (_site, str(_local))
    elif ONLINE:
        intersphinx_mapping[_name] = (_site, None)
intersphinx_timeout = 10

# -- bibliography --------------------------------------------------------------------------

bibtex_bibfiles = ["references.bib"]
bibtex_default_style = "plain"
bibtex_reference_style = "author_year"

# -- gallery -------------------------------------------------------------------------------
#
# Scripts named plot_*.py take a few seconds and run at every build (their output and
# figures are shown); the others (lora_riemannian.py, sam_digits.py: minutes of training)
# are rendered without running.
sphinx_gallery_conf = {
    "examples_dirs": str(ROOT / "examples"),
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"/_",
    "within_subsection_order": "gallery_order.ExampleOrder",
    "download_all_examples": False,
    "plot_gallery": "True",
    "remove_config_comments": True,
    "doc_module": ("geoopt_quotient",),
    "backreferences_dir": "gen_modules/backreferences",
    "reference_url": {"geoopt_quotient": None},
    "min_reported_time": 1,
    "show_memory": False,
    "show_signature": False,
    "image_scrapers": ("matplotlib",),
    "matplotlib_animations": False,
    "reset_modules": ("matplotlib", "seaborn"),
    "promote_jupyter_magic": False,
    "first_notebook_cell": None,
}

# -- doctest ---------------------------------------------------------------------------------

# only the testcode/testoutput blocks of the pages are run by the doctest builder, not
# ">>>" examples in docstrings (the test suite covers those where it wants them)
doctest_test_doctest_blocks = ""
doctest_global_setup = """
import torch
torch.set_num_threads(1)
"""

# -- math --------------------------------------------------------------------------------

mathjax3_config = {
    "tex": {
        "macros": {
            "GL": r"\mathrm{GL}",
            "tr": r"\operatorname{tr}",
        }
    }
}

# -- HTML ------------------------------------------------------------------------------------

html_theme = "pydata_sphinx_theme"
html_title = f"geoopt-quotient {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_show_sourcelink = False
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "header_links_before_dropdown": 7,
}
html_context = {"default_mode": "light"}
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True

# -- the benchmark tables (docs/_ext/results_table.py) ------------------------------------

benchmark_results_dir = str(ROOT / "benchmarks" / "results")
