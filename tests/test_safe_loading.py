"""Checkpoints load without running code."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from geoopt_quotient.experiments.io import UnsafeCheckpointError, find_weights, load_state_dict


class Payload:
    """Unpickling this runs ``os.system``: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "model.pt"
    with open(path, "wb") as f:
        pickle.dump({"weight": torch.ones(2), "evil": Payload(marker)}, f, protocol=2)
    with pytest.raises(UnsafeCheckpointError, match="refused"):
        load_state_dict(path)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError):  # the same file through torch.save's format
        torch.save({"weight": torch.ones(2), "evil": Payload(marker)}, path)
        load_state_dict(path)
    assert not marker.exists()


def test_plain_checkpoints_load(tmp_path):
    state = {"a": torch.randn(3, 2), "b": torch.arange(4)}
    torch.save(state, tmp_path / "w.pt")
    save_file(state, str(tmp_path / "w.safetensors"))
    for name in ("w.pt", "w.safetensors"):
        loaded = load_state_dict(tmp_path / name)
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert find_weights(tmp_path).name == "w.safetensors"


def test_directory_without_weights_is_reported(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights"):
        find_weights(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        load_state_dict(tmp_path / "missing.pt")
