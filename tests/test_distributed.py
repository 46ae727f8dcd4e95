"""The older mode of sharding batches over torch.distributed ranks, ``distributed=``, where
every rank passes all batches. Its two-process run shares the ranks spawned by
test_process_group.py (one spawn for all multi-process checks)."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyTransformer, cross_entropy_loss

from geoopt_quotient import adaptive_sharpness


def make_problem():
    torch.manual_seed(0)
    model = TinyTransformer().double()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 11, (20, 6), generator=g)
    labels = torch.randint(0, 2, (20,), generator=g)
    batches = [(tokens[i : i + 4], labels[i : i + 4]) for i in range(0, 20, 4)]  # 5 batches
    return model, batches


def test_distributed_without_a_process_group_is_an_error():
    model, batches = make_problem()
    with pytest.raises(RuntimeError, match="process group"):
        adaptive_sharpness(model, cross_entropy_loss, batches[:1], rho=0.1, distributed=True)
