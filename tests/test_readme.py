"""Every Python example in the README runs, also after the README's own install (no extras)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
#: The top-level modules of every extra: the README's install (`pip install -e .`) has none.
EXTRA_MODULES = ("matplotlib", "sklearn", "PIL", "hypothesis", "pytest", "peft")


def test_readme_has_examples():
    assert len(BLOCKS) >= 1


def test_readme_fits_on_a_screen():
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    """Each block in a fresh interpreter in which the extras' modules cannot be imported."""
    blocked = "".join(f"sys.modules[{name!r}] = None\n" for name in EXTRA_MODULES)
    code = f"import sys\n{blocked}import torch\ntorch.set_num_threads(1)\n{BLOCKS[index]}"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
