"""The order of the gallery's examples: from the basics to the long scripts."""

from __future__ import annotations

from pathlib import Path

ORDER = (
    "plot_gl_quotient_basics.py",
    "plot_bert_sharpness.py",
    "plot_symmetry_discovery.py",
    "plot_benchmark_results.py",
    "lora_riemannian.py",
    "sam_digits.py",
    "trainer_bert_sam.py",
)


class ExampleOrder:
    """Sort key for ``sphinx_gallery_conf["within_subsection_order"]``: the examples
    of :data:`ORDER` first, in that order, then any other by file name."""

    def __init__(self, src_dir: str):
        self.src_dir = src_dir

    def __call__(self, filename: str) -> tuple:
        name = Path(filename).name
        return (ORDER.index(name), name) if name in ORDER else (len(ORDER), name)

    def __repr__(self) -> str:  # sphinx-gallery keys its cache on the configuration
        return "ExampleOrder"
