"""Smoke run of sharpness on an FSDP2-sharded model under torchrun, against one process.

Every rank builds the same tiny float64 Llama, measures it unsharded on the whole batches
(the reference), then wraps each decoder layer and the root with ``fully_shard`` and
measures it with its rows of every batch; the values must agree to 1e-8 relative, be the
same on every rank, and leave the local shards bitwise unchanged. Exit status 1 otherwise.
On CUDA it uses NCCL and the rank's local device (a 1-GPU run is the NCCL smoke test of
the sharded code path); on the CPU, gloo. No timing.

    torchrun --nproc_per_node 1 benchmarks/smoke_fsdp.py --device cuda
    torchrun --nproc_per_node 2 benchmarks/smoke_fsdp.py --device cpu
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

from geoopt_quotient import adaptive_sharpness, geodesic_sharpness

ROWS = 2  # per rank and batch


def build(device: torch.device) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=24,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.float64)


def loss_fn(model, ids):
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def measure(model, batches, which: str) -> float:
    if which == "adaptive":
        return adaptive_sharpness(model, loss_fn, batches, rho=0.05, iters=5).value
    return geodesic_sharpness(model, loss_fn, batches, rho=0.05, iters=5, metric=which).value


def main(argv=None) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 50, (world * ROWS, 6), generator=g) for _ in range(2)]
        batches = [b.to(device) for b in batches]
        local = [b[rank * ROWS : (rank + 1) * ROWS] for b in batches]
        reference = build(device)
        mesh = init_device_mesh(args.device, (world,))
        model = build(device)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        before = [p.to_local().clone() for p in model.parameters()]
        ok = True
        for which in ("adaptive", "inv", "mix"):
            expected = measure(reference, batches, which)
            value = measure(model, local, which)
            values = [None] * world
            dist.all_gather_object(values, value)
            agree = math.isclose(value, expected, rel_tol=1e-8) and len(set(values)) == 1
            ok &= agree
            if rank == 0:
                print(f"{which:9s} sharded {value:.15g} one process {expected:.15g} ok={agree}")
        unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
        ok &= unchanged
        if rank == 0:
            print(f"{world} ranks on {device.type}: parameters unchanged={unchanged}; ok={ok}")
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
