"""The Trainer example runs (--quick) and writes its figure and results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trainer_bert_sam.py"


def test_trainer_example_quick(tmp_path):
    subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    document = json.loads((tmp_path / "trainer_bert_sam.json").read_text())
    assert [run["method"] for run in document["runs"]] == ["adamw", "sam", "asam", "geodesic"]
    for run in document["runs"]:
        assert [s for s, _ in run["sharpness"]["geodesic_mix"]] == [3, 6]
    assert (tmp_path / "trainer_bert_sam.png").stat().st_size > 0
